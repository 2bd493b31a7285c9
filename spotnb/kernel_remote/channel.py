"""The channel between the agent and the runtime inside the user's kernel.

The agent listens on a Unix socket (path in ``SPOTNB_AGENT_SOCKET``); the runtime
(``spotnb.runtime``, imported in the kernel) connects once. Messages are JSON objects,
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
    steps the run has (:func:`spotnb.runtime.progress`, or the range of the loop
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
    ``{"op": "replay", "attempt": int, "rows": [...], "events": [str, ...]}``: a
    restored checkpoint's carry, for the attempt that saved it; the agent records what
    that attempt's log lacks (rows newer than its newest row, events numbered after its
    newest event), once.

agent -> runtime
    ``{"op": "ping", "until": float | null}``: every second or so; ``until`` is when
    the agent's lease stops counting as held unless renewed, on the host's
    :func:`spotnb.lease.clock` (null: no lease, or it was released): the kernel's
    watchdog stops the kernel by then if the agent falls silent
    ``{"op": "notice", "kind": "instance-action"|"rebalance", "action": str,
    "time": str}``: sent when the notice appears, and again on connect if one is
    pending.
    ``{"op": "unlogged", "id": int, "events": [str, ...], "next": int}``: the answer:
    the JSON lines of the events emitted and not yet written (types
    ``spotnb.kernel_remote.agent.CARRIED_TYPES``), and the next event number.

The kernel's environment (set by the agent when it spawns the kernel, before it holds
the lease): ``SPOTNB_JOB_URI``, ``SPOTNB_JOB_ID``, ``SPOTNB_AGENT_SOCKET``,
``SPOTNB_CHECKPOINT_EVERY`` (JSON ``{"seconds", "steps"}``), ``SPOTNB_KEEP_CHECKPOINTS``,
``SPOTNB_SCRATCH`` (a local directory for this attempt), ``SPOTNB_NOTICE_SECONDS``
(the provider's interruption notice period), ``SPOTNB_PEER_TIMEOUT`` (seconds a
distributed job's ranks wait on a peer). The attempt's own settings are
added to it by the bootstrap (``spotnb.runtime._bootstrap(env=...)``), before anything
reads them: ``SPOTNB_ATTEMPT``, ``SPOTNB_INSTANCE_ID`` and ``SPOTNB_RESTORE_DIR``
(where the agent prefetches the latest checkpoint while the kernel starts and the
cell's imports run: the checkpoint's files plus ``MANIFEST.json``; the agent creates
:data:`PREFETCH_DONE` there when it is finished, successfully or not, and
``restore()`` waits for that file before it looks). A distributed job's workers also get
``SPOTNB_SLOT`` (the agent's node slot) and torchrun's variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...: spotnb.multinode.elastic).
"""

from __future__ import annotations

import json
from typing import Any

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
#: The type of the message the runtime publishes on the kernel's output (IOPub) channel
#: to mark the end of what it printed so far (``{"token": str}``): the ``unlogged`` op.
OUTPUT_MARK = "spotnb_output_mark"


def encode(message: dict[str, Any]) -> bytes:
    """One message as a line of JSON."""
    return (json.dumps(message, separators=(",", ":"), default=float) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    """A line of JSON back to a message."""
    message = json.loads(line)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"not a channel message: {line!r}")
    return message
