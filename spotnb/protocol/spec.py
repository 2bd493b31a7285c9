"""What a job is: the frozen, JSON-serialisable :class:`JobSpec` and its parts.

A spec is written once to ``spec.json`` in the job's store prefix and never changed.
It holds no cloud credentials (DESIGN invariant 7): only names, code and settings, and
the webhook URL of notifications, which is never copied out of it.

Every part checks its fields when it is made (``__post_init__``), so a spec that exists
is a valid one: a bad value is a :class:`SpecError` before anything starts, whether it
came from :func:`spotnb.submit`, the magics or a ``spec.json``. The normalisers
(:mod:`spotnb.protocol.values`: :func:`whole_number`, :func:`amount`,
:func:`parse_duration`, the name checks; handed out here too) turn what a user typed
into the exact types a spec holds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from spotnb.protocol.errors import SpecError
from spotnb.protocol.values import (
    INJECTED_NAMES,
    IPYTHON_CACHE_NAME,
    MAX_NODES,
    MAX_PROCS_PER_NODE,
    PEER_TIMEOUT_MAX_SECONDS,
    PEER_TIMEOUT_MIN_SECONDS,
    amount,
    bad_value,
    check_env_name,
    check_input_name,
    check_nodes,
    check_output_name,
    check_user_env_name,
    check_variable_name,
    parse_duration,
    parse_nodes,
    parse_peer_timeout,
    whole_number,
)

__all__ = [
    "INJECTED_NAMES",
    "IPYTHON_CACHE_NAME",
    "MAX_NODES",
    "MAX_PROCS_PER_NODE",
    "PEER_TIMEOUT_MAX_SECONDS",
    "PEER_TIMEOUT_MIN_SECONDS",
    "READABLE_SCHEMAS",
    "SPEC_SCHEMA",
    "CheckpointEvery",
    "JobSpec",
    "Policy",
    "Resources",
    "SpecError",
    "amount",
    "check_env_name",
    "check_input_name",
    "check_output_name",
    "check_user_env_name",
    "check_variable_name",
    "parse_duration",
    "parse_nodes",
    "parse_peer_timeout",
    "whole_number",
]

SPEC_SCHEMA = 1
#: The spec schemas this version reads: ``schema`` of a ``spec.json``.
READABLE_SCHEMAS = frozenset({1})

# A job's name is shown in one row of `spotnb jobs`; longer is a mistake, not a name.
MAX_NAME_CHARS = 200


#: ``Checkpoint.maybe_save`` saves this often unless the job says otherwise.
DEFAULT_CHECKPOINT_SECONDS = 300.0


@dataclasses.dataclass(frozen=True)
class CheckpointEvery:
    """When ``Checkpoint.maybe_save`` saves: every ``seconds`` or every ``steps``.

    The default is every :data:`DEFAULT_CHECKPOINT_SECONDS`: the interruption notice
    forces a save anyway, so periodic saves only bound what a kill without notice
    redoes, and on S3 each costs about five requests (every minute: $0.0015/h).
    """

    seconds: float | None = DEFAULT_CHECKPOINT_SECONDS
    steps: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.steps is None):
            raise SpecError("{option} needs exactly one of seconds and steps, not "
                            f"{self.seconds!r} and {self.steps!r}", field="checkpoint_every")
        if self.seconds is not None:
            parse_duration(self.seconds, "checkpoint_every")
        if self.steps is not None:
            whole_number(self.steps, "checkpoint_every", minimum=1)

    @classmethod
    def parse(cls, value: Any) -> CheckpointEvery:
        """``300``/``"5m"`` (seconds) or ``"100 steps"``/``"100steps"``."""
        if isinstance(value, CheckpointEvery):
            return value
        usage = ("{option} must be a time like '60s' or '5m', or a step count like "
                 f"'500 steps', not {value!r}")
        if isinstance(value, str):
            m = re.match(r"^\s*(\d+)\s*(steps?)\s*$", value.lower())
            if m:
                steps = int(m.group(1))
                if steps <= 0:
                    raise SpecError(usage, field="checkpoint_every")
                return cls(seconds=None, steps=steps)
        try:
            return cls(seconds=parse_duration(value, "checkpoint_every"), steps=None)
        except SpecError:
            raise SpecError(usage, field="checkpoint_every") from None

    def describe(self) -> str:
        return f"every {self.steps} steps" if self.steps else f"every {self.seconds:g}s"


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the job may run: instance types in order of preference, regions, price cap,
    and how many nodes (``min_nodes``..``max_nodes``) with how many worker processes each.

    ``region`` is the job's *home*: its store is there, wherever its instances run.
    ``regions`` are all the regions it may run in, in the user's order, home among them
    (``spotnb.providers.regions``); a spec made without them (or written before they
    existed) runs in its home only: ``regions`` is then ``(region,)``.

    A job with ``max_nodes > 1`` or ``procs_per_node > 1`` is *distributed*: its cell runs
    in ``procs_per_node`` kernels on each node, as torchrun's workers (see
    :mod:`spotnb.kernel_remote.multinode`).
    """

    instance_types: tuple[str, ...]
    region: str = "us-east-1"
    max_price: float | None = None
    min_nodes: int = 1
    max_nodes: int = 1
    procs_per_node: int = 1
    regions: tuple[str, ...] = ()

    @property
    def distributed(self) -> bool:
        """Whether the cell runs as torchrun workers (several nodes or processes)."""
        return self.max_nodes > 1 or self.procs_per_node > 1

    def __post_init__(self) -> None:
        if not isinstance(self.instance_types, tuple) or not all(
                isinstance(t, str) and t and t == t.strip() and "," not in t
                for t in self.instance_types):
            raise bad_value("instance_types", "instance type names such as 'g5.xlarge'",
                       self.instance_types)
        if not isinstance(self.region, str) or not self.region.strip():
            raise bad_value("region", "a region name such as 'us-east-1'", self.region)
        _check_regions(self.regions, self.region)
        if not self.regions:
            object.__setattr__(self, "regions", (self.region,))
        if self.max_price is not None:
            amount(self.max_price, "max_price", "USD per hour",
                   "leave it unset to cap at the on-demand price")
            _exact_float(self.max_price, "max_price")
        _exact_int(self.min_nodes, "nodes", 1)
        _exact_int(self.max_nodes, "nodes", 1)
        check_nodes(self.min_nodes, self.max_nodes, "nodes",
                     f"{self.min_nodes}:{self.max_nodes}")
        _exact_int(self.procs_per_node, "procs_per_node", 1)
        if self.procs_per_node > MAX_PROCS_PER_NODE:
            raise SpecError(
                f"{{option}} {self.procs_per_node} is above spotnb's limit of "
                f"{MAX_PROCS_PER_NODE} processes per node; use one per GPU of the "
                "instance type (e.g. 8 on p4d.24xlarge)", field="procs_per_node")


