"""The user's own output (print in __init__ and training_step) is shown once, for one device's reference run;
the pre-flight checks' is not shown, and every other run's goes to the launch's log (it was printed 29 times
for a 2-step audit: the checks call training_step dozens of times in the top process)."""

import os
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(300)

LOUD = textwrap.dedent("""
    from examples.audit_models import Plain, Regression


    class Loud(Plain):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            print("USER-INIT")

        def training_step(self, batch, batch_idx):
            print("USER-STEP")
            return super().training_step(batch, batch_idx)


    Data = Regression
""")


def test_a_model_that_prints_is_shown_once(tmp_path):
    (tmp_path / "loud.py").write_text(LOUD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "vae_ddp.cli", "audit", "--model", "loud.Loud", "--data", "loud.Data",
                           "--steps", "2", "--effect_batches", "0", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=280, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = [ln for ln in proc.stdout.splitlines() if ln.startswith("USER-")]
    assert shown == ["USER-INIT", "USER-STEP", "USER-STEP"], shown  # the reference run: its module and 2 steps
    assert "USER-" not in proc.stderr
    logged = (out / "runs" / "stderr.log").read_text()
    assert logged.count("USER-STEP") >= 2 * 2  # the other runs: in the log (both DDP ranks, the floors, ...)
