"""The documentation site: strict build, its Python code blocks, and the pages in a browser.

One site build (``tools/results.py``, which runs every registered example, cached by
content, then ``mkdocs build --strict``, which includes what they wrote) is shared by all tests
of this module.
Broken internal links and anchors fail the strict build (``validation`` in mkdocs.yml).

The browser test drives Debian's ``chromium`` (``/usr/bin/chromium``) with Playwright's
Python package; it never downloads a browser. ``make test`` installs chromium first
(``make browser``: ``apt-get install chromium`` when it is missing and apt is there); the
test itself installs nothing and is skipped, saying why, when chromium is absent.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import sys
import threading
from pathlib import Path

import pytest
from helpers import ROOT

DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"

# the first test to ask for the site waits for the whole build (every registered example)
pytestmark = [pytest.mark.docs, pytest.mark.timeout(3000)]


# --------------------------------------------------------------------------- the build

@pytest.fixture(scope="module")
def site() -> Path:
    """The site, built once with ``mkdocs build --strict`` (started when the session starts,
    beside the other tests: see ``tests/conftest.py``)."""
    from conftest import site_build

    out, log, seconds = site_build()
    print(f"mkdocs build --strict: {seconds:.0f} s")
    print("\n".join(ln for ln in log.splitlines() if "results:" in ln))  # per-entry times (pytest -rA)
    return out


def pages(site: Path) -> list[str]:
    """URL paths of every page of the built site (directory URLs), 404 page left out."""
    found = []
    for html in sorted(site.rglob("index.html")):
        rel = html.parent.relative_to(site).as_posix()
        if rel.startswith(("assets", "search", "generated")):
            continue
        found.append("/" if rel == "." else f"/{rel}/")
    return found


def test_build_strict(site):
    """The strict build passes and holds the pages of the nav and the generated figures."""
    found = pages(site)
    for page in ("/", "/reproduce/", "/notebook/", "/dataparallel/", "/scaling/", "/api/"):
        assert page in found, f"{page} missing from the built site: {found}"
    assert (site / "generated" / "demo" / "curves.png").stat().st_size > 0
    assert (site / "search" / "search_index.json").is_file()
    # The text the pages include is not published as pages of its own.
    assert not list((site / "generated").rglob("*.md")) and not (site / "examples.yml").exists()
    home = (site / "index.html").read_text()
    assert "--8&lt;--" not in home and "--8<--" not in home, "a snippet was not included"


def test_generated_output_included(site):
    """The demo's table on Home comes from the run made during the build, not from the page."""
    output = (DOCS / "generated" / "demo" / "output.md").read_text()
    first_row = next(ln for ln in output.splitlines() if ln.startswith("| single"))
    number = re.findall(r"\d+\.\d+", first_row)[0]
    assert number in (site / "index.html").read_text()
    assert number not in (DOCS / "index.md").read_text()


def test_study_tables_are_what_the_studies_printed(site):
    """Every ``output: tables`` entry: the page includes the tables.md the study wrote, and that
    Markdown is exactly what it printed (one block of its stdout), not a rewording of it."""
    runner = _runner()
    entries = [e for e in runner.load_registry(ROOT) if e["output"] == "tables"]
    assert {"demo", "equivalence", "ablation", "seeds"} <= {e["name"] for e in entries}
    for e in entries:
        out = DOCS / "generated" / e["name"]
        tables = (out / "tables.md").read_text()
        assert (out / "output.md").read_text() == tables, e["name"]
        assert "\n|---" in tables or "|\n|-" in tables, f"{e['name']}: no Markdown table in tables.md"
        assert tables.strip() in (out / "stdout.txt").read_text(), f"{e['name']}: tables.md is not what it printed"


def test_notebook_page_is_executed_and_downloadable(site):
    """docs/notebook.ipynb is run during the build (its outputs are not committed) and offered
    for download from its page."""
    import json

    committed = json.loads((DOCS / "notebook.ipynb").read_text())
    assert not any(c.get("outputs") for c in committed["cells"]), "commit the notebook without outputs"
    html = (site / "notebook" / "index.html").read_text()
    assert "jp-OutputArea-output" in html
    assert re.search(r"single \(1, \d+, \d+, \d+\), DDP \(2, \d+, \d+, \d+\)", html), "no output of the run"
    assert (site / "notebook" / "notebook.ipynb").is_file()
    assert 'href="notebook.ipynb"' in html


# --------------------------------------------------------------------------- the results runner (tools/results.py)

def _runner():
    from conftest import _runner

    return _runner()


def _project(tmp_path: Path, scripts: dict[str, str], registry: str) -> Path:
    (tmp_path / "examples").mkdir()
    (tmp_path / "src" / "vae_ddp").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    for name, code in scripts.items():
        (tmp_path / "examples" / name).write_text(code)
    (tmp_path / "docs" / "examples.yml").write_text(registry)
    return tmp_path


GOOD = """
import argparse, json, pathlib
p = argparse.ArgumentParser(); p.add_argument("--out", type=pathlib.Path); a = p.parse_args()
a.out.mkdir(parents=True, exist_ok=True)
(a.out / "good.json").write_text(json.dumps({"summary": {"factor": "noise", "fix": "GlobalBatchNoise"}}))
print("| a | b |\\n|---|---|\\n| 1 | 2 |")
"""


def test_results_command_names_the_data_folder_dir():
    """A command that reads the CIFAR-10 subset shows it as ``--data_dir DIR``, with the line that
    defines ``DIR`` above it; a command that reads no data folder has no such line."""
    runner = _runner()
    cifar = [sys.executable, "-m", "vae_ddp.cli", "seeds", "--data", "imagefolder", "--data_dir", runner.CIFAR]
    shown = runner.command_md(cifar)
    assert shown.startswith("```bash\n# DIR: ") and "--data_dir DIR" in shown, shown
    assert runner.CIFAR not in shown and "path/to" not in shown, shown
    plain = runner.command_md([sys.executable, "examples/good.py", "--out", "docs/generated/good"])
    assert "DIR" not in plain and plain == "```bash\npython examples/good.py --out out/good\n```\n", plain


def test_results_runs_caches_and_summarises(tmp_path):
    runner = _runner()
    root = _project(tmp_path, {"good.py": GOOD},
                    "examples:\n  - script: examples/good.py\n    summary: true\n    page: factors/noise.md\n")
    assert runner.generate(root, preload=()) == {"good": "ran"}
    out = root / "docs" / "generated" / "good"
    assert "| 1 | 2 |" in (out / "output.md").read_text()
    assert "python examples/good.py --out out/good" in (out / "command.md").read_text()  # not the site's folder
    summary = (root / "docs" / "generated" / "summary" / "output.md").read_text()
    assert "[noise](factors/noise.md)" in summary and "GlobalBatchNoise" in summary
    assert runner.generate(root, preload=()) == {"good": "cached"}
    (root / "examples" / "good.py").write_text(GOOD + "\n# changed\n")
    assert runner.generate(root, preload=()) == {"good": "ran"}


