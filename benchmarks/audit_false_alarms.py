"""How often `vae-ddp audit` raises a false alarm: audits of modules that DDP with the fixes trains exactly.

    python benchmarks/audit_false_alarms.py [--seeds 0 1 2] [--dtypes float64 float32] [--out DIR]
    python benchmarks/audit_false_alarms.py --out docs/results/audit-false-alarms   # the docs' numbers

Each audit (2 gloo ranks, 3 steps, the default global batch) of a module of
``examples/audit_models.py`` whose every exposure the audit fixes by itself — no factor,
gradient clipping, BatchNorm, dropout, two optimizers — must find DDP with the fixes within its
floor (``within_floor`` of ``audit.json``): anything else is a false alarm of the audit's verdict
rules (one step's gradient, update, buffers and the ranks' parameters from the same weights, each
within 2x its one-device floor; the parameters after the 3 steps within 1000x the 3-step floor).
The exit code is not the measure: it is 1 for BatchNorm and dropout by the exit rule (DDP as the
user runs it trains another model, which the fixes close; ``vae_ddp.audit.exit_rule``); an audit
that does not end with 0 or 1 stops the benchmark. The table gives, per audit, whether it was
within the floor and the largest per-step ratio to the floor (the floors are in the JSON); the
summary counts the false alarms.
Many minutes on 2 CPU cores (about 30 s an audit): run it on an idle machine and commit its output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Modules the audit can make exact by itself (see examples/audit_models.py).
CLEAN = ("Plain", "Clipped", "WithBatchNorm", "WithDropout", "TwoOptimizers")


def audit_one(model: str, seed: int, dtype: str, out: Path) -> dict:
    """One `vae-ddp audit` in a subprocess (under the project's guard); its exit code and verdict numbers."""
    sys.path.insert(0, str(ROOT / "src"))
    from vae_ddp import guard

    # a dtype, or a mixed precision of Lightning's (its parameters float32)
    precision = ["--dtype", dtype] if dtype in ("float64", "float32") else ["--trainer.precision", dtype]
    cmd = [sys.executable, "-m", "vae_ddp.cli", "audit", "--model", f"examples/audit_models.py:{model}",
           "--data", "examples/audit_models.py:Regression", "--steps", "3", "--seed", str(seed),
           *precision, "--out", str(out)]
    proc = guard.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    r = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else {}
    step = r.get("whole_step") or {}
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"vae-ddp audit of {model} (seed {seed}, {dtype}) exited with {proc.returncode}")
    return {"model": model, "seed": seed, "dtype": dtype, "within_floor": r.get("within_floor"),
            "ratio_to_floor": r.get("ratio_to_floor"), "floor": r.get("floor"),
            "update_ratio": step.get("update_ratio"), "buffer_ratio": step.get("buffer_ratio"),
            "ranks_ratio": step.get("ranks_ratio"), "trajectory_ratio": r.get("trajectory_ratio"),
            "update_judged": step.get("update_judged", True)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--dtypes", nargs="+", choices=["float64", "float32", "bf16-mixed"],
                   default=["float64", "float32", "bf16-mixed"])
    p.add_argument("--models", nargs="+", choices=CLEAN, default=list(CLEAN))
    p.add_argument("--out", type=Path, default=None,
                   help="write audit_false_alarms.json, tables.md and command.md here")
    args = p.parse_args(argv)
    audits = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            for model in args.models:
                for seed in args.seeds:
                    audits.append(audit_one(model, seed, dtype, Path(tmp) / f"{model}-{seed}-{dtype}"))
                    print(json.dumps(audits[-1]), flush=True)
    result = {"seeds": args.seeds, "dtypes": args.dtypes, "models": args.models, "audits": audits,
              "false_alarms": sum(not a["within_floor"] for a in audits)}
    text = render(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "audit_false_alarms.json").write_text(json.dumps(result, indent=1))
        (args.out / "tables.md").write_text(text + "\n")
        (args.out / "command.md").write_text(command_md(result, args.out.as_posix()))
    return result


def render(result: dict) -> str:
    """The table and the count of ``audit_false_alarms.json`` (what ``--out`` writes into ``tables.md``):
    a row per module, a column per dtype, each cell whether DDP with the fixes was within 2x its floor,
    seed by seed (``ok``; a false alarm: ``ALARM``), and the largest ratio."""
    audits = result["audits"]
    seeds = ", ".join(map(str, result["seeds"]))

    def cell(model: str, dtype: str) -> str:
        row = [a for s in result["seeds"] for a in audits if (a["model"], a["dtype"], a["seed"]) == (model, dtype, s)]
        ratios = [a["ratio_to_floor"] for a in row if a["ratio_to_floor"] is not None]
        return (", ".join("ok" if a["within_floor"] else "ALARM" for a in row)
                + (f" ({max(ratios):.2f})" if ratios else ""))

    lines = ["| module | " + " | ".join(result["dtypes"]) + " |", "|---|" + "---|" * len(result["dtypes"])]
    for model in result["models"]:
        lines.append(f"| {model} | " + " | ".join(cell(model, d) for d in result["dtypes"]) + " |")
    ratios = [a["ratio_to_floor"] for a in audits if a["ratio_to_floor"] is not None]
    lines += ["", f"- seeds {seeds}: ok where DDP with the fixes computes one device's whole step within 2x its floor "
                  f"(in parentheses: DDP's largest per-step gradient difference over "
                  f"the floor, the largest of the seeds); "
                  f"false alarms: {result['false_alarms']} of {len(audits)} audits"
                  + (f"; the largest ratio {max(ratios):.2f}" if ratios else "")]
    rest = {k: [a[k] for a in audits if a.get(k) is not None and (k != "update_ratio" or judged(a))]
            for k in ("update_ratio", "buffer_ratio", "ranks_ratio", "trajectory_ratio")}
    if all(rest.values()):
        mixed = sorted({a["dtype"] for a in audits if not judged(a)})
        lines.append("- the rest of the step, every step from one device's weights, each over its own floor "
                     f"(largest): update {max(rest['update_ratio']):.2f}"
                     + (f" (not judged under {', '.join(mixed)})" if mixed else "")
                     + f", buffers {max(rest['buffer_ratio']):.2f}, ranks apart "
                     f"{max(rest['ranks_ratio']):.2f}; after the 3 steps, each run on its own, "
                     f"{max(rest['trajectory_ratio']):.3g}x the 3-step floor")
    return "\n".join(lines)


def judged(audit: dict) -> bool:
    """Whether the audit judged the update (not under a mixed precision, where Adam amplifies rounding)."""
    return audit.get("update_judged", audit["dtype"] in ("float64", "float32"))


def command_md(result: dict, out: str) -> str:
    """The command line that wrote ``out`` (``command.md`` for the page)."""
    return (f"```bash\npython benchmarks/audit_false_alarms.py --seeds {' '.join(map(str, result['seeds']))} "
            f"--dtypes {' '.join(result['dtypes'])} --out {out}\n```\n")


if __name__ == "__main__":
    main()
