"""Small LightningModules that are not this project's VAE, one per factor, for `vae-ddp audit`.

Every module trains on `Regression` (synthetic, fixed data: `x: (n, 8)` float32,
`y: (n,)`), whose `batch_size` is the global batch size the audit splits across the ranks.
The "Audit your own model" page runs the audit on two of them; the tests run all of them:

    vae-ddp audit --model examples/audit_models.py:WithBatchNorm --data examples/audit_models.py:Regression
"""

from __future__ import annotations

import torch
from pytorch_lightning import LightningDataModule, LightningModule
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset


class Regression(LightningDataModule):
    """`n` samples of a fixed random regression task; `shuffle` as a user would set it."""

    def __init__(self, batch_size: int = 16, n: int = 64, shuffle: bool = True, num_workers: int = 0,
                 augment: bool = False) -> None:
        super().__init__()
        self.batch_size, self.n, self.shuffle = batch_size, n, shuffle
        self.num_workers, self.augment = num_workers, augment

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(self.n, 8, generator=g)
        y = x @ torch.randn(8, generator=g) + 0.1 * torch.randn(self.n, generator=g)
        self.train_set = Jitter(x, y) if self.augment else TensorDataset(x, y)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)


class Mixup(Regression):
    """Batch-level mixup in the loader's `collate_fn`: one lambda and one pairing per batch,
    drawn from torch's global generator (as `torchvision.transforms.v2.MixUp` in a collate_fn)."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=_mixup)


def _mixup(items):
    x = torch.stack([i[0] for i in items])
    y = torch.stack([i[1] for i in items])
    lam, perm = torch.rand(()), torch.randperm(len(x))
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


class Stream(Regression):
    """The same samples as a stream (an `IterableDataset`) that every rank iterates whole: under
    DDP each rank takes the same first B/N samples, the global batch is one per-device batch N times."""

    shard = False

    def train_dataloader(self) -> DataLoader:
        return DataLoader(Samples(self.train_set, self.shard), batch_size=self.batch_size)


class ShardedStream(Stream):
    """The stream sharded by rank (rank r of N takes samples r, r + N, ...), as
    `datasets.distributed.split_dataset_by_node` does: under DDP step k's samples are one device's."""

    shard = True


class Samples(IterableDataset):
    """`data`'s samples in order; with `shard`, this rank's every world_size-th (torch.distributed)."""

    def __init__(self, data, shard: bool) -> None:
        self.data, self.shard = data, shard

    def __iter__(self):
        import torch.distributed as dist

        rank, world = (dist.get_rank(), dist.get_world_size()) if self.shard and dist.is_initialized() else (0, 1)
        for i in range(rank, len(self.data), world):
            yield self.data[i]


class Weighted(Regression):
    """A `WeightedRandomSampler` that draws only the samples with a positive target (class
    balancing at its extreme): one device and every rank must train on those alone."""

    def train_dataloader(self) -> DataLoader:
        from torch.utils.data import WeightedRandomSampler

        weights = (self.train_set.tensors[1] > 0).double()
        return DataLoader(self.train_set, batch_size=self.batch_size,
                          sampler=WeightedRandomSampler(weights, num_samples=self.n, replacement=True))


class RankSeededWorkers(Regression):
    """`Regression(augment=True)`'s jittered samples read by DataLoader workers seeded by rank and
    worker: the `worker_init_fn` Lightning gives a loader after `seed_everything(seed, workers=True)`
    (`pl_worker_init_function`), with this rank's global rank as Lightning passes it. Every rank's
    workers draw their own jitter: independent draws, as one device's samples have."""

    def __init__(self, batch_size: int = 16, n: int = 64, shuffle: bool = True, num_workers: int = 1,
                 augment: bool = True) -> None:
        super().__init__(batch_size, n, shuffle, num_workers, augment)

    def train_dataloader(self) -> DataLoader:
        from functools import partial

        from lightning_fabric.utilities.seed import pl_worker_init_function

        rank = self.trainer.global_rank  # as a user writes it: Lightning attaches its Trainer before any hook
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0,
                          worker_init_fn=partial(pl_worker_init_function, rank=rank))


