"""torch's autograd all_gather over gloo: a gradient that is not contiguous comes back wrong.

    python examples/gloo_all_gather.py [--out DIR]

Two gloo ranks gather their rows `x_r: (2, 3, 4)` with `torch.distributed.nn.functional.all_gather`
(what Lightning's `self.all_gather(x, sync_grads=True)` calls, stacked as Lightning stacks it) and
backpropagate `(r + 1) * sum(G * W)` of the gathered `G: (4, 3, 4)`, read as it is or through a
transpose, `G.transpose(0, 1).flatten(0, 1)` (with `W` alike: the same loss; SimCLR's views laid
out view by view, for one). The exact gradient of
rank r's rows is `(1 + 2) * W[rows of r]` either way; the script prints the largest error of each,
relative to the exact gradient's largest entry, and writes `gloo_all_gather.json` into DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_gather

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from vae_ddp.ranks import run_ranks  # noqa: E402

WORLD = 2


def rank_errors(rank: int) -> dict:
    """This rank's largest gradient error relative to the exact gradient's largest entry, the
    gathered tensor read as it is and through a transpose."""
    torch.manual_seed(0)
    x = torch.randn(WORLD * 2, 3, 4, dtype=torch.float64)
    w = torch.randn(WORLD * 2, 3, 4, dtype=torch.float64)
    errors = {}
    for layout in ("contiguous", "transposed"):
        mine = x[rank * 2:(rank + 1) * 2].clone().requires_grad_()
        gathered = torch.stack(all_gather(mine)).flatten(0, 1)  # (4, 3, 4), as Lightning stacks it
        if layout == "transposed":
            loss = (gathered.transpose(0, 1).flatten(0, 1) * w.transpose(0, 1).flatten(0, 1)).sum() * (rank + 1)
        else:
            loss = (gathered * w).sum() * (rank + 1)
        loss.backward()
        exact = sum(r + 1 for r in range(WORLD)) * w[rank * 2:(rank + 1) * 2]
        errors[layout] = float((mine.grad - exact).abs().max() / exact.abs().max())
    return errors


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        def each_rank():
            dist.init_process_group("gloo", rank=int(os.environ.get("LOCAL_RANK", "0")), world_size=WORLD)
            rank = dist.get_rank()
            Path(tmp, f"{rank}.json").write_text(json.dumps(rank_errors(rank)))
            dist.barrier()
            dist.destroy_process_group()

        run_ranks(WORLD, each_rank)
        per_rank = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(WORLD)]
    result = {"torch": torch.__version__.split("+")[0], "backend": "gloo", "world_size": WORLD,
              **{layout: max(e[layout] for e in per_rank) for layout in ("contiguous", "transposed")}}
    print(f"| the gradient reaching all_gather | largest error of the rows' gradient, relative (torch "
          f"{result['torch']}, gloo, {WORLD} ranks) |\n|---|---:|\n"
          f"| contiguous (G read as it is) | {result['contiguous']:.3g} |\n"
          f"| not contiguous (G read through a transpose, flattened) | {result['transposed']:.3g} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gloo_all_gather.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
