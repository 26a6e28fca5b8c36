"""Start the DDP ranks of a CPU run by forking the process that already imported Lightning.

Lightning's ``strategy="ddp"`` starts ranks 1 … N-1 by running the script again
(``_SubprocessScriptLauncher``): every rank imports torch and Lightning anew, 7-9 CPU seconds
per process on a small CPU, which is most of the time of the short runs the studies and the
audit make. [`run_ranks`][vae_ddp.ranks.run_ranks] starts them as ``fork``s of rank 0 instead,
right after the imports and before anything has run, with the environment Lightning's own
launcher gives its children (``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``). Lightning then sees processes created outside it, as under ``torchrun``
(``LightningEnvironment.creates_processes_externally``, Lightning 2.x) and starts none itself:
the same ``DDPStrategy``, process group, ``DistributedSampler`` and all-reduce, only without the
second import.

What Lightning's launcher does beside starting the ranks is done here too: when a rank exits
with a non-zero code, rank 0 ends every rank (SIGKILL, as ``_ChildProcessObserver`` does), so a
rank that raised does not leave the others waiting in a collective; when rank 0 raises, it ends
its ranks before it re-raises. Each forked rank also gets SIGKILL when rank 0 dies
(``prctl(PR_SET_PDEATHSIG)`` on Linux), and the [guard][vae_ddp.guard] above the tree ends what is
left. A forked rank leaves with ``os._exit`` (its copy of rank 0's interpreter runs no exit
handlers of rank 0's).

Only for CPU runs (gloo): on GPUs Lightning's own launcher starts the ranks, as it always has.
Fork is safe at that point: the process runs no thread but OpenBLAS's idle pool (which re-arms
itself on fork), the same state as the ``forkserver`` that starts DataLoader workers
([`vae_ddp.workers`][vae_ddp.workers]).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Optional

from vae_ddp import guard

__all__ = ["run_ranks", "fork", "cluster_plugins", "alive", "FORKED_RANK"]

#: Set in the environment of the ranks this module forked (rank 0 included): "1".
FORKED_RANK = "VAE_DDP_FORKED_RANK"

_POLL_S = 0.1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _observe(children: dict[int, int], done: threading.Event) -> None:
    """Rank 0's watcher: when a rank exits non-zero, end every rank, rank 0 included."""
    while not done.is_set() and children:
        if _reap(children):
            _kill(children)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(_POLL_S)


def _reap(children: dict[int, int]) -> bool:
    """Collect the ranks of ``children`` that have exited; name on stderr the first that failed
    (its rank, exit code or signal, and step: the line [`launch`][vae_ddp.harness.launch.launch]
    puts last). Returns whether one failed."""
    for pid, rank in list(children.items()):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            got, status = pid, 0
        if got == 0:
            continue
        del children[pid]
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            print(f"vae-ddp: rank {rank} (PID {pid}) {guard.how_it_ended(code, pid)}: ending every rank",
                  file=sys.stderr, flush=True)
            return True
    return False


def _kill(children: dict[int, int]) -> None:
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def fork(main: Callable[[], Any], env: Optional[dict[str, str]] = None) -> int:
    """Run ``main()`` in a forked process that gets SIGKILL when this one dies; return its pid.

    The child sets ``env`` in its environment, runs ``main`` and leaves with ``os._exit``
    ([`guard.fork`][vae_ddp.guard.fork], the project's one fork: ``main``'s return value as
    its exit code, None being 0, 1 after printing an exception). It never returns to the
    caller's code.
    """
    def child() -> Any:
        os.environ.update(env or {})
        return main()

    return guard.fork(child, parent_death=signal.SIGKILL)


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
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def run_ranks(world_size: int, main: Callable[[], Any]) -> int:
    """Run ``main()`` as every rank of a ``world_size``-process CPU DDP run.

    With ``world_size <= 1``, or when this process is already a rank (``LOCAL_RANK`` is set:
    Lightning's launcher, ``torchrun`` or a fork of this function started it), ``main()`` runs
    once, here; so it does when a Python thread besides the main one already runs (a fork
    copies only the calling thread, and a lock another thread holds stays held): Lightning's
    launcher then starts the other ranks as it always does. Otherwise the process forks
    ``world_size - 1`` ranks first ([`fork`][vae_ddp.ranks.fork]); call it before anything that
    starts threads or touches the process group (after the imports). The forked ranks never
    return from this function.

    Args:
        world_size: the number of DDP processes of the run (Lightning's ``devices``).
        main: what every rank runs (it builds the ``Trainer`` with ``strategy="ddp"``,
            ``devices=world_size`` and [`cluster_plugins`][vae_ddp.ranks.cluster_plugins]); its
            return value is the exit code (None: 0).

    Returns:
        rank 0's exit code once every rank has exited 0. When another rank fails, rank 0 is
        ended with every rank (SIGKILL), as Lightning's launcher does, and does not return.
    """
    if world_size <= 1 or "LOCAL_RANK" in os.environ or threading.active_count() > 1:
        # one process; or ranks started by someone else; or a Python thread already runs, whose
        # locks a fork could copy held (then Lightning's own launcher starts the ranks)
        return int(main() or 0)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), NODE_RANK="0",
                      WORLD_SIZE=str(world_size), **{FORKED_RANK: "1"})
    children: dict[int, int] = {}
    for rank in range(1, world_size):
        children[fork(main, env={"LOCAL_RANK": str(rank)})] = rank
    os.environ["LOCAL_RANK"] = "0"
    done = threading.Event()
    watcher = threading.Thread(target=_observe, args=(children, done), name="rank-observer", daemon=True)
    watcher.start()
    try:
        code = int(main() or 0)
    except BaseException:
        done.set()
        watcher.join()
        deadline = time.monotonic() + 1.0  # a rank that died made this one fail (a reset connection): name it
        while children and not _reap(children) and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        _kill(children)
        raise
    while children and watcher.is_alive():  # the other ranks finish (the watcher ends all on a failure)
        watcher.join(timeout=1.0)
    done.set()
    return code
