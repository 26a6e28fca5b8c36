"""The audit judges the whole step, on every rank: the learning rate, the update, the buffers and
the ranks' parameters after each step, besides the gradient (`vae_ddp.audit.whole_step`).

The rules on records whose answer is known (no process started), then `vae-ddp audit` on modules
whose DDP trains something else although its gradient is one device's, each against its ground
truth measured by `tests/scripts/whole_step_truth.py` (plain Lightning DDP on 2 gloo ranks
against one device, float64; it does not import vae_ddp).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from vae_ddp import guard
from vae_ddp.audit import whole_step
from helpers import ROOT, imported_modules

EPS64 = torch.finfo(torch.float64).eps


def record(updates, buffers=None, lrs=None, ranks=None, names=None, norms=None) -> dict:
    """A StepProbe record of len(updates) batches, one optimizer step each."""
    n = len(updates)
    buffers = buffers if buffers is not None else [torch.zeros(0, dtype=torch.float64)] * n
    return {"updates": updates, "buffer_updates": buffers, "lrs": lrs or [[0.01]] * n,
            "grad_batches": list(range(n)), "norms": norms or [[1.0, 1.0]] * n,
            "ranks_apart": ranks if ranks is not None else [0.0] * n,
            "ranks_apart_names": names or [[] for _ in range(n)],
            "param_names": [["w", len(updates[0])]],
            "buffer_names": [["b", len(buffers[0])]] if len(buffers[0]) else []}


def vec(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_a_step_within_its_floor_has_no_difference():
    single = record([vec(1e-2, -1e-2), vec(1e-2, 1e-2)], buffers=[vec(0.1), vec(0.2)])
    ddp = record([vec(1e-2 + 1e-17, -1e-2), vec(1e-2, 1e-2)], buffers=[vec(0.1), vec(0.2 + 1e-17)])
    floor = record([vec(1e-2, -1e-2 + 1e-17), vec(1e-2 + 1e-17, 1e-2)], buffers=[vec(0.1 + 1e-17), vec(0.2)])
    out = whole_step.compare(ddp, single, [floor], EPS64)
    assert out["differences"] == [] and out["update_ratio"] <= 2 and out["buffer_ratio"] <= 2, out
    assert out["buffer_count"] == 1


def test_each_part_is_named_at_the_first_step_where_it_differs():
    single = record([vec(1e-2, -1e-2)] * 3, buffers=[vec(0.1)] * 3)
    floor = record([vec(1e-2, -1e-2)] * 3, buffers=[vec(0.1)] * 3)
    # the rate doubled from the second step, the buffers differ at the third, the ranks apart at the first
    ddp = record([vec(1e-2, -1e-2), vec(2e-2, -2e-2), vec(2e-2, -2e-2)], buffers=[vec(0.1), vec(0.1), vec(0.3)],
                 lrs=[[0.01], [0.02], [0.02]], ranks=[1e-3, 0.0, 0.0],
                 names=[[["emb.weight", 1e-3, "Embedding(max_norm=1.0)"]], [], []])
    out = whole_step.compare(ddp, single, [floor], EPS64)
    parts = [(d["part"], d["step"]) for d in out["differences"]]
    assert parts == [("ranks", 0), ("learning rate", 1), ("update", 1), ("buffers", 2)], parts
    lr = out["differences"][1]
    assert lr["ratio"] == 2.0 and lr["detail"]["ddp"] == [0.02] and lr["detail"]["single"] == [0.01]
    assert out["differences"][0]["names"][0]["module"] == "Embedding(max_norm=1.0)"
    assert out["differences"][2]["names"] == [{"name": "w", "max_abs_diff": pytest.approx(1e-2)}]


def test_float32_rounding_of_the_stored_parameters_is_not_a_difference():
    """A float32 parameter is stored to 24 bits: one flipped last bit of a 0.5 weight changes a 1e-3
    update by 3e-8 / 1e-3, far above the gradient's floor. One rounding of every stored value
    (eps * ||θ||) is the least difference the update is judged by; ten such roundings are not."""
    eps = torch.finfo(torch.float32).eps
    single = record([vec(1e-3, 1e-3)], norms=[[0.7, 0.0]])
    floor = record([vec(1e-3, 1e-3)], norms=[[0.7, 0.0]])
    flipped = record([vec(1e-3 + eps * 0.5, 1e-3)], norms=[[0.7, 0.0]])
    assert whole_step.compare(flipped, single, [floor], eps)["differences"] == []
    ten = record([vec(1e-3 + 10 * eps * 0.5, 1e-3)], norms=[[0.7, 0.0]])
    assert [d["part"] for d in whole_step.compare(ten, single, [floor], eps)["differences"]] == ["update"]


def test_records_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="2 training batches compared with one device's 1"):
        whole_step.compare(record([vec(1.0)] * 2), record([vec(1.0)]), [], EPS64)


def test_a_gradient_scaled_by_the_world_size_is_recognised():
    g = [torch.randn(50, dtype=torch.float64, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    assert whole_step.scaled_by_world_size([x / 2 for x in g], g, 2) == 0.5
    assert whole_step.scaled_by_world_size([x * 4 for x in g], g, 4) == 4.0
    assert whole_step.scaled_by_world_size([x / 3 for x in g], g, 2) is None  # not the world size
    bent = [x / 2 for x in g]
    bent[1] = bent[1] + 0.1 * torch.randn(50, dtype=torch.float64)  # not one device's direction
    assert whole_step.scaled_by_world_size(bent, g, 2) is None


# --- the audit on modules whose DDP trains something else, against ground truth from outside vae_ddp

#: module of examples/audit_models.py -> (the audit's row that names it, words of its evidence)
CASES = {
    "ScaledLearningRate": ("update", "the learning rate is multiplied by the world size"),
    "ScheduleFromLoader": ("update", "the learning rate differs at step 1"),  # reads trainer.max_epochs: 2
    "MovingAverage": ("buffers", "feature_mean"),
    "RenormalisedEmbedding": ("parameters", "nn.Embedding(max_norm=...) renormalises in place"),
    "LossOverWorldSize": ("gradient_scale", "one device's times 0.5 at every step"),
}


#: datamodule of examples/audit_models.py -> (the sampler row exposed?, words of its evidence)
DATA = {
    "Stream": (True, "every rank received the same first training batch"),
    "ShardedStream": (False, "no shuffling DistributedSampler"),
    "Weighted": (True, "DistributedSamplerWrapper(shuffle=True)"),
}


@pytest.fixture(scope="module")
def truth(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("truth") / "truth.json"
    proc = guard.run([sys.executable, str(ROOT / "tests/scripts/whole_step_truth.py"), str(out), "Plain", *CASES,
                      "HardExamples", "AttentionWithoutDropout", *(f"Plain@{d}" for d in DATA)],
                     capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_ground_truth_script_does_not_use_vae_ddp():
    """Neither it (lazily either) nor the models it imports (examples/audit_models.py, at its top level:
    two fixed variants the truth does not run, GlobalTokens and PaddedTokens, import the fix lazily)
    import vae_ddp."""
    for script in ("tests/scripts/whole_step_truth.py", "examples/audit_models.py"):
        names = imported_modules(script, lazy=not script.startswith("examples/"))
        assert names and not [m for m in names if m.startswith("vae_ddp")], (script, names)


def run_audit(tmp_path: Path, model: str, *args: str, data: str = "Regression") -> tuple[int, dict, str]:
    from vae_ddp.cli import main_captured

    out = tmp_path / "audit"
    code, stdout, stderr = main_captured(["audit", "--model", f"examples/audit_models.py:{model}", "--data",
                                          f"examples/audit_models.py:{data}", "--steps", "3", "--out", str(out),
                                          *args], cwd=ROOT)
    return code, json.loads((out / "audit.json").read_text()), stdout + stderr


@pytest.mark.parametrize("model", list(CASES))
def test_a_ddp_step_that_differs_besides_the_gradient_fails_and_is_named(tmp_path, truth, model, generated):
    t = truth[model]
    # the truth: DDP trains another model (or another learning rate) than one device, far above rounding
    assert t["ddp"] > 1e6 * max(t["floor"], EPS64) or t["lrs_ddp"] != t["lrs_single"], t
    # the user's max_epochs reaches the module (the audit stops the runs by --steps); the page's audit is read
    if model == "ScheduleFromLoader":
        result = generated("audit_schedule", "audit.json")
        code, log = (0 if result["within_floor"] else 1), (ROOT / "docs/generated/audit_schedule/output.md").read_text()
    else:
        code, result, log = run_audit(tmp_path, model, "--trainer.max_epochs", "2")
    key, words = CASES[model]
    rows = {f["factor"]: f for f in result["findings"]}
    assert code == 1 and not result["within_floor"] and not result["unexplained"], log[-3000:]
    assert rows[key]["exposed"] and words in rows[key]["evidence"], rows[key]
    assert result["findings"][0]["exposed"], result["findings"][0]  # ranked above what is clean
    assert result["trajectory_ratio"] > 1e3 and not result["trajectory_within"]
    if key == "gradient_scale":
        assert not result["gradient_within"] and result["whole_step"]["gradient_scale"] == 0.5
    else:  # the gradient is one device's: the old verdict passed these models
        assert result["gradient_within"], result["ratio_to_floor"]
        first = result["whole_step"]["differences"][0]
        part = {"update": "learning rate", "buffers": "buffers", "parameters": "ranks"}[key]
        assert first["part"] == part, first
        # the exit's reason names the part, never the gradient that is within its floor (#63 item 7)
        why = result["exit_why"][-1]
        assert f"the {part} at step {first['step']}" in why and "gradient" not in why, result["exit_why"]
        if part == "learning rate":  # the rates the audit saw are the rates plain Lightning trains with
            step = first["detail"]["optimizer_step"]
            assert first["detail"]["ddp"] == t["lrs_ddp"][step] and first["detail"]["single"] == t["lrs_single"][step]
        if part == "ranks":
            assert t["ranks"] > 1e6 * max(t["floor"], EPS64) and first["names"][0]["name"] == t["worst"]
        if part == "buffers":
            assert first["names"][0]["name"] == t["worst"] == "feature_mean"
    assert "- not passed: " in log and "- passed" not in log
    assert result["trainer"] == {"max_epochs": 2} and "max_epochs=2" in log
    # what the step left for the user's code was seen inside the launch (no run's DDPAudit names it): DDP with
    # every fix measured its effect (effect-fixed, trained or the same as a run trained)
    assert "effect-fixed" in result["runs"] + list(result["same_runs"]), result["runs"]


def test_a_clean_module_is_clean_by_the_ground_truth_too(truth):
    """The audit passes `Plain` with the whole step compared (tests/audit/test_study.py::test_no_exposure);
    plain Lightning agrees: DDP's parameters after 3 steps within rounding of one device's."""
    t = truth["Plain"]
    assert t["ddp"] <= 10 * max(t["floor"], EPS64) and t["ranks"] == 0 and t["lrs_ddp"] == t["lrs_single"], t


def test_a_loss_that_turns_nan_is_one_line_naming_the_run_rank_and_step(tmp_path):
    """`Diverging` returns NaN from its second step: exit code 3, the run, the rank and the batch in the
    error line, and no audit.json that could read as a verdict. The last line names the process that failed
    first, the one-device runs' (it blamed "rank 1 of run 'single'", a rank that run does not have: DDP's
    rank 1 failed after it, for want of the reference's weights), and the DDP run that failed because of it."""
    from vae_ddp.cli import main_captured

    out = tmp_path / "audit"
    code, stdout, stderr = main_captured(["audit", "--model", "examples/audit_models.py:Diverging", "--data",
                                          "examples/audit_models.py:Regression", "--steps", "3", "--out", str(out)],
                                         cwd=ROOT)
    first = next(line for line in stderr.strip().splitlines() if not line.startswith("[audit] "))  # (progress)
    assert code == 3 and not (out / "audit.json").exists(), stderr[-2000:]
    assert "run 'single': the gradient is not finite (NaN or infinite) at training batch 1 on rank 0" in first, first
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"one device's process \(PID \d+\) failed first, in run 'single'; then rank "
                        r"\d of run '[^']+' exited with code 1 after step \d", last), last
    log = (out / "runs" / "stderr.log").read_text()
    assert "RuntimeError: no reference weights: run 'single' failed" in log, log[-3000:]


