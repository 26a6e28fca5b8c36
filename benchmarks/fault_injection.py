"""Fault injection: what a kill, a second run, a full disk, a dead rank and a changed image leave.

Counts, per case, the results lost (a file missing or empty), mixed (files of two different
sets) or left behind, and the failures not named (the last line of stderr does not say what
happened). The goal is 0 everywhere. Not part of the test suite: a few minutes on 2 cores.

Cases:

- ``kill``: ``--tries`` times, a process writes compare's result set (``results.json``, two
  figures, ``tables.md``, through ``vae_ddp.studies.compare.write_results``) and a 4 MB params
  file (``vae_ddp.outputs.replacing``) over and over, alternating two sets, and is killed with
  SIGKILL at a random moment; the folder must hold one whole set (byte for byte one of the two)
  and a params file that loads, and after the next run's lock nothing else.
- ``two-runs``: two ``vae-ddp compare`` started together into one ``--out``: one must finish, the
  other be refused in one line naming the first (exit 2); the results must be the winner's.
- ``full-disk``: ``--out`` on a 1 MB tmpfs (exit 2 before training, one line), and a tmpfs filled
  while the run trains (exit 3, one line naming the folder, no empty file). Needs root (mount);
  otherwise reported as skipped.
- ``rank-killed``: SIGKILL of rank 1, then of rank 0, of a 2-rank compare at its second step:
  the last line must name the rank and SIGKILL.
- ``changed-image``: a checked image folder, one image then overwritten with 300 bytes of
  garbage: the next run must name that image (exit 2).
- ``audit-kill``: as ``kill``, for the audit's report: a process writes ``audit.json`` and
  ``tables.md`` (``vae_ddp.audit.study.write_report``) over and over, alternating two reports, and
  is killed with SIGKILL at a random moment: one whole report must be left, never none or a mix.
- ``audit``: ``--audit_tries`` real audits (``--seed`` 1, 2, ...: each report its own) into a folder
  holding an earlier report, each ended at a random moment by SIGKILL or SIGTERM, or failing (a
  model that raises on rank 1): the folder must hold the earlier report or the new one, whole
  (``tables.md`` is the rendering of ``audit.json``); an audit that failed, or was terminated once
  it had read its command, must say the report there is the earlier one.
- ``kills``: ``--kill_tries`` per target (10: 30 in all) of an audit (``vae-ddp audit``), the pytest helper
  (``assert_ddp_matches_one_device`` in a user's test file run by pytest) and the docs runner
  (``tools/results.py`` running the ``audit_batchnorm`` entry in a clone of the repository), the small
  model, 2 steps: at a random moment, SIGKILL, SIGTERM or SIGINT to the top process, the guard or a rank.
  Each try has its own ``TMPDIR`` and a mark in its environment: the processes with the mark still alive
  20 s after the top process ended, and what is left in its ``TMPDIR``, are counted (0 and 0 wanted; for
  the pytest helper, not the inductor folder that importing Lightning in the user's own test process makes).
- every run has its own ``TMPDIR``; anything left in it afterwards is counted.

``--control`` writes the kill case's files in place, one after the other, as the studies did
before their result sets: what the benchmark counts when writes are not atomic.

    .venv/bin/python benchmarks/fault_injection.py --tries 30 --out runs/fault-injection
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
FILES = ("results.json", "curves.png", "report_style.png", "tables.md")

WRITER = r"""
import json, sys, torch
from pathlib import Path
from vae_ddp.outputs import replacing
from vae_ddp.studies.compare import write_results

def canned(tag):
    records = [{"config": "single", "label": "single", "step": s, "recon_loss": tag + s, "kl": tag * s,
                "loss": 2 * tag + s, "logged_recon_loss": tag + s, "logged_kl": tag * s, "logged_loss": tag}
               for s in range(1, 30)]
    result = {"settings": {"steps": 29}, "configs": ["single"], "records": records, "tag": tag}
    return result, [("single", records, [])], f"| tag |\n|-----|\n| {tag} |", f"made-up set {tag}"

