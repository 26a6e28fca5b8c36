"""Start runs in a process tree of their own (under a [guard][vae_ddp.guard]) and collect what
rank 0 wrote; the child's side of that launch.

A launch writes the job (a spec's, a group's or a sequence's JSON) to ``OUT_DIR/job.json`` (a
file: a command line is what ``ps`` shows every user) and runs ``python -m
vae_ddp.harness.runner JOB_FILE OUT_DIR``, which reads it with [`run_job`][vae_ddp.harness.launch.run_job];
on CPU the runner forks the other ranks ([`vae_ddp.ranks`][vae_ddp.ranks]), on GPUs Lightning's
launcher re-runs the command. From a process that runs one thread and has imported Lightning
(the entries of ``make results``) a CPU launch is that command in a fork under a guard
([`guard.run_in_fork`][vae_ddp.guard.run_in_fork]): the same runs, bit for bit
(``tests/test_studies.py``), without importing torch and Lightning again;
``VAE_DDP_LAUNCH=exec`` always starts an interpreter. When a rank fails every rank ends, and
[`launch`][vae_ddp.harness.launch.launch] raises [`RunFailed`][vae_ddp.harness.launch.RunFailed]
with the failing process's first error.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from vae_ddp import guard
from vae_ddp.errors import RunFailed
from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.resources import check_memory, space_needed
from vae_ddp.outputs import write_atomic

__all__ = ["launch", "launch_group", "launch_by_world_size", "group_folder", "RunGroup", "RunSequence", "RunFailed",
           "JOB_FILE", "read_job", "run_job", "run_sequence", "run_together", "BESIDE_PID"]

#: The file in a launch's ``OUT_DIR`` that holds what its child runs (a spec's, a group's or a
#: sequence's ``to_json()``); the child's first argument is its path.
JOB_FILE = "job.json"

_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_][\w.]*(Error|Exception)(:|$)")
#: what a rank's watcher, the sequence runner or the guard says of a rank that ended (vae_ddp.ranks)
_RANK_LINE = re.compile(r"^vae-ddp: rank (?P<rank>\d+) \(PID \d+\) (?P<how>.*?)(: ending every rank)?$")
#: what a full file system looks like in a run's stderr
_NO_SPACE = ("No space left on device", "no space left on the file system", "unexpected pos", "file write failed")


class RunGroup:
    """Several specs of one world size, trained one after the other in one process tree (a launch
    costs seconds of imports, most of a short run's time; Lightning reuses the process group for
    the next ``fit``). ``specs`` have ``to_json()``, ``label``, ``world_size`` and ``accelerator``
    (a [`RunSpec`][vae_ddp.harness.configs.RunSpec] or the audit's runs); so has the group, which
    [`launch`][vae_ddp.harness.launch.launch] takes in place of one spec (its job: the specs' list).

    Raises:
        ValueError: no spec, or specs of different world sizes or accelerators.
    """

    def __init__(self, specs: list) -> None:
        if not specs:
            raise ValueError("a run group needs at least one spec")
        if len({(s.world_size, s.accelerator) for s in specs}) > 1:
            raise ValueError("a run group trains in one process tree: its specs need one world size and accelerator")
        self.specs = list(specs)
        self.world_size, self.accelerator = specs[0].world_size, specs[0].accelerator
        self.label = ", ".join(s.label for s in specs)

    def to_json(self) -> str:
        return json.dumps([json.loads(s.to_json()) for s in self.specs])


class RunSequence:
    """Run groups of several world sizes, one after the other, in one CPU launch: the child imports
    torch and Lightning once and trains each group in a fork of itself
    ([`run_sequence`][vae_ddp.harness.launch.run_sequence]). Each group gets the intra-op threads
    a launch of its own would have (``OMP_NUM_THREADS`` = cores // world size, unless set), so its
    numbers are the same; with ``same_threads``, cores // the largest world size for all.

    Args:
        groups: ``{tag: RunGroup}``; group ``tag`` trains in ``OUT_DIR/tag/``, in this order.
        same_threads: one intra-op thread count for every process (a comparison to the last bit:
            MKL's float32 matrix product rounds differently at another thread count; measured on
            the small VAE's ``fc_mu``, 859 of its 1024 outputs differ between 2 threads and 1).

    Raises:
        ValueError: no group, or a group that does not run on CPU.
    """

    def __init__(self, groups: dict[str, RunGroup], same_threads: bool = False) -> None:
        if not groups or any(g.accelerator != "cpu" for g in groups.values()):
            raise ValueError("a run sequence needs at least one group, each on CPU")
        self.groups = dict(groups)
        self.specs = [s for g in self.groups.values() for s in g.specs]
        self.same_threads = same_threads
        first = next(iter(self.groups.values()))
        self.world_size, self.accelerator = first.world_size, "cpu"
        self.label = ", ".join(g.label for g in self.groups.values())

    def to_json(self) -> str:
        threads = None if "OMP_NUM_THREADS" in os.environ else os.cpu_count() or 1
        widest = max(g.world_size for g in self.groups.values())
        return json.dumps({"sequence": [
            {"tag": tag, "threads": threads and max(1, threads // (widest if self.same_threads else g.world_size)),
             "specs": json.loads(g.to_json())}
            for tag, g in self.groups.items()]})


def launch(spec: "RunSpec | RunGroup", out_dir: Path, timeout: Optional[float] = None, quiet: bool = False,
           entry: Optional[list[str]] = None, stall: Optional[float] = None) -> dict:
    """Run ``spec`` (validated; or a group or sequence) in a process tree under a guard; return its
    ``run.json``. Progress lines stream to stdout (unless ``quiet``), stderr to
    ``out_dir/stderr.log``. ``entry`` replaces ``[python, -m, vae_ddp.harness.runner]``;
    ``stall``: the watchdog's limit (it dumps every rank's stacks into ``stderr.log``). On
    ``timeout``, SIGINT/SIGTERM of this process, or its death, every process of the run ends.

    Raises:
        RunFailed: non-zero exit (any rank failed: the last line names the first rank that
            ended, its exit code or signal and its step), no progress for ``stall`` seconds (the
            message names each rank and the frame it was stuck in) or ``timeout`` seconds
            exceeded.
        vae_ddp.outputs.OutOfSpace: (a ``RunFailed``) the file system of ``out_dir`` filled up.
        vae_ddp.outputs.NoSpaceForRun: (a ``UserError``, before anything starts) less free space
            in ``out_dir`` than [`space_needed`][vae_ddp.harness.resources.space_needed].
        vae_ddp.harness.resources.NotEnoughMemory: (a ``UserError``, before anything starts) the ranks' estimated memory
            ([`check_memory`][vae_ddp.harness.resources.check_memory]) is more than is available.
    """
    from vae_ddp.outputs import check_space

    out_dir = Path(out_dir)
    check_memory(spec)
    check_space(out_dir, space_needed(spec))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run.json").unlink(missing_ok=True)
    job = out_dir / JOB_FILE
    write_atomic(job, spec.to_json())
    log = out_dir / "stderr.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("LOCAL_RANK", None)
    if spec.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun: do not let N ranks x all cores threads fight over the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
    cmd = (entry or [sys.executable, "-m", "vae_ddp.harness.runner"]) + [str(job), str(out_dir)]
    with open(log, "w") as err:
        try:
            # under a guard: its own process group, a watchdog, nothing left behind (vae_ddp.guard)
            if _forkable(cmd, spec):
                with open(os.devnull, "w") as null:
                    code = guard.run_in_fork(lambda: guard.run_python(cmd[1:]), cmd[1:], env, timeout=timeout,
                                             stall=stall, stdout=null.fileno() if quiet else None, stderr=err.fileno())
            else:
                proc = guard.run(cmd, stdout=subprocess.DEVNULL if quiet else None, stderr=err, env=env,
                                 timeout=timeout, stall=stall)
                code = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not (out_dir / "run.json").exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        if code in (guard.STALLED, guard.TIMED_OUT) and lines and lines[-1].startswith("vae-ddp guard:"):
            head = f"run '{spec.label}': {lines[-1][len('vae-ddp guard: '):]}"
            raise RunFailed(f"{head}\n(every rank's stacks: {log})")
        raise _failure(spec.label, code, lines, log, out_dir)
    return json.loads((out_dir / "run.json").read_text())


def read_job(path: "str | Path") -> Any:
    """What a launch's child runs: the JSON in ``path`` (its first argument, ``OUT_DIR/job.json``)."""
    return json.loads(Path(path).read_text())


# --------------------------------------------------------------------------- the child's side
def run_job(argv: list[str], parse: Callable[[dict], Any], train: Callable[[list, Path, bool], int]) -> int:
    """The child of every launch (the study runner, report-scale's frozen runs, the audit's runs):
    ``argv`` = ``JOB_FILE OUT_DIR``. The job is one spec (a dict), a group of one world size (a
    list, [`RunGroup`][vae_ddp.harness.launch.RunGroup]), a sequence of groups
    ([`run_sequence`][vae_ddp.harness.launch.run_sequence]) or groups at the same time
    ([`run_together`][vae_ddp.harness.launch.run_together]). A group runs as ``train(specs,
    out_dir, grouped)`` in every rank (``specs``: ``parse`` of the job's dicts; ``grouped``: they
    came as a list); on CPU the ranks are forks of this process ([`run_ranks`][vae_ddp.ranks.run_ranks]).
    Returns the exit code."""
    return _run_payload(read_job(argv[0]), Path(argv[1]), parse, train)


def _run_payload(payload: Any, out_dir: Path, parse: Callable[[dict], Any],
                 train: Callable[[list, Path, bool], int]) -> int:
    from vae_ddp.ranks import run_ranks

    if isinstance(payload, dict) and "sequence" in payload:
        return run_sequence(payload["sequence"], out_dir, lambda p, out: _run_payload(p, out, parse, train))
    if isinstance(payload, dict) and "together" in payload:
        return run_together({tag: [parse(p) for p in group] for tag, group in payload["together"].items()},
                            out_dir, train)
    specs = [parse(p) for p in payload] if isinstance(payload, list) else [parse(payload)]
    ranks = specs[0].world_size if specs[0].accelerator == "cpu" else 1
    return run_ranks(ranks, lambda: train(specs, out_dir, isinstance(payload, list)))


#: Set in the ranks of a ``together`` job: the pid of the first group forked beside them.
BESIDE_PID = "VAE_DDP_BESIDE_PID"


def run_together(groups: dict[str, list], out_dir: Path, train: Callable[[list, Path, bool], int]) -> int:
    """Groups trained at the same time (the audit's one-device runs beside its DDP runs),
    ``groups[tag]`` in ``OUT_DIR/tag``: the last in the ranks of this process tree, each other in a
    fork beside them (the ranks find the first one's pid in ``$VAE_DDP_BESIDE_PID``; under
    Lightning's launcher or torchrun, beside the first process only). Then ``OUT_DIR/run.json`` =
    ``{tag: that group's run.json}``. Returns the ranks' exit code, or 1 when a group beside failed."""
    from vae_ddp.ranks import fork, run_ranks

    *beside, (tag, last) = groups.items()
    children = {} if "LOCAL_RANK" in os.environ else {
        fork(lambda rs=rs, t=t: train(rs, out_dir / t, True)): t for t, rs in beside}
    if children:
        os.environ[BESIDE_PID] = str(next(iter(children)))
    ranks = last[0].world_size if last[0].accelerator == "cpu" else 1
    code = run_ranks(ranks, lambda: train(last, out_dir / tag, True))
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return code
    for pid, t in children.items():
        if _ended(pid, t):
            code = code or 1
    if code == 0:
        _collect(out_dir, list(groups))
    return code


def run_sequence(groups: list[dict], out_dir: Path, run_group: Callable[[Any, Path], int]) -> int:
    """The child's side of a [`RunSequence`][vae_ddp.harness.launch.RunSequence]: for each
    ``{"tag", "threads", "specs"}`` in turn, ``run_group(specs, OUT_DIR/tag)`` in a fork with
    ``threads`` intra-op threads (this process trains nothing: it stays one that may fork); then
    ``OUT_DIR/run.json`` = ``{tag: that group's run.json}``. Returns the first non-zero exit code
    of a group (the groups after it do not run), else 0."""
    from vae_ddp.ranks import fork

    for g in groups:
        def one(g: dict = g) -> int:
            if g["threads"]:  # what launch() sets for a launch of this world size alone
                import torch

                os.environ["OMP_NUM_THREADS"] = str(g["threads"])
                torch.set_num_threads(g["threads"])
            return run_group(g["specs"], out_dir / g["tag"])

        code = _ended(fork(one), g["tag"])
        if code != 0:
            return code if code > 0 else 128 - code
    _collect(out_dir, [g["tag"] for g in groups])
    return 0


def _ended(pid: int, tag: str) -> int:
    """The exit code of the fork ``pid`` that trained group ``tag``, once it ended; named on
    stderr when not 0 (rank 0 and its signal when one ended it: a rank that failed names itself)."""
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if code < 0:
        print(f"vae-ddp: rank 0 (PID {pid}) {guard.how_it_ended(code, pid)}", file=sys.stderr, flush=True)
    if code != 0:
        print(f"the runs of '{tag}' exited with code {code}", file=sys.stderr, flush=True)
    return code


def _collect(out_dir: Path, tags: list[str]) -> None:
    """``OUT_DIR/run.json`` = ``{tag: OUT_DIR/tag/run.json}``."""
    write_atomic(out_dir / "run.json", json.dumps({t: json.loads((out_dir / t / "run.json").read_text()) for t in tags}))


def _failure(label: str, code: Optional[int], lines: list[str], log: Path, out_dir: Path) -> RunFailed:
    """The error of a failed run: its first error line (the rank that failed first; the others
    follow from it), the log's path, and last the rank that ended first and how (its exit code
    or signal, and its step); [`OutOfSpace`][vae_ddp.outputs.OutOfSpace] naming the folder when
    the file system filled up."""
    from vae_ddp.outputs import OutOfSpace, _free

    if any(s in ln for ln in lines for s in _NO_SPACE) or _free(out_dir) < 2 ** 20:
        return OutOfSpace(out_dir)
    first = next((ln for ln in lines if _ERROR_LINE.match(ln)), None)
    rank = next((m for m in map(_RANK_LINE.match, lines) if m), None)
    what = "timed out" if code is None else f"exited with code {code}"
    text = f"run '{label}' {what}" + (f"; first error: {first}" if first else "")
    text += f"\n(full stderr of all ranks: {log})"
    if rank:
        text += f"\nrank {rank['rank']} of run '{label}' {rank['how']}"
    return RunFailed(text)


#: ``VAE_DDP_LAUNCH=exec``: every launch starts a new interpreter (``_forkable`` never holds).
_LAUNCH_ENV = "VAE_DDP_LAUNCH"
#: The runners a launch may fork: this project's. The audit's runs train the user's classes,
#: whose modules a fork would carry over as the audit's checks left them: they start an interpreter.
_FORKED_MODULES = ("vae_ddp.harness.runner", "vae_ddp.studies.report_scale")


def _forkable(cmd: list[str], spec) -> bool:
    """Whether the launch of ``cmd`` may be a fork of this process: ``python -m`` one of
    ``_FORKED_MODULES``, on CPU (on GPUs Lightning's launcher re-runs the command line), Lightning
    imported here (what the fork saves), ``$VAE_DDP_LAUNCH`` not ``exec``, and one thread runs
    ([`guard.can_fork`][vae_ddp.guard.can_fork]; false in an interpreter whose torch computed, so a
    study started from a shell or a notebook starts an interpreter)."""
    return (cmd[:2] == [sys.executable, "-m"] and cmd[2] in _FORKED_MODULES and spec.accelerator == "cpu"
            and "pytorch_lightning" in sys.modules and os.environ.get(_LAUNCH_ENV) != "exec" and guard.can_fork())


def launch_group(specs: list[RunSpec], out_dir: Path, timeout: Optional[float] = None, quiet: bool = False,
                 entry: Optional[list[str]] = None) -> list[dict]:
    """Train ``specs`` (one world size) in one [`launch`][vae_ddp.harness.launch.launch]; return
    each one's ``{"spec", "runs"}``, in order (a run's ``params`` file is relative to ``out_dir``).

    Raises:
        RunFailed: as [`launch`][vae_ddp.harness.launch.launch].
        ValueError: specs of different world sizes.
    """
    return launch(RunGroup(specs), out_dir, timeout=timeout, quiet=quiet, entry=entry)["group"]


def group_folder(world_size: int, accelerator: str) -> str:
    """The folder of ``launch_by_world_size``'s group of one world size: ``1-process``,
    ``2-processes``, ``2-processes-gpu``."""
    return f"{world_size}-process{'es' if world_size > 1 else ''}{'' if accelerator == 'cpu' else '-' + accelerator}"


def launch_by_world_size(specs: list[RunSpec], out_dir: Path, timeout: Optional[float] = None,
                         quiet: bool = False, same_threads: bool = False,
                         entry: Optional[list[str]] = None) -> list[tuple[dict, Path]]:
    """Train ``specs`` in groups of one world size (a [`RunGroup`][vae_ddp.harness.launch.RunGroup]
    each, in the order the world sizes first appear) under ``out_dir/<N>-process/``
    ([`group_folder`][vae_ddp.harness.launch.group_folder]): on CPU all groups in one launch (a
    [`RunSequence`][vae_ddp.harness.launch.RunSequence], ``same_threads`` passed to it), else one
    launch per group. ``entry``: the child's command instead of the study runner's, as
    [`launch`][vae_ddp.harness.launch.launch] (it writes each group's ``{"group": [one result
    per spec]}``).

    Returns:
        for each spec, in the order given: its ``{"spec", "runs"}`` (an ``entry``'s result) and
        the folder its runs' ``params`` file names are relative to.
    """
    groups: dict[tuple[int, str], list[int]] = {}
    for i, spec in enumerate(specs):
        groups.setdefault((spec.world_size, spec.accelerator), []).append(i)
    tags = {key: group_folder(*key) for key in groups}
    found: list[Optional[tuple[dict, Path]]] = [None] * len(specs)
    if all(accelerator == "cpu" for _, accelerator in groups):
        sequence = RunSequence({tags[key]: RunGroup([specs[i] for i in idx]) for key, idx in groups.items()},
                               same_threads=same_threads)
        launched = launch(sequence, Path(out_dir), timeout=timeout, quiet=quiet, entry=entry)
        for key, idx in groups.items():
            for i, result in zip(idx, launched[tags[key]]["group"]):
                found[i] = (result, Path(out_dir) / tags[key])
        return found  # type: ignore[return-value]
    for key, idx in groups.items():
        where = Path(out_dir) / tags[key]
        for i, result in zip(idx, launch_group([specs[i] for i in idx], where, timeout=timeout, quiet=quiet, entry=entry)):
            found[i] = (result, where)
    return found  # type: ignore[return-value]
