"""What a display of a job shows: :class:`JobView`, the job's fold and the little only a
display needs.

Every fact about the job (its status and reason, the attempt and the instance it runs
on, the prices, the current step, the metrics, the interruptions, the world) is the
fold's (:class:`~spotnb.protocol.events.fold.JobState`, :attr:`JobView.folded`), which
the view applies each event to; the view's properties read it. What the view keeps
itself is what only a display has: the remote cell's last value, whether the user
detached, the nodes' joins it told already, and the figures as last accounted
(:meth:`JobView.account`, from the same fold).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from spotnb.protocol.events import GROUP_STREAM, Event, codec, is_terminal
from spotnb.protocol.events.fold import AttemptState, JobState, Join, savings_pct

if TYPE_CHECKING:
    from spotnb.client.results import JobResult

__all__ = ["JobView"]


@dataclasses.dataclass
class JobView:
    """What a display of a job shows (module docstring). ``folded``: the job's fold
    (one per followed job: the follow loop hands the same to the dashboard)."""

    job_id: str
    name: str
    created: float
    # A multi-node job's node counts (``--nodes MIN:MAX``; 1:1 for one node).
    min_nodes: int = 1
    max_nodes: int = 1
    folded: JobState = dataclasses.field(default_factory=JobState)
    #: ``result.json``, once read (the job's own word on how it ended).
    record: dict[str, Any] | None = None
    last_milestone: str = ""
    # The remote cell's last value (an ``execute_result`` MIME bundle), if any.
    execute_result: dict[str, Any] | None = None
    outputs: tuple[str, ...] = ()
    detached: bool = False
    # The figures as last accounted (:meth:`account`): cost, on-demand cost, the time
    # since the job started, spotnb's own requests (None: not accounted) and what the
    # cost includes, in words, and when (the live clock, or the job's end).
    cost_usd: float = 0.0
    ondemand_cost_usd: float = 0.0
    elapsed: float = 0.0
    requests_usd: float | None = None
    cost_includes: str | None = None
    now: float = 0.0
    #: The ``world`` event just applied if it changed the world (its milestone says
    #: how), else None.
    world_changed: Event | None = None
    # Attempts whose last output a later attempt recovered from their checkpoint.
    recovered: set[int] = dataclasses.field(default_factory=set)
    _cell_attempt: int = 0  # the attempt whose cell's last value this is
    _joins_told: int = 0

    def __post_init__(self) -> None:
        self.folded.max_nodes = max(self.folded.max_nodes, self.max_nodes)
        self.folded.steps.scan = self.folded.steps.scan or self.folded.max_nodes > 1

    # -- input ---------------------------------------------------------------------

    def apply(self, event: Event) -> None:
        """Fold one event in (a ``metrics`` batch: its rows, in bulk) and keep what only
        a display needs of it."""
        if codec.is_row(event) or codec.is_batch(event):  # the hot path: no body built
            self.folded.apply(event)
            self.world_changed = None
            return
        worlds = len(self.folded.worlds)
        self.folded.apply(event)
        body = event.body
        # Every node of a round says the same: only a change is news. A node's stream
        # read late may bring an older round's report: the fold puts it in its place in
        # the job's history, but it is not news (the latest world is not its).
        self.world_changed = event if isinstance(body, codec.World) and \
            len(self.folded.worlds) > worlds and self.folded.worlds[-1][0] == event.time \
            else None
        if isinstance(body, codec.Status) and event.attempt != GROUP_STREAM and \
                body.state == "booting" and event.attempt > self._cell_attempt:
            self._cell_attempt = event.attempt
            self.execute_result = None  # the cell runs again from the top
        elif isinstance(body, codec.Display) and body.execute_result:
            self.execute_result = {"data": body.data, "metadata": body.metadata}

    def account(self, result: JobResult) -> None:
        """Take the cost and the duration from a summary of the fold."""
        self.cost_usd = result.cost_usd
        self.ondemand_cost_usd = result.ondemand_cost_usd
        self.elapsed = result.duration
        self.requests_usd = result.requests_usd
        self.cost_includes = result.cost_includes
        ended = is_terminal(result.status)
        self.now = self.created + result.duration if ended else time.time()
        if ended:
            self.outputs = tuple(sorted(result.outputs))

    def joins_told(self) -> list[tuple[Join, int]]:
        """The nodes' joins whose steps redone the fold now knows and the view has not
        told yet, each with that count (once each)."""
        out = []
        joins = self.folded.joins
        while self._joins_told < len(joins):
            redone = self.folded.join_redone(joins[self._joins_told])
            if redone is None:
                break
            out.append((joins[self._joins_told], redone))
            self._joins_told += 1
        return out

    # -- what the fold says ------------------------------------------------------------

    @property
    def state(self) -> str:
        """The job's status (:meth:`JobState.outcome`)."""
        return self.folded.outcome(self.record)[0]

    @property
    def final(self) -> bool:
        return is_terminal(self.state)

    @property
    def detail(self) -> str:
        """What the job is doing, in words (its newest status's)."""
        return self.folded.detail

    @property
    def reason(self) -> str:
        """Why the job ended (its outcome's reason)."""
        return self.folded.outcome(self.record)[1]

    @property
    def current(self) -> AttemptState | None:
        return self.folded.current_attempt()

    @property
    def attempt(self) -> int:
        """The newest attempt that booted (0: none yet)."""
        current = self.current
        return 0 if current is None else current.number

    @property
    def instance_id(self) -> str | None:
        current = self.current
        return None if current is None else current.instance_id

    @property
    def instance_type(self) -> str | None:
        current = self.current
        if current is not None and current.instance_type:
            return current.instance_type
        inst = None if current is None else self.folded.instances.get(current.instance or "")
        launched = list(self.folded.instances.values())
        inst = inst or (launched[-1] if launched else None)
        return None if inst is None else inst.instance_type

    @property
    def az(self) -> str | None:
        current = self.current
        return None if current is None else current.az

    @property
    def spot_price(self) -> float | None:
        price = self.folded.price_now()
        return None if price is None else price[0]

    @property
    def ondemand_price(self) -> float | None:
        price = self.folded.price_now()
        return None if price is None else price[1]

    @property
    def step(self) -> int | None:
        """The current step (the fold's: a late row of an ended attempt leaves it)."""
        return self.folded.steps.step

    @property
    def metrics(self) -> dict[str, float]:
        return self.folded.metrics()

    @property
    def interruptions(self) -> int:
        return self.folded.interruptions()

    @property
    def worlds(self) -> list[tuple[float, int, int]]:
        return self.folded.worlds

    @property
    def world_nodes(self) -> int:
        return self.worlds[-1][1] if self.worlds else 0

    @property
    def world_size(self) -> int:
        return self.worlds[-1][2] if self.worlds else 0

    @property
    def multinode(self) -> bool:
        """Whether the job may run on more than one node."""
        return self.max_nodes > 1

    @property
    def savings_pct(self) -> float | None:
        return savings_pct(self.cost_usd, self.ondemand_cost_usd)
