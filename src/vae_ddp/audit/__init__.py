"""Audit a user's own LightningModule for the factors that make DDP differ from one device.

- [`DDPAudit`][vae_ddp.audit.callback.DDPAudit]: a passive callback for real runs; warns once
  on rank 0 with the fix and the page of each factor it finds.

The names are imported on first use (PEP 562), so that ``vae-ddp audit --help`` imports
neither torch nor Lightning.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DDPAudit", "Finding"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vae_ddp.audit import callback

        return getattr(callback, name)
    raise AttributeError(f"module 'vae_ddp.audit' has no attribute {name!r}")