class Jitter(Dataset):
    """Random augmentation drawn from torch's global generator in `__getitem__` (as torchvision's transforms do)."""

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(8), self.y[i]


class Base(LightningModule):
    def __init__(self, sync_dist: bool = True) -> None:
        super().__init__()
        self.sync_dist = sync_dist
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=self.sync_dist, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class Plain(Base):
    """No exposure at all (with an unshuffled, evenly divisible dataset and synced logging)."""


class Wide(Base):
    """`Plain` with a hidden layer `width` units wide: a model whose tensors, not its logs, fill the audit's
    folder (what the disk estimate is tested on)."""

    def __init__(self, width: int = 20000) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


class NoisyStep(Base):
    """Input noise drawn with `torch.randn_like` in `training_step`: not keyed to the sample."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x + 0.1 * torch.randn_like(x)), y)


class NoisyStepPerRank(NoisyStep):
    """`NoisyStep` whose ranks seed their generators differently (`setup`): each rank draws its own
    noise, independent as one device's rows are."""

    def setup(self, stage: str) -> None:
        torch.manual_seed(1000 + self.global_rank)


class MaskInForward(Base):
    """A hand-made dropout inside a submodule's `forward` (`torch.rand_like`), the same masks on every rank."""

    class Mask(nn.Module):
        def forward(self, h):
            return h * (torch.rand_like(h) > 0.25) / 0.75 if self.training else h

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), self.Mask(), nn.Linear(16, 1))


class NumpyNoise(Base):
    """Input noise drawn with NumPy in `training_step`: nothing torch draws, so nothing the audit can key."""

    def training_step(self, batch, batch_idx):
        import numpy as np

        x, y = batch
        noise = torch.as_tensor(np.random.standard_normal(tuple(x.shape)), dtype=x.dtype)
        return F.mse_loss(self(x + 0.1 * noise), y)


class Clipped(Base):
    """Gradient clipping by the global norm, through Lightning's own hook."""

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, gradient_clip_val=0.1, gradient_clip_algorithm="norm")


class WithDropout(Base):
    def __init__(self, p: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(p), nn.Linear(16, 1))


class WithBatchNorm(Base):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))


class Unsynced(Base):
    def __init__(self) -> None:
        super().__init__(sync_dist=False)


class TwoOptimizers(Base):
    """Manual optimization with two optimizers (a GAN-like alternation)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_a, opt_b = self.optimizers()
        for opt in (opt_a, opt_b):
            loss = F.mse_loss(self(x), y)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))

    def configure_optimizers(self):
        first, second = self.net[0].parameters(), self.net[2].parameters()
        return torch.optim.Adam(first, lr=1e-2), torch.optim.SGD(second, lr=1e-2)


class Gan(Base):
    """Two optimizers, each stepping on a loss that leaves the other's parameters out (Lightning's
    GAN example pattern): DDP needs ``strategy="ddp_find_unused_parameters_true"``."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.critic = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        opt_g, opt_c = self.optimizers()
        fake = self(x)
        loss_c = F.mse_loss(self.critic(fake.detach().unsqueeze(-1)).squeeze(-1), y)  # the critic's only
        opt_c.zero_grad()
        self.manual_backward(loss_c)
        opt_c.step()
        loss_g = F.mse_loss(fake, y)  # the generator's only
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.net.parameters(), lr=1e-2), torch.optim.Adam(self.critic.parameters(), lr=1e-2)


