"""Generate the Lightning 1.x page's results: parity, factor check on 1.9.5 and on 2.x.

Run with the legacy interpreter (``make legacy`` first)::

    .venv-legacy/bin/python examples/legacy/report.py --out examples/legacy/results

It measures (nothing is typed by hand):

1. ``parity.measure()``: bolts 0.7.0's VAE vs the port (this process, Lightning 1.9.5);
2. ``factor_check.py`` under Lightning 1.9.5 (this interpreter, 2 gloo processes);
3. ``factor_check.py`` under Lightning 2.x (``--main-python``, default ``.venv/bin/python``;
   skipped with a note if that interpreter does not exist);

and writes into ``--out``: ``parity.json``, ``pl1/factor_check.json``,
``pl2/factor_check.json`` and ``results.md`` (Markdown tables for ``docs/legacy.md``,
which includes it with ``--8<--``). About 3 minutes on 2 CPU cores.

Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))


def _fail(msg: str) -> None:
    print(f"report.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _run_factor_check(python: str, out: Path, data_dir: str) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PL_GLOBAL_SEED", None)
    cmd = [python, "examples/legacy/factor_check.py", "--out", os.path.relpath(out, ROOT),
           "--data_dir", os.path.relpath(data_dir, ROOT)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        _fail(f"factor_check.py failed under {python} (exit {proc.returncode})")
    return json.loads((out / "factor_check.json").read_text())


def _shown(command: str) -> str:
    """A recorded command as a reader types it: the data folder of the machine it ran on is ``DIR``."""
    return re.sub(r"--data_dir \S+", "--data_dir DIR", command)


def _fmt(x, digits: int = 6) -> str:
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return "0" if x == 0 else f"{x:.{digits}g}"
    if isinstance(x, int):
        return f"{x:,}"
    return str(x)


def _short(cls: str) -> str:
    return cls.rsplit(".", 1)[-1]


def render(parity: dict, pl1: dict, pl2: dict | None) -> str:
    """The Markdown of ``results.md`` from the three measurements."""
    s, a, m = parity["structure"], parity["analytic_train"], parity["mc_train"]
    ae, me = parity["analytic_eval"], parity["mc_eval"]
    v = parity["versions"]
    L = []
    L.append(f"Measured with pytorch-lightning {v['pytorch_lightning']}, lightning-bolts {v['lightning_bolts']}, "
             f"torch {v['torch']} on {parity['images']['n']} real images "
             f"(`x: {tuple(parity['images']['shape'])}`) of the CIFAR-10 subset.\n")
    L.append("**Structure**\n")
    L.append("| | bolts `VAE(input_height=32)` | port `VAE(enc_type=\"resnet18\")` |")
    L.append("|---|---|---|")
    L.append(f"| parameters | {_fmt(s['bolts_params'])} | {_fmt(s['port_params'])} |")
    L.append(f"| `state_dict` entries (same keys, same order, same shapes) | {s['state_dict_entries']} | "
             f"{'same' if s['same_keys_in_order'] and s['same_shapes'] else 'DIFFERENT'} |")
    L.append(f"| named modules (same names and classes) | {s['modules']} | "
             f"{'same' if s['same_module_names_and_classes'] else 'DIFFERENT'} |")
    L.append("")
    L.append("**One step, bolts' weights loaded into the port, same images, same `eps`** "
             "(largest absolute difference, float32)\n")
    L.append("- analytic: bolts 0.7.0's own `VAE.step` vs the port with `kl_estimator=\"analytic\"`;")
    L.append("- mc: the report-era step (`ReportVAE.step` in `vae.py`: bolts' `VAE` with "
             "`q.log_prob(z) - p.log_prob(z)`) vs the port with `kl_estimator=\"mc\"`.\n")
    cols = ((a, "analytic, train"), (m, "mc, train"), (ae, "analytic, eval"), (me, "mc, eval"))
    L.append("| largest absolute difference, bolts vs port | " + " | ".join(c for _, c in cols) + " |")
    L.append("|---|" + "---|" * len(cols))
    L.append(f"| reconstruction `x_hat` `{tuple(a['batch'])}` | "
             + " | ".join(_fmt(r["max_abs_diff"]["x_hat"]) for r, _ in cols) + " |")
    for k in ("recon_loss", "kl", "loss"):
        L.append(f"| `{k}` | " + " | ".join(_fmt(r["max_abs_diff"][k]) for r, _ in cols) + " |")
    L.append(f"| gradients, all {a['grad']['tensors']} parameter tensors | "
             + " | ".join((f"{_fmt(r['grad']['max_abs_diff'])} (bitwise equal: {_fmt(r['grad']['all_bitwise_equal'])})"
                           if "grad" in r else "no backward") for r, _ in cols) + " |")
    L.append("| BatchNorm running statistics after the step | "
             + " | ".join(_fmt(r["buffers_after_step_max_abs_diff"]) if "grad" in r else "not updated"
                          for r, _ in cols) + " |")
    L.append("")
    L.append(f"The mc estimate agrees with bolts' own log-prob formula `kl_coeff * mean(q.log_prob(z) - "
             f"p.log_prob(z))` on bolts' `p, q, z`: largest difference "
             f"{_fmt(m['max_abs_diff']['kl_vs_bolts_log_prob_formula'])}. The two estimators are not the same "
             f"number: on this batch (training mode, same `eps`) `kl` = {_fmt(a['values_bolts']['kl'])} analytic "
             f"(bolts 0.7.0) vs {_fmt(m['values_bolts']['kl'])} mc (the report's bolts), with the same "
             f"`recon_loss` = {_fmt(a['values_bolts']['recon_loss'])}.\n")

    envs = [("1", pl1)] + ([("2", pl2)] if pl2 else [])
    L.append("**Factor check under DDP** (2 gloo processes on CPU, per-device batch "
             f"{pl1['per_device_batch_size']}, {pl1['steps']} steps; `eps` is the reparameterization noise "
             f"`{tuple(pl1['configs']['seed42']['eps_shape'])}` per rank and step)\n")
    head = "| | " + " | ".join(f"Lightning {d['pl_version']}" for _, d in envs) + " |"
    L.append(head)
    L.append("|---|" + "---|" * len(envs))

    def row(label, fn):
        L.append(f"| {label} | " + " | ".join(fn(d) for _, d in envs) + " |")

    def cfg(d, name):
        return d["configs"][name]

    row("model", lambda d: cfg(d, "seed42")["model"])
    row("sampler Lightning puts in the training `DataLoader`",
        lambda d: f"`{_short(cfg(d, 'seed42')['sampler'][0]['class'])}`" + (
            f" around `{_short(cfg(d, 'seed42')['sampler'][0]['wrapped_sampler'])}`"
            if cfg(d, "seed42")["sampler"][0].get("wrapped_sampler") else ""))
    row("its `seed` / `shuffle` (after `seed_everything(42)`)",
        lambda d: f"{cfg(d, 'seed42')['sampler'][0]['seed']} / {cfg(d, 'seed42')['sampler'][0]['shuffle']}")
    row("DDP `find_unused_parameters`", lambda d: _fmt(cfg(d, "seed42")["ddp_find_unused_parameters"]))
    for name, label in (("seed42", "`seed_everything(42)`"), ("noseed", "`seed_everything()` (bolts' `cli_main`)"),
                        ("per_rank_seed", "`seed_everything(42)` + `PerRankSeed`")):
        if name not in pl1["configs"]:
            continue
        row(f"{label}: `PL_GLOBAL_SEED` on rank 0 / 1", lambda d, n=name: " / ".join(cfg(d, n)["pl_global_seed"]))
        row(f"{label}: generator seed on rank 0 / 1",
            lambda d, n=name: " / ".join(str(x) for x in cfg(d, n)["initial_seed"]))
        row(f"{label}: `eps` correlation rank 0 vs rank 1, per step",
            lambda d, n=name: ", ".join(f"{c:.4f}" for c in cfg(d, n)["eps_corr_per_step"]))
        row(f"{label}: `eps` bitwise identical on both ranks", lambda d, n=name: _fmt(cfg(d, n)["eps_identical"]))
        row(f"{label}: epoch-0 samples dealt to both ranks (overlap) / distinct samples dealt",
            lambda d, n=name: f"{_fmt(cfg(d, n)['index_overlap'])} / {_fmt(cfg(d, n)['index_union'])} "
                              f"of {_fmt(cfg(d, n)['dataset_train_len'])}")
    L.append("")
    L.append("**The report's `Trainer` arguments** (each Trainer built in-process, nothing launched)\n")
    L.append("| arguments | " + " | ".join(f"Lightning {d['pl_version']}" for _, d in envs) + " |")
    L.append("|---|" + "---|" * len(envs))
    for key in pl1["trainer_facts"]:
        L.append(f"| `{key}` | " + " | ".join(
            _fmt(d["trainer_facts"].get(key, "")).replace("|", "\\|") for _, d in envs) + " |")
    if not pl2:
        L.append("\n_Lightning 2.x column not generated: no `.venv` interpreter was given._")
    L.append("")
    L.append("Generated by `.venv-legacy/bin/python examples/legacy/report.py --out examples/legacy/results`; "
             "commands of the factor checks: " + "; ".join(f"`{_shown(d['command'])}`" for _, d in envs)
             + ", with `DIR` the CIFAR-10 subset that `.github/scripts/cifar10-subset.sh DIR` builds from public "
             "CIFAR-10 images.")
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    class P(argparse.ArgumentParser):
        def error(self, message):
            self.exit(2, f"{self.prog}: error: {message}\n")

    ap = P(description="Generate examples/legacy/results (parity + factor checks).")
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data" / "cifar10-jpg-subset"))
    ap.add_argument("--main-python", default=str(ROOT / ".venv" / "bin" / "python"),
                    help="Lightning 2.x interpreter for the comparison column ('' to skip)")
    ap.add_argument("--render-only", action="store_true",
                    help="rewrite results.md from the JSON files already in --out (no measurement)")
    a = ap.parse_args(argv)
    if a.render_only:
        out = Path(a.out)
        try:
            parity = json.loads((out / "parity.json").read_text())
            pl1 = json.loads((out / "pl1" / "factor_check.json").read_text())
        except FileNotFoundError as err:
            _fail(f"--render-only: {err.filename} is missing: run without --render-only first")
        pl2_path = out / "pl2" / "factor_check.json"
        pl2 = json.loads(pl2_path.read_text()) if pl2_path.exists() else None
        (out / "results.md").write_text(render(parity, pl1, pl2))
        print(f"wrote {out / 'results.md'}")
        return 0
    try:
        import pl_bolts  # noqa: F401
        import pytorch_lightning as pl
    except ImportError as err:
        _fail(f"{err.name} is not importable: run with .venv-legacy/bin/python (make legacy)")
    if not pl.__version__.startswith("1."):
        _fail(f"run with the Lightning 1.x interpreter .venv-legacy/bin/python (this one has {pl.__version__})")
    if not (Path(a.data_dir) / "train").is_dir():
        _fail(f"--data_dir {a.data_dir!r} has no train/ folder: expected <dir>/train/<class>/<image>.jpg")
    if a.main_python and not Path(a.main_python).exists():  # noqa: SIM102
        print(f"report.py: note: {a.main_python} not found, the Lightning 2.x column is skipped", file=sys.stderr)
        a.main_python = ""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    import parity as parity_mod

    t0 = time.perf_counter()
    parity = parity_mod.measure(a.data_dir)
    (out / "parity.json").write_text(json.dumps(parity, indent=1))
    print(f"parity: {time.perf_counter() - t0:.0f} s", flush=True)
    t0 = time.perf_counter()
    pl1 = _run_factor_check(sys.executable, out / "pl1", a.data_dir)
    print(f"factor check, Lightning {pl1['pl_version']}: {time.perf_counter() - t0:.0f} s", flush=True)
    pl2 = None
    if a.main_python:
        t0 = time.perf_counter()
        pl2 = _run_factor_check(a.main_python, out / "pl2", a.data_dir)
        print(f"factor check, Lightning {pl2['pl_version']}: {time.perf_counter() - t0:.0f} s", flush=True)
    (out / "results.md").write_text(render(parity, pl1, pl2))
    print(f"wrote {out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
