"""Which launcher starts the ranks: wall time of a tiny 2-rank CPU (gloo) job under each, and how each ends.

    python benchmarks/launchers.py                        # 3 paired repeats of the timing, then the trials
    python benchmarks/launchers.py --repeats 5 --no-trials

The job: a fresh interpreter imports torch and Lightning, then ``--fits`` (3) ``Trainer.fit`` calls of a tiny
LightningModule (``Linear(32, 1)``, ``--steps`` (2) steps of batch 8 per rank), as the audit's and the studies'
several runs in one launch, on 2 ranks, started by

- ``run_ranks``: [`vae_ddp.ranks.run_ranks`][vae_ddp.ranks.run_ranks] forks rank 1 once, after the imports (what a
  launch's child does here); every fit is ``strategy="ddp"`` on the ranks it finds;
- ``ddp_fork``: ``Trainer(strategy="ddp_fork")``: every ``fit`` forks 2 ranks from the process that imported (its
  ``torch.multiprocessing.start_processes``);
- ``torchrun``: ``python -m torch.distributed.run --nproc-per-node 2`` (torchrun) starts 2 new interpreters;
- ``ddp``: Lightning's default launcher (``strategy="ddp"``), which starts rank 1 by running ``sys.argv`` again.

The wall time is from starting the command to its end, measured here (every candidate sets ``OMP_NUM_THREADS=1``,
what torchrun and Lightning's ``ddp_fork`` give their ranks). A repeat runs every candidate once, in a rotated
order; the ratio to ``run_ranks`` is taken within each repeat (paired), so a slow period of a shared machine hits
the candidates of a repeat alike. The trials then run each candidate with rank 1 leaving early (``os._exit(0)``
at its second step), rank 1 failing (an exception at its second step), and the launching process killed
(SIGKILL) in the middle of a fit whose DataLoader has one worker, and the launching process computing on 2
intra-op threads before the ranks start (the fork-with-threads hang); they say how it ended and when each of its
other processes (every rank and DataLoader worker records its pid) ended after it (polled for 20 s). Every process a run
starts is ended: each command runs in a session of its own with a timeout, and what outlives it is killed by pid.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CANDIDATES = ("run_ranks", "ddp_fork", "torchrun", "ddp")
TRIALS = ("rank 1 exits 0 early", "rank 1 fails", "launcher killed", "launcher computed on 2 threads first")
_TRIAL_KEYS = {"rank 1 exits 0 early": "exit0", "rank 1 fails": "fail", "launcher killed": "kill",
               "launcher computed on 2 threads first": "threads"}
#: Seconds before a trial's command is killed (a trial that completes takes under 40 s here).
TRIAL_TIMEOUT = 90.0


# --------------------------------------------------------------------------- the job (in the launched processes)
def _record(role: str) -> None:
    """Write this process's pid under ``$LAUNCHERS_PIDS`` (the trials look for survivors by these)."""
    folder = os.environ.get("LAUNCHERS_PIDS")
    if folder:
        Path(folder, f"{role}-{os.getpid()}").touch()


def _worker_init(_: int) -> None:
    _record("dataloader-worker")


def _job(candidate: str, fits: int, steps: int, trial: str | None) -> int:
    import torch
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(32, 1)

        def training_step(self, batch, i):
            if i == 0:
                _record(f"rank{self.global_rank}")
            if trial in ("exit0", "fail") and self.global_rank == 1 and i == 1:
                if trial == "exit0":
                    os._exit(0)
                raise RuntimeError("rank 1 fails (a trial of benchmarks/launchers.py)")
            if trial == "kill":
                if self.global_rank == 0 and i == 2:
                    _record("started")
                time.sleep(0.5)
            if trial == "threads":  # an op large enough for a parallel region of the intra-op pool
                torch.randn(1_000_000).exp().sum()
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = TensorDataset(torch.randn(512, 32, generator=g), torch.randn(512, 1, generator=g))
            workers = {"num_workers": 1, "worker_init_fn": _worker_init} if trial == "kill" else {}
            return DataLoader(data, batch_size=8, **workers)

    def fit_all(strategy: str, plugins: list) -> int:
        for _ in range(fits):
            trainer = pl.Trainer(strategy=strategy, devices=2, accelerator="cpu", plugins=plugins,
                                 max_steps=60 if trial == "kill" else steps, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 num_sanity_val_steps=0)
            trainer.fit(Tiny())
        if torch.distributed.is_initialized():  # Lightning 2.6 leaves it open: closed, or gloo may abort at exit
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        return 0

    _record("launched")
    if trial == "threads":  # GNU OpenMP's pool started here, before the ranks are forked
        torch.set_num_threads(2)
        torch.randn(1_000_000).exp().sum()
    if candidate == "run_ranks":
        from vae_ddp.ranks import cluster_plugins, run_ranks

        return run_ranks(2, lambda: fit_all("ddp", cluster_plugins()))
    return fit_all("ddp_fork" if candidate == "ddp_fork" else "ddp", [])


