"""Start a run, or a group of runs of one world size, in its own process tree (under a
[guard][vae_ddp.guard]: own process group, watchdog, no orphans) and collect what rank 0 wrote.

Each run is ``python -m vae_ddp.harness.runner JOB_FILE OUT_DIR``, ``JOB_FILE`` being
``OUT_DIR/job.json``, the spec's JSON (a file, not the command line: a spec is kilobytes, and a
command line is what ``ps`` shows every user); Lightning's DDP launcher then
starts the other ranks by re-running that command (on CPU the runner forks them,
[`vae_ddp.ranks`][vae_ddp.ranks]). From a process that runs one thread and has imported Lightning
(the entries of ``make results``), a CPU launch is that command run in a fork of the caller
under a guard ([`guard.run_in_fork`][vae_ddp.guard.run_in_fork]) instead of a new interpreter that
imports torch and Lightning again (seconds of CPU per launch): the same runs, bit for bit
(``tests/test_studies.py``). ``VAE_DDP_LAUNCH=exec`` always starts the interpreter. If any rank fails, Lightning ends the
whole group (rank 0 kills its children on an exception; ``_ChildProcessObserver``
SIGKILLs everyone when a child exits non-zero), so the run returns a non-zero code
instead of hanging; [`launch`][vae_ddp.harness.launch.launch] then raises [`RunFailed`][vae_ddp.harness.launch.RunFailed] with the end of the
failing process's stderr.
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
    """Several specs of one world size, trained one after the other in one process tree.

    A launch costs a few seconds before training starts (each process imports torch and
    Lightning; under DDP the launcher then starts the other ranks, which import them again),
    which is most of the time of the short runs the studies make. Lightning reuses the
    process group for the next ``fit`` of the same processes. ``specs`` are anything with
    ``to_json()``, ``label``, ``world_size`` and ``accelerator`` (a [`RunSpec`][vae_ddp.harness.configs.RunSpec]
    or the audit's runs); the group has the same attributes, so [`launch`][vae_ddp.harness.launch.launch]
    takes it in place of one spec and the child receives the JSON list of the specs.

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
    """Run groups of several world sizes, one after the other, in one launch of the study runner
    (CPU only). The runner's process imports torch and Lightning once and trains each group in
    a process forked from it (which forks the group's ranks, [`vae_ddp.ranks`][vae_ddp.ranks]):
    a launch per world size would import them again each time, about as long as the short
    runs the studies make. Each group gets the intra-op threads a launch of its own would have
    (``OMP_NUM_THREADS`` = cores // world size, unless set), so its numbers are the same; with
    ``same_threads`` every process of every group gets cores // the largest world size instead.

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
    """Run ``spec`` (already validated) in a child process tree under a guard
    ([`vae_ddp.guard`][vae_ddp.guard]); return its ``run.json``.

    The child reads the spec from ``out_dir/job.json`` ([`read_job`][vae_ddp.harness.launch.read_job]).
    Progress lines stream to this process's stdout (unless ``quiet``); stderr goes to
    ``out_dir/stderr.log``. ``entry`` replaces ``[python, -m, vae_ddp.harness.runner]`` (tests use
    it to inject a failing rank). ``stall``: seconds without progress of any rank before the
    watchdog dumps every rank's stacks into ``stderr.log`` and ends the tree (default
    ``$VAE_DDP_WATCHDOG_S`` or 300). On ``timeout``, SIGINT/SIGTERM of this process, or its
    death, every process of the run ends.

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
    """The child of a launch, for every runner (the study runner, report-scale's frozen runs, the
    audit's runs): ``argv`` = ``JOB_FILE OUT_DIR``. The job is one spec (a dict), a group of specs
    of one world size (a list: [`RunGroup`][vae_ddp.harness.launch.RunGroup]), a sequence of
    groups (``{"sequence": ...}``: [`RunSequence`][vae_ddp.harness.launch.RunSequence], each group
    in turn in a fork, [`run_sequence`][vae_ddp.harness.launch.run_sequence]) or groups at the same
    time (``{"together": {tag: specs}}``, [`run_together`][vae_ddp.harness.launch.run_together]).
    A group runs as ``train(specs, out_dir, grouped)`` in every rank, ``specs`` being ``parse``'s
    of the job's dicts and ``grouped`` whether they came as a list; on CPU the ranks are forks of
    this process ([`run_ranks`][vae_ddp.ranks.run_ranks]). Returns the exit code."""
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
    # on CPU the ranks are forks of this process (no second import of Lightning, vae_ddp.ranks)
    ranks = specs[0].world_size if specs[0].accelerator == "cpu" else 1
    return run_ranks(ranks, lambda: train(specs, out_dir, isinstance(payload, list)))