@pytest.mark.parametrize("data", list(DATA))
def test_the_users_data_is_audited_as_the_user_trains_on_it(tmp_path, truth, data):
    """A stream every rank iterates whole, a stream sharded by rank and a WeightedRandomSampler: each
    is audited (an IterableDataset once crashed the sampler fix), the one-device reference and the
    fixed DDP take the user's own draws, dealt in contiguous chunks, and with the fixes DDP computes a
    plain module's step. The whole stream is named, and measured by the ablation, as plain Lightning
    shows it: every rank received the same first batch, and DDP trains another model (exit 1)."""
    exposed, words = DATA[data]
    code, result, log = run_audit(tmp_path, "Plain", data=data)
    sampler = {f["factor"]: f for f in result["findings"]}["sampler"]
    # with the fixes DDP computes one device's step; as it is run, a stream every rank reads whole gives every
    # rank the same batches: another model (exit 1, the sampler named); the others take other samples only
    assert result["within_floor"] and code == (1 if data == "Stream" else 0), log[-3000:]
    assert result["exit_why"] == (["sampler"] if data == "Stream" else []), result["exit_why"]
    assert sampler["exposed"] == exposed and words in sampler["evidence"], sampler
    if data in {"Stream", "ShardedStream"}:
        t = truth[f"Plain@{data}"]
        assert t["same_first_batch"] == (data == "Stream"), t
        if data == "Stream":  # plain Lightning: one per-device batch twice, another model after 3 steps
            assert t["ddp"] > 1e6 * max(t["floor"], EPS64) and sampler["bites"], (t, sampler)
        else:  # each rank its shard: the union of step k's batches is one device's batch k
            assert t["ddp"] <= 10 * max(t["floor"], EPS64), t


