"""Does gradient clipping behave the same under DDP? One device against DDP on 2 processes.

A small regression MLP (8 -> 32 -> 1, tanh, mean squared error on targets scaled so that the
gradient's norm is well above the clip value) takes one SGD step (learning rate 1, so the
update is minus the clipped gradient) in float64: on one device at global batch size 16, and
with Lightning DDP on 2 gloo processes at 8 per device, on the same samples
(``GlobalBatchDistributedSampler``). Compared: the update, ``||DDP - one device|| / ||one
device||`` over all parameters, with

- ``Trainer(gradient_clip_val=...)``, by norm and with ``gradient_clip_algorithm="value"``;
- manual optimization that keeps each rank's own gradient (``no_sync``), then either clips
  it and all-reduces it by hand (each rank clips its own gradient), or all-reduces and then
  clips (the order of the first case, written by hand). The DDP run records the norm of each
  rank's own gradient right after backward: two different norms show that no all-reduce ran.

    python examples/gradient_clipping.py --out out/gradient_clipping

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank (each runs the one-device references too; they are tiny); only rank 0 writes.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp.fixes import GlobalBatchDistributedSampler
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

SAMPLES, FEATURES, WIDTH, GLOBAL_BATCH = 64, 8, 32, 16
CLIP = {"norm": 1.0, "value": 0.1}


def regression_data() -> TensorDataset:
    """``x: (SAMPLES, FEATURES)``, ``y: (SAMPLES, 1)``, float64; large targets, large gradients."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    w = torch.randn(FEATURES, 1, generator=g, dtype=torch.float64)
    return TensorDataset(x, 10 * torch.sin(x @ w) + torch.randn(SAMPLES, 1, generator=g, dtype=torch.float64))