#: Set in the ranks of a ``together`` job: the pid of the first group forked beside them.
BESIDE_PID = "VAE_DDP_BESIDE_PID"


def run_together(groups: dict[str, list], out_dir: Path, train: Callable[[list, Path, bool], int]) -> int:
    """The child's side of groups trained at the same time (the audit's one-device runs beside its
    DDP runs), ``groups[tag]`` in ``OUT_DIR/tag``: the last group in the ranks of this process
    tree, each other in a process forked beside them (one device; the ranks find the first one's
    pid in ``$VAE_DDP_BESIDE_PID``); started by Lightning's launcher (GPUs) or torchrun, the groups
    beside run in the first process only. Then ``OUT_DIR/run.json`` = ``{tag: that group's
    run.json}``. Returns the ranks' exit code, or 1 when a group beside failed."""
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
        child = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if child != 0:
            print(f"the runs of '{t}' exited with code {child}", file=sys.stderr, flush=True)
            code = code or 1
    if code == 0:
        write_atomic(out_dir / "run.json", json.dumps({t: json.loads((out_dir / t / "run.json").read_text())
                                                       for t in groups}))
    return code


def run_sequence(groups: list[dict], out_dir: Path, run_group: Callable[[Any, Path], int]) -> int:
    """The child's side of a [`RunSequence`][vae_ddp.harness.launch.RunSequence]: for each
    ``{"tag", "threads", "specs"}`` in turn, ``run_group(specs, OUT_DIR/tag)`` in a process forked
    from this one, with ``threads`` intra-op threads; then ``OUT_DIR/run.json`` = ``{tag: that
    group's run.json}``. This process trains nothing itself, so it stays one that may fork (no
    thread, no process group; [`vae_ddp.ranks`][vae_ddp.ranks]). Returns the first non-zero exit
    code of a group (the groups after it do not run), else 0."""
    from vae_ddp.ranks import fork

    for g in groups:
        def one(g: dict = g) -> int:
            if g["threads"]:  # what launch() sets for a launch of this world size alone
                import torch

                os.environ["OMP_NUM_THREADS"] = str(g["threads"])
                torch.set_num_threads(g["threads"])
            return run_group(g["specs"], out_dir / g["tag"])

        pid = fork(one)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if code != 0:
            if code < 0:  # rank 0 of the group ended by a signal (a rank that failed names itself)
                print(f"vae-ddp: rank 0 (PID {pid}) {guard.how_it_ended(code, pid)}", file=sys.stderr, flush=True)
            print(f"the runs of '{g['tag']}' exited with code {code}", file=sys.stderr, flush=True)
            return code if code > 0 else 128 - code
    write_atomic(out_dir / "run.json", json.dumps({g["tag"]: json.loads((out_dir / g["tag"] / "run.json").read_text())
                                                   for g in groups}))
    return 0


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
#: The runners a launch may fork: this project's, whose callers' state the runs do not read. The
#: audit's runs (``vae_ddp.audit.run``) train the user's classes, whose modules a fork would carry
#: over as the audit's own checks left them: they start an interpreter.
_FORKED_MODULES = ("vae_ddp.harness.runner", "vae_ddp.studies.report_scale")


def _forkable(cmd: list[str], spec) -> bool:
    """Whether the launch of ``cmd`` may be a fork of this process instead of a new interpreter
    ([`guard.run_in_fork`][vae_ddp.guard.run_in_fork]): ``cmd`` is ``python -m MODULE ...`` with a
    module of ``_FORKED_MODULES``, the run is
    on CPU (on GPUs Lightning's launcher re-runs the command line for the other ranks), Lightning
    is already imported here (what the fork saves), ``$VAE_DDP_LAUNCH`` is not ``exec``, and this
    process runs one thread ([`guard.can_fork`][vae_ddp.guard.can_fork]: true in the results
    runner's entries until they compute with several threads; false in an interpreter that
    imported torch, which starts threads of its own, so a study started from a shell or a
    notebook launches as before)."""
    return (cmd[:2] == [sys.executable, "-m"] and cmd[2] in _FORKED_MODULES and spec.accelerator == "cpu"
            and "pytorch_lightning" in sys.modules and os.environ.get(_LAUNCH_ENV) != "exec" and guard.can_fork())


def launch_group(specs: list[RunSpec], out_dir: Path, timeout: Optional[float] = None, quiet: bool = False,
                 entry: Optional[list[str]] = None) -> list[dict]:
    """Train ``specs`` (one world size) in one launch of the study runner (or of ``entry``, as
    [`launch`][vae_ddp.harness.launch.launch]); return the ``run.json`` of each, in order
    (``{"spec", "runs"}``; a run's ``params`` file name is relative to ``out_dir``).

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
