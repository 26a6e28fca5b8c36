"""``vae-ddp audit``: train the user's module on one device and with DDP, attribute the difference.

From the same seed (same initial weights), the same global batch and the same number of
optimizer steps, through Lightning's own ``Trainer`` and launcher (every run in its own
process tree per world size, see [`vae_ddp.audit.run`][vae_ddp.audit.run]):

1. ``single``: one device, every fix that applies on one device on (the single-device
   global batches of the sampler fix, the global-batch noise) — the reference;
2. ``floor``: the same with the samples inside each batch permuted (the same loss, another
   summation order): ``max |theta_floor - theta_single|`` is what rounding alone does;
3. ``ddp``: N ranks with Lightning's defaults; its [`DDPAudit`][vae_ddp.audit.callback.DDPAudit]
   findings tell which factors the run is exposed to;
4. ``ddp+fixed``: N ranks with every fix on; ``ddp-<factor>``: every fix but one (the
   ablation, run in the same launch for every factor with an automatic fix, reported for the
   exposed ones): the divergence that comes back when that fix is removed is the factor's
   contribution.

The residual of ``ddp+fixed`` is judged as a multiple of the floor: within 2x the audit
passes (exit 0); well above, the difference is "unexplained: not one of the known factors"
(exit 1) and the parameters that differ most are named.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from vae_ddp.audit.spec import FIXABLE, AuditRun
from vae_ddp.fixes import registry
from vae_ddp.studies.launch import RunGroup, launch
from vae_ddp.studies.table import format_table

__all__ = ["audit", "FLOOR_RATIO"]

#: The fixed run passes when its divergence is at most this multiple of the floor.
FLOOR_RATIO = 2.0

#: The audit's own check beside the registered factors: parameters that differ across ranks.
EXTRA_PAGES = {"parameters": "recipe.md"}


def _factors() -> tuple[str, ...]:
    """The factor keys of [`vae_ddp.fixes.registry`][vae_ddp.fixes.registry] in their order, then the audit's own."""
    return tuple(f.key for f in registry.factors()) + tuple(EXTRA_PAGES)


def _page(key: str) -> str:
    return EXTRA_PAGES[key] if key in EXTRA_PAGES else registry.get(key).page


