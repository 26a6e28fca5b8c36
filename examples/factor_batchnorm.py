"""Factor 2: BatchNorm statistics. What does each rank normalise with, and what does it do to the gradient?

One optimizer step of the ResNet-18 VAE through Lightning DDP (2 gloo processes, float64),
with the noise and the sample order already made identical to one device's, so that
BatchNorm is the only difference. It compares, with one process computing the same
global batch on one device: the output of the encoder's first BatchNorm layer, and the
all-reduced gradient that Adam receives. Then the same with [`GlooSyncBatchNorm`][vae_ddp.fixes.batchnorm.GlooSyncBatchNorm].

    python examples/factor_batchnorm.py --out out/batchnorm
"""

import argparse
import json
from pathlib import Path

import pytorch_lightning as pl
import torch

from vae_ddp.data import make_datamodule
from vae_ddp.fixes import GlobalBatchDistributedSampler, GlobalBatchNoise, GlooSyncBatchNorm
from vae_ddp.model import VAE
from vae_ddp.probes import GradientProbe
from vae_ddp.utils import quiet

GLOBAL_BATCH, SEED = 16, 0


def first_bn(model: VAE) -> torch.nn.Module:
    return model.encoder.bn1 if model.hparams.enc_type == "resnet18" else model.encoder[1]


def ddp_step(sync_bn: bool, datamodule, enc_type: str):
    """Rank 0's view of DDP step 0: (params before, averaged grads, first-BN output of all ranks)."""
    pl.seed_everything(SEED, verbose=False)
    model = VAE(enc_type=enc_type)
    outputs = []

    class HookFirstBN(pl.Callback):  # at train start: after GlooSyncBatchNorm replaced the layers
        def on_train_start(self, trainer, pl_module):
            first_bn(pl_module).register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))

    probe = GradientProbe(step=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=1, precision="64-true",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, use_distributed_sampler=False,
                         plugins=[GlooSyncBatchNorm()] if sync_bn else None,
                         callbacks=[GlobalBatchNoise(SEED), probe, HookFirstBN()])
    trainer.fit(model, datamodule=datamodule)
    bn_out = trainer.strategy.all_gather(outputs[0])  # (2, B/2, C, H, W): rank 0's rows, then rank 1's
    return probe.params, probe.grads, bn_out.flatten(0, 1), trainer


def one_device_step(params, datamodule, enc_type: str):
    """The same global batch, weights and noise on one device: (grads, first-BN output)."""
    model = VAE(enc_type=enc_type).double()
    model.load_state_dict(params, strict=False)
    outputs = []
    first_bn(model).register_forward_hook(lambda m, i, o: outputs.append(o.detach().clone()))  # before the in-place ReLU
    ds = datamodule.dataset_train
    idx = list(GlobalBatchDistributedSampler(ds, GLOBAL_BATCH, num_replicas=1, rank=0, seed=SEED))[:GLOBAL_BATCH]
    x = torch.stack([ds[i][0] for i in idx]).double()
    eps = GlobalBatchNoise(SEED)(torch.zeros(GLOBAL_BATCH, model.latent_dim, dtype=torch.float64))
    loss, _ = model.step(x, eps)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}, outputs[0]


def rel_diff(a: dict, b: dict, keys) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in keys) / max(float(b[k].abs().max()) for k in keys)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="BatchNorm statistics under DDP")
    p.add_argument("--out", type=Path, default=Path("out/batchnorm"))
    p.add_argument("--model", default="resnet18", choices=["resnet18", "small"])
    p.add_argument("--data-dir", default=None, help="ImageFolder tree (default: scikit-learn digits)")
    args = p.parse_args(argv)
    quiet()
    dm = make_datamodule("imagefolder" if args.data_dir else "digits", args.data_dir,
                         batch_size=GLOBAL_BATCH // 2, sampler="global", sampler_seed=SEED, max_samples=2000)
    result = {"model": args.model, "global_batch_size": GLOBAL_BATCH, "world_size": 2, "dtype": "float64"}
    for sync_bn in (False, True):
        params, grads, bn_out, trainer = ddp_step(sync_bn, dm, args.model)
        if not trainer.is_global_zero:
            continue
        ref_grads, ref_bn = one_device_step(params, dm, args.model)
        head = [k for k in grads if k.startswith(("fc_mu", "fc_var"))]
        rest = [k for k in grads if k not in head]
        result["sync_bn" if sync_bn else "default"] = {
            "bn_output_max_abs_diff": float((bn_out - ref_bn).abs().max()),
            "grad_rel_diff_all": rel_diff(grads, ref_grads, grads),
            "grad_rel_diff_fc_mu_fc_var": rel_diff(grads, ref_grads, head),
            "grad_rel_diff_encoder_decoder": rel_diff(grads, ref_grads, rest),
        }
    if "default" in result:
        result["summary"] = {
            "Factor": "BatchNorm statistics",
            "What goes wrong": "each rank normalises with the statistics of its own B/N samples",
            "Measured here": f"gradient off by {result['default']['grad_rel_diff_all']:.1e} (relative; "
                             f"{result['default']['grad_rel_diff_fc_mu_fc_var']:.1e} for fc_mu/fc_var) after one "
                             f"step; {result['sync_bn']['grad_rel_diff_all']:.0e} with the fix",
            "Fix": "`plugins=[GlooSyncBatchNorm()]` (CPU), `sync_batchnorm=True` (GPU)",
        }
    if pl.utilities.rank_zero_only.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "factor_batchnorm.json").write_text(json.dumps(result, indent=1))
        print(f"{args.model} VAE, one DDP step (2 ranks x {GLOBAL_BATCH // 2}) vs one device ({GLOBAL_BATCH}), "
              "float64, same weights, samples and noise\n")
        print("| BatchNorm | first BN output, max abs diff | gradient, max rel diff | fc_mu/fc_var | encoder/decoder |")
        print("|---|---|---|---|---|")
        for name, label in (("default", "per rank (default)"), ("sync_bn", "GlooSyncBatchNorm")):
            r = result[name]
            print(f"| {label} | {r['bn_output_max_abs_diff']:.2e} | {r['grad_rel_diff_all']:.2e} | "
                  f"{r['grad_rel_diff_fc_mu_fc_var']:.2e} | {r['grad_rel_diff_encoder_decoder']:.2e} |")
    return result


if __name__ == "__main__":
    main()
