"""A sweep in the store: its definition, its trials' state, its driver, a stop request.

``sweeps/<id>/`` beside ``jobs/`` (an S3 bucket on AWS), one prefix per sweep:

``sweep.json``  the definition: the cell, the space, the settings (written once)
``search.pkl``  the sampler and the pruner (cloudpickle), for a driver that takes over
``state.json``  every trial (parameters, job id, state, objective value), the sweep's
                status and reason, and the driver's heartbeat. Only the driver writes
                it, by compare-and-swap (:func:`put_state`), so no second driver ever
                runs beside it.
``stop.json``   a stop request (``spotnb stop SWEEP``, ``%spot_sweep_stop``): the
                driver ends the sweep for good at its next round; where the driver is
                gone (its heartbeat older than :data:`HEARTBEAT_STALE_SECONDS`), the
                one who asked ends it in ``state.json`` (:func:`end_in_store`)

A sweep whose status is ``running`` but whose driver is gone is *abandoned*
(:func:`liveness`): its running trials' jobs go on by themselves (each is a spot job
with its own resume), but nobody starts its other trials until ``%spot_attach SWEEP
--resume`` drives it on, or ``spotnb stop SWEEP`` ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import time
from collections.abc import Mapping
from typing import Any

from spotnb.protocol import layout
from spotnb.protocol.store import NotFound, Store, open_store

__all__ = [
    "DEFINITION_KEY",
    "HEARTBEAT_SECONDS",
    "HEARTBEAT_STALE_SECONDS",
    "SEARCH_KEY",
    "STATE_KEY",
    "STOP_KEY",
    "SWEEPS_PREFIX",
    "TRIAL_STATES",
    "SweepInfo",
    "SweepNotFound",
    "Trial",
    "definitions",
    "end_in_store",
    "find_definition",
    "index_sweep",
    "liveness",
    "new_sweep_id",
    "put_state",
    "read_state",
    "request_stop",
    "round_value",
    "stop_request",
    "store_root",
    "sweep_info",
    "sweep_prefix",
    "trial_label",
]

SWEEPS_PREFIX = "sweeps"
DEFINITION_KEY = "sweep.json"
STATE_KEY = "state.json"
SEARCH_KEY = "search.pkl"
STOP_KEY = "stop.json"

# The driver rewrites state.json at least this often while trials run, as its heartbeat:
# 360 PUTs an hour, $0.0018/h on S3, once per sweep (not per trial).
HEARTBEAT_SECONDS = 10.0
# A heartbeat older than this: the driver is gone (its kernel restarted or closed).
HEARTBEAT_STALE_SECONDS = 45.0

#: A trial's states: waiting (not started), running, then one of the others
#: (``pruned``: its pruner stopped it; ``skipped``: never started, the sweep ended).
TRIAL_STATES = ("waiting", "running", "completed", "pruned", "failed", "stopped",
                "skipped")


class SweepNotFound(LookupError):
    """No sweep matches what was asked for."""

    def __init__(self, query: str, where: str) -> None:
        self.query, self.where = query, where
        super().__init__(f"no sweep {query!r} in {where}: give a sweep's id (sweep-...) "
                         "or its name, as `spotnb sweeps` (or spotnb.sweeps()) lists them")


@dataclasses.dataclass
class Trial:
    """One trial: its parameters, its job, how it stands (as the sweep's driver
    decided it: the job's own facts are its fold's)."""

    number: int
    params: dict[str, Any]
    job_id: str | None = None
    state: str = "waiting"
    #: The objective: the sweep's metric at the trial's end (its last value), as the
    #: study was told.
    value: float | None = None
    #: The step at which it was pruned.
    pruned_at: int | None = None
    reason: str = ""

    @property
    def over(self) -> bool:
        return self.state not in ("waiting", "running")

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Trial:
        """A trial as ``state.json`` keeps it (fields a newer spotnb added ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in names})


def round_value(value: Any, digits: int = 4) -> str:
    """A parameter's value for a person: numbers to ``digits`` significant digits
    (``0.03029``, ``1e-05``, ``128``), anything else as it is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return format(value, f".{digits}g")


def trial_label(trial: Trial) -> str:
    """``t3 lr=0.03029, hidden=128``: the trial's number and rounded parameters."""
    params = ", ".join(f"{k}={round_value(v)}" for k, v in trial.params.items())
    return f"t{trial.number} {params}".strip()


def new_sweep_id() -> str:
    return "sweep-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def store_root(store: str | os.PathLike[str] | None) -> Store:
    return open_store(os.fspath(store) if store is not None else layout.default_store_root())


def sweep_prefix(root: Store, sweep_id: str) -> Store:
    return root.child(f"{SWEEPS_PREFIX}/{sweep_id}")


def _index_dir() -> Any:
    return layout.index_dir() / "sweeps"


def index_sweep(root_uri: str, sweep_id: str, name: str, created: float) -> None:
    """Remember where the sweep lives (as jobs are), so listings find it in any store."""
    path = _index_dir() / f"{sweep_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"store_uri": root_uri, "name": name, "created": created}))


def definitions(store: str | None = None) -> list[dict[str, Any]]:
    """Every sweep's definition (its ``sweep.json``), oldest first: in ``store``, and
    without one, every sweep started from this machine too."""
    roots = {store_root(store).uri}
    if store is None and _index_dir().is_dir():
        for path in _index_dir().glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                roots.add(json.loads(path.read_text())["store_uri"])
    out = {}
    for uri in roots:
        root = open_store(uri)
        for sweep_id in root.list_children(SWEEPS_PREFIX):
            with contextlib.suppress(NotFound, ValueError):
                out[sweep_id] = json.loads(sweep_prefix(root, sweep_id).get(DEFINITION_KEY))
    return sorted(out.values(), key=lambda d: d["created"])


