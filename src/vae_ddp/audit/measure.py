"""The audit's second stage: the runs of a [`Plan`][vae_ddp.audit.plan.Plan] trained in one launch,
what they saved ([`measure`][vae_ddp.audit.measure.measure] gives a [`Measured`][vae_ddp.audit.measure.Measured])."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from vae_ddp.audit.plan import Plan
from vae_ddp.audit.spec import ONE_DEVICE, PROGRESS_FILE
from vae_ddp.harness.launch import Job, RunFailed, launch
from vae_ddp.lightning_package import env_for
from vae_ddp.probes import per_step_differences

__all__ = ["Measured", "measure", "watch"]


#: One run's measurement: its final state (``{name: tensor}``, parameters and buffers), its ``run.json``
#: entry (``findings``, ``notes``, ...) and the folder of its files (``<label>.steps.pt``).
Run = tuple[dict, dict, Path]


@dataclass
class Measured:
    """The audit's second stage: what the launch of a [`Plan`][vae_ddp.audit.plan.Plan] measured, each run
    by its label as a ``Run`` (final state, ``run.json`` entry, folder)."""

    one_device: dict[str, Run]
    """The one-device runs trained (``single``, ``floor-1``, ..., ``other-batch``, ``permuted``, ...)."""
    ddp: dict[str, Run]
    """The DDP runs (``ddp``, ``ddp+fixed``, ``ddp+fixed-forced``, ``ddp-<factor>`` of an exposed factor, ...),
    rank 0's."""

    @property
    def runs(self) -> list[str]:
        """The labels of the runs trained: one device's, then DDP's, each in the order they trained."""
        return [label for runs in (self.one_device, self.ddp) for label, run in runs.items() if "same_as" not in run[1]]

    @property
    def same_runs(self) -> dict[str, str]:
        """``{label: label of the run trained for it}``: the planned runs that differ from a trained one only
        by fixes that changed nothing (``vae_ddp.audit.spec.same_runs``), not trained again."""
        return {label: run[1]["same_as"] for runs in (self.one_device, self.ddp) for label, run in runs.items()
                if "same_as" in run[1]}

    def record(self, label: str) -> dict:
        """The run's [`StepProbe.record()`][vae_ddp.probes.StepProbe.record] (``grads``, ``updates``, ...),
        loaded from its folder."""
        run = self.one_device.get(label) or self.ddp[label]
        return torch.load(run[2] / f"{run[1].get('same_as', label)}.steps.pt")

    def per_step(self, label: str, reference: str = "single") -> list[float]:
        """Per optimizer step, the run's gradient relative to ``reference``'s.

        Raises:
            RunFailed: the two runs' steps or gradients do not line up.
        """
        try:
            return per_step_differences(self.record(label)["grads"], self.record(reference)["grads"])
        except (ValueError, RuntimeError) as err:  # steps or gradients that do not line up
            raise RunFailed(f"run '{label}' cannot be compared with one device's step by step: {err}") from None

    def largest(self, label: str, reference: str = "single") -> float:
        """The largest of [`per_step`][vae_ddp.audit.measure.Measured.per_step] (0.0 for no step).

        Raises:
            RunFailed: the two runs' steps or gradients do not line up.
        """
        return max(self.per_step(label, reference), default=0.0)


def measure(plan: Plan, runs_dir: Path) -> Measured:
    """The runs of ``plan`` in one launch into ``runs_dir``: the one-device runs in a process forked beside
    the DDP ranks, all forks of one process that imported torch and Lightning once (most of a launch is
    those imports).

    Raises:
        RunFailed: a run failed or hung.
    """
    where = {ONE_DEVICE: runs_dir / ONE_DEVICE, "ddp": runs_dir / "ddp"}
    # the user's own output of one device's reference run is shown (audit.run: the others' goes to the log), unless
    # the caller silenced this process's output (the API without progress redirects sys.stdout)
    launched = launch(Job({ONE_DEVICE: plan.one_device, "ddp": plan.ddp}, together=True), runs_dir,
                      quiet=sys.stdout is not sys.__stdout__,
                      train="vae_ddp.audit.run:train_runs", extra_env=env_for(plan.ddp[0].lightning))
    # the runs trained, in the order they trained: the plan's, but those whose factor was not seen exposed
    # (AuditRun.if_seen), with the check of the sync_grads advice where a gather was seen (localise.SYNC_GRADS);
    # a run the same as another (``same_as``) reads that run's files
    one, first = ({label: (torch.load(where[tag] / f"{info.get('same_as', label)}.pt"), info, where[tag])
                   for label, info in launched[tag].items()} for tag in (ONE_DEVICE, "ddp"))
    return Measured(one, first)



#: Seconds between two looks at the runs' progress files.
POLL_S = 0.5


@contextlib.contextmanager
def watch(plan: Plan, runs_dir: Path, start: float) -> Iterator[None]:
    """While the launch of ``plan`` into ``runs_dir`` runs: one line on stderr per run that finished, ``[audit] K
    of N runs done, S s: LABEL (...)``, K the runs done, N those planned so far (a factor's runs train only
    where the DDP runs see it exposed, so N falls once they have looked), S the seconds since ``start``
    (``time.monotonic()``), read from each group's ``PROGRESS_FILE`` (rank 0 writes it after each run,
    [`vae_ddp.audit.run`][vae_ddp.audit.run]) by a thread of this process."""
    groups = {ONE_DEVICE: len(plan.one_device), "ddp": len(plan.ddp)}
    files = {tag: runs_dir / tag / PROGRESS_FILE for tag in groups}
    for f in files.values():  # an earlier audit's, in the same folder
        f.unlink(missing_ok=True)
    said: dict[str, list[str]] = {tag: [] for tag in groups}
    stop = threading.Event()

    def look() -> None:
        now = {}
        for tag, f in files.items():
            try:
                now[tag] = json.loads(f.read_text())
            except (OSError, ValueError):  # not written yet
                now[tag] = {"done": said[tag], "to_come": groups[tag] - len(said[tag])}
        planned = sum(len(n["done"]) + n["to_come"] for n in now.values())
        for tag, n in now.items():
            for label in n["done"][len(said[tag]):]:
                said[tag].append(label)
                done = sum(map(len, said.values()))
                where = "one device" if tag == ONE_DEVICE else f"{plan.base.devices} DDP ranks"
                print(f"[audit] {done} of {max(planned, done)} runs done, {time.monotonic() - start:.0f} s: "
                      f"{label} ({where})", file=sys.stderr, flush=True)

    def poll() -> None:
        while not stop.wait(POLL_S):
            look()

    thread = threading.Thread(target=poll, name="vae-ddp audit progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        look()