def test_results_failing_example_fails_the_build_with_its_stderr(tmp_path):
    runner = _runner()
    root = _project(tmp_path, {"bad.py": "import sys\nprint('boom: the reason', file=sys.stderr)\nsys.exit(3)\n"},
                    "examples:\n  - script: examples/bad.py\n")
    with pytest.raises(runner.ResultsError, match=r"(?s)exit code 3.*boom: the reason"):
        runner.generate(root, preload=())


def test_results_timeout_kills_the_whole_process_tree(tmp_path):
    """An entry past its ``timeout`` fails the build, and the processes it started (DDP ranks,
    study runs) are killed with it instead of running on."""
    runner = _runner()
    slow = ("import signal, subprocess, sys\n"  # both wait for a signal: only the timeout's kill ends them
            "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
            "print(child.pid, flush=True)\n"
            "signal.pause()\n")
    root = _project(tmp_path, {"slow.py": slow}, "examples:\n  - script: examples/slow.py\n    timeout: 5\n")
    with pytest.raises(runner.ResultsError, match="timed out after 5 s"):
        runner.generate(root, preload=())
    grandchild = int((root / "docs" / "generated" / "slow" / "stdout.txt").read_text().split()[0])
    import select

    try:  # a pidfd turns readable when the process has ended (a zombie included): wait for that
        fd = os.pidfd_open(grandchild)
    except ProcessLookupError:
        return  # already gone
    try:
        ready, _, _ = select.select([fd], [], [], 10)
    finally:
        os.close(fd)
    assert ready, "the entry's child outlived the timeout"


def test_a_log_shows_no_warning_even_one_that_interrupted_a_line():
    """``output: log`` leaves out Python warnings with their source line, also one that another rank
    wrote into the middle of a line (an unbuffered ``print`` writes its text, then the newline)."""
    e = {"drop": [re.compile("Tip:")]}
    text = ("Seed set to 1234\n"
            "/x/site-packages/pl/_pytree.py:21: `LeafSpec` is deprecated\n"
            "  warnings.warn(\n"
            "examples/vae.py:3: UserWarning: relative\n"
            "0         Total Flops/x/work/venv/pl/result.py:433: It is recommended to use sync_dist=True\n"
            "\n"
            "Tip: try this\n"
            "`Trainer.fit` stopped: `max_steps=3` reached.\n")
    shown = _runner().clean_log(e, text)
    assert shown == "Seed set to 1234\n0         Total Flops\n\n`Trainer.fit` stopped: `max_steps=3` reached.", shown


def test_results_registry_errors(tmp_path):
    runner = _runner()
    root = _project(tmp_path, {}, "examples:\n  - script: examples/missing.py\n")
    with pytest.raises(runner.ResultsError, match="does not exist"):
        runner.generate(root, preload=())
    (root / "docs" / "examples.yml").write_text("examples:\n  - name: x\n    command: [true]\n    colour: red\n")
    with pytest.raises(runner.ResultsError, match="unknown key"):
        runner.generate(root, preload=())


TABLES = """
import argparse, pathlib, sys
sys.path.insert(0, {src!r})
from vae_ddp.harness.table import format_table, write_tables
p = argparse.ArgumentParser(); p.add_argument("--out", type=pathlib.Path); a = p.parse_args()
md = format_table(["n", "max |a - b|"], [[2, 0.5]], title="after 3 steps")
print("progress line, not for the page")
print(md)
write_tables(a.out, md)
"""


def test_results_output_tables_is_the_file_the_entry_wrote(tmp_path):
    """``output: tables``: output.md is the entry's tables.md, not its stdout; a pipe inside a
    cell stays content (escaped), so the table keeps its two columns."""
    runner = _runner()
    root = _project(tmp_path, {"study.py": TABLES.format(src=str(ROOT / "src"))},
                    "examples:\n  - script: examples/study.py\n    output: tables\n")
    assert runner.generate(root, preload=()) == {"study": "ran"}
    out = root / "docs" / "generated" / "study"
    assert (out / "output.md").read_text() == (
        "after 3 steps\n\n| n | max \\|a - b\\| |\n|---|---------------|\n| 2 | 0.5000        |\n")
    assert "progress line" in (out / "stdout.txt").read_text()


ENVIRONMENT = """
import os, sys
print(f"| {sys.flags.hash_randomization} | {os.environ['MPLBACKEND']} | {os.getcwd()} | {'wave' in sys.modules} |")
"""


def test_results_runs_an_entry_in_a_fork_of_its_zygote_as_its_command_line_would(tmp_path, monkeypatch):
    """With ``preload``, an entry runs in a fork of this process's zygote of those modules, with
    the environment and folder of the entry's command line: the project's root, ``MPLBACKEND``,
    hash randomisation off (``PYTHONHASHSEED=0``, read only when the zygote's interpreter starts);
    a second entry, two at once, runs in a fork of the same zygote."""
    runner = _runner()
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.setenv("VAE_DDP_DOCS_JOBS", "2")
    root = _project(tmp_path, {"env.py": ENVIRONMENT, "env2.py": ENVIRONMENT},
                    "examples:\n  - script: examples/env.py\n  - script: examples/env2.py\n")
    monkeypatch.chdir(tmp_path.parent)  # not the root: the entry's folder comes with the request
    from vae_ddp import zygote

    before = {k for k in zygote._ZYGOTES if k[0] == os.getpid()}
    assert runner.generate(root, preload=("wave",)) == {"env": "ran", "env2": "ran"}
    for name in ("env", "env2"):
        shown = (root / "docs" / "generated" / name / "output.md").read_text()
        assert shown == f"| 0 | Agg | {root} | True |\n", shown
    started = [k for k in zygote._ZYGOTES if k[0] == os.getpid() and k not in before]
    assert started == [(os.getpid(), "wave", (("PYTHONHASHSEED", "0"), ("VAE_DDP_LIGHTNING", None)))], started


def test_results_runs_a_command_that_is_not_python(tmp_path):
    """An entry's ``command`` need not be Python: it runs as it is, in a new process."""
    runner = _runner()
    root = _project(tmp_path, {}, "examples:\n  - name: echo\n    command: [echo, '| plain |']\n    output: markdown\n")
    assert runner.generate(root, preload=()) == {"echo": "ran"}
    assert (root / "docs" / "generated" / "echo" / "output.md").read_text() == "| plain | --out docs/generated/echo\n"


def test_results_output_tables_missing_file_fails(tmp_path):
    runner = _runner()
    root = _project(tmp_path, {"quiet.py": "print('| a |\\n|---|\\n| 1 |')\n"},
                    "examples:\n  - script: examples/quiet.py\n    output: tables\n")
    with pytest.raises(runner.ResultsError, match=r"`output: tables` but wrote no tables.md"):
        runner.generate(root, preload=())


# --------------------------------------------------------------------------- code blocks

def _code_examples():
    from pytest_examples import find_examples

    files = [p for p in sorted(DOCS.rglob("*.md")) if "generated" not in p.relative_to(DOCS).parts]
    if (ROOT / "README.md").is_file():
        files.append(ROOT / "README.md")
    return list(find_examples(*files)) if files else []


def _is_snippet_include(source: str) -> bool:
    lines = [ln.strip() for ln in source.strip().splitlines()]
    return bool(lines) and all(ln.startswith("--8<--") for ln in lines)