out, mode = Path(sys.argv[1]), sys.argv[2]
(out / "runs").mkdir(parents=True, exist_ok=True)
params = lambda tag: {"tag": tag, "w": torch.full((10 ** 6,), float(tag))}
if mode == "reference":
    for tag in (1.0, 2.0):
        write_results(out / str(tag), *canned(tag))
    sys.exit(0)
if mode == "control":  # as the files were written before: in place, one after the other
    import contextlib
    import vae_ddp.outputs as outputs

    def in_place(folder):
        Path(folder).mkdir(parents=True, exist_ok=True)
        yield Path(folder)

    outputs.result_set = contextlib.contextmanager(in_place)
    outputs.replacing = replacing = contextlib.contextmanager(lambda path, needed=None: (yield path))
print("ready", flush=True)
tag = 1.0
while True:
    tag = 3.0 - tag
    write_results(out, *canned(tag))
    with replacing(out / "runs" / "params-0.pt") as tmp:
        torch.save(params(tag), tmp)
"""


def cli(*args: str, tmp: Path, **popen) -> subprocess.Popen:
    env = dict(ENV, TMPDIR=str(tmp), VAE_DDP_WATCHDOG_S="120")
    env.update(popen.pop("env", {}))
    return subprocess.Popen([sys.executable, "-m", "vae_ddp.cli", *args], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **popen)


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def case_kill(work: Path, tries: int, rng: random.Random, control: bool = False) -> dict:
    import torch

    from vae_ddp.utils import out_folder_lock

    ref = work / "reference"
    subprocess.run([sys.executable, "-c", WRITER, str(ref), "reference"], env=ENV, check=True)
    sets = {tag: {f: (ref / tag / f).read_bytes() for f in FILES} for tag in ("1.0", "2.0")}
    out = work / "kill" / "out"
    counts = {"tries": tries, "lost": 0, "mixed": 0, "params_bad": 0, "left_after_next_run": 0, "sets_seen": []}
    t0 = time.perf_counter()
    period = 4.0  # seconds of writing: kills fall across several whole sets
    for i in range(tries):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(out), "control" if control else "loop"], env=ENV,
                                stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        time.sleep(rng.uniform(0.0, period))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        files = {f: (out / f).read_bytes() if (out / f).exists() else b"" for f in FILES}
        if i == 0 and not any(files.values()):
            pass  # killed before the first set was complete: nothing was there to lose
        elif not all(files.values()):
            counts["lost"] += 1
        else:
            tags = {t for t, s in sets.items() if all(files[f] == s[f] for f in FILES)}
            counts["mixed"] += not tags
            counts["sets_seen"].append(next(iter(tags), "mixed"))
        p = out / "runs" / "params-0.pt"
        if p.exists():
            try:
                torch.load(p)
            except Exception:  # noqa: BLE001 - a truncated file
                counts["params_bad"] += 1
        with out_folder_lock(out, "fault injection: the next run"):
            pass
        extra = [x.name for x in out.parent.iterdir() if x != out] + [x.name for x in out.rglob("*vae-ddp-tmp")]
        counts["left_after_next_run"] += bool(extra)
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    counts["sets_seen"] = {t: counts["sets_seen"].count(t) for t in set(counts["sets_seen"])}
    return counts


COMPARE = ("compare", "--data", "digits", "--configs", "[single]")


def case_two_runs(work: Path, tmp: Path) -> dict:
    out = work / "two" / "out"
    a = cli(*COMPARE, "--steps", "2", "--seed", "1", "--out", str(out), tmp=tmp)
    time.sleep(0.05)
    b = cli(*COMPARE, "--steps", "3", "--seed", "2", "--out", str(out), tmp=tmp)
    (_, ea), (_, eb) = a.communicate(timeout=600), b.communicate(timeout=600)
    codes = sorted([a.returncode, b.returncode])
    refused = [e for c, e in ((a.returncode, ea), (b.returncode, eb)) if c == 2]
    named = bool(refused) and "is in use by another run" in last_line(refused[0])
    winner = 1 if a.returncode == 0 else 2
    results = out / "results.json"
    steps = json.loads(results.read_text())["settings"]["steps"] if results.exists() else None
    mixed = steps != (2 if winner == 1 else 3)
    return {"exit_codes": codes, "second_refused": codes == [0, 2], "not_named": int(not named), "mixed": int(mixed)}


def _mount(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0


def case_full_disk(work: Path, tmp: Path) -> dict:
    fs = work / "fs"
    if not _mount(fs, "1m"):
        return {"skipped": "cannot mount a tmpfs here (not root)"}
    counts: dict = {}
    try:
        p = cli(*COMPARE, "--steps", "2", "--out", str(fs / "out"), tmp=tmp)
        _, err = p.communicate(timeout=600)
        counts["before_training"] = {"exit": p.returncode, "last_line": last_line(err),
                                     "not_named": int(p.returncode != 2 or str(fs) not in last_line(err))}
    finally:
        subprocess.run(["umount", str(fs)])
    if not _mount(fs, "12m"):
        return counts
    try:
        out = fs / "out"
        p = cli(*COMPARE, "--steps", "40", "--out", str(out), tmp=tmp)
        for line in p.stdout:  # fill the disk once training has started
            if "step" in line and "/40" in line:
                with open(fs / "filler", "wb") as f:
                    try:
                        while True:
                            f.write(b"\0" * 65536)
                    except OSError:
                        pass
                break
        _, err = p.communicate(timeout=600)
        empty = [str(x) for x in out.rglob("*") if x.is_file() and x.stat().st_size == 0]
        counts["during_training"] = {"exit": p.returncode, "last_line": last_line(err), "empty_files": len(empty),
                                     "not_named": int(p.returncode != 3 or "no space left" not in last_line(err))}
    finally:
        subprocess.run(["umount", str(fs)])
    return counts


def _rank_pid(tmp: Path, rank: int) -> int | None:
    for info in tmp.glob("vae-ddp-run-*/vae-ddp-guard-*/proc-*.json"):
        try:
            d = json.loads(info.read_text())
        except (OSError, ValueError):
            continue
        if d["rank"] == rank and (info.parent / f"beat-{d['pid']}").read_text().strip() not in ("", "0", "1"):
            return d["pid"]
    return None


def case_rank_killed(work: Path, tmp: Path) -> dict:
    counts = {}
    for rank in (1, 0):
        out = work / f"rank{rank}"
        p = cli("compare", "--data", "digits", "--configs", "[ddp]", "--steps", "200", "--global_batch_size", "64",
                "--out", str(out), tmp=tmp)
        pid, deadline = None, time.monotonic() + 300
        while pid is None and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
            pid = _rank_pid(tmp, rank)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        _, err = p.communicate(timeout=600)
        line = last_line(err)
        counts[f"rank {rank}"] = {"exit": p.returncode, "last_line": line,
                                  "not_named": int(f"rank {rank} of run 'ddp' was killed by SIGKILL" not in line)}
    return counts


def case_changed_image(work: Path, tmp: Path) -> dict:
    import torch
    from torchvision.io import write_png

    imgs = work / "imgs"
    for c in ("cat", "dog"):
        (imgs / c).mkdir(parents=True, exist_ok=True)
        for i in range(40):
            write_png(torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), str(imgs / c / f"{i}.png"))
    env = {"VAE_DDP_CACHE": str(work / "cache")}
    args = ("compare", "--data", "imagefolder", "--data_dir", str(imgs), "--configs", "[single]", "--steps", "1",
            "--global_batch_size", "16")
    first = cli(*args, "--out", str(work / "img1"), tmp=tmp, env=env)
    first.communicate(timeout=600)
    changed = imgs / "dog" / "7.png"
    changed.write_bytes(os.urandom(300))
    second = cli(*args, "--out", str(work / "img2"), tmp=tmp, env=env)
    _, err = second.communicate(timeout=600)
    return {"first_exit": first.returncode, "second_exit": second.returncode, "last_line": last_line(err),
            "not_seen": int(second.returncode != 2 or str(changed) not in err)}


AUDIT_WRITER = r"""
import sys
from pathlib import Path
from vae_ddp.audit.study import write_report

