"""The study application: the three training configurations of the report (:mod:`.configs`),
how one run is launched and trained (:mod:`.launch`, :mod:`.runner`), and the studies built
on them (``compare``, ``equivalence``, ``ablation``, ``seeds``), with their tables, figures
and statistics. The ``vae-ddp`` command (:mod:`vae_ddp.cli`) is a thin layer over it."""
