"""The main job: the three configurations of the report, trained side by side.

``vae-ddp compare`` trains ``single``, ``ddp`` and ``dp`` for K optimizer steps on the
same data, model, seed and global batch size, and writes ``results.json`` (one record per
configuration and step), ``curves.png`` and a summary table.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from vae_ddp.studies.configs import RunSpec
from vae_ddp.studies.launch import launch
from vae_ddp.studies.plots import plot_curves
from vae_ddp.studies.table import format_table, write_tables

__all__ = ["compare"]


def compare(base: RunSpec, configs: list[str], out_dir: Path, exact: bool = False) -> dict:
    """Train each configuration of ``configs`` from ``base`` (one seed: ``base.seeds[0]``).

    Every spec is validated before the first run starts. With ``exact`` every fix is on
    (for ``single`` and ``ddp``; ``dp`` stays Lightning 1.x DP).

    Returns the content written to ``out_dir/results.json``: ``settings``, ``records``
    (dicts with ``config``, ``label``, ``step`` and the global-batch ``recon_loss``,
    ``kl``, ``loss``, plus ``logged_*`` from rank 0 and ``val_*`` where validated).
    """
    out_dir = Path(out_dir)
    specs = []
    for c in configs:
        spec = dataclasses.replace(base, config=c, seeds=base.seeds[:1], label="")
        # the fixes are for ddp and single; the dp emulation keeps Lightning 1.x DP's behaviour
        specs.append((spec.exact() if exact and c != "dp" else spec).validate())
    notes = []  # shown above the table on the page too
    for spec in specs:
        if spec.config == "dp":
            how = "real torch.nn.DataParallel" if spec.dp_mode == "real" else "single-process emulation of Lightning 1.x DP"
            notes.append(f"dp: {how} over {spec.devices} replicas")
            print(notes[-1], flush=True)
    records, series, rows = [], [], []
    for spec in specs:
        print(f"== {spec.label}: {spec.world_size} process(es), per-device batch {spec.per_device_batch_size}, "
              f"global batch {spec.global_batch_size}", flush=True)
        run = launch(spec, out_dir / "runs" / spec.label)["runs"][0]
        val_by_step = {v["step"]: v for v in run["val_records"]}
        for r in run["records"]:
            rec = {"config": spec.config, "label": spec.label, **r}
            if r["step"] in val_by_step:
                rec.update({f"val_{k}": v for k, v in val_by_step[r["step"]].items() if k != "step"})
            records.append(rec)
        series.append((spec.label, run["records"], run["val_records"]))
        last, lastval = run["records"][-1], (run["val_records"] or [{}])[-1]
        rows.append([spec.label, spec.world_size, spec.per_device_batch_size, last["loss"], last["kl"],
                     last["recon_loss"], lastval.get("kl"), lastval.get("recon_loss")])
    settings = dataclasses.asdict(base)  # devices: ddp's world size and dp's replicas
    settings.pop("config"), settings.pop("label")
    result = {"settings": settings, "configs": [s.label for s in specs], "records": records}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(result, indent=1))
    plot_curves(series, out_dir / "curves.png",
                f"{base.model} VAE on {base.data}, global batch {base.global_batch_size}, {base.steps} steps")
    table = format_table(["config", "processes", "per-device batch", "train loss", "train kl", "train recon",
                          "val kl", "val recon"], rows, title=f"after {base.steps} steps")
    markdown = "\n\n".join(notes + [table])
    print(markdown)
    write_tables(out_dir, markdown)
    print(f"wrote {out_dir / 'results.json'}, {out_dir / 'curves.png'} and {out_dir / 'tables.md'}")
    return result
