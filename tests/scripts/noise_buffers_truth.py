"""Ground truth for the audit's buffers row beside draws no fix serves, measured with plain torch.distributed
(no vae_ddp): ``examples/audit_models.py:NoiseBatchNorm``, a generator whose noise ``z`` is drawn with
``torch.randn`` in its step, through BatchNorm.

Usage: python tests/scripts/noise_buffers_truth.py OUT_JSON

From ``torch.manual_seed(0)`` (the module's weights), float64, a global batch of 16 rows: one training
forward of the generator, once on one device (``z`` drawn for the 16 rows after ``torch.manual_seed(1)``),
once with the 16 rows permuted (the floor: rounding), and on 2 gloo ranks, each its 8 rows, four ways:
``z`` drawn per rank as the module draws it (every rank the same generator state, so the same 8 rows) or
the global batch's ``z`` and this rank's rows (what ``global_batch_draw`` does), each with BatchNorm over
the rank's rows (Lightning's default) or over the global batch (the inputs of every rank gathered, as
SyncBatchNorm normalises). Rank 0 writes ``{way: the largest absolute difference of rank 0's BatchNorm
running statistics from one device's, over the largest value}`` with ``"floor"`` (the permuted run's).
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.audit_models import NoiseBatchNorm  # noqa: E402

B, N = 16, 2


class GlobalBN(nn.Module):
    """The wrapped BatchNorm on every rank's rows at once; this rank's rows out."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.bn = bn

    def forward(self, x):
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.detach())
        parts[dist.get_rank()] = x
        return self.bn(torch.cat(parts))[dist.get_rank() * len(x):(dist.get_rank() + 1) * len(x)]


def model() -> NoiseBatchNorm:
    torch.manual_seed(0)
    return NoiseBatchNorm().double().train()


def buffers(m: NoiseBatchNorm) -> torch.Tensor:
    bn = m.generator[1]
    bn = getattr(bn, "bn", bn)
    return torch.cat([bn.running_mean, bn.running_var])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def one_device(permute: bool) -> torch.Tensor:
    m = model()
    torch.manual_seed(1)
    z = m.draw_z(torch.zeros(B, 8, dtype=torch.float64))
    if permute:
        z = z[torch.randperm(B, generator=torch.Generator().manual_seed(2))]
    with torch.no_grad():
        m.generator(z)
    return buffers(m)


def rank(r: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=N)
    reference = one_device(False)
    result = {"floor": relative(one_device(True), reference)}
    for draw in ("per_rank_z", "global_z"):
        for norm in ("rank_batchnorm", "global_batchnorm"):
            m = model()
            if norm == "global_batchnorm":
                m.generator[1] = GlobalBN(m.generator[1])
            torch.manual_seed(1)
            if draw == "per_rank_z":  # as the module draws: its share's length, every rank the same state
                z = m.draw_z(torch.zeros(B // N, 8, dtype=torch.float64))
            else:  # the global batch's draw, this rank's rows
                z = m.draw_z(torch.zeros(B, 8, dtype=torch.float64))[r * B // N:(r + 1) * B // N]
            with torch.no_grad():
                m.generator(z)
            result[f"{draw}, {norm}"] = relative(buffers(m), reference)
    if r == 0:
        Path(out).write_text(json.dumps(result, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(rank, args=(free, sys.argv[1]), nprocs=N)
