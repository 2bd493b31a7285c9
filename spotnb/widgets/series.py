"""What the dashboard plots, derived from a job's events: numpy series of bounded size
(:mod:`spotnb.widgets.reduced`).

No widgets here: :class:`DashboardData` takes events (:meth:`DashboardData.add`) and
keeps, per metric, the curve as it now stands and the points that were *redone* (logged
by an attempt that was interrupted before its next checkpoint, then logged again by the
replacement), GPU or CPU samples, the last checkpoint and the last lines of output. The
job's facts (the spot price of each pool it ran in, its interruptions and resumes, the
steps redone, the world) are its fold's (:attr:`DashboardData.state`, shared with the
follow loop's view: one fold per followed job), which the markers read. A
multi-node job's utilisation is also kept per node slot (one line per node: a node's
replacement continues its line after a gap), with its world size as it changed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, Event, codec, expand, metric_columns, metric_names
from spotnb.protocol.events.fold import EndReason, JobState, PoolState, replaced_attempt
from spotnb.train.tb import TB_SYNC_NAME
from spotnb.widgets.reduced import DEFAULT_BUCKETS, Column, MetricSeries, MinMaxBuckets, Reduced

__all__ = ["DEFAULT_BUCKETS", "Checkpoint", "Column", "DashboardData", "Marker", "MetricSeries",
           "MinMaxBuckets", "Reduced"]

#: Lines of remote output the panel keeps: the first HEAD_LINES (the set-up, the first
#: evaluation) and the last LOG_LINES; between them it says how many it left out (the
#: full log stays in the store: ``%spot_logs``).
LOG_LINES = 200
HEAD_LINES = 50
_LINE_CHARS = 400


@dataclasses.dataclass
class Marker:
    """An interruption, a lost instance, a retry or a resume, as the plots mark it.

    ``kind``: ``"interrupted"`` (a spot notice), ``"lost"`` (the instance went away
    without one), ``"retry"`` (a user-code error rerun in place) or ``"resumed"``.
    ``time`` is the wall clock; ``attempt`` the attempt it ended or started; ``step``
    the last step that attempt logged (interruptions) or the first step it logged
    (resumes), None until known; ``redone`` the steps lost with an interrupted
    attempt, None until the next attempt logs. ``detail`` says why or where.
    """

    kind: str
    time: float
    attempt: int
    step: float | None = None
    redone: int | None = None
    detail: str = ""

    @property
    def ended(self) -> bool:
        """Whether it marks the end of an attempt (not the start of one)."""
        return self.kind != "resumed"

    @property
    def text(self) -> str:
        """The hover text: what happened, at which step, and what it cost."""
        at = f" at step {self.step:.0f}" if self.step is not None else ""
        if self.kind == "resumed":
            start = f" from step {self.step:.0f}" if self.step is not None else ""
            return f"attempt {self.attempt} resumed{start} {self.detail}".strip()
        verb = {"interrupted": "interrupted", "lost": "lost",
                "retry": "failed"}[self.kind]
        redone = ("steps redone: not known yet" if self.redone is None
                  else f"{self.redone} step{'s' if self.redone != 1 else ''} redone")
        return f"attempt {self.attempt} {verb}{at}: {self.detail}; {redone}"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The last durable checkpoint: step, bytes, when, and whether a notice forced it."""

    step: int
    bytes: int
    time: float
    forced: bool


_NOTICE_REASONS = {
    "requested": "interruption asked for (Interrupt now, %spot_interrupt)",
    "price": "the spot price rose above the max price",
    "scheduled": "simulated interruption (--simulate-interruptions)",
    "hazard": "spot capacity reclaimed (the pool's interruption rate)",
}


