"""Stress: DDP runs with DataLoader workers, many times over; counts hangs, failures and exit noise.

A race that shows once in seven runs shows in CI, so each case that runs DataLoader workers
under DDP (2 gloo ranks) is repeated ``--iterations`` times, each under a guard
([`vae_ddp.guard`][vae_ddp.guard]) whose watchdog turns a hang into exit code 125 with every
rank's stacks. Not part of the test suite: it takes tens of minutes.

Cases:

- ``audit``: ``vae-ddp audit`` of ``examples.audit_models.Plain`` on ``Regression`` with random
  augmentation and one worker per rank (the test that hung 1 in 7 with forked workers);
- ``dropout``: ``examples/dropout_ddp.py`` (2 workers per rank, its own ``forkserver`` context);
- ``features``: ``examples/training_features.py --steps 4`` (DataLoader workers among the features).

Prints one line per run and a table per case: runs, hangs (watchdog), other failures,
"terminate called" lines on stderr, median and maximum seconds. ``--out DIR`` keeps the
logs of the runs that did not pass and writes ``stress.json``.

    .venv/bin/python benchmarks/stress_workers.py --iterations 30 --cases audit --out runs/stress
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vae_ddp import guard

ROOT = Path(__file__).resolve().parents[1]


def case_command(name: str, out: Path) -> list[str]:
    py = sys.executable
    if name == "audit":
        return [py, "-m", "vae_ddp.cli", "audit", "--model", "examples.audit_models.Plain",
                "--data", "examples.audit_models.Regression", "--data.init_args.augment", "true",
                "--data.init_args.num_workers", "1", "--steps", "3", "--out", str(out)]
    if name == "dropout":
        return [py, str(ROOT / "examples" / "dropout_ddp.py"), "--out", str(out)]
    if name == "features":
        return [py, str(ROOT / "examples" / "training_features.py"), "--out", str(out), "--steps", "4"]
    raise ValueError(f"unknown case {name!r}: use audit, dropout or features")


#: exit codes that mean "the run did what it should" (the audit exits 1 when a factor needs a code change)
PASSING = {"audit": {0, 1}, "dropout": {0}, "features": {0}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--cases", nargs="+", default=["audit", "dropout", "features"],
                   choices=["audit", "dropout", "features"])
    p.add_argument("--stall", type=float, default=120.0, help="watchdog: seconds without progress (default 120)")
    p.add_argument("--out", type=Path, default=None, help="folder for stress.json and the logs of failed runs")
    args = p.parse_args(argv)
    results: dict[str, list[dict]] = {c: [] for c in args.cases}
    for i in range(args.iterations):
        for case in args.cases:
            with tempfile.TemporaryDirectory(prefix=f"stress-{case}-") as tmp:
                t0 = time.monotonic()
                proc = guard.run(case_command(case, Path(tmp) / "out"), stall=args.stall, timeout=1800,
                                 capture_output=True, text=True, cwd=ROOT)
                seconds = time.monotonic() - t0
                # the ranks' stderr: the captured one, and the logs of the runs a study launched
                stderr = proc.stderr + "".join(f.read_text(errors="replace") for f in Path(tmp).rglob("stderr.log"))
            code = proc.returncode
            run = {"iteration": i, "code": code, "seconds": round(seconds, 1),
                   "hung": code == guard.STALLED, "failed": code not in PASSING[case] and code != guard.STALLED,
                   "terminate_called": stderr.count("terminate called")}
            results[case].append(run)
            status = "HUNG" if run["hung"] else "FAILED" if run["failed"] else "ok"
            print(f"[{case} {i + 1}/{args.iterations}] {status} exit {code} in {seconds:.0f} s"
                  + (f", 'terminate called' x{run['terminate_called']}" if run["terminate_called"] else ""),
                  flush=True)
            if args.out and (status != "ok" or run["terminate_called"]):
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{case}-{i}.log").write_text(proc.stdout + "\n--- stderr ---\n" + stderr)
    print("\n| case | runs | hangs | other failures | 'terminate called' | median s | max s |")
    print("|---|---|---|---|---|---|---|")
    for case, runs in results.items():
        secs = [r["seconds"] for r in runs]
        print(f"| {case} | {len(runs)} | {sum(r['hung'] for r in runs)} | {sum(r['failed'] for r in runs)} | "
              f"{sum(r['terminate_called'] > 0 for r in runs)} | {statistics.median(secs):.0f} | {max(secs):.0f} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "stress.json").write_text(json.dumps(results, indent=1))
    return 1 if any(r["hung"] or r["failed"] for runs in results.values() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
