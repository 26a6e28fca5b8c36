"""The answer to the report, stated from the committed studies.

[`verdict_box`][vae_ddp.studies.verdict.verdict_box] writes the Home page's first screen (a
Material admonition) and [`dp_table`][vae_ddp.studies.verdict.dp_table] the table of which
configuration has which factor, from:

- ``docs/results/seeds-full/seeds.json`` (the seed study): its ``"verdict"`` object
  (``{"ddp": {"train_kl": "equivalent" | "different" | "inconclusive", ...}}``) and
  ``"verdict_lines"`` when present, else its Welch p-values (``summary``);
- ``docs/results/long-horizon/long-horizon.json`` when present (``"verdict"``, ``"summary"``);
- ``docs/results/report-scale/report_scale.json`` (the report's scale, one step): the
  order of the reasons and their sizes.

Every number and every word that depends on a result is taken from those files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["UPSTREAM", "decide", "dp_table", "load", "verdict_box"]

UPSTREAM = "https://github.com/Lightning-AI/pytorch-lightning/issues/6789"

#: What each factor does in the report's setting, and its page.
REASONS = {
    "random streams per rank": ("both ranks draw the same reparameterization noise", "factors/noise.md"),
    "logging": ("the curve shows rank 0's mean of {b} samples, not the global batch's", "factors/logging.md"),
    "sampler and order": ("`DistributedSampler` deals interleaved samples to the ranks, paired with other noise rows",
                          "factors/sampler.md"),
    "BatchNorm statistics": ("each rank normalises with its own {b} samples", "factors/batchnorm.md"),
}


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load(root: Path) -> dict[str, dict | None]:
    """The committed results under ``root/docs/results`` (None where a file is absent)."""
    res = Path(root) / "docs" / "results"
    return {"seeds": _read(res / "seeds-full" / "seeds.json"),
            "long_horizon": _read(res / "long-horizon" / "long-horizon.json"),
            "report_scale": _read(res / "report-scale" / "report_scale.json")}


def _g(v: float) -> str:
    """3 significant digits (``0.109``, ``1.03``, ``12.5``)."""
    return f"{v:#.3g}".rstrip(".")


def decide(seeds: dict, long_horizon: dict | None = None) -> dict[str, Any]:
    """Bug or expected behaviour, from the seed study (and the long-horizon check).

    Returns ``{"kind": "equivalent" | "different" | "inconclusive", "title", "lines"}``.
    With the seed study's ``"verdict"`` object, ``ddp``'s training KL decides; without it,
    its Welch p-values do (p >= 0.05 everywhere: "inconclusive", since not detecting a
    difference does not show equivalence). A long-horizon "different" overrides.
    """
    s = seeds["settings"]
    scope = f"{seeds['num_seeds']} seeds x {s['steps']} steps, {s['model']} VAE, global batch {s['global_batch_size']}"
    if "verdict" in seeds:
        v = seeds["verdict"].get("ddp", {})
        kind = v.get("train_kl", "inconclusive")
        lines = [_short(seeds, "ddp", scope)] + ([_short(seeds, "dp", None)] if "dp" in seeds["verdict"] else [])
        if "ddp+fixed" in seeds["verdict"]:
            lines.append(_short(seeds, "ddp+fixed", None))
    else:
        ps = {q: e["vs_single"]["p"] for q, e in seeds["summary"]["ddp"].items()}
        worst = min(ps, key=ps.get)
        kind = "different" if ps[worst] < 0.05 else "inconclusive"
        lines = [f"ddp vs single, final values over {scope}: smallest Welch p = {ps[worst]:.2f} ({worst})"]
    if long_horizon:
        lines.append(_long_horizon_line(long_horizon))
        if long_horizon["verdict"] == "different":
            kind = "different"
    other = [q for q, w in (seeds.get("verdict", {}).get("ddp", {})).items() if w == "different"]
    kl_ok = seeds.get("verdict", {}).get("ddp", {}).get("train_kl") == "equivalent"
    lh_kl = ((long_horizon or {}).get("comparison", {}).get("train_kl", {}).get("verdict") == "different")
    if kl_ok and other and not lh_kl:
        worse = _rel(seeds, "ddp", other[0])
        fixed = seeds["verdict"].get("ddp+fixed", {})
        tail = " (equivalent with the fixes)" if fixed and all(w == "equivalent" for w in fixed.values()) else ""
        title = (f"Expected behaviour, not a bug: DDP's KL matches one device; with Lightning's defaults its "
                 f"{_NAMES.get(other[0], other[0])} ends {worse}{tail}")
    else:
        title = {"equivalent": "Expected behaviour, not a bug: DDP trains the VAE as well as one device",
                 "inconclusive": "Expected behaviour as far as measured: no difference in training detected",
                 "different": "Not a bug in DDP's arithmetic, but Lightning's defaults change what is trained"}[kind]
    return {"kind": kind, "title": title, "lines": lines, "scope": scope}


_MODEL_NAMES = {"resnet18": "ResNet-18"}

_NAMES = {"train_kl": "training KL", "val_kl": "validation KL", "train_recon_loss": "training reconstruction",
          "val_recon_loss": "validation reconstruction"}


def _rel(seeds: dict, config: str, metric: str) -> str:
    """``3.1% higher`` / ``2.0% lower``: the difference of means relative to single's mean."""
    v = seeds["summary"][config][metric]["vs_single"]
    rel = v["diff"] / v["mean_b"] * 100
    return f"{abs(rel):.2g}% {'higher' if rel > 0 else 'lower'}"


