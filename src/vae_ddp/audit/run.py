"""Audit runs in one process tree: ``python -m vae_ddp.harness vae_ddp.audit.run:train_runs JOB OUT``.

The job (a [`Job`][vae_ddp.harness.launch.Job]'s JSON in ``JOB_FILE``) holds groups of
[`AuditRun`][vae_ddp.audit.spec.AuditRun]s, each with one ``devices`` (the audit's one-device runs and its DDP runs,
at the same time: see ``train_runs``); the runs of a group are trained one after the other in the same processes
(Lightning reuses the process group), which saves a launch per variant. On CPU the other ranks are forks of this
process ([`vae_ddp.ranks`][vae_ddp.ranks]); on GPUs Lightning's launcher re-runs this command for them. Rank 0 writes,
in ``OUT_DIR/TAG/``, ``<label>.pt`` (each run's final floating-point parameters and buffers), ``<label>.steps.pt``
(per-step gradients, for a run with a ``steps_file``) and ``run.json``: ``{label: {"findings": [...], "steps": int,
"notes": [...]}}``, the findings what [`DDPAudit`][vae_ddp.audit.callback.DDPAudit] saw. A teacher-forced run waits
until the reference run (in the process beside it) has written its weights. Where the run ``localise.RANKS_GRADS`` saw
a ``self.all_gather`` without ``sync_grads=True`` on a tensor that requires a gradient (on any rank), the ranks train
it again with ``sync_grads=True`` forced there, as ``localise.SYNC_GRADS``, right after it: the audit's check of its
advice. Likewise a run with ``if_seen`` (a factor's ablation and effect runs) trains only when the deciding DDP runs
(``spec.DECIDING``, the first two) saw one of those factors exposed: rank 0 broadcasts what their ``DDPAudit`` saw to
the other ranks and writes it to ``OUT_DIR/seen.json`` for the one-device process, which waits for it there. A run
that differs from another only by fixes that changed nothing in the run with every fix (``Audit.idle``: a module
without BatchNorm, without draws the noise fix serves) is that run: trained once, its ``run.json`` entry says
``same_as``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytorch_lightning as pl
import torch
from pytorch_lightning import Callback, LightningModule, Trainer
from pytorch_lightning.strategies import Strategy
from torch.utils.data import DataLoader

from vae_ddp.audit import localise
from vae_ddp.audit.callback import DDPAudit
from vae_ddp.audit.draws import KeyedTorchDraws, NoAttentionDropout
from vae_ddp.audit.loader_draws import keyed_items, measure
from vae_ddp.audit import user_objects, users_trainer
from vae_ddp.audit.attached import one_device_view
from vae_ddp.audit.spec import (DECIDING, LEFT, ONE_DEVICE, PROGRESS_FILE, SEEN_FILE, AuditRun, failed_marker,
                              same_runs, seen_in, trained)
from vae_ddp import heartbeat
from vae_ddp.fixes import registry
from vae_ddp.beats import beat
from vae_ddp.harness.launch import BESIDE_PID, say_run
from vae_ddp.harness.permutation import WithinBatchPermutation
from vae_ddp.outputs import replacing, write_atomic
from vae_ddp.probes import StepProbe
from vae_ddp.ranks import alive, cluster_plugins
from vae_ddp.utils import close_process_group, quiet
from vae_ddp.workers import make_fork_safe

#: the run whose user output (print) the audit shows: one device's reference run (audit.plan's label)
REFERENCE = "single"

__all__ = ["build", "train_runs"]


class EvalModeSteps(Callback):
    """Each training step in eval mode: ``module.eval()`` at the start of the batch, ``train()``
    at its end (dropout off, BatchNorm normalising with its running statistics and not updating
    them), what the one-process reduction check measures, here under the real process group."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        pl_module.eval()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pl_module.train()


class LoaderDraws(Callback):
    """At the start of training, every rank reads the same samples through a copy of its training
    loader and the ranks compare their draws ([`measure`][vae_ddp.audit.loader_draws.measure]):
    ``measured``."""

    measured: Optional[dict] = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.measured = measure(trainer.train_dataloader)


