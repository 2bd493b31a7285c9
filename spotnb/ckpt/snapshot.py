"""Training state in host memory: capture it fast, write it, read it back in place.

:func:`capture` is the only part of a checkpoint that runs on the training loop's
thread. It walks every registered object and returns a :class:`Captured`: the
*state*, a small tree holding everything but the tensors (containers rebuilt, kinds,
RNG states, other objects pickled on the spot so that an unpicklable one fails the
save at once, with its name), in which every tensor (and NumPy array, when torch is
there) is replaced by a :class:`TensorRef` naming it; and the *tensors*, by name.

Which tensors are copied is the memory budget's call (:mod:`spotnb.ckpt.memory`):

* the state fits in the budget: every tensor is copied (detached, to CPU) into a
  buffer kept from the previous save (:class:`BufferPool`); training goes on while a
  background thread writes the copies out (a copy into memory that is already mapped
  is several times faster than into a fresh allocation, which must fault in each page);
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
captured with :func:`capture_rng` and restored with :func:`restore_rng`.

Without torch, arrays stay in the state (copied) and the state is pickled whole
(:func:`dump`).
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import logging
import pickle
import random
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import IO, Any

from spotnb.ckpt.memory import (
    POPULATE_MIN_BYTES,
    CopyBatch,
    can_populate,
    host_empty,
    populate,
)

log = logging.getLogger(__name__)

__all__ = [
    "STATE_FORMAT",
    "BufferPool",
    "Captured",
    "Pickled",
    "TensorRef",
    "capture",
    "capture_rng",
    "dump",
    "kind_of",
    "live_tensors",
    "load",
    "nbytes",
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


def _torch() -> Any:
    """The torch module if the user's code imported it (never imported here)."""
    return sys.modules.get("torch")


def synchronize(torch: Any, tensors: Iterable[Any]) -> None:
    """Wait for the asynchronous copies out of ``tensors``: on every GPU one is on
    (``torch.cuda.synchronize()`` alone waits for the current GPU's, and a model split
    over several GPUs copies from each)."""
    devices = {t.device for t in tensors if getattr(t, "is_cuda", False)}
    for device in devices or (None,):
        torch.cuda.synchronize(device)


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


def nbytes(t: Any) -> int:
    """Bytes of a tensor's elements."""
    return int(t.numel()) * int(t.element_size())


def _streamable(torch: Any, t: Any) -> bool:
    """Whether a tensor is written as raw bytes (dense); others stay in the state."""
    return bool(t.layout == torch.strided and not t.is_quantized and not t.is_nested
                and t.device.type != "meta")


