"""``vae-ddp``: a thin command line over the library.

Subcommands: ``compare`` (the main job), ``equivalence``, ``ablation``, ``seeds``, ``report-scale``.
Bad input gets one line on stderr and exit code 2 before any training; a failed run
(any rank) gets its error and exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from vae_ddp.studies.configs import CONFIGS, DTYPES, RunSpec
from vae_ddp.data import DATASETS
from vae_ddp.studies.dp import DP_MODES
from vae_ddp.errors import UserError
from vae_ddp.model import MODELS

__all__ = ["main", "build_parser"]


def _common(p: argparse.ArgumentParser, steps: int, out: str, gbs: int = 64) -> None:
    p.add_argument("--data", default="digits", help=f"one of {', '.join(DATASETS)} (default: digits, bundled)")
    p.add_argument("--data-dir", default=None, help="ImageFolder root for --data imagefolder, CIFAR-10 root for cifar10")
    p.add_argument("--max-samples", type=int, default=None, help="use a fixed random subset of this many images")
    p.add_argument("--model", default="small", help=f"one of {', '.join(MODELS)} (default: small)")
    p.add_argument("--steps", type=int, default=steps, help=f"optimizer steps (default: {steps})")
    p.add_argument("--global-batch-size", type=int, default=gbs, help=f"samples per optimizer step (default: {gbs})")
    p.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="cpu (gloo) or gpu (NCCL)")
    p.add_argument("--lr", type=float, default=1e-4, help="learning rate (default: 1e-4, the report's)")
    p.add_argument("--optimizer", default="adam", help="adam (the report's) or sgd")
    p.add_argument("--out", type=Path, default=Path(out), help=f"output folder (default: {out})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vae-ddp", description=(
        "Why DDP on N devices with per-device batch B/N does not reproduce one device with batch B, "
        "measured on the lightning-bolts CIFAR-10 VAE."))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="train single, ddp and dp side by side (the main job)")
    _common(p, steps=60, out="runs/compare", gbs=256)
    p.add_argument("--devices", type=int, default=2, help="world size of ddp, replicas of dp (default: 2)")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"any of {', '.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-every", type=int, default=10, help="validate every N steps (0: never)")
    p.add_argument("--dp", dest="dp_mode", default="auto", help=f"one of {', '.join(DP_MODES)}: real "
                   "torch.nn.DataParallel needs 2+ CUDA devices; auto picks it when present, else the emulation")
    p.add_argument("--exact", action="store_true", help="turn every fix on (noise, BatchNorm, sampler, logging)")

    p = sub.add_parser("equivalence", help="all fixes on: does ddp match single to the last digits?")
    _common(p, steps=100, out="runs/equivalence")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("ablation", help="from the exact configuration, undo one fix at a time")
    _common(p, steps=100, out="runs/ablation")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)

    p = sub.add_parser("seeds", help="the statistical study: many seeds of single, ddp, fixed ddp and dp")
    _common(p, steps=100, out="runs/seeds")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--num-seeds", type=int, default=10)
    p.add_argument("--configs", nargs="+", default=["single", "ddp", "ddp+fixed", "dp"],
                   help="any of single, ddp, ddp+fixed, ddp+per_rank, dp")
    p.add_argument("--val-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    p.add_argument("--dp", dest="dp_mode", default="auto", help=f"one of {', '.join(DP_MODES)}")
    p = sub.add_parser("report-scale", help="the report's scale (ResNet-18, 2 x 128): each factor's one-step "
                       "gradient difference over batch-to-batch noise, and the logged-KL spread")
    p.add_argument("--data", default="imagefolder", help=f"one of {', '.join(DATASETS)} (default: imagefolder)")
    p.add_argument("--data-dir", default="../shared/data/cifar10-jpg-subset",
                   help="ImageFolder root (e.g. the CIFAR-10 subset) or CIFAR-10 folder for --data cifar10")
    p.add_argument("--max-samples", type=int, default=None, help="use a fixed random subset of this many images")
    p.add_argument("--model", default="resnet18", help=f"one of {', '.join(MODELS)} (default: resnet18, the report's)")
    p.add_argument("--global-batch-size", type=int, default=256, help="samples per optimizer step (default: 256)")
    p.add_argument("--devices", type=int, default=2, help="ddp world size and dp replicas (default: 2)")
    p.add_argument("--grad-steps", type=int, default=3, help="global batches per run, at frozen weights (default: 3)")
    p.add_argument("--spread-batches", type=int, default=6,
                   help="extra forward passes for the logged-KL spread (default: 6; 0: skip)")
    p.add_argument("--variants", nargs="+", default=None, help="subset of the variants (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"], help="cpu (gloo) or gpu (NCCL)")
    p.add_argument("--out", type=Path, default=Path("runs/report-scale"), help="output folder")
    return parser


def _spec(args: argparse.Namespace, **overrides) -> RunSpec:
    base = dict(data=args.data, data_dir=args.data_dir, max_samples=args.max_samples, model=args.model,
                steps=args.steps, global_batch_size=args.global_batch_size, dtype=args.dtype,
                accelerator=args.accelerator, lr=args.lr, optimizer=args.optimizer)
    for name in ("devices", "dp_mode", "val_every"):
        if hasattr(args, name):
            base[name] = getattr(args, name)
    if hasattr(args, "seed"):
        base["seeds"] = [args.seed]
    base.update(overrides)
    return RunSpec(**base)


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from vae_ddp.studies.launch import RunFailed

    try:
        if args.command == "compare":
            from vae_ddp.studies.compare import compare

            for c in args.configs:
                if c not in CONFIGS:
                    raise UserError(f"unknown configuration {c!r}: use any of {', '.join(CONFIGS)}")
            compare(_spec(args), args.configs, args.out, exact=args.exact)
        elif args.command == "equivalence":
            from vae_ddp.studies.equivalence import equivalence

            equivalence(_spec(args), args.world_sizes, args.out)
        elif args.command == "ablation":
            from vae_ddp.studies.ablation import ablation

            ablation(_spec(args), args.out)
        elif args.command == "seeds":
            from vae_ddp.studies.seeds import seed_study

            seed_study(_spec(args), args.configs, args.num_seeds, args.out)
        elif args.command == "report-scale":
            from vae_ddp.studies.report_scale import report_scale

            report_scale(out=args.out, data=args.data, data_dir=args.data_dir, model=args.model,
                         global_batch_size=args.global_batch_size, devices=args.devices, grad_steps=args.grad_steps,
                         spread_batches=args.spread_batches, variants=args.variants, max_samples=args.max_samples,
                         seed=args.seed, accelerator=args.accelerator)
    except UserError as err:
        print(f"vae-ddp: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. an --out folder that cannot be created
        print(f"vae-ddp: error: {err.strerror or err}: {err.filename or ''} (check --out and --data-dir)",
              file=sys.stderr)
        return 2
    except RunFailed as err:
        print(f"vae-ddp: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("vae-ddp: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
