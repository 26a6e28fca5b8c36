"""The first lines of "Is it a bug?": no or yes, and for which of Lightning's defaults.

Written from the committed studies (``docs/results/``, read by
[`vae_ddp.studies.verdict.load`][vae_ddp.studies.verdict.load]) by the rules below; every
number and every verdict word in it is read from their JSON:

- the report's scale (``report_scale.json``, one step of the ResNet-18 VAE at 256 = 2 x 128):
  each training factor's effect (``report_scale.factor_effects``) sorts it by the kind of its
  effect on the gradient, what Adam steps on: ``different`` changes what DDP trains,
  ``same distribution`` only the luck, ``exact`` nothing, ``inconclusive`` is not resolved;
  logging changes no gradient, only what is plotted;
- bug or expected behaviour by the rule of
  [`answer.bug_or_expected`][vae_ddp.studies.answer.bug_or_expected]: "expected behaviour" only
  where the defaults account for the whole difference (with every one of them changed, DDP's step
  is one device's up to rounding and no final value of ``ddp+fixed`` differs) and each is
  documented behaviour;
- whole trainings: the seed study's words for default DDP against one device and the
  long-horizon check's (shared against independent noise), each word exactly as the study
  decided it, a difference placed against the study's margin by ``verdict._against``.

    python examples/is_it_a_bug.py --out out/is-it-a-bug

Prints the answer (Markdown) and writes it to ``answer.md``, with ``is-it-a-bug.json``
(the answer and the class of each factor), and the page's sections (``vae_ddp.studies.answer``):
``documented.md``, ``kl.md``, ``dp.md``, ``faq.md``, ``report_command.md`` and ``reply.md``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vae_ddp.studies import answer as rules
from vae_ddp.studies.report_scale import CELL, effect_cell, factor_effects, logging_cell
from vae_ddp.studies.verdict import (
    QUANTITIES,
    _against,
    _emulated,
    _factor,
    _scope,
    _sd,
    _terms,
    combine,
    load,
    worst,
)

ROOT = Path(__file__).resolve().parents[1]

#: The training factors, in the order the answer names them, and what each default does (words,
#: no numbers: the sizes are the settings').
DEFAULTS = {
    "noise": "every rank draws the same reparameterization noise",
    "batchnorm": "each rank normalizes with the statistics of its own {per_rank} samples",
    "sampler": "`DistributedSampler` deals each rank other samples",
}
#: Each training factor's class, by the kind of its one-step effect on the gradient.
CLASS = {"different": "trains", "same distribution": "luck", "exact": "nothing", "inconclusive": "unresolved"}
LABEL = {"gradient": "gradient", "kl": "KL", "reconstruction": "reconstruction"}
#: What a difference is worded against when the sd phrase is cut off (``_relation``).
_CUT = "\0"


def classes(rs: dict) -> dict[str, str]:
    """``{factor key: "trains" | "luck" | "nothing" | "unresolved"}`` for the training factors the
    report-scale study measured, by the kind of each one's effect on the gradient."""
    effects = factor_effects(rs)
    return {k: CLASS[effects[k]["gradient"]["kind"]] for k in DEFAULTS if k in effects}


def _count(n: int) -> str:
    return {1: "one", 2: "two", 3: "three"}.get(n, str(n))


def _join(items: list[str], word: str = "and") -> str:
    return ", ".join(items[:-1]) + (f" {word} " if len(items) > 1 else "") + items[-1] if items else ""


def _detected(e: dict) -> str:
    """What was detected in one part of a ``different`` effect: ``noise 2.88x``, ``bias 0.188 sd``
    (``report_scale.effect_cell``'s words after its kind)."""
    return effect_cell(e).removeprefix(CELL["different"] + ": ")


def _trains_words(e: dict) -> str:
    """A ``different`` factor's one-step sizes: the gradient's and the KL's where detected (what
    Adam steps on, and what the report plotted), else the reconstruction's."""
    qs = [q for q in ("gradient", "kl") if e[q]["kind"] == "different"] or \
         [q for q in ("reconstruction",) if e[q]["kind"] == "different"]
    return ", ".join(f"{LABEL[q]} {_detected(e[q])}" for q in qs)


