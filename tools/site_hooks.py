"""MkDocs hook (``hooks:`` in mkdocs.yml): the repository's address on the pages that say how to
install the package.

The address is the site setting ``repo_url`` (mkdocs.yml reads it from ``$REPO_URL``; the Pages
workflow sets it to the repository that publishes the site). A page writes

- ``{{ install_command }}``: one line that installs the package from the repository,
  ``pip install "vae-ddp @ git+<repo_url>"``;
- ``{{ clone_command }}``: one line that clones the repository and enters it (for what needs the
  repository's files: ``examples/``, the extras such as ``.[gallery]``);
- ``{{ repo_link }}``: a Markdown link to the repository.

Without a ``repo_url`` (a local build) each says to work in a clone of the repository instead,
so no page shows a command with a made-up address.

Every figure of a page's content is also a link to itself at full size (``on_page_content``): the
figures are drawn wider than the text column, which shows them scaled down.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

#: The package's name on the install line: pyproject's ``[project] name``.
PROJECT = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["name"]

PLACEHOLDERS = ("{{ install_command }}", "{{ clone_command }}", "{{ repo_link }}")


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
    return render(markdown, config.get("repo_url"))


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


def on_page_content(html: str, page, config, files) -> str:  # MkDocs calls it with these names
    return link_figures(html) if "<img" in html else html
