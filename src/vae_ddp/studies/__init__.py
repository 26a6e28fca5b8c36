"""The studies, one module each (run, then render: JSON, Markdown tables, figures): ``compare``,
``equivalence``, ``ablation``, ``seeds``, ``long_horizon``, ``report_scale`` and the site's
``verdict``. They are built on the harness ([`vae_ddp.harness`][vae_ddp.harness]: run specs,
launching, training, tables, statistics, plots), which imports no study. The ``vae-ddp``
command ([`vae_ddp.cli`][vae_ddp.cli]) is a thin layer over them."""

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