def test_bf16_mixed_is_judged_against_a_floor_that_is_never_zero(tmp_path):
    """Under bf16 autocast a permuted batch can give exactly the same gradient (a floor of 0) while
    DDP differs by a fraction of bfloat16's rounding unit: the least difference counted is that unit
    (for the gradient, the buffers and the K free steps), and a clean module passes. The update is
    not judged there: Adam flips the smallest elements of a gradient within a fraction of that unit."""
    from vae_ddp.audit.study import rounding_unit

    assert rounding_unit("float32", "bf16-mixed") == torch.finfo(torch.bfloat16).eps
    assert rounding_unit("float64", None) == EPS64 and rounding_unit("float32", "32-true") == torch.finfo().eps
    code, result, log = run_audit(tmp_path, "Plain", "--trainer.precision", "bf16-mixed")
    assert code == 0 and result["within_floor"] and result["dtype"] == "float32", log[-3000:]
    assert (result["rounding_unit"] == torch.finfo(torch.bfloat16).eps
            and result["trainer"] == {"precision": "bf16-mixed"})
    assert 0 < max(result["grad_steps"]) < result["rounding_unit"], result["grad_steps"]  # DDP differs, below one unit
    assert result["whole_step"]["update_floor"] >= result["rounding_unit"] and result["trajectory_within"]
    assert not result["whole_step"]["update_judged"] and "not judged under bf16-mixed" in log
    assert "machine epsilon of bfloat16" in log or result["floor"] >= result["rounding_unit"]


