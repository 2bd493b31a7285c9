"""Directories the user writes their own checkpoint files to (``spot.sync_dir``).

A :class:`SyncDir` keeps a directory in the job's store under ``sync/<name>`` with the
checkpoint protocol of :mod:`spotnb.ckpt.checkpoints` (files, then manifest, then
``LATEST``): a resume never sees half a directory. Each upload is a complete
snapshot; nothing is uploaded when no file changed (same names, sizes and mtimes).
Files are copied to scratch space while hashed, then uploaded, so a file rewritten
during an upload cannot disagree with its manifest.

Sequence over a job's life::

    sync_dir(path) -> restore the latest snapshot into path -> periodic thread:
    every N s (or at once on a notice) upload if changed -> finish(): last upload

A directory a framework writes its checkpoints to (``every=None``; the integrations of
:mod:`spotnb.train.integrations` set it up) is uploaded at the framework's save points only,
never by a timer, so a snapshot never catches a checkpoint half-written::

    framework wrote checkpoint N -> save(N): copy to scratch now (the only pause),
        upload in the background (the next save waits for it)
    notice pending -> the framework saves at the next step -> save(N): upload
        alongside any upload in flight, commit after it, wait until durable
        -> Session.park (the cell is held; the agent gives the lease up)

``select`` narrows what a snapshot holds: :func:`newest_checkpoint_only` keeps one
checkpoint folder of a directory that holds many (Hugging Face's ``checkpoint-N``),
so each upload, and the last one before termination above all, carries one
checkpoint, not every one the framework keeps.

Each snapshot also carries what the job's event log had not confirmed when it was
taken (:class:`spotnb.train.carry.Carry`: metric rows, output lines), beside its files;
restoring it has the agent record what the saving attempt's log lacks (DESIGN
invariant 8), as a restored ``spot.Checkpoint`` does.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from spotnb.ckpt.checkpoints import (
    SYNC_FORMATS,
    CheckpointStore,
    FencedOff,
    Manifest,
    copy_hashing,
)
from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.protocol.store import _check_key, retrying
from spotnb.train.carry import Carry

if TYPE_CHECKING:
    from spotnb.train.session import Session

__all__ = ["CHECKPOINT_NAME", "SyncDir", "find_checkpoints", "newest_checkpoint_only",
           "sync_name"]

_logger = logging.getLogger(__name__)
# How long finish() waits for a periodic upload in progress before the last one.
_JOIN_SECONDS = 600.0
# While save() waits for the previous upload, how often it looks for a termination
# notice (which ends the wait: the last upload must fit in the notice period).
_PARK_CHECK_SECONDS = 0.02

#: The names frameworks give their checkpoints: Hugging Face's ``checkpoint-500``,
#: Accelerate's ``checkpoint_3`` (automatic naming), spotnb's Accelerate helper's
#: ``step_500``; a folder or a file (``checkpoint-500.pt``). The number orders them.
CHECKPOINT_NAME = re.compile(r"^(?:checkpoint|step)[-_](\d+)(?:\.[A-Za-z0-9]+)?$")
# Where a framework keeps its numbered checkpoints, relative to the synced directory:
# the directory itself, or Accelerate's project_dir/checkpoints.
_CHECKPOINT_PARENTS = ("", "checkpoints")

#: Which of a directory's files a snapshot holds: given every relative path
#: (``a/b.bin``), the ones to keep.
Select = Callable[[list[str]], Iterable[str]]


def find_checkpoints(path: str | os.PathLike[str]) -> list[Path]:
    """The numbered checkpoints (:data:`CHECKPOINT_NAME`) in ``path`` or its
    ``checkpoints/`` folder, oldest first."""
    found: list[tuple[int, str, Path]] = []
    for parent in _CHECKPOINT_PARENTS:
        base = Path(path, parent)
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            match = CHECKPOINT_NAME.match(entry.name)
            if match:
                found.append((int(match.group(1)), parent, Path(entry.path)))
    return [p for _n, _parent, p in sorted(found)]


def newest_checkpoint_only(keep: Callable[[], Iterable[str]] | None = None) -> Select:
    """A ``select`` that drops every numbered checkpoint but the newest (and the
    top-level names ``keep()`` returns when it runs, e.g. the best checkpoint's).

    Other files (logs, a final model saved next to the checkpoints) are all kept.
    """

    def select(rels: list[str]) -> list[str]:
        numbered: dict[str, int] = {}
        for rel in rels:
            parts = rel.split("/")
            for depth in range(min(2, len(parts))):
                if "/".join(parts[:depth]) not in _CHECKPOINT_PARENTS:
                    break
                match = CHECKPOINT_NAME.match(parts[depth])
                if match:
                    numbered["/".join(parts[:depth + 1])] = int(match.group(1))
                    break
        kept = set(keep() if keep is not None else ())
        if numbered:
            kept.add(max(numbered, key=lambda name: numbered[name]))
        return [rel for rel in rels
                if not (top := _numbered_top(rel, numbered)) or top in kept
                or os.path.basename(top) in kept]

    return select


def _numbered_top(rel: str, numbered: dict[str, int]) -> str | None:
    """The numbered checkpoint ``rel`` lies in (or is), if any."""
    for name in numbered:
        if rel == name or rel.startswith(name + "/"):
            return name
    return None


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
    """A directory kept in the job's store (see :func:`spotnb.train.runtime.sync_dir`)."""

    # Data files sit under this folder of a snapshot, so no user file can collide with
    # the snapshot's MANIFEST.json.
    _FILES = "files/"

    def __init__(self, rt: Session, path: str | os.PathLike[str], every: float | None,
                 select: Select | None = None) -> None:
        self.rt = rt
        self.path = Path(path)
        self.name = sync_name(path)
        #: Seconds between periodic uploads; None: uploaded by :meth:`save` only.
        self.every = every
        #: Which files a snapshot holds (None: all).
        self.select = select
        self._store = CheckpointStore(rt.store, f"{layout.SYNC}/{self.name}", keep=rt.keep,
                                      formats=SYNC_FORMATS)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._seq = 0
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._thread: threading.Thread | None = None
        self._upload: _DirUpload | None = None

    def __repr__(self) -> str:
        every = "at saves" if self.every is None else f"{self.every:g}s"
        return f"SyncDir({str(self.path)!r}, name={self.name!r}, every={every})"

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
        if self.select is not None:
            wanted = set(self.select([rel for rel, _f, _st in found]))
            found = [f for f in found if f[0] in wanted]
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
            carry = Carry.read(stage, set(files), f"the snapshot of {self.path}")
            mtimes = manifest.metadata.get("mtimes")
            for name, src in files.items():
                if not name.startswith(self._FILES):
                    continue  # what the snapshot carries of the log (above)
                rel = name[len(self._FILES):]
                dest = self.path / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(src, dest)
                # As it was when saved: a framework may pick its newest file by mtime
                # (Lightning's ckpt_path="last" among last.ckpt, last-v1.ckpt...).
                mtime = mtimes.get(rel) if isinstance(mtimes, dict) else None
                if isinstance(mtime, int) and not isinstance(mtime, bool) and mtime >= 0:
                    os.utime(dest, ns=(mtime, mtime))
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        durable = channel.Sync(name=self.name, phase="durable", id=manifest.id,
                               files=len(manifest.files), bytes=manifest.total_bytes,
                               step=manifest.metadata.get("step"))
        carry.replay(self.rt, manifest.attempt, durable.event_data(), manifest.created)
        self._seq = manifest.step + 1
        self._signature = self._sig(self._scan())
        self.rt.send(channel.Sync(name=self.name, phase="restored",
                                  files=len(manifest.files), bytes=manifest.total_bytes))
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
            staged = self._stage()
            if staged is None:
                return None
            try:
                manifest = retrying(lambda: self._store.write(
                    staged.seq, staged.files, attempt=self.rt.attempt, fence=self.rt.fence,
                    fmt="dir", digests=staged.digests,
                    metadata={"path": str(self.path), "mtimes": staged.mtimes},
                ), f"uploading {self.path}")
            except BaseException as e:
                self._signature = None  # not uploaded: the next sync tries again
                if isinstance(e, FencedOff):
                    self.rt.fenced = True
                raise
            finally:
                staged.discard()
        self._report(manifest, staged.step, forced=False)
        return manifest

    def _stage(self, step: int | None = None) -> _Staged | None:
        """Copy the directory to scratch space (hashing as it copies): the snapshot to
        upload, or None if nothing changed since the last one. Call with the lock held."""
        files = self._scan()
        signature = self._sig(files)
        if signature == self._signature:
            return None
        stage = self.rt.scratch / f"sync-up-{self.name}-{uuid.uuid4().hex[:8]}"
        staged = _Staged(stage, self._seq, step)
        try:
            for rel, full, st in files:
                key = self._FILES + rel
                dest = stage / key  # the carry's files (below) sit beside files/
                dest.parent.mkdir(parents=True, exist_ok=True)
                try:
                    staged.digests[key] = copy_hashing(full, dest)
                except FileNotFoundError:
                    continue  # deleted since the scan
                staged.files[key] = dest
                staged.mtimes[rel] = st.st_mtime_ns
            # What the log has not confirmed up to now (the step the framework saved).
            for name, data in self.rt.carry().files().items():
                (stage / name).write_bytes(data)
                staged.files[name] = stage / name
        except BaseException:
            staged.discard()
            raise
        self._seq += 1
        self._signature = signature
        return staged

    def _report(self, manifest: Manifest, step: int | None, forced: bool) -> None:
        self.rt.send(channel.Sync(name=self.name, phase="durable", id=manifest.id,
                                  files=len(manifest.files), bytes=manifest.total_bytes,
                                  step=step, forced=None if step is None else forced))

    def save(self, step: int, hold: bool = True) -> None:
        """The code (a framework) has written a complete checkpoint of ``step`` into the
        directory: snapshot it now and upload it in the background.

        The pause is the copy into scratch space. The next :meth:`save` waits for this
        upload. After an interruption notice the snapshot uploads alongside any upload
        in flight (committed after it), and once it is durable the cell is held until
        the instance is terminated (:meth:`hold`; ``hold=False`` leaves that call to
        the caller, for a framework that still has the step's metrics to log). A save
        that fails is reported and retried at the next save point, which the notice
        makes the next step (``spot.save_requested`` stays true).
        """
        rt = self.rt
        previous = self._upload
        if previous is not None and not rt.park_requested:
            # Wait for the previous upload; a termination notice arriving meanwhile
            # makes this save the last one, which must not queue behind it.
            while not previous.done(_PARK_CHECK_SECONDS) and not rt.park_requested:
                pass
        park = rt.park_requested
        if rt.fenced:
            rt.hold_fenced()
        forced = rt.force_save or park
        with self._lock:
            staged = self._stage(step)
        # Only now is the notice served: if the copy raised, it is still pending.
        rt.force_save = False
        if staged is not None:
            after = previous if previous is not None and not previous.done(0) else None
            self._upload = _DirUpload(self, staged, forced, after)
        if park and hold:
            self.hold(step)

    def hold(self, step: int) -> None:
        """After a notice: wait until the last :meth:`save` is durable, then hold the
        cell until the instance is terminated (:meth:`spotnb.train.session.Session.park`).

        Returns only if that save failed (reported): the next step saves again.
        """
        rt = self.rt
        last = self._upload
        if last is None or last.wait() is not None:
            rt.park(step)
        if rt.fenced:
            rt.hold_fenced()
        # The upload failed for another reason (reported): try again at the next step.
        self._signature = None
        rt.force_save = True

    def wait(self) -> Manifest | None:
        """Wait for the upload :meth:`save` started; its manifest, or None (none, or it
        failed)."""
        upload = self._upload
        return upload.wait() if upload is not None else None

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
            if self.every is None:
                # Switched to uploads at save points (an integration took the
                # directory over): a timer or a notice must not catch a checkpoint
                # half-written.
                continue
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
        upload = self._upload
        if upload is not None and upload.wait() is None and upload.error is not None:
            self._signature = None  # upload it again below
        if self.rt.fenced:
            return FencedOff(f"{self.path} was not uploaded: this agent lost the job's lease")
        return self.sync_quietly()


class _Staged:
    """A snapshot copied to scratch space, waiting to be uploaded."""

    def __init__(self, root: Path, seq: int, step: int | None) -> None:
        self.root = root
        self.seq = seq
        self.step = step
        self.files: dict[str, Path] = {}
        self.digests: dict[str, tuple[int, str]] = {}
        #: Each file's mtime (ns) when copied: a restore sets it again.
        self.mtimes: dict[str, int] = {}

    def discard(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class _DirUpload:
    """One snapshot of :meth:`SyncDir.save` being uploaded by a background thread.

    Committed only after ``after`` (the upload in flight when it started), so
    ``LATEST`` moves in order.
    """

    def __init__(self, sd: SyncDir, staged: _Staged, forced: bool,
                 after: _DirUpload | None) -> None:
        self.sd = sd
        self.staged = staged
        self.forced = forced
        self.started = time.monotonic()
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self._after = after
        self._done = threading.Event()
        threading.Thread(target=self._run, name=f"spotnb-sync-save-{sd.name}",
                         daemon=True).start()

    def _run(self) -> None:
        sd, rt = self.sd, self.sd.rt
        try:
            uploaded = retrying(lambda: sd._store.upload(
                self.staged.seq, self.staged.files, attempt=rt.attempt, fmt="dir",
                digests=self.staged.digests, metadata={"path": str(sd.path),
                                                       "step": self.staged.step,
                                                       "mtimes": self.staged.mtimes}),
                f"uploading {sd.path}")
            if self._after is not None:
                self._after.wait()
            self.manifest = retrying(lambda: sd._store.commit(uploaded, fence=rt.fence),
                                     f"committing the snapshot of {sd.path}")
            sd._report(self.manifest, self.staged.step, self.forced)
            _logger.info("snapshot of %s at step %s is durable (%.1f MB, %.1f s)", sd.path,
                         self.staged.step, self.manifest.total_bytes / 1e6,
                         time.monotonic() - self.started)
        except FencedOff as e:
            self.error = e
            rt.fenced = True
            _logger.error("%s", e)
        except Exception as e:
            self.error = e
            sd._signature = None  # not uploaded: the next save uploads again
            _logger.exception("uploading %s (step %s) failed; the next save retries",
                              sd.path, self.staged.step)
        finally:
            self._after = None
            self.staged.discard()
            self._done.set()

    def done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the upload has ended (either way)."""
        return self._done.wait(timeout)

    def wait(self) -> Manifest | None:
        """The manifest once durable, or None if the upload failed (logged)."""
        self._done.wait()
        return self.manifest
