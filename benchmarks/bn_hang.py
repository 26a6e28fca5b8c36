"""Hangs of a user-like 2-process CPU training with GlobalSyncBatchNorm and DataLoader workers, counted (#62).

    python benchmarks/bn_hang.py                                         # 20 runs of the variants fork, forkserver
    python benchmarks/bn_hang.py --runs 3 --variants fork fork_plain_bn --out runs/bn-hang

What a user wrote: ``pytorch_lightning.Trainer(accelerator="cpu", devices=2, strategy="ddp",
plugins=[vae_ddp.fixes.GlobalSyncBatchNorm()])`` (Lightning's defaults otherwise: logger, progress bar,
checkpoint; torch's default intra-op threads) on a small CNN with ``nn.BatchNorm2d``, a dataset whose
``__getitem__`` crops and flips at random, ``DataLoader(num_workers=2)`` for training and validation (new
workers each epoch: ``persistent_workers=False``, the default), 4 epochs of 8 steps per rank. Each run is
started under the project's guard ([`vae_ddp.guard`][vae_ddp.guard], a ``Heartbeat`` callback in the
``Trainer``). Once no rank has made progress for ``--stall`` seconds this script attaches ``gdb`` to every
process of the run (the DataLoader workers first, a forkserver, the ranks) and keeps each one's C stack; a
run still without progress ``GDB_S`` seconds later is a hang: the guard's watchdog dumps every rank's Python
stack (``faulthandler``), names the frame each rank was in and ends the run. ``--threads 1 --bare``: one
intra-op thread per rank, no logger, progress bar, checkpoint or model summary. The variants
(``--variants``) test the hypotheses of the report:

- ``fork``: the user's loaders, the start method Python 3.11 uses on Linux (``fork``): each worker is a fork
  of a rank that runs threads (gloo's, DDP's, Lightning's); the last batch of each epoch is smaller
  (``drop_last=False``);
- ``forkserver``: the same with ``multiprocessing_context`` the project's ``forkserver``
  ([`vae_ddp.workers.worker_context`][vae_ddp.workers.worker_context]);
- ``fork_drop_last``: ``fork`` with ``drop_last=True`` (every batch full);
- ``fork_plain_bn``: ``fork`` without the plugin (``nn.BatchNorm2d``, no vae-ddp code in the training);
- ``stuck_worker``, ``stuck_worker_plain_bn``: ``forkserver`` workers, with the plugin and without it, but
  rank 1's first training worker never starts (its ``worker_init_fn`` waits for ever), as a worker blocked at
  start does: the stacks such a worker leaves, on purpose, in every run;
- ``uneven``: ``forkserver`` workers, but each rank its own shard (``use_distributed_sampler=False``) and
  rank 0 one batch more per epoch: ranks that call ``all_reduce`` a different number of times (a user error
  that hangs any DDP training; its stacks for comparison with the report's).

Prints one line per run (``ok``, or ``HUNG`` with where each rank was and the top of each process's C stack)
and a table
per variant: runs, hangs, other failures, median seconds. ``--out DIR`` writes ``bn_hang.json`` and
the full log (the guard's output, the Python stacks and the ``gdb`` stacks) of each run that did not pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parents[1]
#: The folder where a run's ranks write their pids and their progress (set by the parent for the run).
ENV_DIR = "BN_HANG_DIR"
#: variant -> (start method of the workers, drop_last, GlobalSyncBatchNorm plugin, uneven shards, a stuck worker)
VARIANTS = {
    "fork": ("fork", False, True, False, False),
    "forkserver": ("forkserver", False, True, False, False),
    "fork_drop_last": ("fork", True, True, False, False),
    "fork_plain_bn": ("fork", False, False, False, False),
    "uneven": ("forkserver", False, True, True, False),
    "stuck_worker": ("forkserver", False, True, False, True),
    "stuck_worker_plain_bn": ("forkserver", False, False, False, True),
}
BATCH, SAMPLES, EPOCHS = 16, 250, 4  # 250 samples: 125 per rank, 8 batches, the last one of 13
#: Seconds the guard's watchdog waits beyond ``--stall``: the time ``gdb`` takes on every process of a hung run
#: (tens of seconds a process on a loaded machine: it reads libtorch's symbols).
GDB_S = 240.0


class Flips(Dataset):
    """``n`` fixed random images 3x36x36 and labels; ``__getitem__`` crops 32x32 at random and flips at random
    (the worker's torch generator), as a user's augmentation does."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 3, 36, 36, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        top, left = torch.randint(0, 5, (2,)).tolist()
        img = self.x[i, :, top:top + 32, left:left + 32]
        if torch.rand(()) < 0.5:
            img = img.flip(-1)
        return img, self.y[i]


def stuck(worker_id: int) -> None:
    """``worker_init_fn`` of the ``stuck_worker`` variants: worker 0 of rank 1 never starts."""
    if os.environ.get("LOCAL_RANK") == "1" and worker_id == 0:
        threading.Event().wait()


# --------------------------------------------------------------------------- a run's process (rank 0 and 1)
def _module():
    import pytorch_lightning as pl
    from torch import nn
    from torch.nn import functional as F

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                     nn.Conv2d(16, 32, 3, stride=2), nn.BatchNorm2d(32), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))

        def training_step(self, batch, i):
            loss = F.cross_entropy(self.net(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, i):
            self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Progress(pl.Callback):
        """The rank's pid at setup, a touch of ``progress-RANK`` after each batch, in ``$BN_HANG_DIR``."""

        def setup(self, trainer, pl_module, stage) -> None:
            Path(os.environ[ENV_DIR], f"rank-{trainer.global_rank}.pid").write_text(str(os.getpid()))

        def on_train_batch_end(self, trainer, *args) -> None:
            Path(os.environ[ENV_DIR], f"progress-{trainer.global_rank}").touch()

        on_validation_batch_end = on_train_batch_end

    return Net(), Progress()


def _loaders(variant: str) -> tuple:
    """The training and validation loaders of ``variant`` (``uneven``: each rank its own shard, rank 0's
    one batch longer)."""
    from torch.utils.data import DataLoader, Subset

    from benchmarks.bn_hang import Flips, stuck  # by name, not __main__: a forkserver worker unpickles them
    from vae_ddp.workers import worker_context

    start, drop_last, _, uneven, stuck_worker = VARIANTS[variant]
    train, val = Flips(SAMPLES), Flips(64, seed=1)
    if uneven:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        train = Subset(train, range(0, 8 * BATCH) if rank == 0 else range(8 * BATCH, 15 * BATCH))
    context = worker_context("benchmarks.bn_hang") if start == "forkserver" else None
    kw = dict(batch_size=BATCH, num_workers=2, multiprocessing_context=context)
    return (DataLoader(train, shuffle=True, drop_last=drop_last, worker_init_fn=stuck if stuck_worker else None, **kw),
            DataLoader(val, **kw))


def train(variant: str, threads: int, bare: bool) -> None:
    """One user-like training (this process is rank 0; Lightning starts rank 1 with the same command);
    ``threads``: torch's intra-op threads per rank (0: torch's default, as a user's script has); ``bare``:
    no logger, progress bar, checkpoint or model summary (else Lightning's defaults, as a user's ``Trainer``)."""
    import pytorch_lightning as pl

    from vae_ddp import heartbeat
    from vae_ddp.fixes import GlobalSyncBatchNorm

    if threads:
        torch.set_num_threads(threads)
    _, _, plugin, uneven, _ = VARIANTS[variant]
    model, progress = _module()
    off = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
                         plugins=[GlobalSyncBatchNorm()] if plugin else [], use_distributed_sampler=not uneven,
                         callbacks=[*heartbeat.callbacks(), progress], num_sanity_val_steps=0,
                         default_root_dir=os.environ[ENV_DIR], **(off if bare else {}))
    trainer.fit(model, *_loaders(variant))


