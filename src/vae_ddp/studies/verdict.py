"""The words of the studies on DDP against one device, from the committed studies.

``verdict_table`` writes the table under Home's first screen (each whole-training study's own
words per term; the first screen itself is [`vae_ddp.studies.answer`][vae_ddp.studies.answer]),
``dp_table`` the table of which configuration has which factor, from:

- ``docs/results/seeds-full/seeds.json`` (the seed study): its ``"verdict"`` object
  (``{"ddp": {"train_kl": "equivalent" | "different" | "inconclusive", ...}}``) and the
  comparison behind each word (``summary[config][quantity]["vs_single"]``), else its Welch
  p-values;
- ``docs/results/long-horizon/long-horizon.json`` when present (its ``"comparison"``: shared
  against independent reparameterization noise, per quantity);
- ``docs/results/report-scale/report_scale.json`` when present (the report's scale, one
  step): each factor's effect on the gradient (a bias or a noise ratio, or only other luck:
  [`vae_ddp.harness.effect`][vae_ddp.harness.effect]).

Where words of several studies are combined (``combine``, ``worst``): any study that finds a
difference makes it "different"; else any "inconclusive" makes it "inconclusive"; only when
every study shows equivalence is it "equivalent". A table's row holds one study's words, each
cell one word. Every number is read from those files; none is typed here.
"""

from __future__ import annotations

import json
from pathlib import Path

from vae_ddp.harness.table import number

__all__ = ["QUANTITIES", "UPSTREAM", "combine", "dp_table", "load", "verdict_table", "worst"]

UPSTREAM = "https://github.com/Lightning-AI/pytorch-lightning/issues/6789"

#: The final quantities the studies compare, and the term (row of the box's table) of each.
QUANTITIES = {"train_kl": ("KL", "training"), "val_kl": ("KL", "validation"),
              "train_recon_loss": ("reconstruction", "training"), "val_recon_loss": ("reconstruction", "validation")}

_ORDER = ("different", "inconclusive", "equivalent")