_TERMS = {"train_kl": ("KL", "train"), "val_kl": ("KL", "val"), "train_recon_loss": ("reconstruction", "train"),
          "val_recon_loss": ("reconstruction", "val")}


def _signed(summary: dict, metric: str) -> str:
    """``+3.1%`` / ``-2.0%``: the difference of means relative to the reference's mean."""
    v = summary[metric]["vs_single"] if "vs_single" in summary[metric] else summary[metric]
    return f"{v['diff'] / v['mean_b'] * 100:+.2g}%"


def _compact(verdicts: dict[str, str], summary: dict) -> str:
    """``KL equivalent (train, val); reconstruction +3.1% (train), +2.6% (val)``: one clause per
    term, the verdict of each final quantity (train/val) and the size of each difference."""
    clauses = []
    for term in ("KL", "reconstruction"):
        qs = [(q, w) for q, w in verdicts.items() if _TERMS.get(q, (q, q))[0] == term]
        eq = [_TERMS[q][1] for q, w in qs if w == "equivalent"]
        diff = [f"{_signed(summary, q)} ({_TERMS[q][1]})" for q, w in qs if w == "different"]
        unsure = [_TERMS[q][1] for q, w in qs if w == "inconclusive"]
        parts = ([f"equivalent ({', '.join(eq)})"] if eq else []) + ([", ".join(diff)] if diff else []) + \
            ([f"inconclusive ({', '.join(unsure)})"] if unsure else [])
        if parts:
            clauses.append(f"{term} " + ", ".join(parts))
    return "; ".join(clauses)


def _short(seeds: dict, config: str, scope: str | None) -> str:
    """One sentence per configuration: which final quantities are equivalent to single's, which
    differ and by how much."""
    margin = seeds.get("margin_sd", 1)
    where = f" vs one device ({scope}; margin ±{margin:g} seed-to-seed SD, Holm)" if scope else ""
    return f"**{config}**{where}: " + _compact(seeds["verdict"][config], seeds["summary"].get(config, {}))


def _long_horizon_line(lh: dict) -> str:
    """The long-horizon check in the box's words (from its ``comparison``), else its summary."""
    comp = lh.get("comparison")
    if not comp:
        return lh["summary"]
    s = lh.get("settings", {})
    steps = s.get("steps")
    head = f"**shared vs independent noise**{f' after {steps:,} steps' if steps else ''}"
    return f"{head}: " + _compact({q: c["verdict"] for q, c in comp.items()}, comp)


def _reasons(rs: dict) -> list[str]:
    s = rs["settings"]
    b = s["global_batch_size"] // s["world_size"]
    out = []
    for row in rs["ranking"]:
        what, page = REASONS.get(row["factor"], (row["factor"], None))
        what = what.format(b=b)
        label = row["factor"][0].upper() + row["factor"][1:]
        name = f"[{label}]({page})" if page else label
        if row["kind"] == "gradient":
            size = f"gradient off by {_g(row['ratio'])}x the batch-to-batch noise"
        else:
            sp = rs.get("spread") or {}
            size = f"logged KL off the global batch's by {_g(row['ratio'])}x the batch-to-batch change"
            if sp.get("kl_spread_ratio"):
                size += f", spread x{_g(sp['kl_spread_ratio'])}"
        out.append(f"{name}: {what}; {size}.")
    red = rs["reduction"]
    if not red["unequal_steps_per_epoch"]:
        out.append(f"[Mean reduction](factors/reduction.md): none ({b} samples on every rank at every step).")
    return out


FIX = """```python
def on_fit_start(self):  # your LightningModule: its own reparameterization noise per rank
    self.g = torch.Generator(device=self.device).manual_seed(1234 + self.global_rank)
# training_step: z = mu + std * torch.randn(mu.shape, generator=self.g, device=mu.device)
self.log_dict(logs, on_step=True, sync_dist=True, batch_size=len(x))  # plot the global batch
trainer = Trainer(strategy="ddp", sync_batchnorm=True)  # GPUs: BatchNorm over the global batch
```"""


