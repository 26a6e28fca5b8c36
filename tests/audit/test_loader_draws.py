"""Augmentation drawn in a dataset's `__getitem__`: the ranks' draws measured, not assumed (issue #48, item 5).

The rules on made-up measurements, `KeyedItems` and `measure` in one process, then `vae-ddp audit` on
`Regression(augment=True, num_workers=1)` (`tests/audit/test_study.py::test_augmentation_with_workers`)
and `RankSeededWorkers` against ground truth measured by `tests/scripts/loader_draws_truth.py` (plain
Lightning DDP on 2 gloo ranks, the workers' draws taken from the batches; it does not import vae_ddp),
committed as `tests/scripts/loader_draws_truth.json`, one case of which `make test-full` measures again
(`slow`: CI checks the audit against the committed measurement and reruns one case of
`tests/scripts/stateful_truth.py`).
"""

from __future__ import annotations

import json
import random
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from vae_ddp import guard
from vae_ddp.audit.draws import draws_verdict
from vae_ddp.audit.loader_draws import KeyedItems, keyed_items, measure, verdict
from helpers import ROOT, imported_modules

TRUTH = ROOT / "tests/scripts/loader_draws_truth.json"
SCRIPT = ROOT / "tests/scripts/loader_draws_truth.py"


@pytest.fixture(scope="module")
def truth() -> dict:
    return json.loads(TRUTH.read_text())


