"""The report-scale study's Markdown: an effect's words (a table cell, a factor page's
sentence) and the tables ``tables.md`` holds."""

from __future__ import annotations

import math

from vae_ddp.harness.effect import detected
from vae_ddp.studies.report_scale.variants import (DEFAULT_VARIANT, FLOOR_RATIO, LABELS, QUANTITIES, RANKED_BY,
                                                   VARIANTS, ranking)


def _f(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if v == 0:
        return "0"
    return f"{v:.3g}" if 1e-3 <= abs(v) < 1e4 else f"{v:.2e}"


#: How a table cell words an effect's kind at the report's scale.
CELL = {"different": "trains another model", "same distribution": "other luck only", "exact": "the same step",
        "inconclusive": "not resolved"}


def effect_cell(e: dict) -> str:
    """An effect's kind and, where it is ``different``, what was detected: ``trains another model:
    bias 0.82 sd``, ``... noise 1.9x``; ``other luck only``; ``the same step``; ``not resolved``."""
    words = CELL[e["kind"]]
    if e["kind"] != "different":
        return words
    return f"{words}: {', '.join(detected(e, _f))}"


def logging_cell(e: dict) -> str:
    """What logging rank 0's mean does to the plotted curve: ``shifted 0.4 sd``, ``noisier 2.3x``,
    ``quieter 0.6x``, ``the same values`` or ``not resolved``."""
    if e["kind"] in ("same distribution", "exact"):
        return "the same curve" if e["kind"] == "exact" else "the same curve, other luck"
    if e["kind"] == "inconclusive":
        return "not resolved"
    parts = []
    if e["bias_ci"][0] > 0:
        parts.append(f"shifted {_f(e['bias'])} sd")
    lo, hi = e["variance_ratio_ci"]
    if lo > 1:
        parts.append(f"noisier {_f(e['variance_ratio'])}x")
    elif hi < 1:
        parts.append(f"quieter {_f(e['variance_ratio'])}x")
    return ", ".join(parts)


def effect_line(effect: dict) -> str:
    """One sentence for a factor page: what the factor changes in one step at the report's scale, on
    the gradient, the KL and the reconstruction, with the intervals (``effect``: a variant's
    ``{"kind", "gradient", "kl", "reconstruction"}``)."""
    if "gradient" not in effect:  # logging: the plotted value, not the step
        parts = [f"the {LABELS[q]}: {logging_cell(effect[q])} ({_interval(effect[q])})"
                 for q in ("kl", "reconstruction")]
        return ("what Lightning plots under DDP (rank 0's mean) against the global batch's value: on "
                + "; on ".join(parts) + "; it changes no gradient.")
    parts = [f"the {LABELS[q]}: {effect_cell(effect[q])} ({_interval(effect[q])})" for q in QUANTITIES]
    return "on " + "; on ".join(parts) + "."


def _interval(e: dict) -> str:
    b, r = e["bias_ci"], e["variance_ratio_ci"]
    return (f"bias {_f(e['bias'])} sd [{_f(b[0])}, {_f(b[1])}], "
            f"noise ratio {_f(e['variance_ratio'])} [{_f(r[0])}, {_f(r[1])}]")


def _effect_lines(result: dict) -> list[str]:
    """The effects table (a row per variant but the floor, the logged curve last), its key and each
    row's intervals; no lines where the study measured none."""
    from vae_ddp.harness import effect as stats

    s = result["settings"]
    rows = [(VARIANTS[name][2] if name in VARIANTS else v["factor"], name, v["effect"])
            for name, v in result["variants"].items() if v.get("effect") and name != "ddp, every fix"]
    if not rows:
        return []
    order = {r["variant"]: i for i, r in enumerate(ranking(result))}
    rows.sort(key=lambda r: (r[1] != DEFAULT_VARIANT, order.get(r[1], len(order))))
    lines = [f"What each factor changes in one step ({s['model']} VAE, global batch "
             f"{s['global_batch_size']}, {s['world_size']} ranks x {s['global_batch_size'] // s['world_size']}, "
             f"{s['effect_batches']} global batches from the same initial weights)", "",
             f"Lightning's defaults together first, then each factor alone, ranked by {RANKED_BY}.", "",
             "| factor | gradient | KL | reconstruction |", "|---|---|---|---|"]
    lines += [f"| {factor} | {effect_cell(e['gradient'])} | {effect_cell(e['kl'])} "
              f"| {effect_cell(e['reconstruction'])} |" for factor, _, e in rows]
    lg = (result.get("logging") or {}).get("effect")
    if lg:
        lines.append(f"| Logging (the plotted value) | - | {logging_cell(lg['kl'])} "
                     f"| {logging_cell(lg['reconstruction'])} |")
    floor = result["variants"].get("ddp, every fix", {}).get("effect", {}).get("floor")
    lines += ["", "Each cell compares DDP's step with one device's over the same global batches (DDP's own where its "
              "sampler takes others) and draws: **trains another model**, DDP's step is off one device's on average "
              "(a bias, in one device's step-to-step standard deviations, sd) or varies more or less (a noise ratio, "
              f"DDP's variance over one device's), detected at {stats.CONFIDENCE:.0%}; **other luck only**, both shown "
              f"within their margins (a bias below {stats.BIAS_MARGIN:g} sd, a noise ratio between "
              f"{1 / stats.RATIO_MARGIN:g} and {stats.RATIO_MARGIN:g}): what other samples or draws of the same "
              "distribution do; **the same step**, every batch within "
              + (f"{FLOOR_RATIO:g}x the rounding of DDP with every fix ({_f(floor['gradient'] / FLOOR_RATIO)} of the "
                 "gradient)" if floor else "the same bits")
              + "; **not resolved**, neither shown with these batches. Logging compares what Lightning plots under DDP "
              f"(rank 0's mean of {s['global_batch_size'] // s['world_size']}) with the global batch's value.", "",
              f"Intervals ({stats.CONFIDENCE:.0%}):", ""]
    for factor, _, e in rows:
        lines += [f"- {factor}, {LABELS[q]}: {_interval(e[q])}" for q in QUANTITIES]
    if lg:
        lines += [f"- Logging, {LABELS[q]}: {_interval(lg[q])}" for q in ("kl", "reconstruction")]
    return lines + [""] + _heavy_rows(rows)


#: A spread is heavy-tailed, for the note under the intervals, where one global batch carries at least this share.
HEAVY_SHARE = 0.25


def _heavy_rows(rows: list) -> list[str]:
    """Where one global batch carries a large share of a spread (:data:`HEAVY_SHARE`) and the rows' jackknife
    widened the noise ratio's interval: its share on each side and the interval from the F distribution alone
    (normal rows) beside the one shown ([`vae_ddp.harness.effect`][vae_ddp.harness.effect])."""
    notes = []
    for factor, _, e in rows:
        for q in QUANTITIES:
            part = e[q]
            shares, normal = part.get("largest_share"), part.get("variance_ratio_ci_normal")
            if not shares or not normal or max(shares) < HEAVY_SHARE:
                continue
            lo, hi = part["variance_ratio_ci"]
            if lo >= normal[0] * 0.99 and hi <= normal[1] * 1.01:  # the jackknife widened nothing
                continue
            notes.append(f"- {factor}, {LABELS[q]}: the largest of {part['rows']} global batches carries "
                         f"{shares[1]:.0%} of DDP's spread (one device's largest, {shares[0]:.0%} of its own); "
                         f"noise ratio "
                         f"{_f(part['variance_ratio'])}, [{_f(normal[0])}, {_f(normal[1])}] from the F distribution "
                         f"alone, [{_f(lo)}, {_f(hi)}] as shown")
    if not notes:
        return []
    return ([f"Heavy tails: where one global batch carries {HEAVY_SHARE:.0%} or more of a spread, a ratio of two "
             "spreads rests mostly on that batch, and an interval that assumes normal rows (the F distribution's) "
             "is too narrow; each interval above is joined with the rows' jackknife, which assumes no "
             "distribution. Where that widened it:", ""] + notes + [""])


def render(result: dict) -> str:
    """The Markdown tables of ``result`` (what the study prints and writes to ``tables.md``): the
    effects (where measured), then the one-step gradient difference, logging and the mean reduction."""
    s = result["settings"]
    head = (f"{s['model']} VAE, {s['data']}, global batch {s['global_batch_size']} "
            f"({s['world_size']} ranks x {s['global_batch_size'] // s['world_size']} for ddp), {s['dtype']}, "
            f"frozen initial weights, {s['grad_steps']} global batches")
    lines = _effect_lines(result)
    lines += [f"Gradient difference to one device on the same global batch, over the batch-to-batch noise of one "
              f"device ({head}): a size, not a kind (another draw and another model look alike here)", "",
              "| factor (variant) | ratio to batch noise | encoder | fc_mu/fc_var | decoder |",
              "|---|---|---|---|---|"]
    for name, v in result["variants"].items():
        r = v["ratio_to_batch_noise"]
        factor = VARIANTS[name][2] if name in VARIANTS else v["factor"]
        lines.append(f"| {factor} ({name}) | **{_f(r['all'])}** | {_f(r['encoder'])} | {_f(r['fc_mu/fc_var'])} | "
                     f"{_f(r['decoder'])} |")
    n, g = result["batch_noise"], result["grad_norm"]
    lines += ["", f"Batch-to-batch noise of one device: mean ||g(batch k) - g(batch k')|| = {_f(n['all'])}, "
              f"mean gradient norm ||g|| = {_f(g['all'])} (ratio {_f(n['all'] / g['all'])})"]
    lg, sp = result.get("logging"), result.get("spread")
    if lg:
        lines += ["", f"What Lightning logs under DDP (rank 0's mean of {s['global_batch_size'] // s['world_size']}) "
                      f"against the global-batch value, over {lg['batches']} batches at the frozen weights", "",
                  "| term | mean abs(logged - global) over mean abs(global k - global k') | "
                  "spread of logged / spread of global | per-sample variance / mean^2 |",
                  "|---|---|---|---|"]
        lines.append(f"| KL | {_f(lg['kl_ratio'])} | {_f(sp['kl_spread_ratio']) if sp else '-'} | "
                     f"{_f(sp.get('relvar_kl')) if sp else '-'} |")
        lines.append(f"| reconstruction (MSE) | {_f(lg['recon_ratio'])} "
                     f"| {_f(sp['recon_spread_ratio']) if sp else '-'} "
                     f"| {_f(sp.get('relvar_recon')) if sp else '-'} |")
    red = result["reduction"]
    lines += ["", f"Mean reduction: {red['train_samples']} training images, {red['padded_samples']} padded by "
                  f"DistributedSampler; per-rank batches are equal at every step (last: {red['per_rank_last_batch']} "
                  f"per rank), so the mean of rank means is the global mean on "
                  f"{'every step' if not red['unequal_steps_per_epoch'] else 'every step but one per epoch'}."]
    return "\n".join(lines)
