"""Directories the user writes their own checkpoint files to (``spot.sync_dir``).

A :class:`SyncDir` keeps a directory in the job's store under ``sync/<name>`` with the
checkpoint protocol of :mod:`spotnb.checkpoints` (files, then manifest, then
``LATEST``): a resume never sees half a directory. Each upload is a complete
snapshot; nothing is uploaded when no file changed (same names, sizes and mtimes).
Files are copied to scratch space while hashed, then uploaded, so a file rewritten
during an upload cannot disagree with its manifest.

Sequence over a job's life::

    sync_dir(path) -> restore the latest snapshot into path -> periodic thread:
    every N s (or at once on a notice) upload if changed -> finish(): last upload
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from spotnb import layout
from spotnb.checkpoints import CheckpointStore, FencedOff, Manifest, copy_hashing
from spotnb.store import _check_key, retrying

if TYPE_CHECKING:
    from spotnb.session import Session

__all__ = ["SyncDir", "sync_name"]

_logger = logging.getLogger(__name__)
# How long finish() waits for a periodic upload in progress before the last one.
_JOIN_SECONDS = 600.0


def sync_name(path: str | os.PathLike[str]) -> str:
    """A store-safe name for a directory, from the path as written (stable per job)."""
    norm = os.path.normpath(os.fspath(path))
    slug = re.sub(r"[^A-Za-z0-9_-]+", "_", norm).strip("_-")[-48:] or "dir"
    return f"{slug}-{hashlib.sha256(norm.encode()).hexdigest()[:8]}"


def _storable(rel: str) -> bool:
    try:
        _check_key(f"x/{rel}")
    except ValueError:
        return False
    return True


class SyncDir:
    """A directory kept in the job's store (see :func:`spotnb.runtime.sync_dir`)."""

    # Data files sit under this folder of a snapshot, so no user file can collide with
    # the snapshot's MANIFEST.json.
    _FILES = "files/"

    def __init__(self, rt: Session, path: str | os.PathLike[str], every: float) -> None:
        self.rt = rt
        self.path = Path(path)
        self.name = sync_name(path)
        self.every = every
        self._store = CheckpointStore(rt.store, f"{layout.SYNC}/{self.name}", keep=rt.keep)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seq = 0
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"SyncDir({str(self.path)!r}, name={self.name!r}, every={self.every:g}s)"

    def _scan(self) -> list[tuple[str, Path, os.stat_result]]:
        found = []
        for dirpath, _dirs, names in os.walk(self.path):
            for name in names:
                full = Path(dirpath, name)
                rel = full.relative_to(self.path).as_posix()
                try:
                    st = full.stat()
                except FileNotFoundError:
                    continue
                if not _storable(rel):
                    _logger.debug("sync_dir: skipping %s (a temporary name)", full)
                    continue
                found.append((rel, full, st))
        found.sort()
        return found

    def restore(self) -> Manifest | None:
        """Put the latest snapshot's files into the directory (others are left alone)."""
        self.path.mkdir(parents=True, exist_ok=True)
        manifest = self._store.latest()
        if manifest is None:
            return None
        stage = self.rt.scratch / f"sync-{self.name}-{uuid.uuid4().hex[:8]}"
        try:
            files = self._store.download(manifest, stage)
            for name, src in files.items():
                dest = self.path / name[len(self._FILES):]
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(src, dest)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        self._seq = manifest.step + 1
        self._signature = self._sig(self._scan())
        self.rt.send({"op": "sync", "name": self.name, "phase": "restored",
                      "files": len(manifest.files), "bytes": manifest.total_bytes})
        _logger.info("restored %d file(s) into %s from snapshot %s", len(manifest.files),
                     self.path, manifest.id)
        return manifest

    @staticmethod
    def _sig(files: Iterable[tuple[str, Path, os.stat_result]]) -> tuple[
            tuple[str, int, int], ...]:
        return tuple((rel, st.st_size, st.st_mtime_ns) for rel, _p, st in files)

    def sync(self) -> Manifest | None:
        """Upload a snapshot now if anything changed; its manifest, or None if unchanged.

        Files are copied to scratch space (hashing as they are copied) before the
        upload, so a file rewritten meanwhile cannot disagree with the manifest.
        """
        with self._lock:
            files = self._scan()
            signature = self._sig(files)
            if signature == self._signature:
                return None
            stage = self.rt.scratch / f"sync-up-{self.name}-{uuid.uuid4().hex[:8]}"
            try:
                staged: dict[str, Path] = {}
                digests: dict[str, tuple[int, str]] = {}
                for rel, full, _st in files:
                    key = self._FILES + rel
                    dest = stage / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    try:
                        digests[key] = copy_hashing(full, dest)
                    except FileNotFoundError:
                        continue  # deleted since the scan
                    staged[key] = dest
                manifest = retrying(lambda: self._store.write(
                    self._seq, staged, attempt=self.rt.attempt, fence=self.rt.fence,
                    fmt="dir", digests=digests, metadata={"path": str(self.path)},
                ), f"uploading {self.path}")
            except FencedOff:
                self.rt.fenced = True
                raise
            finally:
                shutil.rmtree(stage, ignore_errors=True)
            self._seq += 1
            self._signature = signature
        self.rt.send({"op": "sync", "name": self.name, "phase": "durable",
                      "files": len(manifest.files), "bytes": manifest.total_bytes})
        return manifest

    def sync_quietly(self) -> BaseException | None:
        """:meth:`sync`, logging a failure instead of raising it (returned instead)."""
        try:
            self.sync()
        except Exception as e:
            _logger.exception("uploading %s failed; the next upload retries", self.path)
            return e
        return None

    def wake(self) -> None:
        """Upload now (on a notice)."""
        self._wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"spotnb-sync-{self.name}",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.every)
            self._wake.clear()
            if self._stop.is_set():
                return
            self.sync_quietly()

    def stop(self) -> None:
        """Stop the periodic uploads (a parked cell: the lease is about to go)."""
        self._stop.set()
        self._wake.set()

    def close(self) -> BaseException | None:
        """Stop the periodic uploads and upload one last time; the error, if it failed."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=_JOIN_SECONDS)
        if self.rt.fenced:
            return FencedOff(f"{self.path} was not uploaded: this agent lost the job's lease")
        return self.sync_quietly()