class DashboardData:
    """Everything the dashboard plots, from events (see the module docstring).

    ``state``: the job's fold, which the caller applies every event to (the follow
    loop's, a comparison's); without one, this keeps its own and folds what it is
    given. ``version`` increases whenever something visible changed, so a display can
    tell whether it has anything to send.
    """

    def __init__(self, max_buckets: int = DEFAULT_BUCKETS, log_lines: int = LOG_LINES,
                 max_nodes: int = 1, state: JobState | None = None) -> None:
        self.max_buckets = max_buckets
        self.node_util: dict[int, Reduced] = {}  # node slot -> utilisation, percent
        self.node_gaps: dict[int, list[float]] = {}  # where a replacement's samples start
        self._node_attempt: dict[int, int] = {}
        # The job's story (spotnb.protocol.events.fold): prices, breaks, the world.
        self._folds = state is None
        self.state = JobState(max_nodes) if state is None else state
        self.state.max_nodes = max(self.state.max_nodes, max_nodes)
        self.metrics: dict[str, MetricSeries] = {}
        self.util = Reduced(max_buckets)  # percent
        self.mem = Reduced(max_buckets)  # percent of the total
        self.sys_kind: str | None = None  # "gpu" or "cpu"
        self.sys_gaps: list[float] = []  # where a new instance's samples start (time)
        self._sys_attempt = 0
        self.checkpoint: Checkpoint | None = None
        self.tensorboard_synced = False
        self.head: list[str] = []  # the first HEAD_LINES lines (fewer with a small log_lines)
        self.lines: collections.deque[str] = collections.deque(maxlen=log_lines)
        self._head_lines = min(HEAD_LINES, log_lines)
        self.line_count = 0  # every line written, kept or not
        self._partial = ""
        self.version = 0
        self.log_version = 0
        self.first_time: float | None = None  # the time axes start here
        self.last_time = 0.0
        self._markers: tuple[int, list[Marker]] | None = None
        self._map: tuple[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] | None \
            = None

    def use(self, state: JobState) -> None:
        """Read ``state`` (the caller's fold of the same events) from now on, and fold
        nothing more here."""
        state.max_nodes = max(state.max_nodes, self.state.max_nodes)
        self.state, self._folds = state, False
        self._markers = self._map = None

    @property
    def max_nodes(self) -> int:
        """A multi-node job's MAX nodes (its ``world`` events say it too): which node
        slot an attempt's samples belong to (``layout.node_slot``)."""
        return self.state.max_nodes

    @max_nodes.setter
    def max_nodes(self, value: int) -> None:
        self.state.max_nodes = max(1, value)
        self.state.steps.scan = self.state.steps.scan or value > 1

    # -- input ---------------------------------------------------------------------

    def add(self, events: list[Event]) -> None:
        """Take a batch of events (in time order). Output (``stream``) events are
        left to :meth:`write`, which the display calls in order with milestones."""
        for event in events:
            if self._folds:
                self.state.apply(event)
            if codec.is_batch(event):  # a batch of rows (a reader with batches=True)
                self._metrics(event)
                continue
            if self.first_time is None:
                self.first_time = event.time
            self.last_time = max(self.last_time, event.time)
            self._add(event)

    @property
    def worlds(self) -> list[tuple[float, int, int]]:
        """The world as it changed: (time, nodes, processes)."""
        return self.state.worlds

    @property
    def pools(self) -> dict[str, PoolState]:
        """The spot price of each pool the job ran in (the fold's), in the order it
        used them."""
        return self.state.pools

    @property
    def redo(self) -> int:
        """Steps redone over the job (the fold's)."""
        return self.state.redone_steps()

    def _add(self, e: Event) -> None:
        if codec.is_row(e):  # the series' own: no body built
            self._metric(e)
            self.version += 1
            return
        body = e.body
        if isinstance(body, codec.Sys):
            self.sys_kind = body.kind or self.sys_kind or "cpu"
            t = e.time
            util = np.nan if body.util is None else body.util
            if e.attempt != self._sys_attempt and len(self.util) and not self.multinode:
                # Another instance: no line across the gap. (A multi-node job's nodes
                # take turns in this series: their lines are per node, node_util.)
                self.sys_gaps.append(t)
            self._sys_attempt = e.attempt
            self.util.add(t, util)
            if self.max_nodes > 1:
                self._node_sample(e.attempt, t, util)
            total, used = body.mem_total or 0, body.mem_used
            self.mem.add(t, 100.0 * used / total if total and used is not None else np.nan)
        elif isinstance(body, codec.Instance) and body.noticed:
            return
        elif isinstance(body, (codec.World, codec.Instance, codec.Price, codec.Notice)):
            pass  # the fold's: prices, the world, the markers
        elif isinstance(body, (codec.Status, codec.Error)) and e.attempt != GROUP_STREAM:
            pass  # the fold's: boots (resumes) and ends (markers)
        elif isinstance(body, codec.CheckpointEvent) and body.sync:
            if body.name == TB_SYNC_NAME and body.durable:
                self.tensorboard_synced = True
        elif isinstance(body, codec.CheckpointEvent) and body.durable:
            self.checkpoint = Checkpoint(body.step or 0, body.bytes, e.time, body.forced)
        else:
            return
        self.version += 1

    def _node_sample(self, attempt: int, t: float, util: float) -> None:
        slot = layout.node_slot(attempt, self.max_nodes)
        series = self.node_util.get(slot)
        if series is None:
            series = self.node_util[slot] = Reduced(self.max_buckets)
            self.node_gaps[slot] = []
        elif self._node_attempt.get(slot) != attempt:
            self.node_gaps[slot].append(t)  # the node's replacement: no line across
        self._node_attempt[slot] = attempt
        series.add(t, util)

    def _metric(self, e: Event) -> None:
        step = e.data.get("step")
        if step is None:
            return
        step = float(step)
        t = float(e.data.get("t") or e.time)
        for name, value in (e.data.get("values") or {}).items():
            if not isinstance(value, (int, float)):
                continue
            series = self.metrics.get(name)
            if series is None:
                series = self.metrics[name] = MetricSeries(name, self.max_buckets)
            series.add(e.attempt, step, float(value), t)

    def _metrics(self, e: Event) -> None:
        """A ``metrics`` batch in bulk, a column at a time: the same as its rows one by
        one (:meth:`_metric`), each series taking its points in order."""
        steps, times, columns = metric_columns(e)
        if len(steps) != len(times):  # a damaged batch: what its rows say, row by row
            for row in expand(e):
                self.first_time = row.time if self.first_time is None else self.first_time
                self.last_time = max(self.last_time, row.time)
                self._add(row)
            return
        if not len(steps):
            return
        step = np.frombuffer(steps, dtype=np.int64).astype(float)
        t = np.frombuffer(times, dtype=float)
        if self.first_time is None:
            self.first_time = float(t[0])
        known = t[~np.isnan(t)]
        if len(known):
            self.last_time = max(self.last_time, float(known.max()))
        for name in metric_names(columns):  # new series in the order the rows name them
            idx, vals = columns[name]
            n = min(len(vals), len(step) if idx is None else len(idx))
            if not n:
                continue
            series = self.metrics.get(name)
            if series is None:
                series = self.metrics[name] = MetricSeries(name, self.max_buckets)
            values = np.frombuffer(vals, dtype=float)[:n]
            rows = slice(0, n) if idx is None else np.frombuffer(idx, dtype=np.int32)[:n]
            series.add_many(e.attempt, step[rows], values, t[rows])
        self.version += len(step)

    # -- the markers: the fold's breaks and resumes ------------------------------------

    @property
    def markers(self) -> list[Marker]:
        """Interruptions, lost instances, retries and resumes, in time order, as the
        fold says them (its breaks: the last step, the steps redone; each resumed
        attempt's first step)."""
        if self._markers is None or self._markers[0] != self.state.changes:
            self._markers = (self.state.changes, _markers(self.state))
        return self._markers[1]

    def write(self, text: str, stderr: bool = False) -> None:
        """Remote output text (may hold partial lines)."""
        parts = (self._partial + text).split("\n")
        self._partial = parts.pop()
        for line in parts:
            self._keep(("\x00" if stderr else "") + _clip(line.split("\r")[-1]))
        self.log_version += 1

    def milestone(self, when: float, text: str) -> None:
        """A line of spotnb's own (interruptions, resumes) between the output lines."""
        import datetime

        clock = datetime.datetime.fromtimestamp(when).strftime("%H:%M:%S")
        self._keep(f"\x01[spotnb {clock}] {text}")
        self.log_version += 1

    def _keep(self, line: str) -> None:
        self.line_count += 1
        if len(self.head) < self._head_lines:
            self.head.append(line)
        else:
            self.lines.append(line)

    @property
    def left_out(self) -> int:
        """Lines written between the first and the last ones kept (none: 0)."""
        return self.line_count - len(self.head) - len(self.lines)

    # -- output --------------------------------------------------------------------

    def sys_points(self, which: Reduced, full: bool = False,
                   gaps: list[float] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Utilisation or memory against time, with a NaN where another instance's
        samples start (reduced for display, or every sample with ``full``); ``gaps``:
        where, if not the job's (a node's own series: :attr:`node_gaps`)."""
        gaps = self.sys_gaps if gaps is None else gaps
        if full:
            x, y = which.full.x.copy(), which.full.y.copy()
        else:
            x, y, _t = which.view.points()
        if not gaps or not len(x):
            return x, y
        at = np.searchsorted(x, np.asarray(gaps), side="left")
        nan = np.full(len(at), np.nan)
        return np.insert(x, at, nan), np.insert(y, at, nan)

    def time_to_step(self, times: np.ndarray, held: bool = False) -> np.ndarray:
        """The step the job was at at each of ``times``, for plotting system samples
        against step: interpolated between the logged rows (those of the metric logged
        most often, its redone rows included, so a sample taken while an interrupted
        instance worked on steps later redone maps to those steps). NaN outside the
        rows and between two rows that an instance change separates (an interruption,
        a resume, a new instance's first sample), where no step was being worked on;
        with ``held`` (the times of a step function, such as the world size), the
        nearest step there instead. O(``max_buckets``): it reads the reduced series."""
        times = np.asarray(times, dtype=float)
        out = np.full(len(times), np.nan)
        t, x, bridged = self._step_map()
        if not len(t) or not len(times):
            return out
        if held:
            return np.interp(times, t, x)
        inside = (times >= t[0]) & (times <= t[-1])
        i = np.clip(np.searchsorted(t, times, side="right") - 1, 0, max(len(t) - 2, 0))
        ok = inside & ((times == t[i]) | (times == t[-1]) | (bridged[i] if len(t) > 1
                                                              else True))
        out[ok] = np.interp(times[ok], t, x)
        return out

    def _step_map(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """:meth:`time_to_step`'s rows ``(time, step)`` in time order, and whether each
        row is bridged to the next; computed once per :attr:`version`."""
        key = (self.version, self.state.changes)
        if self._map is not None and self._map[0] == key:
            return self._map[1]
        series = max(self.metrics.values(), default=None,
                     key=lambda s: len(s.curve) + len(s.redone))
        if series is None:
            empty = np.empty(0)
            return empty, empty, np.empty(0, dtype=bool)
        x, _y, t = series.curve.view.points()
        rx, _ry, rt = series.redone.view.points()
        t, x = np.concatenate([t, rt]), np.concatenate([x, rx])
        known = np.isfinite(t) & np.isfinite(x)
        order = np.argsort(t[known], kind="stable")
        t, x = t[known][order], x[known][order]
        breaks = np.sort(np.asarray([*self.sys_gaps, *(m.time for m in self.markers)],
                                    dtype=float))
        # Rows i and i + 1 are bridged unless a break falls in (t[i], t[i + 1]].
        bridged = np.diff(np.searchsorted(breaks, t, side="right")) == 0
        self._map = (key, (t, x, bridged))
        return t, x, bridged

    @property
    def multinode(self) -> bool:
        """Whether the job may run on several nodes (its utilisation is per node)."""
        return self.max_nodes > 1

    def world_points(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The world size (processes) against time as a step line's points, held to
        the last event; and the node count at each point."""
        if not self.worlds:
            empty = np.empty(0)
            return empty, empty, empty
        t = [w[0] for w in self.worlds] + [max(self.last_time, self.worlds[-1][0])]
        size = [w[2] for w in self.worlds] + [self.worlds[-1][2]]
        nodes = [w[1] for w in self.worlds] + [self.worlds[-1][1]]
        return np.asarray(t, float), np.asarray(size, float), np.asarray(nodes, float)

    def log_lines(self, gap: str | None = None) -> list[tuple[str, str]]:
        """The panel's lines as (kind, text): kind is stdout, stderr or spotnb.

        ``gap``: where lines were left out between the first and the last ones kept,
        a line of kind ``spotnb`` with this text (``{n}``: how many) is put there.
        """
        out = []
        between = [] if gap is None or not self.left_out else \
            ["\x01" + gap.format(n=f"{self.left_out:,}")]
        for line in [*self.head, *between, *self.lines,
                     *([self._partial] if self._partial else [])]:
            if line.startswith("\x00"):
                out.append(("stderr", line[1:]))
            elif line.startswith("\x01"):
                out.append(("spotnb", line[1:]))
            else:
                out.append(("stdout", line))
        return out

    def metric_names(self) -> list[str]:
        """Metric names, ``loss`` (or the first name containing it) first."""
        names = list(self.metrics)
        first = [n for n in names if n == "loss"] or [n for n in names if "loss" in n][:1]
        return first + [n for n in names if n not in first]

    def summary(self) -> dict[str, Any]:
        """Sizes, for tests and the benchmark."""
        return {
            "metrics": {k: (len(s.curve), len(s.redone)) for k, s in self.metrics.items()},
            "sys": len(self.util),
            "nodes": {k: len(v) for k, v in self.node_util.items()},
            "worlds": len(self.worlds),
            "price": sum(len(p.series) for p in self.pools.values()),
            "markers": len(self.markers),
        }


def _markers(state: JobState) -> list[Marker]:
    """:attr:`DashboardData.markers` of ``state``."""
    out = []
    reasons = dict(state.group_notices)  # instance id -> the group's reason
    for b in state.breaks():
        a = state.attempts[b.attempt]
        if b.reason is EndReason.INTERRUPTED:
            reason = _NOTICE_REASONS.get(reasons.get(str(a.instance), ""),
                                         "spot interruption notice")
            detail = f"{reason} ({a.notice_action})" if a.notice_action else reason
            kind, when = "interrupted", a.notice_time or b.time
        elif b.reason is EndReason.MOVED:
            kind, when = "interrupted", a.notice_time or b.time
            detail = "its warm standby took over"
        elif b.reason is EndReason.ERROR_RETRIED:
            ename = (a.error or {}).get("ename")
            kind, when, detail = "retry", b.time, f"{ename}, retried in place"
        else:
            kind, when = "lost", b.time
            detail = "the instance went away without a notice"
        out.append(Marker(kind, when, b.attempt, step=b.step, redone=b.redone,
                          detail=detail))
    booted = [n for n, a in state.attempts.items() if a.boot_time is not None]
    for a in state.attempts.values():
        if a.boot_time is None or a.number <= (state.max_nodes if state.max_nodes > 1 else 1):
            continue
        where = " ".join(str(p) for p in (a.instance_type, a.az) if p)
        where += f" ({a.instance_id})" if a.instance_id else ""
        how = f"on {where.strip()}"
        before = replaced_attempt(a.number, booted, state.max_nodes)
        if before is not None and state.attempts[before].reason is EndReason.ERROR_RETRIED:
            how = f"retried in place {how}"  # after the error its marker names
        if state.max_nodes > 1:
            how = f"node {layout.node_slot(a.number, state.max_nodes)} replaced, {how}"
        out.append(Marker("resumed", a.boot_time, a.number, step=a.first_step, detail=how))
    return sorted(out, key=lambda m: m.time)


def _clip(line: str) -> str:
    return line if len(line) <= _LINE_CHARS else line[:_LINE_CHARS] + "…"