class BufferPool:
    """Host-memory buffers for tensor copies, reused from one save to the next.

    A buffer is keyed by where its tensor sits in the state (``("model", "fc.weight")``)
    and reused while shape and dtype match. :meth:`warm_async` allocates buffers in the
    background ahead of the first save. The pool keeps a host copy of (as much of the
    state as the budget allows) alive between saves: that memory is what makes a save
    cheap, and it counts against the budget. Callers never capture while a previous
    capture is still being written.

    Warming and a capture share the work: a key is allocated once, by whoever claims
    it first. A capture passes over the keys the warming thread is allocating, and
    allocates and copies the next ones itself (the thread skips those); it comes back
    for the passed-over ones at the end, waiting for them only if they are still
    being filled. So a save that comes while the pool is still warming has two
    threads filling pages, and no buffer is allocated twice.

    Filling a large buffer's pages (most of the cost of allocating it) is shared the
    same way, piece by piece (:data:`FILL_PIECE_BYTES`, :class:`_Fill`): one large
    tensor is filled by the warming thread and the capture together, as a state of
    many tensors is.
    """

    def __init__(self) -> None:
        self._bufs: dict[Hashable, Any] = {}
        self._lock = threading.Lock()
        self._warming: list[threading.Thread] = []
        # Keys being allocated (by a warming thread or a capture), set when done.
        self._claims: dict[Hashable, threading.Event] = {}
        # The keys the last capture kept (None: no capture since the last warm_async):
        # a warming thread that finishes a buffer nobody wants any more drops it.
        self._wanted: set[Hashable] | None = None
        # Buffers whose pages are still being filled, piece by piece.
        self._fills: dict[Hashable, _Fill] = {}

    @property
    def held(self) -> int:
        """Bytes of host memory the buffers hold."""
        with self._lock:
            return sum(nbytes(b) for b in self._bufs.values())

    def _buffer(self, key: Hashable, shape: Any, dtype: Any, on_gpu: bool,
                wait: bool = True) -> Any:
        """The buffer for ``key``, allocating it unless someone else is: then wait for
        it, or return None if not ``wait``."""
        torch = _torch()
        while True:
            with self._lock:
                buf = self._bufs.get(key)
                if buf is not None and buf.shape == shape and buf.dtype == dtype:
                    return buf
                claim = self._claims.get(key)
                if claim is None:
                    self._bufs.pop(key, None)  # free the old one before allocating
                    claim = self._claims[key] = threading.Event()
                    break
            if not wait:
                return None
            claim.wait()  # another thread is filling it: copy into it when done
        try:
            buf = _empty(torch, shape, dtype, on_gpu)
            fill = _Fill.of(buf, pinned=_pinned(torch, on_gpu))
            with self._lock:
                self._bufs[key] = buf
                if fill is not None:
                    self._fills[key] = fill
            return buf
        finally:
            with self._lock:
                del self._claims[key]
            claim.set()

    def _fill(self, key: Hashable, wait: bool = True) -> bool:
        """Fill the pages of ``key``'s buffer that nobody is filling yet; then wait for
        the pieces others are filling, or return False if not ``wait``."""
        with self._lock:
            fill = self._fills.get(key)
        if fill is None:
            return True
        fill.run(stop=None if wait else _exiting)
        if not fill.wait(wait):
            return False
        with self._lock:
            if self._fills.get(key) is fill:
                del self._fills[key]
        return True

    def copy(self, key: Hashable, t: Any, wait: bool = True, batch: CopyBatch | None = None
             ) -> tuple[Any, bool] | None:
        """A host copy of tensor ``t``; the second item says whether it is still in flight.

        (A copy from a GPU into pinned memory is asynchronous; see :func:`capture`.)
        None, copying nothing, if another thread is allocating its buffer and not
        ``wait``. With a ``batch``, a copy from a CPU tensor is queued there instead:
        the buffer holds the copy once the caller has run the batch.
        """
        torch = _torch()
        t = t.detach()
        buf = self._buffer(key, t.shape, t.dtype, t.is_cuda, wait)
        if buf is None or not self._fill(key, wait):
            return None
        if batch is not None and batch.add(buf, t):
            return buf, False
        non_blocking = t.is_cuda and buf.is_pinned()
        with torch.no_grad():
            buf.copy_(t, non_blocking=non_blocking)
        return buf, non_blocking

    def retain(self, keys: set[Hashable]) -> None:
        """Free the buffers of every other key (their tensors are no longer copied)."""
        with self._lock:
            self._wanted = set(keys)
            for key in [k for k in self._bufs if k not in keys]:
                del self._bufs[key]
                self._fills.pop(key, None)

    def warm_async(self, specs: list[tuple[Hashable, str, Any]], budget: int) -> None:
        """Allocate buffers for ``[(key, name, tensor), ...]`` in the background.

        Only the tensors a capture with this ``budget`` would copy (the same greedy
        choice, in the same order); only shapes and dtypes are read from the tensors,
        on the caller's thread. Returns at once.
        """
        torch = _torch()
        if torch is None:
            return
        chosen = _choose([t for _, _, t in specs], budget)
        wanted = [(key, t.shape, t.dtype, t.is_cuda)
                  for (key, _, t), copy_it in zip(specs, chosen, strict=True) if copy_it]
        if not wanted:
            return
        with self._lock:
            self._wanted = None  # this warming is the newest word on what a save copies

        def run() -> None:
            for key, shape, dtype, on_gpu in wanted:
                if _exiting.is_set():
                    return  # the interpreter is shutting down: allocate nothing more
                with self._lock:
                    buf = self._bufs.get(key)
                    if key in self._claims:
                        continue  # a capture is allocating it
                    had = buf is not None and buf.shape == shape and buf.dtype == dtype
                if had:
                    self._fill(key, wait=False)  # a capture has it: help fill it
                    continue
                self._buffer(key, shape, dtype, on_gpu)
                self._fill(key, wait=False)  # a capture may be filling it too
                with self._lock:
                    if self._wanted is not None and key not in self._wanted:
                        self._bufs.pop(key, None)  # a capture since chose without it
                        self._fills.pop(key, None)

        thread = threading.Thread(target=run, name="spotnb-warm", daemon=True)
        thread.start()
        self._warming = [th for th in self._warming if th.is_alive()] + [thread]
        _warm_threads.add(thread)

    def wait_warm(self) -> None:
        """Wait until every buffer :meth:`warm_async` was asked for is allocated."""
        while self._warming:
            self._warming.pop().join()


