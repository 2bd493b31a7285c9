"""Local copies of a checkpoint's files, checked against its manifest.

A file is checked by its size first (no read), then by its checksum, with the
algorithm the manifest names (:mod:`spotnb.ckpt.checksum`); a file checked before (a
copy that a download made whole) by its size only. :class:`CorruptCheckpoint` names the
file that is missing or differs. Files are checked (and downloaded) :data:`FILE_THREADS`
at a time.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from spotnb.ckpt.checksum import algorithm_of, hash_file
from spotnb.ckpt.errors import CorruptCheckpoint
from spotnb.ckpt.manifest import FileEntry, Manifest

__all__ = ["FILE_THREADS", "in_parallel", "verify_file", "verify_size"]

#: A checkpoint's files are downloaded (and checksummed) this many at a time: as many
#: as a rank writes at once (``spotnb.ckpt.MAX_FILES``), so that a restore reads the
#: store and checksums as fast as the save wrote.
FILE_THREADS = 4


def in_parallel(names: list[str], fn: Callable[[str], Path]) -> dict[str, Path]:
    """``{name: fn(name)}``, FILE_THREADS at a time; the first failure in ``names``'
    order is raised, once every call has ended."""
    if len(names) <= 1:
        return {name: fn(name) for name in names}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(FILE_THREADS, len(names)),
                            thread_name_prefix="spotnb-fetch") as pool:
        futures = [pool.submit(fn, name) for name in names]
    return {name: future.result() for name, future in zip(names, futures, strict=True)}


def verify_size(manifest: Manifest, entry: FileEntry, path: Path) -> None:
    """Check a file verified before: present, of the manifest's size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {manifest.id}: file {entry.name!r} is missing "
                                f"from {path.parent}") from None
    if size != entry.size:
        raise CorruptCheckpoint(f"checkpoint {manifest.id}: file {entry.name!r} has {size} "
                                f"bytes, the manifest says {entry.size}")


def verify_file(manifest: Manifest, entry: FileEntry, path: Path, remove_bad: bool,
                shown: Path | None = None) -> None:
    """Check a file against its manifest entry: its size, then its checksum.

    ``remove_bad``: a bad file we downloaded ourselves is removed, so that nobody loads
    it by mistake. ``shown``: the path to name in errors (``path`` is a temporary name
    of it).
    """
    where = (shown or path).parent
    try:
        size = path.stat().st_size
        if size == entry.size:
            size, checksum = hash_file(path, algorithm_of(entry.checksum))
    except FileNotFoundError:
        raise CorruptCheckpoint(
            f"checkpoint {manifest.id}: file {entry.name!r} is missing from {where}"
        ) from None
    if size != entry.size:
        if remove_bad:
            with contextlib.suppress(OSError):
                path.unlink()
        raise CorruptCheckpoint(
            f"checkpoint {manifest.id}: file {entry.name!r} has {size} bytes, the manifest "
            f"says {entry.size}"
        )
    if checksum != entry.checksum:
        if remove_bad:
            with contextlib.suppress(OSError):
                path.unlink()
        raise CorruptCheckpoint(
            f"checkpoint {manifest.id}: file {entry.name!r} does not match its checksum in "
            f"the manifest ({algorithm_of(entry.checksum)}: the stored data is damaged)"
        )