def _read(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load(root: Path) -> dict[str, dict | None]:
    """The committed results under ``root/docs/results`` (None where a file is absent)."""
    res = Path(root) / "docs" / "results"
    return {"seeds": _read(res / "seeds-full" / "seeds.json"),
            "long_horizon": _read(res / "long-horizon" / "long-horizon.json"),
            "report_scale": _read(res / "report-scale" / "report_scale.json"),
            "report_training": _read(res / "report-training" / "summary.json"),
            "step_equality": _read(res / "step-equality" / "summary.json")}


def _g(v: float) -> str:
    """3 significant digits, trailing zeros kept (``0.100``, ``1.03``, ``12.5``)."""
    return number(v, zeros=True)


def _n(v: float) -> str:
    """2 significant digits, no exponent for the sizes of this project (``0.00051``, ``2.6``)."""
    return f"{abs(v):.2g}"


def worst(verdicts: list[str]) -> str:
    """The rule: any "different" -> "different"; else any "inconclusive" -> "inconclusive"; else
    "equivalent" (an empty list is "inconclusive": nothing was shown)."""
    for w in _ORDER:
        if w in verdicts:
            return w
    return "inconclusive"


def _seed_verdicts(seeds: dict, config: str) -> dict[str, str]:
    """The seed study's word per quantity for ``config``: its ``"verdict"`` object, else its Welch
    p-values (p < 0.05: "different", else "inconclusive": not detecting a difference does not
    show equivalence)."""
    if "verdict" in seeds:
        return dict(seeds["verdict"].get(config, {}))
    return {q: "different" if e["vs_single"]["p"] < 0.05 else "inconclusive"
            for q, e in seeds.get("summary", {}).get(config, {}).items() if "vs_single" in e}


def _lh_verdicts(lh: dict | None) -> dict[str, str]:
    """The long-horizon check's word per quantity (its ``comparison``), else its overall verdict
    for every quantity it names."""
    if not lh:
        return {}
    if lh.get("comparison"):
        return {q: c["verdict"] for q, c in lh["comparison"].items()}
    return {q: lh["verdict"] for q in QUANTITIES if "verdict" in lh}


def combine(seeds: dict, long_horizon: dict | None = None, config: str = "ddp") -> dict[str, str]:
    """One word per final quantity for ``config`` against one device, ``worst`` of the words of
    every study that measured it: the seed study (``config`` against one device) and, for
    ``ddp``, the long-horizon check (shared against independent noise: the default that the
    seed study cannot isolate, over more steps)."""
    words: dict[str, list[str]] = {}
    for q, w in _seed_verdicts(seeds, config).items():
        words.setdefault(q, []).append(w)
    if config == "ddp":
        for q, w in _lh_verdicts(long_horizon).items():
            words.setdefault(q, []).append(w)
    return {q: worst(ws) for q, ws in words.items()}


def _factor(key: str) -> str:
    """``[Random streams per rank](factors/noise.md)``: a factor's link under its registry name."""
    from vae_ddp.fixes.registry import get

    f = get(key)
    return f"[{f.name}]({f.page})"


def _scope(n: int, steps: int | None) -> str:
    return f"{n} seeds x {steps:,} steps" if steps else f"{n} seeds"


def _studies(seeds: dict, lh: dict | None) -> list[dict]:
    """The studies behind DDP's words, each as ``{"name", "scope", "verdicts", "cmp"}`` (``cmp``:
    quantity -> its comparison, with ``diff``, ``mean_b``, ``ci_low``, ``ci_high``, ``margin``
    where the file has them)."""
    s = seeds["settings"]
    out = [{"name": "seeds", "scope": _scope(seeds["num_seeds"], s.get("steps")),
            "verdicts": _seed_verdicts(seeds, "ddp"),
            "cmp": {q: e["vs_single"] for q, e in seeds.get("summary", {}).get("ddp", {}).items()
                    if "vs_single" in e}}]
    if lh:
        out.append({"name": "long_horizon",
                    "scope": _scope(lh.get("num_seeds", len(lh.get("settings", {}).get("seeds", []))),
                                    lh.get("settings", {}).get("steps")),
                    "verdicts": _lh_verdicts(lh), "cmp": dict(lh.get("comparison") or {})})
    return out


def _sd(study: dict, seeds: dict, lh: dict | None) -> str:
    """The margin in the reader's terms: ``one seed-to-seed standard deviation``."""
    k = (lh if study["name"] == "long_horizon" else seeds).get("margin_sd", 1)
    return "one seed-to-seed standard deviation" if k == 1 else f"{k:g} seed-to-seed standard deviations"


def adjusted_interval(c: dict, quantities: int = len(QUANTITIES)) -> tuple[float, float] | None:
    """The interval that decides a difference against the margin at the verdict's correction
    ([`margin_interval`][vae_ddp.harness.stats.margin_interval]: 97.5% for 4 quantities)."""
    from vae_ddp.harness.stats import margin_interval

    return margin_interval(c, quantities)


def _against(c: dict, sd: str) -> str:
    """Where a difference lies against the study's margin, by the interval the verdict's correction
    allows (``adjusted_interval``; the 95% one where the comparison has no spread): ``more than one
    seed-to-seed standard deviation (0.00081 against ±0.00051)`` when it lies wholly outside,
    ``less than`` when the (Holm-adjusted) equivalence test shows it inside, else ``not shown to be
    more or less than``."""
    m = c.get("margin")
    if m is None:
        return "against no stated margin"
    lo, hi = adjusted_interval(c) or (c.get("ci_low", 0), c.get("ci_high", 0))
    if lo > m or hi < -m:
        rel = "more than"
    elif c.get("within_margin"):
        rel = "less than"
    else:
        rel = "not shown to be more or less than"
    return f"{rel} {sd} ({_n(c['diff'])} against ±{_n(m)})"


def _emulated(lh: dict | None) -> str:
    """How the long-horizon check trained, from its settings: ``one device emulating 2 ranks' shared
    noise at a global batch of 16``."""
    st = (lh or {}).get("settings", {})
    how = (f"one device emulating {st['world_size']} ranks' shared noise"
           if st.get("devices") == 1 and st.get("world_size") else "shared against independent noise")
    return how + (f" at a global batch of {st['global_batch_size']}" if st.get("global_batch_size") else "")


def _terms(combined: dict[str, str]) -> dict[str, list[str]]:
    """term -> its quantities present in ``combined`` (``{"KL": ["train_kl", "val_kl"], ...}``)."""
    terms: dict[str, list[str]] = {}
    for q in QUANTITIES:
        if q in combined:
            terms.setdefault(QUANTITIES[q][0], []).append(q)
    return terms


def _step(entry: dict) -> str:
    """A report-scale variant's one-step effect on the gradient in words: ``trains another model:
    bias 0.82 sd`` (``report_scale.effect_cell``)."""
    from vae_ddp.studies.report_scale import effect_cell

    return effect_cell(entry["effect"]["gradient"])


def _cell(qs: list[str], verdicts: dict[str, str], cmp: dict) -> str:
    """One study's words for one term, one word a cell: ``equivalent``, ``inconclusive``, ``different: +3.1%,
    +2.6%, less than the margin`` (the difference from one device's final value, placed against the margin
    by ``_against``); where training and validation have other words, each with its quantity."""
    ws = {q: verdicts.get(q, "-") for q in qs}
    if len(set(ws.values())) == 1 and "different" not in ws.values():
        return next(iter(ws.values()))

    def sized(group: list[str]) -> str:
        pcts = [f"{cmp[q]['diff'] / cmp[q]['mean_b']:+.1%}" for q in group if cmp.get(q, {}).get("mean_b")]
        rels = {_against(cmp[q], "the margin").split(" (")[0] for q in group if "margin" in cmp.get(q, {})}
        return ", ".join(pcts + (list(rels) if len(rels) == 1 else []))

    if len(set(ws.values())) == 1:
        return f"different: {sized(qs)}"
    return ", ".join(f"{w} ({QUANTITIES[q][1]}" + (f": {sized([q])})" if w == "different" else ")")
                     for q, w in ws.items())


STUDY_NAMES = {"seeds": ("DDP vs one device", "is-it-a-bug.md#result-ten-seeds-of-each-configuration"),
               "long_horizon": ("shared noise alone",
                                "is-it-a-bug.md#long-horizon-does-noise-shared-across-ranks-shift-the-kl")}


def _study_link(name: str) -> str:
    """``[DDP vs one device](is-it-a-bug.md#...)``: a study's column head, a link to its section."""
    words, page = STUDY_NAMES[name]
    return f"[{words}]({page})"


def _table(seeds: dict, lh: dict | None, combined: dict[str, str]) -> list[str]:
    """Markdown table rows: a column per term (final training and validation values), a row of each
    study's own words (few columns: it fits a phone's width)."""
    terms = _terms(combined)
    out = ["| whole trainings: final values | " + " | ".join(terms) + " |", "|" + "---|" * (len(terms) + 1)]
    for s in _studies(seeds, lh):
        out.append(f"| {_study_link(s['name'])} | " + " | ".join(_cell(qs, s["verdicts"], s["cmp"])
                                                                  for qs in terms.values()) + " |")
    return out


def verdict_table(results: dict[str, dict | None]) -> str:
    """The table under Home's first screen (Markdown): each study's words per term, then what the
    words mean."""
    seeds, lh = results["seeds"], results["long_horizon"]
    verdicts = combine(seeds, lh, "ddp")
    return "\n".join([*_table(seeds, lh, verdicts), "", _equivalent_means(seeds, lh, verdicts)]) + "\n"


def _equivalent_means(seeds: dict, lh: dict | None, combined: dict[str, str]) -> str:
    """The line under the box's table: what its words mean (each study's margin, in the reader's terms)."""
    sd = _sd({"name": "seeds"}, seeds, lh)
    runs = "; ".join(f"{STUDY_NAMES[s['name']][0]}: {s['scope']}" for s in _studies(seeds, lh))
    return (f"{runs[0].upper() + runs[1:]}{f' ({_emulated(lh)})' if lh else ''}. "
            f"*equivalent*: the difference is shown to lie within the margin, {sd} (an equivalence test at 5%, "
            "Holm-adjusted over the quantities); *different*: a difference is detected at 5%; *inconclusive*: neither. "
            "A percentage is the difference from the final value compared against; *less than the margin*: a "
            "difference detected and shown smaller than the margin.")


def _name(key: str) -> str:
    """A factor's name, from the registry (the one place it is written)."""
    from vae_ddp.fixes.registry import get

    return get(key).name


def _page_link(key: str) -> str:
    """``[its page](factors/noise.md)``: the page of a factor, from the registry (the row already
    names the factor)."""
    from vae_ddp.fixes.registry import get

    return f"[its page]({get(key).page})"


def dp_table(results: dict[str, dict | None]) -> str:
    """Which configuration has which factor (single, Lightning 1.x DP, DDP), each cell with its source."""
    rs = results["report_scale"] or {}
    v = rs.get("variants", {})

    def ratio(name: str) -> str:
        e = v.get(name)
        if e and e.get("effect"):
            return f" (one step: {_step(e)}, [report scale](#the-reports-scale))"
        if not e:
            return ""
        return f" (one step: {_g(e['ratio_to_batch_noise']['all'])}x batch noise, [report scale](#the-reports-scale))"

    dp_note = "inferred: [DP emulation](dataparallel.md), not observed on GPUs here"
    rows = [
        (_name("noise"), "one stream for the whole batch",
         f"every replica draws the same noise ({dp_note}: torch seeds every CUDA device alike)",
         "every rank draws the same noise (measured: " + _page_link("noise") + ")"
         + ratio("ddp, noise back to default")),
        (_name("batchnorm"), "the whole batch",
         f"each replica's chunk ({dp_note}: `nn.DataParallel` runs each replica's BatchNorm on its chunk)",
         "each rank's 128 (measured: " + _page_link("batchnorm") + ")" + ratio("ddp, BatchNorm back to per-rank")),
        (_name("sampler"), "`RandomSampler`",
         "one device's `RandomSampler` in one process: the same batches as one device in the first epoch, other "
         "batches afterwards (checked in the [seed study](is-it-a-bug.md#method))",
         "`DistributedSampler`: other batches, interleaved (measured: " + _page_link("sampler") + ")"
         + ratio("ddp, sampler back to DistributedSampler")),
        (_name("reduction"), "mean over the batch",
         "mean of the replica means (equal chunks but for an uneven last batch; inferred from `training_step_end`)",
         "mean of rank means, equal at this scale (measured: " + _page_link("reduction") + ")"),
        (_name("logging") + " (`on_step`, no `sync_dist`)", "the whole batch",
         "one replica's chunk (inferred from Lightning 1.2.6 and 1.9.5 source, see [`vae_ddp.dp`][vae_ddp.dp])",
         "rank 0's half (measured: " + _page_link("logging") + ")"),
        (_name("optimizer"), "one Adam on the batch gradient", "the same, on the mean of the replica gradients",
         "the same, on the all-reduced gradient (measured: " + _page_link("optimizer") + ")"),
    ]
    both = v.get("dp (emulation of Lightning 1.x DP)"), v.get("ddp, Lightning defaults")
    if all(both) and all(e.get("effect") for e in both):
        rows.append(("All together: one step's gradient vs one device's", "-",
                     f"{_step(both[0])} (DP emulation, [report scale](#the-reports-scale))",
                     f"{_step(both[1])} ([report scale](#the-reports-scale))"))
    elif all(both):
        rows.append(("All together: one step's gradient vs one device's on the same batch", "-",
                     f"{_g(both[0]['ratio_to_batch_noise']['all'])}x batch noise (DP emulation, "
                     "[report scale](#the-reports-scale))",
                     f"{_g(both[1]['ratio_to_batch_noise']['all'])}x batch noise ([report scale](#the-reports-scale))"))
    out = ["| factor | one device | DP (Lightning 1.x) | DDP (Lightning defaults) |", "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(out) + "\n"
