import pytest
import torch

from vae_ddp.model import VAE, vae_loss


def test_resnet18_vae_has_bolts_parameter_count():
    # lightning-bolts 0.7.0: VAE(input_height=32) has exactly 20,057,088 parameters
    assert sum(p.numel() for p in VAE(input_height=32).parameters()) == 20_057_088


@pytest.mark.parametrize("enc_type", ["resnet18", "small"])
def test_forward_and_loss_on_real_cifar_batch(enc_type, cifar_batch):
    torch.manual_seed(0)
    model = VAE(input_height=32, enc_type=enc_type)
    x_hat = model(cifar_batch)
    assert x_hat.shape == cifar_batch.shape
    loss, logs = model.step(cifar_batch)
    assert set(logs) == {"recon_loss", "kl", "loss"}
    assert all(torch.isfinite(v) for v in logs.values())
    assert float(logs["loss"]) == pytest.approx(float(logs["recon_loss"] + logs["kl"]), rel=1e-6)
    assert 0.01 < float(logs["recon_loss"]) < 10  # images in [0, 1], untrained decoder


def test_loss_matches_bolts_formula_at_given_eps(cifar_batch):
    torch.manual_seed(0)
    model = VAE(input_height=32, enc_type="small", latent_dim=8).eval()
    h = model.encoder(cifar_batch)
    mu, log_var = model.fc_mu(h), model.fc_var(h)
    eps = torch.randn_like(mu)
    _, logs = model.step(cifar_batch, eps)
    std = torch.exp(log_var / 2)
    z = mu + eps * std
    # bolts (report era): kl = mean(log q(z|x) - log p(z)) * kl_coeff, written out by hand here
    log_q = -((z - mu) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * torch.log(torch.tensor(2 * torch.pi))
    log_p = -(z**2) / 2 - 0.5 * torch.log(torch.tensor(2 * torch.pi))
    assert float(logs["kl"]) == pytest.approx(float((log_q - log_p).mean() * 0.1), rel=1e-5)
    x_hat = model.decoder(z)
    assert float(logs["recon_loss"]) == pytest.approx(float(((x_hat - cifar_batch) ** 2).mean()), rel=1e-5)


def test_default_noise_is_the_rsample_stream():
    mu, std = torch.zeros(4, 3), torch.ones(4, 3)
    torch.manual_seed(7)
    z_ref = torch.distributions.Normal(mu, std).rsample()
    torch.manual_seed(7)
    model = VAE(enc_type="small", latent_dim=3)
    torch.manual_seed(7)
    _, _, z = model.sample(mu, torch.zeros(4, 3))
    assert torch.equal(z, z_ref)


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown model 'resnet999'"):
        VAE(enc_type="resnet999")
    with pytest.raises(ValueError, match="unknown kl_estimator"):
        VAE(enc_type="small", kl_estimator="exact")
    p = torch.distributions.Normal(torch.zeros(1), torch.ones(1))
    with pytest.raises(ValueError):
        vae_loss(torch.zeros(1), torch.zeros(1), p, p, torch.zeros(1), 0.1, "nope")
