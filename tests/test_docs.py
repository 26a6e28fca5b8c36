"""The documentation site: strict build, its Python code blocks, and the pages in a browser.

One site build (``mkdocs build --strict``, which runs every registered example through
``docs/hooks/generate.py``, cached by content) is shared by all tests of this module.
Broken internal links and anchors fail the strict build (``validation`` in mkdocs.yml).

The browser test drives Debian's ``chromium`` (``/usr/bin/chromium``) with Playwright's
Python package; it never downloads a browser. ``make test`` installs chromium first
(``make browser``: ``apt-get install chromium`` when it is missing and apt is there); the
test itself installs nothing and is skipped, saying why, when chromium is absent.
"""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
CHROMIUM = "/usr/bin/chromium"

pytestmark = pytest.mark.docs


# --------------------------------------------------------------------------- the build

@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once with ``mkdocs build --strict`` into a temporary folder."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-8000:]}"
    print(f"mkdocs build --strict: {time.monotonic() - t0:.0f} s")
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
    assert not list((site / "generated").rglob("*.md")) and not (site / "hooks").exists()
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
    hook = _hook()
    entries = [e for e in hook.load_registry(ROOT) if e["output"] == "tables"]
    assert {"demo", "equivalence", "ablation", "seeds", "step_time"} <= {e["name"] for e in entries}
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


# --------------------------------------------------------------------------- the hook

def _hook():
    spec = importlib.util.spec_from_file_location("docs_generate_hook", DOCS / "hooks" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def test_hook_runs_caches_and_summarises(tmp_path):
    hook = _hook()
    root = _project(tmp_path, {"good.py": GOOD},
                    "examples:\n  - script: examples/good.py\n    summary: true\n    page: factors/noise.md\n")
    assert hook.generate(root) == {"good": "ran"}
    out = root / "docs" / "generated" / "good"
    assert "| 1 | 2 |" in (out / "output.md").read_text()
    assert "python examples/good.py --out docs/generated/good" in (out / "command.md").read_text()
    summary = (root / "docs" / "generated" / "summary" / "output.md").read_text()
    assert "[noise](factors/noise.md)" in summary and "GlobalBatchNoise" in summary
    assert hook.generate(root) == {"good": "cached"}
    (root / "examples" / "good.py").write_text(GOOD + "\n# changed\n")
    assert hook.generate(root) == {"good": "ran"}


def test_hook_failing_example_fails_the_build_with_its_stderr(tmp_path):
    hook = _hook()
    root = _project(tmp_path, {"bad.py": "import sys\nprint('boom: the reason', file=sys.stderr)\nsys.exit(3)\n"},
                    "examples:\n  - script: examples/bad.py\n")
    with pytest.raises(hook.PluginError, match=r"(?s)exit code 3.*boom: the reason"):
        hook.generate(root)


def test_hook_registry_errors(tmp_path):
    hook = _hook()
    root = _project(tmp_path, {}, "examples:\n  - script: examples/missing.py\n")
    with pytest.raises(hook.PluginError, match="does not exist"):
        hook.generate(root)
    (root / "docs" / "examples.yml").write_text("examples:\n  - name: x\n    command: [true]\n    colour: red\n")
    with pytest.raises(hook.PluginError, match="unknown key"):
        hook.generate(root)


TABLES = """
import argparse, pathlib, sys
sys.path.insert(0, {src!r})
from vae_ddp.studies.table import format_table, write_tables
p = argparse.ArgumentParser(); p.add_argument("--out", type=pathlib.Path); a = p.parse_args()
md = format_table(["n", "max |a - b|"], [[2, 0.5]], title="after 3 steps")
print("progress line, not for the page")
print(md)
write_tables(a.out, md)
"""


def test_hook_output_tables_is_the_file_the_entry_wrote(tmp_path):
    """``output: tables``: output.md is the entry's tables.md, not its stdout; a pipe inside a
    cell stays content (escaped), so the table keeps its two columns."""
    hook = _hook()
    root = _project(tmp_path, {"study.py": TABLES.format(src=str(ROOT / "src"))},
                    "examples:\n  - script: examples/study.py\n    output: tables\n")
    assert hook.generate(root) == {"study": "ran"}
    out = root / "docs" / "generated" / "study"
    assert (out / "output.md").read_text() == (
        "after 3 steps\n\n| n | max \\|a - b\\| |\n|---|---------------|\n| 2 | 0.5000        |\n")
    assert "progress line" in (out / "stdout.txt").read_text()


def test_hook_output_tables_missing_file_fails(tmp_path):
    hook = _hook()
    root = _project(tmp_path, {"quiet.py": "print('| a |\\n|---|\\n| 1 |')\n"},
                    "examples:\n  - script: examples/quiet.py\n    output: tables\n")
    with pytest.raises(hook.PluginError, match=r"`output: tables` but wrote no tables.md"):
        hook.generate(root)


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


@pytest.mark.parametrize("example", _code_examples(), ids=str)
def test_code_blocks(example, eval_example):
    """Every Python block of docs/**/*.md and README.md runs; a block that prints has its
    output below the print (``#> ...``) and it must match. Shell blocks (```bash) are not
    run. Opt out with ```python test="skip"``."""
    if _is_snippet_include(example.source):
        pytest.skip("a file included with pymdownx.snippets (the example registry runs it)")
    if example.prefix_settings().get("test") == "skip":
        pytest.skip('marked test="skip"')
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        eval_example.run_print_check(example)
    finally:
        os.chdir(cwd)


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


def test_pages_in_browser(site, server, browser):
    """Every page loads without console errors and with every image loaded."""
    problems = []
    for path in pages(site):
        page = browser.new_page()
        errors = []
        page.on("console", lambda msg, errors=errors: errors.append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc, errors=errors: errors.append(str(exc)))
        page.goto(server + path, wait_until="networkidle")
        images = page.eval_on_selector_all(
            "img", "els => els.map(e => ({src: e.getAttribute('src'), ok: e.complete && e.naturalWidth > 0}))")
        problems += [f"{path}: console error: {e}" for e in errors]
        problems += [f"{path}: image not loaded: {img['src']}" for img in images if not img["ok"]]
        page.close()
    assert not problems, "\n".join(problems)


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