# --------------------------------------------------------------------------- the driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(candidate: str, fits: int, steps: int, trial: str | None) -> list[str]:
    job = [str(Path(__file__).resolve()), "--job", candidate, "--fits", str(fits), "--steps", str(steps)]
    job += ["--trial", trial] if trial else []
    if candidate == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--nnodes", "1",
                "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), *job]
    return [sys.executable, *job]


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _end(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _run(candidate: str, fits: int, steps: int, trial: str | None, timeout: float) -> dict:
    """Run one command in a session of its own; its wall time, exit code, output's tail and, for a
    trial, when each recorded process but the command's own ended after the command did (then killed)."""
    with tempfile.TemporaryDirectory(prefix="launchers-") as folder:
        env = dict(os.environ, OMP_NUM_THREADS="1", LAUNCHERS_PIDS=folder, PYTHONUNBUFFERED="1")
        out = Path(folder, "output.txt").open("w+")
        start = time.perf_counter()
        proc = subprocess.Popen(_command(candidate, fits, steps, trial), env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        killed, code = None, None
        try:
            if trial == "kill":
                while not any(n.startswith("started-") for n in os.listdir(folder)) and proc.poll() is None:
                    if time.perf_counter() - start > timeout:
                        break
                    time.sleep(0.05)
                killed = time.perf_counter()
                proc.kill()  # the launching process only, SIGKILL: what the others do is the trial
            code = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            code = "timeout"
        wall = time.perf_counter() - start
        ended: dict[int, float] = {}
        recorded: dict[int, str] = {}
        while trial:  # when each recorded process ended, after the command did (up to 20 s)
            names = [n.rsplit("-", 1) for n in sorted(os.listdir(folder)) if not n.startswith("started-")]
            recorded = {int(n[1]): n[0] for n in names if len(n) == 2 and n[1].isdigit()}  # a rank's role kept
            late = time.perf_counter() - start - wall
            ended.update({pid: late for pid in recorded if pid not in ended and not _alive(pid)})
            if len(ended) == len(recorded) or late > 20:
                break
            time.sleep(0.2)
        survivors = sorted(f"{role} {'alive at 20 s' if pid not in ended else f'{ended[pid]:.1f} s'}"
                           for pid, role in recorded.items() if pid != proc.pid)
        _end([pid for pid in recorded if _alive(pid)])
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left in its session
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        out.seek(0)
        tail = [ln for ln in out.read().splitlines() if ln.strip()][-3:]
        out.close()
    return {"wall": wall, "code": code, "tail": tail, "survivors": survivors,
            "after_kill": None if killed is None else wall - (killed - start)}


def _table(rows: list[list[str]], head: list[str]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--fits", type=int, default=3)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    p.add_argument("--no-trials", action="store_true")
    p.add_argument("--trials", nargs="+", default=list(_TRIAL_KEYS.values()), choices=list(_TRIAL_KEYS.values()))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per command before it is killed")
    p.add_argument("--job", choices=CANDIDATES, help=argparse.SUPPRESS)
    p.add_argument("--trial", choices=sorted(_TRIAL_KEYS.values()), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.job:
        return _job(a.job, a.fits, a.steps, a.trial)

    cands = a.candidates
    walls: dict[str, list[float]] = {c: [] for c in cands}
    print(f"{datetime.date.today()}, {os.cpu_count()} CPUs (shared with other sessions: timings are noisy), "
          f"{a.fits} fits x {a.steps} steps, 2 ranks, gloo", flush=True)
    for r in range(a.repeats):
        order = cands[r % len(cands):] + cands[:r % len(cands)]
        for c in order:
            res = _run(c, a.fits, a.steps, None, a.timeout)
            if res["code"] != 0:
                print(f"{c} failed ({res['code']}):", *res["tail"], sep="\n  ", file=sys.stderr)
                return 1
            walls[c].append(res["wall"])
            print(f"repeat {r + 1}: {c}: {res['wall']:.2f} s", flush=True)
    if a.repeats:  # 0: the trials only
        base = cands[0]
        rows = []
        for c in cands:
            ratios = [w / b for w, b in zip(walls[c], walls[base])]
            rows.append([c, f"{statistics.median(walls[c]):.2f}", f"{min(walls[c]):.2f}-{max(walls[c]):.2f}",
                         f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}"])
        print(f"\nWall time from start to end, {a.fits} fits x {a.steps} steps on 2 ranks, {a.repeats} paired repeats "
              f"(shared {os.cpu_count()}-CPU machine)\n")
        print(_table(rows, ["launcher", "median s", "range s", f"ratio to {base} (median)", "ratio range"]))
        print("\n" + json.dumps({"walls": walls}), flush=True)
    if a.no_trials:
        return 0
    rows = []
    for trial in (t for t in TRIALS if _TRIAL_KEYS[t] in a.trials):
        for c in cands:
            res = _run(c, 1, 4, _TRIAL_KEYS[trial], TRIAL_TIMEOUT)
            ended = (f"killed at {TRIAL_TIMEOUT:.0f} s" if res["code"] == "timeout"
                     else f"exit {res['code']} after {res['wall'] if trial != 'launcher killed' else 0:.1f} s")
            if trial == "launcher killed":
                ended = f"launcher SIGKILLed; {ended.split(' after')[0]}"
            rows.append([trial, c, ended, ", ".join(res["survivors"]) or "-", (res["tail"] or [""])[-1][:100]])
            print(f"{trial}: {c}: {rows[-1][2]}; the others ended: {rows[-1][3]}", flush=True)
    print("\nTrials (1 fit of 4 steps; 'the others ended': when each rank and DataLoader worker other than the "
          "launching process ended, in seconds after it did (0.2 s polls, up to 20 s; then all killed)\n")
    print(_table([[r[0], r[1], r[2], r[3], r[4].replace("|", "/")] for r in rows],
                 ["trial", "launcher", "how it ended", "the others ended", "last line of output"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
