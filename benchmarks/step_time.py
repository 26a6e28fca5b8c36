"""Step time of each configuration and of each fix: medians over repeated runs, with their spread.

    python benchmarks/step_time.py                        # small model and ResNet-18 VAE, CPU, gloo
    python benchmarks/step_time.py --models small --steps 30 --repeats 5
    python benchmarks/step_time.py --models small --out docs/results/step-time   # the docs' numbers

For every model it trains, through Lightning, ``single``, default ``ddp`` (2 processes),
``ddp`` with each fix of the factor registry alone and with all of them. Each variant is
launched ``--repeats`` times, in rounds (every round runs every variant once, in a rotated
order, so that a slow period of the machine hits all variants alike). Per run: the median
optimizer-step time after ``--warmup`` steps. Per variant: the median of its runs' medians
and their range; the ratio to default ddp is taken within each round (paired) and reported
as the median ratio and its range over rounds. A difference is called only when every
round agrees on its side of 1 *and* the ratio's range stays clear of the noise; otherwise
the output says it is not resolved at this precision (a loaded CPU widens the range).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from vae_ddp.fixes import registry
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import launch_by_world_size
from vae_ddp.harness.table import format_table, write_tables


def variants() -> dict[str, dict]:
    """``{name: RunSpec fields}``: single, default ddp, ddp with each fix of the factor registry
    (each non-default value of each switch), ddp with every fix."""
    out = {"single": {"config": "single"}, "ddp": {"config": "ddp"}}
    for f in registry.switches():
        for value in f.choices:
            out[f"ddp + {f.value_label(value)}"] = {"config": "ddp", f.field: value}
    out["ddp + all fixes"] = {"config": "ddp", **{f.field: f.fixed for f in registry.switches()}}
    return out


def run_median(spec: RunSpec, out: Path, warmup: int) -> float:
    """Median seconds per optimizer step of one run, after ``warmup`` steps."""
    records = launch_by_world_size([spec], out, quiet=True)[0][0]["runs"][0]["records"]
    times = [r["time_s"] for r in records]
    steps = [b - a for a, b in zip(times, times[1:])][warmup:]
    return statistics.median(steps)


def sig3(x: float) -> str:
    """Three significant digits, no exponent for the magnitudes of this table."""
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def summarise(runs: dict[str, list[float]], ref: str = "ddp", tolerance: float = 0.02) -> dict:
    """Per variant: median and range of the run medians (s), and the paired ratios to ``ref``
    (round by round): median, range, and a verdict.

    A variant is ``faster``/``slower`` than ``ref`` only if the ratio is on the same side of 1 in
    every round and beyond ``tolerance`` (2%) in every round; otherwise ``not resolved``.
    """
    out = {}
    for name, times in runs.items():
        ratios = [t / r for t, r in zip(times, runs[ref])]
        if name == ref:
            verdict = "reference"
        elif all(q > 1 + tolerance for q in ratios):
            verdict = "slower"
        elif all(q < 1 - tolerance for q in ratios):
            verdict = "faster"
        else:
            verdict = "not resolved"
        out[name] = {"run_medians_s": times, "median_s": statistics.median(times), "min_s": min(times),
                     "max_s": max(times), "ratios": ratios, "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios), "verdict": verdict}
    return out


def render(model: str, summary: dict, settings: dict) -> str:
    """The table and the lines that say what it resolves; ``settings``: ``global_batch_size``,
    ``repeats``, ``warmup``, ``steps``. (The load of the machine is for whoever runs the
    benchmark: ``main`` warns on stderr and ``step_time.json`` keeps it; the page does not.)"""
    rows = []
    for name, s in summary.items():
        ratio = "1" if s["verdict"] == "reference" else (
            f"{s['ratio_median']:.2f} ({s['ratio_min']:.2f} to {s['ratio_max']:.2f})")
        rows.append([name, sig3(s["median_s"] * 1000), f"{sig3(s['min_s'] * 1000)} to {sig3(s['max_s'] * 1000)}",
                     ratio, s["verdict"] if s["verdict"] != "reference" else "-"])
    title = (f"{model} VAE, global batch {settings['global_batch_size']}, CPU (gloo, 2 processes for ddp); "
             f"{settings['repeats']} runs per variant, median step after {settings['warmup']} warm-up steps of "
             f"{settings['steps']}")
    table = format_table(["variant", "median step (ms)", "range over runs (ms)", "/ default ddp (range)",
                          "vs default ddp"], rows, title=title)
    spreads = [s["ratio_max"] - s["ratio_min"] for n, s in summary.items() if s["verdict"] != "reference"]
    resolved = [n for n, s in summary.items() if s["verdict"] in ("faster", "slower")]
    lines = [f"- The ratios to default ddp vary by up to {max(spreads):.2f} between rounds: differences smaller "
             "than that are not resolved by this run."]
    if resolved:
        lines.append("- Resolved in every round: " + "; ".join(
            f"{n} {summary[n]['verdict']} ({summary[n]['ratio_median']:.2f}x)" for n in resolved) + ".")
    else:
        lines.append("- No variant differs from default ddp consistently in every round.")
    return table + "\n\n" + "\n".join(lines)


def render_all(results: dict) -> str:
    """Every model's table of ``step_time.json`` (what ``--out`` writes into ``tables.md``)."""
    tables = []
    for model, summary in results["models"].items():
        tables.append(render(model, {k: v for k, v in summary.items() if not k.startswith("_")}, results["settings"]))
    return "\n\n".join(tables)


