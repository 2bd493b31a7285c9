"""A node that waits to join a running world: the save before the join, and who joined.

A node waiting to join makes torchelastic restart the workers (its rendezvous
handler's ``num_nodes_waiting``), which would redo every step since the last
checkpoint on every rank. So the first time a node waits while the cell runs, the
runtimes are asked to save (the notice's coordinated checkpoint: every rank at the
same step), and torchelastic is told no node waits until that save is durable and the
runtimes ask to re-form (the workers are then UNHEALTHY: the same restart, from the new
checkpoint). A cell that saves nothing within JOIN_SAVE_SECONDS re-forms without it.
:class:`Joins` keeps the join's state for a node's run
(:class:`spotnb.kernel_remote.multinode.node.NodeRun`), whose answer torchelastic's
handler gives (:class:`spotnb.kernel_remote.multinode.elastic.SaveBeforeJoin`), and
once the new round restored, global rank 0's node says who joined (a ``joined`` event).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from spotnb.kernel_remote import channel
from spotnb.kernel_remote.multinode import JOIN_SAVE_SECONDS
from spotnb.protocol import lease

if TYPE_CHECKING:
    from torch.distributed.elastic.agent.server.api import WorkerGroup

    from spotnb.kernel_remote.multinode.agentapi import Agent
    from spotnb.kernel_remote.multinode.worker import WorkerRun

__all__ = ["Joins"]


class Joins:
    """The joins of a node's run (module docstring), in the node slot ``slot``;
    ``instance_gone``: the provider's check of an instance, if it has one."""

    def __init__(self, agent: Agent, slot: int,
                 instance_gone: Callable[[str], bool] | None) -> None:
        self.agent = agent
        self.slot = slot
        self.instance_gone = instance_gone
        # When this node asked its runtimes for the save before the join (monotonic),
        # and the step of that save once durable; the slots held at this round's start
        # (rank 0's node).
        self.join_asked: float | None = None
        self.join_step: int | None = None
        self.after_join: int | None = None
        self.round_slots: set[int] | None = None
        self.slots_before: set[int] | None = None

    def nodes_waiting(self, waiting: int, workers: Sequence[WorkerRun],
                      reforming: bool) -> int:
        """torchelastic's ``num_nodes_waiting``, after the save before a join (module
        docstring); ``workers``: this round's, ``reforming``: the runtimes asked to
        re-form."""
        if waiting <= 0 or reforming:
            return waiting
        runs = list(workers)
        if not runs or any(r.state != "running" for r in runs):
            return waiting  # no cell runs yet: nothing to lose
        if self.join_asked is None:
            self.join_asked = time.monotonic()
            self.agent.emit("status", state="checkpointing", detail=(
                f"{waiting} node{'s' if waiting != 1 else ''} waiting to join: every rank "
                "saves at its next maybe_save, then the world re-forms"))
            self.agent.send(channel.Notice(kind="join"))
            return 0
        if time.monotonic() - self.join_asked > JOIN_SAVE_SECONDS:
            return waiting
        return 0

    def round_started(self, rank0_here: bool) -> None:
        """A round formed: the join saved for (if any) is this round's; rank 0's node
        notes the slots held now."""
        self.after_join = self.join_step
        self.join_asked = self.join_step = None
        if rank0_here:
            self.slots_before = self.round_slots
            self.round_slots = self._held_slots()

    def restored(self, step: int, group: WorkerGroup | None, rank0_here: bool) -> None:
        """A runtime restored the checkpoint of ``step``: after a join, global rank 0's
        node says who joined, the step saved before re-forming and the one restored
        (``joined`` event; the steps redone are the fold's, from the rows that follow:
        every rank held at the join's save, so none, unless that save could not be read
        and an older one was)."""
        if self.after_join is None or not rank0_here or group is None:
            return
        before, self.after_join = self.after_join, None
        joined = sorted((self.round_slots or set()) - self.slots_before) \
            if self.slots_before is not None else []
        self.agent.emit("joined", nodes=joined, node_count=group.group_world_size,
                        world_size=group.workers[0].world_size, step=step,
                        saved_step=before)
        self.agent.flush_soon()

    def _held_slots(self) -> set[int] | None:
        """The node slots whose lease is held now (who is in the world), or None."""
        try:
            found = set()
            for slot in range(self.agent.spec.resources.max_nodes):
                current = lease.read(self.agent.store, slot)
                if current is None or current[0].released:
                    continue
                gone = self.instance_gone
                if slot == self.slot or gone is None or not gone(current[0].holder):
                    found.add(slot)
            return found
        except Exception:
            return None
