"""Run one [`RunSpec`][vae_ddp.harness.configs.RunSpec] through Lightning's ``Trainer``.

What a launch's child trains by default, ``train_specs``
(``python -m vae_ddp.harness vae_ddp.harness.runner:train_specs JOB_FILE OUT_DIR``, ``JOB_FILE``:
a [`Job`][vae_ddp.harness.launch.Job]'s JSON, [`run_job`][vae_ddp.harness.launch.run_job]). A DDP
run on CPU forks its other ranks from this process once it has imported Lightning
([`vae_ddp.ranks`][vae_ddp.ranks]); on GPUs Lightning starts them by re-running this same
command (``_SubprocessScriptLauncher``). Either way a study launches its runs in a process
tree of their own, not inside its own process. Rank 0 writes each group's ``OUT_DIR/TAG/run.json``:
``{"group": [{"spec": {...}, "runs": [{"seed", "records", "val_records", "params"}]}, ...]}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch

from vae_ddp.data import make_datamodule
from vae_ddp.fixes import registry
from vae_ddp.fixes.registry import FixParts
from vae_ddp.model import VAE
from vae_ddp import heartbeat
from vae_ddp.outputs import replacing, write_atomic
from vae_ddp.ranks import cluster_plugins
from vae_ddp.harness.configs import RunSpec, initial_weights
from vae_ddp.harness.launch import say_run
from vae_ddp.dp import DataParallelVAE
from vae_ddp.recording import GlobalBatchRecorder
from vae_ddp.utils import close_process_group, quiet

__all__ = ["build_model", "build_trainer", "build_datamodule", "fix_parts", "train_one", "train_specs",
           "close_process_group"]


def fix_parts(spec: RunSpec, seed: int) -> FixParts:
    """What the fixes that are on in ``spec`` add to the run, merged over the factor registry."""
    parts = FixParts()
    for factor in registry.switches():
        if factor.is_on(spec) and factor.parts is not None:
            parts = parts.merge(factor.parts(spec, seed))
    return parts


def build_datamodule(spec: RunSpec, seed: int):
    """The datamodule of ``spec`` (its global batch size, which the loaders share over the ranks;
    the sampler a fix asks for)."""
    kwargs = dict(global_batch_size=spec.global_batch_size, max_samples=spec.max_samples, sampler_seed=seed,
                  return_index=spec.record_indices)
    return make_datamodule(spec.data, spec.data_dir, **{**kwargs, **fix_parts(spec, seed).datamodule})


def build_model(spec: RunSpec, seed: int) -> VAE:
    """The LightningModule of ``spec`` (call after ``seed_everything``: it draws the weights)."""
    kwargs = dict(input_height=32, enc_type=spec.model, latent_dim=spec.latent_dim, lr=spec.lr,
                  kl_coeff=spec.kl_coeff, kl_estimator=spec.kl_estimator, optimizer=spec.optimizer,
                  **fix_parts(spec, seed).module)
    if spec.config == "dp":
        return DataParallelVAE(replicas=spec.devices, dp_mode=spec.dp_mode, replica_seed=seed, **kwargs)
    return VAE(**kwargs)


def build_trainer(spec: RunSpec, seed: int, callbacks: Optional[list] = None) -> pl.Trainer:
    """Lightning ``Trainer`` of ``spec`` with the callbacks, plugins and arguments of the fixes
    it asks for (from the factor registry)."""
    parts = fix_parts(spec, seed)
    callbacks = list(callbacks or []) + parts.callbacks + heartbeat.callbacks()  # the guard's watchdog sees progress
    extra: dict[str, Any] = dict(parts.trainer)
    plugins = parts.plugins + cluster_plugins()  # a forked rank: the environment vae_ddp.ranks set
    if plugins:
        extra["plugins"] = plugins
    if spec.permute_seed is not None:  # after the fixes' callbacks: it wraps the noise they set
        from vae_ddp.harness.permutation import WithinBatchPermutation

        callbacks.append(WithinBatchPermutation(spec.permute_seed))
    accelerator = "gpu" if (spec.accelerator == "gpu" or (spec.config == "dp" and spec.dp_mode == "real")) else "cpu"
    return pl.Trainer(
        accelerator=accelerator, devices=spec.world_size, strategy="ddp" if spec.config == "ddp" else "auto",
        max_steps=spec.steps, max_epochs=-1, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision="64-true" if spec.dtype == "float64" else "32-true", callbacks=callbacks, **extra)


def train_one(spec: RunSpec, seed: int, out_dir: Optional[Path] = None, progress: bool = True) -> Optional[dict]:
    """Train ``spec`` with ``seed``; on rank 0 return ``{"seed", "records", "val_records",
    "params"}`` (``params``: file name of the saved ``{"state_dict", "adam_v"}``, Adam's
    ``exp_avg_sq`` per parameter name, or None)."""
    pl.seed_everything(seed, verbose=False)
    dm = build_datamodule(spec, seed)
    model = build_model(spec, seed)
    if spec.init_weights is not None:  # after the seed's own initial weights were drawn: the data and noise keep it
        model.load_state_dict(initial_weights(spec))
    recorder = GlobalBatchRecorder(spec.steps, spec.val_every, f"{spec.label} seed {seed}", progress,
                                   record_indices=spec.record_indices)
    callbacks: list = [recorder]
    probe = None
    if spec.steps_file:
        from vae_ddp.probes import StepProbe

        states = torch.load(spec.steps_file)["states"] if spec.teacher_forced else None
        probe = StepProbe(states, record_states=not spec.teacher_forced)
        callbacks.insert(0, probe)  # first: the step starts from θ_k before any other callback acts
    trainer = build_trainer(spec, seed, callbacks)
    trainer.fit(model, datamodule=dm)
    if not trainer.is_global_zero:
        return None
    steps = None
    if probe is not None:
        record = {"grads": probe.grads, "buffers": probe.buffers}
        if not spec.teacher_forced:
            with replacing(spec.steps_file) as tmp:
                torch.save({**record, "states": probe.states}, tmp)
        if out_dir is not None:
            steps = f"steps-{seed}.pt"
            with replacing(out_dir / steps) as tmp:
                torch.save(record, tmp)
    params = None
    if spec.save_params and out_dir is not None:
        params = f"params-{seed}.pt"
        opt = trainer.optimizers[0]
        adam_v = {n: opt.state[p]["exp_avg_sq"].detach().cpu() for n, p in model.named_parameters() if p in opt.state}
        with replacing(out_dir / params) as tmp:
            torch.save({"state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                        "adam_v": adam_v}, tmp)
    return {"seed": seed, "records": recorder.records, "val_records": recorder.val_records, "params": params,
            "steps": steps}


def train_specs(specs: list[RunSpec], out_dir: Path) -> int:
    """What a launch trains by default (``launch.RUNNER``, in every rank of a group's process tree,
    [`run_job`][vae_ddp.harness.launch.run_job]): ``specs`` one after the other in this rank, spec
    ``k`` saving its parameters under ``OUT_DIR/k/``; rank 0 writes ``OUT_DIR/run.json`` =
    ``{"group": [{"spec", "runs"}, ...]}``."""
    quiet()
    out_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for k, spec in enumerate(specs):
        where = out_dir / str(k)
        where.mkdir(parents=True, exist_ok=True)
        say_run(spec.label)  # in the log: a rank that ends is named with its run (launch)
        try:
            runs = [train_one(spec, seed, where) for seed in spec.seeds]
        except BaseException:
            say_run(spec.label, failed=True, world_size=spec.world_size)
            raise
        runs = [r and dict(r, params=r["params"] and f"{k}/{r['params']}", steps=r.get("steps") and f"{k}/{r['steps']}")
                for r in runs]
        results.append({"spec": json.loads(spec.to_json()), "runs": runs})
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
        write_atomic(out_dir / "run.json", json.dumps({"group": results}))
    close_process_group()
    return 0