# --------------------------------------------------------------------------- the parent: runs, stacks, counts
def _roles(run_dir: Path) -> dict[int, str]:
    """pid -> role of every live process of the run: ``rank R``, ``rank R worker`` (a fork of the rank),
    ``rank R forkserver``, ``rank R worker (forkserver)``, ``rank R resource tracker`` (multiprocessing's)."""
    import psutil

    ranks = {int(f.read_text()): f.stem.split("-")[1] for f in run_dir.glob("rank-*.pid")}
    roles = {pid: f"rank {r}" for pid, r in ranks.items()}
    for pid, r in ranks.items():
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(pid).children():
                if p.pid in ranks:  # rank 1 is a child of rank 0
                    continue
                cmd = " ".join(p.cmdline())
                if "forkserver" not in cmd:
                    roles[p.pid] = f"rank {r} resource tracker" if "resource_tracker" in cmd else f"rank {r} worker"
                    continue
                roles[p.pid] = f"rank {r} forkserver"
                roles.update({w.pid: f"rank {r} worker (forkserver)" for w in p.children()})
    return roles


def _frames(out: str, pid: int) -> list[str]:
    """The function names of the main thread's C stack (LWP ``pid``) in ``gdb``'s ``thread apply all bt``."""
    block = next((b for b in out.split("\nThread ") if f"LWP {pid})" in b.split("\n", 1)[0]
                  or f"LWP {pid} " in b.split("\n", 1)[0]), "")
    names = []
    for line in block.splitlines():
        if line.startswith("#"):
            words = line.split(" in ", 1)[-1].split() if " in " in line else line.split()[1:2]
            names.append(words[0] if words else "?")
    return names


