"""Start the DDP ranks of a CPU run by forking the process that already imported Lightning.

Lightning's ``strategy="ddp"`` starts ranks 1 … N-1 by running the script again
(``_SubprocessScriptLauncher``): each imports torch and Lightning anew, 7-9 CPU seconds here,
most of the time of the short runs the studies and the audit make.
[`run_ranks`][vae_ddp.ranks.run_ranks] forks them from rank 0 right after the imports, with the
environment Lightning's launcher gives its children (``MASTER_ADDR``, ``MASTER_PORT``,
``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``); Lightning then sees processes created outside it,
as under ``torchrun`` (``LightningEnvironment.creates_processes_externally``, Lightning 2.x): the
same ``DDPStrategy``, process group, ``DistributedSampler`` and all-reduce, without the second
import. As Lightning's launcher does (``_ChildProcessObserver``), rank 0 ends every rank when
one exits non-zero, and its ranks before it re-raises; a forked rank gets SIGKILL when rank 0
dies, and the [guard][vae_ddp.guard] above ends what is left. CPU (gloo) only: on GPUs
Lightning's launcher starts the ranks. The fork is safe there: no thread runs but OpenBLAS's
idle pool, as in the ``forkserver`` of the DataLoader workers ([`vae_ddp.workers`][vae_ddp.workers]).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from typing import Any, Callable, Optional

from vae_ddp import beats, forking

__all__ = ["run_ranks", "fork", "cluster_plugins", "alive", "FORKED_RANK"]

#: Set in the environment of the ranks this module forked (rank 0 included): "1".
FORKED_RANK = "VAE_DDP_FORKED_RANK"

_POLL_S = 0.1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _observe(ranks: dict, done: threading.Event, ended: list) -> None:
    """Rank 0's watcher: when a rank exits non-zero, end every rank, rank 0 included; the ranks
    that exit 0 go to ``ended`` (``(rank, pid)``: one that left early is named if rank 0 then fails)."""
    while not done.is_set() and ranks:
        if _reap(ranks, _POLL_S, ended):
            _kill(ranks)
            os.kill(os.getpid(), signal.SIGKILL)


def _reap(ranks: dict, wait: float, ended: Optional[list] = None) -> bool:
    """Collect the ranks (``{psutil.Process: rank}``) that exit within ``wait`` seconds; name the
    first that failed on stderr (the line [`launch`][vae_ddp.harness.launch.launch] puts last);
    those that exit 0 are appended to ``ended`` as ``(rank, pid)``. Returns whether one failed."""
    import psutil

    for p in sorted(psutil.wait_procs(list(ranks), wait)[0], key=ranks.get):
        rank = ranks.pop(p)
        if p.returncode:
            beats.say(f"vae-ddp: rank {rank} (PID {p.pid}) {beats.how_it_ended(int(p.returncode), p.pid)}: ending "
                      "every rank")
            return True
        if ended is not None:
            ended.append((rank, p.pid))
    return False


def _left_early(ended: list) -> None:
    """Name the first rank of ``ended`` that exited 0 while rank 0 still trained (``sys.exit(0)``,
    ``os._exit(0)`` in the user's code): rank 0's error is then only the connection it lost."""
    for rank, pid in sorted(ended)[:1]:
        beats.say(f"vae-ddp: rank {rank} (PID {pid}) {beats.how_it_ended(0, pid)} while the other ranks still "
                  "trained (sys.exit or os._exit in the training code?): ending every rank")


def _exit_code(stop: SystemExit) -> int:
    """The exit code ``sys.exit(code)`` gives (None: 0, another object: 1)."""
    return stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1


def _kill(ranks: dict) -> None:
    import psutil

    for p in ranks:
        with contextlib.suppress(psutil.Error):
            p.kill()


def fork(main: Callable[[], Any], env: Optional[dict[str, str]] = None) -> int:
    """[`forking.fork`][vae_ddp.forking.fork] of ``main()`` with ``env`` set, SIGKILL when this
    process dies; returns the child's pid."""
    def child() -> Any:
        os.environ.update(env or {})
        return main()

    return forking.fork(child, parent_death=signal.SIGKILL)


def cluster_plugins() -> list:
    """``[LightningEnvironment()]`` in a rank that [`run_ranks`][vae_ddp.ranks.run_ranks] started
    (for the ``Trainer``'s ``plugins``), else ``[]``: the ranks take their rank and address from
    the environment this module set, even where Lightning would detect another cluster (a SLURM
    job's variables, say, which describe the job, not these forks)."""
    if os.environ.get(FORKED_RANK) != "1":
        return []
    from lightning_fabric.plugins.environments import LightningEnvironment

    return [LightningEnvironment()]


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:  # another user's: it exists
        return True


def run_ranks(world_size: int, main: Callable[[], Any]) -> int:
    """Run ``main()`` as every rank of a ``world_size``-process CPU DDP run: ``world_size - 1``
    ranks forked first ([`fork`][vae_ddp.ranks.fork]; they never return from here), then rank 0
    here. Call it after the imports, before anything starts threads or the process group.
    ``main()`` runs once, here, when ``world_size <= 1``, when this process already is a rank
    (``LOCAL_RANK`` set: Lightning's launcher or ``torchrun`` started it) or when a second Python
    thread runs (a lock it holds would stay held in a fork; Lightning's launcher then starts the
    ranks). ``main`` builds the ``Trainer`` (``strategy="ddp"``, ``devices=world_size``,
    [`cluster_plugins`][vae_ddp.ranks.cluster_plugins]); its return value is the exit code.

    Returns:
        rank 0's exit code once every rank exited 0. When another rank fails, every rank, rank 0
        included, is ended (SIGKILL), as Lightning's launcher does.
    """
    if world_size <= 1 or "LOCAL_RANK" in os.environ or threading.active_count() > 1:
        # one process; or ranks started by someone else; or a Python thread already runs, whose
        # locks a fork could copy held (then Lightning's own launcher starts the ranks)
        return int(main() or 0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NODE_RANK="0",
                      WORLD_SIZE=str(world_size), **{FORKED_RANK: "1"})
    import psutil

    ranks = {psutil.Process(fork(main, env={"LOCAL_RANK": str(rank)})): rank for rank in range(1, world_size)}
    os.environ["LOCAL_RANK"] = "0"
    done, ended = threading.Event(), []
    watcher = threading.Thread(target=_observe, args=(ranks, done, ended), name="rank-observer", daemon=True)
    watcher.start()
    try:
        code = int(main() or 0)
    except BaseException as err:
        done.set()
        watcher.join()
        # a rank that died made this one fail (a reset connection): name it, or the one that left early
        if not _reap(ranks, 1.0, ended):
            if ended:
                _left_early(ended)
            elif isinstance(err, SystemExit):
                beats.say(f"vae-ddp: rank 0 (PID {os.getpid()}) {beats.how_it_ended(_exit_code(err), os.getpid())} "
                          "while the other ranks still trained (sys.exit in the training code?): ending every rank")
        _kill(ranks)
        raise
    while ranks and watcher.is_alive():  # the other ranks finish (the watcher ends all on a failure)
        watcher.join(timeout=1.0)
    done.set()
    return code
