"""How much host memory a save may use, and how it gets that memory.

A save copies the training state into host memory so that training can go on while
the copy is written out; that copy is the save's *extra* host memory, on top of what
the training process holds anyway. :class:`MemoryBudget` bounds it:

* set by the user: ``spot.Checkpoint(..., host_memory="8GB")`` (bytes, ``"512MB"``,
  ``"8GiB"``, or a share of the free RAM, ``"25%"``), else ``SPOTNB_CHECKPOINT_MEMORY``
  (same forms), else :data:`DEFAULT_FREE_RAM_SHARE` of the free RAM;
* measured at every save: free RAM changes while training runs (data loaders,
  allocator caches). Memory the checkpoint itself already holds (its buffers from the
  previous save) counts as available to it, not as used by someone else.

Free RAM is the kernel's ``MemAvailable`` (it counts reclaimable page cache), or what
the container's cgroup still allows if that is less.

Buffers are allocated with :func:`host_empty`: large ones as anonymous mappings that
the kernel backs with huge pages where it can (``MADV_HUGEPAGE``) and fills in one go
(``MADV_POPULATE_WRITE``, else ``MAP_POPULATE``). Faulting in 4 KiB pages one by one
during the first copy costs several times the copy itself; this is 2-3x faster
(``benchmarks/RESULTS.md``). Filling a buffer is still most of what a first save
costs (the kernel zeroes every page before the copy writes it), so buffers are
allocated ahead, in the background (``buffers.BufferPool.warm_async``): the filling
``madvise`` is called through ctypes, which lets go of the GIL, so that the training
thread runs meanwhile (Python's ``mmap.madvise`` holds the GIL for the whole call, a
quarter of a second or more per 256 MB here). A large buffer is filled in pieces
(:func:`populate`), so that the warming thread and a save that comes meanwhile fill
one large tensor's buffer together, as they fill the buffers of many tensors.

Page-locked (pinned) buffers, for copies from a GPU, are anonymous mappings of
exactly their size registered with CUDA (``cudaHostRegister``; :func:`_pinned_empty`),
not torch's pinned allocator: that one rounds every block up to a power of two (a
state of GPT-2-shaped tensors took 1.55x its bytes, past the budget) and keeps freed
blocks cached, still held once the checkpoint lets them go (``benchmarks/RESULTS.md``,
"GPU device check").

The copies themselves (:class:`CopyBatch`): a save's host-to-host copies are made
together, split into equal shares of bytes over up to :data:`MAX_COPY_THREADS`
threads (torch's intra-op thread count), each calling the C library's ``memmove``
(through ctypes, without the GIL). One thread alone does not reach the memory
bandwidth, and the C library copies a large block with non-temporal stores, which
torch's ``copy_`` does not. On the 2-core VM of ``benchmarks/RESULTS.md``, between
warm buffers: one 1 GiB tensor 0.066 s this way against 0.091-0.10 s with
``Tensor.copy_``; 1 GiB in 64 MiB tensors 0.085-0.09 s against about 0.1 s (glibc
takes the non-temporal path only above a size that it derives from the CPU's caches:
between 128 and 256 MiB per call there).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_FREE_RAM_SHARE",
    "POPULATE_MIN_BYTES",
    "CopyBatch",
    "MemoryBudget",
    "can_populate",
    "free_ram",
    "host_empty",
    "parse_size",
    "populate",
]

#: The user's budget for every checkpoint of the process, when the code sets none.
BUDGET_ENV = "SPOTNB_CHECKPOINT_MEMORY"
#: The default budget: this share of the free RAM. Half leaves the other half to the
#: training process growing (data loader workers, allocator caches, the next batch)
#: and to the page cache the store's writes go through.
DEFAULT_FREE_RAM_SHARE = 0.5
#: At most this many threads copy a save's tensors at once: past a few threads a
#: copy is bound by the memory bus, not by the cores.
MAX_COPY_THREADS = 8
# A share of a batch's copy is at least this many bytes: below it, handing the work to
# another thread costs more than it saves.
_COPY_SHARE_MIN_BYTES = 16 << 20
#: Allocations at least this large are mapped and filled in one system call (or, with
#: ``populate=False``, mapped only, for :func:`populate`).
POPULATE_MIN_BYTES = 1 << 20
# madvise(2) advice Python's mmap module may not name (Linux 5.14+).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 10**3,
          "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, what: str = "host_memory") -> int | float:
    """Bytes (an int) or a share of the free RAM (a float in (0, 1]).

    ``8_000_000_000``, ``"8GB"``, ``"7.5GiB"``, ``"512MB"``, ``"25%"``. Raises
    ValueError naming the accepted forms.
    """
    hint = (f"give {what} as bytes, a size such as '8GB' or '512MiB', or a share of the "
            "free RAM such as '25%'")
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a size: {hint}")
    if isinstance(value, (int, float)):
        if not value > 0:
            raise ValueError(f"{what} must be above 0, not {value!r}: {hint}")
        return int(value)
    text = str(value).strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"{what}={value!r} is not a size: {hint}") from None
        if not 0 < share <= 1:
            raise ValueError(f"{what}={value!r}: a share must be above 0% and at most "
                             "100%")
        return share
    m = _SIZE_RE.match(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{what}={value!r} is not a size: {hint}")
    size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{what} must be above 0, not {value!r}: {hint}")
    return size


def _cgroup_room() -> int | None:
    """What the process's memory cgroup still allows, if it has a limit."""
    v2 = Path("/sys/fs/cgroup")
    candidates = [(v2 / "memory.max", v2 / "memory.current"),
                  (v2 / "memory" / "memory.limit_in_bytes",
                   v2 / "memory" / "memory.usage_in_bytes")]
    for limit_path, usage_path in candidates:
        try:
            limit = limit_path.read_text().strip()
            usage = int(usage_path.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def free_ram() -> int:
    """Bytes of RAM the process could still use: ``MemAvailable``, or the cgroup's room."""
    import psutil

    available = int(psutil.virtual_memory().available)
    room = _cgroup_room()
    return available if room is None else min(available, room)


class MemoryBudget:
    """The extra host memory a save may use (see the module docstring)."""

    def __init__(self, setting: int | float | str | None = None) -> None:
        if setting is None:
            setting = os.environ.get(BUDGET_ENV) or None
            source = BUDGET_ENV
        else:
            source = "host_memory"
        self.setting: int | float = (DEFAULT_FREE_RAM_SHARE if setting is None
                                     else parse_size(setting, source))

    def __repr__(self) -> str:
        if isinstance(self.setting, float):
            return f"MemoryBudget({self.setting:.0%} of free RAM)"
        return f"MemoryBudget({self.setting / 1e6:.0f} MB)"

    def bytes(self, held: int = 0) -> int:
        """The budget now, in bytes; ``held``: what the checkpoint's buffers already use."""
        if isinstance(self.setting, int):
            return self.setting
        return int(self.setting * (free_ram() + held))


def host_empty(torch: Any, shape: Any, dtype: Any, pin: bool = False,
               populate: bool = True) -> Any:
    """An uninitialised CPU tensor whose pages are all in memory already.

    ``pin``: page-locked memory (for asynchronous copies from a GPU; resident by
    definition), of exactly its size (:func:`_pinned_empty`). ``populate=False``: a
    large one is only mapped, and the caller fills its pages with :func:`populate` (in
    pieces, by several threads), unless this kernel cannot do that (see
    :func:`can_populate`): then it comes filled.
    """
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if pin:
        return _pinned_empty(torch, shape, dtype, numel, nbytes)
    if nbytes < POPULATE_MIN_BYTES or not hasattr(mmap, "MAP_POPULATE"):
        return torch.zeros(shape, dtype=dtype, device="cpu")  # zeroing touches each page
    if not populate and can_populate():
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)
    else:
        area = _populated(nbytes)
    # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    return torch.frombuffer(area, dtype=dtype, count=numel).view(shape)


