"""Step time of each configuration and of each fix, as medians and ratios (a benchmark, not a test).

    python benchmarks/step_time.py              # small model and ResNet-18 VAE, CPU, gloo
    python benchmarks/step_time.py --models small --steps 30

For every model it trains, through Lightning, ``single``, default ``ddp`` (2 processes),
``ddp`` with each fix alone and with all of them, and prints the median optimizer-step
time (first steps skipped as warm-up) and the ratios ddp/single and fix/default-ddp.
Run it on an otherwise idle machine: medians on a shared 2-core CPU are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch
from vae_ddp.studies.table import format_table, write_tables

VARIANTS = {
    "single": dict(config="single"),
    "ddp": dict(config="ddp"),
    "ddp + global noise": dict(config="ddp", noise="global"),
    "ddp + per-rank seed": dict(config="ddp", noise="per_rank"),
    "ddp + sync BatchNorm": dict(config="ddp", sync_bn=True),
    "ddp + global sampler": dict(config="ddp", sampler="global"),
    "ddp + sync_dist logging": dict(config="ddp", sync_dist_logging=True),
    "ddp + all fixes": dict(config="ddp", noise="global", sync_bn=True, sampler="global", sync_dist_logging=True),
}


def median_step_time(spec: RunSpec, out: Path, warmup: int) -> float:
    """Median seconds per optimizer step of one run, after ``warmup`` steps."""
    records = launch(spec, out, quiet=True)["runs"][0]["records"]
    times = [r["time_s"] for r in records]
    steps = [b - a for a, b in zip(times, times[1:])][warmup:]
    return statistics.median(steps)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "resnet18"])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--data-dir", default=str(Path(__file__).resolve().parents[2] / "shared/data/cifar10-jpg-subset"))
    p.add_argument("--out", type=Path, default=None, help="also write the results (step_time.json, tables.md) here")
    args = p.parse_args(argv)
    results: dict = {}
    tables = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            base = RunSpec(model=model, steps=args.steps, global_batch_size=args.global_batch_size, devices=2,
                           data="imagefolder", data_dir=args.data_dir, max_samples=4000)
            res = {}
            for name, kw in VARIANTS.items():
                spec = dataclasses.replace(base, **kw, label=name).validate()
                res[name] = median_step_time(spec, Path(tmp) / model / name.replace(" ", "_"), args.warmup)
            results[model] = res
            rows = [[name, t * 1000, t / res["single"], t / res["ddp"]] for name, t in res.items()]
            tables.append(format_table(["variant", "median step (ms)", "/ single", "/ default ddp"], rows,
                                       title=f"{model} VAE, global batch {args.global_batch_size}, CPU (gloo), "
                                             f"median of {args.steps - args.warmup - 1} steps"))
            print(tables[-1] + "\n")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_time.json").write_text(json.dumps(results, indent=1))
        write_tables(args.out, "\n\n".join(tables))
    return results


if __name__ == "__main__":
    main()
