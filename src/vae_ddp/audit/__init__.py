"""Audit a user's own LightningModule for the factors that make DDP differ from one device.

- [`DDPAudit`][vae_ddp.audit.callback.DDPAudit]: a passive callback for real runs; warns once
  on rank 0 with the fix and the page of each factor it finds.
"""

from vae_ddp.audit.callback import DDPAudit, Finding

__all__ = ["DDPAudit", "Finding"]