def verdict_box(results: dict[str, dict | None]) -> str:
    """The Home page's verdict admonition (Markdown, Material ``!!!`` syntax)."""
    d = decide(results["seeds"], results["long_horizon"])
    rs = results["report_scale"]
    kind = {"equivalent": "success", "inconclusive": "success", "different": "warning"}[d["kind"]]
    body = [f"[Lightning issue #6789]({UPSTREAM}), measured ([seed study](is-it-a-bug.md)): " + "; ".join(d["lines"])
            + "."]
    if rs:
        s = rs["settings"]
        body.append("")
        b = s["global_batch_size"] // s["world_size"]
        report = s["model"] == "resnet18" and s["global_batch_size"] == 256 and s["world_size"] == 2
        where = "the report's scale: " if report else "measured with the report's batch, not its model: " if (
            s["global_batch_size"] == 256 and s["world_size"] == 2) else "measured at "
        body.append(f"**Why the DDP curves looked different**, largest measured effect first ({where}"
                    f"{_MODEL_NAMES.get(s['model'], s['model'])} VAE, {s['world_size']} ranks x {b}, "
                    f"[one step from the same weights](#the-reports-scale)):")
        body.append("")
        body += [f"{i}. {r}" for i, r in enumerate(_reasons(rs), 1)]
    body += ["", "**The change** for your own LightningModule ([recipe](recipe.md)):", "", *FIX.splitlines()]
    return f'!!! {kind} "{d["title"]}"\n\n' + "\n".join(("    " + ln) if ln else "" for ln in body) + "\n"


def dp_table(results: dict[str, dict | None]) -> str:
    """Which configuration has which factor (single, Lightning 1.x DP, DDP), each cell with its source."""
    rs = results["report_scale"] or {}
    v = rs.get("variants", {})

    def ratio(name: str) -> str:
        e = v.get(name)
        return f" (one step: {_g(e['ratio_to_batch_noise']['all'])}x batch noise, [report scale](#the-reports-scale))" if e else ""

    dp_note = "inferred: [DP emulation](dataparallel.md), not observed on GPUs here"
    rows = [
        ("Random streams", "one stream for the whole batch",
         f"every replica draws the same noise ({dp_note}: torch seeds every CUDA device alike)",
         "every rank draws the same noise (measured: [noise](factors/noise.md))" + ratio("ddp, noise back to default")),
        ("BatchNorm statistics", "the whole batch",
         f"each replica's chunk ({dp_note}: `nn.DataParallel` runs each replica's BatchNorm on its chunk)",
         "each rank's 128 (measured: [BatchNorm](factors/batchnorm.md))" + ratio("ddp, BatchNorm back to per-rank")),
        ("Sampler and order", "`RandomSampler`",
         "the same `RandomSampler` as one device: the same batches in the same order (by construction: one process, "
         "one DataLoader; measured: [report-style curves](#what-the-report-plotted))",
         "`DistributedSampler`: other batches, interleaved (measured: [sampler](factors/sampler.md))"
         + ratio("ddp, sampler back to DistributedSampler")),
        ("Mean reduction", "mean over the batch",
         "mean of the replica means (equal chunks but for an uneven last batch; inferred from `training_step_end`)",
         "mean of rank means, equal at this scale (measured: [reduction](factors/reduction.md))"),
        ("Logging (`on_step`, no `sync_dist`)", "the whole batch",
         "one replica's chunk (inferred from Lightning 1.2.6 and 1.9.5 source, see [`vae_ddp.studies.dp`][vae_ddp.studies.dp])",
         "rank 0's half (measured: [logging](factors/logging.md))"),
        ("Optimizer (Adam)", "one Adam on the batch gradient", "the same, on the mean of the replica gradients",
         "the same, on the all-reduced gradient (measured: [optimizer](factors/optimizer.md))"),
    ]
    both = v.get("dp (emulation of Lightning 1.x DP)"), v.get("ddp, Lightning defaults")
    if all(both):
        rows.append(("All together: one step's gradient vs one device's on the same batch", "-",
                     f"{_g(both[0]['ratio_to_batch_noise']['all'])}x batch noise (DP emulation, "
                     "[report scale](#the-reports-scale))",
                     f"{_g(both[1]['ratio_to_batch_noise']['all'])}x batch noise ([report scale](#the-reports-scale))"))
    out = ["| factor | one device | DP (Lightning 1.x) | DDP (Lightning defaults) |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out) + "\n"
