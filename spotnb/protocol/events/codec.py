"""The event vocabulary, typed: one small frozen dataclass per event type.

An :class:`~spotnb.protocol.events.Event` is the envelope as the log stores it (``type``,
``time``, ``attempt``, ``instance``, ``n`` and a ``data`` dict); its ``body`` is the
typed payload, decoded once per event (the first time it is asked for) by
:func:`decode`. Readers dispatch on the body's class (``isinstance(e.body,
codec.Status)``) instead of testing type strings; this module and the fold
(:mod:`spotnb.protocol.events.fold`) are the only places that know them.

A type this version does not know (a log written by a newer spotnb) decodes to
:class:`Unknown`, which every reader ignores. A field missing or of the wrong kind in
an old or hand-written log decodes to its default rather than raising.

``metrics`` batches decode to :class:`Metrics`, which holds nothing: a reader takes its
columns with :func:`~spotnb.protocol.events.metric_columns` (the hot path: no object per row).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spotnb.protocol.events import Event

__all__ = [
    "Body",
    "CheckpointEvent",
    "Display",
    "Error",
    "Instance",
    "Metric",
    "Metrics",
    "Notice",
    "Params",
    "Price",
    "ProgressTotal",
    "Pruned",
    "Region",
    "Result",
    "Standby",
    "Status",
    "Stream",
    "Sys",
    "Transfer",
    "Unknown",
    "Usage",
    "Warning",
    "World",
    "decode",
    "is_batch",
    "is_control",
    "is_output",
    "is_row",
    "peek",
]


def _str(value: Any, default: str = "") -> str:
    return default if value is None else str(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None or value == "" else str(value)


def _opt_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(value) if value is not None else default
    except (TypeError, ValueError):
        return default


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclasses.dataclass(frozen=True)
class Status:
    """``status``: the job's state as the attempt (or the group) says it."""

    state: str
    detail: str = ""
    instance_type: str | None = None
    az: str | None = None
    region: str | None = None  # a boot's: the region of its instance
    # A boot of the same attempt again (max_restarts_on_error), not a new one: the agent
    # says so in the event's ``retrying`` field where it decides to retry.
    retrying: bool = False


@dataclasses.dataclass(frozen=True)
class Metric:
    """``metric``: one row of metrics."""

    step: float | None
    t: float
    values: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Metrics:
    """``metrics``: a batch of rows by column (read with ``metric_columns``)."""


@dataclasses.dataclass(frozen=True)
class ProgressTotal:
    """``progress``: the steps of the run."""

    total: int | None
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Stream:
    """``stream``: stdout/stderr text (``replayed_by``: the attempt that recorded it
    from the checkpoint that carried it, its own attempt's instance lost first)."""

    name: str
    text: str
    replayed_by: int | None = None


@dataclasses.dataclass(frozen=True)
class Display:
    """``display``: a rich output."""

    kind: str
    data: dict[str, Any]
    metadata: dict[str, Any]
    display_id: str | None = None
    wait: bool = False  # a clear_output's

    @property
    def execute_result(self) -> bool:
        return self.kind == "execute_result"


@dataclasses.dataclass(frozen=True)
class Sys:
    """``sys``: a utilisation sample."""

    kind: str
    util: float | None
    mem_used: float | None
    mem_total: float | None


@dataclasses.dataclass(frozen=True)
class CheckpointEvent:
    """``checkpoint``: a save's phase (or a synced directory's snapshot, ``kind`` "sync")."""

    phase: str
    step: int | None = None
    bytes: int = 0
    forced: bool = False
    kind: str = ""
    name: str = ""
    id: str | None = None  # the save's id (the same in each of its phases)

    @property
    def durable(self) -> bool:
        return self.phase == "durable"

    @property
    def sync(self) -> bool:
        return self.kind == "sync"


