"""Is DDP's step one device's, with every change, at the report's model and batch, from trained weights too?

``vae-ddp equivalence`` (teacher-forced: every DDP step starts from one device's weights at that step and
its all-reduced gradient is compared with one device's, against the floor of one-device runs with the
samples of each batch permuted) at the report's model and batch (the ResNet-18 VAE, global batch 256 =
2 x 128, the CIFAR-10 subset, float32, Adam), twice: from the initial weights of ``seed_everything(seed)``
(``OUT/initial/``) and from one device's final weights after the training study
(``examples/report_training.py``'s ``TRAINING/seed-S/``, its ``params-S.pt``: ``OUT/trained/``). A part whose
``equivalence.json`` exists is not run again. ``OUT/summary.json`` keeps, per part, the weights it
started from (the training's steps and the file's SHA-256), its verdict and its wall time;
``OUT/summary.md`` is the table the page shows.

    python examples/report_step_equality.py --data_dir DIR --training docs/results/report-training \\
        --weights runs/report-training --seed 0 --steps 2 --out docs/results/step-equality
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _weights(folder: Path, seed: int) -> Path:
    """One device's final weights of ``seed`` in a report_training output folder."""
    found = sorted(folder.glob(f"seed-{seed}/runs/1-process/*/params-{seed}.pt"))
    if len(found) != 1:
        raise SystemExit(f"report_step_equality.py: error: no single one-device weights file params-{seed}.pt "
                         f"under {folder}/seed-{seed}/runs/1-process/: run examples/report_training.py first")
    return found[0]


def render(summary: dict) -> str:
    """The table of the parts run so far."""
    lines = ["| weights the steps start from | DDP's largest step difference over the floor | verdict | time |",
             "|---|---|---|---|"]
    for part in ("initial", "trained"):
        p = summary["parts"].get(part)
        if p is None:
            continue
        ws = p["world_sizes"]["2"]
        start = ("the initial weights" if part == "initial" else
                 f"one device's after {p['trained_steps']} training steps (seed {summary['seed']})")
        lines.append(f"| {start} | {ws['ratio_to_floor']:.3g} (floor {p['floor']:.3g} relative) | {ws['verdict']} | "
                     f"{p['seconds'] / 60:.1f} min |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data_dir", required=True, help="an ImageFolder tree (the CIFAR-10 subset)")
    p.add_argument("--training", type=Path, required=True, help="report_training.py's --out (its results.json)")
    p.add_argument("--weights", type=Path, default=None,
                   help="where that study kept its runs' weights, if not under --training")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2, help="teacher-forced steps per part")
    p.add_argument("--permutations", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("runs/step-equality"))
    args = p.parse_args(argv)

    from vae_ddp.harness.configs import RunSpec
    from vae_ddp.studies.equivalence import equivalence

    results = json.loads((args.training / f"seed-{args.seed}" / "results.json").read_text())
    trained_steps = max(r["step"] for r in results["records"] if r["config"] == "single")  # steps count from 1
    weights = _weights(args.weights or args.training, args.seed)
    base = RunSpec(data="imagefolder", data_dir=args.data_dir, model="resnet18", global_batch_size=256, devices=2,
                   steps=args.steps, seeds=[args.seed], dtype="float32", optimizer="adam")
    summary_file = args.out / "summary.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {"seed": args.seed, "parts": {}}
    for part, init in (("initial", None), ("trained", str(weights))):
        folder = args.out / part
        if (folder / "equivalence.json").is_file() and part in summary["parts"]:
            print(f"{part}: done before ({folder / 'equivalence.json'})", flush=True)
            if init:  # what it started from, read again (a summary written by an earlier version of this script)
                summary["parts"][part].update(trained_steps=trained_steps, weights_sha256=_sha256(weights))
            continue
        t0 = time.perf_counter()
        r = equivalence(RunSpec(**{**base.__dict__, "init_weights": init}), [2], folder, args.permutations)
        summary["parts"][part] = {
            "seconds": time.perf_counter() - t0, "floor": r["floor"], "steps": args.steps,
            "world_sizes": {n: {k: e[k] for k in ("ratio_to_floor", "within_floor", "verdict")}
                            for n, e in r["world_sizes"].items()},
            **({"trained_steps": trained_steps, "weights_sha256": _sha256(weights)} if init else {})}
        args.out.mkdir(parents=True, exist_ok=True)
        summary_file.write_text(json.dumps(summary, indent=1) + "\n")
    summary_file.write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "summary.md").write_text(render(summary))
    print(render(summary))
    return summary


if __name__ == "__main__":
    main()
