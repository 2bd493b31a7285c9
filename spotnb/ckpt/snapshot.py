"""Training state in host memory: capture it fast, write it, read it back in place.

:func:`capture` is the only part of a checkpoint that runs on the training loop's
thread. It walks every registered object and returns a :class:`Captured`: the
*state*, a small tree holding everything but the tensors (containers rebuilt, kinds,
RNG states, other objects pickled on the spot so that an unpicklable one fails the
save at once, with its name), in which every tensor (and NumPy array, when torch is
there) is replaced by a :class:`TensorRef` naming it; and the *tensors*, by name.

Which tensors are copied is the memory budget's call (:mod:`spotnb.ckpt.memory`):

* the state fits in the budget: every tensor is copied (detached, to CPU) into a
  buffer kept from the previous save (:class:`~spotnb.ckpt.buffers.BufferPool`);
  training goes on while a background thread writes the copies out (a copy into memory
  that is already mapped is several times faster than into a fresh allocation, which
  must fault in each page);
* it does not: the tensors that fit are copied, the others are *live*: written
  straight from the training process's own tensors (from a GPU through a small
  staging buffer) while the loop waits, so the extra host memory stays within the
  budget. See :mod:`spotnb.ckpt` for the writer.

A tensor's name is its path joined by dots (``model.fc.weight``,
``optimizer.state.0.exp_avg``), as ``torch.distributed.checkpoint`` names the entries
of ``{"model": model.state_dict(), ...}``; a tensor met twice (tied weights) is
written once. :func:`live_tensors` names the tensors of the live objects the same
way, so a restore can read each saved tensor straight into the tensor it came from.

How each registered object is captured and restored (the *kind*):

``state_dict``  anything with ``state_dict()`` and ``load_state_dict()`` (modules,
                optimizers, LR schedulers, GradScaler): loaded in place
``pystate``     ``getstate()``/``setstate()`` (``random.Random``): set in place
``torch_gen``   ``torch.Generator``: ``set_state`` in place
``np_gen``      ``numpy.random.Generator``: its bit generator's state set in place
``dict``        cleared and updated in place
``list``        slice-assigned in place
``tensor``      ``copy_`` in place (same shape)
``ndarray``     assigned in place (same shape)
``value``       anything else picklable: read back as ``ckpt["name"]``

The global RNGs (Python ``random``, NumPy's legacy global RNG, torch CPU and CUDA) are
captured and restored with the state (:mod:`spotnb.ckpt.rng`).

Without torch, arrays stay in the state (copied) and the state is pickled whole
(:func:`dump`).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
import random
import sys
from collections.abc import Callable, Hashable, Iterable
from typing import IO, Any

from spotnb.ckpt.buffers import BufferPool, choose_copies
from spotnb.ckpt.memory import CopyBatch
from spotnb.ckpt.rng import capture_rng, restore_rng
from spotnb.ckpt.tensors import nbytes, streamable, synchronize, user_torch

log = logging.getLogger(__name__)

__all__ = [
    "STATE_FORMAT",
    "BufferPool",
    "Captured",
    "Pickled",
    "TensorRef",
    "capture",
    "dump",
    "kind_of",
    "live_tensors",
    "load",
    "resolve_refs",
    "restore",
    "restore_rng",
    "tensor_specs",
]

#: The version of the state tree (``{"format", "step", "objects", "rng"}``): 1 held
#: the tensors themselves; 2 holds :class:`TensorRef` placeholders for them.
STATE_FORMAT = 2

# Values that cannot change under us: kept by reference in a snapshot.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis))


class TensorRef:
    """Where a tensor was in the captured state: its name among the saved tensors.

    ``numpy``: the value was a NumPy array (saved as a tensor, read back as an array).
    """

    __slots__ = ("fqn", "numpy")

    def __init__(self, fqn: str, numpy: bool = False) -> None:
        self.fqn = fqn
        self.numpy = numpy

    def __repr__(self) -> str:
        return f"TensorRef({self.fqn!r}{', numpy=True' if self.numpy else ''})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (TensorRef, (self.fqn, self.numpy))


@dataclasses.dataclass
class Captured:
    """One capture: the state tree and the tensors it refers to (see the module doc).

    ``live`` names the tensors that were not copied: they must be written before
    training changes them. ``nbytes`` counts every tensor's bytes; ``copied`` those
    copied into host buffers.
    """

    state: dict[str, Any]
    tensors: dict[str, Any]
    live: frozenset[str]
    nbytes: int
    copied: int


class Pickled:
    """An object pickled at capture time (unpickled on restore)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (Pickled, (self.data,))

    def loads(self) -> Any:
        return pickle.loads(self.data)


