"""Training state in host memory: capture it fast, write it, read it back in place.

:func:`capture` is the only part of a checkpoint that runs on the training loop's
thread: it copies every registered object into host memory so that training can go on
while a background thread serialises (:func:`dump`) and uploads the copy. Tensors are
copied (detached, to CPU) into buffers kept from the previous save
(:class:`BufferPool`): a copy into memory that is already mapped is several times
faster than a fresh allocation, which must fault in every page. Plain containers are
rebuilt; other objects are pickled on the spot, so an unpicklable one fails the save
at once, with its name, instead of later in the background.

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
captured with :func:`capture_rng` and restored with :func:`restore_rng`.
"""

from __future__ import annotations

import copy
import logging
import pickle
import random
import sys
import threading
from collections.abc import Hashable
from typing import IO, Any

log = logging.getLogger(__name__)

__all__ = [
    "BufferPool",
    "Pickled",
    "capture",
    "capture_rng",
    "dump",
    "kind_of",
    "load",
    "restore",
    "restore_rng",
    "tensor_specs",
]

# Values that cannot change under us: kept by reference in a snapshot.
_ATOMIC = (type(None), bool, int, float, complex, str, bytes, range, type(Ellipsis))


class Pickled:
    """An object pickled at capture time (unpickled on restore)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (Pickled, (self.data,))

    def loads(self) -> Any:
        return pickle.loads(self.data)


def _torch() -> Any:
    """The torch module if the user's code imported it (never imported here)."""
    return sys.modules.get("torch")


def _numpy() -> Any:
    """NumPy if it can be imported (its global RNG is part of the state)."""
    np = sys.modules.get("numpy")
    if np is None:
        try:
            import numpy as np
        except ImportError:
            return None
    return np


def _is_atomic(x: Any) -> bool:
    if isinstance(x, _ATOMIC):
        return True
    torch = _torch()
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
    torch = _torch()
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


class BufferPool:
    """Host-memory buffers for tensor copies, reused from one save to the next.

    A buffer is keyed by where its tensor sits in the state (``("model", "fc.weight")``)
    and reused while shape and dtype match (contiguous tensors; others are copied
    afresh each time). :meth:`warm_async` allocates and
    touches buffers in the background ahead of the first save. The pool keeps one host
    copy of the state alive between saves: that memory is what makes a save cheap.
    Callers never capture while a previous capture is still being serialised.
    """

    def __init__(self) -> None:
        self._bufs: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._warming: list[threading.Thread] = []

    def copy(self, key: Hashable, t: Any) -> tuple[Any, bool]:
        """A host copy of tensor ``t``; the second item says whether it is still in flight.

        (A copy from a GPU into pinned memory is asynchronous; see :func:`capture`.)
        """
        torch = _torch()
        t = t.detach()
        if t.layout != torch.strided or not t.is_contiguous() or t.is_quantized:
            return t.to("cpu", copy=True), False
        with self._lock:
            buf = self._bufs.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = _empty_like(torch, t)
                self._bufs[key] = buf
        non_blocking = t.is_cuda and buf.is_pinned()
        with torch.no_grad():
            buf.copy_(t, non_blocking=non_blocking)
        return buf, non_blocking

    def warm_async(self, specs: list[tuple[Hashable, Any]]) -> None:
        """Allocate and touch buffers for ``[(key, tensor), ...]`` in a background thread.

        Only shapes and dtypes are read from the tensors, on the caller's thread.
        """
        torch = _torch()
        if torch is None:
            return
        wanted = []
        with self._lock:
            for key, t in specs:
                buf = self._bufs.get(key)
                if (t.layout == torch.strided and t.is_contiguous() and not t.is_quantized
                        and (buf is None or buf.shape != t.shape or buf.dtype != t.dtype)):
                    wanted.append((key, t.shape, t.dtype, t.is_cuda))
        if not wanted:
            return

        def run() -> None:
            for key, shape, dtype, on_gpu in wanted:
                buf = _empty(torch, shape, dtype, on_gpu)
                buf.zero_()  # touch every page now, not during the save
                with self._lock:
                    old = self._bufs.get(key)
                    if old is None or old.shape != shape or old.dtype != dtype:
                        self._bufs[key] = buf

        thread = threading.Thread(target=run, name="spotnb-warm", daemon=True)
        thread.start()
        self._warming.append(thread)

    def wait_warm(self) -> None:
        """Wait for :meth:`warm_async` (a capture would otherwise allocate twice)."""
        while self._warming:
            self._warming.pop().join()


def _empty(torch: Any, shape: Any, dtype: Any, on_gpu: bool) -> Any:
    # Pinned memory makes copies from the GPU asynchronous and faster.
    pin = on_gpu and torch.cuda.is_available()
    return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)


def _empty_like(torch: Any, t: Any) -> Any:
    return _empty(torch, t.shape, t.dtype, t.is_cuda)


