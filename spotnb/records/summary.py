"""A job's record: what ran, on what, for how long, at what cost, with what result.

:func:`job_record` builds it from the job's store prefix (its spec, its event log, its
checkpoints), reusing :func:`spotnb.client.jobs.summarize` for attempts and cost. It is plain
JSON (see :mod:`spotnb.records` for the fields) and bounded in size however long the
job ran: metric curves are thinned to :data:`MAX_CURVE_POINTS` points, tracebacks and
strings are clipped.

:func:`job_ended` is what the notebook layer calls when a followed job ends: it builds
the record (with the ``--out`` values, which only the notebook has loaded) from what the
follow loop holds (the :class:`~spotnb.client.jobs.JobResult`, the fold of the job's
events and the :class:`Curves` gathered from them: the log is not read again), stores it
as ``summary.json`` in the job's prefix, and returns it for the cell's output metadata.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from spotnb.ckpt.checkpoints import CheckpointStore
from spotnb.client.jobs import JobHandle
from spotnb.client.results import JobResult, node_instances, nodes_label, summarize_state
from spotnb.protocol import layout
from spotnb.protocol.events import (
    Event,
    EventReader,
    codec,
    expand,
    is_terminal,
    metric_columns,
    metric_names,
)
from spotnb.protocol.events.fold import JobState, fold
from spotnb.protocol.secretstore import NOTIFY_SECRET
from spotnb.records.scrub import scrub

__all__ = [
    "MAX_CURVE_POINTS",
    "SCHEMA_VERSION",
    "Curves",
    "describe_value",
    "job_ended",
    "job_record",
    "kernel_outputs",
    "record_bundle",
    "store_summary",
]

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
#: Points kept per metric curve: enough to compare two runs' shapes, small enough that
#: a record of a million-step run weighs the same as one of a thousand.
MAX_CURVE_POINTS = 500
#: Metrics whose curves are kept (the rest keep their final value only).
MAX_CURVES = 12
#: A string output longer than this is described by its type, not kept.
MAX_STRING_OUTPUT = 200
_MAX_TRACEBACK_CHARS = 20_000
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def iso(t: float | None) -> str | None:
    """A wall-clock time as ISO 8601 UTC (``2025-01-31T12:00:00Z``)."""
    if t is None:
        return None
    when = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
    return when.isoformat(timespec="seconds").replace("+00:00", "Z")


def _number(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def describe_value(value: Any) -> Any:
    """What a record keeps of an ``--out`` value: numbers, booleans and short strings
    as they are (0-d arrays and tensors as their number), anything else as its type."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, dict) and set(value) == {"type"}:
        return dict(value)  # described already (an earlier record's)
    if isinstance(value, (int, float)):
        return _number(value) if isinstance(value, float) else value
    if isinstance(value, str) and len(value) <= MAX_STRING_OUTPUT:
        return value
    shape = getattr(value, "shape", None)
    if shape is not None and tuple(shape) == () and hasattr(value, "item"):
        try:
            return describe_value(value.item())
        except Exception:  # an exotic 0-d object: fall through to its type
            pass
    kind = type(value)
    return {"type": f"{kind.__module__}.{kind.__qualname__}"}


def _options(handle: JobHandle) -> dict[str, Any]:
    spec = handle.spec
    policy = spec.policy
    return {
        "provider": spec.provider,
        "instance_types": list(spec.resources.instance_types),
        "region": spec.resources.region,
        "max_price": spec.resources.max_price,
        "checkpoint_every": policy.checkpoint_every.describe(),
        "max_restarts_on_error": policy.max_restarts_on_error,
        "budget_usd": policy.budget_usd,
        "max_duration": policy.max_duration,
        "keep_checkpoints": policy.keep_checkpoints,
        "inputs": list(spec.inputs),
        "outputs": list(spec.outputs),
        "simulate_interruptions": spec.simulate_interruptions,
        # Whether notifications were sent; never where to (the URL is a secret).
        "notify": NOTIFY_SECRET in getattr(spec, "secrets", ()),
        # The names of the cell's secrets; never their values.
        "secrets": [n for n in getattr(spec, "secrets", ()) if n != NOTIFY_SECRET],
        "nodes": nodes_label(spec.resources),
        "peer_timeout": policy.peer_timeout if spec.resources.distributed else None,
    }


