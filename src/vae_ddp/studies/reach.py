"""How far the answer reaches beyond one step from the initial weights, from the studies that trained at the
report's scale: the step from trained weights (``docs/results/step-equality/summary.json``,
``examples/report_step_equality.py``) and the training study (``docs/results/report-training/summary.json``,
``examples/report_training.py``). ``training_gap`` is the rule that words the training study's KL gap
(unit-tested in ``tests/test_answer_rules.py``); ``trained_words`` and ``trained_reply`` are what Home's
first screen and the reply for #6789 say of both (``vae_ddp.studies.answer``)."""

from __future__ import annotations

__all__ = ["trained_reply", "trained_words", "training_gap"]


def training_gap(rt: dict | None, curve: str = "ddp, logged") -> dict:
    """The rule for the training study's KL gap (``report-training/summary.json``'s ``gaps[curve]``):
    ``{"kind": "gap" | "none seen" | "not decided", "words"}``. A gap is "gap" where the mean gap over the
    seeds lies outside its 95% interval's half-width; "none seen" where it lies within (the words give the
    smallest gap the study could have seen, as a share of one device's KL); "not decided" without the study
    or with one seed (no interval)."""
    g = (rt or {}).get("gaps", {}).get(curve)
    if not g or g.get("half_width") is None:
        return {"kind": "not decided", "words": "not decided (no interval: the study needs 2 seeds)"}
    if abs(g["mean"]) > g["half_width"]:
        return {"kind": "gap", "words": f"a KL gap: DDP's {g['relative']:+.0%} of one device's KL"}
    return {"kind": "none seen", "words": f"no KL gap beyond {g['smallest_relative']:.0%} of one device's KL"}


def trained_words(results: dict[str, dict | None]) -> tuple[str, str]:
    """The first screen's words for the verdict's reach beyond the initial weights: what follows "DDP's step is
    one device's up to rounding" (``", also from weights trained 50 steps ([equality](...))"``; the step from
    trained weights, ``step-equality``), and the sentence after the verdict (the training study's KL gap,
    ``report-training``, and what is not decided); "not decided" where either study is absent."""
    se, rt = results.get("step_equality"), results.get("report_training")
    trained = (se or {}).get("parts", {}).get("trained")
    link = "is-it-a-bug.md#trained-at-the-reports-scale"
    also = ""
    if trained:
        ok = trained["world_sizes"]["2"]["within_floor"]
        also = (f", {'also' if ok else 'but not'} from weights trained {trained['trained_steps']} steps "
                f"([equality]({link}))")
    said = ""
    if rt:
        said = f"{len(rt['seeds'])} seeds x {rt.get('steps') or '?'} steps: [{training_gap(rt)['words']}]({link}). "
    rest = ("longer trainings, GPUs, Lightning 1.2.6 ([read, not run](legacy.md))" if trained and rt else
            "trained weights, whole trainings at this size, GPUs, Lightning 1.2.6 ([read, not run](legacy.md))")
    return also, f"{said}Not decided here: {rest}."


def trained_reply(results: dict[str, dict | None]) -> tuple[str, str]:
    """The reply's words for what ``trained_words`` says on the first screen, without links: what the scope
    gains (``" and weights trained 50 steps"`` where the step from trained weights is one device's) and
    the sentence after the verdict."""
    se, rt = results.get("step_equality"), results.get("report_training")
    trained = (se or {}).get("parts", {}).get("trained")
    if not (trained and rt):
        return "", "Not decided: trained weights, full runs on GPUs."
    ok = trained["world_sizes"]["2"]["within_floor"]
    scope = f" and weights trained {trained['trained_steps']} steps" if ok else ""
    said = "" if ok else f"From weights trained {trained['trained_steps']} steps the step differs. "
    return scope, (f"{said}{rt['steps']}-step trainings: {training_gap(rt)['words']}. Not decided: full runs on "
                   "GPUs.")
