"""What a job came to, as values: :class:`JobResult` (its status, attempts, cost,
metrics and outputs) with each :class:`Attempt`, the row of a jobs listing
(:class:`JobInfo`) and the labels of a job's nodes and instances; all made from the
fold of the job's events (:func:`summarize_state`, :func:`job_outcome`). The API that
hands them out is :mod:`spotnb.client.jobs`.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any

from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import JobState, fold, savings_pct
from spotnb.protocol.spec import JobSpec, Resources
from spotnb.protocol.store import Store

__all__ = ["Attempt", "JobInfo", "JobResult", "instances_label", "job_outcome",
           "node_instances", "nodes_label", "summarize", "summarize_state", "when_text"]


def when_text(epoch: float) -> str:
    """``epoch`` as local time, to the second: ``2025-01-01 12:00:00``."""
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S")


def job_outcome(store: Store, result: dict[str, Any] | None,
                max_nodes: int = 1) -> tuple[str, str]:
    """The job's status and reason (:meth:`JobState.outcome`): of ``result`` (its
    ``result.json``) alone where that says it, else with the job's log folded (a job
    not ended, or one stopped, which a sweep's pruner may have pruned)."""
    state = fold(EventReader(store, batches=True).poll(), max_nodes) \
        if JobState.outcome_reads_log(result) else JobState()
    return state.outcome(result)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt: an agent's run under one lease epoch, on one instance."""

    number: int
    instance_id: str | None
    instance_type: str | None
    pool: str | None
    start: float
    end: float | None
    end_reason: str
    spot_price: float | None
    #: The availability zone, where the instance said.
    az: str | None = None
    #: The node slot it ran on (``layout.node_slot``; 0 for a single-node job).
    node: int = 0
    #: The region its instance ran in, where known.
    region: str | None = None
    #: Why the job moved to that region before it (the move's reason: "no capacity in
    #: us-east-1 for g5.xlarge after 3 tries"); None when it ran where the attempt
    #: before it ran, or where the job started.
    moved: str | None = None


@dataclasses.dataclass(frozen=True)
class JobResult:
    """How a job ended (or where it stands, for a job still running)."""

    job_id: str
    name: str
    status: str
    reason: str
    attempts: tuple[Attempt, ...]
    interruptions: int
    #: What the job cost: its instances, billed per second from launch (boot included)
    #: at their pools' spot prices, plus :attr:`requests_usd` and :attr:`transfer_usd`.
    cost_usd: float
    #: The same instance-seconds at the on-demand price.
    ondemand_cost_usd: float
    metrics: dict[str, float]
    duration: float
    outputs: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: dict[str, Any] | None = None
    #: spotnb's own AWS requests (S3, SQS) at list prices, as its agents, runtime and
    #: followers reported them; 0 on the local cloud, whose requests cost nothing.
    requests_usd: float = 0.0
    #: The checkpoint's transfer between regions (saves sent home from another region,
    #: restores there), at AWS's inter-region prices; 0 for a job that stayed home.
    transfer_usd: float = 0.0
    #: A multi-node job's world as it changed: (time, nodes, processes), from its
    #: ``world`` events (every node of a round reports it; each change is kept once).
    worlds: tuple[tuple[float, int, int], ...] = ()

    @property
    def savings_pct(self) -> float | None:
        """Savings versus on-demand in percent (None before any cost): what the job
        cost, boot time and spotnb's own requests included, against its instance time
        at the on-demand price."""
        return savings_pct(self.cost_usd, self.ondemand_cost_usd)

    @property
    def cost_includes(self) -> str:
        """What :attr:`cost_usd` includes, for a person."""
        text = (f"instances billed from launch (boot included) and spotnb's own requests "
                f"(${self.requests_usd:.4f})")
        if self.transfer_usd:
            text += (f", and the checkpoint's transfer between regions "
                     f"(${self.transfer_usd:.4f})")
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the outputs (they are arbitrary objects)."""
        out = dataclasses.asdict(self)
        out.pop("outputs")
        out["output_names"] = sorted(self.outputs)
        out["savings_pct"] = self.savings_pct
        return out

    def __repr__(self) -> str:
        """Every field on a line (``r = %spot_result`` shows this), readable: money in
        USD, times as dates, durations in h/m/s, attempts one per line."""
        fields = _fields(self)
        width = max(len(label) for label, _ in fields) + 2
        lines = [f"JobResult {self.job_id} {self.name!r}"]
        for label, value in fields:
            if label == "attempts":
                lines.append(f"  {label:<{width}}{len(value)}")
                lines += [f"    {_attempt_line(a)}" for a in value]
            else:
                lines.append(f"  {label:<{width}}{_text(label, value)}".rstrip())
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The same as a table, for notebooks."""
        import html

        rows = []
        for label, value in _fields(self):
            if label == "attempts" and value:
                names = [f.name for f in dataclasses.fields(value[0])]
                head = "".join(f"<th>{html.escape(n)}</th>" for n in names)
                body = "".join("<tr>" + "".join(
                    f"<td>{html.escape(_text(n, getattr(a, n)))}</td>" for n in names)
                    + "</tr>" for a in value)
                cell = f"<table><tr>{head}</tr>{body}</table>"
            else:
                cell = html.escape(_text(label, value)).replace("\n", "<br>")
            rows.append(f"<tr><th style='text-align:left;vertical-align:top'>"
                        f"{html.escape(label)}</th><td style='text-align:left'>{cell}</td></tr>")
        return (f"<b>JobResult {html.escape(self.job_id)} {html.escape(repr(self.name))}</b>"
                f"<table>{''.join(rows)}</table>")


