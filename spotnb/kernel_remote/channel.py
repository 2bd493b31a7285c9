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
    ``{"op": "parked", "step": int}``: the save forced by an interruption notice is
    durable; user code is now held until the instance is terminated.

agent -> runtime
    ``{"op": "notice", "kind": "instance-action"|"rebalance", "action": str,
    "time": str}``: sent when the notice appears, and again on connect if one is
    pending.

The kernel's environment (set by the agent when it spawns the kernel, before it holds
the lease): ``SPOTNB_JOB_URI``, ``SPOTNB_JOB_ID``, ``SPOTNB_AGENT_SOCKET``,
``SPOTNB_CHECKPOINT_EVERY`` (JSON ``{"seconds", "steps"}``), ``SPOTNB_KEEP_CHECKPOINTS``,
``SPOTNB_SCRATCH`` (a local directory for this attempt). The attempt's own settings are
added to it by the bootstrap (``spotnb.runtime._bootstrap(env=...)``), before anything
reads them: ``SPOTNB_ATTEMPT``, ``SPOTNB_INSTANCE_ID`` and ``SPOTNB_RESTORE_DIR``
(where the agent prefetches the latest checkpoint while the kernel starts and the
cell's imports run: the checkpoint's files plus ``MANIFEST.json``; the agent creates
:data:`PREFETCH_DONE` there when it is finished, successfully or not, and
``restore()`` waits for that file before it looks).
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
PREFETCH_DONE = ".prefetch-done"


def encode(message: dict[str, Any]) -> bytes:
    """One message as a line of JSON."""
    return (json.dumps(message, separators=(",", ":"), default=float) + "\n").encode()


def decode(line: bytes | str) -> dict[str, Any]:
    """A line of JSON back to a message."""
    message = json.loads(line)
    if not isinstance(message, dict) or "op" not in message:
        raise ValueError(f"not a channel message: {line!r}")
    return message
