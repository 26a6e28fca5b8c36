"""lightning-bolts 0.7.0's VAE and the port (vae_ddp.model.VAE) are the same model.

All comparisons use bolts' weights loaded into the port, real CIFAR-10 images from the
shared subset (x: (8, 3, 32, 32)) and the noise eps: (8, 256) that bolts' q.rsample() drew.
"""

import pytest
import torch

import parity

TOL = 1e-6  # float32


@pytest.fixture(scope="module")
def batch(data_dir):
    return parity.load_images(data_dir, 8)


@pytest.fixture(scope="module")
def analytic_train(batch):
    return parity.compare_step("analytic", *batch, seed=0, train=True)


@pytest.fixture(scope="module")
def mc_train(batch):
    return parity.compare_step("mc", *batch, seed=0, train=True)


def test_images_are_real_cifar(batch):
    x, y = batch
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32
    assert 0.0 <= float(x.min()) and float(x.max()) <= 1.0
    assert float(x.std()) > 0.1  # photographs, not a constant tensor
    assert y.min() >= 0 and y.max() <= 9


def test_same_parameter_count_and_structure():
    bolts_model = parity.make_bolts("analytic", 0)
    s = parity.structure(bolts_model, parity.make_port(bolts_model, "analytic"))
    assert s["bolts_params"] == 20_057_088
    assert s["port_params"] == 20_057_088
    assert s["same_keys_in_order"] and s["same_shapes"]
    assert s["state_dict_entries"] == 241
    assert s["same_module_names_and_classes"]
    assert s["top_level"] == ["encoder", "decoder", "fc_mu", "fc_var"]


def test_port_loading_is_strict():
    """A missing key must fail: load_state_dict(strict=True) is what makes the parity meaningful."""
    bolts_model = parity.make_bolts("analytic", 0)
    sd = bolts_model.state_dict()
    sd.pop("fc_var.bias")
    from vae_ddp.model import VAE

    with pytest.raises(RuntimeError, match="fc_var.bias"):
        VAE(input_height=32).load_state_dict(sd, strict=True)


@pytest.mark.parametrize("which", ["analytic_train", "mc_train"])
def test_same_outputs_for_same_input_and_eps(which, request):
    r = request.getfixturevalue(which)
    assert r["eps_replay_exact"]
    assert r["eps_shape"] == [8, 256]
    for key in ("x_hat", "recon_loss", "kl", "loss"):
        assert r["max_abs_diff"][key] <= TOL, (which, key, r["max_abs_diff"])
    assert r["values_bolts"]["loss"] == pytest.approx(r["values_bolts"]["recon_loss"] + r["values_bolts"]["kl"])


@pytest.mark.parametrize("which", ["analytic_train", "mc_train"])
def test_same_gradients_and_batchnorm_statistics(which, request):
    r = request.getfixturevalue(which)
    assert r["grad"]["tensors"] == 124  # every parameter tensor of the model
    assert r["grad"]["max_abs_grad"] > 1e-3  # the gradients are not trivially zero
    assert r["grad"]["max_abs_diff"] <= TOL
    assert r["buffers_after_step_max_abs_diff"] <= TOL


def test_mc_estimator_is_bolts_log_prob_formula(mc_train):
    """Port kl_estimator="mc" == kl_coeff * mean(q.log_prob(z) - p.log_prob(z)) with bolts' own p, q, z."""
    assert mc_train["max_abs_diff"]["kl_vs_bolts_log_prob_formula"] <= TOL
    assert mc_train["kl_bolts_log_prob_formula"] == pytest.approx(mc_train["values_port"]["kl"], abs=TOL)


def test_estimators_differ_so_the_comparison_can_fail(analytic_train, mc_train):
    """Same weights, images and eps: the analytic and mc KL differ (0.7.0 is not the report's loss)."""
    assert analytic_train["values_bolts"]["recon_loss"] == mc_train["values_bolts"]["recon_loss"]
    assert abs(analytic_train["values_bolts"]["kl"] - mc_train["values_bolts"]["kl"]) > 1e-4


def test_port_mc_does_not_match_bolts_070(batch):
    """Negative control: the port's default (mc) against bolts 0.7.0's own step differs."""
    bolts_model = parity.make_bolts("analytic", 0)
    port = parity.make_port(bolts_model, "mc")
    b = parity.bolts_step(bolts_model, *batch, seed=1)
    p = parity.port_step(port, batch[0], b["eps"])
    assert float((b["logs"]["kl"] - p["logs"]["kl"]).abs()) > 1e-4
    assert float((b["logs"]["recon_loss"] - p["logs"]["recon_loss"]).abs()) <= TOL


@pytest.mark.parametrize("kl", ["analytic", "mc"])
def test_same_outputs_in_eval_mode(batch, kl):
    r = parity.compare_step(kl, *batch, seed=0, train=False)
    for key in ("x_hat", "recon_loss", "kl", "loss"):
        assert r["max_abs_diff"][key] <= TOL, (kl, key, r["max_abs_diff"])


def test_committed_results_are_current(analytic_train, mc_train):
    """The numbers on docs/legacy.md (examples/legacy/results/parity.json) are what this code measures now."""
    import json

    from conftest import ROOT

    committed = json.loads((ROOT / "examples/legacy/results/parity.json").read_text())
    assert committed["structure"]["bolts_params"] == 20_057_088
    for key, fresh in (("analytic_train", analytic_train), ("mc_train", mc_train)):
        assert committed[key]["values_bolts"] == pytest.approx(fresh["values_bolts"], abs=1e-6)
        assert committed[key]["max_abs_diff"] == pytest.approx(fresh["max_abs_diff"], abs=1e-6)
        assert committed[key]["grad"]["max_abs_diff"] == pytest.approx(fresh["grad"]["max_abs_diff"], abs=1e-6)