def _code_block_skip_reason(example) -> str | None:
    """Why ``test_code_blocks`` does not run this block (None: it runs it).
    ``test_every_python_block_runs_or_links_to_a_script`` checks every block skipped here."""
    settings = example.prefix_settings()
    if m := EXCERPT_TITLE.match(settings.get("title", "")):
        return f"an excerpt of {m['path']}, linked to the whole script"
    if _is_snippet_include(example.source):
        return "a file included with pymdownx.snippets (the example registry runs it)"
    if settings.get("test") == "skip":
        return 'marked test="skip"'
    return None


@pytest.mark.parametrize("example", _code_examples(), ids=str)
def test_code_blocks(example, eval_example):
    """Every Python block of docs/**/*.md and README.md runs; a block that prints has its
    output below the print (``#> ...``) and it must match. Shell blocks (```bash) are not
    run. Not run: includes of a file or of a section of one, and excerpts titled
    ``Excerpt of <path>`` (each checked by ``test_every_python_block_runs_or_links_to_a_script``)."""
    reason = _code_block_skip_reason(example)
    if reason:
        pytest.skip(reason)
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        eval_example.run_print_check(example)
    except Exception as exc:  # noqa: BLE001
        # The block runs as code compiled by pytest-examples; on CPython 3.11.7, rendering a
        # traceback through its frames crashed pytest itself (INTERNALERROR: "generator raised
        # StopIteration" in traceback.extract_tb) and ended the whole session. One message instead.
        pytest.fail(f"{example}: {type(exc).__name__}: {exc}", pytrace=False)
    finally:
        os.chdir(cwd)


# A python block is one of: run by test_code_blocks; the include of a whole script that a
# registered example (docs/examples.yml) or a test runs; or an excerpt: titled
# "Excerpt of <path>" (a file that exists; for a section include, the included file), with a
# link, within LINK_WINDOW lines above or below, to a place where the whole <path> is
# included (an anchor followed within ANCHOR_WINDOW lines by the include, or a page holding it).
EXCERPT_TITLE = re.compile(r"Excerpt of (?P<path>[\w./-]*\w)", re.IGNORECASE)  # pytest-examples lowercases it
LINK_WINDOW = 4
ANCHOR_WINDOW = 12
INCLUDE = re.compile(r'--8<--\s+"(?P<spec>[^"]+)"')
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\((?P<href>[^)\s]+)(?:\s+\"[^\"]*\")?\)")
#: Scripts that the site includes whole and that are run by a test suite of their own rather
#: than by docs/examples.yml: script -> the test file that runs it (it must name the script).
RUN_BY_TESTS = {
    "examples/recipe.py": "tests/test_recipe.py",  # run as shown on 2 processes; its train() by recipe_check
    "examples/gallery.py": "tests/test_gallery.py",  # its audits: the reduced gallery (the full one: make gallery)
    "examples/keep_it_fixed/test_ddp.py": "tests/test_installed.py",  # in a fresh venv, as its workflow runs it
    "examples/legacy/vae.py": "tests_legacy/test_report_script.py",
    "examples/legacy/vae_changed.py": "tests_legacy/test_changed_script.py",
    "examples/legacy/imagefolder_cifar10.py": "tests_legacy/test_report_script.py",
}


def _fences(text: str) -> list[dict]:
    """The fenced blocks of a Markdown text: opening line (1-based), closing line, the info
    string after the fence, and the body lines, dedented by the fence's indent."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        close = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        blocks.append({"line": i + 1, "end": j + 1, "info": m["info"].strip(),
                       "body": [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1:j]]})
        i = j + 1
    return blocks


def _fence_language(info: str) -> str:
    first = info.strip("{ }").split(maxsplit=1)
    return first[0].lstrip(".").lower() if first else ""


def _fence_title(info: str) -> str:
    m = re.search(r'title="([^"]*)"', info)
    return m.group(1) if m else ""


def _anchors(text: str) -> dict[str, int]:
    """Anchor id -> line (1-based) of the headings (toc's slugs, made unique as toc does:
    ``_1``, ``_2``), of ``{#id}`` attribute lists and of raw HTML ``id="..."``, outside fences."""
    from markdown.extensions.toc import slugify

    fenced = {n for b in _fences(text) for n in range(b["line"], b["end"] + 1)}
    found: dict[str, int] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if n in fenced:
            continue
        for m in re.finditer(r"""\{[^}]*#(?P<id>[\w-]+)[^}]*\}|\bid=["'](?P<html>[^"']+)["']""", line):
            found.setdefault(m["id"] or m["html"], n)
        h = HEADING.match(line)
        if h and not re.search(r"\{[^}]*#[\w-]+[^}]*\}\s*$", h["text"]):
            plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", h["text"]).replace("`", "")
            slug, k = slugify(plain, "-"), 0
            while (slug if k == 0 else f"{slug}_{k}") in found:
                k += 1
            found[slug if k == 0 else f"{slug}_{k}"] = n
    return found


def _whole_include_lines(text: str, path: str) -> list[int]:
    return [n for n, ln in enumerate(text.splitlines(), 1) if ln.strip() == f'--8<-- "{path}"']


def _links_to_whole_script(rel: str, text: str, block: dict, path: str, read) -> bool:
    """Whether a link within LINK_WINDOW lines of the block leads to the include of the
    whole ``path``: on this page (``#anchor``) or another (``page.md`` or ``page.md#anchor``)."""
    lines = text.splitlines()
    near = (lines[max(0, block["line"] - 1 - LINK_WINDOW):block["line"] - 1]
            + lines[block["end"]:block["end"] + LINK_WINDOW])
    for m in LINK.finditer(" ".join(near)):
        target, _, anchor = m["href"].partition("#")
        if "://" in target or target.startswith("mailto:"):
            continue
        page_rel = rel if not target else os.path.normpath(os.path.join(os.path.dirname(rel), target))
        page = text if page_rel == rel else read(page_rel)
        if page is None:
            continue
        includes = _whole_include_lines(page, path)
        if not anchor:
            if includes:
                return True
            continue
        at = _anchors(page).get(anchor)
        if at is not None and any(at < n <= at + ANCHOR_WINDOW for n in includes):
            return True
    return False


def _classify_python_blocks(rel: str, text: str, *, runs: set[int], scripts: dict[str, str],
                            read, exists) -> list[tuple[int, str, str]]:
    """Each python block of the page ``rel`` (path from the repository root) with ``text``:
    ``(line, kind, note)``, kind one of ``runs`` (its opening line is in ``runs``, the blocks
    test_code_blocks runs), ``whole-file`` (includes scripts of ``scripts``, script -> what runs
    it), ``excerpt`` or ``bad`` (the note says why). ``read(path)`` gives another page's text
    (None if there is none), ``exists(path)`` whether a file of the repository exists."""
    out = []
    for b in _fences(text):
        if _fence_language(b["info"]) not in ("python", "py"):
            continue
        where = f"{rel}:{b['line']}"
        if b["line"] in runs:
            out.append((b["line"], "runs", ""))
            continue
        body = [ln.strip() for ln in b["body"] if ln.strip()]
        specs = [m["spec"] for ln in body if (m := INCLUDE.fullmatch(ln))]
        included = body and len(specs) == len(body)
        wholes = [s for s in specs if ":" not in s] if included else []
        sections = [s.partition(":")[0] for s in specs if ":" in s] if included else []
        if included and not sections:
            unrun = [s for s in wholes if s not in scripts]
            if unrun:
                note = (f"{where}: includes {', '.join(unrun)}, which neither docs/examples.yml nor a "
                        "test runs: register it, or show it as an excerpt")
                out.append((b["line"], "bad", note))
            else:
                out.append((b["line"], "whole-file", ", ".join(f"{s} ({scripts[s]})" for s in wholes)))
            continue
        title = EXCERPT_TITLE.match(_fence_title(b["info"]))
        problem = None
        if not title:
            what = (f"includes a section ({', '.join(specs)})" if included else
                    f"is not run by test_code_blocks (```{b['info']})")
            problem = f'{what} and is not an excerpt titled title="Excerpt of <path>..."'
        elif not exists(title["path"]):
            problem = f"is titled an excerpt of {title['path']}, which does not exist"
        elif included and (set(sections) | set(wholes)) != {title["path"]}:
            problem = f"includes {', '.join(specs)} but is titled an excerpt of {title['path']}"
        elif not _links_to_whole_script(rel, text, b, title["path"], read):
            problem = (f"is an excerpt of {title['path']} without a link, within {LINK_WINDOW} lines, to "
                       f'the whole script (an anchor followed by --8<-- "{title["path"]}", or a page that includes it)')
        if problem:
            out.append((b["line"], "bad", f"{where}: python block {problem}"))
        else:
            out.append((b["line"], "excerpt", title["path"]))
    return out


