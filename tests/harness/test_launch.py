"""Every failure named: a rank that dies is named in the last line with its rank, its signal or
exit code and the step it reached, after the first error line and the log's path; a non-finite
loss is named with its run, rank and step. Each test is one small DDP launch on the digits."""

from __future__ import annotations

import sys

import pytest
from helpers import ROOT

from vae_ddp.harness.configs import RunSpec
from vae_ddp.harness.launch import Job, RunFailed, launch

pytestmark = pytest.mark.timeout(300)

SCRIPT = ROOT / "tests" / "scripts" / "killed_rank.py"


def _spec() -> Job:
    return Job({"ddp": [RunSpec(data="digits", model="small", steps=6, global_batch_size=32, devices=2, config="ddp",
                               seeds=[0]).validate()]})


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_rank_is_named_in_the_last_line(tmp_path, monkeypatch, rank):
    """SIGKILL of rank 1 (or rank 0) at its third step: the last line says which rank, which
    signal and the step it had finished (it said 'exited with code 1; first error: ...
    Connection reset by peer', or 'exited with code 247', and 8 lines of traceback)."""
    monkeypatch.setenv("KILLED_RANK", str(rank))
    with pytest.raises(RunFailed) as err:
        launch(_spec(), tmp_path, quiet=True, timeout=240, entry=[sys.executable, str(SCRIPT)])
    lines = str(err.value).splitlines()
    assert lines[-1] == f"rank {rank} of run 'ddp' was killed by SIGKILL after step 2", lines
    assert lines[0].startswith("run 'ddp' failed") and len(lines) == 3, lines  # not the launch's code 137
    assert lines[1] == f"(full stderr of all ranks: {tmp_path / 'stderr.log'})", lines


@pytest.mark.parametrize("how", ["sys.exit", "os._exit"])
def test_a_rank_that_exits_0_mid_training_is_named(tmp_path, monkeypatch, how):
    """Rank 1 leaves with exit code 0 at its third step (sys.exit(0) or os._exit(0) in the training
    code): it said only 'first error: [rank0] ... Connection closed by peer', rank 1 never named."""
    monkeypatch.setenv("KILLED_RANK", "-1")
    monkeypatch.setenv("EXIT_RANK", "1")
    monkeypatch.setenv("EXIT_HOW", how)
    with pytest.raises(RunFailed) as err:
        launch(_spec(), tmp_path, quiet=True, timeout=240, entry=[sys.executable, str(SCRIPT)])
    lines = str(err.value).splitlines()
    assert lines[-1] == ("rank 1 of run 'ddp' exited with code 0 after step 2 while the other ranks still trained "
                         "(sys.exit or os._exit in the training code?)"), lines
    assert lines[0].startswith("run 'ddp' failed"), lines


def test_a_non_finite_loss_is_named_with_run_rank_and_step(tmp_path, monkeypatch):
    """Rank 1's loss is NaN at its third step: the first error names the run, the rank and the
    step (the run trained on with NaN weights without a word of the loss)."""
    monkeypatch.setenv("KILLED_RANK", "-1")
    monkeypatch.setenv("NAN_RANK", "1")
    with pytest.raises(RunFailed) as err:
        launch(_spec(), tmp_path, quiet=True, timeout=240, entry=[sys.executable, str(SCRIPT)])
    lines = str(err.value).splitlines()
    assert "first error: RuntimeError: non-finite loss (nan) in run 'ddp seed 0' on rank 1 at step 3" in lines[0], lines
    assert lines[-1].startswith("rank 1 of run 'ddp' exited with code 1"), lines


