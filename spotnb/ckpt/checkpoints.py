"""Checkpoints in the store: a reader never sees a partial one (DESIGN invariant 2).

Layout under a prefix (``checkpoints`` for :class:`spotnb.train.runtime.Checkpoint`,
``sync/<name>`` for :func:`spotnb.train.runtime.sync_dir` snapshots)::

    <prefix>/<id>/<file> ...        the data, written first
    <prefix>/<id>/MANIFEST.json     id, step, attempt, created, format, metadata, and
                                    every file with its size and checksum, written second
    <prefix>/LATEST                 {"id", "step"}: the newest complete checkpoint,
                                    written last, by compare-and-swap

An id is ``f"{step:012d}-a{attempt:04d}-{random hex}"``: ids sort by step, then attempt,
and two writers never pick the same one.

Writing a checkpoint, step by step (:meth:`CheckpointStore.write`, which is
:meth:`~CheckpointStore.upload` for steps 1-2, then :meth:`~CheckpointStore.commit`;
or :meth:`CheckpointStore.begin`, which streams the files of step 1 straight into the
store through :class:`PendingCheckpoint`, checksumming them as they are written):

1. Upload the data files under a fresh ``<id>/``. Nothing points there yet, so a
   writer killed here leaves ``LATEST`` on the previous complete checkpoint.
2. Write ``MANIFEST.json``, listing every file with its size and checksum
   (:mod:`spotnb.ckpt.checksum`: CRC-32C; manifests of older checkpoints have SHA-256).
3. Read ``LATEST`` and its ETag (absent the first time).
4. Ask the fence (``spotnb.protocol.lease.still_holds`` in the runtime): a writer that lost the
   lease stops here with :class:`FencedOff` and never moves ``LATEST``.
5. Move ``LATEST`` with ``put_if_match`` on the ETag of step 3 (``put_if_absent`` the
   first time). If someone else moved it in between, raise :class:`FencedOff` too:
   only the lease holder writes, so another writer means this one lost the lease.
6. Prune: keep ``LATEST`` and the ``keep - 1`` newest complete checkpoints below it;
   delete the rest, and leftovers of dead attempts. Deleting is best effort and
   tolerates races (a missing key is not an error).

The two halves let a writer upload one checkpoint while the previous one is still
being committed (the save forced by an interruption notice does), as long as it
commits them in order.

Reading: :meth:`CheckpointStore.latest` reads ``LATEST`` then the manifest;
:meth:`CheckpointStore.download` fetches the files and checks every size and checksum
(:class:`CorruptCheckpoint` names the bad file); :meth:`CheckpointStore.fetch` does it
for one file, which is how a rank of a sharded checkpoint reads only the files its
part of the state is in (:class:`spotnb.ckpt.dcp.StoreReader`).

Large files are never held in memory: :class:`HashingWriter` checksums while the caller
writes (into a local file, or straight into the store), and verification reads files
in chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from spotnb.ckpt.checksum import Checksum, algorithm_of
from spotnb.protocol.store import LocalStore, NotFound, ObjectWriter, Store

__all__ = [
    "CHECKPOINT_FORMATS",
    "LATEST",
    "MANIFEST",
    "SYNC_FORMATS",
    "CheckpointError",
    "CheckpointStore",
    "CorruptCheckpoint",
    "FencedOff",
    "FileEntry",
    "HashingWriter",
    "Manifest",
    "PendingCheckpoint",
    "copy_hashing",
    "hash_file",
    "new_id",
]

log = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
# 2: files carry "checksum" ("crc32c:<hex>").
MANIFEST_SCHEMA = 2

# Files are hashed and copied in chunks of this size: large enough to be fast,
# small enough never to matter for memory.
_CHUNK = 4 * 1024 * 1024
# A reader may race a writer's pruning (LATEST moves and the old id is deleted
# between reading LATEST and its manifest): re-read LATEST this many times.
_LATEST_READ_TRIES = 3
# A file being fetched is downloaded under this prefix, then renamed into place.
_FETCH_MARK = ".fetch-"
_ID_RE = re.compile(r"^(\d{12})-a(\d{4})-[0-9a-f]+$")


class CheckpointError(Exception):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file is missing, or its size or checksum differs from the manifest."""