def _diff(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _largest(a: dict, b: dict, n: int = 3) -> list[dict]:
    d = sorted(((float((a[k].double() - b[k].double()).abs().max()), k) for k in a), reverse=True)[:n]
    return [{"parameter": k, "max_abs_diff": v} for v, k in d]


def audit(base: AuditRun, out_dir: Path, static: Optional[list[dict]] = None, progress: bool = True) -> dict:
    """Run the audit of ``base`` (``devices`` = the DDP world size N) and write
    ``out_dir/audit.json`` and ``out_dir/tables.md``.

    Returns:
        ``{"devices", "steps", "dtype", "floor", "divergence_default", "divergence_fixed",
        "ratio_to_floor", "findings": [{"factor", "exposed", "evidence", "contribution", "fix",
        "page"}], "unexplained": bool, "largest_differences": [...], "notes": [str]}`` (``notes``:
        what the runs noticed beside the factors, e.g. DataLoader workers forked from a
        multithreaded process, which the audit started with ``forkserver`` instead); ``contribution`` is the
        divergence with every fix but this factor's (None where there is no automatic fix or
        the factor changes no parameter, e.g. logging).
    """
    out_dir = Path(out_dir)
    n = base.devices
    fixes = list(FIXABLE)

    def launch_all(tag: str, specs: list[AuditRun]) -> dict[str, tuple[dict, dict]]:
        """Train ``specs`` (one world size) in one launch; {label: (params, info)}."""
        where = out_dir / "runs" / tag
        info = launch(RunGroup(specs), where, quiet=True, entry=[sys.executable, "-m", "vae_ddp.audit.run"])
        return {s.label: (torch.load(where / f"{s.label}.pt"), info[s.label]) for s in specs}

    one_device = [base.replace(label="single", devices=1, fixes=fixes),
                  base.replace(label="floor", devices=1, fixes=fixes, permute=True)]
    # The ablation (every fix but one) runs in the same launch for every fixable factor; only
    # the factors found exposed below are reported (a launch costs more than a few short runs).
    ddp = [base.replace(label="ddp", devices=n, fixes=[]), base.replace(label="ddp+fixed", devices=n, fixes=fixes),
           *(base.replace(label=f"ddp-{f}", devices=n, fixes=[g for g in fixes if g != f]) for f in fixes)]
    if progress:
        for spec in one_device + ddp:
            print(f"[audit] {spec.label}: {spec.devices} process(es), fixes: {', '.join(spec.fixes) or 'none'}"
                  f"{', samples permuted in each batch' if spec.permute else ''}", flush=True)
    # The two launches at the same time (most of a launch is its processes importing torch and
    # Lightning). A daemon thread: if this process ends first, its launch's guard gets SIGTERM
    # (PR_SET_PDEATHSIG, vae_ddp.guard) and ends that tree, as on any exit of this process.
    box: dict = {}

    def launch_one_device() -> None:
        try:
            box["one"] = launch_all("one-device", one_device)
        except BaseException as e:  # raised in the main thread below
            box["error"] = e

    thread = threading.Thread(target=launch_one_device, name="audit-one-device", daemon=True)
    thread.start()
    first = launch_all("ddp", ddp)
    thread.join()
    if "error" in box:
        raise box["error"]
    one = box["one"]
    single = one["single"][0]
    floor = _diff(one["floor"][0], single)
    default, info = first["ddp"]
    fixed = first["ddp+fixed"][0]
    found = {f["factor"]: f for f in info["findings"]}
    manual = {}  # exposed factors the audit cannot fix by itself (one-process checks)
    for f in static or []:
        manual[f["factor"]] = f
        if f["factor"] in found:
            f = dict(f, evidence=found[f["factor"]]["evidence"] + "; " + f["evidence"],
                     fix=found[f["factor"]]["fix"] + "; " + f["fix"])
        found[f["factor"]] = f
    ablated = [f for f in fixes if f in found]
    contributions: dict[str, Optional[float]] = {f: _diff(first[f"ddp-{f}"][0], single) for f in ablated}
    div_default, div_fixed = _diff(default, single), _diff(fixed, single)
    ratio = div_fixed / floor if floor > 0 else (0.0 if div_fixed == 0 else float("inf"))
    within = ratio <= FLOOR_RATIO
    unexplained = not within and not manual
    findings = []
    for factor in _factors():
        f = found.get(factor)
        contribution = contributions.get(factor)
        if factor == "reduction" and "sampler" in contributions and factor not in manual:
            contribution = contributions["sampler"] if f else None  # the sampler fix drops the padding too
        bites = None if contribution is None else contribution > FLOOR_RATIO * max(floor, div_fixed)
        findings.append({"factor": factor, "exposed": f is not None,
                         "evidence": f["evidence"] if f else _CLEAN.get(factor, "not detected"),
                         "contribution": contribution, "bites": bites,
                         "automatic_fix": f is not None and factor not in manual,
                         "fix": f["fix"] if f else "", "page": _page(factor)})
    findings.sort(key=lambda r: (not r["exposed"], -(r["contribution"] or 0.0)))
    result = {"devices": n, "steps": base.steps, "dtype": base.dtype, "floor": floor,
              "divergence_default": div_default, "divergence_fixed": div_fixed, "ratio_to_floor": ratio,
              "findings": findings, "within_floor": within, "unexplained": unexplained,
              "largest_differences": _largest(fixed, single) if unexplained else [],
              "model": base.model, "data": base.data, "global_batch_size": base.global_batch_size,
              "model_name": shown_name(base.model, base.model_file), "data_name": shown_name(base.data, base.data_file)}
    notes = [n for runs in (one, first) for _, i in runs.values() for n in i.get("notes", [])]
    result["notes"] = list(dict.fromkeys(notes))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "audit.json").write_text(json.dumps(result, indent=1))
    text = render(result)
    (out_dir / "tables.md").write_text(text + "\n")
    print(text)
    return result


