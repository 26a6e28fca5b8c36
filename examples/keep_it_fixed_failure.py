"""What the test of examples/keep_it_fixed/test_ddp.py says the day BatchNorm comes back.

The audit of `assert_ddp_matches_one_device`, `vae_ddp.audit.api.audit`, on the page's model with
`norm="batch"` (the per-rank BatchNorm it once had): it prints the result as a value and the
AssertionError the test fails with (`vae_ddp.testing.failure_message` of that result), as Markdown,
and writes OUT/keep_it_fixed_failure.json, `{"exit_code", "exit_why", "message"}`.

    python examples/keep_it_fixed_failure.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "keep_it_fixed"))  # the user's test file, importable

from test_ddp import Classifier, Digits  # noqa: E402

from vae_ddp.audit.api import audit  # noqa: E402
from vae_ddp.testing import failure_message  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run")
    args = parser.parse_args()
    print("```text")
    # --8<-- [start:value]
    result = audit(Classifier, Digits, model_args={"norm": "batch"}, data_args={"batch_size": 32}, steps=args.steps)
    print(f"verdict: {result.verdict}, exit code {result.exit_code}, because of {', '.join(result.exit_why)}")
    for f in result.findings:
        effect = f"{f.effect.kind}, noise ratio {f.effect.variance_ratio:.2g}" if f.effect else "not measured"
        print(f"{f.name}: mechanism {f.mechanism}; effect: {effect}")
    # --8<-- [end:value]
    print("```")
    if result.exit_code == 0:
        raise SystemExit("the model with BatchNorm passed: the page expects the assertion")
    message = failure_message(result)  # what assert_ddp_matches_one_device raises for this result
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "keep_it_fixed_failure.json").write_text(json.dumps(
        {"exit_code": result.exit_code, "exit_why": list(result.exit_why), "message": message}, indent=1))
    print()
    print("The test's failure, as pytest shows it:")
    print()
    print("```text")
    print(f"AssertionError: {message}")
    print("```")


if __name__ == "__main__":
    main()
