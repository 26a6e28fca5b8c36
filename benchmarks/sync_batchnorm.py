"""Step time of DDP with the CPU sync BatchNorm against default DDP (a benchmark, not a test).

    python benchmarks/sync_batchnorm.py                       # ResNet-18 VAE, per-device 16 and 128
    python benchmarks/sync_batchnorm.py --per-device 16 --steps 10

Two gloo processes (one thread each) train one DDP VAE in two variants that share every
tensor: with ``nn.BatchNorm2d`` (Lightning's default DDP) and with its BatchNorm layers
swapped for [`GlobalBatchNorm`][vae_ddp.fixes.batchnorm.GlobalBatchNorm] (what
[`GlobalSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlobalSyncBatchNorm] does). Each step trains
both variants on the same batch, in alternating order, so that a load that varies over time (a shared machine)
falls on both alike; the ratio is taken per step (paired) and summarised by its median and
quartiles. Then, to say where the extra time goes, it times per step, on the shapes the
BatchNorm layers saw: (a) torch's BatchNorm forward+backward, (b) GlobalBatchNorm's, and (c) the
collectives alone (one ``all_gather`` forward and one ``all_reduce`` backward per layer).
Random images stand in for CIFAR-10: the step time does not depend on pixel values.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vae_ddp.fixes.batchnorm import GlobalBatchNorm
from vae_ddp.model import VAE
from vae_ddp.harness.table import format_table


class _Loss(nn.Module):
    """DDP wraps ``forward``: here one VAE training loss (``VAE.step``)."""

    def __init__(self, vae: VAE) -> None:
        super().__init__()
        self.vae = vae

    def forward(self, x):
        return self.vae.step(x)[0]


def _g(v: float) -> str:
    """3 significant digits, no exponent for the values of this table."""
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[2]


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls, ranks in step (barrier before each)."""
    out = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _bn_breakdown(shapes: list[tuple[int, ...]], repeats: int) -> dict:
    """Seconds per training step spent in the BatchNorm layers (inputs of ``shapes``):
    torch's BatchNorm, GlobalBatchNorm (statistics, normalisation, collectives), collectives alone."""
    xs = [torch.randn(s, requires_grad=True) for s in shapes]
    gs = [torch.randn(s) for s in shapes]
    plain = [nn.BatchNorm2d(s[1]) for s in shapes]
    ours = [GlobalBatchNorm(s[1]) for s in shapes]

    def run(layers):
        for layer, x, g in zip(layers, xs, gs):
            layer(x).backward(g)

    bufs = [(torch.zeros(2 * s[1] + 1, dtype=torch.float64), torch.zeros(2 * s[1])) for s in shapes]
    world = dist.get_world_size()

    def collectives():
        for gather_buf, reduce_buf in bufs:
            dist.all_gather([torch.empty_like(gather_buf) for _ in range(world)], gather_buf)
            dist.all_reduce(reduce_buf)

    return {"torch BatchNorm": _time(lambda: run(plain), repeats),
            "GlobalBatchNorm": _time(lambda: run(ours), repeats),
            "collectives alone": _time(collectives, repeats)}


def _worker(rank: int, world: int, port: int, per_device: int, args, queue) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    vae = VAE(enc_type=args.model)
    model = DDP(_Loss(vae))  # one set of parameters, gradients, Adam state and buckets for both variants
    optim = torch.optim.Adam(model.parameters(), lr=1e-4)
    shapes: list[tuple[int, ...]] = []
    times: dict[str, list[float]] = {"default": [], "sync BatchNorm": []}
    g = torch.Generator().manual_seed(rank)
    for step in range(args.warmup + args.steps):
        x = torch.rand(per_device, 3, 32, 32, generator=g)
        order = list(times) if step % 2 == 0 else list(reversed(times))
        for name in order:
            # The variant is switched in place: GlobalBatchNorm.convert/revert swap the BatchNorm
            # modules, sharing their parameters and buffers, so DDP and Adam see the same tensors.
            GlobalBatchNorm.convert(vae) if name == "sync BatchNorm" else GlobalBatchNorm.revert(vae)
            hooks = [m.register_forward_hook(lambda mod, inp, out: shapes.append(tuple(inp[0].shape)))
                     for m in vae.modules() if isinstance(m, GlobalBatchNorm) and not shapes]
            dist.barrier()
            t0 = time.perf_counter()
            optim.zero_grad(set_to_none=True)
            model(x).backward()
            optim.step()
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            for h in hooks:
                h.remove()
    breakdown = _bn_breakdown(shapes, args.repeats)
    results = {str(per_device): {"times": times, "breakdown": breakdown, "layers": len(shapes)}}
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="resnet18", choices=["resnet18", "small"])
    p.add_argument("--per-device", type=int, nargs="+", default=[16, 128],
                   help="per-device batch sizes (global = 2 x this); "
                        "default: global 32 and the report's 128 per device")
    p.add_argument("--steps", type=int, default=6, help="measured steps per size (each trains both models)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="repeats of the per-layer breakdown")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    results = {}
    for per_device in args.per_device:  # one launch per size, so a size's result is out before the next
        queue = ctx.SimpleQueue()
        mp.start_processes(_worker, args=(2, _free_port(), per_device, args, queue), nprocs=2, join=True,
                           start_method="spawn")
        results.update(queue.get())
        print(f"per-device batch {per_device}: done", flush=True)
    rows, parts = [], []
    for per_device, r in results.items():
        base, sync = r["times"]["default"], r["times"]["sync BatchNorm"]
        ratios = [s / b for s, b in zip(sync, base)]
        q1, med, q3 = _quartiles(ratios)
        r["ratio"] = {"q1": q1, "median": med, "q3": q3, "min": min(ratios), "max": max(ratios)}
        rows.append([int(per_device) * 2, int(per_device), _g(statistics.median(base) * 1e3),
                     _g(statistics.median(sync) * 1e3), _g(med), f"{q1:.3g} to {q3:.3g}",
                     f"{min(ratios):.3g} to {max(ratios):.3g}"])
        b = r["breakdown"]
        extra = b["GlobalBatchNorm"] - b["torch BatchNorm"]
        parts.append([int(per_device), r["layers"], _g(b["torch BatchNorm"] * 1e3), _g(b["GlobalBatchNorm"] * 1e3),
                      _g(b["collectives alone"] * 1e3), _g((extra - b["collectives alone"]) * 1e3),
                      _g((statistics.median(sync) - statistics.median(base)) * 1e3)])
    n = len(next(iter(results.values()))["times"]["default"])
    print(format_table(["global batch", "per-device batch", "default DDP (ms)", "sync BatchNorm (ms)",
                        "ratio (median)", "ratio quartiles", "ratio range"], rows,
                       title=f"{args.model} VAE, 2 gloo processes x 1 thread, {n} paired steps per size"))
    print()
    print(format_table(["per-device batch", "BatchNorm layers", "torch BatchNorm (ms)", "GlobalBatchNorm (ms)",
                        "collectives alone (ms)", "other extra (ms)", "step difference (ms)"], parts,
                       title="Where the time goes: forward+backward of all BatchNorm layers per step (medians)"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sync_batchnorm.json").write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