class _Capture:
    """One capture: dedupes shared tensors and remembers pending GPU copies."""

    def __init__(self, pool: BufferPool) -> None:
        self.pool = pool
        self.memo: dict[int, tuple[Any, Any]] = {}
        self.async_copies = False

    def tree(self, x: Any, key: tuple[Hashable, ...], what: str) -> Any:
        if _is_atomic(x):
            return x
        torch = _torch()
        if torch is not None and isinstance(x, torch.Tensor):
            # Tied weights stay one tensor, as torch.save would keep them.
            if id(x) in self.memo:
                return self.memo[id(x)][0]
            host, pending = self.pool.copy(key, x)
            self.async_copies |= pending
            self.memo[id(x)] = (host, x)  # holding x keeps its id() unique meanwhile
            return host
        np = sys.modules.get("numpy")
        if np is not None and isinstance(x, np.ndarray) and x.dtype != object:
            return x.copy()
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
        return _pickle(x, what)


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


def capture(objects: dict[str, Any], pool: BufferPool) -> dict[str, tuple[str, Any]]:
    """Copy every registered object into host memory: {name: (kind, payload)}.

    Runs on the caller's thread; returns once nothing in the result can change when
    training goes on (pending GPU copies are synchronised).
    """
    pool.wait_warm()
    cap = _Capture(pool)
    out: dict[str, tuple[str, Any]] = {}
    for name, obj in objects.items():
        kind = kind_of(obj)
        if kind == "state_dict":
            payload = cap.tree(obj.state_dict(), (name,), name)
        elif kind == "pystate":
            payload = obj.getstate()
        elif kind == "torch_gen":
            payload = obj.get_state()
        elif kind == "np_gen":
            payload = copy.deepcopy(obj.bit_generator.state)
        else:
            payload = cap.tree(obj, (name,), name)
        out[name] = (kind, payload)
    torch = _torch()
    if cap.async_copies and torch is not None:
        torch.cuda.synchronize()
    return out


def tensor_specs(objects: dict[str, Any]) -> list[tuple[Hashable, Any]]:
    """The tensors a capture of ``objects`` would copy, keyed as :func:`capture` keys them.

    Used to warm a :class:`BufferPool`; cheap (``state_dict()`` returns references).
    """
    torch = _torch()
    if torch is None:
        return []
    specs: list[tuple[Hashable, Any]] = []

    def walk(x: Any, key: tuple[Hashable, ...]) -> None:
        if isinstance(x, torch.Tensor):
            specs.append((key, x))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, (*key, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, (*key, i))

    for name, obj in objects.items():
        kind = kind_of(obj)
        if kind == "state_dict":
            walk(obj.state_dict(), (name,))
        elif kind in ("tensor", "dict", "list"):
            walk(obj, (name,))
    return specs


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
        obj.load_state_dict(value)
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
        torch = _torch()
        with torch.no_grad():
            obj.copy_(value)
    elif kind == "ndarray":
        obj[...] = value
    else:
        return value
    return obj


def capture_rng() -> dict[str, Any]:
    """The global RNG states: Python, NumPy (if importable), torch CPU and CUDA."""
    states: dict[str, Any] = {"python": random.getstate()}
    np = _numpy()
    if np is not None:
        states["numpy"] = np.random.get_state()
    torch = _torch()
    if torch is not None:
        states["torch"] = torch.get_rng_state()
        # Only if CUDA is in use: asking for its state would initialise it.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng`'s result."""
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        np = _numpy()
        if np is not None:
            np.random.set_state(states["numpy"])
    if "torch" in states or "cuda" in states:
        import torch

        if "torch" in states:
            torch.set_rng_state(states["torch"])
        if "cuda" in states:
            if torch.cuda.is_available() and torch.cuda.device_count() == len(states["cuda"]):
                torch.cuda.set_rng_state_all(states["cuda"])
            else:
                log.warning("the checkpoint has CUDA RNG states for %d GPU(s) but %d are "
                            "visible; CUDA random numbers will differ from an "
                            "uninterrupted run", len(states["cuda"]),
                            torch.cuda.device_count() if torch.cuda.is_available() else 0)


def dump(state: Any, fileobj: IO[bytes] | Any, fmt: str) -> None:
    """Serialise a captured state: ``torch.save`` (fmt "torch") or pickle."""
    if fmt == "torch":
        import torch

        torch.save(state, fileobj)
    elif fmt == "pickle":
        pickle.dump(state, fileobj, protocol=pickle.HIGHEST_PROTOCOL)
    else:
        raise ValueError(f"unknown checkpoint format {fmt!r}; this is a spotnb bug, please "
                         "report it")


def load(path: Any, fmt: str) -> Any:
    """Read back what :func:`dump` wrote (trusted data: the job's own checkpoint)."""
    if fmt == "torch":
        import torch

        return torch.load(path, map_location="cpu", weights_only=False)
    if fmt == "pickle":
        with open(path, "rb") as f:
            return pickle.load(f)
    raise ValueError(f"cannot read a checkpoint in format {fmt!r}: upgrade spotnb")
