"""Parity of lightning-bolts 0.7.0's ``VAE`` and the port ``vae_ddp.model.VAE``, measured.

Needs both importable, i.e. the legacy environment (``make legacy``: Lightning 1.9.5 +
lightning-bolts 0.7.0 + this project's package installed without dependencies).

Measures, on real CIFAR-10 images (the first ``n`` images of bolts' training split of the
ImageFolder tree):

- structure: parameter counts, ``state_dict`` keys and shapes, ``named_modules`` class names;
- one training-mode step with bolts' weights loaded into the port (``strict=True``) and the
  same reparameterization noise ``eps: (n, 256)`` (the noise bolts' ``q.rsample()`` drew,
  replayed exactly from the global generator): max absolute differences of the
  reconstruction ``x_hat: (n, 3, 32, 32)``, ``recon_loss``, ``kl``, ``loss``, every
  parameter gradient and the BatchNorm running statistics after the step, for

  * ``analytic``: bolts 0.7.0's own ``VAE.step`` vs the port with ``kl_estimator="analytic"``;
  * ``mc``: the report-era loss (``vae.py``'s ``ReportVAE.step``, bolts' ``p, q, z`` and
    ``q.log_prob(z) - p.log_prob(z)``) vs the port with ``kl_estimator="mc"``;

- the same in eval mode (BatchNorm running statistics) for the reconstruction and losses;
- the KL values of both estimators on the same batch (they are different estimators).

Usage::

    .venv-legacy/bin/python examples/legacy/parity.py --out DIR   # writes DIR/parity.json

Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
DEFAULT_DATA = str(HERE.parent.parent.parent / "shared" / "data" / "cifar10-jpg-subset")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

warnings.filterwarnings("ignore", module="pl_bolts")
warnings.filterwarnings("ignore", message=".*under review.*")


def load_images(data_dir: str = DEFAULT_DATA, n: int = 8) -> tuple[Tensor, Tensor]:
    """First ``n`` samples of bolts' training split: ``x: (n, 3, 32, 32) float32`` in
    ``[0, 1]`` and ``y: (n,) int64``."""
    from imagefolder_cifar10 import ImageFolderCIFAR10DataModule

    dm = ImageFolderCIFAR10DataModule(data_dir, batch_size=n, num_workers=0)
    dm.setup("fit")
    xs, ys = zip(*(dm.dataset_train[i] for i in range(n)))
    return torch.stack(xs), torch.tensor(ys)


def make_bolts(kl: str, seed: int = 0):
    """bolts' ``VAE(input_height=32)`` (``kl="analytic"``: bolts 0.7.0's step) or the
    report-era ``ReportVAE`` (``kl="mc"``), initialised after ``torch.manual_seed(seed)``."""
    from pl_bolts.models.autoencoders import VAE as BoltsVAE

    from vae import ReportVAE

    torch.manual_seed(seed)
    return BoltsVAE(input_height=32) if kl == "analytic" else ReportVAE(input_height=32, kl_estimator="mc")


def make_port(bolts_model, kl: str):
    """The port with bolts' weights (and BatchNorm buffers) loaded, ``strict=True``."""
    from vae_ddp.model import VAE as PortVAE

    port = PortVAE(input_height=32, enc_type="resnet18", kl_estimator=kl)
    port.load_state_dict(copy.deepcopy(bolts_model.state_dict()), strict=True)
    return port


def structure(bolts_model, port) -> dict:
    """Parameter counts and ``state_dict`` / module-tree comparison."""
    sb, sp = bolts_model.state_dict(), port.state_dict()
    mods_b = [(n, type(m).__name__) for n, m in bolts_model.named_modules() if n]
    mods_p = [(n, type(m).__name__) for n, m in port.named_modules() if n]
    return {
        "bolts_params": sum(p.numel() for p in bolts_model.parameters()),
        "port_params": sum(p.numel() for p in port.parameters()),
        "state_dict_entries": len(sb),
        "same_keys_in_order": list(sb) == list(sp),
        "same_shapes": list(sb) == list(sp) and all(sb[k].shape == sp[k].shape for k in sb),
        "modules": len(mods_b),
        "same_module_names_and_classes": mods_b == mods_p,
        "top_level": [n for n, _ in bolts_model.named_children()],
    }


def _capture_decoder(model, store: dict):
    return model.decoder.register_forward_hook(lambda m, i, o: store.__setitem__("x_hat", o.detach().clone()))


def bolts_step(model, x: Tensor, y: Tensor, seed: int) -> dict:
    """One bolts ``step((x, y), 0)`` after ``torch.manual_seed(seed)``; returns its logs,
    ``x_hat``, the replayed ``eps: (n, latent_dim)``, bolts' ``p, q, z`` and the loss."""
    store: dict = {}
    orig = model.sample

    def sample(mu, log_var):
        state = torch.get_rng_state()
        p, q, z = orig(mu, log_var)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        store["eps"] = torch.empty_like(mu).normal_()  # exactly what q.rsample() drew
        torch.set_rng_state(after)
        store["replay_exact"] = bool(torch.equal(mu + store["eps"] * torch.exp(log_var / 2), z))
        store["p"], store["q"], store["z"] = p, q, z
        return p, q, z

    model.sample = sample
    hook = _capture_decoder(model, store)
    try:
        torch.manual_seed(seed)
        loss, logs = model.step((x, y), 0)
    finally:
        hook.remove()
        del model.sample
    store["loss"], store["logs"] = loss, logs
    return store


