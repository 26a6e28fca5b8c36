"""Factor check: per-rank random streams and the distributed sampler, measured under DDP.

Runs a real ``Trainer(accelerator="cpu", devices=2, strategy="ddp")`` fit (2 gloo
processes) for a few steps and records, on each rank:

- the reparameterization noise ``eps: (b, latent_dim)`` drawn by ``q.rsample()`` at each
  training step (replayed exactly from the global generator's state, and checked:
  ``mu + eps * std == z`` bit for bit);
- the sampler that Lightning put into the training ``DataLoader`` (class, wrapped
  sampler, ``seed``, ``shuffle``, ``num_replicas``, ``rank``) and the epoch-0 dataset
  indices it deals to this rank (recomputed without touching the global generator, then
  checked against the images of the batches actually trained on).

Configurations (``--configs``):

- ``seed42``: ``seed_everything(42)`` then fit (an explicit seed).
- ``noseed``: ``seed_everything()`` with no seed, as bolts' ``cli_main`` does (the file the report ran).
- ``per_rank_seed``: ``seed_everything(42)`` plus :class:`vae_ddp.fixes.noise.PerRankSeed`
  (reseeds each rank's generators with ``42 + rank`` in ``Callback.setup``).

Works in both environments: in ``.venv-legacy`` (Lightning 1.9.x) the model is the
report's: lightning-bolts 0.7.0's ``VAE`` with the report-era loss (``vae.py`` beside this
file) and the data bolts' ``CIFAR10DataModule`` over the ImageFolder tree; in ``.venv``
(Lightning 2.x, no bolts) it is the port ``vae_ddp.model.VAE`` and
``vae_ddp.data.ImageFolderDataModule``, with the same split rules.

Usage::

    .venv-legacy/bin/python examples/legacy/factor_check.py --out docs/generated/legacy/pl1
    .venv/bin/python examples/legacy/factor_check.py --out docs/generated/legacy/pl2

writes ``DIR/factor_check.json`` (one object; see :func:`summarize`). Bad input: one line
on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = ("seed42", "noseed", "per_rank_seed")
DEFAULT_DATA = str(HERE.parent.parent.parent / "shared" / "data" / "cifar10-jpg-subset")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _fail(msg: str) -> None:
    print(f"factor_check.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


# --------------------------------------------------------------------------- worker (each rank)
def _build(data_dir: str, batch_size: int):
    """``(model, datamodule, model_name)`` for this environment's Lightning major version."""
    import pytorch_lightning as pl

    if int(pl.__version__.split(".")[0]) < 2:
        sys.path.insert(0, str(HERE))
        from imagefolder_cifar10 import ImageFolderCIFAR10DataModule
        from vae import ReportVAE

        dm = ImageFolderCIFAR10DataModule(data_dir, batch_size=batch_size, num_workers=0, pin_memory=False)
        model = ReportVAE(input_height=32, kl_estimator="mc")
        return model, dm, "pl_bolts 0.7.0 VAE + report-era mc KL (examples/legacy/vae.py ReportVAE)"
    from vae_ddp.data import ImageFolderDataModule
    from vae_ddp.model import VAE

    dm = ImageFolderDataModule(data_dir, batch_size=batch_size)
    return VAE(input_height=32, kl_estimator="mc"), dm, "vae_ddp.model.VAE (port, resnet18, mc KL)"


def _sampler_info(trainer, batches: list, dataset) -> dict:
    """Describe the training sampler and the epoch-0 indices it gave this rank.

    ``batches``: the ``x: (b, 3, 32, 32)`` tensors of the steps trained, in order. The
    indices are recomputed from the sampler without drawing from the global generator.
    """
    import torch
    from torch.utils.data import DistributedSampler

    tdl = trainer.train_dataloader
    dl = getattr(tdl, "loaders", tdl)  # 1.9: CombinedLoader(.loaders); 2.x: the DataLoader
    if isinstance(dl, (list, tuple)):
        dl = dl[0]
    s = dl.sampler
    info = {"class": f"{type(s).__module__}.{type(s).__qualname__}", "batch_size": dl.batch_size}
    if isinstance(s, DistributedSampler):
        info.update(seed=s.seed, shuffle=s.shuffle, drop_last=s.drop_last, num_replicas=s.num_replicas,
                    rank=s.rank, epoch=s.epoch, num_samples=s.num_samples)
        positions = list(DistributedSampler.__iter__(s))  # seeded by seed + epoch only
        inner = getattr(s.dataset, "_sampler", None)  # lightning_fabric's _DatasetSamplerWrapper
        if inner is not None:
            info["wrapped_sampler"] = f"{type(inner).__module__}.{type(inner).__qualname__}"
            inner_list = s.dataset._sampler_list  # what this rank's inner sampler yielded in epoch 0
            info["inner_order_head"] = inner_list[:8]
            indices = [inner_list[p] for p in positions]
        else:
            indices = positions
    else:
        indices = None
    info["indices"] = indices
    if indices is not None:
        b = dl.batch_size
        ok = all(torch.equal(torch.stack([dataset[i][0] for i in indices[k * b:(k + 1) * b]]), x)
                 for k, x in enumerate(batches))
        info["indices_match_trained_batches"] = bool(ok)
    return info


