"""Checksums of checkpoint files: a running CRC-32C.

A manifest records every file's checksum as ``"<algorithm>:<hex>"``, so that a reader
knows how to check it:

* ``crc32c``: what a checkpoint is written with. CRC-32C is the checksum S3 keeps
  for multipart parts; with the ``crc32c`` wheel (``spotnb[torch]``, ``spotnb[aws]``)
  it runs on the CPU's CRC instructions without the GIL, at ~12 GB/s on one core of
  the development VM, where SHA-256 ran at ~1.4 GB/s quiet and far less under load:
  a sixth to a quarter of a save's writer threads' time, a tenth of that now
  (``benchmarks/RESULTS.md``).
* ``crc32``: zlib's CRC-32 (another polynomial, ~2.5 GB/s, GIL released), what a
  writer without the wheel records instead.

A CRC detects damaged data (every error burst up to 32 bits, else all but one in
2^32 of random damage), which is what a checksum in a manifest is for: a truncated
upload, a bad disk, a corrupted download. It does not detect deliberate tampering;
the store's access control is what keeps others from writing checkpoints.

Checking a ``crc32c`` file without the wheel falls back to a pure-Python CRC-32C: the
right answer, slowly (about 10 MB/s), with a warning that names the wheel.

Large files are never held in memory: :class:`HashingWriter` checksums while the caller
writes (into a local file, or straight into the store), and :func:`hash_file` reads a
file in chunks.
"""

from __future__ import annotations

import logging
import os
import zlib
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotnb.protocol.store import ObjectWriter

__all__ = ["ALGORITHMS", "DEFAULT_ALGORITHM", "Checksum", "HashingWriter", "algorithm_of",
           "copy_hashing", "hash_file"]

log = logging.getLogger(__name__)

_crc32c_wheel: Any
try:  # the wheel: hardware CRC-32C, GIL released for large buffers
    import crc32c as _crc32c_wheel
except ImportError:  # pragma: no cover - CI installs it; see _crc32c_py
    _crc32c_wheel = None

#: What a checksum may be: ``"<algorithm>:<hex digest>"``.
ALGORITHMS = ("crc32c", "crc32")
#: What new files are checksummed with here: CRC-32C with the wheel, else zlib's CRC-32.
DEFAULT_ALGORITHM = "crc32c" if _crc32c_wheel is not None else "crc32"

# CRC-32C (Castagnoli), reflected polynomial: the pure-Python fallback's table.
_CASTAGNOLI = 0x82F63B78
_TABLE: list[int] = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ (_CASTAGNOLI if _crc & 1 else 0)
    _TABLE.append(_crc)
_warned_slow = False


def _crc32c_py(data: memoryview, crc: int) -> int:
    """CRC-32C in pure Python: slow, used only to check files without the wheel."""
    table = _TABLE
    crc ^= 0xFFFFFFFF
    for b in data.tobytes():
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def algorithm_of(checksum: str) -> str:
    """The algorithm of ``"<algorithm>:<hex>"``; ValueError if it is none of ours."""
    algorithm, sep, digest = checksum.partition(":")
    if not sep or not digest or algorithm not in ALGORITHMS:
        raise ValueError(f"{checksum!r} is not a checksum of {', '.join(ALGORITHMS)} "
                         "(the manifest may come from a newer spotnb: pip install -U spotnb)")
    return algorithm


class Checksum:
    """A running checksum: ``update`` with each piece as it is written, then ``value``.

    ``algorithm``: one of :data:`ALGORITHMS`; :data:`DEFAULT_ALGORITHM` for new files.
    """

    def __init__(self, algorithm: str = DEFAULT_ALGORITHM) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown checksum algorithm {algorithm!r}: one of "
                             f"{', '.join(ALGORITHMS)}")
        self.algorithm = algorithm
        self._crc = 0
        if algorithm == "crc32c" and _crc32c_wheel is None:
            global _warned_slow
            if not _warned_slow:
                _warned_slow = True
                log.warning("checking CRC-32C checksums in pure Python (slow): "
                            "pip install crc32c")

    def update(self, data: Any) -> None:
        """Add the bytes of ``data`` (any contiguous buffer)."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        if self.algorithm == "crc32":
            self._crc = zlib.crc32(view, self._crc)
        elif _crc32c_wheel is not None:
            self._crc = _crc32c_wheel.crc32c(view, self._crc)
        else:
            self._crc = _crc32c_py(view, self._crc)

    @property
    def value(self) -> str:
        """``"<algorithm>:<hex>"``, as manifests record it."""
        return f"{self.algorithm}:{self._crc:08x}"


# Files are hashed and copied in chunks of this size: large enough to be fast,
# small enough never to matter for memory.
_CHUNK = 4 * 1024 * 1024


class HashingWriter:
    """A binary file object that checksums and counts what is written through it.

    ``torch.save`` and ``pickle.dump`` write into it directly, so a large checkpoint is
    checksummed while it is serialised, not read back afterwards. ``raw`` is a local
    file or a store's :class:`~spotnb.protocol.store.ObjectWriter`. The checksum is a running
    CRC-32C (:class:`Checksum`).
    """

    def __init__(self, raw: IO[bytes] | ObjectWriter) -> None:
        self._raw = raw
        self._checksum = Checksum()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self._checksum.update(view)
        self.size += view.nbytes
        self._raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        flush = getattr(self._raw, "flush", None)
        if flush is not None:
            flush()

    def writable(self) -> bool:
        return True

    @property
    def checksum(self) -> str:
        """``"crc32c:<hex>"`` of what was written so far."""
        return self._checksum.value


def hash_file(path: str | os.PathLike[str], algorithm: str | None = None
              ) -> tuple[int, str]:
    """Size and checksum of a local file, read in chunks.

    ``algorithm``: the one a manifest's checksum names (to check a file against it);
    default: the one new checkpoints record.
    """
    checksum = Checksum() if algorithm is None else Checksum(algorithm)
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        while n := f.readinto(buf):
            checksum.update(memoryview(buf)[:n])
            size += n
    return size, checksum.value


def copy_hashing(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> tuple[int, str]:
    """Copy a file in chunks, checksumming what was copied; return its size and checksum.

    The hash describes the copy, so a source that changes during the copy cannot
    produce a manifest that disagrees with the uploaded bytes.
    """
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        writer = HashingWriter(fout)
        while chunk := fin.read(_CHUNK):
            writer.write(chunk)
    return writer.size, writer.checksum
