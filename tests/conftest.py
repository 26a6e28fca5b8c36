import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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


def _hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_generate_hook", ROOT / "docs" / "hooks" / "generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def needs_cifar(entry: dict) -> bool:
    """Whether a registry entry reads the CIFAR-10 subset (``--data imagefolder`` or a path to
    it); the others train on the bundled digits and run without any data folder."""
    args = entry["full_args"] if FULL else entry["args"]
    return any(a == "imagefolder" or "cifar10-jpg-subset" in a for a in args)


@pytest.fixture(scope="session")
def generated(request):
    """``generated(name) -> dict``: run the docs registry entry ``name`` (docs/examples.yml) the
    way the site build does, cached by the same hash, and return the JSON it wrote. The site
    and the tests thus read one execution of each example and study. Only entries that read
    the CIFAR-10 subset need it (through the ``cifar_dir`` fixture)."""
    import json

    hook = _hook()
    entries = {e["name"]: e for e in hook.load_registry(ROOT)}

    def get(name: str, filename: str | None = None) -> dict:
        if needs_cifar(entries[name]):
            request.getfixturevalue("cifar_dir")
        hook.run_entry(ROOT, entries[name])
        out = ROOT / hook.GENERATED / name
        assert (out / "stdout.txt").read_text().strip(), f"{name} printed nothing"
        return json.loads((out / (filename or f"{name}.json")).read_text())

    return get


# --------------------------------------------------------------------------- the site build
# The site build (``mkdocs build --strict``, which runs every example of the docs registry) is
# the longest step of the suite: when the session has a test that reads the built site, it
# starts as soon as the tests are collected and runs beside them, and the tests that read it
# run last. The docs hook locks each example, so an example a test asks for while the build
# runs it is run once and read by both.
#
# Under pytest-xdist (``make test`` runs ``pytest -n 2``) the controller starts the one build
# and owns it: the workers say that they need it (the file ``needed`` in the folder the
# controller names in $VAE_DDP_TEST_SITE before it starts them). The build holds an exclusive
# lock on ``lock`` until it has written its exit code to ``rc``; a worker waits for the lock.
# A build ends with the session that started it (the controller, or the one pytest process).
_SITE: dict = {}
SHARED = "VAE_DDP_TEST_SITE"
_RC = "import pathlib, subprocess, sys; pathlib.Path(sys.argv[1]).write_text(str(subprocess.call(sys.argv[2:])))"


def _start_site_build(out: Path | None = None) -> None:
    import fcntl

    from vae_ddp.guard import guarded

    out = Path(out) if out else Path(tempfile.mkdtemp(prefix="vae-ddp-site-"))
    log = open(out / "build.log", "w+")
    lock = open(out / "lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)  # held by the guard from here until the build has ended
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    # under a guard: the build and every example it runs end with the session, even when
    # pytest itself is killed (SIGTERM/SIGKILL skip pytest_sessionfinish)
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out / "site")]
    cmd = guarded([sys.executable, "-c", _RC, str(out / "rc"), *build], stall=3600)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            pass_fds=(lock.fileno(),))
    lock.close()
    _SITE.update(proc=proc, out=out, log=log, t0=time.monotonic())


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """The xdist controller names the folder of the shared build before it starts the workers."""
    if not _is_worker(config) and getattr(config.option, "numprocesses", None):
        os.environ[SHARED] = tempfile.mkdtemp(prefix="vae-ddp-site-")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reports its collection to the controller
def pytest_collection_finish(session):
    if session.config.option.collectonly:
        return
    if any("site" in getattr(item, "fixturenames", ()) for item in session.items):
        if _is_worker(session.config):
            (Path(os.environ[SHARED]) / "needed").touch()
        else:
            _start_site_build()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Controller: start the build once, when the first worker that needs it has collected
    (before any test is handed out)."""
    shared = Path(os.environ[SHARED])
    if not _SITE and (shared / "needed").exists():
        _start_site_build(shared)


def site_build() -> tuple[Path, str, float]:
    """Wait for the site build (start it if the session did not) and return the built site's
    folder, the build's output and its duration in seconds."""
    import fcntl

    if "PYTEST_XDIST_WORKER" in os.environ:  # the controller's build
        out = Path(os.environ[SHARED])
        assert (out / "lock").exists(), "the test session did not start the site build"
    else:
        if not _SITE:
            _start_site_build()
        out = _SITE["out"]
    with open(out / "lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)  # released when the build has ended
    log = (out / "build.log").read_text()
    assert (out / "rc").exists(), f"the site build was ended before it finished:\n{log[-8000:]}"
    assert (out / "rc").read_text() == "0", f"mkdocs build --strict failed:\n{log[-8000:]}"
    return out / "site", log, (out / "rc").stat().st_mtime - (out / "lock").stat().st_mtime


def pytest_collection_modifyitems(config, items):
    """Full-size studies run only with VAE_DDP_FULL=1 (`make test-full`); CI runs the reduced
    ones. Tests that read the built site run last and may wait for the build (1 hour)."""
    later = [i for i in items if "site" in getattr(i, "fixturenames", ())]
    items[:] = [i for i in items if i not in later] + later
    for item in later:
        item.add_marker(pytest.mark.timeout(3600))
    if FULL:
        return
    skip = pytest.mark.skip(reason="full-size study: run with VAE_DDP_FULL=1 (make test-full)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if _is_worker(session.config):
        return  # the controller owns the shared build
    if _SITE:
        if _SITE["proc"].poll() is None:
            _SITE["proc"].terminate()  # the guard ends the build's whole tree
            _SITE["proc"].wait(timeout=30)
        _SITE["log"].close()
    out = _SITE.get("out") or (Path(os.environ[SHARED]) if os.environ.get(SHARED) else None)
    if out:
        shutil.rmtree(out, ignore_errors=True)