def _is_atomic(x: Any) -> bool:
    if isinstance(x, _ATOMIC):
        return True
    torch = user_torch()
    if torch is not None and isinstance(x, (torch.dtype, torch.device, torch.Size)):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, (np.generic, np.dtype))


def kind_of(obj: Any) -> str:
    """How ``obj`` is captured and restored (see the module docstring)."""
    if callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    ) and not isinstance(obj, type):
        return "state_dict"
    torch = user_torch()
    if torch is not None:
        if isinstance(obj, torch.Tensor):
            return "tensor"
        if isinstance(obj, torch.Generator):
            return "torch_gen"
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(obj, np.ndarray):
            return "ndarray"
        if isinstance(obj, np.random.Generator):
            return "np_gen"
    if isinstance(obj, random.Random):
        return "pystate"
    if isinstance(obj, dict):
        return "dict"
    if isinstance(obj, list):
        return "list"
    return "value"


class _Walker:
    """Walks registered objects the same way for capture, restore and warming.

    ``tree`` rebuilds containers (dicts keep their type and attributes, e.g.
    ``OrderedDict._metadata``) and hands every tensor (and, with torch, every numeric
    NumPy array) to ``on_tensor(key, name, tensor, was_numpy)``, whose result takes its
    place. A tensor met again (tied weights) is handed over once; later places get the
    first result. Other leaves are pickled when ``pickle_leaves``, else left as they are.
    """

    def __init__(self, on_tensor: Callable[[tuple[Hashable, ...], str, Any, bool], Any],
                 pickle_leaves: bool) -> None:
        self.on_tensor = on_tensor
        self.pickle_leaves = pickle_leaves
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.names: set[str] = set()
        self.torch = user_torch()
        self.np = sys.modules.get("numpy")

    def _name(self, key: tuple[Hashable, ...]) -> str:
        name = base = ".".join(map(str, key))
        n = 1
        while name in self.names:  # "a.b" as a key and as a path: keep both
            n += 1
            name = f"{base}#{n}"
        self.names.add(name)
        return name

    def _tensor(self, x: Any, key: tuple[Hashable, ...], t: Any, was_numpy: bool) -> Any:
        if id(x) in self.memo:
            return self.memo[id(x)][0]
        out = self.on_tensor(key, self._name(key), t, was_numpy)
        self.memo[id(x)] = (out, x)  # holding x keeps its id() unique meanwhile
        return out

    def tree(self, x: Any, key: tuple[Hashable, ...], what: str) -> Any:
        if _is_atomic(x):
            return x
        torch, np = self.torch, self.np
        if torch is not None and isinstance(x, torch.Tensor):
            if not streamable(torch, x):
                return x.detach().to("cpu", copy=True)  # sparse, quantized: in the state
            return self._tensor(x, key, x.detach(), False)
        if np is not None and isinstance(x, np.ndarray) and x.dtype != object:
            as_tensor = _from_numpy(torch, np, x)
            if as_tensor is None:
                return x.copy()
            return self._tensor(x, key, as_tensor, True)
        if type(x) is dict or (isinstance(x, dict) and type(x).__module__ == "collections"):
            out = copy.copy(x)  # keeps the type and attributes (OrderedDict._metadata)
            for k in out:
                out[k] = self.tree(x[k], (*key, k), what)
            return out
        if type(x) is list:
            return [self.tree(v, (*key, i), what) for i, v in enumerate(x)]
        if type(x) is tuple:
            return tuple(self.tree(v, (*key, i), what) for i, v in enumerate(x))
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(self.tree(v, (*key, i), what) for i, v in enumerate(x)))
        return _pickle(x, what) if self.pickle_leaves else x

    def objects(self, objects: dict[str, Any]) -> dict[str, tuple[str, Any]]:
        """{name: (kind, payload)} of every registered object."""
        out: dict[str, tuple[str, Any]] = {}
        for name, obj in objects.items():
            kind = kind_of(obj)
            if kind == "state_dict":
                payload = self.tree(state_dict(obj), (name,), name)
            elif kind == "pystate":
                payload = obj.getstate()
            elif kind == "torch_gen":
                payload = obj.get_state()
            elif kind == "np_gen":
                payload = copy.deepcopy(obj.bit_generator.state)
            else:
                payload = self.tree(obj, (name,), name)
            out[name] = (kind, payload)
        return out


# torch.compile wraps a module in an OptimizedModule whose state_dict() names every
# entry under "_orig_mod." (at any depth, for a compiled submodule).
_COMPILED = "_orig_mod"


