"""The answer on Home: the first screen, the studies' words under it and the DP/DDP table.

All of it is written from the committed studies (``docs/results/``: the seed study, the
long-horizon check and the report-scale measurement) by the rules of
``vae_ddp.studies.answer`` (bug or expected behaviour; does the KL match) and
``vae_ddp.studies.verdict`` (each study's words): nothing in them is typed by hand.

    python examples/home_verdict.py --out out/home_verdict

Prints the first screen (Markdown) and writes ``verdict_table.md`` (each study's words, under the
box), ``dp_lead.md`` (the account of DP above the table), ``dp_table.md`` and
``home_verdict.json`` (the two answers by their rules).
"""

import argparse
import json
from pathlib import Path

from vae_ddp.studies.answer import bug_or_expected, dp_account, first_screen, kl_words
from vae_ddp.studies.verdict import dp_table, load, verdict_table

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="the first screen and the DP/DDP table of Home")
    p.add_argument("--out", type=Path, default=Path("out/home_verdict"))
    args = p.parse_args(argv)
    results = load(ROOT)
    box = first_screen(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dp_table.md").write_text(dp_table(results))
    (args.out / "verdict_table.md").write_text(verdict_table(results))
    (args.out / "dp_lead.md").write_text(dp_account(results))
    answers = {"bug": bug_or_expected(results["report_scale"], results["seeds"]),
               "kl": kl_words(results["seeds"], results["long_horizon"])}
    (args.out / "home_verdict.json").write_text(json.dumps({**answers, "box": box}, indent=1))
    print(box)
    return answers


if __name__ == "__main__":
    main()