def _worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    import pytorch_lightning as pl
    from pytorch_lightning import Callback

    if args.config == "noseed":
        pl.seed_everything()
    else:
        pl.seed_everything(args.seed)
    model, dm, model_name = _build(args.data_dir, args.batch_size)

    record = {"eps": [], "replay_exact": [], "x": []}
    orig_sample = model.sample

    def sample(mu, log_var, *a, **k):
        state = torch.get_rng_state()
        p, q, z = orig_sample(mu, log_var, *a, **k)
        if model.training:
            after = torch.get_rng_state()
            torch.set_rng_state(state)
            eps = torch.empty_like(mu).normal_()  # what Normal.rsample / the port's noise drew
            torch.set_rng_state(after)
            record["eps"].append(eps.detach().clone())
            record["replay_exact"].append(bool(torch.equal(mu + eps * torch.exp(log_var / 2), z)))
        return p, q, z

    model.sample = sample

    class Recorder(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx, *rest):
            record["x"].append(batch[0].detach().clone())

        def on_train_end(self, trainer, pl_module):
            info = _sampler_info(trainer, record["x"], trainer.datamodule.dataset_train)
            out = {
                "rank": trainer.global_rank, "world_size": trainer.world_size,
                "pl_global_seed": os.environ.get("PL_GLOBAL_SEED"),
                "initial_seed": int(torch.initial_seed()),
                "sampler": info, "replay_exact": record["replay_exact"],
                "pl_version": pl.__version__, "torch_version": torch.__version__, "model": model_name,
                "dataset_train_len": len(trainer.datamodule.dataset_train),
                "ddp_find_unused_parameters": getattr(trainer.strategy.model, "find_unused_parameters", None),
            }
            d = Path(args.rank_dir)
            torch.save({"eps": record["eps"]}, d / f"eps_rank{trainer.global_rank}.pt")
            (d / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))

    callbacks = [Recorder()]
    if args.config == "per_rank_seed":
        from vae_ddp.fixes.noise import PerRankSeed

        callbacks.insert(0, PerRankSeed(args.seed))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=args.steps,
                         limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, datamodule=dm)


# --------------------------------------------------------------------------- driver
def trainer_facts() -> dict:
    """What this Lightning version does with the report's Trainer arguments (constructed
    in this process; nothing is launched). Each value is the strategy class chosen, or
    ``"ErrorType: message"``."""
    import warnings

    import pytorch_lightning as pl

    def build(**kw) -> str:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                t = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, **kw)
            warned = [str(w.message) for w in caught if "not supported on CPUs" in str(w.message)]
            return type(t.strategy).__name__ + (f" (warning: {warned[0]})" if warned else "")
        except Exception as err:  # the message is the measurement
            return f"{type(err).__name__}: {str(err).splitlines()[0]}"

    return {
        "gpus=1": build(gpus=1),
        "accelerator='ddp', devices=2": build(accelerator="ddp", devices=2),
        "accelerator='cpu', devices=2, strategy='ddp'": build(accelerator="cpu", devices=2, strategy="ddp"),
        "accelerator='cpu', devices=2, strategy='dp'": build(accelerator="cpu", devices=2, strategy="dp"),
        "max_steps=None": build(accelerator="cpu", devices=1, max_steps=None),
        "Trainer.add_argparse_args exists": hasattr(pl.Trainer, "add_argparse_args"),
        "LightningDataModule.size exists": hasattr(pl.LightningDataModule, "size"),
    }


def _corr(a, b) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()))


