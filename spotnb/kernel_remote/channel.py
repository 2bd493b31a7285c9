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
    ``{"op": "reform", "step": int | null, "join": bool}``: distributed jobs: a node of
    the world leaves after the coordinated checkpoint of ``step``; this rank holds the
    cell, and its agent re-forms the world without that node (``join``: with a node
    that waits to join; ``step`` null: the cell made no checkpoint to save first).
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

Each op is a frozen dataclass below (:data:`TO_AGENT`, :data:`TO_RUNTIME`), and both
sides speak only through them: a side builds the message it sends and :func:`encode`
writes it (a field that is None is left out, as a peer of any version reads a missing
field as None); a side reads a line with :func:`decode` and :func:`parse`, which
checks and converts every field once (:meth:`Message.from_dict`), and handles the
typed message through a table of op to handler. The ops the agent records as events
(``checkpoint``, ``sync``, ``params``) say what the event holds (``event_data``).

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
import inspect
import json
from collections.abc import Callable
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


def encode(message: Message | dict[str, Any]) -> bytes:
    """One message as a line of JSON. Both sides send a :class:`Message`; a dict is
    the wire form as it is (what :func:`decode` returns), as a peer of another spotnb
    may send it."""
    if isinstance(message, Message):
        message = message.to_dict()
    return (json.dumps(message, separators=(",", ":"), default=float) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    """A line of JSON back to the message's wire form (:func:`parse` types it)."""
    message = json.loads(line)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"not a channel message: {line!r}")
    return message


class UnknownOp(ValueError):
    """A message whose op the receiving side does not know."""

    def __init__(self, op: str) -> None:
        super().__init__(f"unknown op {op!r}")
        self.op = op


# -- how a field is read from the wire, by its annotation ----------------------------

#: A time: read as a number, and as None if it is anything else.
Time = float


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) \
        and not isinstance(value, bool) else None


def _list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else []


def _lines(value: Any) -> list[str]:
    """JSON lines: only a list of them is trusted."""
    return [str(line) for line in value] if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


#: How a value that came is read into a field (None, or missing: the field's default),
#: by the field's annotation. A value that cannot be read (``"step": "x"``) raises
#: ValueError or TypeError: not a message of its op.
_READ: dict[str, Callable[[Any], Any]] = {
    "int": int, "int | None": int, "float": float, "float | None": float,
    "str": str, "str | None": str, "bool": bool, "bool | None": bool,
    "Time | None": _number, "list[Any]": _list, "list[str]": _lines,
    "dict[str, Any]": _dict, "dict[str, Any] | None": _dict,
}


