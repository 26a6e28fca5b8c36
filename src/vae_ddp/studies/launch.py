"""Start a run in its own process tree and collect what rank 0 wrote.

Each run is ``python -m vae_ddp.studies.runner SPEC_JSON OUT_DIR``; Lightning's DDP launcher then
starts the other ranks by re-running that command. If any rank fails, Lightning ends the
whole group (rank 0 kills its children on an exception; ``_ChildProcessObserver``
SIGKILLs everyone when a child exits non-zero), so the run returns a non-zero code
instead of hanging; [`launch`][vae_ddp.studies.launch.launch] then raises [`RunFailed`][vae_ddp.studies.launch.RunFailed] with the end of the
failing process's stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

from vae_ddp.studies.configs import RunSpec

__all__ = ["launch", "RunFailed"]

_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_][\w.]*(Error|Exception)(:|$)")


class RunFailed(RuntimeError):
    """A training run exited non-zero; ``str()`` holds its label, exit code and stderr tail."""


def launch(spec: RunSpec, out_dir: Path, timeout: Optional[float] = None, quiet: bool = False,
           entry: Optional[list[str]] = None) -> dict:
    """Run ``spec`` (already validated) in a child process; return its ``run.json``.

    Progress lines stream to this process's stdout (unless ``quiet``); stderr goes to
    ``out_dir/stderr.log``. ``entry`` replaces ``[python, -m, vae_ddp.studies.runner]`` (tests use
    it to inject a failing rank).

    Raises:
        RunFailed: non-zero exit (any rank failed) or ``timeout`` seconds exceeded.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run.json").unlink(missing_ok=True)
    log = out_dir / "stderr.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    if spec.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun: do not let N ranks x all cores threads fight over the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
    cmd = (entry or [sys.executable, "-m", "vae_ddp.studies.runner"]) + [spec.to_json(), str(out_dir)]
    with open(log, "w") as err:
        try:
            proc = subprocess.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=err, env=env,
                                  timeout=timeout, start_new_session=False)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not (out_dir / "run.json").exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        # the first exception line is the rank that failed first; the others follow from it
        first = next((ln for ln in lines if _ERROR_LINE.match(ln)), None)
        what = "timed out" if code is None else f"exited with code {code}"
        head = f"run '{spec.label}' {what}" + (f"; first error: {first}" if first else "")
        raise RunFailed(f"{head}\n(full stderr of all ranks: {log}; it ends with:)\n" + "\n".join(lines[-8:]))
    return json.loads((out_dir / "run.json").read_text())