@dataclasses.dataclass(frozen=True)
class Params:
    """``params``: hyperparameters."""

    params: dict[str, Any] | None
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class Notice:
    """``notice``: an interruption notice (``instance-action``) or a rebalance
    recommendation, as the attempt's agent saw it."""

    kind: str
    action: str | None = None
    notice_time: Any = None
    #: ``auto-scaling``: the group ends the instance because its warm standby is in
    #: service (capacity rebalancing), not EC2 taking it back.
    source: str | None = None

    @property
    def interruption(self) -> bool:
        return self.kind == "instance-action"

    @property
    def moved(self) -> bool:
        """The end of the instance the job moves away from, to its standby."""
        return self.interruption and self.source == "auto-scaling"


@dataclasses.dataclass(frozen=True)
class Price:
    """``price``: a pool's spot price from this time on."""

    pool: str
    price: float | None
    instance_type: str | None = None
    az: str | None = None
    ondemand: float | None = None
    #: Where the prices come from (AWS: live; the local cloud: the history it replays),
    #: and for a replay, the real moment this price is from (ISO) and the real seconds
    #: that pass per wall second.
    source: str | None = None
    history_time: str | None = None
    history_scale: float | None = None


@dataclasses.dataclass(frozen=True)
class Instance:
    """``instance``: the group launched, noticed or terminated an instance, or found no
    capacity in a pool."""

    action: str
    instance_id: str | None = None
    instance_type: str | None = None
    az: str | None = None
    region: str | None = None
    pool: str = ""
    price: float | None = None
    ondemand: float | None = None
    reason: str | None = None
    standby_for: str | None = None  # a warm standby's: the instance it stands by for
    kernel_started: float | None = None  # a standby's, once ready
    # A launch's: market seconds a real second (the local cloud's compressed time; an
    # instance's first hour, which an interruption refunds, is that long in market time).
    time_scale: float = 1.0
    standby_due: float | None = None  # a deferred standby's launch time
    # A failed boot's (spotnb.providers.aws.bootreport): the step that failed, the last
    # lines of the boot log, and the failed boots in a row of the job's limit.
    step: str | None = None
    log: tuple[str, ...] = ()
    failures: int | None = None
    limit: int | None = None

    @property
    def launched(self) -> bool:
        return self.action == "launched"

    @property
    def terminated(self) -> bool:
        return self.action == "terminated"

    @property
    def noticed(self) -> bool:
        return self.action == "notice"

    @property
    def rebalance(self) -> bool:
        """The local cloud published a rebalance recommendation (``reason``: the
        interruption it stands for, or ``false-alarm``)."""
        return self.action == "rebalance"

    @property
    def standby_ready(self) -> bool:
        """A warm standby's kernel is started and its cell waits at its restore point."""
        return self.action == "standby-ready"

    @property
    def standby_deferred(self) -> bool:
        """A recommendation in the instance's first hour: its standby launches at
        ``standby_due``, to be ready as that hour ends (spotnb.protocol.billing)."""
        return self.action == "standby-deferred"

    @property
    def capacity_error(self) -> bool:
        return self.action == "capacity_error"

    @property
    def boot_failed(self) -> bool:
        """The instance's bootstrap failed (AWS): it reported why and powered off."""
        return self.action == "boot-failed"


@dataclasses.dataclass(frozen=True)
class Region:
    """``region``: the region the capacity group launches the job's instances in from
    now on (``spotnb.providers.failover``), and why. ``previous``: where it
    launched before (None at the job's start); ``cause``: ``start`` (the launch's
    ranking chose it) or ``no-capacity`` (a move: ``tries`` launch rounds in a row found
    no capacity in ``previous``); ``reason`` says it in words; ``home``: the region of
    the job's store, which never moves."""

    region: str
    previous: str | None = None
    cause: str = ""
    reason: str = ""
    home: str | None = None
    tries: int = 0
    estimate: str = ""  # the ranking's account of ``region``: its expected cost

    @property
    def moved(self) -> bool:
        """The job left ``previous`` for ``region`` (not its first choice)."""
        return self.previous is not None and self.previous != self.region