def _check_regions(regions: Any, home: str) -> None:
    """A tuple of distinct region names (or empty), the home ``region`` among them."""
    if not isinstance(regions, tuple) or not all(
            isinstance(r, str) and r and r == r.strip() and "," not in r for r in regions):
        raise bad_value("region", "region names such as ('us-east-1', 'us-west-2')", regions)
    if len(set(regions)) != len(regions):
        raise bad_value("region", "regions without repeats", regions)
    if regions and home not in regions:
        raise SpecError(f"{{option}}: the job's home region {home} (where its store is) "
                        f"must be one of its regions {', '.join(regions)}", field="region")


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the job is run and when it is given up.

    (A job's notification webhook is a secret, not a setting: it travels as the secret
    :data:`spotnb.protocol.secretstore.NOTIFY_SECRET`, never in the spec.)
    """

    checkpoint_every: CheckpointEvery = CheckpointEvery()
    max_restarts_on_error: int = 0
    budget_usd: float | None = None
    max_duration: float | None = None
    keep_checkpoints: int = 3
    # Distributed jobs: the longest any rank waits on a peer (collectives of process
    # groups created in the cell without a timeout of their own, connections to the
    # rendezvous) before the peer is taken for lost and the world re-forms.
    peer_timeout: float = 120.0
    # A warm standby on a rebalance recommendation (spotnb.kernel_remote.standby): it
    # boots, starts the kernel and prefetches the checkpoint while the old instance
    # trains, and takes over at the notice. Billed to the job; off for the cheapest run.
    standby: bool = True
    # In an instance's first hour a standby is timed to be ready as that hour ends, not
    # started at once: EC2 interrupting it before then makes the whole instance free
    # (spotnb.protocol.billing), which moving the job off it forfeits. True starts
    # standbys at once (the shortest gap, for a deadline, at that price).
    standby_first_hour: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.standby, bool):
            raise bad_value("standby", "True or False", self.standby)
        if not isinstance(self.standby_first_hour, bool):
            raise bad_value("standby_first_hour", "True or False", self.standby_first_hour)
        if not isinstance(self.checkpoint_every, CheckpointEvery):
            raise bad_value("checkpoint_every", "a CheckpointEvery", self.checkpoint_every)
        _exact_int(self.max_restarts_on_error, "max_restarts_on_error", 0)
        if self.budget_usd is not None:
            amount(self.budget_usd, "budget_usd", "USD", "leave it unset for no budget")
            _exact_float(self.budget_usd, "budget_usd")
        if self.max_duration is not None:
            parse_duration(self.max_duration, "max_duration")
            _exact_float(self.max_duration, "max_duration")
        _exact_int(self.keep_checkpoints, "keep_checkpoints", 1)
        parse_peer_timeout(self.peer_timeout)
        _exact_float(self.peer_timeout, "peer_timeout")


def _exact_int(value: Any, field: str, minimum: int) -> None:
    """A spec holds a plain ``int`` (JSON-serialisable), not a numpy integer."""
    whole_number(value, field, minimum)
    if type(value) is not int:
        raise bad_value(field, "a plain int", value)


def _exact_float(value: Any, field: str) -> None:
    if type(value) not in (int, float):
        raise bad_value(field, "a plain number", value)


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything an agent needs to run a job. Written once as ``spec.json``.

    ``env``: environment variables of the job's kernel, by name; a value of None takes
    the variable from the local cloud's own environment (local provider only), so its
    value is never written anywhere. Values written here must not be secrets
    (:func:`spotnb.submit` refuses those that look like one).

    ``secrets``: names of the kernel's environment variables whose values are secrets
    (and :data:`spotnb.protocol.secretstore.NOTIFY_SECRET` for the webhook): the values live in
    the provider's secret store (:mod:`spotnb.protocol.secretstore`), never here.
    """

    job_id: str
    name: str
    code: str
    provider: str
    resources: Resources
    policy: Policy
    store_uri: str
    created: float
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    # Local cloud only: {"count": N} or {"schedule": [seconds since launch, ...]}.
    simulate_interruptions: dict[str, Any] | None = None
    # Local cloud only: the job's rebalance recommendations (spotnb.providers.local.
    # signals.SignalModel's fields); None: the model's defaults.
    simulate_signals: dict[str, Any] | None = None
    env: dict[str, str | None] = dataclasses.field(default_factory=dict)
    secrets: tuple[str, ...] = ()
    spotnb_version: str = ""
    schema: int = SPEC_SCHEMA

    def __post_init__(self) -> None:
        for field in ("job_id", "code", "provider", "store_uri"):
            if not isinstance(getattr(self, field), str):
                raise bad_value(field, "a string", getattr(self, field))
        if not isinstance(self.name, str) or not self.name.strip() or \
                len(self.name) > MAX_NAME_CHARS or not self.name.isprintable():
            raise bad_value("name", f"a printable name of 1 to {MAX_NAME_CHARS} characters on "
                       "one line", self.name)
        if self.name.strip() in (".", "..") or "/" in self.name or "\\" in self.name:
            raise bad_value("name", "a name without '/' or '\\' that is not '.' or '..' (a "
                       "job's name is typed in commands such as `spotnb logs NAME`, where "
                       "these read as paths)", self.name, "e.g. gpt-small-lr3e-4")
        if isinstance(self.schema, bool) or self.schema not in READABLE_SCHEMAS:
            raise SpecError(_unreadable_schema(self.schema))
        if not isinstance(self.resources, Resources) or not isinstance(self.policy, Policy):
            raise SpecError("a JobSpec needs Resources and a Policy; this is a spotnb bug, "
                            "please report it")
        for field in ("inputs", "outputs"):
            names = getattr(self, field)
            if not isinstance(names, tuple):
                raise bad_value(field, "a tuple of variable names", names)
            for name in names:
                (check_input_name if field == "inputs" else check_output_name)(name, field)
            if len(set(names)) != len(names):
                raise bad_value(field, "names without repeats", names)
        _check_simulation(self.simulate_interruptions)
        if self.simulate_signals is not None:
            from spotnb.protocol.signals import SignalModel

            SignalModel.from_dict(self.simulate_signals)
        if not isinstance(self.env, dict):
            raise bad_value("env", "a dict of environment variables", self.env)
        for key, value in self.env.items():
            check_user_env_name(key)
            if value is not None and (not isinstance(value, str) or "\0" in value):
                raise bad_value("env", "text values (or None)", {key: value})
        _check_secret_names(self.secrets, self.env)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        """The spec in ``text`` (a ``spec.json``): SpecError, naming the field, for
        anything that is not one (not JSON, a wrong shape, a bad value), whoever wrote
        it: a spec read back is untrusted input like any other."""
        try:
            raw = json.loads(text)
        except (ValueError, RecursionError) as err:
            raise SpecError(f"spec.json is not JSON ({err}); {_RESUBMIT}") from None
        raw = _object(raw, "spec.json")
        schema = raw.get("schema", SPEC_SCHEMA)
        if isinstance(schema, bool) or not isinstance(schema, int):
            raise SpecError(f"spec.json: schema must be a whole number, not {schema!r}; "
                            + _RESUBMIT)
        if schema not in READABLE_SCHEMAS:
            raise SpecError(_unreadable_schema(schema))
        res = _object(raw.pop("resources", None), "resources")
        pol = _object(raw.pop("policy", None), "policy")
        every = _object(pol.pop("checkpoint_every", None), "checkpoint_every")
        names = {f.name for f in dataclasses.fields(cls)} - {"resources", "policy"}
        unknown = sorted(set(raw) - names) + sorted(
            set(res) - {f.name for f in dataclasses.fields(Resources)}) + sorted(
            set(pol) - {f.name for f in dataclasses.fields(Policy)}) + sorted(
            set(every) - {f.name for f in dataclasses.fields(CheckpointEvery)})
        if unknown:
            raise SpecError(f"spec.json has fields this spotnb does not know "
                            f"({', '.join(map(str, unknown))}); {_RESUBMIT}")
        missing = sorted({"job_id", "name", "code", "provider", "store_uri", "created"}
                         - set(raw)) + (["instance_types"] if "instance_types" not in res
                                        else [])
        if missing:
            raise SpecError(f"spec.json lacks {', '.join(missing)}; {_RESUBMIT}")
        if not isinstance(raw.get("created"), (int, float)) or isinstance(
                raw["created"], bool) or not math.isfinite(raw["created"]):
            raise bad_value("created", "a time (seconds since the epoch)", raw["created"],
                       _RESUBMIT)
        try:
            return cls(
                resources=Resources(
                    instance_types=_names_list(res["instance_types"], "instance_types"),
                    region=res.get("region", "us-east-1"),
                    max_price=res.get("max_price"),
                    min_nodes=res.get("min_nodes", 1),
                    max_nodes=res.get("max_nodes", 1),
                    procs_per_node=res.get("procs_per_node", 1),
                    # Specs written before a job had several regions: its home only.
                    regions=_names_list(res.get("regions", ()), "region"),
                ),
                policy=Policy(checkpoint_every=CheckpointEvery(**every), **pol),
                inputs=_names_list(raw.pop("inputs", ()), "inputs"),
                outputs=_names_list(raw.pop("outputs", ()), "outputs"),
                secrets=_names_list(raw.pop("secrets", ()), "secrets"),
                **raw,
            )
        except (TypeError, ValueError, AttributeError) as err:
            if isinstance(err, SpecError):
                raise
            # A value of a type no check expected (a number where text belongs): the
            # same answer as for any other damage.
            raise SpecError(f"spec.json is damaged ({err}); {_RESUBMIT}") from None