class SkippedExpert(Base):
    """A mixture of two experts that skips an expert with no samples routed to it (as MoE layers do):
    expert 1 takes the samples whose first feature is above 1 (about one in six), which some per-rank
    shares of a global batch do not hold, so that expert's parameters get no gradient on that rank
    and DDP without ``find_unused_parameters`` waits for them."""

    def __init__(self) -> None:
        super().__init__()
        del self.net  # the experts are the whole model
        self.experts = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])

    def forward(self, x):
        route = (x[:, 0] > 1.0).long()  # expert 1 for the rare samples
        out = torch.zeros(len(x), dtype=x.dtype, device=x.device)
        for e, expert in enumerate(self.experts):
            idx = route == e
            if idx.any():  # an expert with no samples is skipped
                out = out.index_put((idx.nonzero().squeeze(1),), expert(x[idx]).squeeze(-1))
        return out


class MaskedTokens(LightningModule):
    """Next-token-like loss: cross entropy averaged over the valid tokens of each rank's batch."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 16)
        self.out = nn.Linear(16, vocab)

    def training_step(self, batch, batch_idx):
        x, _ = batch  # x: (b, 8) float -> tokens, with a per-sample valid length
        tokens = (x.abs() * 3).long().clamp(max=self.vocab - 1)
        length = 2 + tokens[:, 0] % 6
        targets = tokens.roll(-1, dims=1)
        targets[torch.arange(8, device=x.device)[None, :] >= length[:, None]] = -100
        logits = self.out(self.emb(tokens))
        loss = F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1), ignore_index=-100)
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class GlobalTokens(MaskedTokens):
    """The same tokens, averaged over the global token count (vae_ddp.fixes.global_token_cross_entropy)."""

    def training_step(self, batch, batch_idx):
        from vae_ddp.fixes import global_token_cross_entropy

        x, _ = batch
        tokens = (x.abs() * 3).long().clamp(max=self.vocab - 1)
        length = 2 + tokens[:, 0] % 6
        targets = tokens.roll(-1, dims=1)
        targets[torch.arange(8, device=x.device)[None, :] >= length[:, None]] = -100
        logits = self.out(self.emb(tokens))
        return global_token_cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


class PaddedTokens(Regression):
    """Sequences of 2 to 7 tokens, padded in the loader's `collate_fn` to the longest row of
    each batch (as Hugging Face's `DataCollatorWithPadding` and `pad_sequence` do): under DDP
    each rank pads its own per-device batch, one device the global batch."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, collate_fn=_pad_tokens)


def _pad_tokens(items):
    x = torch.stack([i[0] for i in items])  # (b, 8)
    tokens = (x.abs() * 3).long().clamp(max=10)
    length = 2 + tokens[:, 0] % 6
    targets = tokens.roll(-1, dims=1)
    targets[torch.arange(8)[None, :] >= length[:, None]] = -100
    longest = int(length.max())
    return tokens[:, :longest], targets[:, :longest]  # (b, longest) each


class PaddedTokensDropout(LightningModule):
    """Token embeddings with dropout, averaged over the global token count
    (`global_token_cross_entropy`), on `PaddedTokens`: the loss reduces over the global batch,
    but the dropout masks drawn for the global batch follow each rank's own padded length."""

    def __init__(self, vocab: int = 11, p: float = 0.2) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 16)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(16, vocab)

    def training_step(self, batch, batch_idx):
        from vae_ddp.fixes import global_token_cross_entropy

        tokens, targets = batch
        logits = self.out(self.drop(self.emb(tokens)))
        return global_token_cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class GatheredNegatives(Base):
    """In-batch negatives over the global batch (SimCLR-style): the embeddings of every rank
    gathered with gradients, ``self.all_gather(z, sync_grads=True)``; each rank's rows are the
    queries, its own rows of the gathered keys their positives."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z = F.normalize(self.net(x), dim=-1)  # (b, 8)
        keys = self.all_gather(z, sync_grads=True)  # (N, b, 8) under DDP, z itself on one device
        keys = keys.flatten(0, 1) if keys.dim() == 3 else keys
        labels = torch.arange(len(z), device=z.device) + self.global_rank * len(z)
        return F.cross_entropy(z @ keys.T / 0.5, labels)


class SummedLoss(Base):
    """A loss summed over the batch (`reduction="sum"`): DDP's gradient is 1/N of one device's."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y, reduction="sum")