def _gdb_stacks(run_dir: Path) -> tuple[str, list[str]]:
    """Every process of the run, its workers first: role, state and the C stack of each thread (``gdb``); and
    one phrase per process naming the top of its main thread's stack (``PyOS_AfterFork_Child``: a forked child
    that never started)."""
    import psutil

    text, where = [], []
    for pid, role in sorted(_roles(run_dir).items(), key=lambda kv: ("worker" not in kv[1], kv[1])):
        try:
            state = psutil.Process(pid).status()
            gdb = subprocess.run(["gdb", "-p", str(pid), "-batch", "-nx", "-iex", "set auto-load safe-path /",
                                  "-ex", "thread apply all bt 30"], capture_output=True, text=True, timeout=60)
            out = gdb.stdout + gdb.stderr
        except psutil.Error:
            continue
        except (OSError, subprocess.TimeoutExpired) as err:
            out, state = f"(gdb: {err})", "?"
        frames = _frames(out, pid)
        forked = "PyOS_AfterFork_Child" in frames
        top = " <- ".join(frames[:4]) + (" ... PyOS_AfterFork_Child" if forked and "PyOS_AfterFork_Child"
                                         not in frames[:4] else "")
        where.append(f"{role} (pid {pid}, {state}) in {top or 'no C stack'}")
        text.append(f"--- {role} (pid {pid}, {state}) ---\n{out}")
    return "\n".join(text), where


def _watch(run_dir: Path, stall: float, found: dict, done: threading.Event) -> None:
    """Once no rank has made progress for ``stall`` s (the guard's watchdog waits longer): ``gdb`` on every
    process of the run, again if the run went on since."""
    t0, taken = time.time(), None
    while not done.wait(1.0):
        newest = max([f.stat().st_mtime for f in run_dir.glob("progress-*")] or [t0])
        if time.time() - newest > stall and taken != newest:
            found["gdb"], found["where"] = _gdb_stacks(run_dir)
            taken = newest


def _where(stderr: str) -> str:
    """The guard's phrase naming the frame each rank was in (``rank 0 in all_reduce (...); rank 1 in ...``)."""
    for line in reversed(stderr.splitlines()):
        if line.startswith("vae-ddp guard:") and " in `" in line:
            return line.split("; ", 1)[-1].replace(" (every rank's stacks above; all its processes ended)", "")
    return ""


