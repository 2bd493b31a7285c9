"""The channel between the agent and the runtime inside the user's kernel.

The agent listens on a Unix socket (path in ``SPOTNB_AGENT_SOCKET``); the runtime
(``spotnb.train.runtime``, imported in the kernel) connects once. Messages are JSON objects,
one per line, both ways. The agent is the only writer of the attempt's event log, so
everything the runtime wants recorded goes through here.

runtime -> agent
    ``{"op": "hello", "pid": int}``
    ``{"op": "metrics", "rows": [[step, t, {"name": value, ...}], ...]}``
    ``{"op": "checkpoint", "phase": "begin"|"durable"|"failed", "id": str, "step": int,
    "bytes": int, "seconds": float, "forced": bool, "error": str (failed only)}``
    ``{"op": "restored", "id": str, "step": int, "seconds": float}``
    ``{"op": "sync", "name": str, "phase": "durable"|"restored", "files": int,
    "bytes": int}``; a snapshot taken at a framework's save point
    (``SyncDir.save``) also has ``"step": int, "forced": bool``
    ``{"op": "params", "params": {name: value}, "source": str (optional)}``: the run's
    hyperparameters (``spot.log_params``), recorded as a ``params`` event
    ``{"op": "progress", "total": int, "source": "spot.progress"|"range"}``: how many
    steps the run has (:func:`spotnb.train.runtime.progress`, or the range of the loop
    around the first ``spot.log``)
    ``{"op": "parked", "step": int}``: the save forced by an interruption notice is
    durable; user code is now held until the instance is terminated. (A distributed
    job: this node leaves the world.)
    ``{"op": "reform", "step": int}``: distributed jobs: a node of the world leaves
    after the coordinated checkpoint of ``step``; this rank holds the cell, and its
    agent re-forms the world without that node.
    ``{"op": "warning", "kind": str, "text": str}``: something the user should know
    (``notice-fit``: a checkpoint takes too long to fit in the interruption notice).
    ``{"op": "unlogged", "id": int, "mark": str|null}``: a checkpoint being saved asks
    for the events the log has not confirmed, which it carries (``events.jsonl``; the
    runtime's own unconfirmed metric rows go in ``metrics.json``). ``mark``: a token
    the runtime published on the kernel's output channel (an :data:`OUTPUT_MARK`
    message) after flushing ``sys.stdout``/``sys.stderr``; the agent answers once it
    has relayed that mark, so every line printed before the save is in the answer.
    ``{"op": "replay", "attempt": int, "rows": [...], "events": [str, ...],
    "checkpoint": {...} | null, "saved": float | null}``: a restored checkpoint's
    carry, for the attempt that saved it; the agent records what that attempt's log
    lacks (rows newer than its newest row, events numbered after its newest event, the
    restored save's own ``checkpoint`` event), once.
    ``{"op": "fence", "id": int}``: does the agent still hold the lease? Asked before
    the runtime moves ``LATEST`` or writes the outputs.
    ``{"op": "mark", "token": str}``: every row logged before it has been sent (the
    cell failed: the agent waits for the mark before it records the error).
    ``{"op": "usage", "requests": {...}}``: the AWS requests the kernel made
    (:mod:`spotnb.protocol.usage`), recorded as a ``usage`` event.

agent -> runtime
    ``{"op": "ping", "until": float | null}``: every second or so; ``until`` is when
    the agent's lease stops counting as held unless renewed, on the host's
    :func:`spotnb.protocol.lease.clock` (null: no lease, or it was released): the kernel's
    watchdog stops the kernel by then if the agent falls silent
    ``{"op": "notice", "kind": "instance-action"|"rebalance", "action": str,
    "time": str}``: sent when the notice appears, and again on connect if one is
    pending.
    ``{"op": "notice", "kind": "join"}``: distributed jobs: a node waits to join; every
    rank saves at its next ``maybe_save``, then asks to re-form.
    ``{"op": "unlogged", "id": int, "events": [str, ...], "next": int}``: the answer:
    the JSON lines of the events emitted and not yet written (types
    ``spotnb.kernel_remote.messages.CARRIED_TYPES``), and the next event number.
    ``{"op": "fence", "id": int, "ok": bool, "unknown": bool}``: the answer: the lease
    is held (``ok``), or could not be confirmed lately (``unknown``: ask again).
    ``{"op": "durable", "t": float}``: the metric rows up to time ``t`` are durable in
    the log; the runtime forgets them.
    ``{"op": "error", "about": str, "error": str}``: the agent could not handle a
    message of op ``about`` (an op it does not know: a runtime of another spotnb).

Each op is a frozen dataclass below (:data:`TO_AGENT`, :data:`TO_RUNTIME`): the agent
and the runtime parse what they read with :func:`parse` and handle it through a table
of op to handler; fields the agent passes on to an event as they came stay in ``data``.

The kernel's environment (set by the agent when it spawns the kernel, before it holds
the lease): ``SPOTNB_JOB_URI``, ``SPOTNB_JOB_ID``, ``SPOTNB_AGENT_SOCKET``,
``SPOTNB_CHECKPOINT_EVERY`` (JSON ``{"seconds", "steps"}``), ``SPOTNB_KEEP_CHECKPOINTS``,
``SPOTNB_SCRATCH`` (a local directory for this attempt), ``SPOTNB_NOTICE_SECONDS``
(the provider's interruption notice period), ``SPOTNB_PEER_TIMEOUT`` (seconds a
distributed job's ranks wait on a peer). The attempt's own settings are
added to it by the bootstrap (``spotnb.train.runtime._bootstrap(env=...)``), before anything
reads them: ``SPOTNB_ATTEMPT``, ``SPOTNB_INSTANCE_ID`` and ``SPOTNB_RESTORE_DIR``
(where the agent prefetches the latest checkpoint while the kernel starts and the
cell's imports run: the checkpoint's files plus ``MANIFEST.json``; the agent creates
:data:`PREFETCH_DONE` there when it is finished, successfully or not, and
``restore()`` waits for that file before it looks). A distributed job's workers also get
``SPOTNB_SLOT`` (the agent's node slot) and torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...: spotnb.kernel_remote.multinode.elastic).

A warm standby's kernel (spotnb.kernel_remote.standby) is bootstrapped before its agent
holds the lease, with ``SPOTNB_STANDBY=1`` and no attempt: ``restore()`` then creates
:data:`STANDBY_WAITING` in the restore directory (the cell reached its restore point)
and waits, for as long as it takes, for :data:`STANDBY_LEASED` (JSON ``{"attempt":
N}``, written by the agent once it holds the lease), then for :data:`PREFETCH_DONE`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

ENV_JOB_URI = "SPOTNB_JOB_URI"
ENV_JOB_ID = "SPOTNB_JOB_ID"
ENV_ATTEMPT = "SPOTNB_ATTEMPT"
ENV_INSTANCE_ID = "SPOTNB_INSTANCE_ID"
ENV_SOCKET = "SPOTNB_AGENT_SOCKET"
ENV_CHECKPOINT_EVERY = "SPOTNB_CHECKPOINT_EVERY"
ENV_KEEP_CHECKPOINTS = "SPOTNB_KEEP_CHECKPOINTS"
ENV_SCRATCH = "SPOTNB_SCRATCH"
ENV_RESTORE_DIR = "SPOTNB_RESTORE_DIR"
ENV_NOTICE_SECONDS = "SPOTNB_NOTICE_SECONDS"
ENV_PEER_TIMEOUT = "SPOTNB_PEER_TIMEOUT"
ENV_SLOT = "SPOTNB_SLOT"
PREFETCH_DONE = ".prefetch-done"
ENV_STANDBY = "SPOTNB_STANDBY"
STANDBY_WAITING = ".standby-waiting"
STANDBY_LEASED = ".standby-leased"
#: The type of the message the runtime publishes on the kernel's output (IOPub) channel
#: to mark the end of what it printed so far (``{"token": str}``): the ``unlogged`` op.
OUTPUT_MARK = "spotnb_output_mark"


def encode(message: dict[str, Any] | Message) -> bytes:
    """One message as a line of JSON."""
    if isinstance(message, Message):
        message = message.to_dict()
    return (json.dumps(message, separators=(",", ":"), default=float) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    """A line of JSON back to a message."""
    message = json.loads(line)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"not a channel message: {line!r}")
    return message


class UnknownOp(ValueError):
    """A message whose op the receiving side does not know."""

    def __init__(self, op: str) -> None:
        super().__init__(f"unknown op {op!r}")
        self.op = op


def _rest(message: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in message.items() if k != "op"}


@dataclasses.dataclass(frozen=True)
class Message:
    """A message on the channel; ``op`` names its kind (a class attribute)."""

    op: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        """The message as it came (``op`` included), typed: each field as it came, its
        default where it is missing. A message whose fields need converting says how."""
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in message.items() if k in fields})

    def to_dict(self) -> dict[str, Any]:
        """The message as it is sent."""
        return {"op": self.op, **dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class _Passed(Message):
    """A message whose fields the agent passes on as they came (``data``)."""

    data: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(data=_rest(message))

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, **self.data}

    def get(self, name: str, default: Any = None) -> Any:
        """One field, as ``dict.get``."""
        return self.data.get(name, default)


# -- runtime -> agent ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Hello(Message):
    """The runtime connected."""

    op: ClassVar[str] = "hello"
    pid: int | None = None


@dataclasses.dataclass(frozen=True)
class Metrics(Message):
    """Metric rows ``[step, t, {name: value}]`` logged by ``spot.log``."""

    op: ClassVar[str] = "metrics"
    rows: list[Any] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(rows=message["rows"])


@dataclasses.dataclass(frozen=True)
class CheckpointPhase(_Passed):
    """A checkpoint's phase (begin, durable, failed); recorded as it came."""

    op: ClassVar[str] = "checkpoint"


