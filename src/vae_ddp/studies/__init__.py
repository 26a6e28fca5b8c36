"""The studies, one module each (run, then render: JSON, Markdown tables, figures): ``compare``,
``equivalence``, ``ablation``, ``seeds``, ``long_horizon``, ``report_scale`` and the site's
``verdict``. They are built on the harness ([`vae_ddp.harness`][vae_ddp.harness]: run specs,
launching, training, tables, statistics, plots), which imports no study. The ``vae-ddp``
command ([`vae_ddp.cli`][vae_ddp.cli]) is a thin layer over them."""
