"""Old module paths of spotnb, kept importing after the package was laid out by side.

``import spotnb.runtime``, ``from spotnb.tb import tensorboard``, ``from spotnb.jobs
import JobHandle``, a pickle or a ``renderer_class`` naming ``spotnb.display.
TextRenderer``: each old path (and everything under an old package path) is the module
at its new path, the same object, so state and ``isinstance`` are shared. A finder on
``sys.meta_path`` (installed by ``spotnb/__init__``) answers only for these names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence

#: Old path under ``spotnb.`` -> new path under ``spotnb.``; a package's submodules
#: follow it (``spotnb.events.fold`` -> ``spotnb.protocol.events.fold``). Kept in step
#: with the tree by hand: a path here must not exist as a module of its own.
MOVED: dict[str, str] = {
    "jobs": "client.jobs",
    "validation": "client.validation",
    "capture": "client.capture",
    "freevars": "client.freevars",
    "magics": "client.magics",
    "display": "client.display",
    "progress": "client.progress",
    "notebook": "client.notebook",
    "cli": "client.cli",
    "listing": "client.listing",
    "comparison": "client.comparison",
    "spec": "protocol.spec",
    "providers.local.signals": "protocol.signals",
    "errors": "protocol.errors",
    "store": "protocol.store",
    "layout": "protocol.layout",
    "lease": "protocol.lease",
    "usage": "protocol.usage",
    "backoff": "protocol.backoff",
    "events": "protocol.events",
    "secretstore": "protocol.secretstore",
    "notify": "protocol.notify",
    "runtime": "train.runtime",
    "session": "train.session",
    "syncdir": "train.syncdir",
    "tb": "train.tb",
    "looptotal": "train.looptotal",
    "integrations": "train.integrations",
    "checkpoints": "ckpt.checkpoints",
    "checksum": "ckpt.checksum",
    "snapshot": "ckpt.snapshot",
    "catalog": "providers.catalog",
    "kernel_remote.imds": "providers.imds",
    "multinode": "kernel_remote.multinode",
}


def new_name(fullname: str) -> str | None:
    """The module's path today, for an old path; None for any other name."""
    if not fullname.startswith("spotnb."):
        return None
    old = fullname[len("spotnb."):]
    while old:
        target = MOVED.get(old)
        if target is not None:
            return f"spotnb.{target}{fullname[len('spotnb.') + len(old):]}"
        old = old.rpartition(".")[0]
    return None


class OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old path as its module at the new path (see the module docstring).

    First on ``sys.meta_path``: under an old package path (``spotnb.events``, whose
    ``__path__`` is the new package's folder) the path finder would load a second copy
    of a submodule under its old name.
    """

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if new_name(fullname) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        new = new_name(spec.name)
        assert new is not None
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # The module ran at its new path already; the import system set the old
        # path's spec on it on the way here: give it back its own.
        for name, spec in list(self._specs.items()):
            if spec is not None and spec.name == module.__name__:
                module.__spec__ = spec
                del self._specs[name]


    def get_code(self, fullname: str) -> types.CodeType | None:
        """``python -m`` an old path (``python -m spotnb.cli``): the new module's code."""
        new = new_name(fullname)
        spec = importlib.util.find_spec(new) if new else None
        loader = spec.loader if spec is not None else None
        return loader.get_code(new) if isinstance(loader, importlib.abc.InspectLoader) \
            and new else None


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