@dataclasses.dataclass(frozen=True)
class Restored(_Passed):
    """A checkpoint was restored."""

    op: ClassVar[str] = "restored"


@dataclasses.dataclass(frozen=True)
class Sync(_Passed):
    """A synced directory's snapshot is durable, or was restored."""

    op: ClassVar[str] = "sync"


@dataclasses.dataclass(frozen=True)
class Usage(Message):
    """The AWS requests the kernel made."""

    op: ClassVar[str] = "usage"
    requests: dict[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(requests=message.get("requests") or {})


@dataclasses.dataclass(frozen=True)
class Replay(Message):
    """A restored checkpoint's carry, for the attempt that saved it."""

    op: ClassVar[str] = "replay"
    attempt: int = 0
    rows: list[Any] = dataclasses.field(default_factory=list)
    events: list[Any] = dataclasses.field(default_factory=list)
    checkpoint: Any = None
    saved: Any = None

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(attempt=int(message.get("attempt", 0)), rows=message.get("rows") or [],
                   events=message.get("events") or [], checkpoint=message.get("checkpoint"),
                   saved=message.get("saved"))


@dataclasses.dataclass(frozen=True)
class Unlogged(Message):
    """Which events has the agent not written yet? (after the output mark ``mark``)"""

    op: ClassVar[str] = "unlogged"
    id: Any = None
    mark: Any = None


@dataclasses.dataclass(frozen=True)
class Fence(Message):
    """Does the agent still hold the lease?"""

    op: ClassVar[str] = "fence"
    id: Any = None


@dataclasses.dataclass(frozen=True)
class Mark(Message):
    """Every row logged before it has been sent."""

    op: ClassVar[str] = "mark"
    token: str = ""

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(token=str(message.get("token")))


@dataclasses.dataclass(frozen=True)
class Parked(Message):
    """The save forced by an interruption notice is durable; the cell is held."""

    op: ClassVar[str] = "parked"
    step: Any = None


@dataclasses.dataclass(frozen=True)
class Reform(Message):
    """Distributed jobs: re-form the world after the checkpoint of ``step``."""

    op: ClassVar[str] = "reform"
    step: Any = None
    join: bool = False

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(step=message.get("step"), join=bool(message.get("join")))


@dataclasses.dataclass(frozen=True)
class Caution(Message):
    """Something the user should know."""

    op: ClassVar[str] = "warning"
    kind: Any = None
    text: Any = ""


@dataclasses.dataclass(frozen=True)
class Params(_Passed):
    """The run's hyperparameters."""

    op: ClassVar[str] = "params"


@dataclasses.dataclass(frozen=True)
class Progress(Message):
    """How many steps the run has."""

    op: ClassVar[str] = "progress"
    total: Any = None
    source: Any = None


# -- agent -> runtime ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ping(Message):
    """The agent is alive; its lease counts as held until ``until`` unless renewed."""

    op: ClassVar[str] = "ping"
    until: Any = None


@dataclasses.dataclass(frozen=True)
class Notice(Message):
    """An interruption notice, a rebalance recommendation, or (``join``) a node that
    waits to join."""

    op: ClassVar[str] = "notice"
    kind: Any = ""
    action: Any = None
    time: Any = None

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(kind=message.get("kind"), action=message.get("action"),
                   time=message.get("time"))

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "join":
            return {"op": self.op, "kind": self.kind}
        return super().to_dict()


@dataclasses.dataclass(frozen=True)
class UnloggedReply(Message):
    """The answer to :class:`Unlogged`."""

    op: ClassVar[str] = "unlogged"
    id: Any = None
    events: Any = dataclasses.field(default_factory=list)
    next: Any = 0

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        # As they came: the runtime trusts only a list of events.
        return cls(id=message.get("id", -1), events=message.get("events"),
                   next=message.get("next"))


@dataclasses.dataclass(frozen=True)
class FenceReply(Message):
    """The answer to :class:`Fence`."""

    op: ClassVar[str] = "fence"
    id: Any = None
    ok: bool = False
    unknown: bool = False

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(id=message.get("id", -1), ok=bool(message.get("ok")),
                   unknown=bool(message.get("unknown")))


@dataclasses.dataclass(frozen=True)
class Durable(Message):
    """The metric rows up to time ``t`` are durable in the log."""

    op: ClassVar[str] = "durable"
    t: float = 0.0

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(t=float(message.get("t", 0.0)))


@dataclasses.dataclass(frozen=True)
class Error(Message):
    """The agent could not handle a message of op ``about``."""

    op: ClassVar[str] = "error"
    about: Any = ""
    error: Any = ""

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        return cls(about=message.get("about"), error=message.get("error"))


#: Every op the agent accepts, and its message's class.
TO_AGENT: dict[str, type[Message]] = {m.op: m for m in (
    Hello, Metrics, CheckpointPhase, Restored, Sync, Usage, Replay, Unlogged, Fence, Mark,
    Parked, Reform, Caution, Params, Progress)}
#: Every op the agent sends, and its message's class.
TO_RUNTIME: dict[str, type[Message]] = {m.op: m for m in (
    Ping, Notice, UnloggedReply, FenceReply, Durable, Error)}


def parse(message: dict[str, Any],
          ops: dict[str, type[Message]] = TO_AGENT) -> Message:
    """A decoded message as its typed class; :class:`UnknownOp` if ``ops`` lacks it."""
    kind = ops.get(str(message["op"]))
    if kind is None:
        raise UnknownOp(str(message["op"]))
    return kind.from_dict(message)