class _PinnedArea(mmap.mmap):
    """An anonymous mapping, page-locked with ``cudaHostRegister`` while it lives.

    ``__del__`` unregisters it before ``mmap`` unmaps it, once no tensor holds it."""

    address = 0
    cudart: Any = None

    def __del__(self) -> None:
        address, self.address = self.address, 0
        if address:
            with contextlib.suppress(Exception):  # at exit, CUDA may be gone already
                self.cudart.cudaHostUnregister(address)


def _pinned_empty(torch: Any, shape: Any, dtype: Any, numel: int, nbytes: int) -> Any:
    """A page-locked CPU tensor of exactly ``nbytes``: an anonymous mapping registered
    with CUDA, unregistered and unmapped when the tensor is freed.

    Not torch's pinned allocator (``pin_memory=True``), which rounds each block up to
    a power of two and keeps freed blocks cached: host memory the budget does not see
    (see the module docstring). Copies from the GPU into either run at the same speed
    (55 GB/s on an H100), and registering a state's buffers in the background blocked
    the training thread's CUDA calls for less time than torch's ``cudaHostAlloc`` of
    the rounded blocks did. The mapping is not inherited by a forked child
    (``MADV_DONTFORK``, as for any memory a device writes into): a DataLoader worker
    forked from the training process must neither copy the locked pages nor make the
    parent's pages copy-on-write under the GPU's copies. torch's allocator remains
    for buffers under a page, and where registering is not possible.
    """
    try:
        cudart = torch.cuda.cudart()
        register, _ = cudart.cudaHostRegister, cudart.cudaHostUnregister
    except Exception:  # no CUDA runtime bindings: torch's allocator
        register = None
    if register is None or nbytes < mmap.PAGESIZE:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    area = _PinnedArea(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_DONTFORK", "MADV_HUGEPAGE"):
        if hasattr(mmap, advice):
            area.madvise(getattr(mmap, advice))
    t = torch.frombuffer(area, dtype=dtype, count=numel).view(shape)
    try:
        failed = int(register(t.data_ptr(), nbytes, 0))  # cudaHostRegisterDefault
    except Exception as e:
        failed = -1
        log.debug("cudaHostRegister raised %s", e)
    if failed:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    area.cudart, area.address = cudart, t.data_ptr()
    # The tensor keeps the mapping alive; it is unregistered and unmapped when freed.
    return t


def populate(address: int, nbytes: int) -> None:
    """Fill the pages of ``nbytes`` at ``address`` (part of a mapping of
    :func:`host_empty` with ``populate=False``), without holding the GIL: several
    threads fill one large buffer together. Pages it could not fill are filled when
    first written."""
    libc = _c_library()
    if not libc or not nbytes:
        return
    start = address - address % mmap.PAGESIZE
    libc.madvise(start, nbytes + address - start, _MADV_POPULATE_WRITE)


_can_populate: bool | None = None


def can_populate() -> bool:
    """Whether :func:`populate` works here (``MADV_POPULATE_WRITE``: Linux 5.14+)."""
    global _can_populate
    if _can_populate is None:
        libc = _c_library()
        works = False
        if libc:
            probe = mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            anchor = ctypes.c_char.from_buffer(probe)
            try:
                works = libc.madvise(ctypes.addressof(anchor), mmap.PAGESIZE,
                                     _MADV_POPULATE_WRITE) == 0
            finally:
                del anchor
                probe.close()
        _can_populate = works
    return _can_populate


def _populated(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of ``nbytes`` whose pages are all in memory."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE)  # only sets a flag: quick
        _madvise_without_gil(area, _MADV_POPULATE_WRITE)
    except OSError:  # an older kernel: map it again, populated at creation
        area.close()
        area = mmap.mmap(-1, nbytes,
                         flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return area


_libc: Any = None


def _c_library() -> Any:
    """The C library, for ``madvise`` through ctypes; False if there is none."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):  # no C library to call: hold the GIL then
            _libc = False
    return _libc


def _madvise_without_gil(area: mmap.mmap, advice: int) -> None:
    """``area.madvise(advice)``, letting other threads run meanwhile (ctypes calls
    release the GIL; ``mmap.madvise`` does not). OSError as ``mmap.madvise`` raises."""
    _c_library()
    if not _libc:
        area.madvise(advice)
        return
    anchor = ctypes.c_char.from_buffer(area)  # its address; released right after
    try:
        if _libc.madvise(ctypes.addressof(anchor), len(area), advice) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        del anchor


class CopyBatch:
    """Copies of CPU tensors into host buffers, made together in several threads.

    :meth:`add` takes a copy that is a plain run of bytes (both tensors on the CPU,
    contiguous, same dtype and shape, no lazy conjugate or negative bit) and leaves
    any other to the caller; :meth:`run` makes them all, splitting their bytes into
    equal shares, one per thread (the caller's thread takes one). The tensors are
    referenced until :meth:`run` returns.
    """

    def __init__(self) -> None:
        self._ranges: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        self._tensors: list[tuple[Any, Any]] = []
        self.nbytes = 0

    def add(self, dst: Any, src: Any) -> bool:
        """Queue ``dst.copy_(src)`` if it is a plain byte copy; False (nothing queued)
        if it is not, and the caller copies it."""
        if not (_plain(dst) and _plain(src) and dst.dtype == src.dtype
                and dst.shape == src.shape):
            return False
        size = int(src.numel()) * int(src.element_size())
        if size:
            self._ranges.append((int(dst.data_ptr()), int(src.data_ptr()), size))
            self._tensors.append((dst, src))
            self.nbytes += size
        return True

    def run(self, threads: int | None = None) -> None:
        """Make every queued copy; returns when all are done. ``threads``: at most
        this many (default: torch's intra-op thread count, within
        :data:`MAX_COPY_THREADS`)."""
        if not self._ranges:
            return
        if threads is None:
            import torch

            threads = int(torch.get_num_threads())
        shares = _split(self._ranges, max(1, min(threads, MAX_COPY_THREADS,
                                                  self.nbytes // _COPY_SHARE_MIN_BYTES)))
        futures: list[Future[None]] = [_copy_pool().submit(_copy, share)
                                       for share in shares[1:]]
        try:
            _copy(shares[0])
        finally:
            for future in futures:
                future.result()
            self._ranges.clear()
            self._tensors.clear()
            self.nbytes = 0


def _plain(t: Any) -> bool:
    import torch

    return bool(t.device.type == "cpu" and t.layout == torch.strided
                and not t.is_quantized and t.is_contiguous()
                and not t.is_conj() and not t.is_neg())


def _split(ranges: list[tuple[int, int, int]], n: int) -> list[list[tuple[int, int, int]]]:
    """``ranges`` cut into ``n`` lists of (nearly) equal bytes, in order."""
    total = sum(size for *_, size in ranges)
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    share, room = 0, -(-total // n)
    for dst, src, size in ranges:
        while size:
            take = size if share == n - 1 else min(size, room)  # the last takes the rest
            shares[share].append((dst, src, take))
            dst, src, size, room = dst + take, src + take, size - take, room - take
            if room <= 0 and share < n - 1:
                share, room = share + 1, -(-total // n)
    return [s for s in shares if s]


def _copy(ranges: list[tuple[int, int, int]]) -> None:
    for dst, src, size in ranges:
        ctypes.memmove(dst, src, size)  # a foreign call: the GIL is released meanwhile


_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, it)
_pool_lock = threading.Lock()


def _copy_pool() -> ThreadPoolExecutor:
    """The copy threads of this process (a forked child gets its own: it inherits the
    parent's pool without its threads)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), ThreadPoolExecutor(MAX_COPY_THREADS - 1,
                                                     thread_name_prefix="spotnb-copy"))
        return _pool[1]
