"""Start runs in a process tree of their own (under a [guard][vae_ddp.guard]) and collect what
rank 0 wrote ([`launch`][vae_ddp.harness.launch.launch]); the child's side of that launch
([`run_job`][vae_ddp.harness.launch.run_job]). On CPU the child forks the other ranks
([`vae_ddp.ranks`][vae_ddp.ranks]); on GPUs Lightning's launcher re-runs the command.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from vae_ddp import beats, forking, guard, zygote
from vae_ddp.errors import RunFailed
from vae_ddp.harness.resources import check_memory, space_needed
from vae_ddp.outputs import write_atomic
from vae_ddp.ranks import fork, run_ranks

__all__ = ["launch", "launch_by_world_size", "group_folder", "Job", "RunFailed",
           "JOB_FILE", "run_job", "say_run", "BESIDE_PID"]

#: The file in a launch's ``OUT_DIR`` that holds its job's ``to_json()`` (a file: a command line
#: is what ``ps`` shows every user); the child's first argument is its path.
JOB_FILE = "job.json"
#: The one child entry point of every launch: ``python -m vae_ddp.harness TRAIN JOB_FILE OUT_DIR``.
CHILD = "vae_ddp.harness"
#: What a launch trains by default: the study runner's groups of ``RunSpec``s.
RUNNER = "vae_ddp.harness.runner:train_specs"

_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_][\w.]*(Error|Exception)(:|$)")
#: the ``[rankN]: `` torch puts in front of each line a rank writes
_RANK_PREFIX = re.compile(r"^\[rank\d+\]: ")
#: what a rank's watcher, the job's child or the guard says of a rank that ended (vae_ddp.ranks)
_RANK_LINE = re.compile(r"^vae-ddp: rank (?P<rank>\d+) \(PID (?P<pid>\d+)\) (?P<how>.*?)(: ending every rank)?$")
#: what a process of a launch says when it starts a run, and when a run fails in it (say_run)
_STARTS = re.compile(r"^vae-ddp: PID (?P<pid>\d+) starts run '(?P<label>[^']*)'$")
_FAILED = re.compile(r"^vae-ddp: run '(?P<label>[^']*)' failed in PID (?P<pid>\d+)( \((?P<role>[^)]*)\))?$")
#: what a full file system looks like in a run's stderr
_NO_SPACE = ("No space left on device", "no space left on the file system", "unexpected pos", "file write failed")


class Job:
    """What one launch trains: groups of specs (each with ``to_json()``, ``label``, ``world_size``
    and ``accelerator``: a [`RunSpec`][vae_ddp.harness.configs.RunSpec] or the audit's runs), each
    group of one world size and accelerator, trained in ``OUT_DIR/tag/``; then ``OUT_DIR/run.json``
    = ``{tag: that group's run.json}`` ([`run_job`][vae_ddp.harness.launch.run_job]).

    Args:
        groups: ``{tag: specs}``, trained in this order (several: on CPU only, each in a fork of
            the launch's child, which imports torch and Lightning once, with the intra-op threads
            a launch of its world size alone would have: cores // world size unless
            ``OMP_NUM_THREADS`` is set); within a group the specs train one after the other in
            one process tree (Lightning reuses the process group for the next ``fit``).
        together: the groups at the same time: the last in the launch's ranks, each other in a
            fork beside them (the audit's one-device runs beside its DDP runs).
        same_threads: one intra-op thread count for every group, cores // the largest world size
            (a comparison to the last bit: MKL's float32 matrix product rounds differently at
            another thread count; measured on the small VAE's ``fc_mu``, 859 of its 1024 outputs
            differ between 2 threads and 1).

    Raises:
        ValueError: no group, an empty one, a group of several world sizes or accelerators, or
            several groups in turn not on CPU.
    """

    def __init__(self, groups: dict[str, list], together: bool = False, same_threads: bool = False) -> None:
        if not groups or not all(groups.values()):
            raise ValueError("a job needs at least one group, each with at least one spec")
        if any(len({(s.world_size, s.accelerator) for s in g}) > 1 for g in groups.values()):
            raise ValueError("a group trains in one process tree: its specs need one world size and accelerator")
        self.groups, self.together, self.same_threads = dict(groups), together, same_threads
        self.specs = [s for g in self.groups.values() for s in g]
        if len(groups) > 1 and not together and any(s.accelerator != "cpu" for s in self.specs):
            raise ValueError("groups in turn run on CPU only (on GPUs: one launch per group)")
        last = list(self.groups.values())[-1 if together else 0][0]
        self.world_size, self.accelerator = last.world_size, last.accelerator
        self.label = ", ".join(s.label for s in self.specs)

    def to_json(self) -> str:
        cores = None if "OMP_NUM_THREADS" in os.environ else os.cpu_count() or 1
        widest = max(s.world_size for s in self.specs)
        kind = type(self.specs[0])  # what the child makes of the specs' dicts
        return json.dumps({"together": self.together, "spec": f"{kind.__module__}:{kind.__qualname__}", "groups": [
            {"tag": tag, "specs": [json.loads(s.to_json()) for s in specs],
             "threads": cores and max(1, cores // (widest if self.same_threads else specs[0].world_size))}
            for tag, specs in self.groups.items()]})


def launch(spec: Job, out_dir: Path, timeout: Optional[float] = None, quiet: bool = False,
           entry: Optional[list[str]] = None, stall: Optional[float] = None, train: str = RUNNER,
           extra_env: Optional[dict] = None) -> dict:
    """Run the job ``spec`` (its specs validated) in a process tree under a guard; return its
    ``run.json``. Progress lines stream to stdout (unless ``quiet``), stderr to
    ``out_dir/stderr.log``. The child is ``python -m vae_ddp.harness TRAIN JOB_FILE OUT_DIR``
    ([`run_job`][vae_ddp.harness.launch.run_job]), ``train`` (``"module:function"``) what trains
    a group's specs: the study runner's ``RUNNER`` by default; ``entry`` replaces
    ``[python, -m, vae_ddp.harness, TRAIN]`` (a test's script); ``stall``: the watchdog's limit;
    ``extra_env``: entries the child's environment adds to this process's.
    On ``timeout``, SIGINT/SIGTERM of this process, or its death, every process of the run ends.
    From a process that runs one thread and has imported Lightning (the entries of ``make
    results``) the child is a fork of this one (``guard.run(how="fork")``; the same runs bit for
    bit, ``tests/studies/test_studies.py``); ``VAE_DDP_LAUNCH=exec`` always starts an interpreter.

    Raises:
        TypeError: ``spec`` is not a [`Job`][vae_ddp.harness.launch.Job] (one spec:
            [`launch_by_world_size`][vae_ddp.harness.launch.launch_by_world_size]).
        RunFailed: any rank failed (with its first error; the last line names the first rank
            that ended, its exit code or signal and its step), no progress for ``stall`` seconds
            (naming each rank and the frame it was stuck in) or ``timeout`` seconds exceeded.
        vae_ddp.outputs.OutOfSpace: (a ``RunFailed``) the file system of ``out_dir`` filled up.
        vae_ddp.outputs.NoSpaceForRun: (a ``UserError``, before anything starts) less free space
            in ``out_dir`` than [`space_needed`][vae_ddp.harness.resources.space_needed].
        vae_ddp.errors.UserError: (before anything starts) ``out_dir`` or a group's folder in it is a
            link or another user's folder ([`own_folder`][vae_ddp.outputs.own_folder]).
        vae_ddp.harness.resources.NotEnoughMemory: (a ``UserError``, before anything starts) the ranks' estimated memory
            ([`check_memory`][vae_ddp.harness.resources.check_memory]) is more than is available.
    """
    from vae_ddp.outputs import check_space, own_folder

    if not isinstance(spec, Job):
        raise TypeError(f"launch() runs a Job, got {type(spec).__name__} (one spec: launch_by_world_size([spec], ...))")
    out_dir = Path(out_dir)
    for folder in (out_dir, *(out_dir / tag for tag in spec.groups)):
        own_folder(folder)
    check_memory(spec)
    check_space(out_dir, space_needed(spec))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "run.json").unlink(missing_ok=True)
    job = out_dir / JOB_FILE
    write_atomic(job, spec.to_json())
    log = out_dir / "stderr.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(extra_env or {}))
    env.pop("LOCAL_RANK", None)
    if spec.accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # like torchrun: do not let N ranks x all cores threads fight over the cores
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.world_size))
    cmd = (entry or [sys.executable, "-m", CHILD, train]) + [str(job), str(out_dir)]
    log.unlink(missing_ok=True)  # a new file of this run's (O_EXCL): never a link or file someone else put there
    with os.fdopen(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w") as err:
        try:  # under a guard: its own process group, a watchdog, nothing left behind (vae_ddp.guard)
            code = guard.run(cmd, timeout=timeout, stall=stall, how=_how(cmd, spec), env=env, stderr=err,
                             stdout=subprocess.DEVNULL if quiet else None).returncode
        except subprocess.TimeoutExpired:
            code = None
    if code != 0 or not (out_dir / "run.json").exists():
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        if code in (guard.STALLED, guard.TIMED_OUT) and lines and lines[-1].startswith("vae-ddp guard:"):
            stopped = re.search(r"\(PID (\d+)\) is stopped", lines[-1])
            which = _which_run(spec.label, lines, stopped and stopped[1])
            head = f"run '{which}': {lines[-1][len('vae-ddp guard: '):]}"
            raise RunFailed(f"{head}\n(every rank's stacks: {log})")
        raise _failure(spec.label, code, lines, log, out_dir)
    return json.loads((out_dir / "run.json").read_text())


# --------------------------------------------------------------------------- the child's side
def say_run(label: str, failed: bool = False, world_size: Optional[int] = None) -> None:
    """On stderr, in a launch's process: ``vae-ddp: PID P starts run 'LABEL'``, or with ``failed``
    ``vae-ddp: run 'LABEL' failed in PID P (ROLE)``: the lines by which [`launch`][vae_ddp.harness.launch.launch]
    names the run that failed (not the job's every label) and the process that failed first. ``ROLE``:
    ``rank N`` (``$RANK``, else ``$LOCAL_RANK``, else 0) in a run of ``world_size`` > 1, ``one device`` in a run
    of one process; ``world_size`` None: ``rank N`` where either variable is set. Raises nothing."""
    if failed:
        rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK"))
        ddp = rank is not None if world_size is None else world_size > 1
        text = f"run '{label}' failed in PID {os.getpid()} ({f'rank {rank or 0}' if ddp else 'one device'})"
    else:
        text = f"PID {os.getpid()} starts run '{label}'"
    beats.say(f"vae-ddp: {text}")


#: Set in the ranks of a ``together`` job: the pid of the first group forked beside them.
BESIDE_PID = "VAE_DDP_BESIDE_PID"


def _named(name: str) -> Any:
    """What ``"module:qualified.name"`` names (imported)."""
    import importlib

    module, _, qualname = name.partition(":")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def run_job(argv: list[str]) -> int:
    """The child of every launch (``python -m vae_ddp.harness``: the study runner, report-scale's
    frozen runs, the audit's runs): ``argv`` = ``TRAIN JOB_FILE OUT_DIR``, ``TRAIN`` a
    ``"module:function"``. Each group runs as ``function(specs, OUT_DIR/tag)`` in every
    rank of its process tree (``specs``: the job's spec class of its dicts; on CPU the ranks are forks,
    [`run_ranks`][vae_ddp.ranks.run_ranks]); rank 0 writes its ``run.json``. Several groups in
    turn: each in a fork of this process; together: the last in the ranks here, each other in a
    fork beside them (the ranks find the first one's pid in ``$VAE_DDP_BESIDE_PID``; under
    Lightning's launcher or torchrun, beside the first process only). Returns the first non-zero
    exit code of a group (in turn, the groups after it do not run), else 0. What exists when it
    starts is never collected again (``gc.freeze``): it is a launched process's entry point, not a
    function for a long-lived one (a notebook's kernel would keep its garbage)."""
    # what the imports made, out of every later collection (Python's gc.freeze: what the runs make is
    # still collected): a third of a 3-step audit's time, a tenth of a reduced ablation study's launch
    gc.freeze()
    train = _named(argv[0])
    job = json.loads(Path(argv[1]).read_text())
    out_dir = Path(argv[2])
    parse = _named(job["spec"])
    groups = [(g["tag"], g["threads"], [parse(**d) for d in g["specs"]]) for g in job["groups"]]

    def ranks(tag: str, specs: list) -> int:
        if specs[0].world_size == 1:  # named so by the guard's messages (not "rank 0")
            os.environ[beats.ROLE] = "one device's process"
        return run_ranks(specs[0].world_size if specs[0].accelerator == "cpu" else 1,
                         lambda: train(specs, out_dir / tag))

    def train_beside(tag: str, specs: list) -> Any:
        os.environ[beats.ROLE] = "one device's process"
        return train(specs, out_dir / tag)

    def alone(tag: str, threads: Optional[int], specs: list) -> int:
        if threads:  # what launch() sets for a launch of this world size alone
            import torch

            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        return ranks(tag, specs)

    code = 0
    if job["together"]:
        *beside, (tag, _, last) = groups
        children = {} if "LOCAL_RANK" in os.environ else {fork(lambda t=t, s=s: train_beside(t, s)): t
                                                           for t, _, s in beside}
        if children:
            os.environ[BESIDE_PID] = str(next(iter(children)))
        code = ranks(tag, last)
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return code
        failed = [t for pid, t in children.items() if _ended(pid, t)]  # every fork beside waited for
        code = code or int(bool(failed))
    elif len(groups) == 1:
        code = ranks(groups[0][0], groups[0][2])
    else:
        for g in groups:
            code = _ended(fork(lambda g=g: alone(*g)), g[0])
            if code:
                code = code if code > 0 else 128 - code
                break
    if code == 0 and os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        write_atomic(out_dir / "run.json", json.dumps(
            {t: json.loads((out_dir / t / "run.json").read_text()) for t, _, _ in groups}))
    return code


def _ended(pid: int, tag: str) -> int:
    """The exit code of the fork ``pid`` that trained group ``tag``, once it ended; not 0: said on
    stderr (with rank 0's signal, if one ended it: a rank that failed names itself)."""
    code = forking.wait(pid)
    if code < 0:
        beats.say(f"vae-ddp: rank 0 (PID {pid}) {beats.how_it_ended(code, pid)}")
    if code != 0:
        beats.say(f"the runs of '{tag}' exited with code {code}")
    return code


def _failure(label: str, code: Optional[int], lines: list[str], log: Path, out_dir: Path) -> RunFailed:
    """The error of a failed run: its first error line (the rank that failed first; for an error a
    DataLoader worker raised, with the worker's own error line), the log's path, and last the rank
    that ended first and how; [`OutOfSpace`][vae_ddp.outputs.OutOfSpace]
    when the file system filled up."""
    from vae_ddp.outputs import OutOfSpace, _free

    if any(s in ln for ln in lines for s in _NO_SPACE) or _free(out_dir) < 2 ** 20:
        return OutOfSpace(out_dir)
    at = next((i for i, ln in enumerate(lines) if _ERROR_LINE.match(ln)), None)
    first = None if at is None else lines[at]
    if first is not None and "in DataLoader worker process" in first:
        # torch re-raises a worker's error as "Caught X in DataLoader worker process N." with the
        # worker's own traceback below it: its last line is what went wrong (the dataset's words)
        own = next((ln for ln in lines[at + 1:] if _ERROR_LINE.match(ln)), None)
        if own is not None:
            first = f"{first.rstrip('.')}: {_RANK_PREFIX.sub('', own)}"
    rank = next((m for m in map(_RANK_LINE.match, lines) if m), None)
    label = _which_run(label, lines, rank["pid"] if rank else None)
    if code is not None and code < 0 and not rank:  # the guard itself ended by a signal (it returns 128 + N)
        return RunFailed(f"run '{label}': its guard, the process that watches its ranks, "
                         f"{beats.how_it_ended(code)}; its ranks ended with it"
                         + (f"; first error: {first}" if first else "") + f"\n(full stderr of all ranks: {log})"
                         + f"\nthe guard of run '{label}' {beats.how_it_ended(code)}")
    # the launch's own exit code (137: rank 0 ended by its watcher) is not the rank's: the last line says that
    what = "timed out" if code is None else "failed" if rank else f"exited with code {code}"
    text = f"run '{label}' {what}" + (f"; first error: {first}" if first else "")
    text += f"\n(full stderr of all ranks: {log})"
    first_failed = _failed_first(lines, rank)
    if first_failed:
        text += f"\n{first_failed}"
    elif rank:
        text += f"\nrank {rank['rank']} of run '{_run_of(rank['pid'], lines, label)}' {rank['how']}"
    elif code == 0:  # the launch ended without a word and without its results
        text += (f"\nrank 0 of run '{label}' exited with code 0 before the runs ended (sys.exit or os._exit in the "
                 "training code?)")
    return RunFailed(text)


def _failed_first(lines: list[str], rank: Optional[re.Match]) -> Optional[str]:
    """The last line when a process raised before the rank that ended (``rank``, the first that the ranks'
    watcher named) exited: the one-device runs beside the ranks, or another rank. A process that raises
    says so at once (``say_run``), while the watcher names a rank once it exited: the first ``failed in``
    line is the first failure in time, unless the rank was killed or left with code 0 (it said nothing then).
    None: ``rank``'s own line is the last (or there is no rank's line)."""
    first = next((m for m in map(_FAILED.match, lines) if m), None)
    if not (rank and first and first["role"]) or first["pid"] == rank["pid"] or not _raised(rank["how"]):
        return None
    who = "one device's process" if first["role"] == "one device" else first["role"]
    return (f"{who} (PID {first['pid']}) failed first, in run '{first['label']}'; then rank {rank['rank']} of run "
            f"'{_run_of(rank['pid'], lines, first['label'])}' {rank['how']}")


def _run_of(pid: str, lines: list[str], default: str) -> str:
    """The run process ``pid`` started last (what it was training when it ended), else ``default``."""
    return next((m["label"] for m in map(_STARTS.match, reversed(lines)) if m and m["pid"] == pid), default)


def _raised(how: str) -> bool:
    """Whether a rank that ended ``how`` (``exited with code 1 after step 3``) left with a failure's code."""
    return how.startswith("exited with code ") and not how.startswith("exited with code 0")


def _which_run(label: str, lines: list[str], pid: Optional[str] = None) -> str:
    """The run a failure belongs to, from the launch's log: the first run that says it failed; else
    the run process ``pid`` (the rank that ended) was training; else, after a stall, the runs its
    processes were training; else ``label``, the job's."""
    failed = next((m["label"] for m in map(_FAILED.match, lines) if m), None)
    if failed is not None:
        return failed
    started = {m["pid"]: m["label"] for m in map(_STARTS.match, lines) if m}  # each process's last run
    if pid is not None and pid in started:
        return started[pid]
    if pid is None and started:
        return ", ".join(dict.fromkeys(started.values()))
    return label


#: ``VAE_DDP_LAUNCH=exec``: every launch starts a new interpreter (``_forkable`` never holds).
_LAUNCH_ENV = "VAE_DDP_LAUNCH"
#: The runners a launch may fork: this project's. The audit's runs train the user's classes,
#: whose modules a fork would carry over as the audit's checks left them: a zygote's fork runs them.
_FORKED_MODULES = ("vae_ddp.harness.runner", "vae_ddp.studies.report_scale.runs")


def _forkable(cmd: list[str], spec) -> bool:
    """Whether the launch of ``cmd`` may be a fork of this process: ``python -m vae_ddp.harness
    TRAIN ...`` with ``TRAIN`` of one of ``_FORKED_MODULES``, on CPU (on GPUs Lightning's launcher
    re-runs the command line), Lightning imported here (what the fork saves), ``$VAE_DDP_LAUNCH``
    not ``exec``, and one thread runs ([`forking.can_fork`][vae_ddp.forking.can_fork]: not in a
    shell or notebook whose torch computed)."""
    return (cmd[:3] == [sys.executable, "-m", CHILD] and cmd[3].partition(":")[0] in _FORKED_MODULES
            and spec.accelerator == "cpu"
            and "pytorch_lightning" in sys.modules and os.environ.get(_LAUNCH_ENV) != "exec" and forking.can_fork())


def _how(cmd: list[str], spec) -> guard.How:
    """How the launch of ``cmd`` starts its child: a fork of this process where
    [`_forkable`][vae_ddp.harness.launch] holds, else on CPU a fork of this process's zygote of
    the module ([`vae_ddp.zygote`][vae_ddp.zygote]: torch and Lightning imported once per
    caller), else (GPUs: Lightning's launcher re-runs the command line) a new interpreter."""
    if _forkable(cmd, spec):
        return "fork"
    return "zygote" if spec.accelerator == "cpu" and zygote.usable(cmd) else "exec"


def group_folder(world_size: int, accelerator: str) -> str:
    """The folder of ``launch_by_world_size``'s group of one world size: ``1-process``,
    ``2-processes``, ``2-processes-gpu``."""
    return f"{world_size}-process{'es' if world_size > 1 else ''}{'' if accelerator == 'cpu' else '-' + accelerator}"


def launch_by_world_size(specs: list, out_dir: Path, timeout: Optional[float] = None,
                         quiet: bool = False, same_threads: bool = False,
                         entry: Optional[list[str]] = None, train: str = RUNNER) -> list[tuple[dict, Path]]:
    """Train ``specs`` ([`RunSpec`][vae_ddp.harness.configs.RunSpec]s, or any specs a
    [`Job`][vae_ddp.harness.launch.Job] takes) in groups of one world size (in the order they first appear), group ``g``
    in ``out_dir/g/`` ([`group_folder`][vae_ddp.harness.launch.group_folder]): on CPU all in one
    [`launch`][vae_ddp.harness.launch.launch] (a [`Job`][vae_ddp.harness.launch.Job] whose groups
    train in turn), else one launch per group. ``entry``, ``train``: as ``launch``'s (the child
    writes each group's ``{"group": [one result per spec]}``).

    Returns:
        for each spec, in the order given: its ``{"spec", "runs"}`` (an ``entry``'s result) and
        the folder its runs' ``params`` file names are relative to.

    Raises:
        RunFailed: as [`launch`][vae_ddp.harness.launch.launch].
    """
    out_dir = Path(out_dir)
    tags = [group_folder(s.world_size, s.accelerator) for s in specs]
    groups = {tag: [s for s, t in zip(specs, tags) if t == tag] for tag in dict.fromkeys(tags)}
    if all(s.accelerator == "cpu" for s in specs):
        launched = launch(Job(groups, same_threads=same_threads), out_dir, timeout=timeout, quiet=quiet,
                          entry=entry, train=train)
    else:  # one launch per group, one after the other, each group in out_dir/tag as on CPU
        launched = {tag: launch(Job({tag: g}), out_dir, timeout=timeout, quiet=quiet, entry=entry,
                                train=train)[tag]
                    for tag, g in groups.items()}
    results = {tag: iter(launched[tag]["group"]) for tag in groups}  # a group's results in its specs' order
    return [(next(results[tag]), out_dir / tag) for tag in tags]
