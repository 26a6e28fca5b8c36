"""The harness the studies and the audit share, below them (it imports no study).

- [`vae_ddp.harness.configs`][vae_ddp.harness.configs]: the three training configurations
  of the report and [`RunSpec`][vae_ddp.harness.configs.RunSpec], one run's typed settings.
- [`vae_ddp.harness.launch`][vae_ddp.harness.launch] and [`vae_ddp.harness.runner`][vae_ddp.harness.runner]:
  how one run is launched (its own process tree) and trained through Lightning's ``Trainer``.
- [`vae_ddp.harness.permutation`][vae_ddp.harness.permutation]: the one-device reordering floor.
- [`vae_ddp.harness.table`][vae_ddp.harness.table], ``vae_ddp.harness.stats`` and
  ``vae_ddp.harness.plots``: tables, statistics and figures.
"""
