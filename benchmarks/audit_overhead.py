"""What the passive `DDPAudit` callback costs: step time of 2-rank DDP (gloo) with and without it.

    python benchmarks/audit_overhead.py [--steps 60] [--repeats 5] [--out DIR]
    python benchmarks/audit_overhead.py --out docs/results/audit-overhead   # the docs' numbers

Each repeat trains the same small module (examples/audit_models.py: WithBatchNorm, global batch
64) twice in one launch, with and without the callback, in alternating order; the median step
time of each run (after 5 warm-up steps) is kept, and the overhead is the median over repeats
of the paired ratio. The callback works once, at the start of training and after the first
batch, so its cost per step shrinks with the number of steps.
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
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self._t)

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
        result[variant] = clock.times
    if trainer.is_global_zero:
        out.write_text(json.dumps(result))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write audit_overhead.json and tables.md here")
    p.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args.child[0].split(","), args.steps, Path(args.child[1]))
        return {}
    variants = ["without", "with DDPAudit"]
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
                medians[v].append(statistics.median(times[v][5:]))
    ratios = [w / wo for w, wo in zip(medians["with DDPAudit"], medians["without"])]
    result = {"steps": args.steps, "repeats": args.repeats, "median_step_s": medians, "ratios": ratios,
              "overhead": statistics.median(ratios) - 1}
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
    medians, ratios = result["median_step_s"], result["ratios"]
    lines = ["| variant | median step time (ms), per repeat |", "|---|---|"]
    for v, times in medians.items():
        lines.append(f"| {v} | {', '.join(f'{1000 * t:.3g}' for t in times)} |")
    lines += ["", f"- overhead of DDPAudit: {100 * result['overhead']:+.2g}% of the step time (median of "
                  f"{result['repeats']} paired ratios, range {100 * (min(ratios) - 1):+.2g}% to "
                  f"{100 * (max(ratios) - 1):+.2g}%; {result['steps']} steps per run, 5 warm-up steps left out)"]
    return "\n".join(lines)


def command_md(result: dict, out: str) -> str:
    """The command line that wrote ``out`` (``command.md`` for the page)."""
    return (f"```bash\npython benchmarks/audit_overhead.py --steps {result['steps']} --repeats {result['repeats']} "
            f"--out {out}\n```\n")

if __name__ == "__main__":
    main()