def test_16_mixed_on_a_cpu_is_judged_as_the_bf16_mixed_that_runs(tmp_path):
    """Lightning runs ``precision="16-mixed"`` as bf16-mixed on a CPU (measured here with plain
    Lightning); judged in float16's smaller unit, a clean module was "unexplained" (exit 1). The audit
    compares what runs, in bfloat16's unit, and says so in a note."""
    import warnings

    from pytorch_lightning import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert Trainer(accelerator="cpu", precision="16-mixed", logger=False).precision == "bf16-mixed"
    code, result, log = run_audit(tmp_path, "Plain", "--trainer.precision", "16-mixed")
    assert code == 0 and result["within_floor"] and result["trainer"] == {"precision": "bf16-mixed"}, log[-3000:]
    assert result["rounding_unit"] == torch.finfo(torch.bfloat16).eps
    assert any(n.startswith("--trainer.precision 16-mixed runs as bf16-mixed on a CPU") for n in result["notes"])


def test_a_precision_the_audit_does_not_compare_is_one_line(tmp_path):
    from vae_ddp.cli import main_captured

    code, stdout, stderr = main_captured(["audit", "--model", "examples/audit_models.py:Plain", "--data",
                                          "examples/audit_models.py:Regression", "--trainer.precision", "8-true",
                                          "--out", str(tmp_path / "a")], cwd=ROOT)
    assert code == 2 and stderr.strip().splitlines() == [
        "vae-ddp audit: error: --trainer.precision '8-true' is not one the audit compares: give one of 64-true, "
        "32-true, bf16-mixed, 16-mixed"], stderr


