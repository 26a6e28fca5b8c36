"""The user's module and datamodule in the audit's processes: an instance as Lightning's own launchers send it.

Lightning's spawn launcher sends the trainer and the module to its processes by pickling them
(``_MultiProcessingLauncher``, Lightning 2.x): the instance arrives with its weights and attributes. The Python
API does the same with an instance it is given ([`saved`][vae_ddp.audit.user_objects.saved]: pickled into the
call's own ``TMPDIR``); every run, one device's and every rank's alike, then starts from a copy of it
([`build`][vae_ddp.audit.user_objects.build]), a datamodule's ``batch_size`` set to the run's per-device batch.
A class is built from its init arguments as the command line builds it. The pickle names the user's class by the
module it was defined in; a run imports that class by the path the audit gives it (a file the runs import as
a module of another name, ``vae_ddp.audit.spec.resolve_class_arg``), and reads it from there.
"""

from __future__ import annotations

import pickle
import sys
import tempfile
from typing import Any, Optional

from vae_ddp.audit.spec import import_class

__all__ = ["saved", "build", "unpicklable", "STAND_INS"]

#: What the audit's parser checks in place of an instance (``"model"``, ``"data"``): classes that take nothing
#: the instance must show (``vae_ddp.audit.stand_ins``); the runs build the instance, never these.
STAND_INS = {"model": "vae_ddp.audit.stand_ins.GivenModule", "data": "vae_ddp.audit.stand_ins.GivenDataModule"}


def unpicklable(obj: Any) -> Optional[str]:
    """None when ``obj`` pickles, else what does not: ``"attribute 'NAME' (TYPE: ERROR)"`` for the first
    attribute of ``obj`` (its ``__dict__``, its submodules) that does not pickle, or the error itself."""
    try:
        pickle.dumps(obj)
        return None
    except Exception as err:  # noqa: BLE001 - pickle raises what the object's reducers raise
        whole = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    parts = {**getattr(obj, "_modules", {}), **{k: v for k, v in vars(obj).items() if k != "_modules"}}
    for name, value in parts.items():
        try:
            pickle.dumps(value)
        except Exception as err:  # noqa: BLE001 - as above
            return f"attribute {name!r} ({type(value).__name__}: {type(err).__name__})"
    return whole


def saved(obj: Any) -> dict:
    """Pickle ``obj`` (the user's module or datamodule instance) into a new file of this process's ``TMPDIR``;
    returns what [`build`][vae_ddp.audit.user_objects.build] reads: ``{"file", "module"}`` (the module its class
    was defined in).

    Raises:
        pickle.PicklingError, TypeError, AttributeError: it does not pickle (see ``unpicklable``)."""
    data = pickle.dumps(obj)
    with tempfile.NamedTemporaryFile(prefix="vae-ddp-instance-", suffix=".pkl", delete=False) as f:
        f.write(data)
    return {"file": f.name, "module": type(obj).__module__}


class _Unpickler(pickle.Unpickler):
    """Reads the user's classes from the module the run imported them as, not from the one they were defined
    in (``__main__``, a test file pytest imported by another name)."""

    def __init__(self, file: Any, module: str, cls: type) -> None:
        super().__init__(file)
        self._module, self._cls = module, cls

    def find_class(self, module: str, name: str) -> Any:
        if module == self._module and module != self._cls.__module__:
            return getattr(sys.modules[self._cls.__module__], name)
        return super().find_class(module, name)


def build(run: Any, key: str, batch_size: Optional[int] = None, cls: Optional[type] = None) -> Any:
    """The user's module (``key`` ``"model"``) or datamodule (``"data"``) for ``run`` (an
    [`AuditRun`][vae_ddp.audit.spec.AuditRun]): a copy of the instance the caller gave (``run.instances[key]``,
    with its weights and attributes; a datamodule's ``batch_size`` attribute, and its ``hparams`` entry, set to
    ``batch_size``), else its class built from its init arguments (``batch_size`` among them when given); ``cls``:
    that class, imported already (the pre-flight's), else imported from the run's class path.

    Raises:
        Exception: what the user's ``__init__`` raises (a class), or unpickling raises (an instance)."""
    cfg, file = (run.model, run.model_file) if key == "model" else (run.data, run.data_file)
    cls = cls or import_class(cfg["class_path"], file)
    instance = run.instances.get(key)
    if instance is None:
        return cls(**dict(cfg.get("init_args", {}), **({} if batch_size is None else {"batch_size": batch_size})))
    with open(instance["file"], "rb") as f:
        obj = _Unpickler(f, instance["module"], cls).load()
    if batch_size is not None:
        obj.batch_size = batch_size
        hparams = getattr(obj, "hparams", None)
        if hparams is not None and "batch_size" in hparams:
            hparams["batch_size"] = batch_size
    return obj
