"""Per-rank random streams and the distributed sampler under Lightning 1.9.5 (and 2.x), measured
by examples/legacy/factor_check.py with 2 gloo processes."""

import json

import pytest

from conftest import MAIN_PYTHON, run

SCRIPT = "examples/legacy/factor_check.py"


@pytest.fixture(scope="module")
def pl1(tmp_path_factory, data_dir):
    out = tmp_path_factory.mktemp("fc1")
    proc = run([SCRIPT, "--out", out, "--data_dir", data_dir])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "factor_check.json").read_text())


def test_runs_on_195_with_two_ranks(pl1):
    assert pl1["pl_version"] == "1.9.5"
    assert set(pl1["configs"]) == {"seed42", "noseed", "per_rank_seed"}
    for c in pl1["configs"].values():
        assert c["world_size"] == 2 and c["steps"] == 2 and c["eps_shape"] == [2, 256]
        assert c["replay_exact"]  # the recorded eps is what q.rsample() drew
        assert all(s["indices_match_trained_batches"] for s in c["sampler"])  # indices are the trained images
        assert "pl_bolts" in c["model"]


def test_same_seed_gives_identical_eps_on_both_ranks(pl1):
    c = pl1["configs"]["seed42"]
    assert c["pl_global_seed"] == ["42", "42"] and c["initial_seed"] == [42, 42]
    assert c["eps_identical"]
    assert all(abs(r - 1) < 1e-9 for r in c["eps_corr_per_step"])
    assert c["eps_max_abs_diff_per_step"] == [0.0, 0.0]


def test_report_seed_everything_without_seed_is_shared_by_ranks(pl1):
    """The report's `seed_everything()`: a random seed on rank 0, passed to rank 1 by PL_GLOBAL_SEED."""
    c = pl1["configs"]["noseed"]
    s0, s1 = c["pl_global_seed"]
    assert s0 == s1 and s0 != "0"  # 1.9.5 draws a random seed; 2.x would use 0
    assert c["eps_identical"]


def test_per_rank_seed_decorrelates_eps(pl1):
    c = pl1["configs"]["per_rank_seed"]
    assert c["initial_seed"] == [42, 43]
    assert not c["eps_identical"]
    assert all(abs(r) < 0.3 for r in c["eps_corr_per_step"])  # 512 pairs: |r| ~ 0.04 for independent draws


def test_195_wraps_the_random_sampler(pl1):
    for name in ("seed42", "per_rank_seed"):
        for rank, s in enumerate(pl1["configs"][name]["sampler"]):
            assert s["class"] == "lightning_fabric.utilities.distributed.DistributedSamplerWrapper"
            assert s["wrapped_sampler"] == "torch.utils.data.sampler.RandomSampler"
            assert (s["seed"], s["shuffle"], s["num_replicas"], s["rank"]) == (42, True, 2, rank)
    assert pl1["configs"]["seed42"]["ddp_find_unused_parameters"] is True


def test_195_shards_are_disjoint_only_with_identical_generators(pl1):
    same = pl1["configs"]["seed42"]
    assert same["index_overlap"] == 0 and same["index_union"] == same["dataset_train_len"] == 8000
    # PerRankSeed changes the global generator the wrapped RandomSampler draws from:
    # the ranks' inner permutations differ and the shards overlap (about half, by chance)
    per_rank = pl1["configs"]["per_rank_seed"]
    heads = [s["inner_order_head"] for s in per_rank["sampler"]]
    assert heads[0] != heads[1]
    assert 1000 < per_rank["index_overlap"] < 3000
    assert per_rank["index_union"] < 8000


def test_trainer_facts_195(pl1):
    f = pl1["trainer_facts"]
    assert f["accelerator='ddp', devices=2"].startswith("ValueError: You selected an invalid accelerator name")
    assert f["accelerator='cpu', devices=2, strategy='dp'"].startswith("DDPStrategy (warning:")
    assert f["max_steps=None"].startswith("TypeError")
    assert f["Trainer.add_argparse_args exists"] is True


def test_bad_config_is_one_line(tmp_path):
    proc = run([SCRIPT, "--out", tmp_path, "--configs", "bogus"])
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown config bogus" in proc.stderr


def test_missing_data_dir_is_one_line(tmp_path):
    proc = run([SCRIPT, "--out", tmp_path, "--data_dir", tmp_path / "nope"])
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--data_dir" in proc.stderr


@pytest.mark.skipif(not MAIN_PYTHON.exists(), reason="no .venv (Lightning 2.x) to compare with: run `make setup`")
def test_2x_differs_where_recorded(tmp_path, data_dir):
    """Same measurement under Lightning 2.x: plain DistributedSampler, seed 0 without a seed,
    and PerRankSeed keeps the shards disjoint."""
    proc = run([SCRIPT, "--out", tmp_path, "--data_dir", data_dir, "--configs", "noseed,per_rank_seed"],
               python=MAIN_PYTHON)
    assert proc.returncode == 0, proc.stderr[-4000:]
    pl2 = json.loads((tmp_path / "factor_check.json").read_text())
    assert pl2["pl_version"].startswith("2.")
    noseed, per_rank = pl2["configs"]["noseed"], pl2["configs"]["per_rank_seed"]
    assert noseed["pl_global_seed"] == ["0", "0"] and noseed["eps_identical"]
    assert per_rank["sampler"][0]["class"] == "torch.utils.data.distributed.DistributedSampler"
    assert "wrapped_sampler" not in per_rank["sampler"][0]
    assert not per_rank["eps_identical"]
    assert per_rank["index_overlap"] == 0 and per_rank["index_union"] == 8000
    assert per_rank["ddp_find_unused_parameters"] is False
    assert pl2["trainer_facts"]["accelerator='cpu', devices=2, strategy='dp'"].startswith("ValueError")


def test_committed_results_are_current(pl1):
    """The numbers on docs/legacy.md (examples/legacy/results/pl1) are what this code measures now."""
    from conftest import ROOT

    committed = json.loads((ROOT / "examples/legacy/results/pl1/factor_check.json").read_text())
    assert committed["pl_version"] == pl1["pl_version"]
    for name in ("seed42", "per_rank_seed"):  # the seeded configurations are deterministic
        old, new = committed["configs"][name], pl1["configs"][name]
        for key in ("index_overlap", "index_union", "indices_first_steps", "eps_identical", "initial_seed"):
            assert old[key] == new[key], (name, key)
        assert old["eps_corr_per_step"] == pytest.approx(new["eps_corr_per_step"], abs=1e-6)
        assert [s.get("inner_order_head") for s in old["sampler"]] == [s.get("inner_order_head") for s in new["sampler"]]
    assert committed["trainer_facts"] == pl1["trainer_facts"]
