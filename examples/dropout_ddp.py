"""Dropout and random augmentation under DDP: does a small transformer-like model train on 2
devices exactly as on one?

A one-block causal language model (token and position embeddings, one attention head,
an MLP, ``nn.Dropout`` on the attention weights, the attention output and the MLP) learns
next tokens of random sequences, with a random augmentation in the ``Dataset`` (each input
token replaced by a random one with probability 0.1) and 2 DataLoader workers. It trains
for a few Adam steps in float64 on one device (global batch 16) and with Lightning DDP on 2
gloo processes (8 per device), every step on the same samples
(``GlobalBatchDistributedSampler``), and compares the parameters. Three cases:

- dropout 0 and no augmentation: no random draw at all, so the difference is DDP's
  rounding (the gradient all-reduce sums in another order): the floor;
- dropout 0.1 with ``nn.Dropout`` and a plain random transform: each rank draws its masks
  and augmentations from its own generator, seeded alike by ``seed_everything``;
- the same model with ``GlobalBatchRandomness`` (swaps ``nn.Dropout`` for
  ``GlobalBatchDropout`` during ``fit``) and ``SeededAugmentation``.

    python examples/dropout_ddp.py --out out/dropout

Lightning starts rank 1 by re-running this command, so the script runs as is on every
rank (each runs the one-device references too; they are tiny); only rank 0 writes.
"""

import argparse
import json
import math
from pathlib import Path

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalBatchRandomness, SeededAugmentation
from vae_ddp.utils import close_process_group, quiet
from vae_ddp.workers import worker_context

VOCAB, LENGTH, WIDTH, SAMPLES, GLOBAL_BATCH = 16, 8, 16, 64, 16


class TinyLM(pl.LightningModule):
    """One transformer block: ``tokens: (b, T) int64 -> logits: (b, T, VOCAB)``."""

    def __init__(self, dropout: float, data: Dataset) -> None:
        super().__init__()
        self.data = data
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.attn_drop, self.resid_drop = nn.Dropout(dropout), nn.Dropout(dropout)
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH),
                                 nn.Dropout(dropout))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        q, k, v = self.qkv(self.ln1(h)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(WIDTH)
        causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
        att = self.attn_drop(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        h = h + self.resid_drop(self.proj(att @ v))
        h = h + self.mlp(self.ln2(h))
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def train_dataloader(self):
        # built inside fit, so the sampler finds the process group (world size and rank)
        sampler = GlobalBatchDistributedSampler(self.data, GLOBAL_BATCH)
        # workers from a forkserver (torch and Lightning preloaded): a forked worker can hang (vae_ddp.workers)
        return DataLoader(self.data, batch_size=GLOBAL_BATCH // sampler.num_replicas, sampler=sampler, num_workers=2,
                          multiprocessing_context=worker_context())

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Sequences(Dataset):
    """``SAMPLES`` random token sequences: ``(x, y)`` with ``x, y: (LENGTH,) int64``, ``y`` = ``x`` shifted by one."""

    def __init__(self) -> None:
        self.seqs = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.seqs[i, :-1], self.seqs[i, 1:]


def replace_tokens(x):
    """The augmentation: each token replaced by a random one with probability 0.1 (torch's generator)."""
    return torch.where(torch.rand(x.shape) < 0.1, torch.randint(0, VOCAB, x.shape), x)


class PlainAugmentation(Dataset):
    """The usual way: the transform draws from the generator of whichever process loads the sample."""

    def __init__(self, data: Dataset) -> None:
        self.data = data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        x, y = self.data[i]
        return replace_tokens(x), y


CASES = {
    "floor": {"label": "dropout 0, no augmentation (DDP rounding only)", "dropout": 0.0},
    "default": {"label": "dropout 0.1 + augmentation, `nn.Dropout` and a plain transform", "dropout": 0.1},
    "fixed": {"label": "dropout 0.1 + augmentation, `GlobalBatchRandomness` and `SeededAugmentation`",
              "dropout": 0.1},
}


def train(case: str, devices: int, steps: int, seed: int) -> dict:
    """Train one case; return ``{name: parameter}`` (float64) after ``steps`` steps."""
    pl.seed_everything(seed, verbose=False)
    data = Sequences()
    if case == "default":
        data = PlainAugmentation(data)
    elif case == "fixed":
        data = SeededAugmentation(data, replace_tokens)
    model = TinyLM(CASES[case]["dropout"], data).double()
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=[GlobalBatchRandomness()] if case == "fixed" else [])
    trainer.fit(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def sci(v: float) -> str:
    """Two significant digits; an exact zero as 0."""
    return "0" if v == 0 else f"{v:.1e}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="dropout and augmentation of a small transformer-like model under DDP")
    p.add_argument("--out", type=Path, default=Path("out/dropout"))
    p.add_argument("--steps", type=int, default=6)  # 4 steps per epoch: the second epoch reshuffles and re-augments
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    quiet()
    single = {case: train(case, 1, args.steps, args.seed) for case in CASES}
    result = {"steps": args.steps, "global_batch_size": GLOBAL_BATCH, "world_size": 2, "dtype": "float64"}
    for case in CASES:
        ddp = train(case, 2, args.steps, args.seed)
        result[case] = {"max_abs_param_diff": max(float((ddp[n] - single[case][n]).abs().max()) for n in ddp)}
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "dropout_ddp.json").write_text(json.dumps(result, indent=1))
        print(f"one device (batch {GLOBAL_BATCH}) vs DDP (2 x {GLOBAL_BATCH // 2}), {args.steps} Adam steps, "
              f"float64: largest parameter difference\n")
        print("| model | max abs parameter difference |")
        print("|---|---|")
        for case, spec in CASES.items():
            print(f"| {spec['label']} | {sci(result[case]['max_abs_param_diff'])} |")
    close_process_group()  # Lightning leaves the group open after fit; gloo can abort at exit
    return result


if __name__ == "__main__":
    main()
