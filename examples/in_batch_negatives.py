"""In-batch negatives under DDP: is the first gradient of a contrastive loss one device's?

A SimCLR-style model: each sample comes as two views (two fixed noisy copies of one
vector, so no random draw differs between runs), a small MLP encoder maps both, and the
loss is the InfoNCE (NT-Xent) cross-entropy over temperature-scaled cosine similarities:
each embedding's positive is the other view of its sample, its negatives the other
embeddings of the batch. One device (global batch 16) is compared with Lightning DDP on 2
gloo processes (8 samples per device, the same samples through
``GlobalBatchDistributedSampler``, float64), by the gradient the optimizer receives at the
first step. Under DDP the loss is computed four ways:

- per rank: each rank's loss sees only its own samples as negatives;
- ``self.all_gather(z, sync_grads=True)`` and the loss over the gathered global batch;
- the same gather, but each rank keeps only its own samples as anchors (the keys are the
  global batch): the loss is split over the ranks instead of computed on each;
- ``self.all_gather(z, sync_grads=False)`` with this rank's own embeddings put back into
  the gathered tensor (a common way to keep a gradient), then the loss over the global batch.

    python examples/in_batch_negatives.py --out out/in_batch_negatives

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank (each runs the one-device reference too; it is tiny); only rank 0 writes.
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vae_ddp.fixes import GlobalBatchDistributedSampler
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

FEATURES, HIDDEN, EMBED, SAMPLES, GLOBAL_BATCH, TEMPERATURE = 8, 16, 4, 64, 16, 0.5


# --8<-- [start:loss]
def info_nce(q1, q2, k1, k2, start=0):
    """InfoNCE over in-batch negatives, the mean over the anchors.

    ``q1, q2: (b, E)``: the anchors, two views of ``b`` samples; ``k1, k2: (n, E)``: the
    keys, two views of ``n`` samples, of which the anchors are samples ``start .. start+b-1``.
    An anchor's positive is the other view of its sample; its negatives are the ``2n - 2``
    other keys."""
    b, n = len(q1), len(k1)
    q = F.normalize(torch.cat([q1, q2]), dim=1)
    k = F.normalize(torch.cat([k1, k2]), dim=1)
    logits = q @ k.T / TEMPERATURE                                   # (2b, 2n)
    own = torch.cat([torch.arange(b), torch.arange(b) + n]) + start  # each anchor's own key
    positive = torch.cat([own[b:], own[:b]])                         # the other view
    itself = F.one_hot(own, 2 * n).bool()
    return F.cross_entropy(logits.masked_fill(itself, float("-inf")), positive)
# --8<-- [end:loss]


class Contrastive(pl.LightningModule):
    """``x: (b, FEATURES) -> z: (b, EMBED)``; ``loss`` is one of ``LOSSES``."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss_kind = loss
        self.encoder = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, EMBED))
        self.seen: dict = {}

    def forward(self, x):
        return self.encoder(x)

    # --8<-- [start:step]
    def training_step(self, batch, batch_idx):
        z1, z2 = self(batch[0]), self(batch[1])                     # this rank's b samples
        if self.loss_kind == "per_rank":
            loss = info_nce(z1, z2, z1, z2)
        elif self.loss_kind == "gather_grads":
            k1 = self.all_gather(z1, sync_grads=True).reshape(-1, EMBED)  # (world size * b, E)
            k2 = self.all_gather(z2, sync_grads=True).reshape(-1, EMBED)
            loss = info_nce(k1, k2, k1, k2)
        elif self.loss_kind == "gather_grads_local_anchors":
            k1 = self.all_gather(z1, sync_grads=True).reshape(-1, EMBED)
            k2 = self.all_gather(z2, sync_grads=True).reshape(-1, EMBED)
            loss = info_nce(z1, z2, k1, k2, start=self.global_rank * len(z1))
        else:  # "gather_no_grads": gathered without a graph, this rank's own slot put back
            g1 = self.all_gather(z1, sync_grads=False).reshape(self.trainer.world_size, *z1.shape)
            g2 = self.all_gather(z2, sync_grads=False).reshape(self.trainer.world_size, *z2.shape)
            self.seen["gathered_requires_grad"] = g1.requires_grad
            g1[self.global_rank], g2[self.global_rank] = z1, z2
            k1, k2 = g1.reshape(-1, EMBED), g2.reshape(-1, EMBED)
            loss = info_nce(k1, k2, k1, k2)
        # --8<-- [end:step]
        self.seen["keys"] = 2 * len(k1) if self.loss_kind != "per_rank" else 2 * len(z1)
        return loss

    def train_dataloader(self):
        data = TwoViews()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class TwoViews(Dataset):
    """Sample ``i``: ``(x_i + 0.1 e1_i, x_i + 0.1 e2_i)``, ``(FEATURES,) float64`` each, with
    ``x``, ``e1``, ``e2`` drawn once from a fixed generator."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        x, e1, e2 = (torch.randn(SAMPLES, FEATURES, generator=g, dtype=torch.float64) for _ in range(3))
        self.v1, self.v2 = x + 0.1 * e1, x + 0.1 * e2

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.v1[i], self.v2[i]


LOSSES = {"per_rank": "negatives per rank",
          "gather_grads": "`all_gather(sync_grads=True)`",
          "gather_grads_local_anchors": "`sync_grads=True`, own anchors",
          "gather_no_grads": "`sync_grads=False`, own slot put back"}


def first_step(loss: str, devices: int, seed: int) -> tuple[dict, dict]:
    """The gradients the optimizer receives at step 0, and what the step saw."""
    pl.seed_everything(seed, verbose=False)
    model = Contrastive(loss).double()
    probe = GradientProbe(step=0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    trainer.fit(model)
    return probe.grads, model.seen


def flat(grads: dict) -> torch.Tensor:
    return torch.cat([g.flatten() for _, g in sorted(grads.items())])


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="in-batch negatives under DDP")
    p.add_argument("--out", type=Path, default=Path("out/in_batch_negatives"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    ref_grads, ref_seen = first_step("per_rank", 1, args.seed)  # on one device the batch is the global batch
    ref = flat(ref_grads)
    scale = float(ref.abs().max())
    world = 2
    result = {"global_batch_size": GLOBAL_BATCH, "world_size": world, "dtype": "float64",
              "temperature": TEMPERATURE, "one_device_negatives_per_anchor": ref_seen["keys"] - 2}
    for loss in LOSSES:
        grads, seen = first_step(loss, world, args.seed)
        g = flat(grads)
        result[loss] = {"negatives_per_anchor": seen["keys"] - 2,
                        "grad_rel_diff": float((g - ref).abs().max()) / scale,
                        "grad_norm_ratio": float(g.norm() / ref.norm()),
                        "times_world_size_rel_diff": float((world * g - ref).abs().max()) / scale}
        if "gathered_requires_grad" in seen:
            result[loss]["gathered_requires_grad"] = seen["gathered_requires_grad"]
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "in_batch_negatives.json").write_text(json.dumps(result, indent=1))
        print(f"one device (batch {GLOBAL_BATCH}, {result['one_device_negatives_per_anchor']} negatives per anchor) "
              f"vs DDP ({world} x {GLOBAL_BATCH // world}), float64, first step; gradient norm ratio = "
              f"DDP / one device\n")
        print("| loss under DDP | negatives per anchor | gradient: max abs diff / max abs | norm ratio |")
        print("|---|---|---|---|")
        for loss, label in LOSSES.items():
            r = result[loss]
            print(f"| {label} | {r['negatives_per_anchor']} | {sci(r['grad_rel_diff'])} "
                  f"| {r['grad_norm_ratio']:.4f} |")
        r = result["gather_no_grads"]
        print(f"\nWith `sync_grads=False` the gathered tensor has `requires_grad={r['gathered_requires_grad']}`; "
              f"its gradient times the world size differs from one device's by "
              f"{sci(r['times_world_size_rel_diff'])} (max abs diff / max abs).")
    close_process_group()
    return result


if __name__ == "__main__":
    main()