class FencedOff(CheckpointError):
    """This writer lost the lease: ``LATEST`` was not moved."""


def new_id(step: int, attempt: int) -> str:
    """A fresh checkpoint id that sorts by step, then attempt."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, not {step}")
    return f"{step:012d}-a{attempt:04d}-{secrets.token_hex(4)}"


def _parse_id(name: str) -> tuple[int, int] | None:
    m = _ID_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _check_name(name: str) -> str:
    """A file name inside a checkpoint: a relative path without ``..`` (may have ``/``)."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid checkpoint file name {name!r}: use a relative path")
    if name == MANIFEST:
        raise ValueError(f"{MANIFEST} is reserved in a checkpoint")
    return name


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size and ``checksum`` (``"crc32c:<hex>"``; see
    :mod:`spotnb.ckpt.checksum`)."""

    name: str
    size: int
    checksum: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds. Written as ``<id>/MANIFEST.json``."""

    id: str
    step: int
    attempt: int
    created: float
    files: tuple[FileEntry, ...]
    format: str = "files"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema: int = MANIFEST_SCHEMA

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, name: str) -> FileEntry | None:
        """The file ``name`` of the checkpoint, or None if it has none of that name."""
        return next((f for f in self.files if f.name == name), None)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, checkpoint_id: str | None = None) -> Manifest:
        """The manifest in ``text``; :class:`CheckpointError` for anything that is not
        one this module wrote (see :func:`_parse_manifest`). ``checkpoint_id``: the
        directory it was read from, which its ``id`` must name."""
        return _parse_manifest(text, checkpoint_id)

    @classmethod
    def read_local(cls, directory: str | os.PathLike[str]) -> Manifest:
        """The manifest in a local copy of a checkpoint (``<dir>/MANIFEST.json``)."""
        return cls.from_json(Path(directory, MANIFEST).read_bytes())


# The formats of spotnb's readers (their CheckpointStore's ``formats``): what
# spot.Checkpoint reads ("dcp"; "pickle": a state saved where torch was not imported),
# what sync_dir reads.
CHECKPOINT_FORMATS = frozenset({"dcp", "pickle"})
SYNC_FORMATS = frozenset({"dir"})


class _Damaged(CheckpointError):
    """A manifest or ``LATEST`` that is not what this module writes."""


def _load_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested a million deep
        raise _Damaged(f"{what} is not JSON ({str(e)[:80]})") from None


def _whole(raw: Mapping[str, Any], key: str, what: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _Damaged(f"{what}: {key} must be a whole number >= 0, not {value!r}"[:200])
    return value


def _parse_manifest(text: str | bytes, checkpoint_id: str | None) -> Manifest:
    """The one reader of a manifest's shape. A manifest is untrusted input (a disk that
    filled, a hand edit, another program writing to the bucket): every field is checked
    here, once, so that code reading a :class:`Manifest` meets only what this module
    writes. In particular no file name leaves the checkpoint's directory and the id
    is the directory's own."""
    what = f"the manifest of checkpoint {checkpoint_id or '?'}"
    raw = _load_json(text, what)
    if not isinstance(raw, dict):
        raise _Damaged(f"{what} is not a JSON object but {type(raw).__name__}")
    schema = raw.get("schema", MANIFEST_SCHEMA)
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise _Damaged(f"{what}: schema must be a whole number, not {schema!r}"[:200])
    if schema > MANIFEST_SCHEMA:
        raise CheckpointError(
            f"checkpoint {raw.get('id')} was written by a newer spotnb (manifest schema "
            f"{schema}); upgrade spotnb: pip install -U spotnb"
        )
    cid = raw.get("id")
    if not isinstance(cid, str) or _parse_id(cid) is None:
        raise _Damaged(f"{what}: its id {cid!r} is not a checkpoint id"[:200])
    if checkpoint_id is not None and cid != checkpoint_id:
        raise _Damaged(f"{what} names another checkpoint ({cid})")
    created = raw.get("created")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or \
            not math.isfinite(created):
        raise _Damaged(f"{what}: created must be a time, not {created!r}"[:200])
    files = raw.get("files")
    if not isinstance(files, list):
        raise _Damaged(f"{what}: files must be a list, not {type(files).__name__}")
    entries = tuple(_file_entry(f, what) for f in files)
    if len({e.name for e in entries}) != len(entries):
        raise _Damaged(f"{what} lists a file twice")
    fmt = raw.get("format", "files")
    if not isinstance(fmt, str) or not fmt.isprintable() or len(fmt) > 64:
        raise _Damaged(f"{what}: format must be a name, not {fmt!r}"[:200])
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise _Damaged(f"{what}: metadata must be a JSON object, not "
                       f"{type(metadata).__name__}")
    ranks = metadata.get("ranks")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int)
                              or ranks < 1):
        raise _Damaged(f"{what}: metadata.ranks must be a world size, not {ranks!r}"[:200])
    return Manifest(id=cid, step=_whole(raw, "step", what),
                    attempt=_whole(raw, "attempt", what), created=float(created),
                    files=entries, format=fmt, metadata=metadata, schema=schema)


