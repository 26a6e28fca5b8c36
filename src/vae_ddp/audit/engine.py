"""The engine of ``vae-ddp audit`` and of [`vae_ddp.audit.api.audit`][vae_ddp.audit.api.audit]: a parsed
configuration in, ``audit.json``'s dict out. The command line (``vae_ddp.audit.cli``)
maps its exceptions to exit codes, the Python API to exceptions of its own.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["run_config"]


def run_config(cfg: Any, out: Path, command: str, progress: bool = True, cwd: Optional[str] = None,
               instances: Optional[dict] = None) -> dict:
    """The audit of a parsed configuration ``cfg`` (the audit parser's namespace, ``--out`` aside)
    into ``out`` (absolute): the pre-flight checks, the cost line, the audit under the folder's lock
    ([`out_folder_lock`][vae_ddp.utils.out_folder_lock], ``command`` naming the holder). The runs
    start in ``cwd`` (default: this process's working folder when called). The engine of ``vae-ddp audit`` and of
    [`audit`][vae_ddp.audit.api.audit]. ``instances``: the API's pickled instances
    ([`AuditRun.instances`][vae_ddp.audit.spec.AuditRun]).

    Returns:
        ``study.audit``'s dict (``audit.json``).

    Raises:
        UserError: bad input, before any training. RunFailed: a run failed or hung.
    """
    from vae_ddp import zygote
    from vae_ddp.audit import preflight
    from vae_ddp.audit.study import audit as study_audit
    from vae_ddp.lightning_package import env_for
    from vae_ddp.outputs import own_folder
    from vae_ddp.utils import out_folder_lock

    cwd = cwd or os.getcwd()
    run, model_cls, data_cls = preflight.audit_run(cfg.as_dict() if hasattr(cfg, "as_dict") else cfg)
    run = run.replace(instances=dict(instances or {}))
    if run.accelerator == "cpu":  # the runs' process imports torch and Lightning beside the checks below
        zygote.warm("vae_ddp.audit.run", env_for(run.lightning))
    cost: list[str] = []
    sizes: dict[str, int] = {}
    with contextlib.redirect_stdout(io.StringIO()):  # the checks call training_step dozens of times: not shown
        static, notes = preflight.check(run, data_cls, model_cls, cost, sizes)
    run = run.replace(param_count=sizes.get("param_count", 0))  # what the runs write: the space check's estimate
    if os.getcwd() != cwd:  # the user's __init__ changed the working folder: the runs start where the caller was
        os.chdir(cwd)
    out = preflight.writable(out)
    own_folder(out / "runs")  # a planted link refused in one line, before the cost line
    if progress:
        for line in cost:  # before anything starts: what the world size costs
            print(f"[audit] cost: {line}", file=sys.stderr, flush=True)
    with out_folder_lock(out, command):
        return study_audit(run, out, static=static, notes=notes, progress=progress)
