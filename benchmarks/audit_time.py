"""How long `vae-ddp audit` takes on a small model, end to end, and where the time goes.

    python benchmarks/audit_time.py [--repeats 5] [--steps 3] [--out DIR]

Times, as medians over ``--repeats`` runs on this machine (run it on an idle one):

- ``import``: ``python -c "import pytorch_lightning"``, what every process that trains pays;
- ``help``: ``vae-ddp audit -h`` (it imports neither torch nor Lightning);
- ``audit``: ``vae-ddp audit`` of ``examples/audit_models.py:Plain`` on 2 gloo ranks, ``--steps``
  steps: the one-device reference and its floor draws beside the DDP ranks, in one launch;
- ``pytest``: a user's test of the same model, ``python -m pytest`` of a file whose one test calls
  ``vae_ddp.testing.assert_ddp_matches_one_device(Plain, Regression, steps=...)`` (the same audit,
  from a process that imported pytest and the test's imports): at most 1.3x ``audit`` is the aim.

Its top process and its one launch each import torch and Lightning once (the launch's ranks
and one-device process are forks); the launch's import runs in its zygote (``vae_ddp.zygote``)
beside the top process's pre-flight checks, so ``audit - 2 x import`` undercounts what is not imports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: A user's test file of one test (``{root}``, ``{steps}`` filled in).
USER_TEST = """import sys
sys.path.insert(0, {root!r})
from examples.audit_models import Plain, Regression
from vae_ddp.testing import assert_ddp_matches_one_device


def test_ddp():
    assert_ddp_matches_one_device(Plain, Regression, steps={steps})
"""


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - t0


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write audit_time.json and tables.md here")
    args = p.parse_args(argv)
    cli = [sys.executable, "-m", "vae_ddp.cli", "audit"]
    times: dict[str, list[float]] = {"import": [], "help": [], "audit": [], "pytest": []}
    with tempfile.TemporaryDirectory() as tmp:
        test = Path(tmp) / "test_user_ddp.py"
        test.write_text(USER_TEST.format(root=str(ROOT), steps=args.steps))
        (Path(tmp) / "pytest.ini").write_text("[pytest]\n")  # not this repository's settings
        for _ in range(args.repeats):  # interleaved, so that a change of load touches every kind alike
            times["import"].append(timed([sys.executable, "-c", "import pytorch_lightning"]))
            times["help"].append(timed([*cli, "-h"]))
            times["audit"].append(timed([*cli, "--model", "examples/audit_models.py:Plain", "--data",
                                         "examples/audit_models.py:Regression", "--steps", str(args.steps),
                                         "--out", str(Path(tmp) / "audit")]))
            times["pytest"].append(timed([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "--rootdir", tmp, "-c", str(Path(tmp) / "pytest.ini"), str(test)]))
    med = {k: statistics.median(v) for k, v in times.items()}
    lines = [f"`vae-ddp audit` of a small model (2 gloo ranks, {args.steps} steps), median of {args.repeats} runs:", "",
             "| what | median (s) | runs (s) |", "|---|---|---|"]
    labels = {"import": "`import pytorch_lightning`", "help": "`vae-ddp audit -h`", "audit": "`vae-ddp audit`",
              "pytest": "`pytest` of `assert_ddp_matches_one_device`"}
    for k, v in times.items():
        lines.append(f"| {labels[k]} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |")
    # each repeat's pytest over the audit run just before it (the same load): the ratio a loaded machine still pairs
    paired = [t / a for t, a in zip(times["pytest"], times["audit"])]
    med["pytest_over_audit_paired"] = statistics.median(paired)
    lines += ["", f"Beside its two imports of Lightning the audit takes {med['audit'] - 2 * med['import']:.1f} s; "
              f"a user's test of the same model takes {med['pytest'] / med['audit']:.2f}x the command (ratio of the "
              f"medians), {med['pytest_over_audit_paired']:.2f}x as the median of the paired runs' ratios "
              f"({', '.join(f'{r:.2f}' for r in paired)})."]
    text = "\n".join(lines)
    print(text)
    result = {"repeats": args.repeats, "steps": args.steps, "times": times, "median": med}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "audit_time.json").write_text(json.dumps(result, indent=1))
        (args.out / "tables.md").write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
