"""Factor 1: random streams per rank. Is the reparameterization noise the same on every rank?

Runs Lightning DDP (2 gloo processes on CPU) three times from ``seed_everything(seed)``:
with the default noise, with a per-rank seed, and with global-batch noise, records the
``eps`` each rank draws in ``training_step`` and measures the correlation of rank 0's and
rank 1's draws. With global-batch noise it also checks that the two ranks' draws put
together are exactly what one device with the whole global batch draws.

    python examples/factor_noise.py --out out/noise

Lightning starts rank 1 by re-running this same command, so the script runs as is on
every rank; only rank 0 prints and writes ``out/noise/factor_noise.json``.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
from matplotlib.figure import Figure

from vae_ddp.data import DigitsDataModule
from vae_ddp.fixes import GlobalBatchNoise, PerRankSeed, registry
from vae_ddp.model import VAE
from vae_ddp.probes import NoiseProbe
from vae_ddp.utils import close_process_group, quiet

MODES = ("default", "per_rank", "global")
LABELS = {"default": "default (same seed on every rank)", "per_rank": "PerRankSeed", "global": "GlobalBatchNoise"}


# --8<-- [start:measure]
def draws(mode: str, seed: int, steps: int, per_device_batch: int) -> torch.Tensor:
    """The ``eps`` of every rank and step: ``(world_size, steps, per_device_batch, latent_dim)``."""
    pl.seed_everything(seed, verbose=False)
    dm = DigitsDataModule(batch_size=per_device_batch, sampler="global", sampler_seed=seed)
    model = VAE(enc_type="small", latent_dim=16)
    fix = {"default": [], "per_rank": [PerRankSeed(seed)], "global": [GlobalBatchNoise(seed)]}[mode]
    probe = NoiseProbe()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[*fix, probe])
    trainer.fit(model, datamodule=dm)
    return probe.gathered.cpu()
# --8<-- [end:measure]


def takeaway(r: dict) -> str:
    """The result in one sentence, worded from the numbers."""
    d, b = r["default"], r["per_device_batch_size"]
    fixed = max(abs(r[m]["corr_rank0_rank1"]) for m in ("per_rank", "global"))
    same = "identical" if d["identical_fraction"] == 1.0 else f"{100 * d['identical_fraction']:.3g}% identical"
    exact = ("exactly the draws of one device with the whole global batch"
             if r["global"]["max_abs_diff_vs_single_device"] == 0.0 else
             f"the draws of one device up to {r['global']['max_abs_diff_vs_single_device']:.2e}")
    return (f"**Result.** By default the two ranks draw {same} reparameterization noise (correlation "
            f"{d['corr_rank0_rank1']:.3f}): a global batch of {2 * b} samples carries only {b} independent "
            f"draws of `eps`, each used twice, and the Monte Carlo KL term is averaged over half as many draws "
            f"as on one device. With either fix the correlation is at most {fixed:.3f} in absolute value, and "
            f"`GlobalBatchNoise` gives {exact}.")


def plot(eps: dict, path: Path) -> None:
    """rank 1's eps against rank 0's, one panel per noise mode (first 2,000 values)."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    for ax, mode in zip(fig.subplots(1, len(MODES), sharex=True, sharey=True), MODES):
        r0, r1 = eps[mode][0].flatten()[:2000], eps[mode][1].flatten()[:2000]
        ax.scatter(r0, r1, s=2, alpha=0.4, color="C0")
        ax.set_title(LABELS[mode], fontsize=9)
        ax.set_xlabel("eps drawn on rank 0")
        ax.set_ylabel("eps drawn on rank 1 (same row)")  # every panel labelled, shared axis or not
        ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="random streams per rank under DDP")
    p.add_argument("--out", type=Path, default=Path("out/noise"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    b = 32
    result = {"steps": args.steps, "per_device_batch_size": b, "world_size": 2}
    all_eps = {}
    for mode in MODES:
        eps = all_eps[mode] = draws(mode, args.seed, args.steps, b)
        r0, r1 = eps[0].flatten(), eps[1].flatten()
        result[mode] = {
            "corr_rank0_rank1": float(torch.corrcoef(torch.stack([r0, r1]))[0, 1]),
            "identical_fraction": float((r0 == r1).double().mean()),
        }
        if mode == "global":  # the ranks' rows together == one device drawing for the global batch
            single = GlobalBatchNoise(args.seed)  # world size 1, rank 0: the single-device draw
            ref = []
            for k in range(args.steps):
                single._batch = k
                ref.append(single(torch.zeros(2 * b, 16)))
            both = torch.cat([eps[0], eps[1]], dim=1)  # (steps, 2b, d): rank 0's rows, then rank 1's
            result[mode]["max_abs_diff_vs_single_device"] = float((both - torch.stack(ref)).abs().max())
    result["summary"] = {
        "Factor": registry.get("noise").name,  # the factor's one name (vae_ddp.fixes.registry)
        "What goes wrong": "every rank draws the same reparameterization noise",
        "Measured here": f"corr(eps on rank 0, eps on rank 1) = {result['default']['corr_rank0_rank1']:.3f}; "
                         f"{result['global']['corr_rank0_rank1']:.3f} with the fix",
        "Fix": "a per-rank `torch.Generator` for `eps`; `callbacks=[GlobalBatchNoise(seed)]`",
    }
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "factor_noise.json").write_text(json.dumps(result, indent=1))
        plot(all_eps, args.out / "factor_noise.png")
        print(takeaway(result) + "\n")
        print("| noise | corr(eps rank 0, eps rank 1) | identical draws |")
        print("|---|---|---|")
        for mode in MODES:
            r = result[mode]
            print(f"| {LABELS[mode]} | {r['corr_rank0_rank1']:.3f} | {100 * r['identical_fraction']:.3g}% |")
        d = result["global"]["max_abs_diff_vs_single_device"]
        print(f"\n`GlobalBatchNoise`, the ranks' draws put together vs one device's draw for the global batch: "
              f"max abs diff = {'0 (bitwise equal)' if d == 0 else f'{d:.2e}'}")
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
    return result


if __name__ == "__main__":
    main()
