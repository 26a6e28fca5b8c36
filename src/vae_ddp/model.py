"""The report's VAE, ported to Lightning 2.x.

The ResNet-18 encoder/decoder and the ``VAE`` LightningModule follow
lightning-bolts 0.7.0 (``pl_bolts.models.autoencoders.components`` and
``pl_bolts.models.autoencoders.VAE``) layer for layer, so that bolts' weights load
into this port with the same parameter names. bolts cannot be imported beside
Lightning 2.x (it pins ``pytorch-lightning<2.0``), hence the port.

The loss is written once, in [`vae_loss`][vae_ddp.model.vae_loss]; every model variant and every
configuration (single, ddp, dp) calls it.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from pytorch_lightning import LightningModule
from torch import Tensor, nn

__all__ = ["VAE", "vae_loss", "resnet18_encoder", "resnet18_decoder", "MODELS", "KL_ESTIMATORS"]

#: Model names accepted by ``VAE(enc_type=...)`` and ``vae-ddp --model``.
MODELS = ("resnet18", "small")
#: ``"mc"``: one-sample Monte Carlo estimate ``log q(z|x) - log p(z)`` (bolts of the report's
#: era, Lightning 1.2); ``"analytic"``: closed-form ``KL(q || p)`` (what bolts 0.7.0 computes).
KL_ESTIMATORS = ("mc", "analytic")
#: ``"adam"`` (the report's, ``torch.optim.Adam`` defaults) or ``"sgd"`` (plain
#: ``torch.optim.SGD``, to tell Adam's share of a divergence from the rest).
OPTIMIZERS = ("adam", "sgd")


# --------------------------------------------------------------------------- ResNet-18 parts
class Interpolate(nn.Module):
    """``nn.Module`` wrapper of ``F.interpolate`` (as in bolts)."""

    def __init__(self, size: Optional[int] = None, scale_factor: Optional[float] = None) -> None:
        super().__init__()
        self.size, self.scale_factor = size, scale_factor

    def forward(self, x: Tensor) -> Tensor:
        return F.interpolate(x, size=self.size, scale_factor=self.scale_factor)


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


def resize_conv3x3(in_planes: int, out_planes: int, scale: int = 1) -> nn.Module:
    if scale == 1:
        return conv3x3(in_planes, out_planes)
    return nn.Sequential(Interpolate(scale_factor=scale), conv3x3(in_planes, out_planes))


def resize_conv1x1(in_planes: int, out_planes: int, scale: int = 1) -> nn.Module:
    if scale == 1:
        return conv1x1(in_planes, out_planes)
    return nn.Sequential(Interpolate(scale_factor=scale), conv1x1(in_planes, out_planes))


class EncoderBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class DecoderBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, scale: int = 1, upsample: Optional[nn.Module] = None):
        super().__init__()
        self.conv1 = resize_conv3x3(inplanes, inplanes)
        self.bn1 = nn.BatchNorm2d(inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = resize_conv3x3(inplanes, planes, scale)
        self.bn2 = nn.BatchNorm2d(planes)
        self.upsample = upsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.upsample is not None:
            identity = self.upsample(x)
        out += identity
        return self.relu(out)


class ResNetEncoder(nn.Module):
    """ResNet encoder: ``x: (B, 3, H, W)`` -> ``(B, 512)``."""

    def __init__(self, block=EncoderBlock, layers=(2, 2, 2, 2), first_conv: bool = False, maxpool1: bool = False):
        super().__init__()
        self.inplanes = 64
        self.first_conv, self.maxpool1 = first_conv, maxpool1
        if first_conv:
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        if maxpool1:
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        else:
            self.maxpool = nn.MaxPool2d(kernel_size=1, stride=1)
        self.layer1 = self._make_layer(block, 64, layers[0])
        self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
        self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
        self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return torch.flatten(self.avgpool(x), 1)


class ResNetDecoder(nn.Module):
    """ResNet in reverse order: ``z: (B, latent_dim)`` -> ``(B, 3, input_height, input_height)``."""

    def __init__(self, block=DecoderBlock, layers=(2, 2, 2, 2), latent_dim: int = 256, input_height: int = 32,
                 first_conv: bool = False, maxpool1: bool = False):
        super().__init__()
        self.expansion = block.expansion
        self.inplanes = 512 * block.expansion
        self.first_conv, self.maxpool1, self.input_height = first_conv, maxpool1, input_height
        self.upscale_factor = 8
        self.linear = nn.Linear(latent_dim, self.inplanes * 4 * 4)
        self.layer1 = self._make_layer(block, 256, layers[0], scale=2)
        self.layer2 = self._make_layer(block, 128, layers[1], scale=2)
        self.layer3 = self._make_layer(block, 64, layers[2], scale=2)
        if maxpool1:
            self.layer4 = self._make_layer(block, 64, layers[3], scale=2)
            self.upscale_factor *= 2
        else:
            self.layer4 = self._make_layer(block, 64, layers[3])
        if first_conv:
            self.upscale = Interpolate(scale_factor=2)
            self.upscale_factor *= 2
        else:
            self.upscale = Interpolate(scale_factor=1)
        self.upscale1 = Interpolate(size=input_height // self.upscale_factor)
        self.conv1 = nn.Conv2d(64 * block.expansion, 3, kernel_size=3, stride=1, padding=1, bias=False)

    def _make_layer(self, block, planes: int, blocks: int, scale: int = 1) -> nn.Sequential:
        upsample = None
        if scale != 1 or self.inplanes != planes * block.expansion:
            upsample = nn.Sequential(
                resize_conv1x1(self.inplanes, planes * block.expansion, scale), nn.BatchNorm2d(planes * block.expansion)
            )
        layers = [block(self.inplanes, planes, scale, upsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear(x).view(x.size(0), 512 * self.expansion, 4, 4)
        x = self.upscale1(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.conv1(self.upscale(x))


def resnet18_encoder(first_conv: bool = False, maxpool1: bool = False) -> ResNetEncoder:
    return ResNetEncoder(EncoderBlock, [2, 2, 2, 2], first_conv, maxpool1)


def resnet18_decoder(latent_dim: int, input_height: int, first_conv: bool = False, maxpool1: bool = False):
    return ResNetDecoder(DecoderBlock, [2, 2, 2, 2], latent_dim, input_height, first_conv, maxpool1)


# --------------------------------------------------------------------------- small model
def small_encoder() -> nn.Sequential:
    """Three stride-2 conv + BatchNorm + ReLU layers: ``x: (B, 3, 32, 32)`` -> ``(B, 2048)``."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.Conv2d(32, 64, 4, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.Conv2d(64, 128, 4, 2, 1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
        nn.Flatten(),
    )