def _doc_pages() -> list[Path]:
    files = [p for p in sorted(DOCS.rglob("*.md")) if "generated" not in p.relative_to(DOCS).parts]
    return files + ([ROOT / "README.md"] if (ROOT / "README.md").is_file() else [])


def _read_page(rel: str) -> str | None:
    path = ROOT / rel
    return path.read_text() if path.suffix == ".md" and path.is_file() else None


def _scripts_run() -> dict[str, str]:
    """Script path -> what runs it: the entries of docs/examples.yml and RUN_BY_TESTS."""
    scripts = {e["script"]: "docs/examples.yml" for e in _runner().load_registry(ROOT) if "script" in e}
    for script, test in RUN_BY_TESTS.items():
        assert Path(script).name in (ROOT / test).read_text() or Path(script).stem in (ROOT / test).read_text(), \
            f"{test} does not run {script}: correct RUN_BY_TESTS"
        scripts[script] = test
    return scripts


def test_every_python_block_runs_or_links_to_a_script():
    """Every python block a reader can copy runs as shown (test_code_blocks), includes a whole
    script that an example or a test runs, or is titled ``Excerpt of <path>`` and linked to the
    whole script; anything else fails, naming the file and line. A block marked
    ``test="skip"`` counts as not run."""
    runs: dict[Path, set[int]] = {}
    for ex in _code_examples():
        if _code_block_skip_reason(ex) is None:
            runs.setdefault(Path(ex.path), set()).add(ex.start_line)
    scripts = _scripts_run()
    kinds: dict[str, int] = {}
    bad = []
    for page in _doc_pages():
        rel = page.relative_to(ROOT).as_posix()
        for _line, kind, note in _classify_python_blocks(rel, page.read_text(), runs=runs.get(page, set()),
                                                         scripts=scripts, read=_read_page,
                                                         exists=lambda p: (ROOT / p).is_file()):
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind == "bad":
                bad.append(note)
    print(kinds)
    assert not bad, "python blocks that neither run nor link to a script that runs:\n" + "\n".join(bad)
    assert kinds.get("runs", 0) > 10 and kinds.get("excerpt", 0) > 0, kinds


_PAGE = """# A page

Copy [the whole script](#the-whole-script), an excerpt of which is:

```python title="Excerpt of examples/s.py: the model"
--8<-- "examples/s.py:model"
```

```python
--8<-- "examples/s.py:model"
```

```python title="Excerpt of examples/s.py"
--8<-- "examples/s.py:model"
```

Text far away from any link.

```python test="skip"
x = undefined_name
```

```python title="Excerpt of examples/gone.py: part"
y = 1
```

See [the other page](other.md#all) for all of it.

```python title="Excerpt of examples/s.py: by hand"
model = Model()
```

````python
--8<-- "examples/unregistered.py"
````

```python
print(1)
```

## The whole script

??? example "The whole script"

    ```python title="examples/s.py"
    --8<-- "examples/s.py"
    ```
"""


def test_python_block_classifier_on_made_up_blocks():
    """The classifier of test_every_python_block_runs_or_links_to_a_script fails what it should."""
    other = "# Other\n\n## All\n\n```python\n--8<-- \"examples/s.py\"\n```\n"
    result = _classify_python_blocks(
        "docs/page.md", _PAGE, runs={37}, scripts={"examples/s.py": "docs/examples.yml"},
        read=lambda rel: other if rel == "docs/other.md" else None,
        exists=lambda p: p == "examples/s.py")
    assert [(line, kind) for line, kind, _ in result] == [
        (5, "excerpt"),   # titled and linked, two lines above, to the anchor of the whole script
        (9, "bad"),       # a section include with no title
        (13, "bad"),      # titled, but no link within LINK_WINDOW lines
        (19, "bad"),      # test="skip" and not an excerpt: a silent skip
        (23, "bad"),      # an excerpt of a file that does not exist
        (29, "excerpt"),  # linked (just above) to another page that includes the whole script
        (33, "bad"),      # a whole-file include that nothing runs (a four-backtick fence too)
        (37, "runs"),     # run by test_code_blocks
        (45, "whole-file"),
    ], result
    notes = {line: note for line, kind, note in result if kind == "bad"}
    assert notes[9].startswith("docs/page.md:9: ") and "Excerpt of" in notes[9]
    assert "without a link" in notes[13] and "examples/gone.py" in notes[23]
    assert "examples/unregistered.py" in notes[33]
    # the anchor must exist and be followed by the include of the whole script
    broken = _PAGE.replace("## The whole script", "## Something else")
    lines = [(ln, k) for ln, k, _ in _classify_python_blocks(
        "docs/page.md", broken, runs={37}, scripts={"examples/s.py": "x"}, read=lambda rel: None,
        exists=lambda p: True)]
    assert (5, "bad") in lines and (29, "bad") in lines


# --------------------------------------------------------------------------- the browser

@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium (``make browser`` installs it); the browser tests skip without it."""
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: run `make browser` (apt-get install chromium) to run the browser tests")
    return CHROMIUM


@pytest.fixture(scope="module")
def server(site):
    """The built site on http://127.0.0.1:<free port>/, served from a thread."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def browser(chromium):
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright's Python package is not installed")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, headless=True,
                              args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


_PHONE = {"width": 390, "height": 844}
_DESKTOP = {"width": 1280, "height": 800}

