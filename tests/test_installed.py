"""The package as a user installs it, and the user's side of "Keep it fixed" (docs/keep-it-fixed.md).

The wheel of this checkout is built and installed into a fresh virtual environment that sees this
interpreter's site-packages (torch, Lightning, pytest: as ``--system-site-packages`` would, without
downloading them; the checkout's own editable install is not seen there), and the user's test file
of the page (examples/keep_it_fixed/test_ddp.py) runs there with pytest, laid out as the page's
GitHub Actions workflow (examples/keep_it_fixed/ddp.yml) expects it, by that workflow's own test
command. One audit of a small model: about a minute on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import site
import sys
from pathlib import Path

import pytest
import yaml

from helpers import ROOT
from vae_ddp import guard

EXAMPLE = ROOT / "examples" / "keep_it_fixed"


def _workflow() -> dict:
    return yaml.safe_load((EXAMPLE / "ddp.yml").read_text())


def _steps(workflow: dict) -> dict:
    return {s.get("name", s.get("uses")): s for s in workflow["jobs"]["ddp"]["steps"]}


def test_the_workflow_installs_the_package_and_runs_the_test_file():
    """The workflow a user copies: checkout, Python, an install step that installs vae-ddp (from
    ``$VAE_DDP``), pytest and what the test file imports, and a test step that runs the file the page
    shows, at the path the page gives it."""
    workflow = _workflow()
    assert workflow[True] == ["push", "pull_request"]  # YAML 1.1 reads the key `on` as true
    job = workflow["jobs"]["ddp"]
    assert job["runs-on"] == "ubuntu-latest" and job["timeout-minutes"] >= 10 and job["env"]["VAE_DDP"]
    steps = _steps(workflow)
    assert list(steps)[:2] == ["actions/checkout@v4", "actions/setup-python@v5"]
    install = steps["Install"]["run"].splitlines()
    assert 'python -m pip install "$VAE_DDP" pytest pytest-timeout scikit-learn' in install
    assert steps["Test"]["run"].strip() == "python -m pytest tests/test_ddp.py"
    imported = {line.split()[1].split(".")[0] for line in (EXAMPLE / "test_ddp.py").read_text().splitlines()
                if line.startswith(("import ", "from "))}
    assert imported == {"pytest", "torch", "pytorch_lightning", "sklearn", "vae_ddp"}  # what the install step brings


@pytest.mark.timeout(600)
def test_the_workflows_install_line_installs_the_project_from_its_repository(tmp_path):
    """The workflow's ``VAE_DDP`` is the project installed from its repository (``vae-ddp @ git+<address>``,
    the address the site writes): with the address of a local clone, pip installs it into a throwaway
    environment (no dependencies, no index), and the package imports from there."""
    requirement = _workflow()["jobs"]["ddp"]["env"]["VAE_DDP"]
    name, _, address = requirement.partition(" @ git+")
    assert name == "vae-ddp" and address == "{{repo_url}}", requirement
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        timeout=60).strip())
    (purelib / "_system_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")  # setuptools
    # the repository as the Pages workflow leaves it: its site address written in (tools/site_address.py)
    clone = tmp_path / "clone"
    _run(["git", "clone", "-q", str(ROOT), str(clone)], timeout=120)
    _run([sys.executable, str(ROOT / "tools" / "site_address.py"), SITE, str(clone / "pyproject.toml")], timeout=60)
    _run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "site address"], timeout=60, cwd=clone)
    local = requirement.replace("{{repo_url}}", clone.as_uri())
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--no-build-isolation", "-q", local], timeout=500, cwd=tmp_path)
    where = _run([str(python), "-c", "import vae_ddp; print(vae_ddp.__file__)"], timeout=120, cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(purelib), where
    # a message of the installed package names a page a user can open, under the site's address
    url = _run([str(python), "-c", "from vae_ddp.fixes.factor import page_url; print(page_url('factors/noise.md'))"],
               timeout=120, cwd=tmp_path)
    assert url.strip() == SITE + "factors/noise/", url


SITE = "https://owner.github.io/vae-ddp/"


#: this process's environment without what points Python at the checkout (PYTHONPATH) or at pytest's run
ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PYTEST")}


def _run(cmd: list[str], timeout: float, **popen) -> str:
    proc = guard.run(cmd, timeout=timeout, capture_output=True, text=True, **{"env": ENV, **popen})
    log = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{log}"
    return proc.stdout


@pytest.mark.timeout(900)
def test_the_installed_package_runs_the_users_test_file(tmp_path):
    # the wheel, built from a copy of what it is made of (no build files in the checkout)
    source = tmp_path / "source"
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(tmp_path / "dist"), str(source)], timeout=300)
    wheel, = (tmp_path / "dist").glob("vae_ddp-*.whl")

    # a fresh environment that sees this interpreter's site-packages (torch, Lightning, pytest)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
    python = venv / "bin" / "python"
    purelib = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        timeout=60).strip())
    (purelib / "_system_site_packages.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
          str(wheel)], timeout=300)
    env = dict(ENV)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    where = _run([str(python), "-c", "import vae_ddp, vae_ddp.testing; print(vae_ddp.__file__)"], timeout=120,
                 env=env, cwd=tmp_path)
    assert Path(where.strip()).is_relative_to(purelib), where  # the wheel's, not the checkout's

    # the user's project as the workflow expects it, tested by the workflow's own test command
    project = tmp_path / "project"
    (project / "tests").mkdir(parents=True)
    shutil.copy(EXAMPLE / "test_ddp.py", project / "tests" / "test_ddp.py")
    command = _steps(_workflow())["Test"]["run"]
    out = _run(["bash", "-c", command], timeout=800, env=env, cwd=project)
    assert "1 passed" in out, out[-3000:]