def summarize(config: str, rank_dir: Path) -> dict:
    """Combine the two ranks' records of one configuration.

    Returns a dict with ``eps_corr_per_step`` (Pearson correlation of rank 0's and rank 1's
    ``eps: (b, latent_dim)``, flattened, at each step), ``eps_max_abs_diff_per_step``,
    ``eps_identical`` (bitwise, all steps), ``eps_shape``, ``replay_exact``, the ranks'
    ``pl_global_seed`` and ``initial_seed``, the ``sampler`` description of each rank, and
    ``index_overlap`` (dataset indices that both ranks got in epoch 0), ``index_union``,
    ``dataset_train_len``.
    """
    import torch

    ranks = [json.loads((rank_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    eps = [torch.load(rank_dir / f"eps_rank{r}.pt")["eps"] for r in (0, 1)]
    steps = min(len(eps[0]), len(eps[1]))
    corr = [_corr(eps[0][k], eps[1][k]) for k in range(steps)]
    diff = [float((eps[0][k] - eps[1][k]).abs().max()) for k in range(steps)]
    idx = [r["sampler"].get("indices") for r in ranks]
    out = {
        "config": config,
        "pl_version": ranks[0]["pl_version"], "torch_version": ranks[0]["torch_version"],
        "model": ranks[0]["model"], "world_size": ranks[0]["world_size"], "steps": steps,
        "eps_shape": list(eps[0][0].shape),
        "eps_corr_per_step": corr, "eps_max_abs_diff_per_step": diff,
        "eps_identical": all(torch.equal(eps[0][k], eps[1][k]) for k in range(steps)),
        "replay_exact": all(all(r["replay_exact"]) for r in ranks),
        "pl_global_seed": [r["pl_global_seed"] for r in ranks],
        "initial_seed": [r["initial_seed"] for r in ranks],
        "dataset_train_len": ranks[0]["dataset_train_len"],
        "ddp_find_unused_parameters": ranks[0]["ddp_find_unused_parameters"],
        "sampler": [{k: v for k, v in r["sampler"].items() if k != "indices"} for r in ranks],
    }
    if idx[0] is not None and idx[1] is not None:
        out["index_overlap"] = len(set(idx[0]) & set(idx[1]))
        out["index_union"] = len(set(idx[0]) | set(idx[1]))
        out["indices_first_steps"] = [i[: steps * ranks[0]["sampler"]["batch_size"]] for i in idx]
    return out


def main(argv=None) -> int:
    p = _Parser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output folder: writes factor_check.json there")
    p.add_argument("--data_dir", default=DEFAULT_DATA, help="ImageFolder tree <dir>/train/<class>/*.jpg")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--batch_size", type=int, default=2, help="per-device batch size")
    p.add_argument("--steps", type=int, default=2, help="training steps per configuration")
    p.add_argument("--_worker", dest="config", help=argparse.SUPPRESS)
    p.add_argument("--_rank_dir", dest="rank_dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.config:
        _worker(args)
        return 0

    if not args.out:
        _fail("--out DIR is required")
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or not configs:
        _fail(f"unknown config {','.join(bad) or '(none)'}: use a comma-separated subset of {','.join(CONFIGS)}")
    if args.batch_size < 1 or args.steps < 1:
        _fail("--batch_size and --steps must be >= 1")
    if not (Path(args.data_dir) / "train").is_dir():
        _fail(f"--data_dir {args.data_dir!r} has no train/ folder: expected <dir>/train/<class>/<image>.jpg, "
              f"e.g. ../shared/data/cifar10-jpg-subset")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    results, timings = {}, {}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("PL_GLOBAL_SEED", None)
    for cfg in configs:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", cfg, "--_rank_dir", tmp,
                   "--data_dir", args.data_dir, "--seed", str(args.seed), "--batch_size", str(args.batch_size),
                   "--steps", str(args.steps)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            timings[cfg] = round(time.perf_counter() - t0, 1)
            if proc.returncode != 0 or not (Path(tmp) / "rank1.json").exists():
                sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
                _fail(f"the ddp run of config {cfg} failed (exit {proc.returncode})")
            results[cfg] = summarize(cfg, Path(tmp))
            print(f"{cfg}: eps corr {results[cfg]['eps_corr_per_step']}, "
                  f"index overlap {results[cfg].get('index_overlap')}", flush=True)

    import pytorch_lightning as pl

    exe = os.path.relpath(sys.executable) if not os.path.relpath(sys.executable).startswith("..") else sys.executable
    doc = {"pl_version": pl.__version__,
           "command": " ".join([exe, "examples/legacy/factor_check.py"] + (argv if argv is not None else sys.argv[1:])),
           "seed": args.seed, "per_device_batch_size": args.batch_size, "steps": args.steps,
           "wall_seconds": timings, "trainer_facts": trainer_facts(), "configs": results}
    (out_dir / "factor_check.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_dir / 'factor_check.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