def _plain(key: str) -> str:
    return ".".join(part for part in key.split(".") if part != _COMPILED)


def state_dict(obj: Any) -> Any:
    """``obj.state_dict()``; of a module, named as if it had not been compiled (the
    ``_orig_mod.`` parts left out), so a checkpoint loads into the model compiled or
    not, and the README's recipe (DCP's ``get_model_state_dict``, which names them
    so too) reads it into either."""
    sd = obj.state_dict()
    torch = user_torch()
    if torch is None or not isinstance(obj, torch.nn.Module) or \
            not any(_COMPILED in k.split(".") for k in sd):
        return sd
    out: Any = type(sd)((_plain(k), v) for k, v in sd.items())
    metadata = getattr(sd, "_metadata", None)
    if metadata is not None:
        out._metadata = type(metadata)((_plain(k), v) for k, v in metadata.items())
    return out


def _own_keys(obj: Any, sd: Any) -> Any:
    """A saved module state named as ``obj`` names it (compiled or not: see
    :func:`state_dict`); anything else as it is."""
    torch = user_torch()
    if torch is None or not isinstance(obj, torch.nn.Module) or not isinstance(sd, dict):
        return sd
    own_sd = obj.state_dict()
    own = {_plain(k): k for k in own_sd}
    if all(k in own_sd for k in sd):
        return sd
    out: Any = type(sd)((own.get(_plain(k), k), v) for k, v in sd.items())
    metadata = getattr(sd, "_metadata", None)
    own_meta = getattr(own_sd, "_metadata", None)
    if metadata is not None and own_meta is not None:
        prefixes = {_plain(k): k for k in own_meta}
        out._metadata = type(metadata)((prefixes.get(_plain(k), k), v)
                                       for k, v in metadata.items())
    return out


def _from_numpy(torch: Any, np: Any, x: Any) -> Any:
    """A tensor sharing ``x``'s memory, or None (no torch, or a dtype torch lacks)."""
    if torch is None or not x.flags.c_contiguous or not x.dtype.isnative:
        return None
    if not x.flags.writeable:
        x = x.copy()  # torch refuses to share read-only memory
    try:
        return torch.from_numpy(x)
    except TypeError:  # e.g. a dtype torch has no equivalent for
        return None


