"""A checkpoint being written, in the background, while training goes on.

:class:`CheckpointUpload` is one save by a single writer: its thread writes the state's
files (DCP, or one pickle without torch) and what the checkpoint carries of the log
into a fresh checkpoint id, then the manifest, and commits it (fenced, ``LATEST``) after
the upload before it. :class:`ShardedUpload` is one rank's part of a sharded checkpoint
(every rank writes its shards through DCP; rank 0 commits). Each reports its phases to
the agent (``checkpoint``: begin, durable, failed). The save that starts them, and when
it waits for them, is :mod:`spotnb.train.saving`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from spotnb._version import __version__
from spotnb.ckpt import compile_cache, snapshot
from spotnb.ckpt.checkpoints import CheckpointStore, FencedOff, Manifest, PendingCheckpoint
from spotnb.kernel_remote import channel
from spotnb.protocol.store import retrying
from spotnb.train import process
from spotnb.train.carry import Carry
from spotnb.train.session import Session

_logger = logging.getLogger(__name__)

# Without torch the state is one pickle, under this name.
PICKLE_FILE = "state.pkl"


#: What a checkpoint's files are: {part name: writes that part's file(s) into the
#: pending checkpoint}. The state is one part (several files, see spotnb.ckpt); more
#: can be added next to it.
FileWriters = dict[str, Callable[[PendingCheckpoint], None]]


class _Moment(threading.Event):
    """An event that remembers when it was first set (monotonic seconds)."""

    at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()


def _why(rt: Session, forced: bool) -> tuple[bool, bool | None]:
    """A checkpoint event's reason, ``(forced, join)``: ``forced`` by a notice, or
    ``join``: saved before a node joins a distributed job (forced too, but no
    interruption; None otherwise)."""
    if forced and rt.join_requested and not rt.interrupt_pending:
        return False, True
    return forced, None


class CheckpointUpload:
    """One checkpoint being written by a background thread.

    Sequence: the thread writes every part of ``files`` into a fresh checkpoint id
    (live tensors first; ``live_written`` is set once they are out and training may
    change them) -> the manifest -> waits for ``after`` (so ``LATEST`` moves in step
    order) -> commits (fencing check, then ``LATEST``) -> reports "durable".
    """

    def __init__(self, rt: Session, cs: CheckpointStore, cid: str, step: int,
                 files: Callable[[CheckpointUpload], FileWriters], fmt: str, forced: bool,
                 started: float, live: bool,
                 after: CheckpointUpload | ShardedUpload | None = None) -> None:
        self.rt = rt
        self.cs = cs
        self.cid = cid
        self.step = step
        self.forced = forced
        self.started = started
        self.fmt = fmt
        # How long training waited: the capture, and the live tensors' writes if any.
        self.live = live
        self.capture_seconds = time.monotonic() - started
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        self._files: Callable[[CheckpointUpload], FileWriters] | None = files
        # Commit only after this upload is done, so LATEST moves in step order.
        self._after = after
        #: Set when the live tensors are written (or the write ended, either way).
        self.live_written = _Moment()
        # Durable (or failed: reported either way), then done (old checkpoints pruned).
        self._durable = threading.Event()
        self._done = threading.Event()
        rt.last_upload = self
        self._thread = threading.Thread(target=self._run, name=f"spotnb-upload-{step}",
                                        daemon=True)
        self._thread.start()

    def _report(self, phase: str, **extra: Any) -> None:
        forced, join = _why(self.rt, self.forced)
        self.rt.send(channel.CheckpointPhase(phase=phase, id=self.cid, step=self.step,
                                             forced=forced, join=join, **extra))

    def _run(self) -> None:
        self._report("begin", bytes=0, seconds=0.0)
        try:
            self._write_and_commit()
            self._durable.set()
            _compile_caches(self.rt)  # what torch.compile built, for the next attempt
            assert self.manifest is not None
            # Old checkpoints go once this one is durable (and the save has returned).
            self.cs.prune_quietly(self.manifest)
        except FencedOff as e:
            self.error = e
            self.rt.fenced = True
            self._report("failed", bytes=0, seconds=0.0, error=str(e))
            _logger.error("%s", e)
        except Exception as e:
            self.error = e
            self._report("failed", bytes=0, seconds=0.0, error=f"{type(e).__name__}: {e}")
            _logger.exception("the checkpoint of step %d failed; the next save retries",
                              self.step)
        finally:
            self._files = None
            self._after = None
            self.live_written.set()
            self._durable.set()
            self._done.set()

    def _write_and_commit(self) -> None:
        # Its own frame: the captured state it references is released when it returns.
        assert self._files is not None
        files = self._files(self)
        self._files = None
        pending = self.cs.begin(self.step, attempt=self.rt.attempt, checkpoint_id=self.cid)
        for write in files.values():
            write(pending)
        self.live_written.set()
        # A store that fails for a while (full, read-only, out of reach) delays the
        # checkpoint rather than losing it (the data files retry the same way).
        uploaded = retrying(lambda: pending.finish(self.fmt, metadata={"spotnb": __version__}),
                            f"writing the manifest of the checkpoint of step {self.step}")
        written = time.monotonic() - self.started  # this save's own time to durable
        if self._after is not None:
            self._after.wait()
            self._after = None
        self.manifest = retrying(lambda: self.cs.commit(uploaded, fence=self.rt.fence,
                                                        prune=False),
                                 f"committing the checkpoint of step {self.step}")
        seconds = time.monotonic() - self.started
        self._report("durable", bytes=self.manifest.total_bytes,
                     seconds=round(seconds, 3), stall=round(self.stall, 3))
        _logger.info("checkpoint of step %d is durable (%s, %.1f MB)", self.step,
                     self.cid, self.manifest.total_bytes / 1e6)
        self.rt.check_notice_fit(self.manifest.total_bytes, written)

    @property
    def stall(self) -> float:
        """Seconds the training loop waited for this save."""
        if self.live and self.live_written.at is not None:
            return self.live_written.at - self.started
        return self.capture_seconds

    def done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the upload has ended (either way)."""
        return self._durable.wait(timeout)

    def wait(self) -> Manifest | None:
        """The manifest once durable, or None if the save failed (already reported).

        By then the thread holds no reference to the captured state (its buffers are
        free to reuse or to release); it may still be deleting old checkpoints.
        """
        self._durable.wait()
        return self.manifest