class Regression(pl.LightningModule):
    """``x: (b, FEATURES) float64 -> (b, 1)``; Lightning clips (``gradient_clip_val``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def train_dataloader(self):
        data = regression_data()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)  # same samples on any world size
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


# --8<-- [start:manual]
class ManualClipping(Regression):
    """The same model with manual optimization: each rank's own gradient (``no_sync``), then
    ``clip_first=True``: clip it, all-reduce (mean); ``False``: all-reduce (mean), then clip."""

    def __init__(self, algorithm: str, clip_first: bool) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.algorithm, self.clip_first = algorithm, clip_first

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        with self.trainer.strategy.model.no_sync():  # no all-reduce in backward: this rank's gradient
            self.manual_backward(loss)
        if self.clip_first:
            self.clip_gradients(opt, gradient_clip_val=CLIP[self.algorithm], gradient_clip_algorithm=self.algorithm)
        for p in self.parameters():  # what DDP's all-reduce does: the mean over ranks
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        if not self.clip_first:
            self.clip_gradients(opt, gradient_clip_val=CLIP[self.algorithm], gradient_clip_algorithm=self.algorithm)
        opt.step()
# --8<-- [end:manual]


class RecordingManualClipping(ManualClipping):
    """Keeps the norm of this rank's own gradient right after ``manual_backward`` (before any clip
    or all-reduce): if DDP had all-reduced in backward, both ranks would hold the same."""

    def manual_backward(self, loss, *args, **kwargs) -> None:
        super().manual_backward(loss, *args, **kwargs)
        self.own_grad_norm = norm({n: p.grad for n, p in self.named_parameters()})


def first_update(model: Regression, devices: int, algorithm: str | None) -> dict:
    """Parameters after one step minus before, and the gradient ``on_before_optimizer_step`` sees;
    ``algorithm=None``: Lightning does not clip (the manual runs clip in ``training_step``)."""
    probe = GradientProbe(step=0)
    # --8<-- [start:trainer]
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
                         gradient_clip_val=CLIP.get(algorithm), gradient_clip_algorithm=algorithm,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    # --8<-- [end:trainer]
    trainer.fit(model)
    return {"update": {n: p.detach() - probe.params[n] for n, p in model.named_parameters()}, "seen": probe.grads}


def build(seed: int, algorithm: str, manual: bool | None) -> Regression:
    """The model, initialized alike: ``manual=None``: Lightning clips; ``True``/``False``: ``ManualClipping``
    (clip before or after the all-reduce)."""
    pl.seed_everything(seed, verbose=False)
    return (Regression() if manual is None else RecordingManualClipping(algorithm, clip_first=manual)).double()


def norm(tensors: dict) -> float:
    return sum(float((t ** 2).sum()) for t in tensors.values()) ** 0.5


def rel_diff(a: dict, b: dict) -> float:
    """``||a - b|| / ||b||`` over all parameters (L2 norm of the concatenation)."""
    return norm({n: a[n] - b[n] for n in b}) / norm(b)


CASES = [  # (key, run, algorithm, manual: None = Lightning clips, True = each rank clips first, False = after)
    (f"{kind}_{algorithm}", label, algorithm, manual)
    for algorithm in CLIP
    for kind, label, manual in [("lightning", "DDP: `gradient_clip_val`", None),
                                ("rank_clips", "DDP: rank clips, all-reduce", True),
                                ("all_reduce_then_clip", "DDP: all-reduce, clip", False)]
]


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="gradient clipping under DDP against one device")
    p.add_argument("--out", type=Path, default=Path("out/gradient_clipping"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    world = 2
    # one-device references first (on every rank, before the process group exists), then DDP
    one = {a: first_update(build(args.seed, a, None), 1, a) for a in CLIP}
    unclipped = first_update(build(args.seed, "norm", None), 1, None)["update"]
    result = {"world_size": world, "global_batch_size": GLOBAL_BATCH, "dtype": "float64", "clip": CLIP,
              "global_grad_norm": norm(one["norm"]["seen"]),
              "one_device_update_norm": {a: norm(one[a]["update"]) for a in CLIP},
              "one_device_value_update_max_abs": max(float(u.abs().max()) for u in one["value"]["update"].values()),
              "unclipped_update_vs_seen": rel_diff({n: -g for n, g in one["norm"]["seen"].items()}, unclipped)}
    for key, label, algorithm, manual in CASES:
        m = build(args.seed, algorithm, manual)
        run = first_update(m, world, algorithm if manual is None else None)
        if manual is not None:  # each rank's own first gradient's norm, as the DDP run had it
            result[key + "_own_grad_norms"] = own = [None] * world
            dist.all_gather_object(own, m.own_grad_norm)
        result[key] = {"run": label, "algorithm": algorithm, "update_norm": norm(run["update"]),
                       "update_rel_diff": rel_diff(run["update"], one[algorithm]["update"])}
        if manual is None:  # the all-reduced gradient, before Lightning clips it
            result[key]["seen_rel_diff"] = rel_diff(run["seen"], one[algorithm]["seen"])
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gradient_clipping.json").write_text(json.dumps(result, indent=1))
        r0, r1 = result["rank_clips_norm_own_grad_norms"]
        print(f"float64, one SGD step (lr 1), one device at {GLOBAL_BATCH} vs DDP 2 × {GLOBAL_BATCH // world}; "
              f"clip norm {CLIP['norm']}, clip value {CLIP['value']}; first gradient's norm: "
              f"{result['global_grad_norm']:.3g} (global batch), {r0:.3g} and {r1:.3g} (each rank's own)\n")
        print("| run | clip by | update's norm | vs one device |")
        print("|---|---|---|---|")
        for algorithm in CLIP:
            one_norm = result["one_device_update_norm"][algorithm]
            print(f"| one device: `gradient_clip_val` | {algorithm} | {one_norm:.3g} | |")
            for key, label, _, _ in (c for c in CASES if c[2] == algorithm):
                r = result[key]
                print(f"| {label} | {algorithm} | {r['update_norm']:.3g} | {sci(r['update_rel_diff'])} |")
        seen = max(result[f"lightning_{a}"]["seen_rel_diff"] for a in CLIP)
        print(f"\nThe gradient `on_before_optimizer_step` sees under DDP with `gradient_clip_val` (not yet "
              f"clipped) against one device's: {sci(seen)}.")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
