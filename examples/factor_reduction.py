"""Factor 4: mean reduction (and gradient averaging). When is "mean per rank, then average" the global mean?

Each DDP rank takes the mean loss over its own batch and DistributedDataParallel averages
the gradients over ranks, so sample i on rank r gets the weight ``1 / (N * n_r)``; one
device gives every sample ``1 / sum(n_r)``. The two agree exactly when every rank has the
same batch size. This script measures, on real images and the model's per-sample losses
(eval mode, so that samples do not interact through BatchNorm), the loss and the gradient
of: equal batches; an uneven split (one rank short, as a last batch split unevenly
would be); and ``DistributedSampler``'s padding, which repeats samples to even out ranks.

    python examples/factor_reduction.py --out out/reduction
"""

import argparse
import json
from pathlib import Path

import torch
from matplotlib.figure import Figure

from vae_ddp.data import DigitsDataModule
from vae_ddp.fixes import registry
from vae_ddp.model import VAE


def per_sample_losses(model: VAE, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``(B,)`` loss of each sample: the batch loss of [`vae_loss`][vae_ddp.model.vae_loss] at batch size 1."""
    return torch.stack([model.step(x[i:i + 1], eps[i:i + 1])[0] for i in range(len(x))])


# --8<-- [start:objective]
def ddp_objective(losses: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """What DDP optimises: the average over ranks of each rank's mean loss."""
    return torch.stack([chunk.mean() for chunk in losses.split(sizes)]).mean()
# --8<-- [end:objective]


def sample_weights(global_ids: list[int], sizes: list[int]) -> list[float]:
    """Weight of each distinct sample in the DDP objective, relative to one device's ``1 / n``:
    d(ddp objective) / d(loss of sample i), times the number of distinct samples n."""
    unique = sorted(set(global_ids))
    losses = torch.zeros(max(unique) + 1, dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(ddp_objective(losses[global_ids], sizes), losses)
    return [float(grad[i]) * len(unique) for i in unique]


def takeaway(r: dict) -> str:
    """The result in one sentence, worded from the numbers."""
    equal, uneven, padded = (r["cases"][k] for k in r["cases"])
    exact = "up to float64 rounding" if equal["grad_rel_diff"] < 1e-10 else f"to {equal['grad_rel_diff']:.2e}"
    return (f"**Result.** With equal per-rank batches the mean of the rank means is the global mean {exact}. "
            f"An uneven split weights the short rank's samples {max(uneven['weights']):.3g} times as much as one "
            f"device does (loss off by {100 * uneven['loss_rel_diff']:.3g}%), and `DistributedSampler`'s padding "
            f"counts the repeated samples {max(padded['weights']):.3g} times (loss off by "
            f"{100 * padded['loss_rel_diff']:.3g}%).")


def plot(r: dict, path: Path) -> None:
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    axes = fig.subplots(1, len(r["cases"]), sharey=True)
    for ax, (name, c) in zip(axes, r["cases"].items()):
        ax.bar(range(len(c["weights"])), c["weights"], width=1.0, color="C0")
        ax.axhline(1.0, color="k", lw=0.8, ls="--", label="one device")
        ax.set_title(name.replace(" (", "\n("), fontsize=9)
        ax.set_xlabel("sample")
        ax.set_ylabel("weight in the DDP loss\n(one device = 1)")  # every panel labelled, shared axis or not
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.savefig(path, dpi=110)


def grad_of(model: VAE, objective: torch.Tensor) -> torch.Tensor:
    grads = torch.autograd.grad(objective, [p for p in model.parameters() if p.requires_grad], allow_unused=True,
                                retain_graph=True)
    return torch.cat([g.flatten() for g in grads if g is not None])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="mean reduction and gradient averaging")
    p.add_argument("--out", type=Path, default=Path("out/reduction"))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    dm = DigitsDataModule()
    dm.setup()
    x = torch.stack([dm.dataset_train[i][0] for i in range(64)]).double()
    model = VAE(enc_type="small", latent_dim=16).double().eval()
    eps = torch.randn(64, 16, dtype=torch.float64)
    cases = {
        "equal batches (2 x 32)": (x, eps, [32, 32], list(range(64))),
        "uneven batches (32 + 8)": (x[:40], eps[:40], [32, 8], list(range(40))),
        # 62 samples on 4 ranks: DistributedSampler pads to 64 by repeating the first 2
        "DistributedSampler padding (62 samples, 4 ranks)": (x, eps, [16] * 4, list(range(62)) + [0, 1]),
    }
    result = {"cases": {}}
    for name, (xs, es, sizes, global_ids) in cases.items():
        losses = per_sample_losses(model, xs, es)
        ddp = ddp_objective(losses[global_ids], sizes)  # rank r holds global_ids[sum(sizes[:r]):...]
        unique = sorted(set(global_ids))
        single = losses[unique].mean()  # one device sees each sample once
        g_ddp, g_single = grad_of(model, ddp), grad_of(model, single)
        result["cases"][name] = {"weights": sample_weights(global_ids, sizes),
            "loss_ddp": float(ddp.detach()), "loss_single": float(single.detach()),
            "loss_rel_diff": float((abs(ddp - single) / abs(single)).detach()),
            "grad_rel_diff": float((g_ddp - g_single).abs().max() / g_single.abs().max()),
        }
    equal, uneven, padded = result["cases"].values()
    result["summary"] = {
        "Factor": registry.get("reduction").name,  # the factor's one name (vae_ddp.fixes.registry)
        "What goes wrong": "the mean of per-rank means weights samples unequally when rank batches differ",
        "Measured here": f"loss off by {100 * uneven['loss_rel_diff']:.3g}% (uneven split), "
                         f"{100 * padded['loss_rel_diff']:.3g}% (padding); {equal['loss_rel_diff']:.2e} "
                         "with equal batches",
        "Fix": "equal per-rank batches: `drop_last=True`; `GlobalBatchDistributedSampler` drops the incomplete "
               "global batch",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "factor_reduction.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "factor_reduction.png")
    print(takeaway(result) + "\n")
    # three columns, two numbers a cell: fits a phone
    print("| case | loss: mean of rank means / global mean | relative diff: loss / gradient (max) |")
    print("|---|---|---|")
    for name in cases:
        r = result["cases"][name]
        print(f"| {name} | {r['loss_ddp']:.6f} / {r['loss_single']:.6f} | {r['loss_rel_diff']:.2e} / "
              f"{r['grad_rel_diff']:.2e} |")
    return result


if __name__ == "__main__":
    main()
