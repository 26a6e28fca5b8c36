"""What the passive `DDPAudit` callback costs: step time of 2-rank DDP (gloo) with and without it.

    python benchmarks/audit_overhead.py [--steps 300] [--repeats 5] [--out DIR]
    python benchmarks/audit_overhead.py --out docs/results/audit-overhead   # the docs' numbers

Each repeat trains the same small module (examples/audit_models.py: WithBatchNorm, global batch
64) twice in one launch, with and without the callback, in alternating order, and times the
whole training loop (from ``on_train_start`` before the callback's to ``on_train_end``, every
batch hook inside). The overhead is the median over repeats of the paired ratio of those
times. The callback works at the start of training and over the first batches (8 at most), so its
share shrinks with the number of steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(order: list[str], steps: int, out: Path) -> None:
    """In each rank: train with and without DDPAudit (in ``order``); rank 0 writes the step times."""
    import pytorch_lightning as pl
    import torch
    from pytorch_lightning import Callback

    sys.path.insert(0, str(ROOT))
    from examples.audit_models import Regression, WithBatchNorm
    from vae_ddp.audit import DDPAudit
    from vae_ddp.utils import quiet

    class Clock(Callback):
        """First in the callback list: ``on_train_start`` before DDPAudit's, ``on_train_end``
        after every batch hook; each step is timed from one batch start to the next, so the
        hooks that run after a batch (DDPAudit's check after the first one) are inside."""

        def __init__(self) -> None:
            self.starts: list[float] = []

        def on_train_start(self, trainer, *args) -> None:
            trainer.strategy.barrier()  # both ranks start the clock together, in either variant
            self.t0 = time.perf_counter()

        def on_train_batch_start(self, *args) -> None:
            self.starts.append(time.perf_counter())

        def on_train_end(self, *args) -> None:
            self.total = time.perf_counter() - self.t0
            self.steps = [b - a for a, b in zip(self.starts, self.starts[1:])]

    quiet()
    torch.set_num_threads(1)
    result = {}
    for variant in order:
        pl.seed_everything(0, verbose=False)
        clock = Clock()
        callbacks = [clock] + ([DDPAudit(warn=False)] if variant == "with DDPAudit" else [])
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             callbacks=callbacks)
        trainer.fit(WithBatchNorm(), Regression(batch_size=32, n=4096))
        result[variant] = {"total": clock.total, "steps": clock.steps}
    if trainer.is_global_zero:
        out.write_text(json.dumps(result))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write audit_overhead.json and tables.md here")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0].split(","), args.steps, Path(args.child[1]))
        return {}
    variants = ["without", "with DDPAudit"]
    totals: dict[str, list[float]] = {v: [] for v in variants}
    medians: dict[str, list[float]] = {v: [] for v in variants}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = variants if r % 2 == 0 else variants[::-1]
            out = Path(tmp) / f"r{r}.json"
            subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", ",".join(order), str(out)],
                           check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times = json.loads(out.read_text())
            for v in variants:
                totals[v].append(times[v]["total"])
                medians[v].append(statistics.median(times[v]["steps"]))
    ratios = [w / wo for w, wo in zip(totals["with DDPAudit"], totals["without"])]
    result = {"steps": args.steps, "repeats": args.repeats, "train_time_s": totals, "median_step_s": medians,
              "ratios": ratios, "overhead": statistics.median(ratios) - 1,
              "one_time_s": statistics.median(w - wo for w, wo in zip(totals["with DDPAudit"], totals["without"]))}
    text = render(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "audit_overhead.json").write_text(json.dumps(result, indent=1))
        (args.out / "tables.md").write_text(text + "\n")
        (args.out / "command.md").write_text(command_md(result, args.out.as_posix()))
    return result


def render(result: dict) -> str:
    """The table and the overhead line of ``audit_overhead.json`` (what ``--out`` writes into ``tables.md``)."""
    totals, medians, ratios = result["train_time_s"], result["median_step_s"], result["ratios"]
    pct = lambda q: f"{100 * q:+.2g}%"  # noqa: E731
    lines = [f"| variant | training time of {result['steps']} steps (s), per repeat | median step (ms), per repeat |",
             "|---|---|---|"]
    for v in totals:
        lines.append(f"| {v} | {', '.join(f'{t:.3g}' for t in totals[v])} | "
                     f"{', '.join(f'{1000 * t:.3g}' for t in medians[v])} |")
    lines += ["", f"- overhead of DDPAudit: {pct(result['overhead'])} of the training time of a {result['steps']}-step "
                  f"run (median of {result['repeats']} paired ratios, range {pct(min(ratios) - 1)} to "
                  f"{pct(max(ratios) - 1)}); its checks run at the start and over the first 8 batches, so the "
                  "share shrinks as runs get longer "
                  f"(median one-time difference {1000 * result['one_time_s']:.3g} ms)"]
    return "\n".join(lines)


def command_md(result: dict, out: str) -> str:
    """The command line that wrote ``out`` (``command.md`` for the page)."""
    return (f"```bash\npython benchmarks/audit_overhead.py --steps {result['steps']} --repeats {result['repeats']} "
            f"--out {out}\n```\n")

if __name__ == "__main__":
    main()
