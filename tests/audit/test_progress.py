"""What the audit says while it trains goes to stderr, a line per run done (#62: the plan's 25 lines came at
once at the start, then nothing until the report); stdout is the report, which opens with its verdict."""

import json
import re
import time
from types import SimpleNamespace

import pytest
from helpers import ROOT

pytestmark = pytest.mark.timeout(300)

DONE = re.compile(r"^\[audit\] (\d+) of (\d+) runs done, (\d+) s: (\S+) \((one device|2 DDP ranks)\)$")


def test_a_line_per_run_done_counts_the_runs_planned_so_far(tmp_path, capsys):
    from vae_ddp.audit.measure import POLL_S, watch
    from vae_ddp.audit.spec import PROGRESS_FILE

    plan = SimpleNamespace(one_device=[None] * 3, ddp=[None] * 4, base=SimpleNamespace(devices=2))
    one, ddp = tmp_path / "one-device", tmp_path / "ddp"
    one.mkdir()
    ddp.mkdir()
    (one / PROGRESS_FILE).write_text(json.dumps({"done": ["earlier"], "to_come": 0}))  # an earlier audit's
    lines, out = [], ""

    def said_lines(n: int) -> None:  # poll the watcher's output until it said n lines (or 60 s passed)
        nonlocal out
        deadline = time.monotonic() + 60
        while len(lines) < n and time.monotonic() < deadline:
            got = capsys.readouterr()
            out, _ = out + got.out, lines.extend(got.err.splitlines())
            time.sleep(POLL_S / 10)

    with watch(plan, tmp_path, time.monotonic()):
        (one / PROGRESS_FILE).write_text(json.dumps({"done": ["single"], "to_come": 2}))
        said_lines(1)
        (ddp / PROGRESS_FILE).write_text(json.dumps({"done": ["ddp"], "to_come": 3}))
        said_lines(2)
        (ddp / PROGRESS_FILE).write_text(json.dumps({"done": ["ddp", "ddp+fixed"], "to_come": 0}))  # decided: fewer
    got = capsys.readouterr()
    out, _ = out + got.out, lines.extend(got.err.splitlines())
    said = [DONE.match(ln).groups() for ln in lines]
    assert [(k, n, label, where) for k, n, _, label, where in said] == [
        ("1", "7", "single", "one device"), ("2", "7", "ddp", "2 DDP ranks"), ("3", "5", "ddp+fixed", "2 DDP ranks")]
    assert out == ""


def test_the_runs_to_come_are_those_still_planned_as_known_so_far(tmp_path):
    from vae_ddp.audit.run import _say_progress
    from vae_ddp.audit.spec import LEFT, PROGRESS_FILE, SEEN_FILE

    def run(label, *if_seen):
        return SimpleNamespace(label=label, if_seen=list(if_seen))

    later = [run("a"), run("b", "batchnorm"), run("c", LEFT), run("d")]
    out = tmp_path / "one-device"
    out.mkdir()

    def to_come(**kwargs):
        _say_progress(out, ["single"], later, **kwargs)
        return json.loads((out / PROGRESS_FILE).read_text())["to_come"]

    assert to_come(same={"d": "a"}, decided=None, left_checked=False) == 3  # undecided: planned
    assert to_come(same={}, decided={"sampler"}, left_checked=False) == 3  # b not seen; c waits on its check
    assert to_come(same={}, decided={"sampler"}, left_checked=True) == 2
    (tmp_path / SEEN_FILE).write_text(json.dumps({"seen": ["batchnorm"], "idle": []}))  # the DDP runs decided
    assert to_come(same={}, decided=None, left_checked=True) == 3


def test_stdout_is_the_report_opening_with_its_verdict_and_stderr_says_each_run_done(tmp_path):
    from vae_ddp.cli import main_captured

    out = tmp_path / "audit"
    code, stdout, stderr = main_captured(["audit", "--model", "examples/audit_models.py:Plain", "--data",
                                          "examples/audit_models.py:Regression", "--steps", "2", "--effect_batches",
                                          "0", "--out", str(out)], cwd=ROOT)
    assert code == 0, (stdout + stderr)[-3000:]
    assert stdout.startswith("exit 0: DDP trains one device's model as you run it: "), stdout[:500]
    assert "[audit]" not in stdout and stdout == (out / "tables.md").read_text(), stdout[:500]
    result = json.loads((out / "audit.json").read_text())
    said = [m.groups() for m in map(DONE.match, stderr.splitlines()) if m]
    assert [int(k) for k, *_ in said] == list(range(1, len(result["runs"]) + 1)), stderr[-3000:]
    assert sorted(label for *_, label, _ in said) == sorted(result["runs"])
    assert [int(s) for _, _, s, _, _ in said] == sorted(int(s) for _, _, s, _, _ in said)  # seconds so far
    assert int(said[-1][1]) >= len(result["runs"]) and "[audit] cost: " in stderr