def find_definition(query: str, store: str | None = None) -> dict[str, Any] | None:
    """The definition of the sweep ``query`` names (its id or its name; a name several
    sweeps share: the newest), or None."""
    if not query:
        return None
    matches = [d for d in definitions(store) if query in (d["sweep_id"], d["name"])]
    return matches[-1] if matches else None


def read_state(prefix: Store) -> tuple[dict[str, Any], str] | None:
    """``state.json`` and its etag (None before the driver wrote it)."""
    try:
        data, etag = prefix.get_with_etag(STATE_KEY)
    except NotFound:
        return None
    return json.loads(data), etag


def put_state(prefix: Store, state: Mapping[str, Any], etag: str | None) -> str | None:
    """Write ``state.json`` if it is still at ``etag`` (None: only if there is none
    yet); the new etag, or None when another process wrote it meanwhile."""
    data = json.dumps(state).encode()
    if etag is None:
        return prefix.put_if_absent(STATE_KEY, data)
    return prefix.put_if_match(STATE_KEY, data, etag)


def liveness(state: Mapping[str, Any], now: float | None = None) -> str:
    """The sweep's status as a person should read it: ``running`` only while its
    driver's heartbeat is fresh; ``abandoned`` when the driver is gone with the sweep
    unfinished; else the status the driver left (completed, stopped, failed)."""
    status = str(state.get("status") or "running")
    if status != "running":
        return status
    now = time.time() if now is None else now
    beat = float(state.get("heartbeat") or 0.0)
    return "running" if now - beat <= HEARTBEAT_STALE_SECONDS else "abandoned"


def request_stop(prefix: Store, reason: str) -> bool:
    """Ask the sweep's driver, wherever it runs, to end the sweep for good (the first
    request counts); whether this one is the request recorded."""
    body = {"reason": reason, "time": time.time()}
    return prefix.put_if_absent(STOP_KEY, json.dumps(body).encode()) is not None


def stop_request(prefix: Store) -> dict[str, Any] | None:
    """The sweep's stop request, if one was made (one GET)."""
    try:
        raw = json.loads(prefix.get(STOP_KEY) or b"{}")
    except NotFound:
        return None
    except ValueError:
        raw = {}
    return raw if isinstance(raw, dict) else {}


def end_in_store(prefix: Store, reason: str, cost: Any = None,
                 tries: int = 5) -> dict[str, Any] | None:
    """End an abandoned sweep in ``state.json`` (its driver is gone): status
    ``stopped`` with ``reason``, its waiting trials ``skipped``, its running ones
    ``stopped`` (the caller stops their jobs), and its ``cost`` (a
    :class:`~spotnb.sweep.budget.SweepCost`) if given. By compare-and-swap, so a driver
    that comes back meanwhile wins; the state written, or None if the sweep was not
    abandoned (ended already, or its driver is alive)."""
    for _ in range(tries):
        found = read_state(prefix)
        if found is None:
            return None
        state, etag = found
        if liveness(state) != "abandoned":
            return None
        trials = []
        for raw in state.get("trials") or []:
            trial = Trial.from_dict(raw)
            if trial.state == "waiting":
                trial.state, trial.reason = "skipped", reason
            elif trial.state == "running":
                trial.state, trial.reason = "stopped", reason
            trials.append(dataclasses.asdict(trial))
        new = {**state, "status": "stopped", "reason": reason, "ended_at": time.time(),
               "heartbeat": time.time(), "trials": trials}
        if cost is not None:
            new.update({"cost_usd": cost.cost_usd, "billed_usd": cost.billed_usd,
                        "refunded_usd": cost.refunded_usd,
                        "refunded_instances": cost.refunded_instances,
                        "ondemand_cost_usd": cost.ondemand_usd})
        if put_state(prefix, new, etag) is not None:
            return new
    return None


@dataclasses.dataclass(frozen=True)
class SweepInfo:
    """A row of ``spotnb sweeps``: the sweep as its store says it."""

    sweep_id: str
    name: str
    #: running, abandoned (the driver gone, the sweep unfinished), completed, stopped,
    #: failed (:func:`liveness`)
    status: str
    reason: str
    created: float
    metric: str
    direction: str
    counts: dict[str, int]
    cost_usd: float
    refunded_usd: float
    best_value: float | None
    best_trial: int | None
    store_uri: str


def sweep_info(definition: Mapping[str, Any], now: float | None = None) -> SweepInfo:
    """The sweep of ``definition``, from its ``state.json`` (one GET)."""
    prefix = sweep_prefix(open_store(definition["store_uri"]), definition["sweep_id"])
    found = read_state(prefix)
    state: dict[str, Any] = found[0] if found is not None else {"status": "running",
                                                                 "heartbeat": 0}
    counts = dict.fromkeys(TRIAL_STATES, 0)
    for raw in state.get("trials") or []:
        counts[str(raw.get("state"))] = counts.get(str(raw.get("state")), 0) + 1
    best = state.get("best") or {}
    return SweepInfo(
        sweep_id=definition["sweep_id"], name=definition["name"],
        status=liveness(state, now), reason=str(state.get("reason") or ""),
        created=float(definition["created"]), metric=str(definition["metric"]),
        direction=str(definition["direction"]), counts=counts,
        cost_usd=float(state.get("cost_usd") or 0.0),
        refunded_usd=float(state.get("refunded_usd") or 0.0),
        best_value=best.get("value"), best_trial=best.get("number"),
        store_uri=str(definition["store_uri"]))