def _unreadable_schema(schema: Any) -> str:
    readable = ", ".join(map(str, sorted(READABLE_SCHEMAS)))
    if isinstance(schema, int) and not isinstance(schema, bool) and schema > SPEC_SCHEMA:
        return (f"this job was written by a newer spotnb (spec schema {schema}; this "
                f"spotnb reads {readable}); upgrade spotnb: pip install -U spotnb")
    return (f"spec.json: schema {schema!r} is not one this spotnb reads ({readable}); "
            + _RESUBMIT)


# What to do about a spec.json that cannot be read: it is written once, by spotnb.
_RESUBMIT = ("the job's spec.json was changed or damaged after it was written; submit "
             "the job again (its checkpoints stay in its store)")


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"spec.json: {what} must be a JSON object, not {value!r}; "
                        + _RESUBMIT)
    return dict(value)


def _names_list(value: Any, field: str) -> tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise bad_value(field, "a list of names", value, _RESUBMIT)
    return tuple(value)


def _check_secret_names(names: Any, env: dict[str, Any]) -> None:
    """A tuple of distinct variable names, none of them also in ``env``."""
    if not isinstance(names, tuple):
        raise bad_value("secrets", "a tuple of environment variable names", names)
    for name in names:
        check_env_name(name, "secrets")
    if len(set(names)) != len(names):
        raise bad_value("secrets", "names without repeats", names)
    both = sorted(set(names) & set(env))
    if both:
        raise SpecError(f"{{option}}: {', '.join(both)} is given both as a secret and in "
                        "env; give it once, as a secret", field="secrets")


def _check_simulation(sim: Any) -> None:
    """``{"count": N}`` with N >= 1, or ``{"schedule": [seconds >= 0, ...]}``."""
    if sim is None:
        return
    usage = ("{option} must be a count of interruptions or a list of times after launch "
             f"(seconds), not {sim!r}")
    if not isinstance(sim, dict) or len(sim) != 1 or not set(sim) <= {"count", "schedule"}:
        raise SpecError(usage, field="simulate_interruptions")
    if "count" in sim:
        count = sim["count"]
        if isinstance(count, bool) or type(count) is not int or count < 1:
            raise SpecError(usage, field="simulate_interruptions")
    else:
        schedule = sim["schedule"]
        if not isinstance(schedule, (list, tuple)) or not schedule or any(
                isinstance(t, bool) or type(t) not in (int, float) or not math.isfinite(t)
                or t < 0 for t in schedule):
            raise SpecError(usage, field="simulate_interruptions")