@dataclasses.dataclass(frozen=True)
class Transfer:
    """``transfer``: a checkpoint's bytes that crossed regions, as AWS bills them (the
    sending region pays): ``kind`` ``save`` (an instance outside the home region sent a
    checkpoint to the store) or ``restore`` (one read it from there), ``bytes`` from
    ``source`` to ``destination`` at ``usd_per_gb``, ``usd`` in all. ``key`` names the
    crossing (the save's id, the attempt that restored): a fold counts a key once."""

    kind: str
    bytes: int
    source: str
    destination: str
    usd: float
    usd_per_gb: float = 0.0
    key: str = ""
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class Usage:
    """``usage``: a process's request counts so far (totals)."""

    process: str | None
    requests: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Warning:
    """``warning``: something the user should know, in words."""

    kind: str
    text: str


@dataclasses.dataclass(frozen=True)
class Error:
    """``error``: the cell raised."""

    ename: Any
    evalue: Any
    traceback: Any
    retrying: bool = False


@dataclasses.dataclass(frozen=True)
class Result:
    """``result``: the attempt's (and so the job's) end."""

    status: str | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Pruned:
    """``pruned``: a sweep's pruner stopped the job (one of its trials) early: at
    ``step``, where its ``metric`` was ``value``; ``sweep`` and ``trial`` name it.
    Written to the group's stream by the sweep's driver before it stops the job."""

    step: int | None
    metric: str = ""
    value: float | None = None
    sweep: str | None = None
    trial: int | None = None

    @property
    def at(self) -> str:
        """``pruned at step 140`` (``pruned`` without a step)."""
        return f"pruned at step {self.step}" if self.step is not None else "pruned"

    @property
    def text(self) -> str:
        """``pruned at step 140 (val_loss 0.4452)``."""
        value = f" ({self.metric} {self.value:.4g})" if self.metric and \
            self.value is not None else ""
        return f"{self.at}{value}"


@dataclasses.dataclass(frozen=True)
class World:
    """``world``: a multi-node job's world as one node saw it form."""

    nodes: int
    world_size: int
    max_nodes: int = 1


@dataclasses.dataclass(frozen=True)
class Joined:
    """``joined``: nodes joined a multi-node job's world after every rank saved (global
    rank 0's node writes it once the re-formed world restored that save)."""

    nodes: tuple[int, ...]
    world_size: int
    step: int
    saved_step: int | None


@dataclasses.dataclass(frozen=True)
class Standby:
    """``standby``: a warm standby took the job over (``phase`` "took-over": the lease
    is its; when its kernel started and it was ready, the checkpoint step it prefetched
    and the bytes it read at the takeover) or restored it ("restored": training goes
    on)."""

    phase: str
    kernel_started: float | None = None
    ready: float | None = None
    lease_at: float | None = None
    prefetched_step: int | None = None
    step: int | None = None
    read_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Unknown:
    """An event of a type this version does not know (a newer spotnb wrote it)."""

    type: str


Body = (Status | Metric | Metrics | ProgressTotal | Stream | Display | Sys | CheckpointEvent
        | Params | Notice | Price | Instance | Usage | Warning | Error | Result | World
        | Joined | Standby | Pruned | Region | Transfer | Unknown)


def _status(e: Event, d: dict[str, Any]) -> Status:
    detail = _str(d.get("detail"))
    if "retrying" in d:
        retrying = bool(d["retrying"])
    else:
        # Logs of spotnb before the field said it only in the detail's words, which the
        # agent of those versions always began with "retrying"; read here and nowhere else.
        retrying = d.get("state") == "booting" and detail.startswith("retrying")
    return Status(state=_str(d.get("state")), detail=detail,
                  instance_type=_opt_str(d.get("instance_type")), az=_opt_str(d.get("az")),
                  region=_opt_str(d.get("region")), retrying=retrying)


def _metric(e: Event, d: dict[str, Any]) -> Metric:
    step = _opt_float(d.get("step"))
    return Metric(step=None if d.get("step") is None else step,
                  t=_opt_float(d.get("t")) or e.time, values=_dict(d.get("values")))


