"""The API a training cell uses: ``from spotnb import runtime as spot``.

On a spot instance the agent starts the user's kernel with the environment described
in :mod:`spotnb.kernel_remote.channel`, calls :func:`_bootstrap` (connects to the
agent's socket, loads the cell's inputs, binds ``spot`` in the namespace), runs the
cell, and calls :func:`_finish` (flushes, waits until every upload is durable). The
same code also runs in a plain Python or notebook session without that environment,
for debugging a cell locally: then checkpoints go to ``./.spotnb-local/``, ``job_id``
is ``"local"``, ``attempt`` is 0, metrics are kept in memory (:func:`history`) and no
interruption notice ever comes.

A typical cell::

    ckpt = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched)
    for step in range(ckpt.restore(), total_steps):   # 0, or where the last run stopped
        loss = train_step()
        spot.log(step, loss=loss)                      # cheap: no sync, no I/O
        ckpt.maybe_save(step)                          # by policy, or now on a notice

Public API: :func:`log`, :func:`log_params`, :func:`progress`, :class:`Checkpoint`,
:func:`sync_dir`, :func:`last_checkpoint`, :func:`history`, the module attributes
``spot.interrupt_pending`` (an ``instance-action`` notice arrived; a ``rebalance``
recommendation does not set it), ``spot.save_requested`` (a notice asks for a save at
the next step), ``spot.job_id`` and ``spot.attempt``, ``spot.tensorboard()``
(:func:`spotnb.train.tb.tensorboard`) and ``spot.callbacks`` (the framework integrations of
:mod:`spotnb.train.integrations`: ``spot.callbacks.transformers()`` ...).

What happens on an interruption (the ``instance-action`` notice, about two minutes
before EC2 terminates the instance)::

    agent: notice -> runtime (receiver thread): force the next save, wake sync dirs
    cell:  ckpt.maybe_save(step) -> save(step) -> wait until durable
           -> {"op": "parked"} -> hold the cell (sleep) until the instance is gone
    next attempt: cell re-runs from the top -> ckpt.restore() == step + 1

If an earlier save is still uploading when the notice comes, the forced save does not
queue behind it: it uploads alongside (written straight from the training tensors,
since the earlier save's host buffers are still being written) and is committed (made
``LATEST``) right after it, so the final checkpoint shares the link rather than waiting
for a whole upload first. A notice that arrives while a save is stalled writing live
tensors makes that save the final one. Otherwise each save waits for the previous
upload. A ``rebalance`` recommendation only forces the next save. A save that finds
the lease lost (another agent took over the job) never moves ``LATEST`` and holds the
cell too.

A save, in memory and time (see :mod:`spotnb.ckpt` for the format)::

    save(step): capture (copy what fits the host_memory budget into reused buffers)
        -> background: DCP planner + StoreWriter stream every tensor into the store,
           live ones (not copied) first; the loop waits for those only
        -> .metadata, MANIFEST.json -> after the previous save: fence, LATEST
        -> "durable" (with the stall and the time to durable); after the first one,
           a warning if it would not fit in half the interruption notice
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
import os
import shutil
import sys
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from spotnb._version import __version__
from spotnb.ckpt import MAX_FILES, PIECE_BYTES, compile_cache, snapshot
from spotnb.ckpt.checkpoints import (
    CHECKPOINT_FORMATS,
    CheckpointError,
    CheckpointStore,
    CorruptCheckpoint,
    FencedOff,
    Manifest,
    PendingCheckpoint,
    new_id,
)
from spotnb.ckpt.memory import MemoryBudget
from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.protocol.store import NotFound, retrying
from spotnb.train import integrations as callbacks
from spotnb.train import loaders, process
from spotnb.train.cellvars import CellVariables
from spotnb.train.process import current as _rt
from spotnb.train.process import (
    history,
    last_checkpoint,
    log,
    log_params,
    progress,
    sync_dir,
)
from spotnb.train.session import EVENTS_FILE, LOCAL_DIR, METRICS_FILE, Carry, Session
from spotnb.train.syncdir import SyncDir
from spotnb.train.tb import tensorboard

__all__ = ["LOCAL_DIR", "Checkpoint", "OutputError", "SyncDir", "callbacks", "history",
           "last_checkpoint", "log", "log_params", "progress", "sync_dir", "tensorboard"]

_logger = logging.getLogger(__name__)

# How long restore() waits for the agent's checkpoint download before doing its own.
PREFETCH_WAIT_SECONDS = 600.0
# While a save waits for the previous upload, how often it looks for a termination
# notice (which ends the wait: the last save must fit in the notice period).
PARK_CHECK_SECONDS = 0.02
# Without torch the state is one pickle, under this name.
PICKLE_FILE = "state.pkl"
# Upload parts in flight per checkpoint file, at most (stores that upload in parts):
# S3's default (spotnb.providers.aws.store.STREAM_PARTS_IN_FLIGHT).
MAX_PARTS_IN_FLIGHT = 10

def _wait_for_prefetch(restore_dir: Path) -> None:
    """Wait while the agent is still downloading the checkpoint into ``restore_dir``.

    The agent downloads while the kernel starts and the cell's imports run; the first
    ``restore()`` may catch up with it. Give up after ``PREFETCH_WAIT_SECONDS`` and
    download directly (the agent may have died mid-way).
    """
    if not restore_dir.exists():
        return  # not an agent-managed restore dir (standalone, or an older agent)
    deadline = time.monotonic() + PREFETCH_WAIT_SECONDS
    while not (restore_dir / channel.PREFETCH_DONE).exists():
        if time.monotonic() > deadline:
            _logger.warning("the agent's checkpoint download did not finish; downloading")
            return
        time.sleep(0.02)


class InputError(RuntimeError):
    """An input shipped with the job cannot be read on the instance."""


class OutputError(ValueError):
    """An output variable is missing or cannot be pickled."""


class _Module(types.ModuleType):
    """This module's class. The attributes that read the session are properties:
    ``spot.save_requested`` is read at every step (by training loops and by every
    framework integration), and a property costs one lookup where a module
    ``__getattr__`` costs a failed lookup and a call (about 8x more)."""

    @property
    def interrupt_pending(self) -> bool:
        return _rt().interrupt_pending

    @property
    def save_requested(self) -> bool:
        return _rt().save_requested

    @property
    def job_id(self) -> str:
        return _rt().job_id

    @property
    def attempt(self) -> int:
        return _rt().attempt


sys.modules[__name__].__class__ = _Module


def __getattr__(name: str) -> Any:
    # The session's attributes are _Module's properties; named here too for type
    # checkers.
    if name in ("interrupt_pending", "save_requested", "job_id", "attempt"):
        return getattr(sys.modules[__name__], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "interrupt_pending", "job_id", "attempt", "save_requested"])


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


def _why(rt: Session, forced: bool) -> dict[str, bool]:
    """A checkpoint event's reason: ``forced`` by a notice, or ``join``: saved before
    a node joins a distributed job (forced too, but no interruption)."""
    if forced and rt.join_requested and not rt.interrupt_pending:
        return {"forced": False, "join": True}
    return {"forced": forced}


class _Upload:
    """One checkpoint being written by a background thread.

    Sequence: the thread writes every part of ``files`` into a fresh checkpoint id
    (live tensors first; ``live_written`` is set once they are out and training may
    change them) -> the manifest -> waits for ``after`` (so ``LATEST`` moves in step
    order) -> commits (fencing check, then ``LATEST``) -> reports "durable".
    """

    def __init__(self, rt: Session, cs: CheckpointStore, cid: str, step: int,
                 files: Callable[[_Upload], FileWriters], fmt: str, forced: bool,
                 started: float, live: bool,
                 after: _Upload | _ShardedUpload | None = None) -> None:
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
        self._files: Callable[[_Upload], FileWriters] | None = files
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
        self.rt.send({"op": "checkpoint", "phase": phase, "id": self.cid, "step": self.step,
                      **_why(self.rt, self.forced), **extra})

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


class _ShardedUpload:
    """This rank's part of a sharded checkpoint being written (started by
    :meth:`Checkpoint._save_sharded`): DCP's future; then, on rank 0, the manifest,
    ``LATEST`` and the reports.

    A failure is reported once (by rank 0; every rank logs its own), makes the next
    ``maybe_save`` save again, and marks the rank fenced if its agent said it lost the
    lease (its next save holds the cell).
    """

    def __init__(self, owner: Checkpoint, cid: str, step: int, rank: int, world_size: int,
                 future: Future[Any], pending: PendingCheckpoint, carry: Carry,
                 forced: bool, started: float, answers: list[bool], copied: bool) -> None:
        self.owner = owner
        self.rt = owner._rt
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
        self._done = threading.Event()
        self.rt.last_upload = self
        _wait_before_destroy()
        self._thread = threading.Thread(target=self._run, name=f"spotnb-sharded-{step}",
                                        daemon=True)
        self._thread.start()

    def _report(self, phase: str, **extra: Any) -> None:
        if self.rank == 0:
            self.rt.send({"op": "checkpoint", "phase": phase, "id": self.cid,
                          "step": self.step, **_why(self.rt, self.forced), **extra})

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
            self.owner._retry = True
            self._report("failed", bytes=0, seconds=0.0, error=f"{type(e).__name__}: {e}")
            _logger.error("the sharded checkpoint of step %d failed (%s); the next save "
                          "retries", self.step, e)
        finally:
            self._future = None
            self._done.set()

    def _commit(self) -> None:
        """Rank 0: the manifest of every rank's files, then ``LATEST`` (fenced)."""
        rt, step, pending = self.rt, self.step, self._pending
        store = self.owner._store
        if self._carry:
            _carry_writer(self._carry, step)(pending)
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
        if isinstance(upload, _ShardedUpload):
            upload.wait()
        return original(*args, **kwargs)

    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