out, mode = Path(sys.argv[1]), sys.argv[2]
report = lambda tag: ({"tag": tag, "rows": [tag * k for k in range(2000)]}, f"| tag |\n|-----|\n| {tag} |")
if mode == "reference":
    for tag in (1.0, 2.0):
        write_report(out / str(tag), *report(tag))
    sys.exit(0)
print("ready", flush=True)
tag = 1.0
while True:
    tag = 3.0 - tag
    write_report(out, *report(tag))
"""
REPORT = ("audit.json", "tables.md")


def case_audit_kill(work: Path, tries: int, rng: random.Random) -> dict:
    """The audit's report written over and over, killed at random: one whole report left each time."""
    ref = work / "audit-reference"
    subprocess.run([sys.executable, "-c", AUDIT_WRITER, str(ref), "reference"], env=ENV, check=True)
    sets = {tag: {f: (ref / tag / f).read_bytes() for f in REPORT} for tag in ("1.0", "2.0")}
    out = work / "audit-kill" / "out"
    counts = {"tries": tries, "lost": 0, "mixed": 0, "sets_seen": []}
    for i in range(tries):
        proc = subprocess.Popen([sys.executable, "-c", AUDIT_WRITER, str(out), "loop"], env=ENV, stdout=subprocess.PIPE,
                                text=True)
        proc.stdout.readline()
        time.sleep(rng.uniform(0.0, 2.0))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        files = {f: (out / f).read_bytes() if (out / f).exists() else b"" for f in REPORT}
        if i == 0 and not any(files.values()):
            continue  # killed before the first report was whole: nothing was there to lose
        if not all(files.values()):
            counts["lost"] += 1
            continue
        tags = [t for t, s in sets.items() if files == s]
        counts["mixed"] += not tags
        counts["sets_seen"].append(tags[0] if tags else "mixed")
    counts["sets_seen"] = {t: counts["sets_seen"].count(t) for t in set(counts["sets_seen"])}
    return counts