def command_md(results: dict, out: str) -> str:
    """The command line that wrote ``out`` (``command.md`` for the page)."""
    s = results["settings"]
    return ("```bash\n# DIR: the CIFAR-10 subset (ImageFolder tree)\n"
            f"python benchmarks/step_time.py --models {' '.join(results['models'])} --steps {s['steps']} "
            f"--warmup {s['warmup']} --repeats {s['repeats']} --global-batch-size {s['global_batch_size']} "
            f"--data-dir DIR --out {out}\n```\n")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "resnet18"], choices=["small", "resnet18"])
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per variant (rounds)")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--data-dir", default=os.environ.get("VAE_DDP_CIFAR_SUBSET"),
                   help="ImageFolder tree of CIFAR-10 images (default: $VAE_DDP_CIFAR_SUBSET)")
    p.add_argument("--out", type=Path, default=None, help="also write the results (step_time.json, tables.md) here")
    args = p.parse_args(argv)
    if not args.data_dir:
        p.error("give --data-dir DIR (an ImageFolder tree of CIFAR-10 images) or set VAE_DDP_CIFAR_SUBSET")
    if args.steps - args.warmup < 3 or args.repeats < 2:
        p.error("need --steps at least --warmup + 3 and --repeats at least 2")
    settings = {"steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
                "global_batch_size": args.global_batch_size}
    results: dict = {"settings": settings, "models": {}}
    specs = variants()
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            base = RunSpec(model=model, steps=args.steps, global_batch_size=args.global_batch_size, devices=2,
                           data="imagefolder", data_dir=args.data_dir, max_samples=4000)
            runs: dict[str, list[float]] = {name: [] for name in specs}
            load_before = os.getloadavg()[0]
            names = list(specs)
            for r in range(args.repeats):
                for name in names[r % len(names):] + names[:r % len(names)]:  # rotated order per round
                    spec = dataclasses.replace(base, **specs[name], label=name).validate()
                    out = Path(tmp) / model / f"{name.replace(' ', '_')}-{r}"
                    runs[name].append(run_median(spec, out, args.warmup))
            summary = summarise(runs)
            summary["_load_average"] = {"before": load_before, "after": os.getloadavg()[0], "cores": os.cpu_count()}
            if load_before > (os.cpu_count() or 1) / 2:  # other work widens the spread: rerun on an idle machine
                print(f"step_time: other work loaded the CPU when the {model} runs started (load average "
                      f"{load_before:.1f} on {os.cpu_count()} cores); rerun on an idle machine", file=sys.stderr)
            results["models"][model] = summary
    text = render_all(results)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_time.json").write_text(json.dumps(results, indent=1))
        write_tables(args.out, text)
        (args.out / "command.md").write_text(command_md(results, args.out.as_posix()))
    return results

if __name__ == "__main__":
    main()
