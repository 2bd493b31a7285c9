"""Which entries of a ``spot.Checkpoint`` follow a variable of the cell.

``spot.Checkpoint(model=model, best_val_loss=best_val_loss, X=X)``: a keyword that
names a variable of the cell holding that very object *follows the variable*. Each save
reads the variable's value at that moment, and a restore that brings back a new
object (a float, a tuple, a batch the loop rebinds) assigns it to the variable. A float
is immutable: without this, ``best_val_loss = loss`` in the loop would never reach the
checkpoint, and every resume would bring back the value it had at registration.

A variable the cell rebinds to a wrapper of the registered object (``model =
torch.compile(model)``, ``model = DDP(model)``) keeps the registered object in the
checkpoint, so its state's keys do not change mid-job.

Refused at registration (``TypeError`` with the fix), where a value would be frozen
without a word:

* a plain value (one restored by replacement, not in place: a number, a string, a
  tuple, any object without ``state_dict``) held by a variable of another name
  (``spot.Checkpoint(best=best_val_loss)``): the checkpoint cannot know that later
  assignments to ``best_val_loss`` are meant;
* a plain value held by a local variable of a function (the checkpoint cannot read or
  set a function's variables later): keep it in a dict that is registered, or read
  and update it as ``ckpt["name"]``.

Anything else registered (a literal, an expression) is read back as ``ckpt["name"]``
and updated with ``ckpt["name"] = value``. Each process follows its own variables: in
a distributed job every rank's restore assigns its cell's variables.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from typing import Any

from spotnb.ckpt.snapshot import kind_of
from spotnb.protocol.spec import INJECTED_NAMES, IPYTHON_CACHE_NAME

__all__ = ["CellVariables"]

# Attributes through which a wrapper holds the module it wraps: torch.compile's
# OptimizedModule, DistributedDataParallel and DataParallel.
_WRAPPED = ("_orig_mod", "module")


class CellVariables:
    """The registered names that follow a variable of the registering namespace."""

    def __init__(self, namespace: dict[str, Any] | None, names: tuple[str, ...]) -> None:
        self._namespace = namespace
        self.names = names

    @classmethod
    def of_caller(cls, state: Mapping[str, Any], api: type) -> CellVariables:
        """The entries of ``state`` that follow a variable of the code that registered
        them (the first frame outside ``api``'s ``__init__`` and spotnb's runtime);
        raises ``TypeError`` for a value that would be frozen (module docstring)."""
        frame = _caller(api)
        if frame is None:
            return cls(None, ())
        module_level = frame.f_locals is frame.f_globals
        variables = frame.f_globals if module_level else frame.f_locals
        where = "the cell" if module_level else f"{frame.f_code.co_name}()"
        names = []
        for name, obj in state.items():
            if module_level and variables.get(name, _MISSING) is obj:
                names.append(name)
                continue
            if kind_of(obj) != "value" or not _distinct(obj):
                continue
            holders = sorted(n for n, v in variables.items() if v is obj
                             and n not in INJECTED_NAMES and not IPYTHON_CACHE_NAME.match(n))
            if not holders:
                continue  # a literal or an expression: ckpt[name]
            raise TypeError(_frozen(name, holders[0], obj, where, module_level))
        return cls(frame.f_globals if module_level else None, tuple(names))

    def refresh(self, objects: dict[str, Any], restoring: bool = False) -> None:
        """Put each followed variable's current value into ``objects`` (before a save,
        and before a restore: ``restoring``, where a view into another array, a batch
        sliced from the data set, is replaced by a copy to restore into, so that the
        restore assigns the variable instead of writing into the data set)."""
        if self._namespace is None:
            return
        for name in self.names:
            current = self._namespace.get(name, _MISSING)
            if current is _MISSING:
                continue  # deleted: the checkpoint keeps what it last saw
            registered = objects[name]
            if current is not registered and _wraps(current, registered):
                continue  # model = torch.compile(model): the module itself is saved
            if restoring and _is_view(current):
                current = current.clone() if hasattr(current, "clone") else current.copy()
            objects[name] = current

    def follows(self, name: str) -> bool:
        return self._namespace is not None and name in self.names

    def assign(self, name: str, value: Any) -> None:
        """Assign a followed variable (``ckpt[name] = value``, or a restored value), unless
        it holds ``value`` already or a wrapper of it (``torch.compile(model)``)."""
        if self._namespace is None or name not in self.names:
            return
        current = self._namespace.get(name, _MISSING)
        if current is value or _wraps(current, value):
            return
        self._namespace[name] = value


_MISSING = object()


def _wraps(wrapper: Any, obj: Any) -> bool:
    """Whether ``wrapper`` holds ``obj`` as the module it wraps (``torch.compile``'s,
    DDP's). Not a value without such an attribute: registered as None (``smooth_loss =
    None`` before the loop), the variable's later float is no wrapper of it."""
    return any(getattr(wrapper, attr, _MISSING) is obj for attr in _WRAPPED)


def _caller(api: type) -> types.FrameType | None:
    frame = sys._getframe(1)
    while frame is not None and (
            frame.f_globals.get("__name__", "").startswith("spotnb.train")
            or (frame.f_code.co_name == "__init__"
                and isinstance(frame.f_locals.get("self"), api))):
        frame = frame.f_back  # type: ignore[assignment]
    return frame


def _is_view(obj: Any) -> bool:
    """Whether ``obj`` is a tensor or an array that shares another one's memory."""
    kind = kind_of(obj)
    if kind == "tensor":
        return getattr(obj, "_base", None) is not None
    return kind == "ndarray" and getattr(obj, "base", None) is not None


def _distinct(obj: Any) -> bool:
    """Whether being held by a variable says that the variable was meant: not a
    value Python shares between unrelated names (None, booleans, small ints, strings)."""
    if obj is None or isinstance(obj, (bool, str, bytes)):
        return False
    if isinstance(obj, int):
        return not -5 <= obj <= 256
    if isinstance(obj, (tuple, frozenset)):
        return bool(obj)
    return True


def _frozen(name: str, holder: str, obj: Any, where: str, module_level: bool) -> str:
    kind = type(obj).__name__
    if module_level:
        return (f"spot.Checkpoint({name}={holder}): {holder} is a {kind}, which a checkpoint "
                f"saves as a value, and registered under another name the checkpoint "
                f"cannot follow the variable: later assignments to {holder} would never "
                f"be saved. Register it under the variable's own name, "
                f"spot.Checkpoint(..., {holder}={holder}): each save then reads its "
                f"current value and restore() assigns it")
    return (f"spot.Checkpoint({name}=...): {holder} is a {kind} in a local variable of "
            f"{where}, which a checkpoint cannot read or assign later: every save would "
            f"write the value it has now. Keep it in a dict that the checkpoint holds "
            f"(state = {{'{holder}': {holder}}}; spot.Checkpoint(..., state=state)), or read "
            f"and update it as ckpt['{name}'], or run the loop at the cell's top level")
