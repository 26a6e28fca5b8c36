"""The page "Keep it fixed: DDP in your test suite" (docs/keep-it-fixed.md): what its failure shows.

The user's test file and its workflow run in tests/test_installed.py (the installed wheel).
"""

from __future__ import annotations

import pytest


@pytest.mark.timeout(900)
def test_the_page_shows_the_failure_of_the_model_with_batchnorm(generated):
    """examples/keep_it_fixed_failure.py: the user's model with its BatchNorm back fails, the message
    naming BatchNorm, the layer, its effect, the sync fix and its page; the sampler is named as seen,
    not as a cause."""
    shown = generated("keep_it_fixed_failure")
    assert shown["exit_code"] == 1 and shown["exit_why"] == ["batchnorm"]
    message = shown["message"]
    first, *rest = message.splitlines()
    assert first.startswith("DDP on 2 devices does not train one device's model (")
    assert first.endswith("vae-ddp audit exits 1 because of batchnorm")
    bn = message.split("- BatchNorm statistics (its mechanism changes the model DDP trains): ")[1].split("\n- ")[0]
    assert "normalise with per-rank statistics (net.1)" in bn and "  effect: " in bn
    assert "fix: Trainer(sync_batchnorm=True)" in bn and "GlobalSyncBatchNorm" in bn
    assert "batchnorm" in bn.split("page: ")[1]
    assert "- Sampler and data order (seen; it does not change the model DDP trains)" in message