AUDIT = ("audit", "--data", "examples.audit_models.Regression", "--steps", "2", "--effect_batches", "0")
RAISES = """
from examples.audit_models import Plain


class RaisesOnRank1(Plain):
    def training_step(self, batch, batch_idx):
        if self.trainer.global_rank == 1 and batch_idx == 1:
            raise RuntimeError("rank 1 raised on purpose")
        return super().training_step(batch, batch_idx)
"""


def _report(out: Path) -> "dict | None":
    """The report in ``out`` when it is whole (``tables.md`` the rendering of ``audit.json``), else None."""
    from vae_ddp.audit.render import render
    from vae_ddp.audit.verdict import Verdict

    try:
        result = json.loads((out / "audit.json").read_text())
        return result if (out / "tables.md").read_text() == render(Verdict.from_dict(result)) + "\n" else None
    except (OSError, ValueError, KeyError, TypeError):  # TypeError: not every key of a Verdict
        return None


def case_audit(work: Path, tmp: Path, tries: int, rng: random.Random) -> dict:
    """Real audits into a folder with an earlier report, killed, terminated or failing: the earlier report
    or the new one, whole, each time; a failed or terminated audit says the report is the earlier one."""
    out = work / "audit" / "out"
    model = work / "raises.py"
    model.write_text(RAISES)
    t0 = time.perf_counter()
    first = cli(*AUDIT, "--model", "examples.audit_models.Plain", "--seed", "0", "--out", str(out), tmp=tmp)
    first.communicate(timeout=900)
    period = time.perf_counter() - t0  # the kills fall anywhere in an audit's time (15-25 s on 2 cores)
    earlier = _report(out)
    counts = {"tries": tries, "first_exit": first.returncode, "lost": 0, "earlier": 0, "new": 0, "not_said": 0,
              "how": []}
    for i in range(tries):
        how = ("SIGKILL", "SIGTERM", "raises")[i % 3]
        cls = f"{model}:RaisesOnRank1" if how == "raises" else "examples.audit_models.Plain"
        p = cli(*AUDIT, "--model", cls, "--seed", str(i + 1), "--out", str(out), tmp=tmp)
        if how != "raises":
            time.sleep(rng.uniform(0.0, period))
            p.send_signal(getattr(signal, how))
        printed, err = p.communicate(timeout=900)
        now = _report(out)
        left = "lost" if now is None else "earlier" if now == earlier else "new"
        counts["how"].append(f"{how}: exit {p.returncode}, {left}")
        if now is None:
            counts["lost"] += 1
        elif now == earlier:
            counts["earlier"] += 1
            # failed, or SIGTERM once its command was read (before, it cannot name the folder)
            if p.returncode in (3, 143) and "[audit] cost:" in printed and "are not this audit's" not in err:
                counts["not_said"] += 1
                counts.setdefault("not_said_lines", []).append(last_line(err))
        else:
            counts["new"] += 1
            earlier = now
    return counts