def small_decoder(latent_dim: int) -> nn.Sequential:
    """Mirror of [`small_encoder`][vae_ddp.model.small_encoder]: ``z: (B, latent_dim)`` -> ``(B, 3, 32, 32)``."""
    return nn.Sequential(
        nn.Linear(latent_dim, 128 * 4 * 4), nn.Unflatten(1, (128, 4, 4)),
        nn.ConvTranspose2d(128, 64, 4, 2, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(),
        nn.ConvTranspose2d(32, 3, 4, 2, 1),
    )


# --------------------------------------------------------------------------- the loss
def vae_loss(x: Tensor, x_hat: Tensor, p: torch.distributions.Normal, q: torch.distributions.Normal, z: Tensor,
             kl_coeff: float, kl_estimator: str = "mc") -> tuple[Tensor, dict[str, Tensor]]:
    """The VAE loss of the report: ``recon_loss + kl_coeff * KL``.

    Args:
        x: input images, ``(B, 3, H, W)``.
        x_hat: reconstructions, same shape as ``x``.
        p: prior ``N(0, I)``, batch shape ``(B, latent_dim)``.
        q: approximate posterior ``N(mu, std)``, batch shape ``(B, latent_dim)``.
        z: the reparameterized sample ``mu + std * eps``, ``(B, latent_dim)``.
        kl_coeff: weight of the KL term (0.1 in the report).
        kl_estimator: ``"mc"`` uses ``log q(z|x) - log p(z)`` at the one sample ``z``
            (lightning-bolts of the report's era); ``"analytic"`` uses
            ``torch.distributions.kl_divergence(q, p)`` (lightning-bolts 0.7.0).

    Returns:
        ``(loss, logs)``: scalar loss and ``{"recon_loss", "kl", "loss"}``, each a scalar
        tensor averaged over every element of the batch (mean reduction), with ``kl``
        already multiplied by ``kl_coeff``.

    Raises:
        ValueError: unknown ``kl_estimator``.
    """
    recon_loss = F.mse_loss(x_hat, x, reduction="mean")
    if kl_estimator == "mc":
        kl = q.log_prob(z) - p.log_prob(z)
    elif kl_estimator == "analytic":
        kl = torch.distributions.kl_divergence(q, p)
    else:
        raise ValueError(f"unknown kl_estimator {kl_estimator!r}: use one of {KL_ESTIMATORS}")
    kl = kl.mean() * kl_coeff
    loss = kl + recon_loss
    return loss, {"recon_loss": recon_loss, "kl": kl, "loss": loss}


def standard_normal_noise(mu: Tensor) -> Tensor:
    """Default reparameterization noise: exactly what ``Normal(mu, std).rsample()`` draws
    (``torch.empty(shape).normal_()`` on the global generator, torch 2.x)."""
    return torch.empty_like(mu).normal_()


# --------------------------------------------------------------------------- the module
class VAE(LightningModule):
    """Standard VAE with Gaussian prior and approximate posterior (lightning-bolts' ``VAE``).

    Args:
        input_height: image height and width in pixels (32 for CIFAR-10).
        enc_type: ``"resnet18"`` (the report's model: bolts' ``resnet18_encoder`` /
            ``resnet18_decoder``, 20,057,088 parameters at ``input_height=32``) or
            ``"small"`` (three conv layers each way, for fast CPU runs; same loss code).
        first_conv: bolts switch: 7x7 stride-2 first conv instead of 3x3 stride 1.
        maxpool1: bolts switch: max-pool after the first conv.
        enc_out_dim: encoder output width (512 for resnet18; ignored for small).
        kl_coeff: weight of the KL term.
        latent_dim: dimension of ``z``.
        lr: Adam learning rate.
        kl_estimator: see [`vae_loss`][vae_ddp.model.vae_loss]; ``"mc"`` is the report's.
        optimizer: ``"adam"`` (the report's) or ``"sgd"``; see ``OPTIMIZERS``.
        sync_dist_logging: pass ``sync_dist=True`` to ``self.log_dict`` for the training
            metrics (off by default, as in bolts: then under DDP the logged step value
            is rank 0's alone).

    Raises:
        ValueError: unknown ``enc_type`` or ``kl_estimator`` (bolts silently fell back to
            resnet18 on an unknown name; this port refuses it).

    Attributes:
        noise: callable ``mu -> eps`` with ``eps`` of ``mu``'s shape and dtype used by the
            reparameterization trick during training. Default:
            [`standard_normal_noise`][vae_ddp.model.standard_normal_noise].
            The fixes in [`vae_ddp.fixes.noise`][vae_ddp.fixes.noise] replace it.
        last_logs: detached ``{"recon_loss", "kl", "loss"}`` of the last training step and
            ``"batch_size"``, for callbacks that record global-batch values.
    """

    def __init__(self, input_height: int = 32, enc_type: str = "resnet18", first_conv: bool = False,
                 maxpool1: bool = False, enc_out_dim: int = 512, kl_coeff: float = 0.1, latent_dim: int = 256,
                 lr: float = 1e-4, kl_estimator: str = "mc", sync_dist_logging: bool = False,
                 optimizer: str = "adam") -> None:
        super().__init__()
        if enc_type not in MODELS:
            raise ValueError(f"unknown model {enc_type!r}: use one of {', '.join(MODELS)}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        if kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {kl_estimator!r}: use one of {', '.join(KL_ESTIMATORS)}")
        self.save_hyperparameters()
        self.lr, self.kl_coeff, self.latent_dim, self.input_height = lr, kl_coeff, latent_dim, input_height
        self.kl_estimator, self.sync_dist_logging, self.optimizer_name = kl_estimator, sync_dist_logging, optimizer
        if enc_type == "resnet18":
            self.enc_out_dim = enc_out_dim
            self.encoder = resnet18_encoder(first_conv, maxpool1)
            self.decoder = resnet18_decoder(latent_dim, input_height, first_conv, maxpool1)
        else:
            if input_height != 32:
                raise ValueError(f"the small model needs input_height 32, got {input_height}")
            self.enc_out_dim = 128 * 4 * 4
            self.encoder = small_encoder()
            self.decoder = small_decoder(latent_dim)
        self.fc_mu = nn.Linear(self.enc_out_dim, latent_dim)
        self.fc_var = nn.Linear(self.enc_out_dim, latent_dim)
        self.noise: Callable[[Tensor], Tensor] = standard_normal_noise
        self.last_logs: dict[str, Tensor] = {}

    def sample(self, mu: Tensor, log_var: Tensor, eps: Optional[Tensor] = None):
        """Reparameterization trick: ``z = mu + exp(log_var / 2) * eps``.

        ``mu, log_var: (B, latent_dim)``; ``eps`` defaults to ``self.noise(mu)``.
        Returns ``(p, q, z)`` as bolts does.
        """
        std = torch.exp(log_var / 2)
        p = torch.distributions.Normal(torch.zeros_like(mu), torch.ones_like(std))
        q = torch.distributions.Normal(mu, std)
        if eps is None:
            eps = self.noise(mu)
        z = mu + eps * std  # == q.rsample() given the same eps
        return p, q, z

    def _run_step(self, x: Tensor, eps: Optional[Tensor] = None):
        h = self.encoder(x)
        mu, log_var = self.fc_mu(h), self.fc_var(h)
        p, q, z = self.sample(mu, log_var, eps)
        return z, self.decoder(z), p, q

    def forward(self, x: Tensor, eps: Optional[Tensor] = None) -> Tensor:
        """Reconstruction ``x_hat: (B, 3, H, W)`` of ``x: (B, 3, H, W)`` at one sample of ``z``."""
        return self._run_step(x, eps)[1]

    def step(self, x: Tensor, eps: Optional[Tensor] = None) -> tuple[Tensor, dict[str, Tensor]]:
        """Loss of one batch ``x: (B, 3, H, W)``; see [`vae_loss`][vae_ddp.model.vae_loss]."""
        z, x_hat, p, q = self._run_step(x, eps)
        return vae_loss(x, x_hat, p, q, z, self.kl_coeff, self.kl_estimator)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        loss, logs = self.step(x)
        self.last_logs = {k: v.detach() for k, v in logs.items()}
        self.last_logs["batch_size"] = torch.tensor(float(len(x)), dtype=loss.dtype, device=loss.device)
        self.log_dict({f"train_{k}": v for k, v in logs.items()}, on_step=True, on_epoch=False,
                      sync_dist=self.sync_dist_logging, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        loss, logs = self.step(batch[0])
        self.log_dict({f"val_{k}": v for k, v in logs.items()}, sync_dist=self.sync_dist_logging,
                      batch_size=len(batch[0]))
        return loss

    def configure_optimizers(self):
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.lr)
        return torch.optim.Adam(self.parameters(), lr=self.lr)
