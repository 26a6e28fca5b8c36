"""What a process under a [guard][vae_ddp.guard] tells it: its beats, its stacks, how it ended.

A process beats with [`beat`][vae_ddp.beats.beat] (the ``Trainer``s of this project's launches
through the [`Heartbeat`][vae_ddp.heartbeat.Heartbeat] callback): a file per process in the
guard's folder (``$VAE_DDP_HEARTBEAT_DIR``), touched at each beat, holding the last optimizer step
given; the first beat registers the process (its rank, its main thread) and makes it dump every
thread's stack on SIGUSR1 (``faulthandler``), which the guard's watchdog sends before it names
the frame a rank was stuck in. [`how_it_ended`][vae_ddp.beats.how_it_ended] words a process's
end with its last step. The standard library only: a guard imports it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Optional

__all__ = ["beat", "last_step", "how_it_ended", "under_guard", "say"]

#: The guard's folder, set in the environment of the command it runs.
_ENV_DIR = "VAE_DDP_HEARTBEAT_DIR"
#: A process's role in the guard's messages where it is not a DDP rank (``one device's process``); unset: ``rank N``.
ROLE = "VAE_DDP_ROLE"


def under_guard() -> bool:
    """Whether this process runs under a guard (its heartbeat directory is set)."""
    return bool(os.environ.get(_ENV_DIR))


_STATE: dict[str, Any] = {}


def beat(rank: Optional[int] = None, step: Optional[int] = None) -> None:
    """Tell the guard (if any) that this process made progress; the first call also makes the
    process dump its stacks on SIGUSR1. ``rank``: the global rank (default ``$RANK`` or 0);
    ``step``: the optimizer steps it has made (kept for [`last_step`][vae_ddp.beats.last_step])."""
    where = os.environ.get(_ENV_DIR)
    if not where:
        return
    pid = os.getpid()
    if _STATE.get("pid") != pid:  # first beat of this process (a forked child starts again)
        _register(Path(where), pid, rank)
    if step is None:
        os.utime(_STATE["beat"])
    else:
        with open(_STATE["beat"], "w") as f:
            f.write(str(step))


def rearm() -> None:
    """Register this process's stack dump on SIGUSR1 again (after its first beat; else nothing): at the end of
    every ``fit``, Lightning's ``Trainer`` sets each signal back to what ``signal.getsignal`` said at its start
    (``_SignalConnector.teardown``, Lightning 2.6), ``SIG_DFL`` for SIGUSR1, whose ``faulthandler`` handler
    Python does not see; a process that trains several runs (an audit's ranks) was then killed by the
    watchdog's SIGUSR1 in its second run instead of dumping its stacks. Between two fits SIGUSR1 is ignored
    (what Python sees of it since the first beat: Lightning sets that back)."""
    import faulthandler

    if _STATE.get("pid") == os.getpid():
        faulthandler.unregister(signal.SIGUSR1)  # register() alone installs nothing where it is registered
        faulthandler.register(signal.SIGUSR1, file=_STATE["stacks"], all_threads=True, chain=False)


def last_step(pid: int, where: "Optional[str | Path]" = None) -> Optional[int]:
    """The last ``step`` process ``pid`` of this guard's tree gave [`beat`][vae_ddp.beats.beat]
    (None: none, or not under a guard). ``where``: the guard's folder (default: this process's)."""
    where = where or os.environ.get(_ENV_DIR)
    try:
        text = Path(where, f"beat-{pid}").read_text() if where else ""
    except OSError:
        return None
    return int(text) if text.strip().isdigit() else None


def say(line: str) -> None:
    """``line`` on stderr in one write, flushed: the ranks of a launch write into one file, and an
    unbuffered stream (``PYTHONUNBUFFERED``) writes ``print``'s text and its newline in two, between
    which another rank's line can land; the lines that name a run or a rank are read back
    ([`launch`][vae_ddp.harness.launch.launch])."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def how_it_ended(code: int, pid: Optional[int] = None, where: "Optional[str | Path]" = None) -> str:
    """``"exited with code 1"`` or ``"was killed by SIGKILL"`` for ``os.waitstatus_to_exitcode``'s
    ``code`` (negative: the signal), with ``" after step K"`` when process ``pid`` beat a step."""
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code}"
    step = last_step(pid, where) if pid is not None else None
    return how + (f" after step {step}" if step is not None else "")


def _register(where: Path, pid: int, rank: Optional[int]) -> None:
    import faulthandler
    import threading

    if rank is None:
        rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    where.mkdir(parents=True, exist_ok=True)
    stacks = open(where / f"stacks-{pid}.txt", "w")  # kept open: faulthandler writes to its descriptor
    # what Python sees of SIGUSR1, which Lightning's Trainer sets back at the end of each fit: ignored, not
    # the default (death), between two fits of the process; rearm() registers the dump again at each setup
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    # a fork of a process that registered has faulthandler's record of it but the guard's default
    # handler (it resets SIGUSR1): register() would then install nothing, and SIGUSR1 would end it
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True, chain=False)
    role = os.environ.get(ROLE) or f"rank {rank}"  # what the guard's messages call this process
    from vae_ddp.forking import set_name

    set_name(f"vae-ddp rank {rank}" if role == f"rank {rank}" else "vae-ddp single")  # what ps -eo comm shows
    (where / f"proc-{pid}.json").write_text(json.dumps(
        {"pid": pid, "rank": rank, "role": role, "main_thread": threading.main_thread().ident, "argv": sys.argv}))
    path = where / f"beat-{pid}"
    path.touch()
    _STATE.update(pid=pid, beat=path, stacks=stacks)
