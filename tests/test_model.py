"""The VAE port and its loss, against references computed independently of the code under test:
closed-form Gaussian KL, hand-computed numbers, bolts' parameter count, torch's ``rsample``."""

import math

import pytest
import torch

from vae_ddp.model import VAE, vae_loss


def _normal(mu: torch.Tensor, std: torch.Tensor) -> torch.distributions.Normal:
    return torch.distributions.Normal(mu, std)


def _closed_form_kl(mu: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL(N(mu, std^2) || N(0, 1)) per element, written out (Kingma & Welling 2014, appendix B)."""
    return 0.5 * (std**2 + mu**2 - 1.0) - torch.log(std)


@pytest.fixture(scope="module")
def digits_batch() -> torch.Tensor:
    """16 images of the bundled digits, ``(16, 3, 32, 32)`` float32 (no data folder needed)."""
    from vae_ddp.data import DigitsDataModule

    dm = DigitsDataModule(batch_size=16)
    dm.setup()
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32
    return x


def test_resnet18_vae_has_bolts_parameter_count():
    # lightning-bolts 0.7.0: VAE(input_height=32) has exactly 20,057,088 parameters
    assert sum(p.numel() for p in VAE(input_height=32).parameters()) == 20_057_088


def test_closed_form_reference_at_known_values():
    """The reference itself, at values worked out by hand: KL(N(0,1)||N(0,1)) = 0,
    KL(N(1,1)||N(0,1)) = 1/2, KL(N(0,2^2)||N(0,1)) = (4 - 1)/2 - ln 2."""
    kl = _closed_form_kl(torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([1.0, 1.0, 2.0],
                                                                                         dtype=torch.float64))
    assert kl.tolist() == pytest.approx([0.0, 0.5, 1.5 - math.log(2.0)], abs=1e-15)


def test_analytic_kl_is_the_closed_form():
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(6, 5, generator=g, dtype=torch.float64)
    std = torch.rand(6, 5, generator=g, dtype=torch.float64) * 2 + 0.1
    z = mu.clone()  # unused by the analytic estimator
    x = torch.zeros(6, 3, 2, 2, dtype=torch.float64)
    _, logs = vae_loss(x, x, _normal(torch.zeros_like(mu), torch.ones_like(std)), _normal(mu, std), z,
                       kl_coeff=0.1, kl_estimator="analytic")
    assert float(logs["kl"]) == pytest.approx(0.1 * float(_closed_form_kl(mu, std).mean()), rel=1e-12)
    assert float(logs["recon_loss"]) == 0.0


def test_model_analytic_kl_is_the_closed_form_of_its_encoder(digits_batch):
    """Through the module: the KL term of ``VAE.step`` is the closed form at the encoder's ``mu, std``."""
    torch.manual_seed(0)
    model = VAE(enc_type="small", latent_dim=8, kl_estimator="analytic", kl_coeff=0.5).eval()
    with torch.no_grad():
        _, logs = model.step(digits_batch)
        h = model.encoder(digits_batch)
        mu, std = model.fc_mu(h), torch.exp(model.fc_var(h) / 2)
    assert float(logs["kl"]) == pytest.approx(0.5 * float(_closed_form_kl(mu.double(), std.double()).mean()), rel=1e-5)


def test_monte_carlo_kl_is_unbiased():
    """The report's one-sample estimator ``log q(z) - log p(z)``, averaged over many ``eps``,
    converges to the closed form: |mean - closed form| within 4 standard errors, the standard
    error estimated from the spread of 64 independent batches of 4096 draws each. A missing
    ``log std`` term would shift the mean by 0.13 here, about 70 standard errors."""
    mu = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    std = torch.tensor([0.3, 1.0, 2.5, 0.8], dtype=torch.float64)
    reference = float(_closed_form_kl(mu, std).mean())
    g = torch.Generator().manual_seed(1)
    n, batches = 4096, 64
    m, s = mu.expand(n, 4), std.expand(n, 4)
    p, q = _normal(torch.zeros_like(m), torch.ones_like(s)), _normal(m, s)
    x = torch.zeros(n, 1, dtype=torch.float64)
    estimates = []
    for _ in range(batches):
        z = m + s * torch.randn(n, 4, generator=g, dtype=torch.float64)
        _, logs = vae_loss(x, x, p, q, z, kl_coeff=1.0, kl_estimator="mc")
        estimates.append(float(logs["kl"]))
    est = torch.tensor(estimates, dtype=torch.float64)
    se = float(est.std() / math.sqrt(batches))
    assert 0 < se < 0.01
    assert abs(float(est.mean()) - reference) < 4 * se, (float(est.mean()), reference, se)


def test_mc_kl_at_given_eps_is_the_gaussian_log_density_ratio(digits_batch):
    """At a given ``eps``: log q(z) - log p(z) with the Gaussian log densities written out by hand
    (bolts of the report's era), times ``kl_coeff``."""
    torch.manual_seed(0)
    model = VAE(input_height=32, enc_type="small", latent_dim=8).eval()
    with torch.no_grad():
        h = model.encoder(digits_batch)
        mu, log_var = model.fc_mu(h), model.fc_var(h)
        eps = torch.randn_like(mu)
        _, logs = model.step(digits_batch, eps)
        std = torch.exp(log_var / 2)
        z = mu + eps * std
        log_q = -((z - mu) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        log_p = -(z**2) / 2 - 0.5 * math.log(2 * math.pi)
        x_hat = model.decoder(z)
    assert float(logs["kl"]) == pytest.approx(float((log_q - log_p).mean() * 0.1), rel=1e-5)
    assert float(logs["recon_loss"]) == pytest.approx(float(((x_hat - digits_batch) ** 2).mean()), rel=1e-5)


def test_recon_is_the_mean_squared_error_over_every_element():
    """Mean reduction over all elements (not a sum, not per image): hand-computed on 2 images of
    2 pixels: squared errors 1, 0, 4, 0 -> 5/4."""
    x = torch.tensor([0.0, 1.0, 2.0, 3.0]).reshape(2, 1, 1, 2)
    x_hat = torch.tensor([1.0, 1.0, 0.0, 3.0]).reshape(2, 1, 1, 2)
    mu, std = torch.zeros(2, 3), torch.ones(2, 3)
    loss, logs = vae_loss(x, x_hat, _normal(mu, std), _normal(mu, std), mu, kl_coeff=0.1, kl_estimator="analytic")
    assert float(logs["recon_loss"]) == 1.25
    assert float(logs["kl"]) == 0.0  # q == p
    assert float(loss) == 1.25


@pytest.mark.parametrize("enc_type", ["resnet18", "small"])
def test_forward_shapes_on_digits(enc_type, digits_batch):
    torch.manual_seed(0)
    model = VAE(input_height=32, enc_type=enc_type, latent_dim=16)
    x_hat = model(digits_batch)
    assert x_hat.shape == digits_batch.shape and x_hat.dtype == torch.float32
    _, logs = model.step(digits_batch)
    assert set(logs) == {"recon_loss", "kl", "loss"}
    assert all(v.shape == () and torch.isfinite(v) for v in logs.values())


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
