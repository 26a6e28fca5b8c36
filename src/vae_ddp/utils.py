"""Small helpers shared by the examples and the studies."""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet"]


def quiet() -> None:
    """Silence Lightning's informational chatter in child processes (warnings stay on stderr)."""
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`max_epochs` was not set.*")
