"""Host-memory buffers for a save's tensor copies, reused from one save to the next.

A capture (:func:`spotnb.ckpt.snapshot.capture`) copies the tensors that its memory
budget allows (:func:`choose_copies`) into the buffers of a :class:`BufferPool`, kept
from the previous save: a copy into memory that is already mapped is several times
faster than into a fresh allocation, which must fault in each page. The pool allocates
them ahead, in the background (:meth:`BufferPool.warm_async`), and the pages of a large
buffer are filled in pieces that the warming thread and a capture share. How the
memory is allocated and filled: :mod:`spotnb.ckpt.memory`.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Hashable
from typing import Any

from spotnb.ckpt.memory import (
    POPULATE_MIN_BYTES,
    CopyBatch,
    can_populate,
    host_empty,
    populate,
)
from spotnb.ckpt.tensors import nbytes, user_torch

__all__ = ["FILL_PIECE_BYTES", "BufferPool", "choose_copies"]


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
        torch = user_torch()
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
        torch = user_torch()
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
        torch = user_torch()
        if torch is None:
            return
        chosen = choose_copies([t for _, _, t in specs], budget)
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


def choose_copies(tensors: list[Any], budget: int) -> list[bool]:
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