def test_launch_takes_a_job_and_says_what_to_call_for_one_spec(tmp_path):
    """``launch`` runs a ``Job``; a bare spec is refused before anything starts, naming the call
    that launches one spec."""
    spec = RunSpec(data="digits", model="small", steps=1, global_batch_size=32, config="single").validate()
    with pytest.raises(TypeError, match=r"launch_by_world_size\(\[spec\]"):
        launch(spec, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_only_this_projects_runners_are_forked_never_the_audits(monkeypatch):
    """A CPU launch forks its caller only for the study runners; the audit's runs, which train the
    user's classes, are forks of the caller's zygote (a fork of the caller would carry the user's
    modules as the audit's checks left them; the zygote imported none of them); under
    ``VAE_DDP_LAUNCH=exec`` every launch starts an interpreter."""
    import pytorch_lightning  # noqa: F401  (what _forkable asks for: Lightning imported here)

    from vae_ddp import forking
    from vae_ddp.harness.launch import _forkable, _how

    monkeypatch.setattr(forking, "can_fork", lambda: True)  # one thread, as a results entry runs
    spec = _spec()
    runners = [[sys.executable, "-m", "vae_ddp.harness", train, "job.json", "out"]  # the studies' children
               for train in ("vae_ddp.harness.runner:train_specs", "vae_ddp.studies.report_scale.runs:frozen_runs")]
    audit = [sys.executable, "-m", "vae_ddp.harness", "vae_ddp.audit.run:train_runs", "job.json", "out"]
    assert all(_forkable(cmd, spec) and _how(cmd, spec) == "fork" for cmd in runners)
    assert not _forkable(audit, spec) and _how(audit, spec) == "zygote"
    monkeypatch.setattr(forking, "can_fork", lambda: False)  # a caller that computed on several threads
    assert all(_how(cmd, spec) == "zygote" for cmd in runners)
    monkeypatch.setenv("VAE_DDP_LAUNCH", "exec")
    assert not any(_forkable(cmd, spec) or _how(cmd, spec) != "exec" for cmd in [*runners, audit])


def test_a_dataloader_workers_own_error_is_in_the_first_line(tmp_path):
    """torch re-raises a worker's error as 'ValueError: Caught ValueError in DataLoader worker process
    0.', the worker's own error at the end of its traceback below: the one line kept only the former."""
    from vae_ddp.harness.launch import _failure

    log = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/torch/_utils.py", line 803, in reraise
[rank1]:     raise exception
[rank1]: ValueError: Caught ValueError in DataLoader worker process 0.
[rank1]: Original Traceback (most recent call last):
[rank1]:   File "/x/torch/utils/data/_utils/worker.py", line 375, in _worker_loop
[rank1]:     data = fetcher.fetch(index)
[rank1]:   File "data.py", line 6, in __getitem__
[rank1]: ValueError: bad sample 3: its label is missing
[rank0]: RuntimeError: Connection closed by peer""".splitlines()
    err = _failure("ddp", 1, log, tmp_path / "stderr.log", tmp_path)
    assert str(err).splitlines()[0] == ("run 'ddp' exited with code 1; first error: [rank1]: ValueError: Caught "
                                        "ValueError in DataLoader worker process 0: ValueError: bad sample 3: its "
                                        "label is missing"), str(err)


def test_a_killed_guard_is_named_not_a_run_exit_code(tmp_path):
    """kill -9 of a launch's guard read "run 'single, ddp' exited with code -9": the guard is named, and how."""
    from vae_ddp.harness.launch import _failure

    lines = str(_failure("single, ddp", -9, ["vae-ddp: PID 11 starts run 'single'"], tmp_path / "stderr.log",
                         tmp_path)).splitlines()
    assert lines[0].startswith("run 'single': its guard, the process that watches its ranks, was killed by SIGKILL")
    assert lines[-1] == "the guard of run 'single' was killed by SIGKILL", lines
    assert not any("exited with code -9" in ln for ln in lines)


def test_a_failure_names_the_run_that_failed_not_the_jobs_every_run(tmp_path):
    """An audit's launch trains 22 runs; a failure named them all ("run 'single, floor-1, ...,
    effect-defaults'"): the run that says it failed, else the run the rank that ended was training."""
    from vae_ddp.harness.launch import _failure

    job = "single, floor-1, floor-2, ddp, ddp+fixed, ddp+fixed-forced"
    log = ["vae-ddp: PID 11 starts run 'single'", "vae-ddp: PID 20 starts run 'ddp'",
           "vae-ddp: PID 21 starts run 'ddp'",
           "vae-ddp: PID 11 starts run 'floor-1'", "vae-ddp: PID 20 starts run 'ddp+fixed'",
           "vae-ddp: PID 21 starts run 'ddp+fixed'", "vae-ddp: run 'ddp+fixed' failed in PID 20",
           "[rank0]: RuntimeError: Connection closed by peer",
           "vae-ddp: rank 1 (PID 21) was killed by SIGKILL after step 2: ending every rank"]
    lines = str(_failure(job, 137, log, tmp_path / "stderr.log", tmp_path)).splitlines()
    assert lines[0] == "run 'ddp+fixed' failed; first error: [rank0]: RuntimeError: Connection closed by peer", lines
    assert lines[-1] == "rank 1 of run 'ddp+fixed' was killed by SIGKILL after step 2", lines
    killed = [ln for ln in log if "failed in" not in ln and "Connection" not in ln]  # no process raised
    lines = str(_failure(job, 137, killed, tmp_path / "stderr.log", tmp_path)).splitlines()
    assert lines[0] == "run 'ddp+fixed' failed" and lines[-1].startswith("rank 1 of run 'ddp+fixed' was"), lines


def test_the_last_line_names_the_process_that_failed_first(tmp_path):
    """An audit's log whose one-device run failed first (NaN at batch 1), then both DDP ranks for want of its
    weights, rank 1 reaped first: the last line blamed "rank 1 of run 'single'", a rank that run does not
    have. It names the process that raised first, by its role, then the rank that ended; a rank that
    raised first is named the same way; a rank killed (it could not say so) is still the last line."""
    from vae_ddp.harness.launch import _failure

    log = ["vae-ddp: PID 11 starts run 'single'", "vae-ddp: PID 20 starts run 'ddp'",
           "vae-ddp: PID 21 starts run 'ddp'",
           "vae-ddp: run 'single' failed in PID 11 (one device)",
           "RuntimeError: run 'single': the gradient is not finite (NaN or infinite) at training batch 1 on rank 0",
           "vae-ddp: PID 20 starts run 'ddp+fixed-forced'", "vae-ddp: PID 21 starts run 'ddp+fixed-forced'",
           "vae-ddp: run 'ddp+fixed-forced' failed in PID 20 (rank 0)",
           "vae-ddp: run 'ddp+fixed-forced' failed in PID 21 (rank 1)",
           "RuntimeError: no reference weights: run 'single' failed",
           "vae-ddp: rank 1 (PID 21) exited with code 1 after step 4: ending every rank",
           "vae-ddp: rank 0 (PID 20) was killed by SIGKILL after step 4"]
    lines = str(_failure("single, ddp", -9, log, tmp_path / "stderr.log", tmp_path)).splitlines()
    assert lines[0].startswith("run 'single' failed; first error: RuntimeError: run 'single': the gradient"), lines
    assert lines[-1] == ("one device's process (PID 11) failed first, in run 'single'; then rank 1 of run "
                         "'ddp+fixed-forced' exited with code 1 after step 4"), lines
    ranks = [ln for ln in log if "PID 11" not in ln]  # rank 0 raised first, rank 1 was reaped first
    lines = str(_failure("single, ddp", -9, ranks, tmp_path / "stderr.log", tmp_path)).splitlines()
    assert lines[-1] == ("rank 0 (PID 20) failed first, in run 'ddp+fixed-forced'; then rank 1 of run "
                         "'ddp+fixed-forced' exited with code 1 after step 4"), lines
    killed = log[:-2] + ["vae-ddp: rank 1 (PID 21) was killed by SIGKILL after step 4: ending every rank"]
    lines = str(_failure("single, ddp", -9, killed, tmp_path / "stderr.log", tmp_path)).splitlines()
    assert lines[-1] == "rank 1 of run 'ddp+fixed-forced' was killed by SIGKILL after step 4", lines  # its own run