@dataclasses.dataclass(frozen=True)
class Message:
    """A message on the channel; ``op`` names its kind (a class attribute). Each field
    is read from the wire by its annotation (:data:`_READ`: a class whose field has
    another annotation is refused when it is defined)."""

    op: ClassVar[str] = ""
    _readers: ClassVar[dict[str, Callable[[Any], Any]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = {name: annotation for name, annotation in inspect.get_annotations(cls).items()
               if not annotation.startswith("ClassVar")}
        unread = {name: a for name, a in own.items() if a not in _READ}
        if unread:
            raise TypeError(f"{cls.__name__}: no reader for the fields {unread}")
        cls._readers = {**cls._readers, **{name: _READ[a] for name, a in own.items()}}

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        """The message as it came (``op`` included), typed: each field read by its
        annotation, its default where it is missing or None."""
        return cls(**{name: read(message[name]) for name, read in cls._readers.items()
                      if message.get(name) is not None})

    def to_dict(self) -> dict[str, Any]:
        """The message as it is sent: its fields but those that are None."""
        sent: dict[str, Any] = {"op": self.op}
        for name in self._readers:
            value = getattr(self, name)
            if value is not None:
                sent[name] = value
        return sent

    def event_data(self) -> dict[str, Any]:
        """The fields as an event's data (those that are None left out)."""
        data = self.to_dict()
        del data["op"]
        return data


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


@dataclasses.dataclass(frozen=True)
class CheckpointPhase(Message):
    """A checkpoint's phase (``begin``, ``durable``, ``failed``), recorded as a
    ``checkpoint`` event with these fields."""

    op: ClassVar[str] = "checkpoint"
    phase: str = ""
    id: str | None = None
    step: int | None = None
    #: Forced by a notice (sent with every phase).
    forced: bool | None = None
    #: True when saved before a node joins a distributed job (forced, but no notice);
    #: not sent otherwise.
    join: bool | None = None
    bytes: int | None = None
    seconds: float | None = None
    #: ``durable``: how long the training loop waited for this save.
    stall: float | None = None
    #: ``failed``: why.
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class Restored(Message):
    """A checkpoint was restored."""

    op: ClassVar[str] = "restored"
    id: str | None = None
    step: int | None = None
    seconds: float | None = None


@dataclasses.dataclass(frozen=True)
class Sync(Message):
    """A synced directory's snapshot is durable, or was restored; recorded as a
    ``checkpoint`` event of kind ``sync`` with these fields."""

    op: ClassVar[str] = "sync"
    name: str = ""
    phase: str = ""
    id: str | None = None
    files: int | None = None
    bytes: int | None = None
    #: A snapshot taken at a framework's save point (``SyncDir.save``): its step, and
    #: whether a notice forced it.
    step: int | None = None
    forced: bool | None = None

    def event_data(self) -> dict[str, Any]:
        return {"kind": "sync", **super().event_data()}


@dataclasses.dataclass(frozen=True)
class Usage(Message):
    """The AWS requests the kernel made."""

    op: ClassVar[str] = "usage"
    requests: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Replay(Message):
    """A restored checkpoint's carry, for the attempt that saved it: its rows, its
    events (JSON lines), and the restored save's own ``checkpoint`` event data saved
    at time ``saved`` (both None unless that is a dict with a string ``id`` and
    ``saved`` a time)."""

    op: ClassVar[str] = "replay"
    attempt: int = 0
    rows: list[Any] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)
    checkpoint: dict[str, Any] | None = None
    saved: Time | None = None

    @classmethod
    def from_dict(cls, message: dict[str, Any]) -> Message:
        replay = super().from_dict(message)
        assert isinstance(replay, Replay)
        if replay.saved is None or replay.checkpoint is None \
                or not isinstance(replay.checkpoint.get("id"), str):
            return dataclasses.replace(replay, checkpoint=None, saved=None)
        return replay


@dataclasses.dataclass(frozen=True)
class Unlogged(Message):
    """Which events has the agent not written yet? (after the output mark ``mark``)"""

    op: ClassVar[str] = "unlogged"
    id: int = -1
    mark: str | None = None


@dataclasses.dataclass(frozen=True)
class Fence(Message):
    """Does the agent still hold the lease?"""

    op: ClassVar[str] = "fence"
    id: int = -1


@dataclasses.dataclass(frozen=True)
class Mark(Message):
    """Every row logged before it has been sent."""

    op: ClassVar[str] = "mark"
    token: str = ""


@dataclasses.dataclass(frozen=True)
class Parked(Message):
    """The save forced by an interruption notice is durable; the cell is held."""

    op: ClassVar[str] = "parked"
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class Reform(Message):
    """Distributed jobs: re-form the world after the checkpoint of ``step`` (None: the
    cell made no checkpoint), without a node that leaves, or (``join``) with one that
    waits to join."""

    op: ClassVar[str] = "reform"
    step: int | None = None
    join: bool = False


@dataclasses.dataclass(frozen=True)
class Caution(Message):
    """Something the user should know."""

    op: ClassVar[str] = "warning"
    kind: str | None = None
    text: str = ""


@dataclasses.dataclass(frozen=True)
class Params(Message):
    """The run's hyperparameters, recorded as a ``params`` event with these fields."""

    op: ClassVar[str] = "params"
    params: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str | None = None


@dataclasses.dataclass(frozen=True)
class Progress(Message):
    """How many steps the run has."""

    op: ClassVar[str] = "progress"
    total: int | None = None
    source: str | None = None


# -- agent -> runtime ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ping(Message):
    """The agent is alive; its lease counts as held until ``until`` unless renewed
    (None: it holds none)."""

    op: ClassVar[str] = "ping"
    until: Time | None = None


@dataclasses.dataclass(frozen=True)
class Notice(Message):
    """An interruption notice, a rebalance recommendation, or (``join``) a node that
    waits to join."""

    op: ClassVar[str] = "notice"
    kind: str = ""
    action: str | None = None
    time: str | None = None


@dataclasses.dataclass(frozen=True)
class UnloggedReply(Message):
    """The answer to :class:`Unlogged`."""

    op: ClassVar[str] = "unlogged"
    id: int = -1
    events: list[str] = dataclasses.field(default_factory=list)
    next: int | None = None


@dataclasses.dataclass(frozen=True)
class FenceReply(Message):
    """The answer to :class:`Fence`."""

    op: ClassVar[str] = "fence"
    id: int = -1
    ok: bool = False
    unknown: bool = False


@dataclasses.dataclass(frozen=True)
class Durable(Message):
    """The metric rows up to time ``t`` are durable in the log."""

    op: ClassVar[str] = "durable"
    t: float = 0.0


@dataclasses.dataclass(frozen=True)
class Error(Message):
    """The agent could not handle a message of op ``about``."""

    op: ClassVar[str] = "error"
    about: str = ""
    error: str = ""


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
