"""A module whose one-device run fails at its second step (the DDP runs would not)."""
from examples.audit_models import Plain


class FailsAlone(Plain):
    def training_step(self, batch, batch_idx):
        if self.trainer.world_size == 1 and batch_idx == 1:
            raise RuntimeError("one device exploded on purpose")
        return super().training_step(batch, batch_idx)


class ExitsAlone(Plain):
    """The one-device process ends at its second step without a Python exception (as when killed)."""

    def training_step(self, batch, batch_idx):
        if self.trainer.world_size == 1 and batch_idx == 1:
            import os

            os._exit(7)
        return super().training_step(batch, batch_idx)