class ShardedUpload:
    """This rank's part of a sharded checkpoint being written (started by
    :meth:`spotnb.train.saving.Saves.save_sharded`): DCP's future; then, on rank 0, the manifest,
    ``LATEST`` and the reports.

    A failure is reported once (by rank 0; every rank logs its own), makes the next
    ``maybe_save`` save again, and marks the rank fenced if its agent said it lost the
    lease (its next save holds the cell).
    """

    def __init__(self, rt: Session, store: CheckpointStore, cid: str, step: int, rank: int,
                 world_size: int, future: Future[Any], pending: PendingCheckpoint,
                 carry: Carry, forced: bool, started: float, answers: list[bool],
                 copied: bool, retry: Callable[[], None]) -> None:
        self.rt = rt
        self._store = store
        self.cid = cid
        self.step = step
        self.rank = rank
        self.world_size = world_size
        self.forced = forced
        self.started = started
        self.manifest: Manifest | None = None
        self.error: BaseException | None = None
        # How long training waited: the copy, or (nothing copied) the whole write.
        self.stall: float | None = time.monotonic() - started if copied else None
        self._future: Future[Any] | None = future
        self._pending = pending
        self._carry = carry
        self._answers = answers
        self._retry = retry
        self._done = threading.Event()
        self.rt.last_upload = self
        _wait_before_destroy()
        self._thread = threading.Thread(target=self._run, name=f"spotnb-sharded-{step}",
                                        daemon=True)
        self._thread.start()

    def _report(self, phase: str, **extra: Any) -> None:
        if self.rank == 0:
            forced, join = _why(self.rt, self.forced)
            self.rt.send(channel.CheckpointPhase(phase=phase, id=self.cid, step=self.step,
                                                 forced=forced, join=join, **extra))

    def _run(self) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        rt = self.rt
        try:
            assert self._future is not None
            self._future.result()  # every rank's files and .metadata are written
            self._future = None  # the staged copies are free to reuse from here on
            if self.stall is None:
                self.stall = time.monotonic() - self.started
            if self.rank == 0:
                self._commit()
        except FencedOff as e:
            self.error = e
            rt.fenced = True
            self._report("failed", bytes=0, seconds=0.0, error=str(e))
            _logger.error("%s", e)
        except (Exception, CheckpointException) as e:
            self.error = e
            if self._answers and not self._answers[-1]:
                rt.fenced = True  # this rank's agent lost its lease: hold the cell
            self._retry()  # the next maybe_save saves again (every rank)
            self._report("failed", bytes=0, seconds=0.0, error=f"{type(e).__name__}: {e}")
            _logger.error("the sharded checkpoint of step %d failed (%s); the next save "
                          "retries", self.step, e)
        finally:
            self._future = None
            self._done.set()

    def _commit(self) -> None:
        """Rank 0: the manifest of every rank's files, then ``LATEST`` (fenced)."""
        rt, step, pending = self.rt, self.step, self._pending
        store = self._store
        if self._carry:
            carry_writer(self._carry, step)(pending)
        uploaded = retrying(
            lambda: pending.finish("dcp", metadata={"spotnb": __version__,
                                                    "ranks": self.world_size}),
            f"writing the manifest of the checkpoint of step {step}")
        written = time.monotonic() - self.started
        self.manifest = retrying(lambda: store.commit(uploaded, fence=rt.fence, prune=False),
                                 f"committing the checkpoint of step {step}")
        seconds = time.monotonic() - self.started
        self._report("durable", bytes=self.manifest.total_bytes, seconds=round(seconds, 3),
                     stall=round(self.stall or 0.0, 3))
        _logger.info("sharded checkpoint of step %d is durable (%s, %d ranks, %.1f MB)",
                     step, self.cid, self.world_size, self.manifest.total_bytes / 1e6)
        rt.check_notice_fit(self.manifest.total_bytes, written)
        store.prune_quietly(self.manifest)

    def done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the save has ended (either way)."""
        return self._done.wait(timeout)

    def wait(self) -> Manifest | None:
        """Rank 0: the manifest once durable, or None if the save failed (reported);
        other ranks: None once their part is over (``error`` says whether it failed)."""
        self._done.wait()
        return self.manifest


_destroy_wrapped = False


_compile_uploader: compile_cache.Uploader | None = None


def _compile_caches(rt: Session) -> None:
    """After a durable save on an instance: upload the compiler's caches if they
    changed (:mod:`spotnb.ckpt.compile_cache`; the agent set where they are)."""
    global _compile_uploader
    if channel.ENV_SCRATCH not in os.environ:
        return  # standalone: the user's own caches stay theirs
    if _compile_uploader is None or _compile_uploader.store is not rt.store:
        _compile_uploader = compile_cache.Uploader(
            rt.store, compile_cache.cache_dirs(Path(os.environ[channel.ENV_SCRATCH]),
                                               os.environ))
    _compile_uploader.maybe_upload()


def _wait_before_destroy() -> None:
    """Make ``torch.distributed.destroy_process_group`` wait for this process's sharded
    save in flight first (installed at the first one).

    The save's collectives run on a group of the checkpoint's own
    (:func:`spotnb.ckpt.sharded.checkpoint_group`); a cell that ends with
    ``dist.destroy_process_group()`` right after its last ``maybe_save`` would pull that
    group from under the save and lose the checkpoint.
    """
    global _destroy_wrapped
    if _destroy_wrapped:
        return
    _destroy_wrapped = True
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        rt = process.existing()
        upload = rt.last_upload if rt is not None else None
        if isinstance(upload, ShardedUpload):
            upload.wait()
        return original(*args, **kwargs)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


_writer_import: threading.Thread | None = None


def import_writer_in_background() -> None:
    """Import the DCP writer now, off the training thread: importing
    ``torch.distributed.checkpoint`` takes a second or more in a fresh process (less
    once an optimizer has imported what it shares), which the first save, or the
    final one after a notice, should not wait for."""
    global _writer_import
    if _writer_import is None:
        _writer_import = threading.Thread(target=importlib.import_module,
                                          args=("spotnb.ckpt.dcp",),
                                          name="spotnb-import", daemon=True)
        _writer_import.start()


def join_writer_import() -> None:
    """Wait for :func:`import_writer_in_background`'s import, if one started: an
    interpreter must not exit in the middle of it."""
    if _writer_import is not None:
        _writer_import.join()


def carry_writer(carry: Carry, step: int) -> Callable[[PendingCheckpoint], None]:
    """The part that carries the metric rows and events the event log has not
    confirmed (:class:`spotnb.train.carry.Carry`)."""
    files = carry.files()

    def write_carry(pending: PendingCheckpoint) -> None:
        for name, data in files.items():
            retrying(functools.partial(pending.put_bytes, name, data),
                     f"writing what the checkpoint of step {step} carries of the log")
    return write_carry


def state_writer(captured: snapshot.Captured, upload: CheckpointUpload,
                  parts_in_flight: int | None) -> Callable[[PendingCheckpoint], None]:
    """The part that writes the captured state: DCP files with torch, else a pickle."""
    if upload.fmt == "pickle":
        def write_pickle(pending: PendingCheckpoint) -> None:
            def once() -> None:
                with pending.open(PICKLE_FILE) as f:
                    snapshot.dump(captured.state, f, "pickle")
            retrying(once, f"writing the checkpoint of step {upload.step}")
        return write_pickle

    def write_dcp(pending: PendingCheckpoint) -> None:
        from spotnb.ckpt.dcp import StoreWriter, save_state, state_key

        writer = StoreWriter(pending, live=captured.live, parts_in_flight=parts_in_flight,
                             live_written=upload.live_written)
        save_state({**captured.tensors, state_key(): captured.state}, writer)
    return write_dcp