def _checkpoint(e: Event, d: dict[str, Any]) -> CheckpointEvent:
    step = d.get("step")
    return CheckpointEvent(phase=_str(d.get("phase")), step=None if step is None else _int(step),
                           bytes=_int(d.get("bytes")), forced=bool(d.get("forced")),
                           kind=_str(d.get("kind")), name=_str(d.get("name")),
                           id=_opt_str(d.get("id")))


def _instance(e: Event, d: dict[str, Any]) -> Instance:
    return Instance(action=_str(d.get("action")), instance_id=_opt_str(d.get("instance_id")),
                    instance_type=_opt_str(d.get("instance_type")), az=_opt_str(d.get("az")),
                    region=_opt_str(d.get("region")),
                    pool=_str(d.get("pool")), price=_opt_float(d.get("price")),
                    ondemand=_opt_float(d.get("ondemand")), reason=_opt_str(d.get("reason")),
                    standby_for=_opt_str(d.get("standby_for")),
                    kernel_started=_opt_float(d.get("kernel_started")),
                    time_scale=_opt_float(d.get("time_scale")) or 1.0,
                    standby_due=_opt_float(d.get("standby_due")),
                    step=_opt_str(d.get("step")),
                    log=tuple(str(line) for line in d.get("log") or ()
                              if isinstance(d.get("log"), list)),
                    failures=None if d.get("failures") is None else _int(d.get("failures")),
                    limit=None if d.get("limit") is None else _int(d.get("limit")))


def _standby(e: Event, d: dict[str, Any]) -> Standby:
    def step(key: str) -> int | None:
        return None if d.get(key) is None else _int(d.get(key))

    return Standby(phase=_str(d.get("phase")), kernel_started=_opt_float(d.get("kernel_started")),
                   ready=_opt_float(d.get("ready")), lease_at=_opt_float(d.get("lease_at")),
                   prefetched_step=step("prefetched_step"), step=step("step"),
                   read_bytes=_int(d.get("read_bytes")))


def _price(e: Event, d: dict[str, Any]) -> Price:
    return Price(pool=_str(d.get("pool")), price=_opt_float(d.get("price")),
                 instance_type=_opt_str(d.get("instance_type")), az=_opt_str(d.get("az")),
                 ondemand=_opt_float(d.get("ondemand")),
                 source=_opt_str(d.get("price_source") or d.get("source")),
                 history_time=_opt_str(d.get("history_time")),
                 history_scale=_opt_float(d.get("history_scale")))


def _region(e: Event, d: dict[str, Any]) -> Region:
    return Region(region=_str(d.get("region")), previous=_opt_str(d.get("previous")),
                  cause=_str(d.get("cause")), reason=_str(d.get("reason")),
                  home=_opt_str(d.get("home")), tries=_int(d.get("tries")),
                  estimate=_str(d.get("estimate")))


def _transfer(e: Event, d: dict[str, Any]) -> Transfer:
    step = d.get("step")
    return Transfer(kind=_str(d.get("kind")), bytes=_int(d.get("bytes")),
                    source=_str(d.get("source")), destination=_str(d.get("destination")),
                    usd=_opt_float(d.get("usd")) or 0.0,
                    usd_per_gb=_opt_float(d.get("usd_per_gb")) or 0.0,
                    key=_str(d.get("key")), step=None if step is None else _int(step))