def _fields(obj: Any) -> list[tuple[str, Any]]:
    """A dataclass's fields, then its properties, as (name, value): whatever fields the
    class has, so a new one appears in the repr without further work."""
    pairs = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)
             if f.name not in ("job_id", "name")]
    properties = {name for klass in type(obj).__mro__ for name, member in vars(klass).items()
                  if isinstance(member, property)}
    return pairs + [(name, getattr(obj, name)) for name in sorted(properties)]


def _text(name: str, value: Any) -> str:
    """One value for a person, by what its name says it is."""
    import reprlib

    if value is None:
        return "-"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if name.endswith("_usd"):
            return f"${value:,.4f}"
        if name.endswith("_pct"):
            return f"{value:.1f}%"
        if name == "duration" or name.endswith(("_seconds", "_duration")):
            return _duration(float(value))
        if name in ("created", "start", "end", "time") or name.endswith("_at"):
            return when_text(float(value))
        return f"{value:.6g}" if isinstance(value, float) else str(value)
    if isinstance(value, dict) and {"ename", "evalue"} <= set(value):
        return f"{value['ename']}: {value['evalue']}"
    if isinstance(value, dict):
        if not value:
            return "-"
        return ", ".join(f"{k} = {_item(str(k), v)}" for k, v in value.items())
    return str(value) if isinstance(value, str) else reprlib.repr(value)


def _item(name: str, value: Any) -> str:
    """A value inside a dict: numbers formatted, anything else a short repr (an output
    may be a whole model)."""
    import reprlib

    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _text(name, value)
    return reprlib.repr(value)


def _attempt_line(attempt: Any) -> str:
    return "  ".join(f"{name} {_text(name, value)}" for name, value in _fields(attempt))


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    return (f"{hours}h {rest // 60:02d}m {rest % 60:02d}s" if hours
            else f"{rest // 60}m {rest % 60:02d}s")


@dataclasses.dataclass(frozen=True)
class JobInfo:
    """A row of :func:`jobs`.

    ``instance_type`` is the last attempt's; ``duration`` in seconds; ``metric`` the
    last value of the first metric logged, as ``(name, value)``.
    """

    job_id: str
    name: str
    status: str
    attempts: int
    interruptions: int
    cost_usd: float
    created: float
    instance_type: str | None = None
    duration: float = 0.0
    ondemand_cost_usd: float = 0.0
    metric: tuple[str, float] | None = None
    #: How many nodes: ``"1"``, ``"4"``, ``"3:4"`` (MIN:MAX); ``"x2"`` appended with
    #: two worker processes per node; a multi-node job whose world formed says how
    #: many nodes it has now (or had at the end) first: ``"3 nodes (3:4)"``.
    nodes: str = "1"
    #: Why it ended (a sweep's pruned trial: ``pruned at step 140 (val_loss 0.4452)``).
    reason: str = ""
    #: The status as the listing says it where it says more than ``status``: a sweep's
    #: pruned trial's with its step (``pruned at step 140``; its log says why).
    status_text: str = ""

    @property
    def savings_pct(self) -> float | None:
        """Savings versus on-demand in percent (None before any cost)."""
        return savings_pct(self.cost_usd, self.ondemand_cost_usd)


