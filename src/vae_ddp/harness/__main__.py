"""``python -m vae_ddp.harness TRAIN JOB_FILE OUT_DIR``: the child of every launch, the one entry
point of the project's processes besides the CLIs and the guard
([`run_job`][vae_ddp.harness.launch.run_job]; ``TRAIN``: the ``"module:function"`` that trains
a group's specs in every rank). Imported under another name (tests/test_imports.py imports every
module), it runs nothing."""

import sys

from vae_ddp.harness.launch import run_job

if __name__ == "__main__":
    sys.exit(run_job(sys.argv[1:]))