def test_a_step_that_reads_the_trainer_is_still_checked_for_coupled_samples(tmp_path, truth):
    """Online hard example mining (the largest quarter of the batch's losses) that reads
    self.trainer.world_size: the one-process check runs with a Trainer attached and names the
    coupled loss (exit 1, with the fix), where it once skipped and the audit said 'unexplained'.
    Plain Lightning: DDP trains another model."""
    t = truth["HardExamples"]
    assert t["ddp"] > 1e6 * max(t["floor"], EPS64), t
    code, result, log = run_audit(tmp_path, "HardExamples")
    f = {x["factor"]: x for x in result["findings"]}["reduction"]
    assert code == 1 and not result["unexplained"] and f["exposed"] and not f["automatic_fix"], log[-3000:]
    assert "depends on the other samples of its batch" in f["evidence"], f
    # the advice tells outputs that meet (gather with gradients) from a statistic of the batch (all-reduce it)
    assert "self.all_gather(z, sync_grads=True)" in f["fix"] and "all-reduce that statistic" in f["fix"], f


@pytest.mark.parametrize("model, repeated", [("AttentionDropout", True), ("AttentionDropoutPerRank", False)])
def test_attention_dropout_gets_a_two_part_verdict(tmp_path, truth, model, repeated):
    """Dropout inside scaled_dot_product_attention draws masks no run can key to a sample (it was
    'not judged', exit 1, the layers named only in a log): the rest of the step is judged with that
    dropout off in every compared run (plain Lightning: without it DDP is one device), the layer is
    named, and the draws are judged by whether the ranks repeat them: the same masks on every rank
    under Lightning's seeding (exit 1, with the fix), different masks with per-rank seeds (exit 0)."""
    t = truth["AttentionWithoutDropout"]
    assert t["ddp"] <= 10 * max(t["floor"], EPS64), t
    code, result, log = run_audit(tmp_path, model)
    noise = {f["factor"]: f for f in result["findings"]}["noise"]
    assert result["deterministic"] and result["gradient_within"] and not result["unexplained"], log[-3000:]
    assert result["unkeyed_draws"] == {"attention": ["the LightningModule (%s, dropout_p=0.2)" % model],
                                       "torch": [], "repeated": repeated}, result["unkeyed_draws"]
    assert "in two parts, for draws no run can key to a sample as your code makes them, the dropout inside " \
           "scaled_dot_product_attention" in log
    if repeated:
        assert code == 1 and noise["exposed"] and not noise["automatic_fix"] and "PerRankSeed" in noise["fix"]
        assert "the draws no fix keys to a sample are the same on every rank" in log
    else:
        assert code == 0 and result["within_floor"] and "different on every rank" in log, log[-3000:]
        assert not noise["exposed"], noise


def test_the_same_command_gives_the_same_audit_json(tmp_path, generated):
    """The page's audit (registry entry audit_schedule, run by the results runner) and the same
    command here give the same audit.json: the runs, the one-process check and the judgement take
    every draw from the command's seed (the evidence once differed between two runs of one command)."""
    page = generated("audit_schedule", "audit.json")
    code, result, log = run_audit(tmp_path, "ScheduleFromLoader", "--trainer.max_epochs", "2")
    assert code == 1 and result == page, [k for k in set(result) | set(page) if result.get(k) != page.get(k)]


