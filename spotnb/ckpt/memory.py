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
allocated ahead, in the background (``snapshot.BufferPool.warm_async``): the filling
``madvise`` is called through ctypes, which lets go of the GIL, so that the training
thread runs meanwhile (Python's ``mmap.madvise`` holds the GIL for the whole call, a
quarter of a second or more per 256 MB here). Pinned memory for copies from a GPU
comes from torch.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
from pathlib import Path
from typing import Any

__all__ = [
    "BUDGET_ENV",
    "DEFAULT_FREE_RAM_SHARE",
    "MemoryBudget",
    "free_ram",
    "host_empty",
    "parse_size",
]

#: The user's budget for every checkpoint of the process, when the code sets none.
BUDGET_ENV = "SPOTNB_CHECKPOINT_MEMORY"
#: The default budget: this share of the free RAM. Half leaves the other half to the
#: training process growing (data loader workers, allocator caches, the next batch)
#: and to the page cache the store's writes go through.
DEFAULT_FREE_RAM_SHARE = 0.5
# Allocations at least this large are mapped and populated in one system call.
_POPULATE_MIN_BYTES = 1 << 20
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


def host_empty(torch: Any, shape: Any, dtype: Any, pin: bool = False) -> Any:
    """An uninitialised CPU tensor whose pages are all in memory already.

    ``pin``: page-locked memory (for asynchronous copies from a GPU), from torch
    (page-locked memory is resident by definition).
    """
    if pin:
        return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
    numel = 1
    for n in shape:
        numel *= int(n)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes < _POPULATE_MIN_BYTES or not hasattr(mmap, "MAP_POPULATE"):
        return torch.zeros(shape, dtype=dtype, device="cpu")  # zeroing touches each page
    area = _populated(nbytes)
    # The tensor keeps the mapping alive; it is unmapped when the tensor is freed.
    return torch.frombuffer(area, dtype=dtype, count=numel).view(shape)


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


def _madvise_without_gil(area: mmap.mmap, advice: int) -> None:
    """``area.madvise(advice)``, letting other threads run meanwhile (ctypes calls
    release the GIL; ``mmap.madvise`` does not). OSError as ``mmap.madvise`` raises."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):  # no C library to call: hold the GIL then
            _libc = False
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
