"""A cell's inputs as they travel: ``inputs.pkl``, and the notebook's functions in it.

``inputs.pkl`` is a cloudpickled ``{name: cloudpickled value}``: each input on its own,
so that one the instance cannot read is named (:class:`InputUnreadable`).

Functions defined in the notebook (or in a script's ``__main__``) are *linked* rather
than frozen, as ipyparallel's ``@interactive`` links a pushed function to the engine's
user namespace. cloudpickle would pickle such a function with a copy of the globals it
reads, taken at submit time: an ``estimate_loss()`` that reads the global ``model``
would measure the notebook's model, not the one the cell trains. :class:`Pickler`
instead writes the function without its globals, and :func:`load` rebuilds it with
the instance's user namespace as its ``__globals__``, so it reads the cell's live
variables when it is called. This holds for lambdas, for the methods of classes defined
in the notebook, and for functions nested in them, wherever they are in an input (in a
list, in a ``functools.partial``, as a bound method). What such a function reads from
the notebook that the cell does not define travels as inputs of their own: the notebook
side finds those names with :func:`globals_read` on the functions :func:`dumps` reports
(:func:`spotnb.client.capture.capture`, :func:`spotnb.client.validation.prepare_job`).

The notebook's global random states travel too (:func:`random_states`, under
:data:`RANDOM_STATES`, not an input of the cell): Python's ``random``, NumPy's legacy
global state and torch's CPU generator, as they are when the cell is submitted, set on
the instance before the cell runs. A cell that draws without seeding, after
``np.random.seed(0)`` in an earlier cell, then draws what it would draw in the notebook,
and two runs of it (one interrupted before its first checkpoint and run again, or a job
and the same cell run locally) the same numbers. ``restore()`` sets the saved states
over them.

Both sides use this module: the notebook side writes with :func:`dumps`, the instance's
runtime reads with :func:`load` (``spotnb.train.runtime._bootstrap``).
"""

from __future__ import annotations

import contextlib
import dis
import io
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

import cloudpickle

__all__ = ["RANDOM_STATES", "InputUnreadable", "Pickler", "dumps", "globals_read",
           "is_notebook_function", "load", "pack", "random_states"]

#: The entry of ``inputs.pkl`` that holds the notebook's global random states.
RANDOM_STATES = "__spotnb_random_states__"

# The instance's namespace that functions unpickled by load() are linked to.
_target: dict[str, Any] | None = None


class InputUnreadable(Exception):
    """An input cannot be unpickled here (its class's module is missing, ...)."""

    def __init__(self, name: str, error: BaseException) -> None:
        self.name = name
        self.error = error
        super().__init__(f"input {name!r}: {type(error).__name__}: {error}")