def _nodes(spec: Any, result: JobResult) -> dict[str, Any] | None:
    """A distributed job's nodes: its counts, its world as it changed, and the instance
    each node slot ran on last (type and zone where known). None for one node."""
    res = spec.resources
    if not res.distributed:
        return None
    return {
        "min": res.min_nodes,
        "max": res.max_nodes,
        "procs_per_node": res.procs_per_node,
        "label": nodes_label(res, result),
        "worlds": [{"time": iso(t), "nodes": n, "world_size": w}
                   for t, n, w in result.worlds],
        "instances": [{"node": a.node, "attempt": a.number, "instance_id": a.instance_id,
                       "instance_type": a.instance_type, "az": a.az,
                       "end_reason": a.end_reason} for a in node_instances(result)],
    }


class Curves:
    """Each metric against step as it finally stands (a step logged again by a later
    attempt replaces the lost one), gathered as events come (:meth:`add`: a batch a
    column at a time, in C loops), thinned to :data:`MAX_CURVE_POINTS` when asked
    (:meth:`thinned`). The follow loop feeds one, so a followed job's record needs no
    second read of its log."""

    def __init__(self) -> None:
        self._by_metric: dict[str, dict[float, float | None]] = {}

    def add(self, events: Iterable[Event]) -> None:
        by_metric = self._by_metric
        for e in events:
            if codec.is_batch(e):  # a batch, a column at a time (C loops)
                steps, times, columns = metric_columns(e)
                if len(steps) == len(times):  # else damaged: read as its rows, below
                    for name in metric_names(columns):
                        rows, values = columns[name]
                        if len(values) and len(steps):
                            at = steps if rows is None else map(steps.__getitem__, rows)
                            by_metric.setdefault(str(name), {}).update(
                                zip(map(float, at), map(_number, values), strict=False))
                    continue
            elif not codec.is_row(e):
                continue
            for row in expand(e):  # a metric event, or a damaged batch's rows
                if not codec.is_row(row) or row.data.get("step") is None:
                    continue
                step = _number(row.data["step"])
                if step is None:
                    continue
                for name, value in (row.data.get("values") or {}).items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool):
                        by_metric.setdefault(str(name), {})[step] = _number(value)

    def put(self, name: str, steps: Iterable[float], values: Iterable[float]) -> None:
        """A metric's points as they stand (a dashboard's series' curve, say)."""
        self._by_metric.setdefault(str(name), {}).update(
            zip(map(float, steps), map(_number, values), strict=False))

    def thinned(self) -> tuple[dict[str, Any], list[str]]:
        """The curves of the first :data:`MAX_CURVES` metrics, each thinned, and the
        names of the rest."""
        names = list(self._by_metric)
        kept, omitted = names[:MAX_CURVES], names[MAX_CURVES:]
        curves = {}
        for name in kept:
            points = sorted(self._by_metric[name].items())
            if len(points) > MAX_CURVE_POINTS:
                last = len(points) - 1
                picks = sorted({round(i * last / (MAX_CURVE_POINTS - 1))
                                for i in range(MAX_CURVE_POINTS)})
                points = [points[i] for i in picks]
            curves[name] = {"step": [int(s) if s.is_integer() else s for s, _ in points],
                            "value": [v for _, v in points]}
        return curves, omitted


