"""A pytest fixture for [`assert_ddp_matches_one_device`][vae_ddp.testing.assert_ddp_matches_one_device]
whose report stays in the test's own ``tmp_path`` (pytest keeps the last runs' folders), where a
failure can be read whole. Enable it in your ``conftest.py``:

    pytest_plugins = ["vae_ddp.pytest_plugin"]

    def test_ddp(ddp_audit):
        ddp_audit(MyModule, MyDataModule, data_args={"batch_size": 32})

The package registers nothing with pytest by itself: only a suite that names this module gets the fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

__all__ = ["ddp_audit", "bound_to"]


def bound_to(folder: Path) -> Callable[..., Any]:
    """``assert_ddp_matches_one_device`` writing into ``folder`` (``out``), unless the call gives ``out``."""
    from vae_ddp import testing

    def check(model: Any, datamodule: Any, **options: Any) -> Any:
        __tracebackhide__ = True
        options.setdefault("out", folder)
        return testing.assert_ddp_matches_one_device(model, datamodule, **options)

    return check


@pytest.fixture
def ddp_audit(tmp_path: Path) -> Callable[..., Any]:
    """``ddp_audit(model, datamodule, **options)``:
    [`assert_ddp_matches_one_device`][vae_ddp.testing.assert_ddp_matches_one_device] with its
    report (``audit.json``, ``tables.md``) in ``tmp_path / "ddp-audit"``; the AssertionError's
    message ends with the report's path."""
    return bound_to(tmp_path / "ddp-audit")