def shown_name(cls: dict, file: Optional[str]) -> str:
    """The class as the user named it: ``path/to/file.py:Class`` (relative to the working
    directory) for a class given by file, else its dotted ``class_path``."""
    if not file:
        return cls["class_path"]
    try:
        where = os.path.relpath(file)
    except ValueError:  # another drive (Windows)
        where = file
    return f"{where}:{cls['class_path'].rpartition('.')[2]}"


_CLEAN = {
    "noise": "no training-step draws repeated across ranks",
    "batchnorm": "no per-rank BatchNorm layer",
    "sampler": "no shuffling DistributedSampler",
    "reduction": "no padded samples",
    "logging": "every logged metric synchronised (or none logged)",
    "optimizer": "follows the noise check",
    "parameters": "the same parameters on every rank",
}


def render(result: dict) -> str:
    """The Markdown the audit prints and writes: the ranked table and the verdict lines."""
    floor = result["floor"]

    def contribution(f: dict) -> str:
        c = f["contribution"]
        if c is None:
            return ""
        times = f" ({c / floor:.3g}x the floor)" if floor > 0 else ""
        return f"{c:.3g}{times}" + ("" if f["bites"] else ": does not bite")

    def name(key: str) -> str:  # the registry's name of a factor, one name everywhere
        return registry.get(key).name if key in {f.key for f in registry.factors()} else key

    rows = [[name(f["factor"]), "yes" if f["exposed"] else "no", contribution(f), f["fix"]] for f in result["findings"]]
    title = (f"Audit of {result.get('model_name') or result['model']['class_path']} on {result['devices']} devices vs one, "
             f"global batch {result['global_batch_size']}, {result['steps']} steps, {result['dtype']}")
    lines = [format_table(["factor", "exposed", "contribution", "fix"], rows, title=title), "",
             "contribution: the largest parameter difference to one device with every fix on but this "
             "factor's. Evidence, per factor:", ""]
    lines += [f"- {name(f['factor'])}: {f['evidence']} ([{f['page']}]({f['page']}))" for f in result["findings"]]
    lines.append("")
    lines.append(f"- one-device floor (samples permuted inside each batch): {result['floor']:.3g}")
    lines.append(f"- DDP with Lightning's defaults vs one device: {result['divergence_default']:.3g}")
    lines.append(f"- DDP with every fix vs one device: {result['divergence_fixed']:.3g} "
                 f"({result['ratio_to_floor']:.3g}x the floor)")
    if result["unexplained"]:
        names = ", ".join(f"{d['parameter']} ({d['max_abs_diff']:.3g})" for d in result["largest_differences"])
        lines.append(f"- unexplained: not one of the known factors (more than {FLOOR_RATIO:g}x the floor after "
                     f"every fix); largest differences: {names}")
    elif not result["within_floor"]:
        manual = [f["factor"] for f in result["findings"] if f["exposed"] and not f["automatic_fix"]]
        lines.append(f"- not within {FLOOR_RATIO:g}x the floor after the automatic fixes: explained by "
                     f"{', '.join(manual)}, which needs a change in your code (see the fix column)")
    else:
        bite = [f["factor"] for f in result["findings"] if f["bites"]]
        lines.append(f"- explained: with the fixes, DDP matches one device within {FLOOR_RATIO:g}x the floor"
                     + (f"; the factors that make a difference: {', '.join(bite)}" if bite
                        else "; no factor makes a difference here"))
    lines += [f"- note: {n}" for n in result.get("notes", [])]
    return "\n".join(lines)