def port_step(port, x: Tensor, eps: Tensor) -> dict:
    store: dict = {}
    hook = _capture_decoder(port, store)
    try:
        loss, logs = port.step(x, eps=eps)
    finally:
        hook.remove()
    store["loss"], store["logs"] = loss, logs
    return store


def _maxdiff(a: Tensor, b: Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max())


def compare_step(kl: str, x: Tensor, y: Tensor, seed: int = 0, train: bool = True) -> dict:
    """Same weights, same input, same ``eps``: bolts vs port, one step (+ backward if ``train``)."""
    bolts_model = make_bolts(kl, seed)
    port = make_port(bolts_model, kl)
    bolts_model.train(train)
    port.train(train)
    with torch.set_grad_enabled(train):
        b = bolts_step(bolts_model, x, y, seed + 1)
        p = port_step(port, x, b["eps"])
    out = {
        "mode": "train" if train else "eval",
        "kl_estimator": kl,
        "batch": list(x.shape),
        "eps_shape": list(b["eps"].shape),
        "eps_replay_exact": b["replay_exact"],
        "values_bolts": {k: float(v.detach()) for k, v in b["logs"].items()},
        "values_port": {k: float(v.detach()) for k, v in p["logs"].items()},
        "max_abs_diff": {"x_hat": _maxdiff(b["x_hat"], p["x_hat"]),
                         **{k: _maxdiff(b["logs"][k], p["logs"][k]) for k in ("recon_loss", "kl", "loss")}},
    }
    if kl == "mc":  # bolts' own distributions and z, the report-era formula
        own = (b["q"].log_prob(b["z"]) - b["p"].log_prob(b["z"])).mean() * bolts_model.kl_coeff
        out["max_abs_diff"]["kl_vs_bolts_log_prob_formula"] = _maxdiff(own, p["logs"]["kl"])
        out["kl_bolts_log_prob_formula"] = float(own.detach())
    if train:
        b["loss"].backward()
        p["loss"].backward()
        gb = dict(bolts_model.named_parameters())
        gp = dict(port.named_parameters())
        diffs = {n: _maxdiff(gb[n].grad, gp[n].grad) for n in gb}
        worst = max(diffs, key=diffs.get) if max(diffs.values()) > 0 else None
        out["grad"] = {"tensors": len(diffs), "max_abs_diff": max(diffs.values()), "worst": worst,
                       "max_abs_grad": max(float(g.grad.abs().max()) for g in gb.values()),
                       "all_bitwise_equal": all(torch.equal(gb[n].grad, gp[n].grad) for n in gb)}
        bb = dict(bolts_model.named_buffers())
        bp = dict(port.named_buffers())
        out["buffers_after_step_max_abs_diff"] = max(_maxdiff(bb[n].float(), bp[n].float()) for n in bb)
    return out


def measure(data_dir: str = DEFAULT_DATA, n: int = 8, seed: int = 0) -> dict:
    """All parity measurements as one JSON-able dict (see the module docstring)."""
    import pl_bolts
    import pytorch_lightning as pl

    x, y = load_images(data_dir, n)
    bolts_model = make_bolts("analytic", seed)
    res = {
        "versions": {"pytorch_lightning": pl.__version__, "lightning_bolts": pl_bolts.__version__,
                     "torch": torch.__version__},
        "images": {"data_dir": Path(data_dir).name, "n": n, "shape": list(x.shape), "labels": y.tolist()},
        "structure": structure(bolts_model, make_port(bolts_model, "analytic")),
        "analytic_train": compare_step("analytic", x, y, seed, train=True),
        "mc_train": compare_step("mc", x, y, seed, train=True),
        "analytic_eval": compare_step("analytic", x, y, seed, train=False),
        "mc_eval": compare_step("mc", x, y, seed, train=False),
    }
    return res


def _fail(msg: str) -> None:
    print(f"parity.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Optional[list] = None) -> int:
    class P(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: error: {message}\n")

    ap = P(description="bolts VAE vs port parity (legacy environment)")
    ap.add_argument("--out", required=True, help="output folder: writes parity.json there")
    ap.add_argument("--data_dir", default=DEFAULT_DATA)
    ap.add_argument("--n", type=int, default=8, help="number of images")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    if a.n < 2:
        _fail("--n must be >= 2 (BatchNorm needs more than one sample in training mode)")
    if not (Path(a.data_dir) / "train").is_dir():
        _fail(f"--data_dir {a.data_dir!r} has no train/ folder: expected <dir>/train/<class>/<image>.jpg")
    try:
        import pl_bolts  # noqa: F401
        import vae_ddp.model  # noqa: F401
    except ImportError as err:
        _fail(f"{err.name} is not importable here: run with .venv-legacy/bin/python (make legacy)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "parity.json").write_text(json.dumps(measure(a.data_dir, a.n, a.seed), indent=1))
    print(f"wrote {out / 'parity.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