def nodes_label(resources: Resources, result: JobResult | None = None) -> str:
    """A job's nodes as ``%spot_jobs`` shows them (see :attr:`JobInfo.nodes`)."""
    low, high = resources.min_nodes, resources.max_nodes
    label = str(high) if low == high else f"{low}:{high}"
    label += f"x{resources.procs_per_node}" if resources.procs_per_node > 1 else ""
    if high > 1 and result is not None and result.worlds:
        nodes = result.worlds[-1][1]
        return f"{nodes} node{'' if nodes == 1 else 's'} ({label})"
    return label


def node_instances(result: JobResult) -> list[Attempt]:
    """The newest attempt of each node slot, in slot order: the instances a
    multi-node job runs on now (or ran on at the end)."""
    newest: dict[int, Attempt] = {}
    for attempt in result.attempts:
        if attempt.node not in newest or attempt.number > newest[attempt.node].number:
            newest[attempt.node] = attempt
    return [newest[k] for k in sorted(newest)]


def instances_label(result: JobResult, multinode: bool, home: str | None = None) -> str | None:
    """The instance type(s) ``%spot_jobs`` shows: the last attempt's; for a multi-node
    job each node's newest, counted, with their zone where the instances said it
    (``"g4dn.xlarge x2 us-east-1a, g5.xlarge us-east-1a"``); the region after them when
    it is not ``home`` (the job moved: ``"g4dn.xlarge in us-west-2"``)."""
    if not result.attempts:
        return None
    region = result.attempts[-1].region
    away = f" in {region}" if home is not None and region and region != home else ""
    if not multinode:
        label = result.attempts[-1].instance_type
        return None if label is None else label + away
    counts: dict[str, int] = {}
    for a in node_instances(result):
        where = " ".join(p for p in (a.instance_type or "?", a.az) if p)
        counts[where] = counts.get(where, 0) + 1
    parts = []
    for where, n in counts.items():
        kind, _, zone = where.partition(" ")
        parts.append(" ".join(p for p in (kind, f"x{n}" if n > 1 else "", zone) if p))
    return ", ".join(parts) + away


# -- summarising ---------------------------------------------------------------------

def summarize(spec: JobSpec, events: list[Event], result: dict[str, Any] | None,
              now: float | None = None) -> JobResult:
    """A :class:`JobResult` from the event history (and ``result.json`` if any).

    Cost: each instance is billed per second from launch to termination at its pool's
    spot price, which changes when ``price`` events say so; the on-demand equivalent
    bills the same seconds at the on-demand price.
    """
    return summarize_state(spec, fold(events, spec.resources.max_nodes), result, now)


def summarize_state(spec: JobSpec, state: JobState, result: dict[str, Any] | None,
                    now: float | None = None) -> JobResult:
    """:func:`summarize` of the job's events folded (:mod:`spotnb.protocol.events.fold`)."""
    now = time.time() if now is None else now
    final = result is not None or state.final
    end_of_job = (state.last_time if state.last_time is not None else now) if final else now
    ondemand = state.cost(end_of_job)[1]
    status, reason = state.outcome(result)
    attempts = []
    for number in sorted(state.attempts):
        a = state.attempts[number]
        instance = state.instances.get((a.instance_id if a.boot_time is not None
                                        else a.first_instance) or "")
        end_reason = state.end_reason(number, final, status)
        attempts.append(Attempt(
            number=number,
            instance_id=a.instance_id if a.boot_time is not None else a.first_instance,
            instance_type=a.instance_type or (instance.instance_type if instance else None),
            pool=instance.pool if instance else None,
            start=a.start,
            end=a.last_time if end_reason != "running" else None,
            end_reason=end_reason,
            spot_price=instance.price if instance else None,
            az=a.az or (instance.az if instance else None),
            node=a.node,
            region=a.region or (instance.region if instance else None),
            moved=move.reason if (move := state.region_choice(number)) is not None
            and move.moved else None,
        ))
    start = state.first_time if state.first_time is not None else spec.created
    return JobResult(
        job_id=spec.job_id, name=spec.name, status=status, reason=reason,
        attempts=tuple(attempts), interruptions=state.interruptions(final),
        cost_usd=state.cost_usd(end_of_job), ondemand_cost_usd=ondemand,
        metrics=state.metrics(),
        duration=max(0.0, end_of_job - min(start, spec.created)),
        error=(result or {}).get("error") or (state.error() if status == "failed" else None),
        requests_usd=state.requests_usd(), transfer_usd=state.transfer_usd(),
        worlds=tuple(state.worlds),
    )