_PHONE_TABLES = """els => els.map(t => {
    let box = t.parentElement;
    while (box && !['auto', 'scroll'].includes(getComputedStyle(box).overflowX)) box = box.parentElement;
    const r = t.getBoundingClientRect();
    return {fits: r.right <= window.innerWidth + 1 && r.left >= -1,
            scrolls: !!box && box.scrollWidth > box.clientWidth && box.clientWidth <= window.innerWidth,
            head: t.querySelector('th') ? t.querySelector('th').textContent : ''};
})"""

_TABLE_WIDTHS = """() => {
    document.querySelectorAll('article details').forEach(d => { d.open = true; });
    return [...document.querySelectorAll('article table')].map(t => {
        const wrap = t.closest('.md-typeset__scrollwrap') || t.parentElement;
        const heads = [...t.querySelectorAll('thead th')];
        const v = heads.find(h => /verdict/i.test(h.textContent));
        return {width: t.scrollWidth, column: wrap.clientWidth,
                head: heads.map(h => h.textContent.trim()).join(' | ').slice(0, 120),
                verdictRight: v ? v.getBoundingClientRect().right : null};
    });
}"""


#: The tables and code blocks that start on the first screen (no scrolling; collapsed blocks stay
#: closed): each fits when its box does not scroll sideways and it ends on the screen.
_FIRST_SCREEN = """() => [...document.querySelectorAll('article table, article pre')]
        .filter(e => e.offsetParent !== null && e.getBoundingClientRect().top < window.innerHeight).map(e => {
    const table = e.tagName === 'TABLE';
    const box = table ? (e.closest('.md-typeset__scrollwrap') || e.parentElement) : (e.querySelector('code') || e);
    const r = e.getBoundingClientRect();
    return {kind: table ? 'table' : 'code block', width: table ? e.scrollWidth : box.scrollWidth,
            fits: box.scrollWidth <= box.clientWidth + 1 && r.right <= window.innerWidth + 1 && r.left >= -1,
            over: Math.max(box.scrollWidth - box.clientWidth, Math.round(r.right - window.innerWidth)),
            what: (table ? [...e.querySelectorAll('th')].map(h => h.textContent.trim()).join(' | ')
                         : e.textContent.trim().split('\\n')[0]).slice(0, 80)};
})"""

#: Every code block, collapsed blocks opened: does it scroll inside its own box, on the screen?
_CODE_BLOCKS = """() => {
    document.querySelectorAll('article details').forEach(d => { d.open = true; });
    return [...document.querySelectorAll('article pre')].filter(e => e.offsetParent !== null).map(e => {
        const box = e.querySelector('code') || e;
        const r = box.getBoundingClientRect();
        return {wide: box.scrollWidth > box.clientWidth + 1,
                scrolls: ['auto', 'scroll'].includes(getComputedStyle(box).overflowX),
                inside: r.left >= -1 && r.right <= window.innerWidth + 1,
                first: e.textContent.trim().split('\\n')[0].slice(0, 60)};
    }).concat([{page: document.documentElement.scrollWidth}]);
}"""

#: The top-level items of the site's navigation, in order, as a desktop shows them.
_NAV = """() => [...document.querySelectorAll('.md-nav--primary > .md-nav__list > .md-nav__item')]
    .map(e => (e.querySelector('a, label') || e).textContent.trim())"""


@pytest.fixture(scope="module")
def rendered(site, server, browser) -> dict:
    """Every page, loaded once on a desktop (1280 x 800) and once on a phone (390 x 844): what
    the browser tests below check. Per viewport and page: ``errors`` (console errors, uncaught
    exceptions), ``images`` (``src``, loaded), ``width`` (the page's scroll width),
    ``tables`` (as laid out, collapsed blocks closed: fits the screen or scrolls in its own box),
    ``first_screen`` (the tables and code blocks that start on the first screen: do they fit),
    ``nav`` (the navigation's top-level items), ``widths`` (collapsed blocks opened: each
    table's width, its column's, the right edge of its verdict column) and ``code`` (collapsed
    blocks opened: each code block, wide or not, scrolls in its box on the screen; last, the
    page's width)."""
    seen = {}
    for name, context in (("desktop", browser.new_context(viewport=_DESKTOP)),
                          ("phone", browser.new_context(viewport=_PHONE, device_scale_factor=2, is_mobile=True))):
        seen[name] = {}
        paths = pages(site)
        for start in range(0, len(paths), 8):  # 8 pages load at once: their idle waits overlap
            batch = []
            for path in paths[start:start + 8]:
                page = context.new_page()
                errors: list[str] = []
                page.on("console", lambda msg, errors=errors: errors.append(msg.text) if msg.type == "error" else None)
                page.on("pageerror", lambda exc, errors=errors: errors.append(str(exc)))
                page.goto(server + path, wait_until="commit")
                batch.append((path, page, errors))
            for path, page, errors in batch:
                page.wait_for_load_state("networkidle")
                seen[name][path] = {
                    "images": page.eval_on_selector_all(
                        "img",
                        "els => els.map(e => ({src: e.getAttribute('src'), ok: e.complete && e.naturalWidth > 0}))"),
                    "width": page.evaluate("document.documentElement.scrollWidth"),
                    "tables": page.eval_on_selector_all("article table", _PHONE_TABLES),
                    "first_screen": page.evaluate(_FIRST_SCREEN),
                    "nav": page.evaluate(_NAV),
                    "widths": page.evaluate(_TABLE_WIDTHS),  # from here on: the collapsed blocks opened
                    "code": page.evaluate(_CODE_BLOCKS),
                    "errors": errors}
                page.close()
        context.close()
    return seen


def test_pages_in_browser(rendered):
    """Every page loads without console errors and with every image loaded, on a desktop and a phone."""
    problems = [f"{view}: {path}: console error: {e}" for view, seen in rendered.items()
                for path, r in seen.items() for e in r["errors"]]
    problems += [f"{view}: {path}: image not loaded: {img['src']}" for view, seen in rendered.items()
                 for path, r in seen.items() for img in r["images"] if not img["ok"]]
    assert rendered["desktop"] and set(rendered["desktop"]) == set(rendered["phone"])
    assert not problems, "\n".join(problems)


def test_verdict_box_on_the_first_screen(server, browser):
    """Home's first screen (1280 x 800, no scrolling) carries the whole verdict box, with the
    link to the upstream report."""
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(server + "/", wait_until="networkidle")
    box = page.locator("article .admonition").first
    assert box.is_visible()
    bb = box.bounding_box()
    assert bb is not None and 0 <= bb["y"] and bb["y"] + bb["height"] <= 800, f"verdict box at {bb}"
    text = box.inner_text()
    assert "#6789" in text and "sync_dist=True" in text and "sync_batchnorm=True" in text
    # the two answers, in the reader's words: bug or expected behaviour (title), and the KL
    from vae_ddp.studies.answer import HEADLINE

    assert any(h in text.splitlines()[0] for h in HEADLINE.values()) and "DDP's KL" in text, text
    assert "DP's match" in text and "Same step as one device" in text, text
    page.close()


