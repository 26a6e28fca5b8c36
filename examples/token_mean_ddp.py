"""A mean over a variable number of tokens under DDP: is the first gradient one device's?

A next-token model (embedding, one GRU layer, a linear head) on padded sequences of random
valid lengths: labels past a sequence's end are ``-100`` and the loss is
``F.cross_entropy(..., ignore_index=-100)``, the mean over the tokens that count. One device
(global batch 16) is compared with Lightning DDP on 2 gloo processes (8 sequences per
device, the same samples at every step through ``GlobalBatchDistributedSampler``, float64):
the gradient the optimizer receives at the first step, and the logged loss
(``sync_dist=True``). Per device the batches have equal sizes but not equal token counts,
so the per-rank mean weighs a token by ``1 / (N * n_r)`` instead of ``1 / sum(n_r)``;
``global_token_cross_entropy`` divides each rank's token sum by the all-reduced count.

    python examples/token_mean_ddp.py --out out/token_mean

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

from vae_ddp.fixes import GlobalBatchDistributedSampler, global_token_cross_entropy
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import close_process_group, quiet

VOCAB, LENGTH, WIDTH, SAMPLES, GLOBAL_BATCH = 12, 10, 16, 64, 16


class NextToken(pl.LightningModule):
    """``tokens: (b, T) int64 -> logits: (b, T, VOCAB)``; ``loss`` is ``"per_rank_mean"`` or ``"global_mean"``."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss_kind = loss
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.rnn = nn.GRU(WIDTH, WIDTH, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        return self.head(self.rnn(self.emb(tokens))[0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits, target = self(x).flatten(0, 1), y.flatten()
        if self.loss_kind == "per_rank_mean":
            loss = F.cross_entropy(logits, target, ignore_index=-100)
        else:
            loss = global_token_cross_entropy(logits, target, ignore_index=-100)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def train_dataloader(self):
        data = PaddedSequences()
        sampler = GlobalBatchDistributedSampler(data, GLOBAL_BATCH)
        return DataLoader(data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class PaddedSequences(Dataset):
    """Random sequences of 2 to ``LENGTH`` valid tokens, padded: ``(x, y)``, ``(LENGTH,) int64``
    each; ``y[t] = x[t + 1]`` for valid positions, ``-100`` elsewhere."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=g)
        self.lengths = torch.randint(2, LENGTH + 1, (SAMPLES,), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x, y = self.tokens[i, :-1].clone(), self.tokens[i, 1:].clone()
        y[self.lengths[i]:] = -100
        x[self.lengths[i]:] = 0
        return x, y


LOSSES = {"per_rank_mean": "`F.cross_entropy(..., ignore_index=-100)` (mean per rank)",
          "global_mean": "`global_token_cross_entropy(...)` (token count all-reduced)"}


def first_step(loss: str, devices: int, seed: int) -> tuple[dict, float]:
    """The gradients the optimizer receives at step 0 and the logged loss."""
    pl.seed_everything(seed, verbose=False)
    model = NextToken(loss).double()
    probe = GradientProbe(step=0)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False, callbacks=[probe])
    trainer.fit(model)
    return probe.grads, float(trainer.callback_metrics["train_loss"])


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="a token mean under DDP")
    p.add_argument("--out", type=Path, default=Path("out/token_mean"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    ref_grads, ref_loss = first_step("per_rank_mean", 1, args.seed)  # on one device the plain mean is the global mean
    one_device_helper, _ = first_step("global_mean", 1, args.seed)
    data = PaddedSequences()
    counts = [int((data[i][1] != -100).sum()) for i in GlobalBatchDistributedSampler(data, GLOBAL_BATCH, 1, 0,
                                                                                       seed=args.seed)]
    result = {"global_batch_size": GLOBAL_BATCH, "world_size": 2, "dtype": "float64",
              "tokens_per_rank_step0": [sum(counts[:GLOBAL_BATCH // 2]), sum(counts[GLOBAL_BATCH // 2:GLOBAL_BATCH])],
              "one_device_helper_vs_mean": max(float((one_device_helper[n] - ref_grads[n]).abs().max())
                                               for n in ref_grads)}
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for loss in LOSSES:
        grads, logged = first_step(loss, 2, args.seed)
        diff = max(float((grads[n] - ref_grads[n]).abs().max()) for n in ref_grads)
        result[loss] = {"grad_max_abs_diff": diff, "grad_rel_diff": diff / scale,
                        "logged_loss_abs_diff": abs(logged - ref_loss)}
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "token_mean_ddp.json").write_text(json.dumps(result, indent=1))
        a, b = result["tokens_per_rank_step0"]
        print(f"one device (batch {GLOBAL_BATCH}) vs DDP (2 x {GLOBAL_BATCH // 2}), float64, first step; "
              f"tokens that count at step 0: {a} on rank 0, {b} on rank 1\n")
        print("| loss under DDP | first gradient: max abs diff / max abs gradient | logged loss: abs diff |")
        print("|---|---|---|")
        for loss, label in LOSSES.items():
            r = result[loss]
            print(f"| {label} | {sci(r['grad_rel_diff'])} | {sci(r['logged_loss_abs_diff'])} |")
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
    return result


if __name__ == "__main__":
    main()
