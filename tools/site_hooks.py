"""MkDocs hook (``hooks:`` in mkdocs.yml): the repository's address on the pages that say how to
install the package.

The address is the site setting ``repo_url`` (mkdocs.yml reads it from ``$REPO_URL``; the Pages
workflow sets it to the repository that publishes the site). A page writes

- ``{{ install_command }}``: one line that installs the package from the repository,
  ``pip install "vae-ddp @ git+<repo_url>"``;
- ``{{ clone_command }}``: one line that clones the repository and enters it (for what needs the
  repository's files: ``examples/``, the extras such as ``.[gallery]``);
- ``{{ repo_link }}``: a Markdown link to the repository;
- ``{{repo_url}}``: the repository's address alone, in an included file (the keep-it-fixed workflow's
  requirement, ``vae-ddp @ git+{{repo_url}}``), replaced in the page's HTML;
- ``{{ page_url }}``: the page's own address (``site_url`` and the page's URL; without a
  ``site_url``, words that say to link this page), for text a reader posts elsewhere; replaced in
  the page's HTML (``on_page_content``), so an included snippet may use it too.

Without a ``repo_url`` (a local build) each says to work in a clone of the repository instead,
so no page shows a command with a made-up address.

Every figure of a page's content is also a link to itself at full size (``on_page_content``): the
figures are drawn wider than the text column, which shows them scaled down.

The nav's "The factors" section is written here, not in mkdocs.yml (``on_config``): one entry per
factor of the registry (``vae_ddp.fixes.registry``: its name, its page), grouped by what the
committed report-scale study measured of its one step (``factor_nav``); and the API page's
``{{ fix_modules }}`` becomes one mkdocstrings block per module of ``vae_ddp.fixes``
(``fix_modules_markdown``): the factors' modules in the registry's order, then the other fix
modules. A new factor is its module, its example and its page: the nav and the API page follow.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

#: The package's name on the install line: pyproject's ``[project] name``.
PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["name"]

#: The nav section the hook writes (mkdocs.yml holds it empty, where it goes).
FACTORS_SECTION = "The factors"
#: The report-scale study whose measured kinds group the factors in the nav.
REPORT_SCALE = Path(__file__).resolve().parents[1] / "docs" / "results" / "report-scale" / "report_scale.json"
#: The nav's groups, in order: the measured kind of a factor's gradient step at the report's scale
#: (``vae_ddp.harness.effect.KINDS``), then what the study does not measure on the gradient.
GROUPS = {"different": "Change what DDP trains", "same distribution": "Change only the luck",
          "plot": "Change only the plot", "no cause": "Not a cause at equal per-device batches",
          "exact": "Change nothing at the report's scale", "inconclusive": "Not resolved at the report's scale",
          "unmeasured": "Not measured at the report's scale"}

#: The API page's placeholder for the fix modules' blocks.
FIX_MODULES = "{{ fix_modules }}"

PLACEHOLDERS = ("{{ install_command }}", "{{ clone_command }}", "{{ repo_link }}", "{{ page_url }}")


def texts(repo_url: str | None) -> dict[str, str]:
    """What each placeholder becomes for the site setting ``repo_url`` (empty or None: none set)."""
    url = (repo_url or "").strip().rstrip("/")
    if not url:
        return {"{{ install_command }}": "pip install -e .   # from the root of a clone of this repository",
                "{{ clone_command }}": "# from the root of a clone of this repository",
                "{{ repo_link }}": "this repository"}
    folder = url.rsplit("/", 1)[-1].removesuffix(".git")
    return {"{{ install_command }}": f'pip install "{PROJECT} @ git+{url}"',
            "{{ clone_command }}": f"git clone {url} && cd {folder}",
            "{{ repo_link }}": f"[the repository]({url})"}


def render(markdown: str, repo_url: str | None) -> str:
    """``markdown`` with every placeholder replaced."""
    for key, value in texts(repo_url).items():
        markdown = markdown.replace(key, value)
    return markdown


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs calls it with these names
    if "{{ " not in markdown:
        return markdown
    if FIX_MODULES in markdown:
        markdown = markdown.replace(FIX_MODULES, fix_modules_markdown())
    return render(markdown, config.get("repo_url"))


PAGE_URL = "{{ page_url }}"


def page_url(site_url: str | None, url: str) -> str:
    """A page's address: ``site_url`` joined with the page's ``url``; without a ``site_url`` (a local
    build), what to write instead."""
    base = (site_url or "").strip()
    return base.rstrip("/") + "/" + url.lstrip("/") if base else "(the address of this page on the published site)"


_IMG = re.compile(r"<img\b[^>]*?\bsrc=\"([^\"]+)\"[^>]*>")
_OPEN_A = re.compile(r"<a\b[^>]*>\s*$")
FULL_SIZE = "Open the figure at full size"


def link_figures(html: str) -> str:
    """``html`` with every ``<img>`` that is not already inside a link wrapped in a link to its own
    source (``title``: ``FULL_SIZE``); an image inlined as a ``data:`` URI (a notebook's output) is
    left alone: browsers do not open those as pages."""
    def wrap(m: re.Match) -> str:
        if m.group(1).startswith("data:") or _OPEN_A.search(html[max(0, m.start() - 400):m.start()]):
            return m.group(0)
        return f'<a href="{m.group(1)}" title="{FULL_SIZE}">{m.group(0)}</a>'

    return _IMG.sub(wrap, html)


_TABLE = re.compile(r"<table>(.*?)</table>", re.S)
_TH = re.compile(r"<th\b[^>]*>(.*?)</th>", re.S)
_TR = re.compile(r"<tr>(.*?)</tr>", re.S)
_TD = re.compile(r"<td\b")
_TAG = re.compile(r"<[^>]+>")


def label_cells(html: str) -> str:
    """``html`` with every cell of a Markdown table's body labelled with its column's header
    (``data-label``), so that a phone's stylesheet (docs/stylesheets/extra.css) shows each row as a block
    of "header: value" lines instead of a table wider than the screen."""
    def table(m: re.Match) -> str:
        inner = m.group(1)
        heads = [html_escape(_TAG.sub("", h).strip()) for h in _TH.findall(inner)]
        if not heads or "<tbody>" not in inner:
            return m.group(0)
        head, body = inner.split("<tbody>", 1)

        def row(r: re.Match) -> str:
            cells = iter(heads)
            return "<tr>" + _TD.sub(lambda _: f'<td data-label="{next(cells, "")}"', r.group(1)) + "</tr>"

        return "<table>" + head + "<tbody>" + _TR.sub(row, body) + "</table>"

    return _TABLE.sub(table, html)


def html_escape(text: str) -> str:
    """A header's text (already HTML, its entities kept) as an attribute value."""
    return text.replace('"', "&quot;")


#: In an included file (the keep-it-fixed workflow), the repository's address; replaced in the page's HTML.
REPO_URL = "{{repo_url}}"
#: What it becomes without a ``repo_url`` (a local build): a word that says what to put there.
NO_REPO_URL = "URL-OF-THE-vae-ddp-REPOSITORY"


def on_page_content(html: str, page, config, files) -> str:  # MkDocs calls it with these names
    if REPO_URL in html:
        html = html.replace(REPO_URL, (config.get("repo_url") or "").strip().rstrip("/") or NO_REPO_URL)
    if PAGE_URL in html:
        html = html.replace(PAGE_URL, page_url(config.get("site_url"), page.url))
    if "<table>" in html:
        html = label_cells(html)
    return link_figures(html) if "<img" in html else html


def group_of(factor, effect: dict | None) -> str:
    """The key of ``GROUPS`` a factor's nav entry goes under: the kind the report-scale study
    measured of its one step (the most serious of the gradient's, the KL's and the reconstruction's:
    the kind its ranking and the first screen use); ``plot`` when it measured only the plotted value
    (logging changes no gradient); ``no cause`` for a factor it does not isolate whose fix is another
    factor's (``fixed_by``: gone at equal per-device batches with that fix); else ``unmeasured``."""
    if effect and "gradient" in effect:
        return effect["kind"]
    if effect:
        return "plot"
    return "no cause" if factor.fixed_by else "unmeasured"


def factor_nav(report_scale: Path = REPORT_SCALE) -> list[dict]:
    """The nav's "The factors" section: ``[{group title: [{factor name: page}, ...]}, ...]``,
    the groups in ``GROUPS`` order, the factors in the registry's order."""
    import json

    from vae_ddp.fixes import registry
    from vae_ddp.studies.report_scale import factor_effects

    effects = factor_effects(json.loads(report_scale.read_text())) if report_scale.is_file() else {}
    groups: dict[str, list] = {key: [] for key in GROUPS}
    for f in registry.factors():
        groups[group_of(f, effects.get(f.key))].append({f.name: f.page})
    return [{GROUPS[key]: pages} for key, pages in groups.items() if pages]


def on_config(config):  # MkDocs calls it with this name
    for i, item in enumerate(config["nav"] or []):
        if isinstance(item, dict) and FACTORS_SECTION in item:
            config["nav"][i] = {FACTORS_SECTION: factor_nav()}
    return config


def fix_modules() -> list[str]:
    """The fix modules (``registry.fix_modules``): those that declare a factor in the registry's
    order, then the others by name."""
    from vae_ddp.fixes import registry

    declared = [m.__name__ for m in registry.MODULES]
    return declared + [name for name in registry.fix_modules() if name not in declared]


def fix_modules_markdown() -> str:
    """One mkdocstrings block (``::: module``) per module of ``fix_modules()``."""
    return "\n\n".join(f"::: {name}\n    options:\n      heading_level: 3" for name in fix_modules())