def test_verdict_fits_a_phone(server, browser):
    """At a phone's width (390 x 844) the verdict box and the table of each study's words under it
    are read without scrolling sideways: nothing in them is wider than the column."""
    page = browser.new_page(viewport={"width": 390, "height": 844})
    page.goto(server + "/", wait_until="networkidle")
    box = page.locator("article .admonition").first
    assert box.is_visible()
    assert box.evaluate("e => e.scrollWidth <= e.clientWidth + 1"), "the verdict box scrolls sideways at 390 px"
    bb = box.bounding_box()
    assert bb is not None and bb["x"] >= 0 and bb["x"] + bb["width"] <= 390, f"verdict box at {bb}"
    wrap = page.locator("article .verdict-table .md-typeset__scrollwrap").first
    sizes = wrap.evaluate("e => { const t = e.querySelector('.md-typeset__table') || e; "
                          "const c = e.querySelector('td[data-label]'); "
                          "return [t.scrollWidth, e.clientWidth, c ? c.dataset.label : e.innerText]; }")
    # each row a block, its cells labelled by their column (the first: the table's title)
    assert "whole trainings" in sizes[2] and sizes[0] <= sizes[1] + 1, \
        f"the verdict table is {sizes[0]} px in {sizes[1]} px"
    bb = box.bounding_box()  # the box within the first two phone screens
    assert bb["y"] + bb["height"] <= 2 * 844, f"the first screen's box ends at {bb['y'] + bb['height']} px"
    page.close()


def test_search_finds_syncbatchnorm(server, browser):
    """Material's search box finds SyncBatchNorm (the search index and its worker work)."""
    page = browser.new_page()
    page.goto(server + "/", wait_until="networkidle")
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially("SyncBatchNorm", delay=20)
    result = page.locator(".md-search-result__item").first
    result.wait_for(state="visible", timeout=20000)
    assert "SyncBatchNorm" in page.locator(".md-search-result").inner_text()
    page.close()


# --------------------------------------------------------------------------- CI workflows

@pytest.mark.parametrize("name", ["ci.yml", "pages.yml"])
def test_workflows(name):
    """The workflows are valid YAML and run the README's commands (make test, make docs)."""
    import yaml

    path = ROOT / ".github" / "workflows" / name
    wf = yaml.safe_load(path.read_text())
    steps = [s for job in wf["jobs"].values() for s in job.get("steps", [])]
    commands = [s["run"].strip() for s in steps if "run" in s]
    assert "make docs" in commands
    if name == "ci.yml":
        assert "make test" in commands
    else:
        uses = [s.get("uses", "").split("@")[0] for s in steps]
        assert "actions/upload-pages-artifact" in uses and "actions/deploy-pages" in uses


# --------------------------------------------------------------------------- what a reader reads

#: Words of the project's tracker, paths of its machines and words about how the site is made
#: (its build, tests and CI, the machine that built it): no page may contain them. A reader is
#: told what the page shows and the command that produced it instead.
INTERNAL = ("the issue's bound", "this CPU-only machine", "capstone", "../shared", "/work/",
            "VAE_DDP_FULL", "make test", "make docs", "(and CI)", "every build", "load average",
            "two CPU cores", "2 CPU cores", "four backticks", "_vae_ddp_user_", "docs/generated",
            # the site's own build, tests and CI (a page says what was measured and the command)
            "page was built", "this page is built", "site's build", "site is built", "this build",
            "a test runs", "a test trains", "the tests check", "the tests require", "make legacy-test", "tests_legacy",
            "path/to/cifar10-jpg-subset")


def _page_text(html: str) -> str:
    """The visible text and code of a built page (tags, search index and scripts left out)."""
    import html as html_mod

    body = re.sub(r"(?is)<(script|style)\b.*?</\1>", " ", html)
    return html_mod.unescape(re.sub(r"<[^>]+>", "", body))


#: (page, word) pairs still on the site, each owned by another part of the project. Remove a
#: pair when it is fixed (the test fails on a pair that no longer occurs, so that this list
#: only shrinks).
KNOWN_INTERNAL: set = set()


def test_no_internal_wording(site):
    """No built page shows the tracker's words or paths of the project's machines; a reader is
    told instead how to get the data (``.github/scripts/cifar10-subset.sh``, or torchvision)."""
    # the paths of this machine too: where the repository and the interpreter's environment are
    words = INTERNAL + tuple(str(p) for p in {ROOT.resolve(), Path(sys.prefix).resolve()})
    found, where = set(), []
    for path in pages(site):
        text = _page_text((site / path.strip("/") / "index.html").read_text()).lower()
        for w in words:
            at = text.find(w.lower())
            if at >= 0:
                found.add((path, w))
                where.append(f"{path}: ...{text[max(0, at - 120):at + 80]!r}...")
    assert not found - KNOWN_INTERNAL, (f"internal wording on the site: {sorted(found - KNOWN_INTERNAL)}\n"
                                        + "\n".join(where))
    assert not KNOWN_INTERNAL - found, f"fixed, remove from KNOWN_INTERNAL: {sorted(KNOWN_INTERNAL - found)}"


def _site_hooks():
    from helpers import load_script

    return load_script("tools/site_hooks.py", "vae_ddp_site_hooks")


def test_site_hooks_link_each_figure_to_its_full_size():
    hooks = _site_hooks()
    html = '<p><img alt="a" src="f.png" /></p><a href="g.png"><img src="g.png"></a>'
    out = hooks.link_figures(html)
    assert out.count("<a ") == 2 and f'<a href="f.png" title="{hooks.FULL_SIZE}"><img alt="a" src="f.png" /></a>' in out
    assert hooks.link_figures(out) == out  # a figure already linked is left alone


def test_every_figure_opens_at_full_size(site):
    """Figures are drawn wider than the text column and shown scaled down: on every page each one
    is a link to its own file."""
    missing = []
    for path in pages(site):
        html = (site / path.strip("/") / "index.html").read_text()
        article = html[html.find("<article"):html.find("</article>")]
        for m in re.finditer(r"<img\b[^>]*?\bsrc=\"([^\"]+)\"[^>]*>", article):
            if m.group(1).startswith("data:"):  # a notebook's inlined output: browsers do not open it
                continue
            before = article[max(0, m.start() - 400):m.start()]
            link = re.search(r'<a\b[^>]*href="([^"]+)"[^>]*>\s*$', before)
            if not link or link.group(1) != m.group(1):
                missing.append(f"{path}: {m.group(1)}")
    assert not missing, missing


def test_site_hooks_label_each_table_cell_with_its_column():
    """Every body cell of a table carries its column's header text (tags removed, quotes escaped) as
    ``data-label``, which the phone stylesheet shows before the value; a table without a header is left."""
    hooks = _site_hooks()
    html = ('<table>\n<thead>\n<tr>\n<th>factor <code>"x"</code></th>\n<th align="right">ratio</th>\n</tr>\n</thead>'
            '\n<tbody>\n<tr>\n<td>BatchNorm</td>\n<td align="right">0.4</td>\n</tr>\n<tr>\n<td>noise</td>\n'
            '<td>0.8</td>\n</tr>\n</tbody>\n</table>')
    out = hooks.label_cells(html)
    assert out.count('<td data-label="factor &quot;x&quot;">') == 2 and out.count('<td data-label="ratio"') == 2
    assert '<td data-label="ratio" align="right">0.4</td>' in out
    bare = "<table>\n<tbody>\n<tr>\n<td>1</td>\n</tr>\n</tbody>\n</table>"
    assert hooks.label_cells(bare) == bare


