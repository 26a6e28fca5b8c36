import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from helpers import ROOT, load_script

CIFAR_SUBSET = Path(os.environ.get("VAE_DDP_CIFAR_SUBSET", ROOT.parent / "shared" / "data" / "cifar10-jpg-subset"))
FULL = os.environ.get("VAE_DDP_FULL") == "1"


@pytest.fixture(scope="session")
def cifar_dir() -> Path:
    if not (CIFAR_SUBSET / "train").is_dir():
        pytest.fail(f"the shared CIFAR-10 subset is missing at {CIFAR_SUBSET} (see ../shared/data/README.md)")
    return CIFAR_SUBSET


def run_cli(*args: str, timeout: float = 600):
    """``vae-ddp ARGS`` under a guard: on timeout every process of the run ends."""
    from vae_ddp import guard

    return guard.run([sys.executable, "-m", "vae_ddp.cli", *args], capture_output=True, text=True,
                     timeout=timeout, cwd=ROOT)


#: Fixtures of the tests that read the built site (they wait for the site build).
SITE_FIXTURES = {"site", "server", "browser"}
#: Test files whose time is mostly waiting on timers (the guard's watchdog, timeouts, signals): first,
#: while the site build computes on the cores they leave idle.
WAITING = ("tests/test_guard.py",)


def _order(item) -> int:
    """-1: tests that mostly wait (``WAITING``); 0: the other tests that need nothing of the site
    build; 1: tests that read an entry of the docs registry (``generated``), which the build runs
    too; 2: tests that read the built site."""
    names = set(getattr(item, "fixturenames", ()))
    if SITE_FIXTURES & names:
        return 2
    if "generated" in names:
        return 1
    return -1 if item.nodeid.startswith(WAITING) else 0


def pytest_collection_modifyitems(config, items):
    """The tests that need nothing of the site build run first, beside it (those that mostly wait
    first of all); then those that read the registry's entries (by then mostly run by the build);
    the tests that read the built site last. Full-size studies run only with VAE_DDP_FULL=1 (`make test-full`),
    CI runs the reduced ones."""
    items.sort(key=_order)  # stable: file order within each group
    if FULL:
        return
    skip = pytest.mark.skip(reason="full-size study: run with VAE_DDP_FULL=1 (make test-full)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _runner():
    return load_script("tools/results.py", "vae_ddp_results")


def needs_cifar(entry: dict) -> bool:
    """Whether a registry entry reads the CIFAR-10 subset (``--data imagefolder`` or a path to
    it); the others train on the bundled digits and run without any data folder."""
    args = entry["full_args"] if FULL else entry["args"]
    return any(a == "imagefolder" or "cifar10-jpg-subset" in a for a in args)


@pytest.fixture(scope="session")
def generated(request):
    """``generated(name) -> dict``: run the docs registry entry ``name`` (docs/examples.yml) the
    way ``make results`` does (``tools/results.py``), cached by the same hash, and return the JSON
    it wrote. The site and the tests thus read one execution of each example and study. Only
    entries that read the CIFAR-10 subset need it (through the ``cifar_dir`` fixture)."""
    import json

    runner = _runner()
    entries = {e["name"]: e for e in runner.load_registry(ROOT)}

    def get(name: str, filename: str | None = None) -> dict:
        if needs_cifar(entries[name]):
            request.getfixturevalue("cifar_dir")
        runner.run_entry(ROOT, entries[name])
        out = ROOT / runner.GENERATED / name
        assert (out / "stdout.txt").read_text().strip(), f"{name} printed nothing"
        return json.loads((out / (filename or f"{name}.json")).read_text())

    return get


# --------------------------------------------------------------------------- the site build
_SITE: dict = {}

#: The site setting ``repo_url`` of the test build (mkdocs.yml reads $REPO_URL): the address the Pages
#: workflow gives, or one of the addresses reserved for examples, so that the pages that show the
#: install command are built as published (``test_install_command_uses_the_configured_repository``).
REPO_URL = os.environ.get("REPO_URL") or "https://git.example.org/vae-ddp"


def _start_site_build() -> None:
    out = Path(tempfile.mkdtemp(prefix="vae-ddp-site-"))
    log = open(out.with_suffix(".log"), "w+")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", REPO_URL=REPO_URL)
    from vae_ddp.guard import guarded

    # `make results` (every registered example, cached), then `mkdocs build --strict`, which only
    # includes what they wrote; under a guard: the build and every example it runs end with the
    # session, even when pytest itself is killed (SIGTERM/SIGKILL skip pytest_sessionfinish)
    py, site = shlex.quote(sys.executable), shlex.quote(str(out / "site"))
    cmd = guarded(["bash", "-c", f"{py} tools/results.py && {py} -m mkdocs build --strict --site-dir {site}"],
                  stall=3600)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    _SITE.update(proc=proc, out=out, log=log, t0=time.monotonic(), started=time.time())


def pytest_collection_finish(session):
    """The results (``tools/results.py``: every example of the docs registry) and the site build
    (``mkdocs build --strict``) are the longest step of the suite: when the session has a test
    that reads the built site, start them now, beside the other tests. The results runner locks
    each example, so an example a test asks for while the runner runs it is run once and read by both."""
    if session.config.option.collectonly:
        return
    if any("site" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_site_build()


def site_build(timeout: float = 3600) -> tuple[Path, str, float]:
    """Wait for the site build (start it if the session did not) and return the built site's
    folder, the build's output and its duration in seconds."""
    if not _SITE:
        _start_site_build()
    proc = _SITE["proc"]
    try:
        proc.wait(timeout=max(1.0, timeout - (time.monotonic() - _SITE["t0"])))
    except subprocess.TimeoutExpired:
        proc.terminate()  # the guard ends the build's whole tree
        raise
    # how long the build took: until its last line (its log's last write), not until a test asked
    _SITE.setdefault("seconds", os.path.getmtime(_SITE["log"].name) - _SITE["started"])
    _SITE.setdefault("asked", time.monotonic() - _SITE["t0"])
    _SITE["log"].seek(0)
    log = _SITE["log"].read()
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{log[-8000:]}"
    return _SITE["out"] / "site", log, _SITE["seconds"]


def pytest_terminal_summary(terminalreporter):
    """How long the results and the site build took and each docs registry example they ran
    (``results: NAME ran in N s``): they run beside the tests, and these are where the time went."""
    if "seconds" not in _SITE:  # no build, or one the session did not wait for
        return
    ran = [ln.split("results: ", 1)[1] for ln in _SITE.get("text", "").splitlines() if "results: " in ln]
    terminalreporter.write_sep("-", f"site build: {_SITE['seconds']:.0f} s (the first test that reads it asked "
                                    f"after {_SITE['asked']:.0f} s)")
    for line in ran:
        terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _SITE:
        if _SITE["proc"].poll() is None:
            _SITE["proc"].terminate()  # the guard ends the build's whole tree
            _SITE["proc"].wait(timeout=30)
        _SITE["log"].seek(0)
        _SITE["text"] = _SITE["log"].read()  # for pytest_terminal_summary, which runs after this
        _SITE["log"].close()
        shutil.rmtree(_SITE["out"], ignore_errors=True)
        Path(_SITE["log"].name).unlink(missing_ok=True)