class LocalNegatives(GatheredNegatives):
    """In-batch negatives of this rank's batch only (no all_gather): each rank's loss sees b samples."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        z = F.normalize(self.net(x), dim=-1)
        return F.cross_entropy(z @ z.T / 0.5, torch.arange(len(z), device=z.device))


class ScaledLearningRate(Base):
    """The learning rate multiplied by the world size (the "linear scaling rule") at the same
    global batch size: DDP's gradient is one device's, its update is N times one device's."""

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2 * self.trainer.world_size)


class ScheduleFromLoader(Base):
    """A OneCycleLR whose length is counted from the loader and the epochs
    (`len(train_dataloader()) * trainer.max_epochs`): under DDP the loader is per-device, N times
    as many batches of B/N, so the schedule is N times as long. Needs `max_epochs` set."""

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        total = len(self.trainer.datamodule.train_dataloader()) * self.trainer.max_epochs
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class MovingAverage(Base):
    """Moving averages of the batch's hidden features kept in a buffer that `forward` writes in
    training mode (as a VQ-VAE codebook's exponential moving averages): the step uses the
    buffer as it was, and then writes the mean of this rank's share of the batch into it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("feature_mean", torch.zeros(16))

    def forward(self, x):
        h = self.net[1](self.net[0](x))  # (b, 16)
        out = self.net[2](h - self.feature_mean.clone()).squeeze(-1)
        if self.training:
            with torch.no_grad():
                self.feature_mean.mul_(0.9).add_(0.1 * h.mean(0))
        return out


class KeyQueue(Base):
    """A queue of keys kept in buffers, as MoCo's: each step's loss reads the queue (every sample's
    negatives, a per-sample mean), then writes the batch's keys into it at the pointer, in the order
    of the batch's rows (`queue`, `(size, 16)`; `ptr`, an integer buffer). Under DDP each rank
    enqueues its own b keys where one device enqueues all B: MoCo gathers every rank's keys first."""

    gather = False

    def __init__(self, size: int = 48) -> None:
        super().__init__()
        self.register_buffer("queue", F.normalize(torch.randn(size, 16), dim=1))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.net[1](self.net[0](x))  # (b, 16)
        q = F.normalize(h, dim=1)
        negatives = torch.logsumexp(q @ self.queue.clone().T / 0.5, dim=1)  # (b,)
        loss = F.mse_loss(self.net[2](h).squeeze(-1), y) + 0.1 * negatives.mean()
        with torch.no_grad():
            keys = q.detach()
            if self.gather:  # every rank's keys, in rank order: the global batch's rows (MoCo's concat_all_gather)
                keys = self.all_gather(keys).reshape(-1, keys.shape[-1])
            rows = (self.ptr + torch.arange(len(keys), device=keys.device)) % len(self.queue)
            self.queue[rows] = keys.to(self.queue.dtype)
            self.ptr.copy_((self.ptr + len(keys)) % len(self.queue))
        return loss


class GatheredKeyQueue(KeyQueue):
    """`KeyQueue` with every rank's keys gathered before they are enqueued (MoCo's own way): under
    DDP every rank writes one device's keys, in one device's order."""

    gather = True