def test_site_hooks_render_the_install_command_from_repo_url():
    """The hook writes one install line from the site setting ``repo_url`` (pyproject's name, pip's
    ``name @ git+URL``), a clone line and a link; without an address it names no made-up one."""
    import tomllib

    hooks = _site_hooks()
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    page = "a\n{{ install_command }}\n{{ clone_command }}\nsee {{ repo_link }}\n"
    out = hooks.render(page, "https://github.com/someone/vae-ddp/")
    assert out == (f'a\npip install "{name} @ git+https://github.com/someone/vae-ddp"\n'
                   "git clone https://github.com/someone/vae-ddp && cd vae-ddp\n"
                   "see [the repository](https://github.com/someone/vae-ddp)\n"), out
    for url in ("", None):
        local = hooks.render(page, url)
        assert "{{" not in local and "git+" not in local and "http" not in local, local
        assert "pip install -e ." in local and "clone of this repository" in local, local
    assert hooks.on_page_markdown("no placeholder {{x}}", None, {"repo_url": "https://h/r"}, None) == \
        "no placeholder {{x}}"


def test_install_command_uses_the_configured_repository(site):
    """The built audit and gallery pages show the install command and the link with the site's
    ``repo_url`` (the test build's, ``conftest.REPO_URL``), and no placeholder is left on any page."""
    from conftest import REPO_URL

    url = REPO_URL.rstrip("/")
    audit = (site / "audit" / "index.html").read_text()
    gallery = (site / "gallery" / "index.html").read_text()
    assert f'pip install "vae-ddp @ git+{url}"' in _page_text(audit), "install command missing on /audit/"
    assert f"git clone {url} && cd" in _page_text(gallery), "clone command missing on /gallery/"
    for html in (audit, gallery):
        assert f'<a href="{url}">the repository</a>' in html
    keep = _page_text((site / "keep-it-fixed" / "index.html").read_text())
    assert f'VAE_DDP: "vae-ddp @ git+{url}"' in keep, "the workflow's install line lacks the repository"
    keys = _site_hooks().PLACEHOLDERS + (_site_hooks().REPO_URL,)
    left = [(path, k) for path in pages(site)
            for k in keys if k in _page_text((site / path.strip("/") / "index.html").read_text())]
    assert not left, f"placeholders not rendered: {left}"


#: Markdown that did not render: a link, a cross-reference, a snippet include, shown as text.
UNRENDERED = re.compile(r"\]\(|\]\[|--8<--|^\s*:::\s+\w", re.M)


def test_no_unrendered_markdown(site):
    """Outside code, no page shows Markdown as text (``[text](page.md)``, ``[`x`][vae_ddp.x]``, a
    snippet include): each would be a link or an include a reader never gets."""
    found = []
    for path in pages(site):
        html = (site / path.strip("/") / "index.html").read_text()
        html = re.sub(r"(?is)<(pre|code)\b.*?</\1>", " ", html)
        for m in UNRENDERED.finditer(_page_text(html)):
            found.append((path, _page_text(html)[max(0, m.start() - 40):m.end() + 40].replace("\n", " ")))
    assert not found, f"unrendered Markdown on the site: {found[:10]}"


def test_factor_pages_put_the_result_first(site):
    """Each factor page opens with its result (worded by its script from the data) and a figure,
    and keeps the whole script in a collapsed block."""
    for name in ("noise", "batchnorm", "sampler", "reduction", "logging", "optimizer"):
        html = (site / "factors" / name / "index.html").read_text()
        article = html[html.index("<h1"):]
        first_p = re.search(r"<p>(.*?)</p>", article, re.S).group(1)
        assert first_p.startswith("<strong>Result.</strong>"), (name, first_p[:200])
        assert re.search(rf'<img [^>]*src="[^"]*factor_{name}\.png"', article), name
        assert article.index("Result.") < article.index("<h2"), name
        assert re.search(r'<details class="example">\s*<summary>The whole script', article), name
        assert (site / "generated" / f"factor_{name}" / f"factor_{name}.png").stat().st_size > 0


def test_factor_pages_show_the_number_home_ranks_them_by(site):
    """One quantity: each factor page states what the factor changes in one step at the report's
    scale (its kind, bias and noise ratio), in the same words as Home's factor table, both read
    from the committed report-scale JSON (or says it has none)."""
    from vae_ddp.fixes import registry
    from vae_ddp.studies.report_scale import effect_cell, effect_line

    effects = _runner().report_scale_effects(ROOT)
    assert effects, "no committed report-scale study"
    rows = re.findall(r"(?s)<tr>(.*?)</tr>", (site / "index.html").read_text())
    for f in registry.factors():
        text = _page_text((site / f.page.replace(".md", "") / "index.html").read_text())
        if f.key in effects:  # every term's words and intervals (logging: the plotted value)
            assert effect_line(effects[f.key]) in text, (f.key, effect_line(effects[f.key]))
        if f.key in effects and "gradient" in effects[f.key]:
            words = effect_cell(effects[f.key]["gradient"])
            assert words in text, (f.key, words)
            # the factor table's row: the factor's page link, then the same words
            row = next(_page_text(r) for r in rows
                       if re.search(rf'<td[^>]*><a href="[^"]*{f.key}/">{re.escape(f.name)}</a></td>', r))
            assert words in row, (f.key, row)
        elif f.key not in effects:
            assert "this factor has no row" in text, f.key


def test_reproduce_page_shows_the_whole_script_as_code(site):
    """The code blocks inside examples/vae.py's docstring do not end the page's code block."""
    html = (site / "reproduce" / "index.html").read_text()
    block = html[html.index("examples/vae.py</span>"):]
    block = block[:block.index("</code></pre>")]
    assert "class ReportCLI" in _page_text(block) and "if __name__" in _page_text(block)


def _search(browser, server, query: str, every: bool = True) -> list[str]:
    """The pages (URL paths) Material's search box lists for ``query``, best first (``every``:
    all of them; else those of the first batch it renders)."""
    page = browser.new_page()
    page.goto(server + "/", wait_until="networkidle")
    box = page.locator("input.md-search__input")
    box.click()
    box.press_sequentially(query, delay=20)
    # Material's worker answers in one go: the meta line then says "N matching documents"; the
    # list renders its items ten at a time as it scrolls, so scroll until all N are there
    meta = ".md-search-result__meta"
    page.wait_for_function(f"() => /\\d+ matching|No matching/.test(document.querySelector('{meta}')?.textContent)",
                           timeout=20000)
    found = re.search(r"(\d+) matching", page.text_content(meta))
    total = int(found.group(1)) if found else 0
    items = ".md-search-result__item"
    while every and (count := page.locator(items).count()) < total:
        page.eval_on_selector(".md-search__scrollwrap", "el => el.scrollTo(0, el.scrollHeight)")
        page.wait_for_function(f"n => document.querySelectorAll('{items}').length > n", arg=count, timeout=20000)
    paths = page.eval_on_selector_all(".md-search-result__item > a", "els => els.map(e => new URL(e.href).pathname)")
    page.close()
    return list(dict.fromkeys(paths))  # in Material's order, best first


