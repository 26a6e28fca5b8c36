"""``python -m vae_ddp.studies.report_scale JOB_FILE OUT_DIR``: the child of a launch of the
report-scale study's runs of one world size ([`run_job`][vae_ddp.harness.launch.run_job] with
[`runs`][vae_ddp.studies.report_scale.runs]' frozen-weights runs). Imported under another name
(tests/test_imports.py imports every module), it runs nothing."""

import sys

from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import run_job
from vae_ddp.studies.report_scale.runs import _frozen_runs

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:], lambda d: RunSpec(**d), _frozen_runs))