class TargetNormaliser(Base):
    """A running normaliser of the targets (mean and variance, momentum 0.5) in buffers, updated
    from the batch's targets before the loss reads it: under DDP each rank normalises by its own
    share of the batch, so the gradient and the buffers are not one device's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("target_mean", torch.zeros(()))
        self.register_buffer("target_var", torch.ones(()))

    def training_step(self, batch, batch_idx):
        x, y = batch
        with torch.no_grad():
            self.target_mean.mul_(0.5).add_(0.5 * y.mean())
            self.target_var.mul_(0.5).add_(0.5 * y.var())
        return F.mse_loss(self(x), (y - self.target_mean) / self.target_var.sqrt())


class NoiseBatchNorm(LightningModule):
    """A generator-like module (the gallery's DCGAN in small): a noise vector `z: (b, 4)` drawn with
    `torch.randn` in a method the training step calls, through a generator with BatchNorm, a critic
    that scores the generated rows and the real ones (each loss a mean over the samples), under
    manual optimization as a GAN's. Under DDP every rank draws the same `z` rows (same seed), not its
    share of one device's, and BatchNorm's running statistics follow from those rows and the per-rank
    statistics: with the audit's fixes for both (draws keyed to the samples, global BatchNorm) they
    are one device's."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 8))
        self.critic = nn.Linear(8, 1)

    def draw_z(self, x):
        return torch.randn(len(x), 4, dtype=x.dtype, device=x.device)

    def loss(self, x, z):
        fake = self.generator(z)
        return ((self.critic(fake) - 1) ** 2).mean() + (self.critic(x) ** 2).mean()

    def training_step(self, batch, batch_idx):
        x, _ = batch
        opt = self.optimizers()
        loss = self.loss(x, self.draw_z(x))
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class RenormalisedEmbedding(LightningModule):
    """`nn.Embedding(max_norm=1.0)`: `forward` renormalises, in place, the rows it looks up (on
    each rank, the rows of that rank's share of the batch)."""

    def __init__(self, vocab: int = 40) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, 16, max_norm=1.0)
        self.out = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch  # x: (b, 8) float -> 8 tokens per sample
        tokens = (x.abs() * 10).long().clamp(max=self.vocab - 1)
        return F.mse_loss(self.out(self.emb(tokens).mean(1)).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


class LossOverWorldSize(Base):
    """The loss divided by the world size ("DDP sums the gradients"): DDP averages them, so its
    gradient is one device's over N."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y) / self.trainer.world_size


class Diverging(Base):
    """A loss that turns NaN at the second optimizer step (a diverging model)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        return loss * float("nan") if self.global_step >= 1 else loss


class HardExamples(Base):
    """Online hard example mining: the mean of the largest quarter of the batch's per-sample losses
    (a loss that couples the samples of its batch), logged with `sync_dist` read from the Trainer."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        per_sample = (self(x) - y) ** 2
        hard = per_sample.topk(max(1, len(per_sample) // 4)).values
        self.log("hard_loss", hard.mean(), sync_dist=self.trainer.world_size > 1, batch_size=len(x))
        return hard.mean()


class AttentionDropout(Base):
    """Self-attention over the 8 features as tokens, with dropout inside
    `scaled_dot_product_attention` (as Hugging Face's SDPA attention calls it in training)."""

    p = 0.2

    def __init__(self) -> None:
        super().__init__()
        del self.net
        self.qkv = nn.Linear(1, 12)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        q, k, v = self.qkv(x.unsqueeze(-1)).unsqueeze(1).chunk(3, dim=-1)  # (b, 1, 8, 4) each
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0)
        return self.head(a.mean(2).squeeze(1)).squeeze(-1)


class AttentionWithoutDropout(AttentionDropout):
    """The same attention with `dropout_p=0`: what the audit compares of `AttentionDropout`."""

    p = 0.0


class AttentionDropoutPerRank(AttentionDropout):
    """`AttentionDropout` whose ranks seed their generators differently (`setup`): each rank draws
    its own masks, independent as one device's rows are."""

    def setup(self, stage: str) -> None:
        torch.manual_seed(1000 + self.global_rank)


class OnlyCuda(Base):
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x.cuda()), y.cuda())


class NoTrainingStep(LightningModule):
    pass


class Empty(Regression):
    def setup(self, stage: str) -> None:
        self.train_set = TensorDataset(torch.zeros(0, 8), torch.zeros(0))
