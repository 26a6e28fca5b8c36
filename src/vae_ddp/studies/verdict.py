"""The answer to the report, stated from the committed studies.

``verdict_box`` writes the Home page's first screen (a neutral Material ``!!! info``
admonition: what the report saw, what training changes, what to change), ``dp_table`` the table of which configuration has which factor and ``dp_lead``
the measured line above it, from:

- ``docs/results/seeds-full/seeds.json`` (the seed study): its ``"verdict"`` object
  (``{"ddp": {"train_kl": "equivalent" | "different" | "inconclusive", ...}}``) and the
  comparison behind each word (``summary[config][quantity]["vs_single"]``), else its Welch
  p-values;
- ``docs/results/long-horizon/long-horizon.json`` when present (its ``"comparison"``: shared
  against independent reparameterization noise, per quantity);
- ``docs/results/report-scale/report_scale.json`` when present (the report's scale, one
  step): what logging does to the plotted KL and each factor's effect on the gradient (a bias
  or a noise ratio, or only other luck: [`vae_ddp.harness.effect`][vae_ddp.harness.effect]).

The words follow rules, one quantity at a time (``combine``, ``worst``): any study that
finds a difference makes it "different"; else any "inconclusive" makes it "inconclusive";
only when every study shows equivalence does the box say "matches", and then with the
margin in the reader's terms (one seed-to-seed standard deviation). Every number is read
from those files; none is typed here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vae_ddp.harness.table import number

__all__ = ["QUANTITIES", "UPSTREAM", "combine", "decide", "dp_lead", "dp_table", "load", "verdict_box", "worst"]

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
            "report_scale": _read(res / "report-scale" / "report_scale.json")}


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


def _pick(study_list: list[dict], qs: list[str], word: str) -> tuple[dict, str] | None:
    """The study and quantity that say ``word`` for one of ``qs``: the seed study first (DDP against
    one device, the reader's question; the long-horizon check isolates one factor), the training
    quantity first."""
    for st in sorted(study_list, key=lambda s: s["name"] != "seeds"):
        for q in qs:
            if st["verdicts"].get(q) == word:
                return st, q
    return None


def _which(qs: list[str], combined: dict[str, str], word: str) -> str:
    """`` (validation)`` when only some of a term's quantities have ``word``; empty when all do."""
    hit = [QUANTITIES[q][1] for q in qs if combined.get(q) == word]
    return "" if len(hit) == len(qs) else f" ({', '.join(hit)})"


def _term_clause(term: str, qs: list[str], combined: dict[str, str], studies: list[dict], seeds: dict,
                 lh: dict | None, said: set[str]) -> str:
    """One clause of the training sentence, worded from the term's combined verdict only (a scope
    or a margin's meaning already in ``said`` is not repeated)."""
    word = worst([combined[q] for q in qs])
    st, q = _pick(studies, qs, word) or (studies[0], qs[0])
    c, sd = st["cmp"].get(q, {}), _sd(st, seeds, lh)
    scope, sd_once = ("" if st["scope"] in said else st["scope"]), ("" if sd in said else sd)
    said.update({st["scope"], sd})
    if word == "different":
        who = (f"alone ({_emulated(lh)}), over {st['scope']}, it" if st["name"] == "long_horizon"
               else f"with Lightning's defaults, over {st['scope']}, DDP")
        if "diff" not in c or not c.get("mean_b"):
            return f"{who} changes the final {term}{_which(qs, combined, word)}"
        way = "raises" if c["diff"] > 0 else "lowers"
        return (f"{who} {way} the final {QUANTITIES[q][1]} {term} by {abs(c['diff'] / c['mean_b']):.1%}, "
                f"{_against(c, sd)}")
    if word == "inconclusive":
        m = ""
        if "margin" in c:
            m = f", nor shown within the margin of ±{_n(c['margin'])}" + (f", {sd_once}" if sd_once else "")
        whose = (f"the effect of {_factor('noise')} alone on the" if st["name"] == "long_horizon" else "its effect on the")
        return (f"{whose} {term}{_which(qs, combined, word)} is inconclusive ({scope + ': ' if scope else ''}"
                f"no difference detected{m})")
    margins = [(s["cmp"][q]["margin"], s["cmp"][q].get("mean_b")) for s in studies if "margin" in s["cmp"].get(q, {})]
    m = ""
    if margins:
        margin, mean = max(margins)
        m = f" within ±{_n(margin)}, {sd}" + (f" ({abs(margin / mean):.1%} of its value)" if mean else "")
    return f"the {term} matches one device's{m} ({' and '.join(s['scope'] for s in studies)})"


def _emulated(lh: dict | None) -> str:
    """How the long-horizon check trained, from its settings: ``one device emulating 2 ranks' shared
    noise at a global batch of 16``."""
    st = (lh or {}).get("settings", {})
    how = (f"one device emulating {st['world_size']} ranks' shared noise" if st.get("devices") == 1 and st.get("world_size")
           else "shared against independent noise")
    return how + (f" at a global batch of {st['global_batch_size']}" if st.get("global_batch_size") else "")


def _measured_on(seeds: dict, lh: dict | None) -> str:
    """`` (the small VAE, global batches of 64 and 16)``: the model and batch the studies trained,
    from their settings (empty when they do not say)."""
    settings = [st.get("settings", {}) for st in (seeds, lh) if st]
    models = list(dict.fromkeys(s["model"] for s in settings if s.get("model")))
    batches = list(dict.fromkeys(s["global_batch_size"] for s in settings if s.get("global_batch_size")))
    if not models:
        return ""
    model = " and ".join(f"{'ResNet-18' if m == 'resnet18' else m} VAE" for m in models)
    if not batches:
        return f" (the {model})"
    sizes = " and ".join(str(b) for b in batches)
    return f" (the {model}, global batch{'es of' if len(batches) > 1 else ''} {sizes})"


def _terms(combined: dict[str, str]) -> dict[str, list[str]]:
    """term -> its quantities present in ``combined`` (``{"KL": ["train_kl", "val_kl"], ...}``)."""
    terms: dict[str, list[str]] = {}
    for q in QUANTITIES:
        if q in combined:
            terms.setdefault(QUANTITIES[q][0], []).append(q)
    return terms


#: Each training factor's fix, as the report's script takes it (``examples/vae.py``'s flags; the
#: names are ``vae_ddp.fixes`` exports, checked by tests/test_answer.py).
FIXES = {"batchnorm": "GlobalSyncBatchNorm", "noise": "GlobalBatchNoise", "sampler": "GlobalBatchDistributedSampler"}


def plotted_words(effect: dict) -> str:
    """What logging rank 0's mean does to the logged curve against the global batch's, by rule, from
    a [`decompose`][vae_ddp.harness.effect.decompose] result: a shift (the bias interval above 0), a
    noisier or quieter curve (the noise ratio interval above or below 1), "not a shifted one" only
    where the shift is shown below the margin (the bias interval's upper end below ``BIAS_MARGIN``)."""
    from vae_ddp.harness.effect import BIAS_MARGIN

    (b_lo, b_hi), (r_lo, r_hi) = effect["bias_ci"], effect["variance_ratio_ci"]
    ratio = (f"{_g(effect['variance_ratio'])}x the variance of the global batch's, 95% interval "
             f"{_n(r_lo)} to {_n(r_hi)}")
    shifted = f"shifted by {_n(effect['bias'])} sd" if b_lo > 0 else ""
    if r_lo > 1 or r_hi < 1:
        noisy = f"a {'noisier' if r_lo > 1 else 'quieter'} curve ({ratio})"
        if shifted:
            return f"{noisy}, {shifted}"
        if b_hi < BIAS_MARGIN:
            return f"{noisy}, not a shifted one (a shift below {_n(b_hi)} sd)"
        return f"{noisy}; a shift is neither detected nor excluded"
    if shifted:
        return f"a curve {shifted}"
    if effect["kind"] == "same distribution":
        return "the same curve up to other luck"
    return "a curve this study cannot tell from the global batch's"


def _step_clause(key: str, e: dict) -> str:
    """One factor's one-step effect on the gradient, by rule: ``[BatchNorm statistics](...) shifts
    DDP's gradient by 0.82 sd``, ``... gives DDP's gradient 1.3x one device's variance``, ``... changes
    only the luck``."""
    name = _factor(key)
    if e["kind"] == "exact":
        return f"{name} changes nothing"
    if e["kind"] == "same distribution":
        return f"{name} changes only the luck"
    if e["kind"] == "inconclusive":
        return f"{name} is not resolved"
    parts = []
    if e["bias_ci"][0] > 0:
        parts.append(f"shifts DDP's gradient by {_n(e['bias'])} sd")
    lo, hi = e["variance_ratio_ci"]
    if lo > 1 or hi < 1:
        parts.append(f"{_n(e['variance_ratio'])}x its variance" if parts else
                     f"gives DDP's gradient {_n(e['variance_ratio'])}x one device's variance")
    return f"{name} {' and '.join(parts)}"


def step_words(rs: dict | None) -> str:
    """The report's scale in one clause, by rule, from ``report_scale.json``'s effects (empty where
    it has none): ``at the report's scale (one step of the ResNet-18 VAE, 24 global batches of 256 = 2
    x 128 from the same weights; sd: one device's step-to-step standard deviation), [BatchNorm
    statistics](...) shifts DDP's gradient by 0.82 sd, ... and [Sampler and data order](...) changes
    only the luck``; the factors that change what DDP trains first."""
    if not rs:
        return ""
    from vae_ddp.studies.report_scale import FACTOR_VARIANTS, ranking

    keys = {v: k for k, v in FACTOR_VARIANTS.items()}
    rows = [r for r in ranking(rs) if r["variant"] in keys]
    if not rows:
        return ""
    s = rs["settings"]
    model = "ResNet-18 VAE" if s.get("model") == "resnet18" else f"{s.get('model')} VAE"
    clauses = [_step_clause(keys[r["variant"]], rs["variants"][r["variant"]]["effect"]["gradient"]) for r in rows]
    listed = ", ".join(clauses[:-1]) + (" and " if len(clauses) > 1 else "") + clauses[-1]
    scale = ("at the report's scale (one step of the" if (s.get("model"), s["global_batch_size"]) == ("resnet18", 256)
             else "in one step (the")
    sd = "; sd: one device's step-to-step standard deviation" if " sd" in listed else ""
    return (f"{scale} {model}, {s['effect_batches']} global batches of "
            f"{s['global_batch_size']} = {s['world_size']} x {s['global_batch_size'] // s['world_size']} from the same "
            f"weights{sd}), {listed}")


def _change(rs: dict | None) -> str:
    """The box's third sentence: what to change in the report's script, the fixes of the factors the
    report's scale shows changing what DDP trains (every training fix where it has no effects)."""
    keys = list(FIXES)
    if rs:
        from vae_ddp.studies.report_scale import FACTOR_VARIANTS

        measured = {k: rs["variants"].get(v, {}).get("effect") for k, v in FACTOR_VARIANTS.items()}
        if any(measured.values()):
            keys = [k for k in FIXES if (measured.get(k) or {}).get("kind") == "different"]
    fixes = "".join(f", `{FIXES[k]}` for {_name(k)}" for k in keys)
    return ("**What to change**: log with `sync_dist=True` for the curve" + fixes
            + " ([the report's script with every change](scaling.md), which trains one device's weights on 2 "
              "processes; [the recipe](recipe.md) explains each change).")


def decide(seeds: dict, long_horizon: dict | None = None, report_scale: dict | None = None) -> dict[str, Any]:
    """What the studies support for DDP against one device, by rule (see ``combine``):
    ``{"kind", "title", "verdicts", "training", "scope"}``.

    ``kind`` is the rule applied over every quantity ("different", "inconclusive" or
    "equivalent"), ``verdicts`` the word per quantity, ``training`` the box's sentence on what
    training changes (different terms first, each worded from its own verdict). Neither says
    "matches" unless every study shows the quantity equivalent.
    """
    combined = combine(seeds, long_horizon, "ddp")
    kind = worst(list(combined.values()))
    studies = _studies(seeds, long_horizon)
    terms = sorted(_terms(combined).items(), key=lambda t: _ORDER.index(worst([combined[q] for q in t[1]])))
    said: set[str] = set()
    clauses = [_term_clause(term, qs, combined, studies, seeds, long_horizon, said) for term, qs in terms]
    step = step_words(report_scale)
    over = f"over whole trainings{_measured_on(seeds, long_horizon)}" if step else _measured_on(seeds, long_horizon)
    noise = ("" if step else "by default every rank draws the same reparameterization noise "
             f"({_factor('noise')}); ")
    training = ("**What training changes**" + (f": {step}; {over}: " if step else f"{over}: ")
                + noise + "; ".join(clauses) + ".")
    title = {"different": "DDP plots rank 0's share of each batch, and Lightning's defaults change training",
             "inconclusive": "DDP plots rank 0's share of each batch; whether its training differs is inconclusive",
             "equivalent": "DDP plots rank 0's share of each batch; its training matches one device within the margin",
             }[kind]
    return {"kind": kind, "title": title, "verdicts": combined, "training": training,
            "scope": [s["scope"] for s in studies]}


def _seen(rs: dict | None) -> str:
    """The reporter's view: DDP's logged curve is rank 0's share (report_scale.json's logging row)."""
    head = (f"**What the report saw** ([#6789]({UPSTREAM})): DDP's curve, logged with `on_step=True` and no "
            "`sync_dist`, is ")
    link = f"({_factor('logging')}; `sync_dist=True` plots the global batch)."
    if not rs or not rs.get("logging"):
        return head + f"rank 0's share of each batch, not the global batch {link}"
    s = rs["settings"]
    share = f"rank 0's {s['global_batch_size'] // s['world_size']} of {s['global_batch_size']} samples"
    where = "" if s.get("model") == "resnet18" else f" (measured with the {s.get('model')} VAE)"
    plotted = rs["logging"].get("effect")
    if plotted:
        names = {"kl": "KL", "reconstruction": "reconstruction"}
        terms = sorted((q for q in names if q in plotted), key=lambda q: plotted[q]["kind"] == "inconclusive")
        said = "; ".join(f"its {names[q]} {'is ' if i == 0 else ''}{plotted_words(plotted[q])}"
                         for i, q in enumerate(terms))
        return head + f"{share}: {said}{where} " + link
    sp = (rs.get("spread") or {}).get("kl_spread_ratio")
    jump = f" and {_g(sp)}x as spread" if sp else ""
    return (head + f"{share}, which alone puts its KL {_g(rs['logging']['kl_ratio'])}x a batch-to-batch change off "
            f"the global batch's{jump}{where} " + link)


def _training_words(seeds: dict, config: str, scope: bool = True, long_horizon: dict | None = None) -> str:
    """``differs in training (training reconstruction +2.7%, 10 seeds x 150 steps)``: the words on
    ``config`` against one device, by the rule of ``combine`` over the seed study and, for
    ``ddp``, the long-horizon check (the same words as the verdict box)."""
    v = combine(seeds, long_horizon, config)
    if not v:
        return "is not measured in training here"
    word = worst(list(v.values()))
    where = _scope(seeds["num_seeds"], seeds["settings"].get("steps")) if scope else ""
    summ = {q: e["vs_single"] for q, e in seeds.get("summary", {}).get(config, {}).items() if "vs_single" in e}
    if word == "different":
        q = next((q for q in QUANTITIES if v.get(q) == "different" and summ.get(q, {}).get("mean_b")), None)
        size = f"{QUANTITIES[q][1]} {QUANTITIES[q][0]} {summ[q]['diff'] / summ[q]['mean_b']:+.1%}" if q else ""
        inner = ", ".join(x for x in (size, where) if x)
        return f"differs in training{f' ({inner})' if inner else ''}"
    if word == "inconclusive":
        return f"is inconclusive in training{f' ({where})' if where else ''}"
    ms = [summ[q]["margin"] for q in v if "margin" in summ.get(q, {})]
    m = f" within ±{_n(max(ms))}, {_sd({'name': 'seeds'}, seeds, None)}" if ms else ""
    if scope and config == "ddp" and long_horizon:
        where = " and ".join(st["scope"] for st in _studies(seeds, long_horizon))
    return f"matches one device in training{m}{f' ({where})' if where else ''}"


def dp_lead(results: dict[str, dict | None]) -> str:
    """The measured line above ``dp_table``'s table: DP's and DDP's training against one device
    (the seed study's words; DDP's by the verdict box's rule, the long-horizon check included)
    and one step's gradient at the report's scale."""
    seeds, rs = results["seeds"], results["report_scale"] or {}
    v = rs.get("variants", {})
    both = v.get("dp (emulation of Lightning 1.x DP)"), v.get("ddp, Lightning defaults")
    step = ""
    if all(both) and all(e.get("effect") for e in both):
        step = f"; one step at the report's scale: DP (emulation) {_step(both[0])}, DDP {_step(both[1])}"
    elif all(both):
        step = (f"; one step at the report's scale moves DP's gradient {_g(both[0]['ratio_to_batch_noise']['all'])}x "
                f"the batch-to-batch noise (emulation), DDP's {_g(both[1]['ratio_to_batch_noise']['all'])}x")
    scope = _scope(seeds["num_seeds"], seeds["settings"].get("steps"))
    lh = results.get("long_horizon")
    also = ""
    if lh and worst(list(combine(seeds, lh).values())) != worst(list(combine(seeds).values())):
        # DDP's words weigh the long-horizon check too, as the verdict box does: say so where it decides them
        also = (f" (with the [long-horizon check](is-it-a-bug.md#long-horizon-does-noise-shared-across-ranks-shift-"
                f"the-kl), {_studies(seeds, lh)[-1]['scope']})")
    dp_words, ddp_words = worst(list(combine(seeds, None, "dp").values())), worst(list(combine(seeds, lh).values()))
    same = dp_words == ddp_words != "equivalent"
    if all(both) and all(e.get("effect") for e in both):
        same = same and both[0]["effect"]["gradient"]["kind"] == both[1]["effect"]["gradient"]["kind"]
    closer = ". By these measures DP is no closer to one device than DDP" if same else ""
    return (f"Measured with Lightning's defaults ([seed study](is-it-a-bug.md#result-ten-seeds-of-each-configuration), "
            f"{scope}): DP {_training_words(seeds, 'dp', scope=False)}, and DDP "
            f"{_training_words(seeds, 'ddp', scope=False, long_horizon=lh)}{also}{step}{closer}.\n")


def _step(entry: dict) -> str:
    """A report-scale variant's one-step effect on the gradient in words: ``trains another model:
    bias 0.82 sd`` (``report_scale.effect_cell``)."""
    from vae_ddp.studies.report_scale import effect_cell

    return effect_cell(entry["effect"]["gradient"])


def _cell(qs: list[str], verdicts: dict[str, str], cmp: dict) -> str:
    """One study's words for one term: ``equivalent`` / ``+3.1%, +2.6%`` / ``inconclusive``."""
    ws = [verdicts.get(q, "-") for q in qs]
    if len(set(ws)) == 1 and ws[0] != "different":
        return ws[0]
    if all(w == "different" and cmp.get(q, {}).get("within_margin") and "diff" in cmp[q] for q, w in zip(qs, ws)):
        return ", ".join(f"{cmp[q]['diff'] / cmp[q]['mean_b']:+.1%}" for q in qs) + " (within the margin)"
    return ", ".join((f"{cmp[q]['diff'] / cmp[q]['mean_b']:+.1%}" + (" (within the margin)" if cmp[q].get("within_margin") else ""))
                     if w == "different" and "diff" in cmp.get(q, {}) else w for q, w in zip(qs, ws))


STUDY_NAMES = {"seeds": ("DDP vs one device", "is-it-a-bug.md#result-ten-seeds-of-each-configuration"),
               "long_horizon": ("shared noise alone",
                                "is-it-a-bug.md#long-horizon-does-noise-shared-across-ranks-shift-the-kl")}


def _study_link(name: str) -> str:
    """``[DDP vs one device](is-it-a-bug.md#...)``: a study's column head, a link to its section."""
    words, page = STUDY_NAMES[name]
    return f"[{words}]({page})"


def _table(seeds: dict, lh: dict | None, combined: dict[str, str]) -> list[str]:
    """Markdown table rows: a column per term (final training and validation values), the combined
    verdict first, then a row of each study's words (few columns: it fits a phone's width)."""
    studies = _studies(seeds, lh)
    terms = _terms(combined)
    out = ["| final value (training, validation) | " + " | ".join(terms) + " |", "|" + "---|" * (len(terms) + 1),
           "| **verdict** | " + " | ".join(f"**{worst([combined[q] for q in qs])}**" for qs in terms.values()) + " |"]
    for s in studies:
        out.append(f"| {_study_link(s['name'])} | " + " | ".join(_cell(qs, s["verdicts"], s["cmp"])
                                                                  for qs in terms.values()) + " |")
    return out


def verdict_box(results: dict[str, dict | None]) -> str:
    """The Home page's verdict admonition (Markdown, a neutral Material ``!!! info``): three
    sentences (what the report saw, what training changes, what to change), with links to the
    studies; each study's words per term are ``verdict_table``'s, under the box."""
    seeds, lh, rs = results["seeds"], results["long_horizon"], results["report_scale"]
    d = decide(seeds, lh, rs)
    body = " ".join([_seen(rs), d["training"], _change(rs)])
    return f'!!! info "{d["title"]}"\n\n    {body}\n'


def verdict_table(results: dict[str, dict | None]) -> str:
    """The table under Home's verdict box (Markdown): each term's combined verdict and each study's
    words, then what the words mean."""
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
            "A percentage is DDP's difference from one device's final value.")


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
        return f" (one step: {_g(e['ratio_to_batch_noise']['all'])}x batch noise, [report scale](#the-reports-scale))" if e else ""

    dp_note = "inferred: [DP emulation](dataparallel.md), not observed on GPUs here"
    rows = [
        (_name("noise"), "one stream for the whole batch",
         f"every replica draws the same noise ({dp_note}: torch seeds every CUDA device alike)",
         "every rank draws the same noise (measured: " + _page_link("noise") + ")" + ratio("ddp, noise back to default")),
        (_name("batchnorm"), "the whole batch",
         f"each replica's chunk ({dp_note}: `nn.DataParallel` runs each replica's BatchNorm on its chunk)",
         "each rank's 128 (measured: " + _page_link("batchnorm") + ")" + ratio("ddp, BatchNorm back to per-rank")),
        (_name("sampler"), "`RandomSampler`",
         "the same `RandomSampler` as one device: the same batches in the same order (by construction: one process, "
         "one DataLoader; measured: [report-style curves](#what-the-report-plotted))",
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
