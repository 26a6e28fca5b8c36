"""The study application: the three training configurations of the report ([`vae_ddp.studies.configs`][vae_ddp.studies.configs]),
how one run is launched and trained ([`vae_ddp.studies.launch`][vae_ddp.studies.launch], [`vae_ddp.studies.runner`][vae_ddp.studies.runner]), and the studies built
on them (``compare``, ``equivalence``, ``ablation``, ``seeds``), with their tables, figures
and statistics. The ``vae-ddp`` command ([`vae_ddp.cli`][vae_ddp.cli]) is a thin layer over it."""
