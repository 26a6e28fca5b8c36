"""The upstream report (Lightning issue #6789) is quoted as its author wrote it.

``examples/legacy/upstream-report-6789.txt`` is the report's text (its code lost its
indentation in that copy). Every place that shows the report's command lines, its seed or its
environment shows them as that file has them: the Reproduce and Lightning 1.x pages, and the
docstrings of the two scripts, which the pages render.
"""

from __future__ import annotations

import re

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(30)

REPORT = ROOT / "examples" / "legacy" / "upstream-report-6789.txt"
#: The copy handed to this project beside its checkout, when there is one.
SHARED = ROOT.parent / "shared" / "upstream-report-6789.txt"
#: Where the site quotes the report's commands: the Lightning 1.x page and the two scripts'
#: docstrings (the Reproduce page renders examples/vae.py's, the Lightning 1.x page includes
#: examples/legacy/vae.py).
QUOTING = ["docs/legacy.md", "examples/vae.py", "examples/legacy/vae.py"]
#: A command line of the report's script, ``vae.py`` run as the report ran it.
COMMAND = re.compile(r"^\s*(python vae\.py\b.*?)\s*$")


def report() -> dict:
    """What the report says: its three command lines, its seed call and its environment."""
    text = REPORT.read_text()
    env = text[text.index("### Environment"):]
    return {
        "commands": [m.group(1) for m in map(COMMAND.match, text.splitlines()) if m],
        "seed": re.search(r"^(pl\.seed_everything\(\d+\))$", text, re.M).group(1),
        "torch": re.search(r"- pyTorch_version: (\S+)", env).group(1),
        "lightning": re.search(r"- pytorch-lightning: (\S+)", env).group(1),
        "cuda": re.search(r"\* CUDA:.*?- version: (\S+)", env, re.S).group(1),
        "gpu": re.search(r"- GPU:\s*\n- (.+)", env).group(1).strip(),
    }


def test_the_copy_is_the_report():
    """The repository's copy is the text handed over as the report (when that copy is beside the
    checkout), and it holds what the pages quote."""
    if SHARED.exists():
        assert REPORT.read_bytes() == SHARED.read_bytes()
    r = report()
    assert r["commands"] == [
        "python vae.py --dataset=cifar10 --batch_size=256 # single gpu training",
        "python vae.py --dataset=cifar10 --batch_size=128 --gpus=2 --accelerator=ddp",
        "python vae.py --dataset=cifar10 --batch_size=256 --gpus=2 --accelerator=dp",
    ]
    assert (r["seed"], r["torch"], r["lightning"], r["cuda"], r["gpu"]) == (
        "pl.seed_everything(1234)", "1.8.0", "1.2.6", "10.2", "TITAN X (Pascal)")


@pytest.mark.parametrize("path", QUOTING)
def test_the_report_commands_are_quoted_exactly(path):
    """Each of these files shows the report's three command lines, each exactly as the report
    has it, and no other ``python vae.py`` line."""
    shown = [m.group(1) for m in map(COMMAND.match, (ROOT / path).read_text().splitlines()) if m]
    commands = report()["commands"]
    assert [c for c in shown if c not in commands] == [], f"{path}: not the report's lines"
    assert sorted(set(shown)) == sorted(commands), f"{path}: shows {shown}"


def test_reproduce_page_gives_the_report_seed_and_environment():
    """The Reproduce page names the report's seed call and its environment as the report does."""
    r = report()
    text = (ROOT / "docs" / "reproduce.md").read_text()
    assert re.search(r"^::: vae$", text, re.M), "the page renders examples/vae.py's docstring (its commands)"
    line = next((ln for ln in text.splitlines() if "environment" in ln.lower() and "1." in ln), "")
    assert f"`{r['seed']}`" in text
    for words in (f"PyTorch {r['torch']}", f"Lightning {r['lightning']}", f"CUDA {r['cuda']}", r["gpu"]):
        assert words in line, (words, line)


def test_legacy_page_names_the_report_seed_and_version():
    """The Lightning 1.x page compares with the report's Lightning version and seed call."""
    r = report()
    text = (ROOT / "docs" / "legacy.md").read_text()
    assert f"`{r['seed']}`" in text and f"Lightning {r['lightning']}" in text


def test_dataparallel_page_quotes_the_report_dp_flags():
    """The DataParallel page opens with the report's third configuration, its flags as written."""
    dp_line = next(c for c in report()["commands"] if "--accelerator=dp" in c)
    first = (ROOT / "docs" / "dataparallel.md").read_text().split("\n\n")[1]
    spans = [s for s in re.findall(r"`([^`]+)`", first.replace("\n", " ")) if "--accelerator" in s]
    assert spans and all(s in dp_line for s in spans) and any("--accelerator=dp" in s for s in spans), spans