_DECODERS: dict[str, Any] = {
    "status": _status,
    "metric": _metric,
    "metrics": lambda e, d: Metrics(),
    "progress": lambda e, d: ProgressTotal(total=_int(d.get("total")) or None,
                                           source=_str(d.get("source"))),
    "stream": lambda e, d: Stream(
        name=_str(d.get("name"), "stdout"), text=_str(d.get("text")),
        replayed_by=None if d.get("replayed_by") is None else _int(d.get("replayed_by"))),
    "display": lambda e, d: Display(kind=_str(d.get("kind"), "display_data"),
                                    data=_dict(d.get("data")), metadata=_dict(d.get("metadata")),
                                    display_id=d.get("display_id"),
                                    wait=bool(d.get("wait"))),
    "sys": lambda e, d: Sys(kind=_str(d.get("kind")), util=_opt_float(d.get("util")),
                            mem_used=_opt_float(d.get("mem_used")),
                            mem_total=_opt_float(d.get("mem_total"))),
    "checkpoint": _checkpoint,
    "params": lambda e, d: Params(params=d["params"] if isinstance(d.get("params"), dict)
                                  else None, source=_opt_str(d.get("source"))),
    "notice": lambda e, d: Notice(kind=_str(d.get("kind")), action=_opt_str(d.get("action")),
                                  notice_time=d.get("notice_time"),
                                  source=_opt_str(d.get("source"))),
    "price": _price,
    "instance": _instance,
    "region": _region,
    "transfer": _transfer,
    "standby": _standby,
    "usage": lambda e, d: Usage(process=_opt_str(d.get("process")),
                                requests=_dict(d.get("requests"))),
    "warning": lambda e, d: Warning(kind=_str(d.get("kind")), text=_str(d.get("text"))),
    "error": lambda e, d: Error(ename=d.get("ename"), evalue=d.get("evalue"),
                                traceback=d.get("traceback"), retrying=bool(d.get("retrying"))),
    "result": lambda e, d: Result(status=_opt_str(d.get("status")), reason=_str(d.get("reason"))),
    "pruned": lambda e, d: Pruned(
        step=None if d.get("step") is None else _int(d.get("step")), metric=_str(d.get("metric")),
        value=_opt_float(d.get("value")), sweep=_opt_str(d.get("sweep")),
        trial=None if d.get("trial") is None else _int(d.get("trial"))),
    "world": lambda e, d: World(nodes=_int(d.get("nodes")), world_size=_int(d.get("world_size")),
                                max_nodes=_int(d.get("max_nodes"), 1) or 1),
    "joined": lambda e, d: Joined(
        nodes=tuple(_int(n) for n in d.get("nodes") or () if isinstance(n, int)),
        world_size=_int(d.get("world_size")), step=_int(d.get("step")),
        saved_step=None if d.get("saved_step") is None else _int(d.get("saved_step"))),
}


def decode(event: Event) -> Body:
    """The typed body of ``event`` (:class:`Unknown` for a type this version does not
    know). Use ``event.body``, which decodes once."""
    decoder = _DECODERS.get(event.type)
    if decoder is None:
        return Unknown(type=event.type)
    body: Body = decoder(event, event.data if isinstance(event.data, dict) else {})
    return body


# Metric rows are most of a log (a day's run: millions): the hot paths (a display's
# live update, a re-attach) tell them apart without building a body for each.

def is_row(event: Event) -> bool:
    """Whether ``event`` is one row of metrics (a :class:`Metric`), without decoding it:
    a reader takes its ``step``, ``t`` and ``values`` from ``event.data``."""
    return event.type == "metric"


def peek(event: Event) -> Body | None:
    """The body of ``event``, or None for a metric row (no body built: a reader that
    wants rows takes them from ``event.data``, see :func:`is_row`)."""
    return None if event.type == "metric" else event.body


def is_batch(event: Event) -> bool:
    """Whether ``event`` is a batch of metric rows (a :class:`Metrics`)."""
    return event.type == "metrics"


_OUTPUT_TYPES = frozenset({"stream", "display", "metric", "metrics"})
_CONTROL_TYPES = frozenset({"status", "notice", "instance", "price", "error", "result",
                            "usage", "standby", "pruned", "region", "transfer"})


def is_output(event: Event) -> bool:
    """Whether ``event`` is output of the cell (stdout/stderr, a rich output, metrics)."""
    return event.type in _OUTPUT_TYPES


def is_control(event: Event) -> bool:
    """Whether ``event`` is one the job's cost and attempts are made of (the rest:
    output, metrics, samples)."""
    return event.type in _CONTROL_TYPES