@pytest.mark.parametrize("model, repeated", [("NoisyStep", True), ("NoisyStepPerRank", False)])
def test_torch_draws_in_the_step_get_a_two_part_verdict(tmp_path, truth, model, repeated):
    """`torch.randn_like` in training_step (it was 'not judged', exit 1): every compared run keys the
    draw to the samples, the rest of the step is judged (plain Lightning: without the draw, DDP is one
    device), the call is named, and the draws are judged by whether the ranks repeat them."""
    t = truth["Plain"]
    assert t["ddp"] <= 10 * max(t["floor"], EPS64), t
    code, result, log = run_audit(tmp_path, model)
    noise = {f["factor"]: f for f in result["findings"]}["noise"]
    assert result["deterministic"] and result["gradient_within"] and not result["unexplained"], log[-3000:]
    assert result["unkeyed_draws"] == {"attention": [], "torch": [f"torch.randn_like in the LightningModule ({model})"],
                                       "repeated": repeated}, result["unkeyed_draws"]
    if repeated:
        assert code == 1 and noise["exposed"] and "global_batch_draw" in noise["fix"], log[-3000:]
    else:
        assert code == 0 and "- passed, in two parts: with the draws named above made alike" in log, log[-3000:]


def test_torch_draws_are_named_where_they_are_made():
    """The one-process check names each of torch's random functions by the innermost module running;
    a draw with its own generator is the caller's stream and is left alone."""
    from examples.audit_models import MaskInForward
    from vae_ddp.audit.draws import unkeyed_draws

    model = MaskInForward()
    x = torch.randn(4, 8)
    assert unkeyed_draws(model, lambda: model(x)) == ([], ["torch.rand_like in net.2 (Mask)"])
    g = torch.Generator().manual_seed(0)
    assert unkeyed_draws(model, lambda: torch.rand(3, generator=g)) == ([], [])
    # the dropout and drop-path layers the fixes serve draw with torch too: not the user's own draws
    from torchvision.ops import StochasticDepth

    served = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), StochasticDepth(0.5, "row"))
    assert unkeyed_draws(served, lambda: served(x)) == ([], [])


def test_keyed_torch_draws_give_each_rank_one_devices_rows():
    """The draws the compared runs make: a batch-shaped draw on rank r of N is rows [r*b, (r+1)*b) of one
    device's draw of the global batch, a draw of another shape is one device's whole draw, in-place and
    `_like` spellings alike; a permuted floor run reorders the rows with their samples."""
    from vae_ddp.audit.draws import _Keyed
    from vae_ddp.fixes.randomness import GlobalBatchStream

    def draws(rank, world, b, permutation=None):
        stream = GlobalBatchStream(5, rank, world)
        stream.step = 3
        with _Keyed(stream, b, permutation):
            x = torch.zeros(b, 2, dtype=torch.float64)
            return [torch.randn_like(x), torch.rand(b, 3), torch.rand(7), torch.empty(b, 2).uniform_(-1, 1),
                    torch.bernoulli(torch.full((b, 4), 0.5))]

    one = draws(0, 1, 4)
    ranks = [draws(r, 2, 2) for r in range(2)]
    for i, d in enumerate(one):
        if i == 2:  # no batch dimension: the same numbers on every rank
            assert all(torch.equal(r[i], d) for r in ranks)
        else:
            assert torch.equal(torch.cat([r[i] for r in ranks]), d), i
    assert one[0].dtype == torch.float64 and torch.equal(one[0], draws(0, 1, 4)[0])  # repeatable

    class Perm:  # what WithinBatchPermutation.follow does with its permutation
        perm = torch.tensor([2, 0, 3, 1])

        def follow(self, t):
            return t[self.perm] if len(t) == 4 else t

    permuted = draws(0, 1, 4, Perm())
    assert torch.equal(permuted[1], one[1][Perm.perm]) and torch.equal(permuted[2], one[2])