def build(run: AuditRun,
          probe: Optional[StepProbe] = None) -> tuple[LightningModule, pl.LightningDataModule, Trainer]:
    """Seed, build the user's module and datamodule (per-device batch size) and the Trainer with
    ``run.fixes`` on (and ``probe`` as its first callback). Call in every rank (Lightning re-runs
    the command)."""
    pl.seed_everything(run.seed, verbose=False)
    model = user_objects.build(run, "model")
    # each fix in run.fixes, as its factor declares it; the user's Trainer arguments as they run here
    parts, user, notes = users_trainer.in_run(run, registry.audit_parts(run))
    NOTES.extend(n for n in notes if n not in NOTES)
    dm = user_objects.build(run, "data", batch_size=run.global_batch_size // run.devices)
    callbacks: list[Callback] = [probe] if probe is not None else []  # first: θ_k before any other acts
    callbacks += parts.callbacks
    if run.permute:
        callbacks.append(WithinBatchPermutation(run.seed * 1009 + run.permute))
    if run.eval_mode:
        callbacks.append(EvalModeSteps())
    if not run.attention_dropout:
        callbacks.append(NoAttentionDropout())
    if run.keyed_draws:
        callbacks.append(KeyedTorchDraws(run.seed * 1009 + 17))
    if run.probe_items:
        callbacks.append(LoaderDraws())
    callbacks.append(DDPAudit(warn=False))
    callbacks += heartbeat.callbacks()  # the guard's watchdog sees the run's progress
    plugins = parts.plugins + cluster_plugins()  # cluster_plugins: a forked rank (the environment vae_ddp.ranks set)
    # the user's, else what a Trainer with neither max_epochs nor max_steps gives the module (the
    # audit's max_steps would make Lightning's default -1, and a schedule counted from it negative)
    max_epochs = user.pop("max_epochs", None)
    if max_epochs is None:
        max_epochs = DEFAULT_MAX_EPOCHS
    precision = user.pop("precision", None) or ("64-true" if run.dtype == "float64" else "32-true")
    loaders = parts.loaders + ([lambda dl, _: keyed_items(dl, run.seed)] if run.keyed_items else [])
    strategy = audit_strategy(run, user.pop("strategy", None) or "ddp", loaders)
    trainer = Trainer(
        accelerator=run.accelerator, devices=run.devices, strategy=strategy, **user,
        max_steps=run.steps, max_epochs=max_epochs, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        precision=precision, callbacks=callbacks,
        **({"plugins": plugins} if plugins else {}), **parts.trainer)
    return model, dm, trainer


#: ``self.trainer.max_epochs`` of a ``Trainer`` given neither ``max_epochs`` nor ``max_steps``
#: (Lightning 2.x, ``_parse_loop_limits`` in ``pytorch_lightning/loops/utilities.py``): what the
#: audit's runs give the user's module unless ``--trainer.max_epochs`` says otherwise.
DEFAULT_MAX_EPOCHS = 1000


def audit_settings(run: AuditRun) -> str:
    """The settings of the audit's that the user's code can read in a run (``self.trainer.*``, the
    datamodule's ``batch_size``), as one clause for the error line of a run that fails."""
    given = (run.trainer or {}).get("max_epochs")
    epochs = (f"max_epochs={given} (--trainer.max_epochs)" if given is not None else
              f"max_epochs={DEFAULT_MAX_EPOCHS} (Lightning's default for a Trainer without max_steps; "
              "--trainer.max_epochs sets it)")
    return (f"the audit's settings in this run: max_steps={run.steps} (--steps), {epochs}, devices={run.devices}, "
            f"batch_size={run.global_batch_size // run.devices} per device (--data.init_args.batch_size / devices), "
            "limit_val_batches=0, num_sanity_val_steps=0, logger=False")


def with_settings(err: BaseException, run: AuditRun) -> BaseException:
    """``err`` with :func:`audit_settings` appended to its message (its first argument, when a
    string), so that the one error line of a failed run names what the audit set; the audit's own
    errors (a ``RuntimeError`` naming its run) and errors without a message are left as they are."""
    if (not isinstance(err, Exception) or not err.args or not isinstance(err.args[0], str)
            or err.args[0].startswith("run '")):
        return err
    first, newline, rest = err.args[0].partition("\n")
    err.args = (f"{first} ({audit_settings(run)}){newline}{rest}", *err.args[1:])
    return err


def audit_strategy(run: AuditRun, name: str, loaders: list) -> Strategy:
    """The run's Lightning strategy, as Lightning builds it (``StrategyRegistry[name]``, a
    ``DDPStrategy``, for ``run.devices > 1``; else ``SingleDeviceStrategy``), whose
    ``process_dataloader`` (Lightning's hook for a strategy to wrap the loaders, called for each
    loader after Lightning's own sampler injection, ``_process_dataloader`` in Lightning 2.x)
    hands each training ``DataLoader`` to the fixes' ``loaders`` (``loader(dataloader, strategy)``:
    the sampler fix deals global batches) and then starts its workers with ``forkserver`` unless
    the user chose a start method (see [`vae_ddp.workers`][vae_ddp.workers]): a worker forked
    from a rank that runs threads can hang at start, and the audit must end. The user's
    datamodule is not changed."""
    from pytorch_lightning.strategies import SingleDeviceStrategy, StrategyRegistry
    from pytorch_lightning.trainer.states import RunningStage

    if run.devices > 1:
        base, kwargs = StrategyRegistry[name]["strategy"], dict(StrategyRegistry[name]["init_params"])
    else:
        base = SingleDeviceStrategy
        kwargs = {"device": torch.device("cuda", 0) if run.accelerator == "gpu" else torch.device("cpu")}

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = base.process_dataloader(self, dataloader)
        if self.lightning_module.trainer.state.stage != RunningStage.TRAINING or not isinstance(dataloader, DataLoader):
            return dataloader
        for loader in loaders:
            dataloader = loader(dataloader, self)
        note = make_fork_safe(dataloader, preload=("vae_ddp.audit.spec",))
        if note and note not in NOTES:
            NOTES.append(note)
        return dataloader

    def global_batch_loader(self) -> object:
        """The user's training loader at the global batch size, from a second instance of the user's
        datamodule (``setup("fit")``): what the sampler fix deals to the ranks. The trainer's own
        datamodule stays the per-device one, as under DDP (a schedule counted from its loader's
        length sees what it would see)."""
        data = user_objects.build(run, "data", batch_size=run.global_batch_size)
        data.trainer = one_device_view(self.lightning_module.trainer)  # one device's loader (a sampler by rank too)
        data.setup("fit")
        loader = data.train_dataloader()
        note = make_fork_safe(loader, preload=("vae_ddp.audit.spec",))
        if note and note not in NOTES:
            NOTES.append(note)
        return loader

    return type(f"Audit{base.__name__}", (base,), {"process_dataloader": process_dataloader,
                                                   "global_batch_loader": global_batch_loader})(**kwargs)


#: What the audit's runs noticed about the user's loaders in this process (one line each).
NOTES: list[str] = []


#: Seconds a teacher-forced run waits for the reference's weights (the one-device runs, in the
#: process beside it, record them; the guard's watchdog ends a stalled tree long before).
WAIT_S = 1800.0

def wait_for_steps(steps_file: Path, timeout: float = WAIT_S) -> list[dict]:
    """The per-batch weights θ_k the reference run records in ``steps_file`` (``states``),
    once it has written them; the guard's heartbeat goes on meanwhile.

    Raises:
        RuntimeError: the reference failed (its marker file exists: ``no reference weights: run 'LABEL'
            failed``, the run that failed) or ``timeout`` seconds passed.
    """
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    deadline = time.monotonic() + timeout
    reference = int(os.environ.get(BESIDE_PID, "0"))  # the one-device runs: the group beside the ranks
    while not steps_file.exists():
        if failed_marker(steps_file).exists():  # the failed run's label in it (train_runs)
            failed = failed_marker(steps_file).read_text().strip()
            raise RuntimeError(f"no reference weights: run '{failed}' failed" if failed else
                               f"no reference weights: the one-device reference run failed (no {steps_file})")
        if reference and not alive(reference) and not steps_file.exists():  # killed, or left another way
            raise RuntimeError(f"the one-device reference run (PID {reference}) ended without writing {steps_file}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no reference weights in {steps_file} after {timeout:g} s")
        beat(rank)
        time.sleep(0.2)
    return torch.load(steps_file)["states"]


def wait_for_seen(seen_file: Path, timeout: float = WAIT_S) -> set[str]:
    """What the deciding DDP runs saw (``seen_file``, a JSON list of ``AuditRun.if_seen`` tokens that rank 0
    of the DDP runs writes; [`seen_in`][vae_ddp.audit.spec.seen_in]), once written; the guard's heartbeat
    goes on meanwhile. For the one-device process, a fork beside the ranks (its parent, rank 0 on CPU).

    Raises:
        RuntimeError: the DDP runs failed (their marker file exists: ``no decision of the DDP runs: run 'LABEL'
            failed``), the parent process ended, or ``timeout`` seconds passed.
    """
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    deadline = time.monotonic() + timeout
    parent = os.getppid()
    while not seen_file.exists():
        if failed_marker(seen_file).exists():
            raise RuntimeError(f"no decision of the DDP runs: run '{failed_marker(seen_file).read_text().strip()}' "
                               "failed")
        if (not alive(parent) or os.getppid() != parent) and not seen_file.exists():
            raise RuntimeError(f"the DDP runs (PID {parent}) ended without writing {seen_file}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no decision of the DDP runs in {seen_file} after {timeout:g} s")
        beat(rank)
        time.sleep(0.2)
    return set(json.loads(seen_file.read_text())["seen"])


def _rank() -> int:
    """This process's global rank (0 outside a process group)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank of the process group the runs share (``obj`` itself outside one)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _step_left(runs: list[AuditRun], out: Path, timeout: float = WAIT_S) -> bool:
    """On rank 0: [`judge.step_left`][vae_ddp.audit.judge.step_left] of DDP's step with every fix (the run of
    ``runs`` labelled ``localise.RANKS_GRADS``, its record in ``out``; True where it did not train) against
    one device's reference and floor draws and ``other-batch`` (their records in the one-device folder beside
    ``out``, waited for: the process beside the ranks trains them first; the guard's heartbeat goes on
    meanwhile), each record read once.

    Raises:
        RuntimeError: the one-device process ended (or a run of it failed) without writing them, or ``timeout``
            seconds passed.
        RunFailed: their steps do not line up.
    """
    from vae_ddp.audit import judge
    from vae_ddp.audit.measure import Measured
    from vae_ddp.audit.plan import FLOOR_DRAWS, Plan, batch_lag

    run = next((r for r in runs if r.label == localise.RANKS_GRADS), None)
    if run is None or not (out / f"{run.label}.steps.pt").exists():
        return True
    one = out.parent / ONE_DEVICE
    labels = ["single", *(f"floor-{k}" for k in range(1, FLOOR_DRAWS + 1)), "other-batch"]
    deadline = time.monotonic() + timeout
    beside = int(os.environ.get(BESIDE_PID, "0"))
    while not all((one / f"{label}.steps.pt").exists() for label in labels):
        if failed_marker(Path(run.steps_file)).exists() or (beside and not alive(beside)):
            raise RuntimeError(f"the one-device runs ended without writing their records in {one}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no one-device records in {one} after {timeout:g} s")
        beat(0)
        time.sleep(0.2)
    records: dict[str, dict] = {}

    class Read(Measured):
        def record(self, label: str) -> dict:  # each record loaded once (the judgement reads some several times)
            if label not in records:
                records[label] = super().record(label)
            return records[label]

    measured = Read({label: (None, {}, one) for label in labels}, {run.label: (None, {}, out)})
    try:
        return judge.step_left(Plan(run, list(run.fixes), [], [], batch_lag(run), False, [], [], []), measured)
    finally:
        records.clear()


#: The run this process trains now (its label), for the line that names a run that failed.
_CURRENT: list[str] = []


def _say_progress(out: Path, done: list[str], later: list[AuditRun], same: dict[str, str],
                  decided: Optional[set[str]], left_checked: bool) -> None:
    """``out/PROGRESS_FILE`` (rank 0): ``done`` and the ``later`` runs still to train as known now: not the same
    as another (``same``), of ``if_seen`` either undecided or ``trained`` by ``decided`` (or waiting on the check
    of what is left for the user's code, not yet made); undecided here, decided where the DDP runs wrote
    ``SEEN_FILE`` (the one-device process reads it only when it reaches such a run)."""
    seen_file = out.parent / SEEN_FILE
    if decided is None and seen_file.exists():
        decided = set(json.loads(seen_file.read_text())["seen"])
    to_come = sum(1 for r in later if r.label not in same and (
        decided is None or trained(r, decided) or (LEFT in r.if_seen and not left_checked)))
    write_atomic(out / PROGRESS_FILE, json.dumps({"done": done, "to_come": to_come}))


def _validate(trainer: Trainer, model: LightningModule, dm: Any) -> None:
    """Two batches of the user's validation (``trainer.validate``), where the module has a ``validation_step`` and
    the datamodule a ``val_dataloader``: what ``DDPAudit`` sees of the metrics it logs (without ``sync_dist``, an
    epoch mean over counts the world size does not divide). The runs themselves validate nothing."""
    def own(obj: Any, name: str) -> bool:
        return any(name in k.__dict__ for k in type(obj).__mro__ if not k.__module__.startswith(("pytorch_lightning",
                                                                                                 "lightning.")))

    if own(model, "validation_step") and own(dm, "val_dataloader"):
        trainer.limit_val_batches = 2
        trainer.validate(model, datamodule=dm, verbose=False)


def train_runs(runs: list[AuditRun], out: Path) -> int:
    """What the audit's launches train (``python -m vae_ddp.harness vae_ddp.audit.run:train_runs JOB
    OUT``, [`run_job`][vae_ddp.harness.launch.run_job]: the audit's job trains its groups together,
    the DDP runs in the ranks of this process tree and the one-device runs in a process forked
    beside them, no second import of torch and Lightning): ``_train(runs, out)``; if it fails,
    the line ``vae-ddp: run 'LABEL' failed in PID P`` names the run on stderr
    ([`launch`][vae_ddp.harness.launch.launch] names it, not the job's every label), and the
    teacher-forced runs waiting for the weights these runs record are told so (their marker file, which
    holds the label of the run that failed).

    Raises:
        BaseException: what training raised (the user's error with the audit's settings, a signal's), again.
    """
    try:
        return _train(runs, out)
    except BaseException:
        if _CURRENT:
            say_run(_CURRENT[-1], failed=True, world_size=runs[0].world_size)
        for run in runs:
            if run.steps_file and not run.teacher_forced:
                failed_marker(Path(run.steps_file)).write_text(_CURRENT[-1] if _CURRENT else "")
        if any(run.label in DECIDING and run.devices > 1 for run in runs):  # the one-device process may wait on them
            failed_marker(out.parent / SEEN_FILE).write_text(_CURRENT[-1] if _CURRENT else "")
        raise


def _saved(run: AuditRun, trainer: Trainer, model: LightningModule, probe: Optional[StepProbe], out: Path,
           gathers: Any) -> dict:
    """Rank 0's files of the run just trained (weights, recorded steps, the reference's) and its ``run.json`` entry."""
    audit = next(c for c in trainer.callbacks if isinstance(c, DDPAudit))
    with replacing(out / f"{run.label}.pt") as tmp:
        torch.save({n: t.detach().cpu() for n, t in model.state_dict().items() if t.is_floating_point()}, tmp)
    entry = {"findings": audit.state(), "steps": trainer.global_step, "notes": list(NOTES), "gathers": gathers}
    drawn = next((c for c in trainer.callbacks if isinstance(c, LoaderDraws)), None)
    if drawn is not None:  # what the ranks' loaders drew for the same samples
        entry["loader_draws"] = drawn.measured
    if probe is not None and probe.forced:  # which of the reference's θ_k each batch started from
        entry["weights_of_batch"] = probe.loaded
    if probe is not None:
        record = probe.record()
        with replacing(out / f"{run.label}.steps.pt") as tmp:
            torch.save(record, tmp)
        if not run.teacher_forced:  # the reference: its weights, for the forced runs (written whole)
            with replacing(Path(run.steps_file)) as tmp:
                torch.save({**record, "states": probe.states}, tmp)
    return entry


def _fit(run: AuditRun) -> tuple[LightningModule, Any, Trainer, Optional[StepProbe], Any]:
    """Train ``run`` in this rank: its module, datamodule, trainer, probe and the gathers seen."""
    _CURRENT[:] = [run.label]  # which run each process trains, in the log: a rank that dies is named with its run
    say_run(run.label)
    probe = None
    if run.steps_file:
        probe = StepProbe(wait_for_steps(Path(run.steps_file)) if run.teacher_forced else None,
                          record_states=not run.teacher_forced, lag=run.lag, label=run.label,
                          repeat=run.repeat, sketch=run.sketch, ranks_grads=run.label == localise.RANKS_GRADS)
    # the user's own output (print) is shown once, for one device's reference run; every other run's goes
    # to the launch's log (its stderr), where its errors go
    shown = run.label == REFERENCE and run.devices == 1
    with contextlib.redirect_stdout(sys.stdout if shown else sys.stderr):
        model, dm, trainer = build(run, probe)
        try:
            with localise.watch_gathers(force=run.sync_grads) as gathers:
                trainer.fit(model, datamodule=dm)
        except Exception as err:  # the user's code failed under the audit's settings: the error names them
            raise with_settings(err, run)
    return model, dm, trainer, probe, gathers


def _train(runs: list[AuditRun], out: Path) -> int:
    """Train ``runs`` one after the other in this rank; rank 0 writes what the audit reads."""
    quiet()
    out.mkdir(parents=True, exist_ok=True)
    info = {}
    runs = list(runs)
    # if_seen runs train where the deciding DDP runs saw their factor; runs the same as another: once (module doc)
    deciding = [run.label for run in runs if run.label in DECIDING and run.devices > 1]
    seen: set[str] = set()
    idle: set[str] = set()
    decided: Optional[set[str]] = None
    same: dict[str, str] = {}
    left_checked = False
    for run in runs:
        if LEFT in run.if_seen and LEFT not in seen and decided is not None and run.devices > 1 and not left_checked:
            # the step with every fix, judged as the audit will, once the runs before are done (the one-device
            # runs it reads have long ended): does it leave anything for the user's code? (effect-fixed measures
            # what that changes; with nothing left, it need not train)
            left_checked = True
            if _broadcast(_step_left(runs, out) if _rank() == 0 else None):
                seen.add(LEFT)
                later = runs[runs.index(run):]
                same = {**{k: v for k, v in same.items() if k not in {r.label for r in later}},
                        **same_runs(later, seen, idle)}
        if run.if_seen:
            if decided is None and deciding:
                raise RuntimeError(f"run '{run.label}' is planned before the runs that decide it "
                                   f"({', '.join(deciding)})")
            if decided is None:
                decided = wait_for_seen(out.parent / SEEN_FILE)
            if not trained(run, decided):
                continue
        if run.label in same:
            continue
        model, dm, trainer, probe, gathers = _fit(run)
        if run.label == localise.RANKS_GRADS and run.devices > 1 and trainer.strategy.reduce_boolean_decision(
                bool(gathers), all=False):  # a gather without gradient on any rank: its advice checked, next
            runs.insert(runs.index(run) + 1, run.replace(label=localise.SYNC_GRADS, sync_grads=True))
        if run.label == DECIDING[0] and run.devices > 1:  # Lightning's defaults: what the validation logs too
            _validate(trainer, model, dm)
        if run.label in deciding:  # what it saw, rank 0's findings, on every rank
            mine = None
            if trainer.is_global_zero:
                found = next(c for c in trainer.callbacks if isinstance(c, DDPAudit)).state()
                mine = {"seen": sorted(seen_in(run.label, found, any(True for _ in model.buffers()))),
                        "idle": sorted(f.key for f in registry.factors() if f.key in run.fixes
                                       and f.audit.idle is not None and f.audit.idle(trainer, model))}
            mine = trainer.strategy.broadcast(mine, src=0)
            seen |= set(mine["seen"])
            if run.fixes:  # the run with every fix: which of them changed nothing
                idle = set(mine["idle"])
            deciding.remove(run.label)
            if not deciding:
                decided = seen
                same = same_runs(runs[runs.index(run) + 1:], decided, idle)  # of the runs to come
                if trainer.is_global_zero:
                    write_atomic(out.parent / SEEN_FILE, json.dumps({"seen": sorted(seen), "idle": sorted(idle)}))
        if trainer.is_global_zero:
            info[run.label] = _saved(run, trainer, model, probe, out, gathers)
            _say_progress(out, list(info), runs[runs.index(run) + 1:], same, decided, left_checked)
        # Trainer and module refer to each other: uncollected, each run's module and optimizer state outlive it
        del model, dm, trainer, probe
        gc.collect()
    for label, other in same.items():  # a run the same as another: its entry says which (its files are that run's)
        if other in info:
            info[label] = dict(info[other], same_as=other)
    if info:
        write_atomic(out / "run.json", json.dumps(info))
    close_process_group()
    return 0
