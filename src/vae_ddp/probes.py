"""Measurement callbacks: what each rank drew and what the optimizer received.

They observe a run without changing it, so the factor examples can show a mechanism on a
real Lightning DDP run (gloo on CPU) and compare it with a one-process reference.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["NoiseProbe", "GradientProbe", "StepProbe", "relative_difference", "per_step_differences", "count_sketch"]


class NoiseProbe(Callback):
    """Record the reparameterization noise ``eps`` each rank draws in each training step.

    Put it after any callback that replaces ``pl_module.noise`` (e.g.
    [`GlobalBatchNoise`][vae_ddp.fixes.noise.GlobalBatchNoise]): it wraps whatever is there at
    ``on_train_batch_start``. At the end of training the draws are gathered from all ranks.

    Attributes:
        gathered: ``(world_size, steps, b, latent_dim)`` tensor on every rank after
            ``fit`` (``trainer.strategy.all_gather``), where ``b`` is the per-device batch.
    """

    def __init__(self) -> None:
        self._draws: list[Tensor] = []
        self.gathered: Optional[Tensor] = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        inner = pl_module.noise

        def recording(mu: Tensor) -> Tensor:
            eps = inner(mu)
            self._draws.append(eps.detach().clone())
            return eps

        pl_module.noise = recording
        self._inner = inner

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.noise = self._inner

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        local = torch.stack(self._draws)
        g = trainer.strategy.all_gather(local)
        self.gathered = g if trainer.world_size > 1 else g.unsqueeze(0)


class GradientProbe(Callback):
    """Keep the gradients the optimizer receives at optimizer step ``step`` (0-based).

    Under ``strategy="ddp"`` the gradients have been all-reduced (averaged over ranks) by
    DistributedDataParallel during ``backward``, so ``on_before_optimizer_step`` sees what
    every rank's Adam sees. Also keeps the parameters before that step.

    Attributes:
        grads: ``{name: Tensor}`` (detached copies) after ``fit``; None if the run was shorter.
        params: ``{name: Tensor}`` before the step.
    """

    def __init__(self, step: int = 0) -> None:
        self.step = step
        self.grads: Optional[dict[str, Tensor]] = None
        self.params: Optional[dict[str, Tensor]] = None

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        if trainer.global_step == self.step:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            self.params = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


class StepProbe(Callback):
    """Every optimizer step's gradient, optionally from weights forced to another run's.

    Recording (``states=None``): at the start of step ``k`` keep the module's state (parameters
    and buffers, the weights θ_k), and before the optimizer steps keep the gradient it receives
    (all-reduced over ranks under ``strategy="ddp"``) and the BatchNorm buffers the step's
    forward left. Teacher forcing (``states`` = the ``states`` another run recorded): at the
    start of step ``k`` load θ_k into the module first, on every rank alike, so the step starts
    from the reference run's weights and its gradient differs from the reference's only by
    what this run computes differently (grouping over ranks, order of the samples), never by
    differences carried over from earlier steps. The optimizer still steps, but its result is
    replaced at the next step. With ``lag`` L, batch ``k >= L`` starts from θ_(k-L) instead
    (batches ``k < L`` from θ_k): another batch at the same weights, the batch-to-batch
    gradient noise one device has at the reference's weights. With ``repeat`` R, batch ``k``
    starts from θ_(k // R) instead: R batches at each of the reference's weights in turn, the
    samples of one device's (or DDP's) step at the same weights
    ([`vae_ddp.audit.effects`][vae_ddp.audit.effects]).

    ``k`` counts training batches; the gradients are kept at every optimizer step: one per
    batch under automatic optimization, one per ``accumulate_grad_batches`` batches with
    accumulation, two per batch for a manual-optimization module that steps two optimizers (a
    GAN), in both runs alike.

    Args:
        states: the reference's ``{name: Tensor}`` per step, or None to record them.
        record_states: keep θ_k of each step (the reference run).
        lag: forced runs only: batches later than the weights they start from (0: the same batch).
        repeat: forced runs only: batches per recorded weights (0: one, batch k from θ_k or θ_(k-lag)).
        sketch: 0, or keep each vector longer than this (gradients, buffers, updates) as its
            [`count_sketch`][vae_ddp.probes.count_sketch] of ``sketch`` elements: what many steps of
            a large model can hold in memory (the norms and the ranks' distance stay exact).
        label: the run's name, for the error of a gradient that is not finite.
        ranks_grads: world size > 1: also measure, at every optimizer step, how far the ranks'
            gradients are apart and their mean (``grads_apart``, ``grads_mean``): all-reduced
            gradients are the same bits on every rank; one extra all-reduce of the gradient per step.

    Attributes:
        grads: per step, the gradient as one float64 vector ``(P,)`` (parameters in
            ``named_parameters`` order, those without a gradient left out).
        buffers: per step, the floating-point buffers as one float64 vector (empty without BatchNorm).
        states: the θ_k loaded or recorded, per step.
        loaded: forced runs: per batch, the index k of the θ_k it started from.
        epochs: per training batch, the epoch it belongs to (``trainer.current_epoch``).
        grad_batches: per kept gradient, the training batch (0, 1, ...) it was computed on.
        lrs: per kept gradient, the learning rate of each of the optimizer's parameter groups
            (what that step applies, after the LR schedulers' updates).
        updates: per training batch, what the batch changed in the parameters: their values at
            the end of the batch minus those it started from (θ_k, loaded or recorded), one
            float64 vector ``(P,)`` over every parameter in ``named_parameters`` order; zero for
            a batch that only accumulates.
        buffer_updates: per training batch, what the batch changed in the floating-point buffers
            (at its end minus at its start), as one float64 vector: what the batch's forward wrote
            into them, e.g. BatchNorm's running statistics or a codebook's moving averages.
        norms: per training batch, ``[||θ||, ||buffers||]`` at its end (float64): the size of one
            rounding of every stored value, the least a difference of the update can be told by.
        ranks_apart: world size > 1: per training batch, ``max_r ||θ^r - θ^0||`` over the
            ranks' parameters at its end (float64; 0.0 when every rank holds the same bits);
            ``ranks_apart_names``: the parameters that differ most across ranks then
            (``[[name, max_abs_diff, owner class], ...]``, at most 3, empty when none differ).
        buffers_apart: world size > 1: per training batch, every buffer (floating-point and
            integer) that differs across the ranks at its end (before DDP's next broadcast of rank
            0's buffers), as ``[[name, max_abs_diff, max_abs_value], ...]`` (float64; empty when every
            rank holds the same values).
        int_buffers: per training batch, the integer and boolean buffers at its end (a queue's
            pointer, a counter) as one int64 vector, in ``int_buffer_names`` order: compared exactly.
        grad_index: per kept gradient, the indices (into ``param_names``) of the parameters whose
            gradients it holds, in its order; ``opt_index``: per kept gradient, those of the
            optimizer that steps on it (a GAN's two optimizers step on their own parameters).
        grads_apart: with ``ranks_grads``, per kept gradient ``max_r ||g^r - g^0|| / ||g^0||`` over
            the ranks' gradients (float; None where the ranks hold gradients of other lengths);
            ``grads_mean``: per kept gradient the ranks' mean gradient ``(P,)`` (float64, or None).
        param_names, buffer_names: the names and element counts (``[[name, numel], ...]``) of
            the entries of ``updates`` and ``buffer_updates``, in their order.

    Raises:
        RuntimeError: a forced run that has more steps than the reference recorded; a gradient
            that is not finite (NaN or infinite), naming the rank and the step.
    """

    def __init__(self, states: Optional[list[dict[str, Tensor]]] = None, record_states: bool = False,
                 lag: int = 0, label: str = "", repeat: int = 0, sketch: int = 0, ranks_grads: bool = False) -> None:
        self.forced = states is not None
        self.ranks_grads = ranks_grads
        self.grad_index: list[list[int]] = []
        self.opt_index: list[list[int]] = []
        self.grads_apart: list[Optional[float]] = []
        self.grads_mean: list[Optional[Tensor]] = []
        self.label = label
        self.lag = lag
        self.repeat = repeat
        self.sketch = sketch
        self.states: list[dict[str, Tensor]] = list(states) if states is not None else []
        self.record_states = record_states and not self.forced
        self.grads: list[Tensor] = []
        self.buffers: list[Tensor] = []
        self.loaded: list[int] = []
        self.epochs: list[int] = []
        self.grad_batches: list[int] = []
        self.lrs: list[list[float]] = []
        self.updates: list[Tensor] = []
        self.buffer_updates: list[Tensor] = []
        self.norms: list[list[float]] = []
        self.ranks_apart: list[float] = []
        self.ranks_apart_names: list[list] = []
        self.param_names: list[list] = []
        self.buffer_names: list[list] = []
        self.buffers_apart: list[list] = []
        self.int_buffers: list[Tensor] = []
        self.int_buffer_names: list[list] = []
        self._batch = 0
        self._start: Optional[Tensor] = None
        self._start_buffers: Optional[Tensor] = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._batch = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        # counted per training batch, not by `global_step`: with manual optimization and two
        # optimizers, Lightning counts two steps per batch
        k = self._batch
        self._batch += 1
        self.epochs.append(trainer.current_epoch)
        if self.forced:
            point = k // self.repeat if self.repeat else k
            if point >= len(self.states):
                raise RuntimeError(f"StepProbe: batch {k} is past the {len(self.states)} batches of the reference")
            own = pl_module.state_dict()
            self.loaded.append(point if self.repeat else k - self.lag if k >= self.lag else k)
            with torch.no_grad():
                for name, value in self.states[self.loaded[-1]].items():
                    if name in own:
                        own[name].copy_(value.to(own[name].device, own[name].dtype))
        elif self.record_states:
            self.states.append({n: t.detach().cpu().clone() for n, t in pl_module.state_dict().items()})
        self._start = _flat(p for _, p in pl_module.named_parameters())
        self._start_buffers = _flat(b for _, b in pl_module.named_buffers() if b.is_floating_point())

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        params = [p for _, p in pl_module.named_parameters()]
        grads = [p.grad.detach().reshape(-1).double().cpu() for p in params if p.grad is not None]
        self.grads.append(torch.cat(grads) if grads else torch.zeros(0, dtype=torch.float64))
        self.grad_index.append([i for i, p in enumerate(params) if p.grad is not None])
        own = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.opt_index.append([i for i, p in enumerate(params) if id(p) in own])
        if self.ranks_grads and trainer.world_size > 1:
            apart, mean = _ranks_grads(self.grads[-1], trainer)
            self.grads_apart.append(apart)
            self.grads_mean.append(mean)
        if not bool(torch.isfinite(self.grads[-1]).all()):
            run = f"run '{self.label}': " if self.label else ""
            raise RuntimeError(f"{run}the gradient is not finite (NaN or infinite) at training batch {self._batch - 1} "
                               f"on rank {trainer.global_rank}: the loss or the model diverges; lower the learning "
                               "rate or fix the loss before comparing DDP with one device")
        self.grads[-1] = count_sketch(self.grads[-1], self.sketch)
        self.grad_batches.append(self._batch - 1)
        self.lrs.append([float(g["lr"]) for g in optimizer.param_groups])
        bufs = [b.detach().reshape(-1).double().cpu() for _, b in pl_module.named_buffers() if b.is_floating_point()]
        self.buffers.append(count_sketch(torch.cat(bufs) if bufs else torch.zeros(0, dtype=torch.float64), self.sketch))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # after the optimizer step and the LR schedulers' "step" updates (_TrainingEpochLoop.advance, Lightning 2.x)
        params = list(pl_module.named_parameters())
        buffers = [(n, b) for n, b in pl_module.named_buffers() if b.is_floating_point()]
        ints = [(n, b) for n, b in pl_module.named_buffers() if not b.is_floating_point()]
        if not self.param_names:
            self.param_names = [[n, p.numel()] for n, p in params]
            self.buffer_names = [[n, b.numel()] for n, b in buffers]
            self.int_buffer_names = [[n, b.numel()] for n, b in ints]
        self.int_buffers.append(torch.cat([b.detach().reshape(-1).long().cpu() for _, b in ints]) if ints
                                else torch.zeros(0, dtype=torch.long))
        now, after = _flat(p for _, p in params), _flat(b for _, b in buffers)
        self.updates.append(count_sketch(now - self._start, self.sketch))
        self.buffer_updates.append(count_sketch(after - self._start_buffers, self.sketch))
        self.norms.append([float(now.norm()), float(after.norm())])
        if trainer.world_size > 1:
            distance, names = _ranks_apart(now, self.param_names, trainer, pl_module)
            self.ranks_apart.append(distance)
            self.ranks_apart_names.append(names)
            self.buffers_apart.append(_buffers_apart(pl_module, trainer))

    def record(self) -> dict:
        """What the audit compares, as one picklable dict (``torch.save``)."""
        return {k: getattr(self, k) for k in ("grads", "buffers", "grad_batches", "epochs", "lrs", "updates",
                                              "buffer_updates", "norms", "ranks_apart", "ranks_apart_names",
                                              "param_names", "buffer_names", "buffers_apart", "int_buffers",
                                              "int_buffer_names", "grad_index", "opt_index", "grads_apart",
                                              "grads_mean")}


_SKETCHES: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}


def count_sketch(v: Tensor, k: int, seed: int = 0) -> Tensor:
    """A CountSketch (Charikar, Chen and Farach-Colton 2002) of the float64 vector ``v`` ``(P,)`` in
    ``k`` elements: element ``i`` added, with a random sign, to one of ``k`` buckets, both drawn from
    a generator seeded with ``seed`` and ``P`` (the same buckets in every process for a vector of
    that length). Linear, and inner products, norms and traces are kept in expectation. ``v`` itself
    when ``k`` is 0 or ``P <= k``."""
    n = v.numel()
    if not k or n <= k:
        return v
    if (n, k) not in _SKETCHES:
        g = torch.Generator().manual_seed(seed * 1_000_003 + n)
        _SKETCHES[(n, k)] = (torch.randint(0, k, (n,), generator=g),
                             torch.randint(0, 2, (n,), generator=g).double() * 2 - 1)
    bucket, sign = _SKETCHES[(n, k)]
    return torch.zeros(k, dtype=torch.float64).index_add_(0, bucket, v.double().cpu() * sign)


def _flat(tensors) -> Tensor:
    """The tensors as one float64 vector on the CPU (empty when there are none)."""
    parts = [t.detach().reshape(-1).double().cpu() for t in tensors]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _ranks_apart(flat: Tensor, names: list[list], trainer: Trainer,
                 module: torch.nn.Module) -> tuple[float, list[list]]:
    """``max_r ||flat^r - flat^0||`` over the ranks and the (at most 3) parameters that differ most:
    rank 0's vector is broadcast, each rank measures its own distance, and the per-parameter largest
    absolute differences are all-reduced with MAX (``torch.distributed``, the run's process group).
    Each name comes as ``[name, max_abs_diff, owner]``, the owner being the module's class."""
    import torch.distributed as dist

    device = trainer.strategy.root_device
    ref = flat.to(device).clone()
    dist.broadcast(ref, 0)
    diff = (flat.to(device) - ref).abs()
    sizes = [int(n) for _, n in names]
    per_param = torch.stack([d.max() if d.numel() else d.new_zeros(()) for d in diff.split(sizes)])
    total = torch.stack([diff.norm(), *per_param])
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    total = total.cpu()
    order = [int(i) for i in torch.argsort(total[1:], descending=True)[:3] if total[1 + int(i)] > 0]
    return float(total[0]), [[names[i][0], float(total[1 + i]), _owner(module, names[i][0])] for i in order]


def _ranks_grads(grad: Tensor, trainer: Trainer) -> tuple[Optional[float], Optional[Tensor]]:
    """``(max_r ||g^r - g^0|| / ||g^0||, the ranks' mean gradient)`` of this rank's gradient ``grad``
    ``(P,)`` (rank 0's broadcast, the distance all-reduced with MAX, the mean by an all-reduce SUM over
    the run's process group); ``(None, None)`` when the ranks' gradients have other lengths."""
    import torch.distributed as dist

    device = trainer.strategy.root_device
    size = torch.tensor([grad.numel(), -grad.numel()], dtype=torch.float64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX)
    if int(size[0]) != -int(size[1]):  # the ranks' gradients have other lengths
        return None, None
    mine = grad.to(device)
    ref = mine.clone()
    dist.broadcast(ref, 0)
    distance = (mine - ref).norm().reshape(1)
    dist.all_reduce(distance, op=dist.ReduceOp.MAX)
    total = mine.clone()
    dist.all_reduce(total)
    norm = float(ref.norm())
    apart = float(distance) / norm if norm else (0.0 if float(distance) == 0 else float("inf"))
    return apart, (total / trainer.world_size).cpu()


def _buffers_apart(module: torch.nn.Module, trainer: Trainer) -> list[list]:
    """Every buffer whose values differ across the ranks: ``[[name, max_abs_diff, max_abs_value], ...]``
    (rank 0's buffers broadcast, the per-buffer largest absolute differences and values all-reduced
    with MAX over the run's process group; integer buffers as float64, exact below 2**53)."""
    import torch.distributed as dist

    named = list(module.named_buffers())
    if not named:
        return []
    device = trainer.strategy.root_device
    sizes = [b.numel() for _, b in named]
    flat = torch.cat([b.detach().reshape(-1).double() for _, b in named]).to(device)
    ref = flat.clone()
    dist.broadcast(ref, 0)
    diff, size = (flat - ref).abs(), flat.abs()
    parts = [torch.stack([d.max(), v.max()]) if d.numel() else flat.new_zeros(2)
             for d, v in zip(diff.split(sizes), size.split(sizes))]
    total = torch.stack(parts)  # (buffers, 2)
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    return [[name, float(d), float(v)] for (name, _), (d, v) in zip(named, total.cpu().tolist()) if d > 0]


def _owner(module: torch.nn.Module, name: str) -> str:
    """The module that holds parameter ``name``, as its class (and ``max_norm`` where it renormalises
    the rows it looks up in place in ``forward``, as ``nn.Embedding(max_norm=...)`` does)."""
    owner = module.get_submodule(name.rpartition(".")[0])
    max_norm = getattr(owner, "max_norm", None)
    return type(owner).__name__ + (f"(max_norm={max_norm})" if max_norm is not None else "")


def relative_difference(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64 (0.0 when both are zero; ``inf`` when only ``b`` is)."""
    a, b = a.double(), b.double()
    nb = float(b.norm())
    d = float((a - b).norm())
    if nb == 0:
        return 0.0 if d == 0 else float("inf")
    return d / nb


def per_step_differences(steps: list[Tensor], reference: list[Tensor]) -> list[float]:
    """[`relative_difference`][vae_ddp.probes.relative_difference] of each step's tensor
    (``StepProbe.grads`` or ``.buffers``: one flat float64 tensor per optimizer step) against
    the same step of ``reference`` (0.0 for a step with an empty reference, e.g. no buffers).

    Raises:
        ValueError: the two records hold different numbers of steps.
    """
    if len(steps) != len(reference):
        raise ValueError(f"{len(steps)} steps compared with a reference of {len(reference)}")
    return [relative_difference(a, b) if b.numel() else 0.0 for a, b in zip(steps, reference)]
