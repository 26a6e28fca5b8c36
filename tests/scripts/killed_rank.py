"""A runner whose rank ``$KILLED_RANK`` SIGKILLs itself at its 3rd training step, whose rank
``$NAN_RANK`` has a NaN loss there, and whose rank ``$EXIT_RANK`` leaves there with ``$EXIT_HOW``
(``sys.exit`` or ``os._exit``, code 0) (tests that each is named with its rank and step)."""
import os
import signal
import sys

import vae_ddp.harness.runner as runner
from vae_ddp.harness.launch import run_job
from vae_ddp.model import VAE


class KilledVAE(VAE):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == int(os.environ.get("KILLED_RANK", "1")) and batch_idx == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("EXIT_RANK") == str(self.trainer.global_rank) and batch_idx == 2:
            sys.exit(0) if os.environ.get("EXIT_HOW") == "sys.exit" else os._exit(0)
        loss = super().training_step(batch, batch_idx)
        if os.environ.get("NAN_RANK") == str(self.trainer.global_rank) and batch_idx == 2:
            loss = loss * float("nan")  # a loss that overflowed, say
            self.last_logs["loss"] = loss.detach()
        return loss


def build_model(spec, seed):
    return KilledVAE(enc_type=spec.model, latent_dim=spec.latent_dim)


runner.build_model = build_model
if __name__ == "__main__":
    sys.exit(run_job(["vae_ddp.harness.runner:train_specs", *sys.argv[1:]]))
