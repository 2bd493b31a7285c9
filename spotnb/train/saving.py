"""When a :class:`~spotnb.train.checkpoint.Checkpoint` saves, and how one save goes.

:class:`Saves` is what the saves of one checkpoint share (its store, the host buffers,
the upload in flight, the policy's count) and the seam between the checkpoint and its
saves: the checkpoint hands it the registered objects and how to read the cell's
followed variables, and every save goes through it. It decides when to save
(``maybe_save``: the job's ``checkpoint_every``, a notice, a node waiting to join a
distributed job) and starts the save: one writer's (:class:`SaveRun`), or every rank's
part of a sharded checkpoint (:meth:`Saves.save_sharded`). The uploads themselves, in
the background, are :mod:`spotnb.train.upload`.

One writer's save is a state machine (:class:`SaveState`, :data:`SAVE_TRANSITIONS`)::

    START -> WAITING (an upload in flight) -> AFTER (it ended) or BESIDE (a notice came)
    START -> AFTER (nothing in flight) or BESIDE (a notice, an upload in flight)
    AFTER / BESIDE -> CAPTURING -> UPLOADING -> DONE, or PARKING (after a notice) -> DONE
"""

from __future__ import annotations

import enum
import sys
import time
from collections.abc import Callable
from typing import Any, ClassVar

from spotnb.ckpt import MAX_FILES, PIECE_BYTES, snapshot
from spotnb.ckpt.checkpoints import CHECKPOINT_FORMATS, CheckpointStore, Manifest, new_id
from spotnb.ckpt.memory import MemoryBudget
from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.train import process
from spotnb.train.carry import Carry
from spotnb.train.distributed import holds_sharded, initialised, world
from spotnb.train.session import Session
from spotnb.train.upload import (
    CheckpointUpload,
    FileWriters,
    ShardedUpload,
    carry_writer,
    state_writer,
)

# While a save waits for the previous upload, how often it looks for a termination
# notice (which ends the wait: the last save must fit in the notice period).
PARK_CHECK_SECONDS = 0.02
# Upload parts in flight per checkpoint file, at most (stores that upload in parts):
# S3's default (spotnb.providers.aws.store.STREAM_PARTS_IN_FLIGHT).
MAX_PARTS_IN_FLIGHT = 10


