"""DDPAudit on a foreign module under real 2-rank DDP (gloo): what it finds and what it does not."""

import json
import sys
from pathlib import Path

from vae_ddp import guard

ROOT = Path(__file__).resolve().parents[1]


def _findings(tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    proc = guard.run([sys.executable, str(ROOT / "tests" / "scripts" / "audit_callback.py"), str(out), mode],
                     capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {f["factor"]: f for f in json.loads(out.read_text())}


def test_exposed_module(tmp_path):
    found = _findings(tmp_path, "exposed")
    assert set(found) == {"noise", "optimizer", "batchnorm", "sampler", "reduction", "logging"}
    assert "1 BatchNorm layer" in found["batchnorm"]["evidence"]
    assert "train: 1 repeated of 101" in found["reduction"]["evidence"]
    assert "train_loss" in found["logging"]["evidence"]
    assert all(f["page"].endswith(".md") for f in found.values())


def test_clean_module(tmp_path):
    assert _findings(tmp_path, "clean") == {}