def _file_entry(raw: Any, what: str) -> FileEntry:
    """A file of a manifest: its name, size and ``checksum``."""
    if not isinstance(raw, dict):
        raise _Damaged(f"{what}: a file entry is {type(raw).__name__}, not an object")
    name = raw.get("name")
    try:
        _check_name(name if isinstance(name, str) else "")
    except ValueError:
        raise _Damaged(f"{what}: file name {name!r} is not a path inside the "
                       "checkpoint"[:200]) from None
    checksum = raw.get("checksum")
    try:
        algorithm_of(checksum if isinstance(checksum, str) else "")
    except ValueError as e:  # a checksum this spotnb does not know
        raise _Damaged(f"{what}: file {name!r}: {e}"[:300]) from None
    assert isinstance(name, str) and isinstance(checksum, str)
    return FileEntry(name, _whole(raw, "size", f"{what}: file {name!r}"), checksum)


class HashingWriter:
    """A binary file object that checksums and counts what is written through it.

    ``torch.save`` and ``pickle.dump`` write into it directly, so a large checkpoint is
    checksummed while it is serialised, not read back afterwards. ``raw`` is a local
    file or a store's :class:`~spotnb.protocol.store.ObjectWriter`. The checksum is a running
    CRC-32C (:mod:`spotnb.ckpt.checksum`).
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

    def __init__(self, cs: CheckpointStore, checkpoint_id: str, step: int,
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
        return self.cs._key(self.id, _check_name(name))

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
        _check_name(entry.name)
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
        self.store.put(self.cs._key(self.id, MANIFEST), manifest.to_json().encode())
        return manifest


class CheckpointStore:
    """Writes and reads checkpoints under ``prefix`` of a store. See the module docstring.

    ``keep`` is how many complete checkpoints survive pruning (at least 1: the one
    ``LATEST`` points to). ``formats``: the manifest formats its reader reads (None:
    any); a checkpoint of another format is skipped like a damaged one.
    """

    def __init__(self, store: Store, prefix: str = "checkpoints", keep: int = 3,
                 formats: Collection[str] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, not {keep}")
        self.store = store
        self.prefix = prefix.strip("/")
        self.keep = keep
        self.formats = None if formats is None else frozenset(formats)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.store!r}, prefix={self.prefix!r}, keep={self.keep})"

    def _key(self, *parts: str) -> str:
        return "/".join((self.prefix, *parts)) if self.prefix else "/".join(parts)

    # -- writing ---------------------------------------------------------------------

    def write(
        self,
        step: int,
        files: Mapping[str, str | os.PathLike[str]],
        *,
        attempt: int = 0,
        fence: Callable[[], bool] | None = None,
        fmt: str = "files",
        metadata: Mapping[str, Any] | None = None,
        digests: Mapping[str, tuple[int, str]] | None = None,
        checkpoint_id: str | None = None,
    ) -> Manifest:
        """Write a checkpoint of local ``files`` ({name in the checkpoint: path}).

        :meth:`upload` then :meth:`commit`; see them. Returns the manifest of the new
        ``LATEST``.
        """
        manifest = self.upload(step, files, attempt=attempt, fmt=fmt, metadata=metadata,
                               digests=digests, checkpoint_id=checkpoint_id)
        return self.commit(manifest, fence=fence)

    def upload(
        self,
        step: int,
        files: Mapping[str, str | os.PathLike[str]],
        *,
        attempt: int = 0,
        fmt: str = "files",
        metadata: Mapping[str, Any] | None = None,
        digests: Mapping[str, tuple[int, str]] | None = None,
        checkpoint_id: str | None = None,
    ) -> Manifest:
        """Steps 1-2: the data files, then the manifest; ``LATEST`` does not move.

        ``digests`` gives ``(size, checksum)`` of files the caller already hashed (with
        :class:`HashingWriter`); the others are hashed here, in chunks.
        """
        pending = self.begin(step, attempt=attempt, checkpoint_id=checkpoint_id)
        digests = digests or {}
        # Step 1: the data. Nothing points at <id>/ yet.
        for name, path in files.items():
            pending.add_file(name, path, digests.get(name))
        # Step 2: the manifest makes <id>/ complete (but not yet current).
        return pending.finish(fmt, metadata)

    def begin(self, step: int, *, attempt: int = 0, checkpoint_id: str | None = None
              ) -> PendingCheckpoint:
        """Start a checkpoint whose files are streamed in (steps 1-2; see
        :class:`PendingCheckpoint`), then :meth:`commit` its manifest."""
        return PendingCheckpoint(self, checkpoint_id or new_id(step, attempt), step, attempt)

    def commit(self, manifest: Manifest, fence: Callable[[], bool] | None = None,
               prune: bool = True) -> Manifest:
        """Steps 3-6: make an uploaded checkpoint current, then prune.

        ``fence`` is asked just before ``LATEST`` moves; if it returns False,
        :class:`FencedOff` is raised and ``LATEST`` stays. ``prune=False`` leaves step 6
        to the caller (:meth:`prune_quietly`), e.g. after it has reported the
        checkpoint durable: deleting old checkpoints is no part of making one durable.
        """
        cid, step = manifest.id, manifest.step
        # Step 3: the ETag we will compare-and-swap against.
        try:
            _, latest_etag = self.store.get_with_etag(self._key(LATEST))
        except NotFound:
            latest_etag = None

        # Step 4: fencing. A writer that lost the lease must not move LATEST.
        if fence is not None and not fence():
            raise FencedOff(
                f"checkpoint {cid} (step {step}) was written but not made current: this "
                "agent lost the job's lease to another one, which carries on with the job"
            )

        # Step 5: move LATEST by compare-and-swap.
        pointer = json.dumps({"id": cid, "step": step}).encode()
        if latest_etag is None:
            moved = self.store.put_if_absent(self._key(LATEST), pointer)
        else:
            moved = self.store.put_if_match(self._key(LATEST), pointer, latest_etag)
        if moved is None:
            raise FencedOff(
                f"checkpoint {cid} (step {step}) was written but not made current: "
                f"{self._key(LATEST)} was changed by another writer meanwhile (another "
                "agent holds the job's lease)"
            )
        log.debug("checkpoint %s/%s is current (step %d)", self.prefix, cid, step)

        # Step 6: prune, best effort.
        if prune:
            self.prune_quietly(manifest)
        return manifest

    def prune_quietly(self, current: Manifest) -> None:
        """Step 6 after committing ``current``: :meth:`prune`, logging a failure."""
        try:
            self.prune(current=current.id, attempt=current.attempt)
        except Exception:
            log.warning("pruning old checkpoints under %s failed; will retry next time",
                        self.prefix, exc_info=True)

    def ids(self) -> list[str]:
        """Ids of every checkpoint directory, complete or not, in sort order."""
        return [n for n in self.store.list_children(self.prefix) if _parse_id(n)]

    def prune(self, current: str | None = None, attempt: int | None = None) -> list[str]:
        """Delete what ``keep`` no longer covers; return the deleted ids.

        Kept: the checkpoint ``LATEST`` points to (``current``, read if not given) and
        the ``keep - 1`` newest complete checkpoints that sort below it. Deleted: other
        ids below it, and ids above it written by an attempt older than ``attempt``
        (left by a dead writer). Ids above it from this or a newer attempt may be in
        progress and are left alone.
        """
        if current is None:
            pointer = self._read_pointer()
            if pointer is None:
                return []
            current = pointer[0]
        ids = self.ids()
        older = [i for i in ids if i < current]
        complete_older = [i for i in older if self.store.exists(self._key(i, MANIFEST))]
        survivors = set(complete_older[max(0, len(complete_older) - (self.keep - 1)):]
                        if self.keep > 1 else [])
        doomed = [i for i in older if i not in survivors]
        if attempt is not None:
            for i in ids:
                parsed = _parse_id(i)
                if i > current and parsed is not None and parsed[1] < attempt:
                    doomed.append(i)
        for i in doomed:
            # The manifest first: a half-deleted checkpoint must not look complete.
            self.store.delete(self._key(i, MANIFEST))
            self.store.delete_prefix(self._key(i) + "/")
        if doomed:
            log.debug("pruned %d old checkpoint(s) under %s", len(doomed), self.prefix)
        return doomed

    # -- reading ---------------------------------------------------------------------

    def _read_pointer(self) -> tuple[str, int] | None:
        """``LATEST``'s checkpoint id and step; None if there is none. Raises
        :class:`CheckpointError` if it is damaged (not the JSON this module writes, or
        an id that is not a checkpoint's: ``..`` would leave the prefix)."""
        try:
            data = self.store.get(self._key(LATEST))
        except NotFound:
            return None
        what = self._key(LATEST)
        try:
            raw = _load_json(data, "it")
            if not isinstance(raw, dict):
                raise _Damaged("not a JSON object")
            cid = raw.get("id")
            if not isinstance(cid, str) or _parse_id(cid) is None:
                raise _Damaged(f"its id {cid!r} is not a checkpoint id"[:200])
            return cid, _whole(raw, "step", "its")
        except _Damaged as e:
            raise CheckpointError(f"{what} is damaged ({e})") from None

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The manifest of one checkpoint; :class:`spotnb.protocol.store.NotFound` if incomplete,
        :class:`CheckpointError` if damaged (or ``checkpoint_id`` is not an id)."""
        if _parse_id(checkpoint_id) is None:
            raise _Damaged(f"{checkpoint_id!r} is not a checkpoint id"[:200])
        raw = self.store.get(self._key(checkpoint_id, MANIFEST))
        try:
            manifest = Manifest.from_json(raw, checkpoint_id)
        except _Damaged as e:
            raise CheckpointError(f"{e}: the manifest is damaged") from None
        if self.formats is not None and manifest.format not in self.formats:
            raise CheckpointError(
                f"checkpoint {checkpoint_id} is in format {manifest.format!r}, which its "
                f"reader does not read ({', '.join(sorted(self.formats))}): the manifest "
                "is damaged, or was written by a newer spotnb (pip install -U spotnb)")
        return manifest

    def latest(self) -> Manifest | None:
        """The newest complete checkpoint, or None if there is none yet.

        A damaged or missing ``LATEST`` or a damaged newest manifest does not hide the
        intact checkpoints below it: the newest intact one is used, and the damage is
        logged.
        """
        return next(self.manifests(), None)

    def _pointed(self) -> Manifest | None:
        """The manifest ``LATEST`` points to (None without ``LATEST``)."""
        for _ in range(_LATEST_READ_TRIES):
            pointer = self._read_pointer()
            if pointer is None:
                return None
            try:
                return self.manifest(pointer[0])
            except NotFound:
                # Pruned between our two reads: LATEST has moved on; read it again.
                continue
        raise CheckpointError(
            f"{self._key(LATEST)} points to a checkpoint without a manifest; the store was "
            "changed by hand or another writer is racing"
        )

    def manifests(self) -> Iterator[Manifest]:
        """Complete checkpoints, newest first: ``LATEST``'s, then the older survivors.

        Lazy: a reader that is happy with the first one reads nothing more. A restore
        falls back along it when a checkpoint turns out to be damaged; a damaged
        ``LATEST`` or manifest is skipped here with a warning, for the next intact one.
        Without ``LATEST`` (deleted, or lost with a disk) the checkpoints are found by
        listing: the newest complete one first.
        """
        try:
            newest = self._pointed()
        except CheckpointError as e:
            log.error("%s; falling back to the newest intact checkpoint before it", e)
            newest, below, missing = None, None, False
        else:
            below = newest.id if newest is not None else None
            missing = newest is None
            if newest is not None:
                yield newest
        for cid in reversed(self.ids()):
            if below is not None and cid >= below:
                continue
            try:
                found = self.manifest(cid)
            except NotFound:
                continue  # incomplete, or pruned meanwhile
            except CheckpointError as e:
                log.error("%s; trying the checkpoint before it", e)
                continue
            if missing:
                missing = False  # said once
                log.warning("%s is missing; using the newest complete checkpoint found "
                            "by listing, %s (step %d)", self._key(LATEST), cid, found.step)
            yield found

    def download(self, manifest: Manifest, dest_dir: str | os.PathLike[str],
                 names: Iterable[str] | None = None) -> dict[str, Path]:
        """Download a checkpoint's files into ``dest_dir`` and verify them.

        ``names``: only these files (e.g. a node's share of a sharded checkpoint);
        default every file. Files already there that verify are not downloaded again
        (:meth:`fetch`). Returns {name: local path}; also writes ``MANIFEST.json``
        there. Raises :class:`CorruptCheckpoint` naming the first file that is missing
        or differs.
        """
        dest = Path(dest_dir)
        dest.mkdir(parents=True, exist_ok=True)
        # MANIFEST.json says the files beside it were verified against it (a download
        # wrote it last): those the new manifest lists the same (name, size, checksum)
        # are not read again. None while the files change (a refresh that fails
        # half-way leaves none).
        same: set[str] = set()
        with contextlib.suppress(OSError, ValueError, KeyError, CheckpointError):
            before = Manifest.read_local(dest)
            same = {e.name for e in manifest.files if before.entry(e.name) == e}
        with contextlib.suppress(FileNotFoundError):
            (dest / MANIFEST).unlink()
        wanted = None if names is None else set(names)
        paths = _in_parallel([entry.name for entry in manifest.files
                              if wanted is None or entry.name in wanted],
                             lambda name: self.fetch(manifest, name, dest,
                                                     verified=name in same))
        (dest / MANIFEST).write_text(manifest.to_json())
        return paths

    def fetch(self, manifest: Manifest, name: str, directory: str | os.PathLike[str],
              *, verified: bool = False) -> Path:
        """One file of a checkpoint, verified, in ``directory``; its local path.

        A copy already there that matches the manifest is used as it is (no request;
        ``verified``: it was verified against this file's entry before, so only its
        size is checked);
        otherwise the file is downloaded under a temporary name, verified, and renamed
        into place, so that processes sharing ``directory`` (the ranks of one node) may
        fetch the same file at once and never see a partial or unverified one. Raises
        :class:`CorruptCheckpoint` if the manifest does not list it, the store lacks
        it, or the downloaded bytes differ from the manifest (the bad copy is removed).
        """
        entry = manifest.entry(name)
        if entry is None:
            raise CorruptCheckpoint(f"checkpoint {manifest.id}: its manifest does not list "
                                    f"{name!r}, which its metadata refers to")
        path = Path(directory) / _check_name(name)
        if path.exists():
            try:
                if verified:
                    _verify_size(manifest, entry, path)
                else:
                    _verify(manifest, entry, path, remove_bad=False)
                return path
            except CorruptCheckpoint:
                pass  # stale or damaged: replaced below, never removed (another process
                # sharing the directory may be renaming a good copy onto it)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_FETCH_MARK}{path.name}-{secrets.token_hex(4)}")
        try:
            try:
                self.store.download_file(self._key(manifest.id, name), tmp)
            except NotFound:
                raise CorruptCheckpoint(
                    f"checkpoint {manifest.id}: file {name!r} is missing from the store"
                ) from None
            _verify(manifest, entry, tmp, remove_bad=True, shown=path)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return path

    def read_range(self, manifest: Manifest, name: str, offset: int, length: int) -> bytes:
        """``length`` bytes of file ``name`` of a checkpoint from ``offset`` (one ranged
        request), not verified: the caller must know the whole file is verified by
        someone (see :class:`spotnb.ckpt.dcp.StoreReader`). Raises
        :class:`CorruptCheckpoint` if the file is missing or shorter than that."""
        entry = manifest.entry(name)
        if entry is None or offset + length > entry.size:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.id}: {name!r} has no bytes {offset}-{offset + length} "
                "in its manifest, which its metadata refers to")
        try:
            data = self.store.get_range(self._key(manifest.id, _check_name(name)), offset,
                                        length)
        except NotFound:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.id}: file {name!r} is missing from the store"
            ) from None
        if len(data) != length:
            raise CorruptCheckpoint(
                f"checkpoint {manifest.id}: file {name!r} ends before byte "
                f"{offset + length} (the manifest says {entry.size} bytes)")
        return data

    def local_dir(self, manifest: Manifest) -> Path | None:
        """Where a checkpoint's files lie in a local store (read them there, verified:
        no copy), or None for a store elsewhere."""
        if not isinstance(self.store, LocalStore):
            return None
        return self.store.root / self._key(_check_name(manifest.id))

    def verify_local(
        self, manifest: Manifest, directory: str | os.PathLike[str], *,
        downloaded: bool = False,
    ) -> dict[str, Path]:
        """Check a local copy of a checkpoint (e.g. one an agent prefetched).

        ``downloaded``: the copy is one :meth:`download` made (an agent's prefetch): if
        it made it whole for this manifest (its ``MANIFEST.json`` is this manifest,
        written once every file beside it was verified), its files' sizes are checked,
        not their checksums: reading it all again would cost a restore a second pass
        over the state. Returns {name: local path}; raises :class:`CorruptCheckpoint`
        like :meth:`download`.
        """
        verified = False
        if downloaded:
            with contextlib.suppress(OSError, UnicodeDecodeError):
                verified = (Path(directory) / MANIFEST).read_text() == manifest.to_json()

        def verify(name: str) -> Path:
            entry = manifest.entry(name)
            assert entry is not None
            path = Path(directory) / _check_name(name)
            if verified:
                _verify_size(manifest, entry, path)
            else:
                _verify(manifest, entry, path, remove_bad=False)
            return path

        return _in_parallel([entry.name for entry in manifest.files], verify)


#: A checkpoint's files are downloaded (and checksummed) this many at a time: as many
#: as a rank writes at once (``spotnb.ckpt.MAX_FILES``), so that a restore reads the
#: store and checksums as fast as the save wrote.
FILE_THREADS = 4


def _in_parallel(names: list[str], fn: Callable[[str], Path]) -> dict[str, Path]:
    """``{name: fn(name)}``, FILE_THREADS at a time; the first failure in ``names``'
    order is raised, once every call has ended."""
    if len(names) <= 1:
        return {name: fn(name) for name in names}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(FILE_THREADS, len(names)),
                            thread_name_prefix="spotnb-fetch") as pool:
        futures = [pool.submit(fn, name) for name in names]
    return {name: future.result() for name, future in zip(names, futures, strict=True)}


def _verify_size(manifest: Manifest, entry: FileEntry, path: Path) -> None:
    """Check a file verified before: present, of the manifest's size."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptCheckpoint(f"checkpoint {manifest.id}: file {entry.name!r} is missing "
                                f"from {path.parent}") from None
    if size != entry.size:
        raise CorruptCheckpoint(f"checkpoint {manifest.id}: file {entry.name!r} has {size} "
                                f"bytes, the manifest says {entry.size}")


def _verify(manifest: Manifest, entry: FileEntry, path: Path, remove_bad: bool,
            shown: Path | None = None) -> None:
    # A bad file we downloaded ourselves is removed so that nobody loads it by mistake.
    # The size first (no read), then the checksum with the algorithm the manifest names.
    # ``shown``: the path to name in errors (``path`` is a temporary name of it).
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
