"""The studies, one module each (``report_scale`` a package; run, then render: JSON, Markdown
tables, figures): ``compare``, ``equivalence``, ``ablation``, ``seeds``, ``long_horizon``,
``report_scale`` and the site's ``verdict`` and ``answer``. They are built on the harness
([`vae_ddp.harness`][vae_ddp.harness]: run specs, launching, training, tables, statistics, plots),
which imports no study. The ``vae-ddp`` command ([`vae_ddp.cli`][vae_ddp.cli]) is a thin layer over them."""

_GRID = {"steps": 100, "global_batch_size": 64}
#: The ``vae-ddp`` subcommands (``vae_ddp.cli``): (module:function of this package, one line of
#: help, defaults of its flags, the RunSpec fields it takes no flag for: "switches" = the fix
#: switches of the factor registry and --exact; "seed" = no --seed).
COMMANDS = {
    "compare": ("compare:compare", "train single, ddp and dp side by side (the main job)",
                {"steps": 60, "global_batch_size": 256, "val_every": 10, "configs": ["single", "ddp", "dp"]}, ()),
    "equivalence": ("equivalence:equivalence", "all fixes on: does ddp match single to the last digits?",
                    {**_GRID, "world_sizes": [2, 4]}, ("devices", "dp_mode", "switches")),
    "ablation": ("ablation:ablation", "from the exact configuration, undo one fix at a time", _GRID,
                 ("dp_mode", "switches")),
    "seeds": ("seeds:seed_study", "the statistical study: many seeds of single, ddp, fixed ddp and dp",
              {**_GRID, "num_seeds": 10, "configs": ["single", "ddp", "ddp+fixed", "dp"]}, ("seed",)),
    "long-horizon": ("long_horizon:long_horizon", "thousands of steps: does noise shared across ranks shift the KL?",
                     {}, ()),
    "report-scale": ("report_scale:report_scale", "the report's scale (ResNet-18, 2 x 128): each factor's one-step "
                     "gradient difference over batch-to-batch noise, and the logged KL", {}, ()),
}
#: RunSpec fields the studies set themselves
INTERNAL = {"config", "seeds", "label", "save_params", "record_indices", "permute_seed", "steps_file", "teacher_forced"}


def study_function(name: str):
    """The function of the subcommand ``name`` of ``COMMANDS`` (its module is imported now:
    ``vae-ddp audit -h`` and ``vae-ddp -h`` import no study)."""
    import importlib

    module, function = COMMANDS[name][0].split(":")
    return getattr(importlib.import_module(f"vae_ddp.studies.{module}"), function)


def run_study(name: str, options: dict) -> None:
    """Run the study ``name`` with the parsed options of its subcommand (``vae_ddp.cli``): the
    RunSpec fields become its ``base`` (``--exact`` turns every fix on), checked with its data
    folder and the output folder before any work (``UserError``, ``ValueError``, ``OSError``)."""
    import dataclasses
    import inspect
    import sys

    from vae_ddp.data import check_data
    from vae_ddp.harness.configs import RunSpec
    from vae_ddp.utils import check_writable, out_folder_lock

    function = study_function(name)
    params = inspect.signature(function).parameters
    kwargs = {k: v for k, v in options.items() if k in params}
    if "base" in params:
        spec = {f.name: options[f.name] for f in dataclasses.fields(RunSpec)
                if f.name in options and f.name not in INTERNAL}
        base = RunSpec(**spec, seeds=[options.get("seed", 0)])
        kwargs["base"] = base = base.exact() if options.get("exact") and "exact" not in params else base
        base.validate()
        check_data(base.data, base.data_dir)
    out = check_writable(options["out"])
    with out_folder_lock(out, f"vae-ddp {name} " + " ".join(sys.argv[2:])):
        function(**kwargs, out_dir=out)