def _checkpoints(handle: JobHandle, state: JobState) -> dict[str, Any]:
    written = state.checkpoints
    base = handle.store.uri.rstrip("/")
    kept = []
    try:
        for manifest in CheckpointStore(handle.store, layout.CHECKPOINTS).manifests():
            kept.append({"uri": f"{base}/{layout.CHECKPOINTS}/{manifest.id}/",
                         "step": manifest.step, "bytes": manifest.total_bytes,
                         "created": iso(manifest.created)})
    except Exception as err:  # a store we cannot read now: the events still tell a lot
        log.warning("cannot list the checkpoints of job %s: %s", handle.job_id, err)
    return {
        "written": len(written),
        "forced_by_notice": sum(1 for c in written if c.forced),
        "last_step": written[-1].step if written else None,
        "latest": kept[0]["uri"] if kept else None,
        "kept": kept,
        "sync_dirs": [f"{base}/{layout.SYNC}/{name}/" for name in sorted(state.synced)],
    }


def _error(error: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if not error:
        return None
    tb = error.get("traceback") or []
    text = _ANSI.sub("", "\n".join(tb) if isinstance(tb, list) else str(tb))
    if len(text) > _MAX_TRACEBACK_CHARS:
        text = "…" + text[-_MAX_TRACEBACK_CHARS:]
    return {"ename": error.get("ename"), "evalue": _ANSI.sub("", str(error.get("evalue", ""))),
            "traceback": text}


def job_record(handle: JobHandle, outputs: Mapping[str, Any] | None = None,
               events: list[Event] | None = None, result: JobResult | None = None,
               state: JobState | None = None, curves: Curves | None = None
               ) -> dict[str, Any]:
    """The record of the job behind ``handle`` (see :mod:`spotnb.records`).

    ``outputs`` are the job's ``--out`` values where they are loaded (the notebook's
    kernel), or their descriptions (:func:`describe_value`) from an earlier record.
    What the caller has saves reading the log again: ``state`` (its events folded) and
    ``curves`` (gathered from them) together, or ``events``; and ``result``.
    """
    spec = handle.spec
    if state is None or curves is None:
        if events is None:
            events = EventReader(handle.store).poll()
        state = fold(events, spec.resources.max_nodes)
        curves = Curves()
        curves.add(events)
    if result is None:
        result = summarize_state(spec, state, handle.result_record())
    described = {k: describe_value(v) for k, v in (outputs or {}).items()}
    metrics = {k: _number(v) for k, v in result.metrics.items()}
    final = dict(metrics)
    final.update({k: v for k, v in described.items() if _number(v) is not None})
    thinned, omitted = curves.thinned()
    ended = is_terminal(result.status)
    breaks = state.breaks(final=ended)
    last_time = state.last_time
    record: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "job_id": spec.job_id,
        "name": spec.name,
        "status": result.status,
        "reason": result.reason,
        "store_uri": spec.store_uri,
        "spotnb_version": spec.spotnb_version,
        "code_sha256": hashlib.sha256(spec.code.encode()).hexdigest(),
        "options": _options(handle),
        "params": state.params,
        "params_source": list(state.param_sources),
        "created": iso(spec.created),
        "end": iso(last_time) if ended else None,
        "duration_s": round(result.duration, 3),
        "attempts": [{
            "number": a.number,
            "instance_id": a.instance_id,
            "instance_type": a.instance_type,
            "pool": a.pool,
            "start": iso(a.start),
            "end": iso(a.end),
            "end_reason": a.end_reason,
            "spot_price_usd_per_hour": a.spot_price,
            "az": a.az,
            "node": a.node,
            "region": a.region,
            "moved": a.moved,
        } for a in result.attempts],
        "interruptions": result.interruptions,
        # Where each early end was (the comparison marks them on the curves).
        "breaks": [{"attempt": b.attempt, "reason": b.reason.value, "time": iso(b.time),
                    "step": b.step, "resumed_at": b.resumed_at, "redone": b.redone}
                   for b in breaks],
        "redone_steps": state.redone_steps(),
        "cost_usd": result.cost_usd,
        "transfer_usd": round(result.transfer_usd, 6),
        # What EC2 interrupted in its first hour ran: not charged (not in cost_usd).
        "refunded_usd": round(state.refunded_usd(), 6),
        "refunded_instances": len(state.refunded()),
        "ondemand_cost_usd": result.ondemand_cost_usd,
        "savings_pct": (round(result.savings_pct, 2) if result.savings_pct is not None
                        else None),
        "metrics": metrics,
        "outputs": described,
        "final_metrics": final,
        "checkpoints": _checkpoints(handle, state),
        "curves": thinned,
        "error": _error(result.error),
    }
    if omitted:
        record["curves_omitted"] = omitted
    nodes = _nodes(spec, result)
    if nodes is not None:
        record["nodes"] = nodes
    # Belt and braces (DESIGN invariant 7): a traceback or an output may quote a secret.
    return scrub(record)[0]


