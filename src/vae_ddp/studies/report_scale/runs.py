"""The child process of the report-scale study: frozen-weights runs of one world size in every
rank (a launch's child, ``python -m vae_ddp.harness vae_ddp.studies.report_scale.runs:frozen_runs
JOB OUT``, [`run_job`][vae_ddp.harness.launch.run_job]), each step's all-reduced gradient kept and
then zeroed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vae_ddp.harness.configs import RunSpec
from vae_ddp.outputs import replacing, write_atomic


class _FrozenGradients:
    """Lightning callback (built lazily to keep this module light): keep the gradient Adam
    receives at every step (after DDP's all-reduce), then zero it, so the weights never move.
    The first ``keep`` steps' gradients are kept whole (``grads``), every step's as its
    ``sketch``-long [`count_sketch`][vae_ddp.probes.count_sketch] (``sketches``: the same linear
    map in every run, so norms and traces of differences are kept in expectation)."""

    def __new__(cls, keep: int, sketch: int = 0):
        from pytorch_lightning import Callback

        from vae_ddp.probes import count_sketch

        class FrozenGradients(Callback):
            def __init__(self) -> None:
                self.grads: list[dict[str, torch.Tensor]] = []
                self.sketches: list[torch.Tensor] = []

            def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
                named = sorted((n, p) for n, p in pl_module.named_parameters() if p.grad is not None)
                if len(self.grads) < keep:
                    self.grads.append({n: p.grad.detach().float().cpu().clone() for n, p in named})
                if sketch:
                    flat = torch.cat([p.grad.detach().reshape(-1).double().cpu() for _, p in named])
                    self.sketches.append(count_sketch(flat, sketch))
                for _, p in named:
                    p.grad.zero_()  # Adam: m = v = 0, update lr * 0 / (0 + eps) = 0

        return FrozenGradients()


def per_sample_terms(module, x: torch.Tensor, eps: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample ``(kl, recon)``, each ``(B,)``, of one training-mode forward of ``x: (B, 3, H, W)``.

    The forward runs once on the whole batch (BatchNorm sees the batch, as in training);
    each sample's terms are then [`vae_loss`][vae_ddp.model.vae_loss] of that row alone, so
    their mean is the batch's ``kl`` and ``recon_loss`` (equal numbers of elements per row).
    """
    from vae_ddp.model import vae_loss

    with torch.no_grad():
        h = module.encoder(x)
        mu, log_var = module.fc_mu(h), module.fc_var(h)
        p, q, z = module.sample(mu, log_var, eps)
        x_hat = module.decoder(z)
        kl, rec = [], []
        for i in range(len(x)):
            pi = torch.distributions.Normal(p.loc[i:i + 1], p.scale[i:i + 1])
            qi = torch.distributions.Normal(q.loc[i:i + 1], q.scale[i:i + 1])
            _, logs = vae_loss(x[i:i + 1], x_hat[i:i + 1], pi, qi, z[i:i + 1], module.kl_coeff, module.kl_estimator)
            kl.append(logs["kl"])
            rec.append(logs["recon_loss"])
    return torch.stack(kl).double(), torch.stack(rec).double()


def _spread(trainer, module, skip: int, batches: int) -> dict:
    """``batches`` further training-mode forward passes at the frozen weights on this rank's
    batches (after the first ``skip``): rank 0's mean, the global mean and every sample's terms."""
    loader = trainer.train_dataloader
    module.train()
    out: dict[str, list] = {"rank0_kl": [], "global_kl": [], "rank0_recon": [], "global_recon": [],
                            "sample_kl": [], "sample_recon": []}
    for i, batch in enumerate(loader):
        if i < skip:
            continue
        if i >= skip + batches:
            break
        x = batch[0].to(module.device, module.dtype)
        kl, rec = per_sample_terms(module, x)
        stats = torch.stack([kl.sum(), rec.sum(), torch.tensor(float(len(x)), dtype=torch.float64)])
        tot = trainer.strategy.reduce(stats.clone(), reduce_op="sum")
        every_kl = trainer.strategy.all_gather(kl).reshape(-1)
        every_rec = trainer.strategy.all_gather(rec).reshape(-1)
        out["rank0_kl"].append(float(kl.mean()))  # what self.log(on_step=True) shows under DDP
        out["rank0_recon"].append(float(rec.mean()))
        out["global_kl"].append(float(tot[0] / tot[2]))
        out["global_recon"].append(float(tot[1] / tot[2]))
        out["sample_kl"].append(every_kl.tolist())
        out["sample_recon"].append(every_rec.tolist())
    return out


def frozen_runs(specs: list[RunSpec], out: Path) -> int:
    """Frozen-weights runs of one world size, one after the other in this rank (the child of a
    launch, [`run_job`][vae_ddp.harness.launch.run_job]): ``OUT_DIR/worker.json`` lists, per
    spec, its ``folder`` and ``spread_batches``; rank 0 writes ``grads.pt`` and ``run.json``
    into each folder, and ``OUT_DIR/run.json``."""
    import pytorch_lightning as pl

    from vae_ddp.data import make_datamodule
    from vae_ddp.recording import GlobalBatchRecorder
    from vae_ddp.harness.runner import build_model, build_trainer, close_process_group
    from vae_ddp.utils import quiet

    jobs = json.loads((out / "worker.json").read_text())
    quiet()
    is_zero = False
    for spec, job in zip(specs, jobs):
        seed = spec.seeds[0]
        pl.seed_everything(seed, verbose=False)
        dm = make_datamodule(spec.data, spec.data_dir, global_batch_size=spec.global_batch_size,
                             max_samples=spec.max_samples, sampler=spec.sampler, sampler_seed=seed,
                             return_index=spec.record_indices)
        model = build_model(spec, seed)
        recorder = GlobalBatchRecorder(spec.steps, 0, spec.label, progress=True, record_indices=spec.record_indices)
        frozen = _FrozenGradients(job.get("keep", spec.steps), job.get("sketch", 0))
        trainer = build_trainer(spec, seed, [recorder, frozen])
        trainer.fit(model, datamodule=dm)
        spread = _spread(trainer, model, spec.steps, job["spread_batches"]) if job["spread_batches"] else None
        is_zero = trainer.is_global_zero
        if is_zero:
            folder = Path(job["folder"])
            folder.mkdir(parents=True, exist_ok=True)
            with replacing(folder / "grads.pt") as tmp:
                torch.save({"grads": frozen.grads, "sketches": frozen.sketches}, tmp)
            write_atomic(folder / "run.json", json.dumps({"records": recorder.records, "spread": spread}))
    if is_zero:
        write_atomic(out / "run.json", json.dumps({"group": [{"folder": job["folder"]} for job in jobs]}))
    close_process_group()
    return 0
