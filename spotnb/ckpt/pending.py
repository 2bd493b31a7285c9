"""A checkpoint being written: its files streamed into the store, then its manifest.

Steps 1-2 of :mod:`spotnb.ckpt.checkpoints`' protocol: the files go under a fresh
``<prefix>/<id>/`` (nothing points there yet), each checksummed as it is written
(:class:`~spotnb.ckpt.checksum.HashingWriter`), then :meth:`PendingCheckpoint.finish`
writes the manifest that lists them all. Making it current (``LATEST``) is the
:class:`~spotnb.ckpt.checkpoints.CheckpointStore`'s.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Protocol

from spotnb.ckpt.checksum import Checksum, HashingWriter, hash_file
from spotnb.ckpt.manifest import MANIFEST, FileEntry, Manifest, check_name
from spotnb.protocol.store import ObjectWriter, Store

__all__ = ["CheckpointHome", "PendingCheckpoint"]


class CheckpointHome(Protocol):
    """Where checkpoints live: what a :class:`PendingCheckpoint` needs of its
    :class:`~spotnb.ckpt.checkpoints.CheckpointStore`."""

    @property
    def store(self) -> Store: ...

    @property
    def prefix(self) -> str: ...

    def key(self, *parts: str) -> str:
        """The store key of ``<prefix>/<parts...>``."""
        ...


class _StreamedFile(HashingWriter):
    """One file of a :class:`PendingCheckpoint`, streamed into the store and hashed."""

    def __init__(self, pending: PendingCheckpoint, name: str, raw: ObjectWriter) -> None:
        super().__init__(raw)
        self.name = name
        self._pending = pending
        self._object = raw

    def close(self) -> None:
        """The file is complete: make it durable in the store and list it."""
        self._object.close()
        self._pending.add_entry(FileEntry(self.name, self.size, self.checksum))

    def abort(self) -> None:
        self._object.abort()

    def __enter__(self) -> _StreamedFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class PendingCheckpoint:
    """A checkpoint being written: steps 1-2 of the module docstring.

    Files go straight into the store under ``<prefix>/<id>/`` (:meth:`open` streams
    one, hashing it on the way; :meth:`put_bytes` and :meth:`add_file` for small and
    local ones), from any number of threads; :meth:`finish` writes the manifest that
    lists them all. Files written by other processes into the same id (the ranks of a
    multi-node checkpoint) are listed with :meth:`add_entry`.
    """

    def __init__(self, cs: CheckpointHome, checkpoint_id: str, step: int,
                 attempt: int) -> None:
        self.cs = cs
        self.id = checkpoint_id
        self.step = step
        self.attempt = attempt
        self._entries: dict[str, FileEntry] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"PendingCheckpoint({self.cs.prefix}/{self.id}, {len(self._entries)} files)"

    @property
    def store(self) -> Store:
        return self.cs.store

    @property
    def entries(self) -> tuple[FileEntry, ...]:
        with self._lock:
            return tuple(self._entries[name] for name in sorted(self._entries))

    def open(self, name: str, *, parts_in_flight: int | None = None) -> _StreamedFile:
        """Stream file ``name`` into the store: ``with pending.open("x") as f: ...``.

        Closing it makes it durable and lists it; an exception in the block drops it.
        ``parts_in_flight``: see :meth:`spotnb.protocol.store.Store.open_writer`.
        """
        return _StreamedFile(self, name, self.store.open_writer(
            self.key(name), parts_in_flight=parts_in_flight))

    def key(self, name: str) -> str:
        """The store key of file ``name`` of this checkpoint."""
        return self.cs.key(self.id, check_name(name))

    def put_bytes(self, name: str, data: bytes) -> FileEntry:
        """Write a small file whole."""
        self.store.put(self.key(name), data)
        checksum = Checksum()
        checksum.update(data)
        entry = FileEntry(name, len(data), checksum.value)
        self.add_entry(entry)
        return entry

    def add_file(self, name: str, path: str | os.PathLike[str],
                 digest: tuple[int, str] | None = None) -> FileEntry:
        """Upload a local file; ``digest`` is its ``(size, checksum)`` if already known."""
        size, checksum = digest if digest is not None else hash_file(path)
        self.store.upload_file(self.key(name), path)
        entry = FileEntry(name, size, checksum)
        self.add_entry(entry)
        return entry

    def add_entry(self, entry: FileEntry) -> None:
        """List a file that is already durable in the store under this id."""
        check_name(entry.name)
        with self._lock:
            self._entries[entry.name] = entry

    def finish(self, fmt: str = "files", metadata: Mapping[str, Any] | None = None
               ) -> Manifest:
        """Step 2: the manifest makes ``<id>/`` complete (but not yet current)."""
        manifest = Manifest(
            id=self.id,
            step=self.step,
            attempt=self.attempt,
            created=time.time(),
            files=self.entries,
            format=fmt,
            metadata=dict(metadata or {}),
        )
        self.store.put(self.cs.key(self.id, MANIFEST), manifest.to_json().encode())
        return manifest
