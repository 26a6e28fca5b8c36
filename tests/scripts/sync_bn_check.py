"""GlobalBatchNorm on N gloo ranks against torch's BatchNorm on the concatenated batch, float64.

Run as ``python sync_bn_check.py RANK WORLD PORT``, one process per rank. For each variant
(BatchNorm1d/2d/3d, channels-last, affine=False, track_running_stats=False, momentum=None,
uneven per-rank batches, inputs whose mean is 1e4 times their spread) it takes three
training steps and compares, at every step: the output, the input gradient, the weight and
bias gradients (summed over ranks: the objective is the sum of the per-rank objectives) and
the running statistics. Rank 0 prints one JSON object: variant -> largest absolute difference
over ranks and steps, relative to the largest reference value; and the same for variance
from sums of x and x**2 (the one-all-reduce alternative) on the 1e4-mean input.
"""

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from vae_ddp.fixes.batchnorm import GlobalBatchNorm

VARIANTS = {
    # name: (reference class, input shape (global batch first), kwargs, options)
    "1d (B, C)": (nn.BatchNorm1d, (8, 5), {}, {}),
    "1d (B, C, L)": (nn.BatchNorm1d, (8, 5, 7), {}, {}),
    "2d": (nn.BatchNorm2d, (8, 4, 5, 5), {}, {}),
    "2d channels-last": (nn.BatchNorm2d, (8, 4, 5, 5), {}, {"channels_last": True}),
    "3d": (nn.BatchNorm3d, (8, 3, 4, 3, 3), {}, {}),
    "affine=False": (nn.BatchNorm2d, (8, 4, 5, 5), {"affine": False}, {}),
    "track_running_stats=False": (nn.BatchNorm2d, (8, 4, 5, 5), {"track_running_stats": False}, {}),
    "momentum=None": (nn.BatchNorm2d, (8, 4, 5, 5), {"momentum": None}, {}),
    "uneven per-rank batches": (nn.BatchNorm2d, (8, 4, 5, 5), {}, {"uneven": True}),
    "mean 1e4, std 1": (nn.BatchNorm2d, (8, 4, 5, 5), {}, {"offset": 1e4}),
}


def split(n: int, world: int, uneven: bool) -> list[int]:
    """Per-rank batch sizes: equal, or the first rank gets one sample fewer."""
    sizes = [n // world] * world
    if uneven:
        sizes[0] -= 1
        sizes[-1] += 1
    return sizes


def run_variant(rank: int, world: int, cls, shape, kwargs, opts) -> float:
    torch.manual_seed(0)
    ref = cls(shape[1], **kwargs).double()
    ours = GlobalBatchNorm(shape[1], **kwargs).double()
    if ref.affine:  # non-trivial affine parameters, the same in both
        with torch.no_grad():
            ref.weight.normal_(), ref.bias.normal_()
        ours.load_state_dict(ref.state_dict())
    sizes = split(shape[0], world, opts.get("uneven", False))
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    worst = 0.0
    for _ in range(3):
        x = torch.randn(shape, dtype=torch.float64) + opts.get("offset", 0.0)
        w = torch.randn(shape, dtype=torch.float64)
        if opts.get("channels_last"):
            x = x.contiguous(memory_format=torch.channels_last)
        xr = x.clone().requires_grad_()
        y_ref = ref(xr)
        (y_ref * w).sum().backward()
        xs = x[lo:hi].clone().requires_grad_()
        y = ours(xs)
        (y * w[lo:hi]).sum().backward()
        if opts.get("channels_last"):
            assert y.is_contiguous(memory_format=torch.channels_last), "output lost the channels-last layout"
        pairs = [(y, y_ref[lo:hi]), (xs.grad, xr.grad[lo:hi])]
        if ref.affine:
            gw, gb = ours.weight.grad.clone(), ours.bias.grad.clone()
            dist.all_reduce(gw), dist.all_reduce(gb)
            pairs += [(gw, ref.weight.grad), (gb, ref.bias.grad)]
            ours.weight.grad = ours.bias.grad = ref.weight.grad = ref.bias.grad = None
        if ref.track_running_stats:
            pairs += [(ours.running_mean, ref.running_mean), (ours.running_var, ref.running_var)]
            assert int(ours.num_batches_tracked) == int(ref.num_batches_tracked)
        for a, b in pairs:
            worst = max(worst, float(((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).detach()))
    return worst


def sum_of_squares_error(offset: float) -> float:
    """Relative error of the global variance from sums of x and x**2 (what one all-reduce of
    the concatenated sums would give) against the two-pass variance, float64."""
    torch.manual_seed(0)
    x = torch.randn(8, 4, 5, 5, dtype=torch.float64) + offset
    n = x.numel() / x.shape[1]
    dims = (0, 2, 3)
    naive = (x * x).sum(dims) / n - (x.sum(dims) / n) ** 2
    exact = x.var(dims, unbiased=False)
    return float(((naive - exact).abs() / exact).max())


def main() -> None:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    result = {}
    for name, (cls, shape, kwargs, opts) in VARIANTS.items():
        worst = torch.tensor([run_variant(rank, world, cls, shape, kwargs, opts)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        result[name] = float(worst)
    result["sum/sum-of-squares variance, mean 1e4"] = sum_of_squares_error(1e4)
    if rank == 0:
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