class Noisy(torch.utils.data.Dataset):
    """Sample i is i plus one draw of torch, numpy and random each (a fresh draw on every read)."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i):
        return torch.tensor([float(i), float(torch.rand(())), np.random.rand(), random.random()], dtype=torch.float64)


# --- the words follow the measurement


SAME = {"ranks": 2, "samples": 8, "workers": 1, "worker_init_fn": None, "distinct": 8, "shared": 8}
APART = dict(SAME, worker_init_fn="pl_worker_init_function", distinct=16, shared=0)


def test_the_same_draws_on_every_rank_are_named_with_the_workers_seeding():
    v = verdict(SAME)
    assert v["repeated"] is True
    assert "8 distinct draws of 16" in v["state"] and "8 of the 8 alike on two ranks" in v["state"]
    assert "base_seed + w" in v["state"] and "1 DataLoader worker per rank" in v["state"]
    assert "seed_everything(seed, workers=True)" in v["fix"] and "pl_worker_init_function" in v["fix"]
    assert "SeededAugmentation" in v["fix"] and "independent" not in v["state"]


def test_without_workers_the_fix_seeds_the_ranks():
    v = verdict(dict(SAME, workers=0))
    assert v["repeated"] is True and "num_workers=0" in v["state"] and "base_seed" not in v["state"]
    assert "torch.manual_seed(seed + self.global_rank)" in v["fix"] and "workers=True" not in v["fix"]


def test_independent_draws_are_one_devices_distribution():
    v = verdict(APART)
    assert v["repeated"] is False and "16 distinct draws of 16" in v["state"]
    assert "independent draws from one device's distribution" in v["state"]
    assert "pl_worker_init_function" in v["state"] and "same augmentation" not in v["state"]
    assert v["fix"].startswith("none needed")


def test_one_sample_alike_on_two_ranks_is_the_same_draws():
    assert verdict(dict(APART, distinct=15, shared=1))["repeated"] is True


def test_not_measured_is_not_passed():
    v = verdict(None)
    assert v["repeated"] is None and "not measured" in v["state"]
    d = draws_verdict([], [], [], v)
    assert d["repeated"] and "not measured" in d["finding"]["evidence"] and d["finding"]["factor"] == "noise"


def test_the_draws_verdict_takes_the_datasets_measurement():
    apart = draws_verdict([], [], [], verdict(APART))
    assert not apart["repeated"] and apart["dataset"]["repeated"] is False
    same = draws_verdict([], [], [], verdict(SAME))
    assert same["repeated"] and same["finding"]["evidence"].startswith("the dataset draws random augmentation")
    assert same["finding"]["fix"].startswith("seed the workers by rank and worker")
    # the step's own draws repeated, the dataset's independent: repeated all the same, both named
    step = [{"factor": "noise", "manual": False}]
    both = draws_verdict([], ["torch.rand_like in net"], step, verdict(APART))
    assert both["repeated"] and "every rank draws the same numbers" in both["finding"]["evidence"]
    assert "16 distinct draws of 16" in both["finding"]["evidence"]
    assert "for the dataset's draws" in both["finding"]["fix"]


# --- keying and measuring, in one process


def test_keyed_items_draw_per_index_and_leave_the_generators():
    ds = KeyedItems(Noisy(), seed=3)
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    a = [ds[i] for i in (4, 2, 4)]
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0][1:], a[1][1:])  # every read of 4 alike, 2 apart
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]
    assert not torch.equal(KeyedItems(Noisy(), seed=4)[4], a[0]) and len(ds) == 12
    loader = keyed_items(DataLoader(Noisy(), batch_size=4), seed=3)
    assert isinstance(loader.dataset, KeyedItems) and torch.equal(next(iter(loader))[2], ds[2])
    assert keyed_items(loader, seed=3).dataset is loader.dataset  # once


def test_measure_reads_the_same_samples_and_leaves_the_generator():
    torch.manual_seed(0)
    state = torch.get_rng_state()
    m = measure(DataLoader(Noisy(), batch_size=4, shuffle=True))
    assert m == {"ranks": 1, "samples": 8, "workers": 0, "worker_init_fn": None, "distinct": 8, "shared": 0}
    assert torch.equal(torch.get_rng_state(), state)
    fixed = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4)
    assert measure(fixed) is None and measure([fixed, DataLoader(Noisy())])["samples"] == 8


# --- the ground truth, and the audit against it


def test_the_ground_truth_script_does_not_use_vae_ddp():
    names = imported_modules(SCRIPT.relative_to(ROOT))
    assert names and not [m for m in names if m.startswith("vae_ddp")], names


def test_the_truth_the_audit_is_judged_against(truth):
    same, apart = truth["augment"], truth["rank_seeded"]
    # every sample identified: the sampler's indices are the nearest clean rows
    for t in (same, apart):
        assert t["ranks"] == 2 and t["per_rank"] == 8 and t["matched"], t
    assert same["distinct"] == [8, 8] and same["same_at_place"] == [8, 8], same  # rank 1 draws rank 0's
    assert apart["distinct"] == [16, 16] and apart["same_at_place"] == [0, 0], apart


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_committed_truth_is_what_the_script_measures(tmp_path, truth):
    """One case of the committed JSON, measured again."""
    out = tmp_path / "truth.json"
    proc = guard.run([sys.executable, str(SCRIPT), str(out), "augment"], capture_output=True, text=True,
                     timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    new, old = json.loads(out.read_text())["augment"], truth["augment"]
    assert {k: new[k] for k in ("ranks", "per_rank", "distinct", "same_at_place")} == \
        {k: old[k] for k in ("ranks", "per_rank", "distinct", "same_at_place")}, (new, old)


@pytest.mark.timeout(400)
def test_workers_seeded_by_rank_pass(tmp_path, truth):
    """Lightning's pl_worker_init_function with the rank: independent draws, one device's
    distribution; the rest of the step, with each sample's draws keyed to its index, one device's. The
    datamodule reads ``self.trainer.global_rank`` in ``train_dataloader()`` as a user writes it, with no guard
    for a missing Trainer: the pre-checks attach one as Lightning does (it was refused: "yields no batch")."""
    from vae_ddp.cli import main_captured

    t = truth["rank_seeded"]
    out = tmp_path / "audit"
    code, stdout, stderr = main_captured(["audit", "--model", "examples/audit_models.py:Plain", "--data",
                                          "examples/audit_models.py:RankSeededWorkers", "--steps", "3",
                                          "--effect_batches", "0", "--out", str(out)], cwd=ROOT)
    log = stdout + stderr
    result = json.loads((out / "audit.json").read_text())
    d = result["unkeyed_draws"]["dataset"]
    assert code == 0 and result["exit_why"] == [] and result["within_floor"], log[-3000:]
    assert d["repeated"] is False and f"{t['distinct'][0]} distinct draws of {t['ranks'] * t['per_rank']}" in d["state"]
    assert "independent draws from one device's distribution" in log and "same augmentation" not in log
    rows = {f["factor"]: f for f in result["findings"]}
    assert not rows["noise"]["exposed"] and "- passed, in two parts" in log


def test_every_cause_of_the_noise_factor_is_listed_at_once():
    """The dataset's augmentation drawn alike on the ranks and dropout masks repeated across ranks (the ``ddp``
    run's ``DDPAudit`` finding): one row names both, with both fixes (the first audit named the augmentation only;
    the dropout masks came out only once it was fixed)."""
    dropout = {"factor": "noise", "manual": False, "evidence": "the training step draws random numbers and all 2 "
               "ranks draw the same ones (same torch seed): its dropout masks or noise repeat across ranks",
               "fix": "vae_ddp.fixes.PerRankSeed"}
    both = draws_verdict([], [], [dropout], verdict(SAME))["finding"]
    assert both["evidence"].startswith(dropout["evidence"] + "; the dataset draws random augmentation"), both
    assert both["fix"].startswith("vae_ddp.fixes.PerRankSeed; for the dataset's draws: seed the workers"), both
    alone = draws_verdict([], [], [], verdict(SAME))["finding"]
    assert "dropout" not in alone["evidence"]
