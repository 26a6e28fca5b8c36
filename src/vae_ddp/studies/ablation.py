"""The ablation: from the exact configuration, switch one factor back to Lightning's default.

``vae-ddp ablation`` trains the exact ``single`` reference and ``ddp`` with all fixes, then
``ddp`` with one fix removed at a time (each switch of the factor registry: noise,
BatchNorm, sampler, logging) and with none (Lightning's defaults), and reports for each the
parameter divergence from the reference and the differences of the KL and reconstruction terms
after K steps: on the whole validation set with fixed noise, and in the logged training curve (mean over the last
steps of what Lightning logged on rank 0).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

import torch

from vae_ddp.fixes import registry
from vae_ddp.harness.configs import RunSpec
from vae_ddp.studies.equivalence import max_abs_diff
from vae_ddp.harness.launch import launch_by_world_size
from vae_ddp.harness.table import format_table, write_tables

__all__ = ["ablation", "variants"]


def variants() -> dict[str, dict]:
    """Each variant: a name and the RunSpec fields that undo fixes of the exact spec: none, one
    switch of the factor registry at a time (named by its ``ablation_label``), all of them."""
    out: dict[str, dict] = {"all fixes": {}}
    for f in registry.switches():
        out[f.ablation_label] = {f.field: f.default}
    out["Lightning defaults (no fix)"] = {f.field: f.default for f in registry.switches()}
    return out


def _tail_mean(records: list[dict], key: str) -> float:
    n = max(1, len(records) // 10)
    return statistics.fmean(r[key] for r in records[-n:])


def ablation(base: RunSpec, out_dir: Path) -> dict:
    """Run the ablation; write and return ``out_dir/ablation.json``."""
    out_dir = Path(out_dir)
    exact = dataclasses.replace(base, save_params=True, val_every=base.steps, seeds=base.seeds[:1]).exact()
    ref_spec = dataclasses.replace(exact, config="single", label="single").validate()
    specs = {name: dataclasses.replace(exact, config="ddp", label=name, **kw).validate()
             for name, kw in variants().items()}
    # one launch: single, then every ddp variant in the same (forked) processes
    results = launch_by_world_size([ref_spec, *specs.values()], out_dir / "runs")
    (ref_result, ref_dir), variant_results = results[0], results[1:]
    ref_run = ref_result["runs"][0]
    ref = torch.load(ref_dir / ref_run["params"])["state_dict"]
    rv, rr = ref_run["val_records"][-1], ref_run["records"]
    result = {"settings": dataclasses.asdict(ref_spec), "variants": {}}
    rows = []
    for (name, spec), (res, where) in zip(specs.items(), variant_results):
        run = res["runs"][0]
        params = torch.load(where / run["params"])["state_dict"]
        v, recs = run["val_records"][-1], run["records"]
        entry = {
            "fixes": spec.fixes(),
            "max_abs_param_diff": max_abs_diff(params, ref),
            "val_kl_diff": v["kl"] - rv["kl"], "val_recon_diff": v["recon_loss"] - rv["recon_loss"],
            "logged_kl_diff": _tail_mean(recs, "logged_kl") - _tail_mean(rr, "logged_kl"),
            "logged_recon_diff": _tail_mean(recs, "logged_recon_loss") - _tail_mean(rr, "logged_recon_loss"),
        }
        result["variants"][name] = entry
        rows.append([name, entry["max_abs_param_diff"], entry["val_kl_diff"], entry["val_recon_diff"],
                     entry["logged_kl_diff"], entry["logged_recon_diff"]])
    table = format_table(["ddp variant", "max abs param diff vs single", "val KL diff", "val recon diff",
                          "logged KL diff", "logged recon diff"], rows,
                         title=f"{base.model} VAE, {base.data}, {base.devices} ranks, global batch "
                               f"{base.global_batch_size}, {base.steps} steps, {base.dtype}; differences to single")
    from vae_ddp.outputs import result_set

    with result_set(out_dir) as new:
        (new / "ablation.json").write_text(json.dumps(result, indent=1))
        write_tables(new, table)
    print(table)
    return result