def one_run(variant: str, stall: float, timeout: float, threads: int, bare: bool) -> dict:
    """One training of ``variant`` under a guard; a hang's stacks in ``log``."""
    with tempfile.TemporaryDirectory(prefix="bn-hang-") as tmp:
        run_dir, found, done = Path(tmp), {}, threading.Event()
        env = dict(os.environ, **{ENV_DIR: tmp, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])})
        watcher = threading.Thread(target=_watch, args=(run_dir, stall, found, done), daemon=True)
        watcher.start()
        t0 = time.monotonic()
        from vae_ddp import guard

        cmd = [sys.executable, str(Path(__file__).resolve()), "--train", variant, "--threads", str(threads),
               *["--bare"] * bare]
        try:
            proc = guard.run(cmd, stall=stall + GDB_S, timeout=timeout, capture_output=True, text=True, cwd=ROOT,
                             env=env)
        except subprocess.TimeoutExpired:  # slow, not stalled: every process ended by run
            proc = subprocess.CompletedProcess(cmd, guard.TIMED_OUT, "", f"timed out after {timeout:g} s")
        seconds = time.monotonic() - t0
        done.set()
        watcher.join()
    code = proc.returncode
    hung = code in (guard.STALLED, guard.TIMED_OUT)
    run = {"code": code, "seconds": round(seconds, 1), "hung": hung, "failed": code != 0 and not hung,
           "ranks": _where(proc.stderr) if hung else "", "processes": found.get("where", []) if hung else []}
    run["log"] = (proc.stdout + "\n--- stderr (the guard's Python stacks of the ranks) ---\n" + proc.stderr
                  + "\n--- gdb: every process of the run ---\n" + found.get("gdb", "(none taken)"))
    return run


def _summary(results: dict) -> str:
    lines = ["| variant | start method | drop_last | GlobalSyncBatchNorm | uneven shards | stuck worker | runs | "
             "hung | other failures | median s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, runs in results.items():
        start, drop_last, plugin, uneven, stuck_worker = VARIANTS[variant]
        secs = [r["seconds"] for r in runs if not r["hung"]] or [r["seconds"] for r in runs]
        lines.append(f"| {variant} | {start} | {drop_last} | {plugin} | {uneven} | {stuck_worker} | {len(runs)} | "
                     f"{sum(r['hung'] for r in runs)} | {sum(r['failed'] for r in runs)} | "
                     f"{statistics.median(secs):.0f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="trainings per variant (default 20)")
    p.add_argument("--variants", nargs="+", default=["fork", "forkserver"], choices=list(VARIANTS))
    p.add_argument("--stall", type=float, default=60.0, help="seconds without progress that make a hang (default 60)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a run may take in all, a hang's stacks included (default 600)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's intra-op threads per rank (default 0: torch's default, as in a user's script)")
    p.add_argument("--bare", action="store_true",
                   help="no logger, progress bar, checkpoint or model summary (default: Lightning's defaults)")
    p.add_argument("--out", type=Path, default=None, help="folder for bn_hang.json and the logs of runs that hung")
    p.add_argument("--train", choices=list(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.train:
        train(args.train, args.threads, args.bare)
        return 0
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    for i in range(args.runs):
        for variant in args.variants:  # interleaved: a load that varies falls on every variant alike
            run = one_run(variant, args.stall, args.timeout, args.threads, args.bare)
            results[variant].append(run)
            status = "HUNG" if run["hung"] else "FAILED" if run["failed"] else "ok"
            print(f"[{variant} {i + 1}/{args.runs}] {status} exit {run['code']} in {run['seconds']:.0f} s"
                  + (f": {run['ranks']}" if run["ranks"] else "")
                  + "".join(f"\n    {p}" for p in run["processes"]), flush=True)
            if args.out and status != "ok":
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{variant}-{i}.log").write_text(run["log"])
    print("\n" + _summary(results))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bn_hang.json").write_text(json.dumps(
            {v: [{k: r[k] for k in r if k != "log"} for r in runs] for v, runs in results.items()}, indent=1))
    return 1 if any(r["hung"] or r["failed"] for runs in results.values() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