def is_notebook_function(obj: Any) -> bool:
    """Whether ``obj`` is a function of the notebook (its globals are ``__main__``'s:
    a notebook cell's, a lambda's, a method of a class defined there, or a script's),
    which travels linked to the instance's namespace."""
    return isinstance(obj, types.FunctionType) and \
        obj.__globals__.get("__name__") == "__main__"


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, writing notebook functions linked (see the module
    docstring); ``linked`` lists the functions it wrote so, in the order met."""

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self.linked: list[types.FunctionType] = []

    def reducer_override(self, obj: Any) -> Any:
        if is_notebook_function(obj):
            self.linked.append(obj)
            cells = obj.__closure__ or ()
            # Created first (and memoised), then its state: a function that its own
            # closure or defaults refer to (recursion through a closure) is pickled once.
            state = {
                "defaults": obj.__defaults__,
                "kwdefaults": obj.__kwdefaults__,
                "cells": [_cell_value(cell) for cell in cells],
                "dict": dict(obj.__dict__),
                "qualname": obj.__qualname__,
                "module": obj.__module__,
                "doc": obj.__doc__,
                "annotations": obj.__annotations__,
            }
            return (_linked_function, (obj.__code__, obj.__name__, len(cells)), state,
                    None, None, _set_function_state)
        return super().reducer_override(obj)


def dumps(value: Any) -> tuple[bytes, list[types.FunctionType]]:
    """``value`` pickled, notebook functions linked; and those functions."""
    buf = io.BytesIO()
    pickler = Pickler(buf)
    pickler.dump(value)
    return buf.getvalue(), pickler.linked


def pack(blobs: Mapping[str, bytes]) -> bytes:
    """``inputs.pkl`` from ``{name: pickled value}``."""
    return cloudpickle.dumps(dict(blobs))


def random_states() -> bytes:
    """This process's global random states, pickled: Python's, and NumPy's and torch's
    (CPU) when they are imported here."""
    import random

    states: dict[str, Any] = {"python": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        # In plain Python types: the states unpickle where NumPy is not installed (an
        # instance whose cell never imports it).
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = (str(name), keys.tobytes(), str(keys.dtype), int(pos),
                           int(has_gauss), float(cached))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_rng_state"):
        states["torch"] = torch.get_rng_state().numpy().tobytes()
    return cloudpickle.dumps(states)


def _set_random_states(blob: bytes) -> None:
    """Set the random states :func:`random_states` took, for the libraries that are
    installed here (imported for it: the cell that draws from them imports them)."""
    import importlib
    import random

    states = cloudpickle.loads(blob)
    random.setstate(states["python"])
    if "numpy" in states:
        with contextlib.suppress(ImportError):
            numpy = importlib.import_module("numpy")
            name, keys, dtype, pos, has_gauss, cached = states["numpy"]
            numpy.random.set_state((name, numpy.frombuffer(keys, dtype=dtype).copy(), pos,
                                    has_gauss, cached))
    if "torch" in states:
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            return
        torch.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))


def load(data: bytes, namespace: dict[str, Any]) -> None:
    """Define each input of ``inputs.pkl`` in ``namespace``, the notebook's functions
    linked to it, and set the notebook's random states. Raises :class:`InputUnreadable`
    naming the first input that cannot be unpickled here (those before it are
    defined)."""
    global _target
    blobs: dict[str, bytes] = cloudpickle.loads(data)
    _target = namespace
    try:
        for name, blob in blobs.items():
            if name == RANDOM_STATES:
                _set_random_states(blob)
                continue
            try:
                namespace[name] = cloudpickle.loads(blob)
            except Exception as err:
                raise InputUnreadable(name, err) from err
    finally:
        _target = None


def globals_read(func: types.FunctionType) -> set[str]:
    """The global names ``func``'s code reads or assigns (``global``), nested functions,
    lambdas, comprehensions and class bodies in it included."""
    return set(_global_names(func.__code__))


def _global_names(code: types.CodeType) -> Iterator[str]:
    for instruction in dis.get_instructions(code):
        if instruction.opname in _GLOBAL_OPS:
            yield str(instruction.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_names(const)


# LOAD_NAME: a class body inside a function looks its free names up in the globals.
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


class _Empty:
    """An empty closure cell's content, as pickled."""

    def __reduce__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell: a name of the enclosing function not yet bound
        return _EMPTY


def _linked_function(code: types.CodeType, name: str, cells: int) -> types.FunctionType:
    """A notebook function rebuilt with the instance's namespace as its globals."""
    namespace = _target if _target is not None else vars(sys.modules["__main__"])
    closure = tuple(types.CellType() for _ in range(cells)) if cells else None
    return types.FunctionType(code, namespace, name, None, closure)


def _set_function_state(func: types.FunctionType, state: dict[str, Any]) -> None:
    func.__defaults__ = state["defaults"]
    func.__kwdefaults__ = state["kwdefaults"]
    for cell, value in zip(func.__closure__ or (), state["cells"], strict=True):
        if value is not _EMPTY:
            cell.cell_contents = value
    func.__dict__.update(state["dict"])
    func.__qualname__ = state["qualname"]
    func.__module__ = state["module"]
    func.__doc__ = state["doc"]
    func.__annotations__ = state["annotations"]