# Warming threads still running, and the flag that stops them when the interpreter
# exits: a daemon thread killed inside a torch allocation at shutdown can abort the
# process ("terminate called without an active exception") of a script that ends
# right after a restore.
_warm_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_exiting = threading.Event()


@atexit.register
def _stop_warming() -> None:
    _exiting.set()
    for thread in list(_warm_threads):
        thread.join()


#: A large buffer's pages are filled in pieces of this size, each by whichever thread
#: (warming or capture) takes it first.
FILL_PIECE_BYTES = 32 * 2**20


class _Fill:
    """The filling of a large buffer's pages, in pieces that threads take in turn.

    Holds the buffer, so that its mapping stays while a thread fills it.
    """

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        address, size = int(buf.data_ptr()), nbytes(buf)
        self.pieces = [(address + start, min(FILL_PIECE_BYTES, size - start))
                       for start in range(0, size, FILL_PIECE_BYTES)]
        self.done = [threading.Event() for _ in self.pieces]
        self._next = 0
        self._lock = threading.Lock()

    @classmethod
    def of(cls, buf: Any, pinned: bool) -> _Fill | None:
        """The filling a fresh buffer of :func:`_empty` needs: None if it came filled
        (small, ``pinned``, or a kernel without ``MADV_POPULATE_WRITE``)."""
        if pinned or nbytes(buf) < POPULATE_MIN_BYTES or not can_populate():
            return None
        return cls(buf)

    def run(self, stop: threading.Event | None = None) -> None:
        """Fill the pieces nobody has taken, until none is left (or ``stop`` is set)."""
        while stop is None or not stop.is_set():
            with self._lock:
                i = self._next
                if i >= len(self.pieces):
                    return
                self._next += 1
            try:
                populate(*self.pieces[i])
            finally:
                self.done[i].set()

    def wait(self, block: bool = True) -> bool:
        """Whether every piece is filled (waiting for them if ``block``)."""
        if block:
            self.run()  # pieces left untaken by a stopped thread
            for done in self.done:
                done.wait()
            return True
        return all(done.is_set() for done in self.done)


def _pinned(torch: Any, on_gpu: bool) -> bool:
    # Pinned memory makes copies from the GPU asynchronous and faster.
    return bool(on_gpu and torch.cuda.is_available())


def _empty(torch: Any, shape: Any, dtype: Any, on_gpu: bool) -> Any:
    # A large host buffer comes unfilled: BufferPool fills it in pieces (_Fill).
    return host_empty(torch, shape, dtype, pin=_pinned(torch, on_gpu), populate=False)


def _choose(tensors: list[Any], budget: int) -> list[bool]:
    """Which tensors to copy: all if they fit, else greedily in order while they fit."""
    sizes = [nbytes(t) for t in tensors]
    if sum(sizes) <= budget:
        return [True] * len(tensors)
    chosen, used = [], 0
    for size in sizes:
        fits = used + size <= budget
        chosen.append(fits)
        used += size if fits else 0
    return chosen


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
        self.torch = _torch()
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
            if not _streamable(torch, x):
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
    torch = _torch()
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
    torch = _torch()
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
    chosen = _choose([t for _, _, t in found],
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
    torch = _torch()
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

    if _torch() is not None:
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
