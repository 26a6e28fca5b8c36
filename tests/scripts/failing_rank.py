"""A runner whose rank 1 raises at its 3rd training step (tests that a dead rank ends the run)."""
import sys

import vae_ddp.harness.runner as runner
from vae_ddp.harness.launch import run_job
from vae_ddp.model import VAE


class ExplodingVAE(VAE):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and batch_idx == 2:
            raise RuntimeError("rank 1 exploded on purpose")
        return super().training_step(batch, batch_idx)


def build_model(spec, seed):
    return ExplodingVAE(enc_type=spec.model, latent_dim=spec.latent_dim)


runner.build_model = build_model
if __name__ == "__main__":
    sys.exit(run_job(["vae_ddp.harness.runner:train_specs", *sys.argv[1:]]))