HELPER_TEST = """
from examples.audit_models import Plain, Regression
from vae_ddp.testing import assert_ddp_matches_one_device


def test_ddp():
    assert_ddp_matches_one_device(Plain, Regression, steps=2)
"""


def _marked(mark: str) -> list[int]:
    """PIDs of the live processes whose environment holds ``VAE_DDP_PROBE=mark`` (zombies aside)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"VAE_DDP_PROBE={mark}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                if " Z " not in (proc / "stat").read_text().split(")", 1)[1][:4]:
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def _victim(what: str, top: subprocess.Popen, mark: str, tmp: Path) -> "int | None":
    """The PID to signal: the top process, a guard (``vae_ddp.guard`` in its command line) or a rank (a
    process registered with a guard), among the processes of ``mark``."""
    if what == "top":
        return top.pid
    if what == "rank":
        pids = []
        for info in tmp.glob("vae-ddp-run-*/vae-ddp-guard-*/proc-*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                pids.append(json.loads(info.read_text())["pid"])
        return random.choice(pids) if pids else None
    guards = []
    for pid in _marked(mark):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"vae_ddp.guard" in argv and b"--zygote" not in argv:
                guards.append(pid)
    return random.choice(guards) if guards else None


def case_kills(work: Path, tries: int, rng: random.Random, only: tuple[str, ...] = ()) -> dict:
    """30 kills of the three ways the project starts processes: nothing may be left running or in TMPDIR."""
    clone = work / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    (work / "test_helper.py").write_text(HELPER_TEST)
    targets = {
        "audit": ([sys.executable, "-m", "vae_ddp.cli", *AUDIT, "--model", "examples.audit_models.Plain",
                   "--out", str(work / "kills-audit")], ROOT, {}),
        "pytest helper": ([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(work / "test_helper.py")], ROOT, {}),
        "docs runner": ([sys.executable, "tools/results.py", "audit_batchnorm"], clone,
                        {"PYTHONPATH": str(clone / "src") + os.pathsep + str(clone)}),
    }
    report: dict = {}
    for target, (cmd, cwd, extra) in targets.items():
        if only and target not in only:
            continue
        counts = {"tries": tries, "processes_left": 0, "tmpdir_left": 0, "how": []}
        period = None
        for i in range(tries + 1):  # the first try, not counted, measures how long a whole run takes
            mark = f"{target.replace(' ', '-')}-{i}-{os.getpid()}"
            tmp = Path(tempfile.mkdtemp(prefix="k", dir=work))
            if target == "docs runner":
                shutil.rmtree(clone / "docs" / "generated" / "audit_batchnorm", ignore_errors=True)
            env = dict(ENV, TMPDIR=str(tmp), VAE_DDP_PROBE=mark, **extra)
            t0 = time.perf_counter()
            # SIGINT at its default, as a terminal's Ctrl-C finds it (a background job of a shell starts with
            # SIGINT ignored, and its children inherit that: a SIGINT try would then measure nothing)
            top = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                   start_new_session=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            how = "none"
            if period is not None:
                time.sleep(rng.uniform(0.0, period))
                what, sig = rng.choice(["top", "guard", "rank"]), rng.choice(["SIGKILL", "SIGTERM", "SIGINT"])
                pid = _victim(what, top, mark, tmp)
                if pid is None and top.poll() is None:
                    what, pid = "top", top.pid  # none of that kind (yet): the top process
                how = f"{sig} to the {what}" + (" (none: the run had ended)" if pid is None else "")
                if pid is not None:
                    try:
                        os.kill(pid, getattr(signal, sig))
                    except ProcessLookupError:  # a rank of a run that had finished (its guard's folder remains)
                        how += " (it had already ended)"
            try:
                top.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                top.kill()
                top.communicate()
                how += ", top process hung (killed after 600 s)"
            if period is None:
                period = time.perf_counter() - t0
                counts["whole_run_exit"] = top.returncode  # 0: the target runs as it should, unkilled
                shutil.rmtree(tmp, ignore_errors=True)
                continue
            deadline = time.monotonic() + 20
            while _marked(mark) and time.monotonic() < deadline:
                time.sleep(0.5)
            left, files = _marked(mark), sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*"))
            if target == "pytest helper":  # the user's own test process imports Lightning: its inductor folder
                files = [f for f in files if not f.startswith("torchinductor_")]
            counts["processes_left"] += len(left)
            counts["tmpdir_left"] += bool(files)
            counts["how"].append(f"{how}: exit {top.returncode}" + (f", left {len(left)} processes" if left else "")
                                 + (f", left in TMPDIR {files[:4]}" if files else ""))
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(tmp, ignore_errors=True)
        counts["seconds_per_run"] = period
        report[target] = counts
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tries", type=int, default=30, help="kills during output writes (default 30)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", nargs="+", default=["kill", "two-runs", "full-disk", "rank-killed", "changed-image",
                                                  "audit-kill", "audit", "kills"])
    p.add_argument("--audit_tries", type=int, default=6, help="real audits killed, terminated or failing (default 6)")
    p.add_argument("--kill_tries", type=int, default=10, help="kills per target of the kills case (default 10)")
    p.add_argument("--kill_targets", nargs="+", default=[], choices=["audit", "pytest helper", "docs runner"],
                   help="the kills case's targets (default: all three)")
    p.add_argument("--out", type=Path, default=None, help="folder for fault_injection.json")
    p.add_argument("--control", action="store_true",
                   help="kill case only: write the files in place, one after the other, as before the result sets "
                        "(the counts the benchmark finds then)")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="fi-", dir="/tmp"))
    tmp = work / "tmp"
    tmp.mkdir()
    report: dict = {}
    try:
        for case in args.cases:
            t = time.perf_counter()
            if case == "kill":
                report[case] = case_kill(work, args.tries, random.Random(args.seed), args.control)
            elif case == "audit-kill":
                report[case] = case_audit_kill(work, args.tries, random.Random(args.seed))
            elif case == "audit":
                report[case] = case_audit(work, tmp, args.audit_tries, random.Random(args.seed))
            elif case == "kills":
                report[case] = case_kills(work, args.kill_tries, random.Random(args.seed), tuple(args.kill_targets))
            else:
                report[case] = {"two-runs": case_two_runs, "full-disk": case_full_disk, "rank-killed": case_rank_killed,
                                "changed-image": case_changed_image}[case](work, tmp)
            print(f"{case} ({time.perf_counter() - t:.0f} s): {json.dumps(report[case])}", flush=True)
        report["tmpdir_left"] = sorted(x.name for x in tmp.iterdir())
        print(f"left in TMPDIR by the runs: {report['tmpdir_left'] or 'nothing'}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "fault_injection.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
