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
store through :class:`~spotnb.ckpt.pending.PendingCheckpoint`, checksumming them as they
are written):

1. Upload the data files under a fresh ``<id>/``. Nothing points there yet, so a
   writer killed here leaves ``LATEST`` on the previous complete checkpoint.
2. Write ``MANIFEST.json`` (:mod:`spotnb.ckpt.manifest`), listing every file with its
   size and checksum (:mod:`spotnb.ckpt.checksum`: CRC-32C; manifests of older
   checkpoints have SHA-256).
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
(:mod:`spotnb.ckpt.verify`; :class:`CorruptCheckpoint` names the bad file);
:meth:`CheckpointStore.fetch` does it for one file, which is how a rank of a sharded
checkpoint reads only the files its part of the state is in
(:class:`spotnb.ckpt.dcp.StoreReader`).

Large files are never held in memory: :class:`~spotnb.ckpt.checksum.HashingWriter`
checksums while the caller writes (into a local file, or straight into the store), and
verification reads files in chunks.

The names of this protocol are importable from here: its errors
(:mod:`spotnb.ckpt.errors`), manifest (:mod:`spotnb.ckpt.manifest`), checksums of files
(:mod:`spotnb.ckpt.checksum`) and the checkpoint being written
(:mod:`spotnb.ckpt.pending`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from spotnb.ckpt.checksum import HashingWriter, copy_hashing, hash_file
from spotnb.ckpt.errors import CheckpointError, CorruptCheckpoint, FencedOff
from spotnb.ckpt.manifest import (
    CHECKPOINT_FORMATS,
    LATEST,
    MANIFEST,
    SYNC_FORMATS,
    Damaged,
    FileEntry,
    Manifest,
    check_name,
    new_id,
    parse_id,
    parse_latest,
)
from spotnb.ckpt.pending import PendingCheckpoint
from spotnb.ckpt.verify import in_parallel, verify_file, verify_size
from spotnb.protocol.store import LocalStore, NotFound, Store

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

# A reader may race a writer's pruning (LATEST moves and the old id is deleted
# between reading LATEST and its manifest): re-read LATEST this many times.
_LATEST_READ_TRIES = 3
# A file being fetched is downloaded under this prefix, then renamed into place.
_FETCH_MARK = ".fetch-"


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

    def key(self, *parts: str) -> str:
        """The store key of ``<prefix>/<parts...>``."""
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
            _, latest_etag = self.store.get_with_etag(self.key(LATEST))
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
            moved = self.store.put_if_absent(self.key(LATEST), pointer)
        else:
            moved = self.store.put_if_match(self.key(LATEST), pointer, latest_etag)
        if moved is None:
            raise FencedOff(
                f"checkpoint {cid} (step {step}) was written but not made current: "
                f"{self.key(LATEST)} was changed by another writer meanwhile (another "
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
        return [n for n in self.store.list_children(self.prefix) if parse_id(n)]

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
        complete_older = [i for i in older if self.store.exists(self.key(i, MANIFEST))]
        survivors = set(complete_older[max(0, len(complete_older) - (self.keep - 1)):]
                        if self.keep > 1 else [])
        doomed = [i for i in older if i not in survivors]
        if attempt is not None:
            for i in ids:
                parsed = parse_id(i)
                if i > current and parsed is not None and parsed[1] < attempt:
                    doomed.append(i)
        for i in doomed:
            # The manifest first: a half-deleted checkpoint must not look complete.
            self.store.delete(self.key(i, MANIFEST))
            self.store.delete_prefix(self.key(i) + "/")
        if doomed:
            log.debug("pruned %d old checkpoint(s) under %s", len(doomed), self.prefix)
        return doomed

    # -- reading ---------------------------------------------------------------------

    def _read_pointer(self) -> tuple[str, int] | None:
        """``LATEST``'s checkpoint id and step; None if there is none. Raises
        :class:`CheckpointError` if it is damaged (not the JSON this module writes, or
        an id that is not a checkpoint's: ``..`` would leave the prefix)."""
        try:
            data = self.store.get(self.key(LATEST))
        except NotFound:
            return None
        try:
            return parse_latest(data)
        except Damaged as e:
            raise CheckpointError(f"{self.key(LATEST)} is damaged ({e})") from None

    def manifest(self, checkpoint_id: str) -> Manifest:
        """The manifest of one checkpoint; :class:`spotnb.protocol.store.NotFound` if incomplete,
        :class:`CheckpointError` if damaged (or ``checkpoint_id`` is not an id)."""
        if parse_id(checkpoint_id) is None:
            raise Damaged(f"{checkpoint_id!r} is not a checkpoint id"[:200])
        raw = self.store.get(self.key(checkpoint_id, MANIFEST))
        try:
            manifest = Manifest.from_json(raw, checkpoint_id)
        except Damaged as e:
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
            f"{self.key(LATEST)} points to a checkpoint without a manifest; the store was "
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
                            "by listing, %s (step %d)", self.key(LATEST), cid, found.step)
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
        paths = in_parallel([entry.name for entry in manifest.files
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
        path = Path(directory) / check_name(name)
        if path.exists():
            try:
                if verified:
                    verify_size(manifest, entry, path)
                else:
                    verify_file(manifest, entry, path, remove_bad=False)
                return path
            except CorruptCheckpoint:
                pass  # stale or damaged: replaced below, never removed (another process
                # sharing the directory may be renaming a good copy onto it)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_FETCH_MARK}{path.name}-{secrets.token_hex(4)}")
        try:
            try:
                self.store.download_file(self.key(manifest.id, name), tmp)
            except NotFound:
                raise CorruptCheckpoint(
                    f"checkpoint {manifest.id}: file {name!r} is missing from the store"
                ) from None
            verify_file(manifest, entry, tmp, remove_bad=True, shown=path)
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
            data = self.store.get_range(self.key(manifest.id, check_name(name)), offset,
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
        return self.store.root / self.key(check_name(manifest.id))

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
            path = Path(directory) / check_name(name)
            if verified:
                verify_size(manifest, entry, path)
            else:
                verify_file(manifest, entry, path, remove_bad=False)
            return path

        return in_parallel([entry.name for entry in manifest.files], verify)
