"""Small helpers shared by the examples and the studies."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

__all__ = ["quiet", "close_process_group", "check_writable"]


def quiet() -> None:
    """Silence Lightning's informational chatter in child processes (warnings stay on stderr)."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")


def close_process_group() -> None:
    """Destroy the default process group after a successful run, on every rank.

    Lightning 2.6 leaves it alive after ``fit`` (it destroys it only on an exception); gloo's
    worker threads are then destroyed during interpreter finalization, which now and then
    aborts the process with "terminate called without an active exception" after the run
    has finished (pytorch/pytorch#190489: calling ``destroy_process_group`` avoids it). The
    barrier lets every rank finish its last collective before rank 0, which hosts the
    TCPStore, tears down. Not called after a failure (a rank may be inside a collective;
    pytorch/torchtitan#1342).
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def check_writable(out_dir: "str | Path") -> Path:
    """``out_dir`` as a ``Path`` once it is known to be a folder that can be created and written
    into: checked before any training by creating it and a scratch file, then removing what the
    check created (a mistyped path leaves nothing behind).

    Raises:
        NotADirectoryError: ``out_dir`` is a file.
        PermissionError: it cannot be created or written (any ``OSError`` there).
    """
    import os
    import tempfile

    out = Path(out_dir).expanduser()
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} is a file, not a folder: choose a folder path")
    created, p = [], out
    while not p.exists():
        created.append(p)
        p = p.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, scratch = tempfile.mkstemp(dir=out, prefix=".write-check-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as err:
        raise PermissionError(f"out_dir {out} is not writable ({err.strerror or err}): choose a folder you can write "
                              "to") from None
    finally:
        for d in created:  # deepest first
            try:
                d.rmdir()
            except OSError:
                pass
    return Path(out_dir)