def test_search_finds_kl_on_the_pages_that_explain_it(server, browser):
    """Searching "KL" lists the noise and logging pages (two-letter terms are searchable)."""
    found = _search(browser, server, "KL")
    for page in ("/factors/noise/", "/factors/logging/"):
        assert page in found, f"search for KL: {page} not among {found}"


@pytest.mark.parametrize("query, pages", [("seed", ["/factors/noise/"]), ("sampler", ["/factors/sampler/"]),
                                          ("KL", ["/factors/noise/", "/factors/logging/"])])
def test_search_puts_the_factor_page_first(server, browser, query, pages):
    """What a reader types for a factor finds its page first, above the API reference and the
    pages that only mention it (the factor pages name those words as ``tags`` in their metadata,
    which Material's search weighs far above the text)."""
    found = _search(browser, server, query, every=False)
    assert found and found[0] in pages, f"search for {query!r}: first {found[:3]}, expected one of {pages}"


def test_wide_tables_are_reachable_on_a_phone(rendered):
    """At 390 px width no page is wider than the screen, and every table either fits or
    scrolls sideways inside its own box (so its last column, e.g. Home's Fix, is reachable)."""
    problems = []
    for path, r in rendered["phone"].items():
        if r["width"] > _PHONE["width"] + 1:
            problems.append(f"{path}: the page is {r['width']} px wide")
        problems += [f"{path}: table '{t['head']}' neither fits nor scrolls" for t in r["tables"]
                     if not (t["fits"] or t["scrolls"])]
    assert not problems, "\n".join(problems)


def test_tables_fit_the_column_on_a_desktop_and_show_the_verdict_on_a_phone(rendered):
    """At 1280 x 800 no table (collapsed blocks opened) is wider than the column it sits in,
    so no column is cut off; at 390 x 844 the verdict column of every table that has one is
    on the screen without scrolling sideways."""
    problems = []
    for path, r in rendered["desktop"].items():
        problems += [f"1280 px: {path}: table '{t['head']}' is {t['width']} px wide in a {t['column']} px column"
                     for t in r["widths"] if t["width"] > t["column"] + 1]
    for path, r in rendered["phone"].items():
        problems += [f"390 px: {path}: the verdict column of '{t['head']}' ends at {t['verdictRight']:.0f} px, "
                     f"off the screen" for t in r["widths"]
                     if t["verdictRight"] is not None and t["verdictRight"] > _PHONE["width"] + 1]
    assert not problems, "\n".join(problems)


#: The pages a reader of the answer reads whole: no table on them scrolls sideways on a phone.
MAIN_PAGES = ["/", "/is-it-a-bug/", "/dataparallel/", "/audit/", "/factors/optimizer/"]


@pytest.mark.parametrize("path", MAIN_PAGES)
def test_no_table_of_a_main_page_scrolls_sideways_on_a_phone(rendered, path):
    """At 390 x 844 every table of the main pages (collapsed blocks opened) is as narrow as its column:
    each row is read as a block of "header: value" lines (tools/site_hooks.py labels the cells,
    docs/stylesheets/extra.css stacks them), none scrolls sideways. Before the stacking, 29 of Home's
    tables scrolled."""
    widths = rendered["phone"][path]["widths"]
    assert widths, f"{path}: no table, nothing checked"
    problems = [f"{path}: table '{t['head']}' is {t['width']} px wide in a {t['column']} px column"
                for t in widths if t["width"] > t["column"] + 1]
    assert not problems, "\n".join(problems)


def test_the_reply_and_the_command_for_2_gpus_fit_their_boxes(server, browser):
    """The reply for #6789 wraps (no line wider than its box) at 1280 and at 390 px, and the report's
    command with every change fits its box at 1280 px, on "Is it a bug?"."""
    problems = []
    for viewport in (_DESKTOP, _PHONE):
        page = browser.new_page(viewport=viewport)
        page.goto(server + "/is-it-a-bug/", wait_until="networkidle")
        reply = page.locator("article .reply pre code").first
        sizes = reply.evaluate("e => [e.scrollWidth, e.clientWidth, e.innerText.split(/\\s+/).length]")
        assert sizes[2] > 50, f"the reply is {sizes[2]} words: not found"
        if sizes[0] > sizes[1] + 1:
            problems.append(f"{viewport['width']} px: the reply is {sizes[0]} px wide in a {sizes[1]} px box")
        if viewport is _DESKTOP:
            command = page.locator("article pre code", has_text="use_distributed_sampler false").first
            sizes = command.evaluate("e => [e.scrollWidth, e.clientWidth]")
            if sizes[0] > sizes[1] + 1:
                problems.append(f"1280 px: the command for 2 GPUs is {sizes[0]} px wide in a {sizes[1]} px box")
        page.close()
    assert not problems, "\n".join(problems)


def test_is_it_a_bug_is_among_the_first_navigation_items(rendered):
    """"Is it a bug?", the question most readers come with, is one of the first three items of
    the navigation after Home."""
    nav = rendered["desktop"]["/"]["nav"]
    assert nav[:1] == ["Home"] and "Is it a bug?" in nav[1:4], f"the navigation: {nav}"


#: The pages a reader starts from: on each, every table and code block that starts on the first
#: phone screen fits its width (390 px) without scrolling sideways. A URL path, or a folder of pages.
FIRST_SCREEN_PAGES = ["/", "/is-it-a-bug/", "/factors/", "/questions/"]


@pytest.mark.parametrize("where", FIRST_SCREEN_PAGES)
def test_first_phone_screen_fits(rendered, where):
    """At 390 x 844, every table and code block that starts on the first screen (no scrolling)
    of Home, "Is it a bug?", the factor pages and the question pages fits the screen's width:
    it does not scroll sideways and ends on the screen."""
    paths = ([p for p in rendered["phone"] if p == where]  # a page, or the pages of a folder
             or [p for p in rendered["phone"] if p.startswith(where)])
    assert len(paths) >= (1 if where in rendered["phone"] else 6), f"{where}: {paths}"
    problems = [f"{path}: {e['kind']} '{e['what']}' is {e['width']} px wide, {e['over']} px more than the screen has"
                for path in paths for e in rendered["phone"][path]["first_screen"] if not e["fits"]]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", ["/audit/", "/scaling/"])
def test_code_blocks_scroll_inside_their_block_on_a_phone(rendered, path):
    """At 390 px the long lines of the audit and scaling pages' code blocks (collapsed blocks
    opened) scroll inside their block, which stays on the screen; the page itself does not
    scroll sideways."""
    *blocks, page = rendered["phone"][path]["code"]
    assert any(b["wide"] for b in blocks), f"{path}: no code block wider than the screen, nothing checked"
    problems = [f"{path}: code block '{b['first']}' "
                + ("runs off the screen" if not b["inside"] else "does not scroll")
                for b in blocks if not b["inside"] or (b["wide"] and not b["scrolls"])]
    if page["page"] > _PHONE["width"] + 1:
        problems.append(f"{path}: the page is {page['page']} px wide with its collapsed blocks open")
    assert not problems, "\n".join(problems)
