"""The global-batch stream of the running training step: one slot, ``stream``.

``GlobalBatchStream.start`` (``vae_ddp.fixes.randomness``) puts the stream here and ``stop``
empties it; ``current_stream``, ``global_batch_draw`` and ``GlobalBatchDropout``
(``vae_ddp.fixes.dropout``) read it. It is a module of its own so that the imports go one
way: ``randomness`` imports ``dropout`` (its callback swaps dropout layers), ``dropout``
imports only this slot.
"""

from __future__ import annotations

from typing import Any

#: the ``GlobalBatchStream`` of the running training step, or None outside one
stream: Any = None
