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


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the job may run: instance types in order of preference, region, price cap."""

    instance_types: tuple[str, ...]
    region: str = "us-east-1"
    max_price: float | None = None


@dataclasses.dataclass(frozen=True)
class Policy:
    """How the job is run and when it is given up."""

    checkpoint_every: CheckpointEvery = CheckpointEvery()
    max_restarts_on_error: int = 0
    budget_usd: float | None = None
    max_duration: float | None = None
    keep_checkpoints: int = 3


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
            ),
            policy=Policy(checkpoint_every=CheckpointEvery(**every), **pol),
            inputs=tuple(raw.pop("inputs", ())),
            outputs=tuple(raw.pop("outputs", ())),
            **raw,
        )