def store_summary(handle: JobHandle, record: Mapping[str, Any]) -> bool:
    """Write ``record`` as the job's ``summary.json``; whether that worked (a store
    that refuses the write is logged, not raised: the record is a by-product)."""
    body = {k: v for k, v in record.items() if k != "cell"}
    try:
        handle.store.put(layout.SUMMARY, json.dumps(body, indent=1, sort_keys=True).encode())
    except Exception as err:
        log.warning("could not store the summary of job %s in %s: %s", handle.job_id,
                    handle.store.uri, err)
        return False
    return True


def job_ended(handle: JobHandle, result: JobResult, state: JobState | None = None,
              curves: Curves | None = None) -> dict[str, Any] | None:
    """The notebook's hook for a followed job that ended: build its record from the
    ``result`` in hand (with the ``--out`` values in ``result.outputs``), the follow
    loop's fold of its events (``state``) and the curves gathered from them (without
    both, the log is read), store it as ``summary.json`` in the job's prefix, and return
    it, for the cell's output metadata (``{"spotnb": {"job": ...}}``).

    Never raises: the record is a by-product, and the cell's outcome must not depend on
    it; None (and a logged warning) if it could not be built.
    """
    try:
        record = job_record(handle, outputs=result.outputs, result=result, state=state,
                            curves=curves)
    except Exception:
        log.warning("could not build the record of job %s", handle.job_id, exc_info=True)
        return None
    store_summary(handle, record)
    return record


def record_bundle(record: Mapping[str, Any]) -> dict[str, str]:
    """A one-line MIME bundle to display with a job's record as output metadata."""
    parts = [f"{record.get('status')}", f"{len(record.get('attempts') or [])} attempt(s)",
             f"{record.get('interruptions', 0)} interruption(s)",
             f"${record.get('cost_usd', 0):.4f}"]
    if record.get("savings_pct") is not None:
        parts[-1] += (f" ({record['savings_pct']:.0f}% less than "
                      f"${record.get('ondemand_cost_usd', 0):.4f} on-demand)")
    finals = ", ".join(f"{k} {v:.4g}" for k, v in list(
        (record.get("final_metrics") or {}).items())[:4] if isinstance(v, (int, float)))
    text = (f"spotnb record of job {record.get('job_id')} ({record.get('name')!r}): "
            + ", ".join(parts) + (f"; {finals}" if finals else "")
            + f". Saved with the notebook and as {layout.SUMMARY} in the job's store.")
    return {"text/plain": text}


def kernel_outputs(job_ids: list[str]) -> str:
    """Run in the notebook's kernel by ``spotnb record``: the ``--out`` values of the
    given jobs as JSON ``{job_id: {name: described value}}``. The kernel is where they
    load (it has the modules their classes come from)."""
    import cloudpickle

    import spotnb

    found: dict[str, dict[str, Any]] = {}
    for job_id in job_ids:
        try:
            handle = spotnb.attach(job_id)
            if not handle.spec.outputs or not handle.store.exists(layout.OUTPUTS):
                continue
            values = cloudpickle.loads(handle.store.get(layout.OUTPUTS))
            found[job_id] = {str(k): describe_value(v) for k, v in dict(values).items()}
        except Exception as err:  # one job's outputs must not cost the others
            log.warning("cannot load the outputs of job %s: %s", job_id, err)
    return json.dumps(found)

