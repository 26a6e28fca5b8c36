"""How long ``vae-ddp audit`` takes to refuse a command line that its arguments alone refuse (#62).

    python benchmarks/cli_errors.py                  # 5 repeats of each case
    python benchmarks/cli_errors.py --repeats 9

Each case runs the command as a user does (a fresh ``python -m vae_ddp.cli audit ...``, the console
script's ``entry``) from the repository's root; the wall time is from starting it to its end, with its
exit code (2: refused; a command line that is not refused runs the audit, into a temporary folder removed
at the end). A repeat runs every case once, in a rotated order (a slow period of a shared machine hits
the cases alike). The ``vae_ddp`` timed is the one the interpreter imports: ``PYTHONPATH=other/src`` times
another checkout (the same cases before a change). The tests assert that the refusal comes before torch
is imported (tests/test_cli_errors.py), not a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
M = "examples.audit_models"
CASES = {
    "no arguments": [],
    "--step 3 (abbreviated)": ["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--step", "3"],
    "--stpes 3 (misspelled)": ["--model", f"{M}.Plain", "--data", f"{M}.Regression", "--stpes", "3"],
    "--model shapes:Net (no .py)": ["--model", "shapes:Net", "--data", f"{M}.Regression"],
}


def once(args: list[str], out: str) -> tuple[float, int]:
    """Seconds and exit code of one ``vae-ddp audit ARGS --out OUT``."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vae_ddp.cli", "audit", *args, "--out", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    return time.perf_counter() - start, proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    names = list(CASES)
    times: dict[str, list[float]] = {n: [] for n in names}
    codes: dict[str, set[int]] = {n: set() for n in names}
    out = tempfile.mkdtemp(prefix="vae-ddp-cli-errors-")
    try:
        for r in range(args.repeats):
            for name in names[r % len(names):] + names[:r % len(names)]:
                took, code = once(CASES[name], os.path.join(out, "audit"))
                times[name].append(took)
                codes[name].add(code)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"vae-ddp audit refusals, {args.repeats} repeats, load average {os.getloadavg()[0]:.2f} at the end")
    print("| case | exit code | median s | min s | max s |\n|---|---|---|---|---|")
    for name in names:
        t = times[name]
        print(f"| {name} | {', '.join(map(str, sorted(codes[name])))} | {statistics.median(t):.2f} | {min(t):.2f} "
              f"| {max(t):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
