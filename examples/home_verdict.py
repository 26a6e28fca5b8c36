"""The answer on Home: the verdict box and the table of which configuration has which factor.

Both are written from the committed studies (``docs/results/``: the seed study, the
long-horizon check when present, and the report-scale measurement) by
``vae_ddp.studies.verdict``, by its rules: nothing in them is typed by hand.

    python examples/home_verdict.py --out out/home_verdict

Prints the verdict box (Markdown) and writes ``verdict_table.md`` (each study's words, under the
box), ``dp_lead.md`` (the measured line above the
table), ``dp_table.md`` and ``home_verdict.json``.
"""

import argparse
import json
from pathlib import Path

from vae_ddp.studies.verdict import decide, dp_lead, dp_table, load, verdict_box, verdict_table

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="the verdict box and the DP/DDP table of Home")
    p.add_argument("--out", type=Path, default=Path("out/home_verdict"))
    args = p.parse_args(argv)
    results = load(ROOT)
    box, table = verdict_box(results), dp_table(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dp_table.md").write_text(table)
    (args.out / "verdict_table.md").write_text(verdict_table(results))
    (args.out / "dp_lead.md").write_text(dp_lead(results))
    decision = decide(results["seeds"], results["long_horizon"], results["report_scale"])
    (args.out / "home_verdict.json").write_text(json.dumps({"decision": decision, "box": box, "table": table}, indent=1))
    print(box)
    return decision


if __name__ == "__main__":
    main()