_writer_import: threading.Thread | None = None


def _import_writer_in_background() -> None:
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


def _carry_writer(carry: Carry, step: int) -> Callable[[PendingCheckpoint], None]:
    """The part that carries the metric rows and events the event log has not
    confirmed (:class:`spotnb.train.session.Carry`)."""
    files = carry.files()

    def write_carry(pending: PendingCheckpoint) -> None:
        for name, data in files.items():
            retrying(functools.partial(pending.put_bytes, name, data),
                     f"writing what the checkpoint of step {step} carries of the log")
    return write_carry


def _state_writer(captured: snapshot.Captured, upload: _Upload,
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


class Checkpoint:
    """Saves and restores training state: ``spot.Checkpoint(model=m, optimizer=opt)``.

    Register everything the loop needs to continue exactly: objects with
    ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers,
    GradScaler), ``random.Random``/``torch.Generator``/``numpy.random.Generator``,
    tensors, arrays, dicts and lists are restored in place; a plain ``DataLoader``
    resumes its epoch at the batch it was at (:mod:`spotnb.train.loaders`); any other
    picklable value is read back as ``ckpt["name"]`` (and updated with
    ``ckpt["name"] = value``).
    The global RNG states (``random``, NumPy, torch CPU and CUDA) are always included,
    so seeded code continues bitwise-identically after an interruption.

    Step convention: ``save(step)`` means "step ``step`` is done", and
    :meth:`restore` returns ``step + 1``, the first step still to do (0 if there is
    no checkpoint). So ``for step in range(ckpt.restore(), n)`` resumes correctly.

    ``host_memory`` bounds the extra host memory a save uses (bytes, ``"8GB"``, or a
    share of the free RAM, ``"25%"``; default ``SPOTNB_CHECKPOINT_MEMORY``, else half
    the free RAM): a state that fits is copied whole and written in the background
    (the save stalls only for the copy); of a larger one, what does not fit is written
    straight from the training tensors while the save stalls. Either way a save never
    holds more than the budget. The copy's buffers are kept between saves (that is
    what makes a save a fast memory copy).

    Use one ``Checkpoint`` per job.
    """

    def __init__(self, *, host_memory: int | str | None = None, **state: Any) -> None:
        if not state:
            raise TypeError("Checkpoint() needs the state to save, e.g. "
                            "spot.Checkpoint(model=model, optimizer=optimizer)")
        self._budget = MemoryBudget(host_memory)
        # A plain DataLoader becomes resumable in place (its position is saved): the
        # same object, which then restores in place, so it may live in any variable.
        self._objects: dict[str, Any] = {name: loaders.resumable(obj)
                                         for name, obj in state.items()}
        # The entries that follow a variable of the cell (spotnb.train.cellvars).
        self._cell = CellVariables.of_caller(self._objects, Checkpoint)
        if "torch" in sys.modules:
            _import_writer_in_background()
        rt = _rt()
        rt.has_checkpoint = True  # a node joining a distributed job waits for its save
        self._store = CheckpointStore(rt.store, layout.CHECKPOINTS, keep=rt.keep,
                                      formats=CHECKPOINT_FORMATS)
        self._pool = snapshot.BufferPool()
        self._warmed = False
        # A sharded save failed (reported): the next maybe_save saves (every rank).
        self._retry = False
        if "torch" in sys.modules and _world() is None:
            # Allocate the host buffers for the state that exists now (the model; an
            # optimizer's state appears at its first step: maybe_save warms that) in
            # the background, while the loop starts: filling fresh pages was most of a
            # first save's stall. A save that comes first shares the work
            # (snapshot.BufferPool). Distributed jobs warm at their first maybe_save.
            self._pool.warm_async(snapshot.tensor_specs(self._objects),
                                  self._plan_memory()[0])
        self._upload: _Upload | _ShardedUpload | None = None
        # maybe_save's call sites (code, line) -> the registered loaders' epochs then.
        self._save_sites: dict[tuple[Any, int], tuple[int | None, ...]] = {}
        self._last_step = -1
        self._last_time = time.monotonic()

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"

    @property
    def _rt(self) -> Session:
        # The current session (a new one after _finish(), e.g. when a cell re-runs).
        return _rt()

    def __getitem__(self, name: str) -> Any:
        self._cell.refresh(self._objects)
        return self._objects[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._objects[name] = value
        self._cell.assign(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    # -- memory ----------------------------------------------------------------------

    def _plan_memory(self) -> tuple[int, int | None]:
        """(bytes of tensors a capture may copy, upload parts in flight per file).

        The budget less what the writer needs besides the copies: upload part buffers
        (stores that upload in parts) and GPU staging buffers, for every file a
        checkpoint may be written as at once.
        """
        budget = self._budget.bytes(held=self._pool.held)
        torch = sys.modules.get("torch")
        reserve = MAX_FILES * PIECE_BYTES if torch is not None and \
            torch.cuda.is_available() else 0
        part = self._rt.store.part_bytes
        parts: int | None = None
        if part:
            # Up to a quarter of the budget for upload parts, within what a writer uses
            # at most, and at least one part uploading while the next one fills.
            per_file = budget // 4 // MAX_FILES // part - 1
            parts = max(1, min(per_file, MAX_PARTS_IN_FLIGHT))
            reserve += MAX_FILES * (parts + 1) * part
        return max(0, budget - reserve), parts

    # -- restore ---------------------------------------------------------------------

    def restore(self) -> int:
        """Load the latest checkpoint into the registered objects; return the next step.

        Returns 0 when the job has no checkpoint yet, else ``saved_step + 1``. Saved
        tensors are read straight into the registered objects' tensors where shapes
        and dtypes match, so a restore needs no second copy of the state in memory.
        """
        process.wait_for_lease(self._rt)  # a standby's restore point: nothing read before it
        self.wait()
        last = self._rt.last_upload
        if last is not None:
            last.wait()  # another Checkpoint's save of this session: it may be the newest
        started = time.monotonic()
        world = _world()
        damaged: list[str] = []
        self._cell.refresh(self._objects, restoring=True)  # into what the variables hold
        while True:
            found = self._fetch_newest_intact(damaged)
            if world is not None:
                found = self._agree(found)
            if found is None:
                _logger.info("no checkpoint yet: starting from step 0")
                return 0
            manifest, directory, downloaded = found
            try:
                state, carry = self._load(manifest, directory, world)
                break
            except CorruptCheckpoint as e:
                if not manifest.metadata.get("ranks"):
                    raise  # verified whole before it was read: not damage found reading
                # A sharded checkpoint is verified file by file as each rank reads its
                # part: sharded.load raised this on every rank at once, so every rank
                # skips it here and agrees on the one before it.
                _logger.error("%s; trying the checkpoint before it", e)
                damaged.append(manifest.id)
            finally:
                if downloaded:
                    shutil.rmtree(directory, ignore_errors=True)
        if world is None or world[0] == 0:
            # Rows and output the checkpoint's attempt logged that its agent may not
            # have written (it died with them): the agent records those its log lacks.
            # In a distributed job global rank 0's agent alone, as spot.log records
            # rank 0's rows: agents of several nodes appending the same rows would
            # repeat them.
            carry.replay(self._rt, manifest.attempt,
                         {"phase": "durable", "id": manifest.id, "step": manifest.step,
                          "bytes": manifest.total_bytes}, manifest.created)
        saved = state["objects"]
        for name, obj in list(self._objects.items()):
            if name in saved and saved[name][0] == "dcp":
                continue  # loaded by DCP already (spotnb.ckpt.sharded)
            if name not in saved:
                _logger.warning("%r is not in checkpoint %s (added since?); it keeps its "
                                "current value", name, manifest.id)
                continue
            kind, payload = saved[name]
            self._objects[name] = snapshot.restore(name, obj, kind, payload)
            self._cell.assign(name, self._objects[name])  # best_val_loss = the saved one
        for name in saved.keys() - self._objects.keys():
            _logger.warning("checkpoint %s also holds %r, which is not registered now; "
                            "ignored", manifest.id, name)
        del saved  # the loaded copy is in the objects now
        # The state exists in full now (optimizer state too): allocate the host buffers
        # for the first save in the background, so that save is a memory copy.
        self._warm()
        # The global RNGs last: the warm-up reads every state_dict(), and some draw (a
        # StatefulDataLoader's makes its iterator, which draws its worker seed).
        snapshot.restore_rng(state.pop("rng"))
        del state
        self._last_step = manifest.step
        self._last_time = time.monotonic()
        seconds = time.monotonic() - started
        self._rt.send({"op": "restored", "id": manifest.id, "step": manifest.step,
                       "seconds": round(seconds, 3)})
        _logger.info("restored checkpoint %s in %.1f s: continuing at step %d", manifest.id,
                     seconds, manifest.step + 1)
        return manifest.step + 1

    def _load(self, manifest: Manifest, directory: Path, world: tuple[int, int] | None
              ) -> tuple[dict[str, Any], Carry]:
        """The state tree of a fetched checkpoint, and what it carries of the log."""
        if not manifest.metadata.get("ranks"):
            return self._read(manifest, directory), _read_carry(manifest, directory)
        # Written by every rank (sharded): DCP reshards it to this world, each rank
        # fetching and reading only the files its part is in (collective in a
        # distributed job; a damaged file raises CorruptCheckpoint on every rank).
        from spotnb.ckpt import sharded
        from spotnb.ckpt.dcp import StoreReader

        reader = StoreReader(self._store, manifest, directory)
        state = sharded.load(self._objects, reader, world[0] if world else 0)
        if world is not None and world[0] != 0:
            return state, Carry()  # global rank 0 replays (its agent records them)
        carried = [n for n in (METRICS_FILE, EVENTS_FILE) if manifest.entry(n) is not None]
        if carried:
            try:
                reader.fetch_files(carried)
            except (CheckpointError, OSError) as e:
                # Not the training state: the restore goes on (as _read_carry does).
                _logger.warning("what checkpoint %s carries of the log cannot be fetched "
                                "(%s); the history may miss the steps just before it",
                                manifest.id, e)
                return state, Carry()
        return state, _read_carry(manifest, directory)

    def _read(self, manifest: Manifest, directory: Path) -> dict[str, Any]:
        """The saved state tree of a verified local copy, tensors resolved."""
        if manifest.format == "pickle":  # one state file: a state saved without torch
            entry = next((f for f in manifest.files if f.name.startswith("state.")), None)
            if entry is None:
                raise CheckpointError(f"checkpoint {manifest.id} has no state file; it "
                                      "was not written by spot.Checkpoint")
            state: dict[str, Any] = snapshot.load(directory / entry.name, manifest.format)
            return state
        if manifest.format != "dcp":
            raise CheckpointError(f"checkpoint {manifest.id} is in format "
                                  f"{manifest.format!r}, which spot.Checkpoint does not "
                                  "read: it was written by sync_dir or a newer spotnb")
        import torch

        from spotnb.ckpt.dcp import FileReader, load_state, state_key, tensor_names

        reader = FileReader(directory)
        live = snapshot.live_tensors(self._objects)
        targets: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        for name, saved in tensor_names(reader.read_metadata()):
            own = live.get(name)
            if own is not None and tuple(own.shape) == tuple(saved.size) and \
                    own.dtype == saved.properties.dtype:
                targets[name] = own  # read in place: no second copy of the state
                continue
            mapped = reader.mapped(name)  # no own tensor (fresh optimizer state): a view
            if mapped is not None:
                tensors[name] = mapped
            else:
                targets[name] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        key = state_key()
        targets[key] = None
        load_state(targets, reader)
        tree = targets.pop(key)
        if tree is None:
            raise CheckpointError(f"checkpoint {manifest.id} has no spotnb state; it was "
                                  "not written by spot.Checkpoint")
        tensors.update(targets)
        tree["objects"] = {name: (kind, snapshot.resolve_refs(payload, tensors))
                           for name, (kind, payload) in tree["objects"].items()}
        return dict(tree)

    def _fetch_newest_intact(self, damaged: list[str] | None = None
                             ) -> tuple[Manifest, Path, bool] | None:
        """The newest checkpoint whose files verify, fetched; None if there is none.

        A damaged checkpoint (its files disagree with its manifest) is skipped for the
        one before it: redoing some steps beats failing the job. ``damaged``: ids found
        damaged already (by a restore that read them); those found here are added.

        A sharded checkpoint is not fetched whole here: each rank fetches and verifies
        the files it reads as it reads them (:meth:`_fetch`, :meth:`_load`).
        """
        damaged = damaged if damaged is not None else []
        for manifest in self._store.manifests():
            if manifest.id in damaged:
                continue
            try:
                directory, downloaded = self._fetch(manifest)
            except CorruptCheckpoint as e:
                _logger.error("%s; trying the checkpoint before it", e)
                damaged.append(manifest.id)
                continue
            return manifest, directory, downloaded
        if damaged:
            raise CorruptCheckpoint(
                f"every checkpoint of this job is damaged ({', '.join(damaged)}); delete "
                f"the {layout.CHECKPOINTS}/ prefix of the job's store to start from step 0"
            )
        return None

    def _agree(self, found: tuple[Manifest, Path, bool] | None
               ) -> tuple[Manifest, Path, bool] | None:
        """In a distributed job: every rank restores the checkpoint rank 0 found (one
        broadcast), so that no two ranks resume from different steps."""
        import torch.distributed as dist

        chosen: list[str | None] = [found[0].id if found is not None else None]
        dist.broadcast_object_list(chosen, src=0)
        if (found[0].id if found is not None else None) == chosen[0]:
            return found
        if found is not None and found[2]:
            shutil.rmtree(found[1], ignore_errors=True)
        if chosen[0] is None:
            return None
        manifest = self._store.manifest(str(chosen[0]))
        return (manifest, *self._fetch(manifest))

    def _fetch(self, manifest: Manifest) -> tuple[Path, bool]:
        """A local copy of the checkpoint: the agent's prefetch if it is this
        checkpoint, else the store's own files if the store is local (verified where
        they are), else a fresh download. The second item says whether we downloaded
        it (and remove it after the restore).

        Verified whole, except a sharded checkpoint's: of that, only the directory is
        chosen here, and each rank's :class:`~spotnb.ckpt.dcp.StoreReader` fetches
        into it the files it reads. The ranks of a node share the agent's restore
        directory (or a subdirectory of it named after the checkpoint, when the
        prefetch brought another one): nobody removes it while another rank reads.
        """
        restore_dir = self._rt.restore_dir
        sharded = bool(manifest.metadata.get("ranks"))
        if restore_dir is not None:
            _wait_for_prefetch(restore_dir)
        if restore_dir is not None and (restore_dir / "MANIFEST.json").exists():
            try:
                local = Manifest.read_local(restore_dir)
                if local.id == manifest.id:
                    if not sharded:  # the agent's download verified every file
                        self._store.verify_local(manifest, restore_dir, downloaded=True)
                    return restore_dir, False
                _logger.info("the prefetched checkpoint %s is not the latest (%s); "
                             "downloading", local.id, manifest.id)
            except (CheckpointError, OSError, ValueError, KeyError) as e:
                _logger.warning("the prefetched checkpoint in %s is unusable (%s); "
                                "downloading", restore_dir, e)
        if sharded and restore_dir is not None and restore_dir.exists():
            own = restore_dir / manifest.id
            own.mkdir(exist_ok=True)
            return own, False
        here = None if sharded else self._store.local_dir(manifest)
        if here is not None:  # a local store: its files are read where they are
            self._store.verify_local(manifest, here)
            return here, False
        dest = self._rt.scratch / f"runtime-restore-{uuid.uuid4().hex[:8]}"
        if sharded:
            dest.mkdir(parents=True)
            return dest, True
        try:
            self._store.download(manifest, dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return dest, True

    # -- save ------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Checkpoint now: "step ``step`` is done". Stalls only to copy state to memory.

        Writing to the store happens in the background; the next save (or the end of
        the job) waits for this one. Of a state larger than the memory budget, the part
        that does not fit is written before this returns. After an interruption notice
        the save waits until it is durable and then holds the cell (see the module
        docstring).
        """
        world = _world()
        if world is not None and _sharded(self._objects):
            self._save_sharded(int(step), *world, forced=False)  # every rank calls save
            self._last_step = int(step)
            self._last_time = time.monotonic()
            return
        self._save(int(step), forced=False)

    def maybe_save(self, step: int) -> bool:
        """Save if the policy says so or a notice is pending; return whether it saved.

        The policy (``checkpoint_every`` of the job; 5 minutes standalone) counts seconds
        and steps since the last save or restore. Cheap when there is nothing to do.
        A save due while a registered data loader is in its epoch's last batch (a notice's
        too) is taken at the next call, after the epoch's end: a run resumed from that
        batch would start the next epoch and skip the code after the loop over the loader.
        """
        rt = self._rt
        world = _world()
        caller = sys._getframe(1)
        site = (caller.f_code, caller.f_lineno)
        if world is not None:
            return self._maybe_save_in_world(int(step), *world, site=site)
        if self._in_last_batch(site):
            # The epoch's end (its evaluation, scheduler step, bookkeeping) is still
            # to run, and a run resumed from here would start the next epoch without
            # it: the save due (a notice's too) is taken at the next call.
            return False
        if rt.force_save or rt.park_requested or rt.fenced:
            self._save(int(step), forced=True)
            if rt.join_requested and not (rt.park_requested or rt.fenced):
                # A distributed job shrunk to one process: a node waits to join; once
                # this save is durable the world re-forms with it (redoing no step).
                if self.wait() is not None:
                    rt.hold_for_reform(int(step))
                rt.force_save = True  # the save failed (reported): again next time
            return True
        if self._due(step):
            self._save(int(step), forced=False)
            return True
        if not self._warmed:
            # The first call that does not save: allocate the host buffers now, in the
            # background, so the first save is a memory copy too (the optimizer state
            # exists by now, after a first step).
            self._warm()
        return False

    def _in_last_batch(self, site: tuple[Any, int]) -> bool:
        """Whether this call (from ``site``: the caller's code and line) is in the loop
        over a registered data loader, at its epoch's last batch (see
        :func:`spotnb.train.loaders.in_last_batch`), and this attempt may still save (an
        agent that lost its lease holds the cell at once).

        In the loop: the same line called ``maybe_save`` earlier in the same epoch. A
        save once per epoch, after a loop that stopped at the last batch without asking
        for more (``islice(loader, len(loader))``, ``zip(range(n), loader)``), is not
        delayed: its line runs once per epoch.
        """
        epochs = tuple(loaders.epoch_of(obj) for obj in self._objects.values())
        in_loop = self._save_sites.get(site) == epochs
        self._save_sites[site] = epochs
        return in_loop and not self._rt.fenced and any(
            loaders.in_last_batch(obj) for obj in self._objects.values())

    def _warm(self) -> None:
        """Allocate the host buffers of the next save in the background (see
        :class:`~spotnb.ckpt.snapshot.BufferPool`), on a rank that saves: every rank of a
        sharded job (its own shards), else only global rank 0."""
        self._warmed = True
        world = _world()
        if _sharded(self._objects):
            from spotnb.ckpt import sharded

            specs = sharded.stage_specs(self._objects)
        elif world is None or world[0] == 0:
            specs = snapshot.tensor_specs(self._objects)
        else:
            return  # a replica of rank 0's state: rank 0 saves it
        self._pool.warm_async(specs, self._plan_memory()[0])

    def _due(self, step: int) -> bool:
        every = self._rt.every
        return (every.steps is not None and step - self._last_step >= every.steps) or (
            every.seconds is not None and time.monotonic() - self._last_time >= every.seconds)

    def _maybe_save_in_world(self, step: int, rank: int, world_size: int,
                             site: tuple[Any, int]) -> bool:
        """``maybe_save`` in a distributed job (every rank calls it at the same steps).

        Step 1  one all-reduce (MAX) of [a notice on my node, a save due here]: every
                rank decides the same, so a notice on any node saves at one step. A
                rebalance recommendation is a save due, not a notice: every rank
                saves at once and the world goes on as it is (its node's warm standby
                takes over later, through that node's notice).
        Step 2  global rank 0 writes the checkpoint (DDP: every rank holds the same
                state; spotnb.kernel_remote.multinode), every other rank only notes the step; or,
                when a registered module holds sharded tensors (FSDP), every rank
                writes its own shards (:meth:`_save_sharded`).
        Step 3  after a notice: rank 0 waits until it is durable and broadcasts
                whether it is; then the noticed node's ranks park (its agent leaves
                the world) and every other rank asks its agent to re-form without it
                (torchelastic restarts them from this checkpoint). A node waiting to
                join is the same save (its agents' ``join`` notice), after which every
                rank asks to re-form: the join redoes no step.
        """
        import torch
        import torch.distributed as dist

        rt = self._rt
        # A recommendation's save: every rank saves now, none holds for a re-formation
        # (the world would re-form around the node it is for, which stays).
        rebalance = rt.force_save and rt.notice == "rebalance" and not (
            rt.park_requested or rt.fenced or rt.join_requested)
        noticed = (rt.force_save and not rebalance) or rt.park_requested or rt.fenced
        flags = torch.tensor([float(noticed),
                              float(self._due(step) or self._retry or rebalance),
                              float(rt.join_requested),
                              float(not self._in_last_batch(site))])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        notice_anywhere, due = bool(flags[0].item()), bool(flags[1].item())
        if flags[2].item():
            rt.join_requested = True  # a node waits to join: this save is before it
        # Every rank in its loader's last batch: the save waits for the epoch's end,
        # as in a single process (maybe_save).
        if not (notice_anywhere or due) or not flags[3].item():
            if not self._warmed:
                self._warm()  # as maybe_save's first call that does not save
            return False
        if not notice_anywhere:
            rt.force_save = False  # a recommendation's (if any): served by this save
        if _sharded(self._objects):
            # Sharded state (FSDP): every rank writes its shards, at once (see
            # _save_sharded); the outcome is known on every rank when it returns.
            durable = self._save_sharded(step, rank, world_size, forced=notice_anywhere)
            self._last_step = step
            self._last_time = time.monotonic()
            if not notice_anywhere:
                return True
        else:
            if rank == 0:
                self._save(step, forced=notice_anywhere, hold=False)
            self._last_step = step
            self._last_time = time.monotonic()
            if not notice_anywhere:
                return True
            flag = torch.tensor([1.0 if rank != 0 or self.wait() is not None else 0.0])
            dist.broadcast(flag, src=0)
            durable = bool(flag.item())
        if not durable:
            rt.force_save = True  # the save failed (reported): try again next time
            return True
        if rt.fenced:
            rt.hold_fenced()
        if rt.park_requested:
            rt.park(step)
        rt.hold_for_reform(step)

    def _save_sharded(self, step: int, rank: int, world_size: int, forced: bool) -> bool:
        """Every rank's part of a sharded checkpoint (:mod:`spotnb.ckpt.sharded`).

        Returns, after a notice (``forced``), whether the checkpoint is durable (the
        same answer on every rank); otherwise True once it is under way (a failure is
        reported, and the next ``maybe_save`` saves again).

        Step 1  wait for this rank's previous save; a rank whose agent lost its lease
                holds here (its peers' next collective fails within the peer timeout
                and the world re-forms without it). Rank 0 picks the checkpoint id and
                broadcasts it.
        Step 2  every rank copies its shards into host memory (the stall: see
                :func:`spotnb.ckpt.sharded.save`) and starts ``dcp.async_save``, which
                writes the rank's files and then asks its agent whether it still holds
                its slot's lease; DCP gathers every rank's results and answers on rank
                0, which writes ``.metadata`` only if every rank wrote and holds its
                lease. Otherwise DCP raises on every rank: no manifest, ``LATEST``
                stays.
        Step 3  in the background (:class:`_ShardedUpload`), rank 0 writes the
                manifest (every rank's files) and moves ``LATEST`` after its own
                fencing check.
        Step 4  after a notice only: every rank waits for its save; rank 0 broadcasts
                whether it is durable.
        """
        import torch
        import torch.distributed as dist

        from spotnb.ckpt import sharded

        rt = self._rt
        self.wait()  # step 1
        if rt.fenced:
            rt.hold_fenced()
        started = time.monotonic()
        forced = forced or rt.force_save
        chosen: list[str | None] = [new_id(step, rt.attempt) if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        cid = str(chosen[0])
        pending = self._store.begin(step, attempt=rt.attempt, checkpoint_id=cid)
        answers: list[bool] = []

        def fence() -> bool:
            answers.append(rt.fence())
            return answers[-1]

        if rank == 0:  # one report per checkpoint, as a single-node job's
            rt.send({"op": "checkpoint", "phase": "begin", "id": cid, "step": step,
                     "forced": forced, "bytes": 0, "seconds": 0.0})
        carry = rt.carry() if rank == 0 else Carry()
        copy_budget, parts = self._plan_memory()
        self._retry = False
        self._cell.refresh(self._objects)  # the followed variables' values now
        future, copied = sharded.save(self._objects, pending, step=step, rank=rank,
                                      fence=fence, pool=self._pool, copy_budget=copy_budget,
                                      parts_in_flight=parts)  # step 2
        # Only now is a notice served: if this save fails, the next one retries.
        rt.force_save = False
        self._warmed = True
        upload = self._upload = _ShardedUpload(self, cid, step, rank, world_size, future,
                                               pending, carry, forced, started, answers,
                                               copied)
        if not copied:
            upload.wait()  # written from the training state: it must not change meanwhile
        if not forced:
            return True
        manifest = upload.wait()  # step 4
        flag = torch.tensor([1.0 if rank != 0 or manifest is not None else 0.0])
        dist.broadcast(flag, src=0)
        durable = bool(flag.item())
        if not durable:
            rt.force_save = True  # the notice still stands: the next step saves again
            if rt.fenced:
                rt.hold_fenced()
        return durable

    def wait(self) -> Manifest | None:
        """Wait for the save in progress; its manifest, or None (none, it failed, or
        this rank of a sharded checkpoint is not the one that commits it)."""
        upload, self._upload = self._upload, None
        if upload is None:
            return None
        return upload.wait()

    def _save(self, step: int, forced: bool, hold: bool = True) -> None:
        """Save; after a notice, wait until durable and park (``hold``; a distributed
        job's rank 0 parks in :meth:`_maybe_save_in_world` instead)."""
        rt = self._rt
        if _initialised() and _sharded(self._objects):
            # Sharded state in a world of one process (a job shrunk to one node): its
            # tensors are DTensors, which only DCP's state-dict API saves.
            durable = self._save_sharded(step, 0, 1, forced)
            self._last_step = step
            self._last_time = time.monotonic()
            if durable and hold and rt.park_requested:
                rt.park(step)
            return
        run = _SaveRun(self, step, forced, hold)
        state = SaveState.START
        while state is not SaveState.DONE:
            following = run.step(state)
            assert following in SAVE_TRANSITIONS[state], (state, following)
            state = following


class SaveState(enum.Enum):
    """Where one save of a :class:`Checkpoint` is (:class:`_SaveRun`). The transitions
    are :data:`SAVE_TRANSITIONS`; what each state does is its :class:`_SaveRun` step."""

    #: Decide how this save relates to the upload still in flight, if any.
    START = "start"
    #: Wait for the previous upload; a termination notice ends the wait.
    WAITING = "waiting"
    #: The save before termination, while the previous upload still runs: it does not
    #: wait (two uploads in a row may not fit in the notice period), writes straight
    #: from the training tensors, and commits after the previous one.
    BESIDE = "beside"
    #: No upload in flight: the save copies into host memory within the budget.
    AFTER = "after"
    #: Copy the state (a cell whose agent lost the lease is held first).
    CAPTURING = "capturing"
    #: The upload runs in the background; training waits only for live tensors.
    UPLOADING = "uploading"
    #: After a termination notice: wait until durable, then park (or hold, fenced).
    PARKING = "parking"
    DONE = "done"


SAVE_TRANSITIONS: dict[SaveState, frozenset[SaveState]] = {
    SaveState.START: frozenset({SaveState.WAITING, SaveState.BESIDE, SaveState.AFTER}),
    SaveState.WAITING: frozenset({SaveState.BESIDE, SaveState.AFTER}),
    SaveState.BESIDE: frozenset({SaveState.CAPTURING}),
    SaveState.AFTER: frozenset({SaveState.CAPTURING}),
    SaveState.CAPTURING: frozenset({SaveState.UPLOADING}),
    SaveState.UPLOADING: frozenset({SaveState.PARKING, SaveState.DONE}),
    SaveState.PARKING: frozenset({SaveState.DONE}),
    SaveState.DONE: frozenset(),
}


class _SaveRun:
    """One save of a :class:`Checkpoint` (a single writer: not a sharded one), as a
    state machine (:class:`SaveState`); what it keeps between its steps."""

    def __init__(self, ckpt: Checkpoint, step: int, forced: bool, hold: bool) -> None:
        self.ckpt = ckpt
        self.rt = ckpt._rt
        self.step_number = step
        self.forced = forced
        self.hold = hold
        # The upload still in flight when this save began; kept only by a save that
        # commits after it (BESIDE).
        self.previous: _Upload | _ShardedUpload | None = None
        self.park = False
        self.copy_budget = 0
        self.parts: int | None = None
        self.upload: _Upload | None = None

    def step(self, state: SaveState) -> SaveState:
        """Do what ``state`` does; the state that follows."""
        following: SaveState = getattr(self, f"_{state.value}")()
        return following

    def _start(self) -> SaveState:
        self.previous = self.ckpt._upload
        if self.previous is not None and not self.rt.park_requested:
            return SaveState.WAITING
        return self._after_wait()

    def _waiting(self) -> SaveState:
        # A save waits for the previous upload; a termination notice arriving
        # meanwhile makes this save the last one, which must not wait (BESIDE).
        previous = self.previous
        assert previous is not None
        while not previous.done(PARK_CHECK_SECONDS) and not self.rt.park_requested:
            pass
        return self._after_wait()

    def _after_wait(self) -> SaveState:
        self.park = self.rt.park_requested
        if self.park and self.previous is not None and not self.previous.done(0):
            return SaveState.BESIDE
        return SaveState.AFTER

    def _beside(self) -> SaveState:
        # Its buffers are still being written, so this save writes straight from the
        # training tensors (the cell is held after it anyway: its stall does not matter).
        self.ckpt._upload = None
        self.copy_budget, self.parts = 0, self.ckpt._plan_memory()[1]
        return SaveState.CAPTURING

    def _after(self) -> SaveState:
        self.previous = None
        self.ckpt.wait()
        self.copy_budget, self.parts = self.ckpt._plan_memory()
        return SaveState.CAPTURING

    def _capturing(self) -> SaveState:
        ckpt, rt, step = self.ckpt, self.rt, self.step_number
        if rt.fenced:
            rt.hold_fenced()
        started = time.monotonic()
        forced = self.forced or rt.force_save
        fmt = "dcp" if "torch" in sys.modules else "pickle"
        try:
            ckpt._cell.refresh(ckpt._objects)  # the followed variables' values now
            captured = snapshot.capture(ckpt._objects, ckpt._pool, step, self.copy_budget)
        except BaseException:
            ckpt._upload = ckpt._upload or self.previous
            raise
        # Only now is the notice served: if the copy raised, it is still pending.
        rt.force_save = False
        ckpt._warmed = True
        cid = new_id(step, rt.attempt)

        carry = rt.carry()
        parts = self.parts

        def files(upload: _Upload) -> FileWriters:
            parts_of = {"state": _state_writer(captured, upload, parts)}
            if carry:
                parts_of["carry"] = _carry_writer(carry, step)
            return parts_of

        self.upload = ckpt._upload = _Upload(rt, ckpt._store, cid, step, files, fmt, forced,
                                             started, bool(captured.live),
                                             after=self.previous)
        return SaveState.UPLOADING

    def _uploading(self) -> SaveState:
        upload = self.upload
        assert upload is not None
        if upload.live:
            # Live tensors (what did not fit in the budget) are written from the
            # training state itself: training must not change them until they are out.
            upload.live_written.wait()
        self.ckpt._last_step = self.step_number
        self.ckpt._last_time = time.monotonic()
        # A notice that came while this save stalled makes it the last one.
        self.park = self.park or self.rt.park_requested
        return SaveState.PARKING if self.park and self.hold else SaveState.DONE

    def _parking(self) -> SaveState:
        rt = self.rt
        if self.ckpt.wait() is not None:
            rt.park(self.step_number)
        if rt.fenced:
            rt.hold_fenced()
        # The save failed for another reason (reported): try again next time.
        rt.force_save = True
        return SaveState.DONE


def _sharded(objects: dict[str, Any]) -> bool:
    """Whether a registered module holds sharded tensors (FSDP, DTensor)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nothing can be sharded without it having been imported
    from spotnb.ckpt.sharded import holds_sharded

    return holds_sharded(objects)


def _initialised() -> bool:
    """Whether the cell runs in an initialised ``torch.distributed`` world (any size)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _world() -> tuple[int, int] | None:
    """``(rank, world size)`` when the cell runs in an initialised ``torch.distributed``
    world of more than one process (a distributed job), else None.

    Called at every ``maybe_save``: the rank and size are asked of a process group once,
    when it is first seen (a new default group, after a re-formation, is asked again).
    """
    global _world_seen
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.GroupMember.WORLD
    seen_group, seen = _world_seen
    if group is not seen_group:
        size = int(dist.get_world_size())
        seen = (int(dist.get_rank()), size) if size > 1 else None
        _world_seen = (group, seen)
    return seen


# The default process group _world() last asked, and its answer.
_world_seen: tuple[Any, tuple[int, int] | None] = (None, None)


def _read_carry(manifest: Manifest, directory: Path) -> Carry:
    """What a checkpoint carries of the log (verified with the rest), or nothing."""
    names = {f.name for f in manifest.files}
    return Carry.read(directory, names, f"checkpoint {manifest.id}")


# -- hooks the agent calls inside the kernel -----------------------------------------


def _user_ns() -> dict[str, Any]:
    try:
        from IPython import get_ipython
    except ImportError:
        shell = None
    else:
        shell = get_ipython()
    if shell is None:
        raise RuntimeError("spotnb.train.runtime._bootstrap must run inside an IPython kernel "
                           "(or be given user_ns); this is a spotnb bug, please report it")
    ns: dict[str, Any] = shell.user_ns
    return ns


def _bootstrap(user_ns: dict[str, Any] | None = None,
               env: dict[str, str] | None = None) -> None:
    """Called by the agent in the fresh kernel before the cell runs.

    Adds ``env`` to the environment (the attempt's own settings: the agent spawns the
    kernel before it knows which attempt it runs; subprocesses of the cell inherit
    them too), connects to the agent (``SPOTNB_AGENT_SOCKET``), loads the cell's
    captured inputs (``inputs.pkl`` in the job store: :mod:`spotnb.protocol.inputs`;
    the notebook's functions among them linked to the namespace) into the namespace,
    and binds ``spot`` to this module there.
    """
    from spotnb.protocol import inputs

    os.environ.update(env or {})
    # The agent unpacks the job's files while the kernel boots: forget any directory
    # listing the import system cached before they were there.
    importlib.invalidate_caches()
    _bound_peer_waits()
    rt = _rt()
    ns = _user_ns() if user_ns is None else user_ns
    try:
        data = rt.store.get(layout.INPUTS)
    except NotFound:
        data = None
    if data is not None:
        # Each input is pickled on its own, so one that cannot be read here (its
        # class lives in a module the instance lacks) is named.
        try:
            inputs.load(data, ns)
        except inputs.InputUnreadable as err:
            raise InputError(
                f"input {err.name!r} could not be unpickled on the instance: "
                f"{type(err.error).__name__}: {err.error}. Make the module that defines it "
                "importable on the instance, or create it inside the cell."
            ) from err.error
        _logger.info("loaded the job's inputs")
    ns["spot"] = sys.modules[__name__]


def _bound_peer_waits() -> None:
    """In a distributed job's worker: make the job's peer timeout the default timeout
    of every process group the cell creates without one of its own.

    torch's defaults are 30 minutes (gloo) and 10 (NCCL): a rank whose peer froze
    (no connection reset: a stopped process, a partitioned network) would wait that
    long in a collective. With the job's ``peer_timeout`` the collective fails in
    time, the worker ends and the node re-forms without the peer (spotnb.kernel_remote.multinode).
    A group created with an explicit ``timeout=`` keeps it.
    """
    seconds = os.environ.get(channel.ENV_PEER_TIMEOUT)
    if not seconds or "RANK" not in os.environ:
        return  # not a torchrun worker
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return  # no torch: nothing can wait on a peer
    import datetime

    timeout = datetime.timedelta(seconds=float(seconds))
    c10d.default_pg_timeout = timeout  # read by init_process_group and new_group
    if isinstance(c10d.default_pg_nccl_timeout, datetime.timedelta):  # NCCL built in
        c10d.default_pg_nccl_timeout = timeout


def _finish() -> None:
    """Called by the agent after the cell: blocks until everything is sent and durable.

    Flushes metrics, waits for the newest checkpoint upload, uploads every
    :func:`sync_dir` a last time, and closes the channel. Raises
    :class:`spotnb.ckpt.checkpoints.CheckpointError` (after all of that) if the newest
    checkpoint or a last directory upload is not durable. Safe to call twice; the
    next use of the API starts afresh.
    """
    rt = process.end()
    if _writer_import is not None:
        _writer_import.join()  # an interpreter must not exit in the middle of it
    if rt is None:
        return
    problems = rt.finish()
    if problems:
        raise CheckpointError("; ".join(problems))


def _sync(token: str) -> None:
    """Called by the agent (after a failed cell): send every row logged so far, then
    ``token``; the agent waits for it before it records the failure."""
    rt = process.existing()
    if rt is not None:
        rt.sync(token)


def _finish_at_exit() -> None:
    try:
        _finish()
    except CheckpointError as e:
        _logger.error("%s", e)


process.at_exit(_finish_at_exit)


def _save_outputs(names: Iterable[str], user_ns: dict[str, Any] | None = None) -> None:
    """Called by the agent after the cell: cloudpickle the outputs to ``outputs.pkl``.

    Raises :class:`OutputError` naming the variable that is missing or cannot be
    pickled, and :class:`spotnb.ckpt.checkpoints.FencedOff` if the lease was lost.
    """
    import cloudpickle

    rt = _rt()
    ns = _user_ns() if user_ns is None else user_ns
    names = list(names)
    missing = [name for name in names if name not in ns]
    if missing:
        raise OutputError(
            f"output {missing[0]!r} is not defined when the cell ends: assign it in the "
            "cell, or remove it from the cell's outputs"
        )
    outputs = {name: ns[name] for name in names}
    try:
        data = cloudpickle.dumps(outputs)
    except Exception as whole:
        # Name the culprit: pickle the values one by one (only on this error path).
        for name, value in outputs.items():
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise OutputError(
                    f"output {name!r} (a {type(value).__name__}) cannot be pickled: {e}. "
                    "Return something picklable instead (e.g. model.state_dict() rather "
                    "than an object holding files, locks or sockets), or remove it from "
                    "the cell's outputs"
                ) from e
        raise OutputError(f"the outputs cannot be pickled together: {whole}") from whole
    if not rt.fence():
        raise FencedOff("outputs were not written: this agent lost the job's lease")
    retrying(lambda: rt.store.put(layout.OUTPUTS, data), "writing the outputs")