def _per_rank(rs: dict) -> dict[str, int]:
    s = rs["settings"]
    return {"per_rank": s["global_batch_size"] // s["world_size"], "global": s["global_batch_size"]}


def _scale(rs: dict) -> str:
    """``at the report's scale (one step of the ResNet-18 VAE, 256 = 2 x 128)``."""
    s = rs["settings"]
    model = "ResNet-18 VAE" if s.get("model") == "resnet18" else f"{s.get('model')} VAE"
    where = "at the report's scale" if (s.get("model"), s["global_batch_size"]) == ("resnet18", 256) else "in one step"
    return (f"{where} (one step of the {model}, {s['global_batch_size']} = {s['world_size']} x "
            f"{s['global_batch_size'] // s['world_size']})")


def accounted(rs: dict, seeds: dict) -> bool:
    """Whether the defaults account for the whole difference, by ``answer.bug_or_expected``: with every
    one changed, DDP's step is one device's up to rounding (``exact``), no final value of ``ddp+fixed``
    is ``different`` (where the seed study has it), and each difference left is documented."""
    return rules.bug_or_expected(rs, seeds)["kind"] == "expected"


def headline(rs: dict, seeds: dict) -> str:
    """The first sentence: expected behaviour or not (``answer.HEADLINE``), and which defaults change what
    DDP trains, with their one-step sizes."""
    cls = classes(rs)
    trains = [k for k, c in cls.items() if c == "trains"]
    unresolved = [k for k, c in cls.items() if c == "unresolved"]
    fill = _per_rank(rs)
    if accounted(rs, seeds):
        head = f"**{rules.HEADLINE['expected']}: "
        if trains:
            verb = "changes" if len(trains) == 1 else "change"
            head += (f"{_count(len(trains))} of Lightning's defaults {verb} what DDP trains**, measured {_scale(rs)}: "
                     + _join([f"{_factor(k)} ({DEFAULTS[k].format(**fill)}: {_trains_words(factor_effects(rs)[k])})"
                              for k in trains]) + ".")
        else:
            head += f"none of Lightning's defaults is shown to change what DDP trains** {_scale(rs)}."
    else:
        fixed = worst(list(seeds.get("verdict", {}).get("ddp+fixed", {}).values()))
        kind = rules.bug_or_expected(rs, seeds)["kind"]
        head = (f"**{rules.HEADLINE[kind]}**: with every default changed, {_step_words(rs)} and whole trainings end "
                f"**{fixed}** against one device's.")
        if trains:
            head += (f" {_count(len(trains)).capitalize()} of Lightning's defaults "
                     f"{'changes' if len(trains) == 1 else 'change'} what DDP trains, measured "
                     f"{_scale(rs)}: " + _join([_factor(k) for k in trains]) + ".")
    if unresolved:
        head += f" Whether {_join([_factor(k) for k in unresolved], 'or')} changes it is not resolved."
    return head


def _step_words(rs: dict) -> str:
    """DDP's one-step kind with every default changed (the variant ``ddp, every fix``): ``DDP's step is
    one device's up to float32 rounding``."""
    floor = (rs["variants"].get("ddp, every fix") or {}).get("effect") or {}
    return "DDP's step is " + {
        "exact": f"one device's up to {rs['settings'].get('dtype', 'float')} rounding",
        "same distribution": "one device's up to other luck", "different": "not one device's",
        "inconclusive": "not shown to be one device's"}.get(floor.get("kind"), "not measured")


def changed(rs: dict, seeds: dict) -> str:
    """What DDP does with every default changed (the evidence behind "No"): its one-step kind at the
    report's scale and the seed study's words on ``ddp+fixed``."""
    floor = (rs["variants"].get("ddp, every fix") or {}).get("effect") or {}
    fixed = seeds.get("verdict", {}).get("ddp+fixed")
    if not floor and not fixed:
        return ""
    parts = [_step_words(rs)] if floor else []
    if fixed:
        s = seeds["settings"]
        cmp = {q: e["vs_single"] for q, e in seeds.get("summary", {}).get("ddp+fixed", {}).items() if "vs_single" in e}
        parts.append(f"whole trainings ({_scope(seeds['num_seeds'], s.get('steps'))}) end with "
                     + _study_words(fixed, cmp, _sd({"name": "seeds"}, seeds, None)))
    end = "; what differs comes from these defaults" if accounted(rs, seeds) else ""
    return f"With every default changed ([the recipe](recipe.md)), {_join(parts)}{end}."


def luck_and_plot(rs: dict) -> str:
    """The factors that change only the luck, nothing, or only the plot (logging, from its effect on
    the plotted KL and reconstruction)."""
    cls, effects = classes(rs), factor_effects(rs)
    parts = []
    for k in (k for k, c in cls.items() if c in ("luck", "nothing")):
        e, what = effects[k], "only the luck" if cls[k] == "luck" else "nothing"
        loose = [LABEL[q] for q in ("kl", "reconstruction") if e[q]["kind"] == "inconclusive"]
        note = f"; its one-step {_join(loose)} not resolved" if loose else ""
        gist = "the same distribution of gradients" if cls[k] == "luck" else "the same step"
        parts.append(f"{_factor(k)} changes {what} ({DEFAULTS[k]}: {gist}{note})")
    lg = effects.get("logging")
    if lg:
        fill = _per_rank(rs)
        plotted = "; ".join(f"{LABEL[q]}: {logging_cell(lg[q])}" for q in ("kl", "reconstruction"))
        parts.append(f"{_factor('logging')} only the plot (the curve is rank 0's {fill['per_rank']} of "
                     f"{fill['global']} samples; {plotted})")
    if not parts:
        return ""
    text = _join(parts)
    return text[0].upper() + text[1:] + "."


def _relation(c: dict) -> str:
    """``less than`` / ``more than`` / ``not shown to be more or less than``: ``verdict._against``'s
    placing of a difference against the margin, without its numbers."""
    return _against(c, _CUT).split(" " + _CUT)[0]


def _term(term: str, qs: list[str], verdicts: dict[str, str], cmp: dict, sd: str) -> str:
    """One term's words in one study, each word the study's own: ``the KL **equivalent**``, ``the
    reconstruction **different**: +3.1% in training and +2.6% in validation, both less than one
    seed-to-seed standard deviation``; where its quantities' words differ, each quantity's: ``the KL
    **equivalent** in training and **different** in validation (+2.0%, less than ...)``."""
    words = [verdicts[q] for q in qs if q in verdicts]
    sized = [q for q in qs if verdicts.get(q) == "different" and "diff" in cmp.get(q, {}) and cmp[q].get("mean_b")]
    pct = {q: f"{cmp[q]['diff'] / cmp[q]['mean_b']:+.1%}" for q in sized}
    if len(set(words)) > 1:
        return f"the {term} " + _join([f"**{verdicts[q]}** in {QUANTITIES[q][1]}"
                                       + (f" ({pct[q]}, {_relation(cmp[q])} {sd})" if q in pct else "")
                                       for q in qs if q in verdicts])
    word = words[0]
    if word != "different" or not sized:
        return f"the {term} **{word}**"
    pcts = [f"{pct[q]} in {QUANTITIES[q][1]}" for q in sized]
    rels = [_relation(cmp[q]) for q in sized]
    if len(set(rels)) == 1:
        each = "" if len(sized) == 1 else ("both " if len(sized) == 2 else "each ")
        return f"the {term} **different**: {_join(pcts)}, {each}{rels[0]} {sd}"
    return f"the {term} **different**: " + ", ".join(f"{p} ({r} {sd})" for p, r in zip(pcts, rels))


def _study_words(verdicts: dict[str, str], cmp: dict, sd: str) -> str:
    """One study's words on every term (``every final value **equivalent**`` where all quantities
    have that one word and it is not "different")."""
    words = set(verdicts.values())
    if len(words) == 1 and words != {"different"}:
        return f"every final value **{words.pop()}**"
    return _join([_term(t, qs, verdicts, cmp, sd) for t, qs in _terms(verdicts).items()])


def trainings(seeds: dict, lh: dict | None) -> str:
    """Whole trainings with Lightning's defaults: the seed study's words on default DDP against one
    device and, where committed, the long-horizon check's on shared against independent noise."""
    s = seeds["settings"]
    cmp = {q: e["vs_single"] for q, e in seeds.get("summary", {}).get("ddp", {}).items() if "vs_single" in e}
    model = f"the {s['model']} VAE" if s.get("model") else "a VAE"
    out = (f"Over whole trainings on a CPU ({model}, global batch {s['global_batch_size']}, "
           f"{_scope(seeds['num_seeds'], s.get('steps'))}), default DDP against one device: "
           + _study_words(combine(seeds, None, "ddp"), cmp, _sd({"name": "seeds"}, seeds, lh)))
    if lh and lh.get("comparison"):
        st = lh.get("settings", {})
        out += (f"; the shared noise alone ({_emulated(lh)}, "
                f"{_scope(lh.get('num_seeds', len(st.get('seeds', []))), st.get('steps'))}): "
                + _study_words({q: c["verdict"] for q, c in lh["comparison"].items()}, lh["comparison"],
                               _sd({"name": "long_horizon"}, seeds, lh)))
    return out + "."


def terms_line(seeds: dict, lh: dict | None = None) -> str:
    """What the answer's words mean (the page defines them again where its studies are shown); the
    margin in the seed study's terms (``verdict._sd``)."""
    sd = _sd({"name": "seeds"}, seeds, lh)
    against = "one device's, or independent noise's" if lh and lh.get("comparison") else "one device's"
    return ("*One step*: DDP's step against one device's over the same global batches from the same weights; "
            "*sd*: one device's step-to-step standard deviation; *bias 0.5 sd*: DDP's step off one device's by "
            "half an sd on average; *noise 2x*: DDP's step-to-step variance twice one device's. A one-step "
            "difference says what DDP trains, not where a training ends. *Over whole trainings*, final values "
            f"paired by seed: *equivalent*, the difference is shown to lie within the margin, {sd} of the final "
            f"value compared against ({against}; what separates two seeds of one configuration); *different*, a "
            "difference is detected; *inconclusive*, neither.")


def answer(results: dict[str, dict | None]) -> str:
    """The page's first lines (Markdown), from ``verdict.load``'s results."""
    seeds, lh, rs = results["seeds"], results["long_horizon"], results["report_scale"]
    lines = [headline(rs, seeds), ""]
    rest = [luck_and_plot(rs), changed(rs, seeds), trainings(seeds, lh)]
    lines += [f"- {x}" for x in rest if x]
    return "\n".join(lines + ["", terms_line(seeds, lh)]) + "\n"


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description="the first lines of 'Is it a bug?', from the committed studies")
    p.add_argument("--out", type=Path, default=Path("out/is-it-a-bug"))
    args = p.parse_args(argv)
    results = load(ROOT)
    text = answer(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "answer.md").write_text(text)
    sections = {"documented": rules.documented_table(results["report_scale"]), "kl": rules.kl_section(results),
                "dp": rules.dp_account(results), "faq": rules.faq_section(results),
                "report_command": rules.command_block(), "reply": rules.reply(results)}
    for name, section in sections.items():
        (args.out / f"{name}.md").write_text(section)
    rs = results["report_scale"]
    (args.out / "is-it-a-bug.json").write_text(json.dumps(
        {"answer": text, "classes": classes(rs), "accounted": accounted(rs, results["seeds"])}, indent=1))
    print(text)
    return text


if __name__ == "__main__":
    main()
