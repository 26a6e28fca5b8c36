"""Does the change in 1.x names (``vae_changed.py``) do what it promises? Measured on Lightning 1.9.5.

Trains the report's bolts VAE for one step from the same seed (``PL_GLOBAL_SEED``) on the CIFAR-10
subset, on a CPU (gloo), four ways at one global batch: one device with ``--same step``; DDP on 2
processes with ``--same step``; DDP with ``--same distribution``; the report's script unchanged on DDP.
Each DDP run's weights and BatchNorm buffers after the step are compared with one device's. Adam's
first step moves a weight by about the learning rate (1e-4) whatever the gradient's size, so a weight
whose gradient differs in more than rounding moves differently: the measure is the share of weights
that differ from one device's by more than 1% of the learning rate. "The same step" holds when that
share is rounding's (a few weights whose gradient is near Adam's epsilon, 1e-8) and the buffers are
equal; "the same distribution" and the unchanged script take other draws and other rows, and about
half the weights differ.

    .venv-legacy/bin/python examples/legacy/change_check.py --out examples/legacy/results/change_check

writes ``change_check.json`` and ``change_check.md`` (the table ``docs/legacy.md`` includes). About
a minute on 2 CPU cores. Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LR = 1e-4
RUNS = {  # name: (script, --same, devices)
    "one device, --same step": ("vae_changed.py", "step", 1),
    "DDP, --same step": ("vae_changed.py", "step", 2),
    "DDP, --same distribution": ("vae_changed.py", "distribution", 2),
    "DDP, the report's script": ("vae.py", None, 2),
}
REFERENCE = "one device, --same step"


def _train(name: str, data_dir: str, global_batch: int, seed: int, root: Path) -> dict:
    script, same, devices = RUNS[name]
    args = [sys.executable, str(HERE / script), "--data_dir", data_dir, "--accelerator", "cpu", "--devices",
            str(devices), "--batch_size", str(global_batch // devices), "--num_workers", "0", "--max_steps", "1",
            "--limit_val_batches", "0", "--num_sanity_val_steps", "0", "--enable_progress_bar", "false",
            "--default_root_dir", str(root)]
    args += ["--strategy", "ddp"] if devices > 1 else []
    args += ["--same", same] if same else []
    env = dict(os.environ, PL_GLOBAL_SEED=str(seed), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(f"change_check.py: {name} failed (exit {proc.returncode})")
    import torch

    (ckpt,) = glob.glob(str(root / "lightning_logs" / "version_0" / "checkpoints" / "*.ckpt"))
    on_cpu = "GlobalSyncBatchNorm in place of sync_batchnorm=True" in proc.stderr
    return {"state": torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"], "cpu_note": on_cpu}


def compare(ref: dict, other: dict) -> dict:
    """``other``'s weights and BatchNorm buffers against ``ref``'s (two state dicts, same keys)."""
    import torch

    weights = [k for k in ref if ref[k].is_floating_point() and "running" not in k]
    buffers = [k for k in ref if "running" in k]
    diffs = torch.cat([(ref[k].double() - other[k].double()).abs().flatten() for k in weights])
    return {"weights": diffs.numel(), "share_beyond_1pct_lr": float((diffs > 0.01 * LR).double().mean()),
            "largest_weight_diff": float(diffs.max()),
            "largest_buffer_diff": max(float((ref[k].double() - other[k].double()).abs().max()) for k in buffers)}


def render(result: dict) -> str:
    lines = [f"The report's bolts VAE, one step from seed {result['seed']}, global batch {result['global_batch']} "
             f"(DDP: 2 x {result['global_batch'] // 2}), Lightning {result['lightning']}, CPU; against one device "
             "with `--same step`:", "",
             "| run | weights differing by over 1% of the learning rate | largest BatchNorm buffer difference |",
             "|---|---|---|"]
    for name, c in result["runs"].items():
        lines.append(f"| {name} | {c['share_beyond_1pct_lr']:.2g} ({c['weights']:,} weights) | "
                     f"{c['largest_buffer_diff']:.2g} |")
    lines += ["", f"Each run took {result['seconds_per_run']:.0f} s on average. On this CPU, "
              "`vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm` stood in for `sync_batchnorm=True` (torch's "
              "SyncBatchNorm refuses CPU tensors)." if result["cpu_batchnorm"] else ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", default=os.environ.get("VAE_DDP_CIFAR_DIR"), help="the CIFAR-10 ImageFolder tree")
    p.add_argument("--global_batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if not args.data_dir or not os.path.isdir(os.path.join(args.data_dir, "train")):
        p.exit(2, f"change_check.py: error: --data_dir {args.data_dir!r} has no train/ folder: give the CIFAR-10 "
               "ImageFolder tree\n")
    if args.global_batch < 2 or args.global_batch % 2:
        p.exit(2, f"change_check.py: error: --global_batch must be even and at least 2, got {args.global_batch}\n")
    import pytorch_lightning as pl

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        states = {n: _train(n, args.data_dir, args.global_batch, args.seed, Path(tmp) / str(i))
                  for i, n in enumerate(RUNS)}
    ref = states[REFERENCE]["state"]
    result = {"seed": args.seed, "global_batch": args.global_batch, "lightning": pl.__version__,
              "cpu_batchnorm": all(s["cpu_note"] for n, s in states.items() if RUNS[n][0] == "vae_changed.py"
                                   and RUNS[n][2] > 1),
              "seconds_per_run": (time.perf_counter() - t0) / len(RUNS),
              "runs": {n: compare(ref, s["state"]) for n, s in states.items() if n != REFERENCE}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "change_check.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "change_check.md").write_text(render(result))
    print(render(result))
    return result


if __name__ == "__main__":
    main()
