"""The report-scale study's variants and how a result reads them: ``VARIANTS`` (each factor
alone, every other fix on), the quantities each effect is measured on, and the factors of a
``report_scale.json`` ranked (``ranking``) and keyed by the registry's factor keys
(``factor_effects``), as the site shows them."""

from __future__ import annotations

from vae_ddp.harness.permutation import FLOOR_FACTOR

#: name -> (configuration, fields changed from the exact spec, factor it isolates).
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "ddp, Lightning defaults": ("ddp", {"noise": "default", "sync_bn": False, "sampler": "default",
                                        "sync_dist_logging": False}, "all factors together"),
    "ddp, noise back to default": ("ddp", {"noise": "default"}, "Random streams per rank"),
    "ddp, BatchNorm back to per-rank": ("ddp", {"sync_bn": False}, "BatchNorm statistics"),
    "ddp, sampler back to DistributedSampler": ("ddp", {"sampler": "default"}, "Sampler and data order"),
    "dp (emulation of Lightning 1.x DP)": ("dp", {"noise": "default", "sync_bn": False, "sampler": "global",
                                                  "sync_dist_logging": False}, "DP's chunks"),
    "ddp, every fix": ("ddp", {}, "none (rounding floor)"),
}
DEFAULT_VARIANT = "ddp, Lightning defaults"
#: factor key of ``vae_ddp.fixes.registry`` -> the variant that isolates it (every fix on but that one);
#: the factor names in ``VARIANTS`` are the registry's (tests/test_names.py checks)
FACTOR_VARIANTS = {"noise": "ddp, noise back to default", "batchnorm": "ddp, BatchNorm back to per-rank",
                   "sampler": "ddp, sampler back to DistributedSampler"}

#: The quantities each variant's effect is measured on: the gradient Adam receives, and the
#: global batch's loss terms (what the report's curves show, over the whole batch).
QUANTITIES = ("gradient", "kl", "reconstruction")
#: How the tables name the quantities.
LABELS = {"gradient": "gradient", "kl": "KL", "reconstruction": "reconstruction"}
#: A row is the same step as one device's within this many times the floor (the largest relative
#: difference of ``ddp, every fix``): the audit's and the equivalence study's rule.
FLOOR_RATIO = FLOOR_FACTOR


#: What the ranking orders by, in words (the box, the tables and "Is it a bug?" state it).
RANKED_BY = ("how far one step's gradient moves from one device's, as a multiple of how far another global batch "
             "moves it (1: as different as another batch), each default alone with every other change on; the "
             "defaults that change what DDP trains before those that change only its luck")


def ranking(result: dict) -> list[dict]:
    """The training factors, largest first by one quantity (:data:`RANKED_BY`): the defaults whose
    effect is ``different`` (they change what DDP trains) before the others, in
    [`KINDS`][vae_ddp.harness.effect.KINDS]' order, and within a kind the larger
    ``ratio_to_batch_noise`` of the whole gradient (``ratio``). Logging changes what is plotted, not
    what is trained: it is not ranked with these. Empty where the study measured no effects
    (``--effect_batches 0``)."""
    from vae_ddp.harness import effect as stats

    rows = [{"factor": VARIANTS[name][2] if name in VARIANTS else v["factor"], "variant": name,
             "kind": v["effect"]["kind"], "ratio": v["ratio_to_batch_noise"]["all"],
             "bias": v["effect"]["gradient"]["bias"], "variance_ratio": v["effect"]["gradient"]["variance_ratio"]}
            for name, v in result["variants"].items()
            if v.get("effect") and name not in (DEFAULT_VARIANT, "ddp, every fix")]
    return sorted(rows, key=lambda r: (stats.KINDS.index(r["kind"]), -r["ratio"]))


def factor_effects(result: dict) -> dict[str, dict]:
    """``{factor key: effect}``: each training factor's effect at the report's scale (the variant
    that isolates it, every other fix on; ``{"kind", "gradient", "kl", "reconstruction"}``, each part
    a [`decompose`][vae_ddp.harness.effect.decompose] result), from a ``report_scale.json`` content;
    what the factor table and the factor pages show."""
    out = {key: result["variants"][name]["effect"] for key, name in FACTOR_VARIANTS.items()
           if name in result["variants"] and result["variants"][name].get("effect")}
    plotted = (result.get("logging") or {}).get("effect")
    if plotted:  # logging changes no gradient: what it does to the plotted value
        out["logging"] = dict(plotted, kind=min((plotted[q]["kind"] for q in ("kl", "reconstruction")),
                                                key=_kinds().index))
    return out


def _kinds() -> tuple[str, ...]:
    from vae_ddp.harness import effect as stats

    return stats.KINDS