class Saves:
    """The saves of one checkpoint (module docstring).

    ``objects``: the registered objects (the checkpoint's own dict, which a restore
    updates in place); ``refresh``: reads the cell's followed variables into it
    (:mod:`spotnb.train.cellvars`), before each capture.
    """

    def __init__(self, objects: dict[str, Any], refresh: Callable[[], None],
                 budget: MemoryBudget) -> None:
        rt = process.current()
        self.objects = objects
        self._refresh = refresh
        self.budget = budget
        self.store = CheckpointStore(rt.store, layout.CHECKPOINTS, keep=rt.keep,
                                     formats=CHECKPOINT_FORMATS)
        self.pool = snapshot.BufferPool()
        #: The host buffers of the next save are allocated (or being allocated).
        self.warmed = False
        #: A sharded save failed (reported): the next maybe_save saves (every rank).
        self.retry = False
        if "torch" in sys.modules and world() is None:
            # Allocate the host buffers for the state that exists now (the model; an
            # optimizer's state appears at its first step: maybe_save warms that) in
            # the background, while the loop starts: filling fresh pages was most of a
            # first save's stall. A save that comes first shares the work
            # (snapshot.BufferPool). Distributed jobs warm at their first maybe_save.
            self.pool.warm_async(snapshot.tensor_specs(self.objects), self.plan_memory()[0])
        #: The upload still running, if any: the next save waits for it.
        self.in_flight: CheckpointUpload | ShardedUpload | None = None
        self._last_step = -1
        self._last_time = time.monotonic()

    @property
    def rt(self) -> Session:
        """The current session (a new one after ``_finish()``, e.g. when a cell re-runs)."""
        return process.current()

    # -- memory ----------------------------------------------------------------------

    def plan_memory(self) -> tuple[int, int | None]:
        """(bytes of tensors a capture may copy, upload parts in flight per file).

        The budget less what the writer needs besides the copies: upload part buffers
        (stores that upload in parts) and GPU staging buffers, for every file a
        checkpoint may be written as at once.
        """
        budget = self.budget.bytes(held=self.pool.held)
        torch = sys.modules.get("torch")
        reserve = MAX_FILES * PIECE_BYTES if torch is not None and \
            torch.cuda.is_available() else 0
        part = self.rt.store.part_bytes
        parts: int | None = None
        if part:
            # Up to a quarter of the budget for upload parts, within what a writer uses
            # at most, and at least one part uploading while the next one fills.
            per_file = budget // 4 // MAX_FILES // part - 1
            parts = max(1, min(per_file, MAX_PARTS_IN_FLIGHT))
            reserve += MAX_FILES * (parts + 1) * part
        return max(0, budget - reserve), parts

    def warm(self) -> None:
        """Allocate the host buffers of the next save in the background (see
        :class:`~spotnb.ckpt.snapshot.BufferPool`), on a rank that saves: every rank of a
        sharded job (its own shards), else only global rank 0."""
        self.warmed = True
        where = world()
        if holds_sharded(self.objects):
            from spotnb.ckpt import sharded

            specs = sharded.stage_specs(self.objects)
        elif where is None or where[0] == 0:
            specs = snapshot.tensor_specs(self.objects)
        else:
            return  # a replica of rank 0's state: rank 0 saves it
        self.pool.warm_async(specs, self.plan_memory()[0])

    def capture(self, step: int, copy_budget: int) -> snapshot.Captured:
        """The state now (the followed variables' values read first), copied into host
        memory as far as ``copy_budget`` bytes go (:func:`spotnb.ckpt.snapshot.capture`)."""
        self._refresh()
        return snapshot.capture(self.objects, self.pool, step, copy_budget)

    # -- the policy ------------------------------------------------------------------

    def count_from(self, step: int) -> None:
        """The policy counts seconds and steps from ``step``, now (a save, a restore)."""
        self._last_step = step
        self._last_time = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether the job's ``checkpoint_every`` says ``step`` saves."""
        every = self.rt.every
        return (every.steps is not None and step - self._last_step >= every.steps) or (
            every.seconds is not None and time.monotonic() - self._last_time >= every.seconds)

    def save(self, step: int) -> None:
        """:meth:`Checkpoint.save <spotnb.train.checkpoint.Checkpoint.save>`."""
        where = world()
        if where is not None and holds_sharded(self.objects):
            self.save_sharded(step, *where, forced=False)  # every rank calls save
            self.count_from(step)
            return
        self.save_one(step, forced=False)

    def maybe_save(self, step: int) -> bool:
        """:meth:`Checkpoint.maybe_save <spotnb.train.checkpoint.Checkpoint.maybe_save>`."""
        rt = self.rt
        where = world()
        if where is not None:
            return self._maybe_save_in_world(int(step), *where)
        if rt.force_save or rt.park_requested or rt.fenced:
            self.save_one(int(step), forced=True)
            if rt.join_requested and not (rt.park_requested or rt.fenced):
                # A distributed job shrunk to one process: a node waits to join; once
                # this save is durable the world re-forms with it (redoing no step).
                if self.wait() is not None:
                    rt.hold_for_reform(int(step))
                rt.force_save = True  # the save failed (reported): again next time
            return True
        if self.due(step):
            self.save_one(int(step), forced=False)
            return True
        if not self.warmed:
            # The first call that does not save: allocate the host buffers now, in the
            # background, so the first save is a memory copy too (the optimizer state
            # exists by now, after a first step).
            self.warm()
        return False

    def _maybe_save_in_world(self, step: int, rank: int, world_size: int) -> bool:
        """``maybe_save`` in a distributed job (every rank calls it at the same steps).

        Step 1  one all-reduce (MAX) of [a notice on my node, a save due here]: every
                rank decides the same, so a notice on any node saves at one step. A
                rebalance recommendation is a save due, not a notice: every rank
                saves at once and the world goes on as it is (its node's warm standby
                takes over later, through that node's notice).
        Step 2  global rank 0 writes the checkpoint (DDP: every rank holds the same
                state; spotnb.kernel_remote.multinode), every other rank only notes the step; or,
                when a registered module holds sharded tensors (FSDP), every rank
                writes its own shards (:meth:`save_sharded`).
        Step 3  after a notice: rank 0 waits until it is durable and broadcasts
                whether it is; then the noticed node's ranks park (its agent leaves
                the world) and every other rank asks its agent to re-form without it
                (torchelastic restarts them from this checkpoint). A node waiting to
                join is the same save (its agents' ``join`` notice), after which every
                rank asks to re-form: the join redoes no step.
        """
        import torch
        import torch.distributed as dist

        rt = self.rt
        # A recommendation's save: every rank saves now, none holds for a re-formation
        # (the world would re-form around the node it is for, which stays).
        rebalance = rt.force_save and rt.notice == "rebalance" and not (
            rt.park_requested or rt.fenced or rt.join_requested)
        noticed = (rt.force_save and not rebalance) or rt.park_requested or rt.fenced
        flags = torch.tensor([float(noticed),
                              float(self.due(step) or self.retry or rebalance),
                              float(rt.join_requested)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        notice_anywhere, due = bool(flags[0].item()), bool(flags[1].item())
        if flags[2].item():
            rt.join_requested = True  # a node waits to join: this save is before it
        if not (notice_anywhere or due):
            if not self.warmed:
                self.warm()  # as maybe_save's first call that does not save
            return False
        if not notice_anywhere:
            rt.force_save = False  # a recommendation's (if any): served by this save
        if holds_sharded(self.objects):
            # Sharded state (FSDP): every rank writes its shards, at once (see
            # save_sharded); the outcome is known on every rank when it returns.
            durable = self.save_sharded(step, rank, world_size, forced=notice_anywhere)
            self.count_from(step)
            if not notice_anywhere:
                return True
        else:
            if rank == 0:
                self.save_one(step, forced=notice_anywhere, hold=False)
            self.count_from(step)
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

    # -- saving ----------------------------------------------------------------------

    def wait(self) -> Manifest | None:
        """Wait for the save in progress; its manifest, or None (none, it failed, or
        this rank of a sharded checkpoint is not the one that commits it)."""
        upload, self.in_flight = self.in_flight, None
        if upload is None:
            return None
        return upload.wait()

    def save_one(self, step: int, forced: bool, hold: bool = True) -> None:
        """Save (one writer: :class:`SaveRun`); after a notice, wait until durable and
        park (``hold``; a distributed job's rank 0 parks in :meth:`maybe_save`'s world
        branch instead)."""
        rt = self.rt
        if initialised() and holds_sharded(self.objects):
            # Sharded state in a world of one process (a job shrunk to one node): its
            # tensors are DTensors, which only DCP's state-dict API saves.
            durable = self.save_sharded(step, 0, 1, forced)
            self.count_from(step)
            if durable and hold and rt.park_requested:
                rt.park(step)
            return
        SaveRun(self, step, forced, hold).run()

    def save_sharded(self, step: int, rank: int, world_size: int, forced: bool) -> bool:
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
        Step 3  in the background (:class:`~spotnb.train.upload.ShardedUpload`), rank 0
                writes the manifest (every rank's files) and moves ``LATEST`` after its
                own fencing check.
        Step 4  after a notice only: every rank waits for its save; rank 0 broadcasts
                whether it is durable.
        """
        import torch
        import torch.distributed as dist

        from spotnb.ckpt import sharded

        rt = self.rt
        self.wait()  # step 1
        if rt.fenced:
            rt.hold_fenced()
        started = time.monotonic()
        forced = forced or rt.force_save
        chosen: list[str | None] = [new_id(step, rt.attempt) if rank == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        cid = str(chosen[0])
        pending = self.store.begin(step, attempt=rt.attempt, checkpoint_id=cid)
        answers: list[bool] = []

        def fence() -> bool:
            answers.append(rt.fence())
            return answers[-1]

        if rank == 0:  # one report per checkpoint, as a single-node job's
            rt.send(channel.CheckpointPhase(phase="begin", id=cid, step=step, forced=forced,
                                            bytes=0, seconds=0.0))
        carry = rt.carry() if rank == 0 else Carry()
        copy_budget, parts = self.plan_memory()
        self.retry = False
        self._refresh()  # the followed variables' values now
        future, copied = sharded.save(self.objects, pending, step=step, rank=rank,
                                      fence=fence, pool=self.pool, copy_budget=copy_budget,
                                      parts_in_flight=parts)  # step 2
        # Only now is a notice served: if this save fails, the next one retries.
        rt.force_save = False
        self.warmed = True
        upload = self.in_flight = ShardedUpload(rt, self.store, cid, step, rank, world_size,
                                                future, pending, carry, forced, started,
                                                answers, copied, retry=self._retry_next)
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

    def _retry_next(self) -> None:
        self.retry = True


class SaveState(enum.Enum):
    """Where one save of a checkpoint is (:class:`SaveRun`). The transitions are
    :data:`SAVE_TRANSITIONS`; what each state does is its :class:`SaveRun` step."""

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


class SaveRun:
    """One save by a single writer (not a sharded one), as a state machine
    (:class:`SaveState`): :attr:`STEPS` says what each state does, and what the steps
    share is kept here. What it uses of its checkpoint is :class:`Saves`."""

    def __init__(self, saves: Saves, step: int, forced: bool, hold: bool) -> None:
        self.saves = saves
        self.rt = saves.rt
        self.step_number = step
        self.forced = forced
        self.hold = hold
        # The upload still in flight when this save began; kept only by a save that
        # commits after it (BESIDE).
        self.previous: CheckpointUpload | ShardedUpload | None = None
        self.park = False
        self.copy_budget = 0
        self.parts: int | None = None
        self.upload: CheckpointUpload | None = None

    def run(self) -> None:
        """From START to DONE, each transition checked against :data:`SAVE_TRANSITIONS`."""
        state = SaveState.START
        while state is not SaveState.DONE:
            following = self.STEPS[state](self)
            assert following in SAVE_TRANSITIONS[state], (state, following)
            state = following

    def _start(self) -> SaveState:
        self.previous = self.saves.in_flight
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
        self.saves.in_flight = None
        self.copy_budget, self.parts = 0, self.saves.plan_memory()[1]
        return SaveState.CAPTURING

    def _after(self) -> SaveState:
        self.previous = None
        self.saves.wait()
        self.copy_budget, self.parts = self.saves.plan_memory()
        return SaveState.CAPTURING

    def _capturing(self) -> SaveState:
        saves, rt, step = self.saves, self.rt, self.step_number
        if rt.fenced:
            rt.hold_fenced()
        started = time.monotonic()
        forced = self.forced or rt.force_save
        fmt = "dcp" if "torch" in sys.modules else "pickle"
        try:
            captured = saves.capture(step, self.copy_budget)
        except BaseException:
            saves.in_flight = saves.in_flight or self.previous
            raise
        # Only now is the notice served: if the copy raised, it is still pending.
        rt.force_save = False
        saves.warmed = True
        cid = new_id(step, rt.attempt)

        carry = rt.carry()
        parts = self.parts

        def files(upload: CheckpointUpload) -> FileWriters:
            parts_of = {"state": state_writer(captured, upload, parts)}
            if carry:
                parts_of["carry"] = carry_writer(carry, step)
            return parts_of

        self.upload = saves.in_flight = CheckpointUpload(
            rt, saves.store, cid, step, files, fmt, forced, started, bool(captured.live),
            after=self.previous)
        return SaveState.UPLOADING

    def _uploading(self) -> SaveState:
        upload = self.upload
        assert upload is not None
        if upload.live:
            # Live tensors (what did not fit in the budget) are written from the
            # training state itself: training must not change them until they are out.
            upload.live_written.wait()
        self.saves.count_from(self.step_number)
        # A notice that came while this save stalled makes it the last one.
        self.park = self.park or self.rt.park_requested
        return SaveState.PARKING if self.park and self.hold else SaveState.DONE

    def _parking(self) -> SaveState:
        rt = self.rt
        if self.saves.wait() is not None:
            rt.park(self.step_number)
        if rt.fenced:
            rt.hold_fenced()
        # The save failed for another reason (reported): try again next time.
        rt.force_save = True
        return SaveState.DONE

    #: The step of each state but DONE: it does the state's work and returns the state
    #: that follows.
    STEPS: ClassVar[dict[SaveState, Callable[[SaveRun], SaveState]]] = {
        SaveState.START: _start, SaveState.WAITING: _waiting, SaveState.BESIDE: _beside,
        SaveState.AFTER: _after, SaveState.CAPTURING: _capturing,
        SaveState.UPLOADING: _uploading, SaveState.PARKING: _parking,
    }
