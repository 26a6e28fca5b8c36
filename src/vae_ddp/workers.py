"""DataLoader workers that cannot hang at start: a start method other than ``fork``.

On Linux a ``DataLoader`` with ``num_workers > 0`` starts its workers with ``fork`` by
default. A DDP rank already runs threads when it does (gloo's, the launcher's observer of
the other ranks, torch's thread pools); ``fork`` copies the process but only the calling
thread, and a lock another thread held at that moment stays held in the child for ever.
It happens at random: an audit with ``num_workers=1`` on 2 gloo ranks hung now and then,
the new worker blocked in ``PyOS_AfterFork_Child`` (seen with gdb). PyTorch's multiprocessing notes warn
about this ("poison fork"), and Python 3.14 made ``forkserver`` the default start method
on Linux for the same reason.

``forkserver`` forks each worker from a small server process that has one thread, started
once per rank, so no lock can be inherited; ``spawn`` would start a fresh interpreter for
every worker (each importing torch again). The price is that everything a worker receives is
pickled: the dataset, ``collate_fn`` and ``worker_init_fn`` must be picklable (classes and
functions defined at module level, not lambdas), and the modules they live in are
imported in the server first (``preload``), once per rank.

Workers are seeded as before: PyTorch gives worker ``i`` the seed ``base_seed + i`` whatever
the start method, so random augmentation in ``__getitem__`` repeats across ranks exactly
as with ``fork`` (see the noise factor) and the fixes that key draws to samples still apply.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any, Optional

__all__ = ["worker_context", "loader_kwargs", "dataset_modules", "make_fork_safe", "fork_hazard", "thread_count",
           "START_METHOD"]

#: The start method this project uses for DataLoader workers.
START_METHOD = "forkserver"


#: Imported once in the forkserver of each process, before the modules a loader names.
PRELOAD = ("torch", "torch.utils.data._utils.worker", "pytorch_lightning")


def worker_context(*modules: str) -> multiprocessing.context.BaseContext:
    """The ``forkserver`` multiprocessing context for ``DataLoader(multiprocessing_context=...)``,
    with torch, Lightning and ``modules`` (the dataset's, ``collate_fn``'s) imported once in
    the server, so that a worker does not import them again when it starts.

    Why the preload matters: a worker of a plain ``multiprocessing_context="forkserver"``
    imports torch (and re-imports the script's ``__main__`` with all it imports) every time
    it starts, each epoch unless ``persistent_workers=True``: seconds per epoch even for a
    bare ``TensorDataset``, where the preload makes it a fraction of a second. (Python 3.11's forkserver does
    not preload ``__main__`` itself: its preparation data names the script
    ``init_main_from_path``, the server looks for ``main_path``.) The preload takes effect
    when this process starts its server, at its first loader with workers.
    """
    ctx = multiprocessing.get_context(START_METHOD)
    wanted = [*PRELOAD, *modules]
    preload = ["__main__", *dict.fromkeys(m for m in wanted if m and m not in ("__main__", "__mp_main__", "builtins"))]
    ctx.set_forkserver_preload(preload)
    return ctx


def loader_kwargs(num_workers: int, dataset: Any = None) -> dict:
    """``DataLoader`` keyword arguments for ``num_workers`` fork-safe workers:
    ``{"num_workers": n}`` plus, when ``n > 0``, ``multiprocessing_context`` (``forkserver``,
    preloading the module of ``dataset``'s class)."""
    if num_workers <= 0:
        return {"num_workers": 0}
    return {"num_workers": num_workers, "multiprocessing_context": worker_context(*dataset_modules(dataset))}


def dataset_modules(dataset: Any) -> list[str]:
    """The modules of ``dataset``'s class and of the datasets it wraps (``Subset.dataset``,
    ``ConcatDataset.datasets``), innermost first: what a worker imports to unpickle it."""
    found: list[str] = []
    todo = [dataset] if dataset is not None else []
    while todo:
        ds = todo.pop()
        found.insert(0, type(ds).__module__)
        inner = getattr(ds, "dataset", None)
        todo += ([inner] if inner is not None else []) + list(getattr(ds, "datasets", None) or [])
    return list(dict.fromkeys(found))


def thread_count() -> int:
    """Threads of this process (all of them, not only Python's: ``/proc/self/task`` on Linux;
    Python's own count elsewhere)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def make_fork_safe(loader: Any, preload: tuple[str, ...] = ()) -> Optional[str]:
    """Give ``loader`` (a ``torch.utils.data.DataLoader``) the ``forkserver`` start method when it
    has workers and no start method of its own, before its first iteration. A start method the
    user chose is kept. ``preload``: modules to import in the server before the dataset's.

    Returns:
        a one-line note for the user when the loader would have forked its workers from a
        process that runs several threads (the hazard), else None.
    """
    if getattr(loader, "num_workers", 0) <= 0 or getattr(loader, "multiprocessing_context", None) is not None:
        return None
    # the default start method (the first of get_all_start_methods): fork on Linux before Python 3.14
    if (multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]) != "fork":
        return None
    threads = thread_count()
    collate = getattr(getattr(loader, "collate_fn", None), "__module__", None)
    loader.multiprocessing_context = worker_context(*preload, *dataset_modules(getattr(loader, "dataset", None)),
                                                    *([collate] if collate else []))
    if threads <= 1:
        return None
    return (f"the DataLoader forks its {loader.num_workers} worker(s) from a process that runs {threads} threads, "
            "which can hang a worker at start (a lock held by another thread at the fork); the audit used "
            "'forkserver': pass DataLoader(..., multiprocessing_context='forkserver')")


def fork_hazard(loader: Any) -> Optional[str]:
    """Why ``loader`` (a ``torch.utils.data.DataLoader``) can hang this process's training, in one line, or None:
    it starts workers with ``fork`` (its own start method, or the default one: ``fork`` on Linux before Python
    3.14) from a process that runs several threads (a DDP rank: gloo's). Such a worker can block before it loads
    a sample (``PyOS_AfterFork_Child``: a lock another thread held at the fork), its rank then waits for its batch
    for ever, and the other ranks in the step's first collective. Changes nothing."""
    if getattr(loader, "num_workers", 0) <= 0:
        return None
    own = getattr(loader, "multiprocessing_context", None)
    method = own.get_start_method() if own is not None else (
        multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0])
    threads = thread_count()
    if method != "fork" or threads <= 1:
        return None
    return (f"DataLoader(num_workers={loader.num_workers}) forks its workers from a rank that runs {threads} threads: "
            "a worker can block at start (PyOS_AfterFork_Child, a lock another thread held at the fork) and the "
            "training hang, its rank waiting for the worker's batch and the other ranks in the step's first "
            "all_reduce (GlobalBatchNorm's); start the workers from a forkserver: "
            'DataLoader(..., multiprocessing_context="forkserver") (the "BatchNorm statistics" page of the vae-ddp '
            'documentation)')
