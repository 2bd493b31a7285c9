"""What a job is: the frozen, JSON-serialisable :class:`JobSpec` and its parts.

A spec is written once to ``spec.json`` in the job's store prefix and never changed.
It holds no credentials (DESIGN invariant 7): only names, code and settings.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

__all__ = [
    "SPEC_SCHEMA",
    "CheckpointEvery",
    "JobSpec",
    "Policy",
    "Resources",
    "SpecError",
    "parse_duration",
    "parse_nodes",
]

SPEC_SCHEMA = 1


class SpecError(ValueError):
    """A job's settings are invalid; the message says how to fix them."""


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "m": 60.0, "min": 60.0,
          "mins": 60.0, "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "d": 86400.0}


def parse_duration(value: float | int | str, what: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"5m"``, ``"2h"`` or ``"1.5d"``."""
    if isinstance(value, bool):
        raise SpecError(f"{what} must be a duration like 90, '90s', '5m' or '2h', not {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise SpecError(
                f"{what} must be a duration like 90, '90s', '5m' or '2h', not {value!r}"
            )
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds <= 0:
        raise SpecError(f"{what} must be positive, not {value!r}")
    return seconds


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

    @classmethod
    def parse(cls, value: float | int | str | CheckpointEvery) -> CheckpointEvery:
        """``300``/``"5m"`` (seconds) or ``"100 steps"``/``"100steps"``."""
        if isinstance(value, CheckpointEvery):
            return value
        text = str(value).strip().lower()
        m = re.match(r"^(\d+)\s*(steps?)$", text)
        if m:
            steps = int(m.group(1))
            if steps <= 0:
                raise SpecError(f"checkpoint_every must be positive, not {value!r}")
            return cls(seconds=None, steps=steps)
        try:
            return cls(seconds=parse_duration(value, "checkpoint_every"), steps=None)
        except SpecError:
            raise SpecError(
                f"checkpoint_every must be a time like '60s' or '5m', or a step count like "
                f"'500 steps', not {value!r}"
            ) from None

    def describe(self) -> str:
        return f"every {self.steps} steps" if self.steps else f"every {self.seconds:g}s"


# A multi-node job's nodes, at most: one node slot (lease, event stream) per node.
MAX_NODES = 64


def parse_nodes(value: int | str | tuple[int, int] | list[int]) -> tuple[int, int]:
    """``(min, max)`` nodes from ``4``, ``"4"``, ``"3:4"`` or ``(3, 4)``.

    MIN is how few nodes training goes on with while a lost node's replacement boots
    (torchrun's ``--nnodes MIN:MAX``); MAX is how many the capacity group keeps.
    """
    usage = ("nodes must be a count (--nodes 4) or MIN:MAX (--nodes 3:4: train on 3 while "
             f"a lost node's replacement boots, on 4 otherwise), not {value!r}")
    if isinstance(value, bool):
        raise SpecError(usage)
    if isinstance(value, int):
        low = high = value
    elif isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(isinstance(v, int) and not isinstance(v, bool)
                                      for v in value):
            raise SpecError(usage)
        low, high = value
    else:
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(value))
        if not m:
            raise SpecError(usage)
        low = int(m.group(1))
        high = int(m.group(2)) if m.group(2) is not None else low
    if low < 1 or high < 1:
        raise SpecError(f"a job needs at least one node, not {value!r}: use --nodes 1 (the "
                        "default) or more")
    if low > high:
        raise SpecError(f"--nodes {low}:{high} asks for at least {low} nodes but at most "
                        f"{high}: MIN must not exceed MAX (e.g. --nodes {high}:{low})")
    if high > MAX_NODES:
        raise SpecError(f"--nodes {value} is above spotnb's limit of {MAX_NODES} nodes")
    return low, high


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the job may run: instance types in order of preference, region, price cap,
    and how many nodes (``min_nodes``..``max_nodes``) with how many worker processes each.

    A job with ``max_nodes > 1`` or ``procs_per_node > 1`` is *distributed*: its cell runs
    in ``procs_per_node`` kernels on each node, as torchrun's workers (see
    :mod:`spotnb.multinode`).
    """

    instance_types: tuple[str, ...]
    region: str = "us-east-1"
    max_price: float | None = None
    min_nodes: int = 1
    max_nodes: int = 1
    procs_per_node: int = 1

    @property
    def distributed(self) -> bool:
        """Whether the cell runs as torchrun workers (several nodes or processes)."""
        return self.max_nodes > 1 or self.procs_per_node > 1


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the job is run and when it is given up."""

    checkpoint_every: CheckpointEvery = CheckpointEvery()
    max_restarts_on_error: int = 0
    budget_usd: float | None = None
    max_duration: float | None = None
    keep_checkpoints: int = 3
    # Distributed jobs: the longest any rank waits on a peer (collectives of process
    # groups created in the cell without a timeout of their own, connections to the
    # rendezvous) before the peer is taken for lost and the world re-forms.
    peer_timeout: float = 120.0


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything an agent needs to run a job. Written once as ``spec.json``."""

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
    spotnb_version: str = ""
    schema: int = SPEC_SCHEMA

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        raw = json.loads(text)
        if raw.get("schema", SPEC_SCHEMA) > SPEC_SCHEMA:
            raise SpecError(
                f"this job was written by a newer spotnb (spec schema {raw['schema']}); "
                "upgrade spotnb: pip install -U spotnb"
            )
        res = raw.pop("resources")
        pol = raw.pop("policy")
        every = pol.pop("checkpoint_every")
        return cls(
            resources=Resources(
                instance_types=tuple(res["instance_types"]),
                region=res.get("region", "us-east-1"),
                max_price=res.get("max_price"),
                min_nodes=int(res.get("min_nodes", 1)),
                max_nodes=int(res.get("max_nodes", 1)),
                procs_per_node=int(res.get("procs_per_node", 1)),
            ),
            policy=Policy(checkpoint_every=CheckpointEvery(**every), **pol),
            inputs=tuple(raw.pop("inputs", ())),
            outputs=tuple(raw.pop("outputs", ())),
            **raw,
        )