def _pickle(x: Any, what: str) -> Pickled:
    """Pickle now; cloudpickle for what plain pickle refuses (lambdas, local classes)."""
    try:
        return Pickled(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        pass
    try:
        import cloudpickle

        return Pickled(cloudpickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as e:
        raise TypeError(
            f"cannot checkpoint {what!r}: a {type(x).__name__} inside it cannot be pickled "
            f"({e}). Register only picklable state, or give the object state_dict() and "
            "load_state_dict() methods."
        ) from e


def capture(objects: dict[str, Any], pool: BufferPool, step: int,
            budget: int | None = None, keep: Iterable[Hashable] = ()) -> Captured:
    """Capture every registered object (see the module docstring).

    ``budget``: the bytes of tensors that may be copied into host buffers (None: all).
    ``keep``: keys of ``pool`` that the caller filled for the same save (they stay).
    Runs on the caller's thread; returns once nothing that was copied can change when
    training goes on (pending GPU copies are synchronised). The live tensors can.
    """
    found: list[tuple[tuple[Hashable, ...], str, Any]] = []

    def on_tensor(key: tuple[Hashable, ...], name: str, t: Any, was_numpy: bool) -> Any:
        found.append((key, name, t))
        return TensorRef(name, was_numpy)

    walker = _Walker(on_tensor, pickle_leaves=True)
    state = {"format": STATE_FORMAT, "step": step, "objects": walker.objects(objects),
             "rng": capture_rng()}
    chosen = choose_copies([t for _, _, t in found],
                           budget if budget is not None else sum(nbytes(t) for *_, t in found))
    tensors: dict[str, Any] = {}
    live: set[str] = set()
    copied = 0
    async_copies = False
    # Tensors whose buffers a warming thread is still filling: copied last (see
    # BufferPool), so that meanwhile this thread fills the next buffers itself.
    later: list[tuple[tuple[Hashable, ...], str, Any]] = []
    # The copies from CPU tensors, made together at the end in several threads.
    batch = CopyBatch()
    for (key, name, t), copy_it in zip(found, chosen, strict=True):
        tensors[name] = t  # the copy replaces it below; the order stays the state's
        if not copy_it:
            live.add(name)
            continue
        done = pool.copy(key, t, wait=False, batch=batch)
        if done is None:
            later.append((key, name, t))
            continue
        tensors[name], pending = done
        async_copies |= pending
        copied += nbytes(t)
    for key, name, t in later:
        done = pool.copy(key, t, batch=batch)
        assert done is not None
        tensors[name], pending = done
        async_copies |= pending
        copied += nbytes(t)
    batch.run()
    pool.retain({key for (key, _, _), copy_it in zip(found, chosen, strict=True) if copy_it}
                | set(keep))
    torch = user_torch()
    if async_copies and torch is not None:
        synchronize(torch, (t for (_, _, t), copy_it in zip(found, chosen, strict=True)
                            if copy_it))
    return Captured(state, tensors, frozenset(live),
                    sum(nbytes(t) for *_, t in found), copied)


def tensor_specs(objects: dict[str, Any]) -> list[tuple[Hashable, str, Any]]:
    """``[(key, name, tensor), ...]`` that a capture of ``objects`` would save, in order.

    Used to warm a :class:`BufferPool`; cheap (``state_dict()`` returns references).
    """
    specs: list[tuple[Hashable, str, Any]] = []

    def on_tensor(key: tuple[Hashable, ...], name: str, t: Any, was_numpy: bool) -> None:
        specs.append((key, name, t))

    if user_torch() is not None:
        _Walker(on_tensor, pickle_leaves=False).objects(objects)
    return specs


def live_tensors(objects: dict[str, Any]) -> dict[str, Any]:
    """The registered objects' own tensors by name (as :func:`capture` names them).

    A restore reads saved tensors straight into these (same shape and dtype), so
    loading a checkpoint needs no second copy of the state in memory.
    """
    return {name: t for _, name, t in tensor_specs(objects)}


def resolve_refs(x: Any, tensors: dict[str, Any]) -> Any:
    """Replace the :class:`TensorRef` leaves of a state tree with ``tensors[name]``."""
    if isinstance(x, TensorRef):
        t = tensors[x.fqn]
        return t.numpy() if x.numpy else t
    if isinstance(x, dict):
        out = copy.copy(x)
        for k in out:
            out[k] = resolve_refs(x[k], tensors)
        return out
    if type(x) is list:
        return [resolve_refs(v, tensors) for v in x]
    if type(x) is tuple:
        return tuple(resolve_refs(v, tensors) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(resolve_refs(v, tensors) for v in x))
    return x


def _unwrap(x: Any) -> Any:
    """Undo :class:`Pickled` leaves of a loaded payload."""
    if isinstance(x, Pickled):
        return x.loads()
    if isinstance(x, dict):
        out = copy.copy(x)
        for k in out:
            out[k] = _unwrap(x[k])
        return out
    if type(x) is list:
        return [_unwrap(v) for v in x]
    if type(x) is tuple:
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(_unwrap(v) for v in x))
    return x


def restore(name: str, obj: Any, kind: str, payload: Any) -> Any:
    """Load a captured payload into ``obj`` in place where its kind allows.

    Returns the restored value: ``obj`` itself for in-place kinds, else the loaded value.
    """
    current = kind_of(obj)
    value = _unwrap(payload)
    if current != kind:
        log.warning("checkpointed %r was a %s and is now a %s; read it back as ckpt[%r]",
                    name, kind, current, name)
        return value
    if kind == "state_dict":
        obj.load_state_dict(_own_keys(obj, value))
    elif kind == "pystate":
        obj.setstate(value)
    elif kind == "torch_gen":
        obj.set_state(value)
    elif kind == "np_gen":
        obj.bit_generator.state = value
    elif kind == "dict":
        obj.clear()
        obj.update(value)
    elif kind == "list":
        obj[:] = value
    elif kind == "tensor":
        torch = user_torch()
        with torch.no_grad():
            obj.copy_(value)
    elif kind == "ndarray":
        obj[...] = value
    else:
        return value
    return obj


def dump(state: Any, fileobj: IO[bytes] | Any, fmt: str) -> None:
    """Serialise a captured state with no tensors (fmt "pickle"; tensors go to DCP)."""
    if fmt == "pickle":
        pickle.dump(state, fileobj, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}; this is a spotnb bug, please "
                         "report it")


def load(path: Any, fmt: str) -> Any:
    """Read back what :func:`dump` wrote (trusted data: the job's own checkpoint)."""
    if fmt == "pickle":
        with open(path, "rb") as f:
            return pickle.load(f)
    raise ValueError(f"cannot read a checkpoint in format {fmt!r}: upgrade spotnb")
