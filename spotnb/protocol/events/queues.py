"""Message queues for what must arrive in about a second: live events and control.

The durable record of a job is its event log in the store; writing it every second
would cost an S3 PUT a second per job (and a LIST a second per reader), more than the
spot instance itself. A queue carries what is urgent instead, at a fraction of that:

* a job's *control queue*, which its agent long-polls (one request per
  :data:`CONTROL_WAIT_SECONDS` when idle): "watch" registrations of followers, stop
  requests;
* one *live queue* per follower (a notebook cell, ``spotnb logs -f``), to which the
  agent sends the events of its attempt every second (every quarter second through a
  free local queue: :attr:`Queue.live_seconds`) while that follower's registration
  lasts.

Two transports, chosen by the job's store (:func:`queue_for`):

``LocalQueue`` (``file://`` URIs; the local store)
    A directory of message files, written atomically; receiving lists, reads and
    deletes them in order. Free, like the local store.
``SqsQueue`` (``sqs://region/account/name``; S3 stores; :mod:`spotnb.providers.aws.queue`)
    Amazon SQS standard queues: $0.40 per million requests (each 64 KiB of a message
    counts as one), 12x less than an S3 PUT or LIST. Long polling; received messages
    stay invisible for 12 hours and expire after 60 seconds anyway (the shortest
    retention SQS allows), so nothing is ever deleted message by message.

Messages are text; :func:`pack`/:func:`unpack` carry JSON, compressed with zlib and
base64-encoded when that makes them smaller.
"""

from __future__ import annotations

import base64
import contextlib
import importlib
import json
import logging
import os
import tempfile
import time
import urllib.parse
import zlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

__all__ = ["QUEUE_SCHEMES", "LocalQueue", "Queue", "open_queue", "pack", "queue_for", "unpack"]

log = logging.getLogger(__name__)

# An idle agent's long poll of its control queue: one request per 20 s, the most SQS
# allows (180 requests/h = $0.000072/h).
CONTROL_WAIT_SECONDS = 20
# SQS takes messages of up to 256 KiB; stay below it (base64 and the envelope included).
MAX_MESSAGE_BYTES = 240 * 1024
# Messages nobody received in time are of no use to anyone: SQS's shortest retention.
RETENTION_SECONDS = 60
# A local queue's receive looks for new message files this often while it waits.
_LOCAL_POLL_SECONDS = 0.05
_PACKED = "z:"


def pack(message: dict[str, Any]) -> str:
    """A message as queue text: JSON, zlib-compressed and base64-encoded if smaller."""
    text = json.dumps(message, separators=(",", ":"))
    if len(text) < 512:
        return text
    packed = _PACKED + base64.b64encode(zlib.compress(text.encode(), 6)).decode()
    return packed if len(packed) < len(text) else text


def unpack(body: str) -> dict[str, Any]:
    """The message :func:`pack` made."""
    if body.startswith(_PACKED):
        body = zlib.decompress(base64.b64decode(body[len(_PACKED):])).decode()
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("not a spotnb queue message")
    return message


class Queue(ABC):
    """One queue. Every method may raise OSError or ``spotnb.protocol.store.StoreError``."""

    uri: str
    #: How often an agent sends live events through queues of this kind: each send is
    #: a request that SQS bills; a local queue costs nothing.
    live_seconds: float = 1.0
    #: Whether each request is billed (and counted in the job's cost).
    billed: bool = True

    @abstractmethod
    def send(self, body: str) -> None:
        """Send one message (at most :data:`MAX_MESSAGE_BYTES`)."""

    @abstractmethod
    def receive(self, wait: float) -> list[str]:
        """The messages that arrive within ``wait`` seconds (returns as soon as there
        are any), oldest first; each is received once."""

    @abstractmethod
    def create(self) -> None:
        """Make the queue exist (idempotent)."""

    @abstractmethod
    def delete(self) -> None:
        """Delete the queue and what it holds (idempotent)."""

    def send_message(self, message: dict[str, Any]) -> None:
        self.send(pack(message))

    def receive_messages(self, wait: float) -> list[dict[str, Any]]:
        out = []
        for body in self.receive(wait):
            try:
                out.append(unpack(body))
            except (ValueError, zlib.error):
                log.warning("ignoring a malformed message on %s", self.uri)
        return out


class LocalQueue(Queue):
    """A queue in a local directory (the local cloud's)."""

    live_seconds = 0.25
    billed = False

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.uri = self.path.absolute().as_uri()

    def __repr__(self) -> str:
        return f"LocalQueue({str(self.path)!r})"

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def delete(self) -> None:
        import shutil

        shutil.rmtree(self.path, ignore_errors=True)

    def send(self, body: str) -> None:
        if not self.path.is_dir():
            raise FileNotFoundError(f"no queue at {self.path}")
        # Names sort in sending order: the time in ns, then a random part.
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(body)
        name = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(3).hex()}.msg"
        os.replace(tmp, self.path / name)

    def receive(self, wait: float) -> list[str]:
        deadline = time.monotonic() + wait
        while True:
            try:
                names = sorted(n for n in os.listdir(self.path) if n.endswith(".msg"))
            except FileNotFoundError:
                names = []
            bodies = []
            for name in names:
                path = self.path / name
                try:
                    # Rename first: of two receivers, exactly one gets each message.
                    taken = path.with_name(name + ".taken")
                    os.rename(path, taken)
                except FileNotFoundError:
                    continue
                with contextlib.suppress(OSError):
                    bodies.append(taken.read_text())
                    taken.unlink()
            if bodies or time.monotonic() >= deadline:
                return bodies
            time.sleep(_LOCAL_POLL_SECONDS)


#: Where the queue of each URI scheme other than ``file`` is implemented: (module,
#: class with ``from_uri``), imported when first opened, as the store's schemes are
#: (:data:`spotnb.protocol.store.STORE_SCHEMES`).
QUEUE_SCHEMES: dict[str, tuple[str, str]] = {
    "sqs": ("spotnb.providers.aws.queue", "SqsQueue"),
}


def open_queue(uri: str) -> Queue:
    """The queue at ``uri``: ``file:///path`` or ``sqs://region/account/name``."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return LocalQueue(urllib.parse.unquote(parsed.path))
    if parsed.scheme in QUEUE_SCHEMES:
        module, name = QUEUE_SCHEMES[parsed.scheme]
        queue: Queue = getattr(importlib.import_module(module), name).from_uri(uri)
        return queue
    raise ValueError(f"not a queue URI: {uri!r}")


def queue_for(store: Any, job_id: str, name: str) -> Queue:
    """The queue ``name`` of a job whose store is ``store``: a directory under a local
    job prefix, or the queue the store offers (``store.job_queue(job_id, name)``: an
    S3 store's is an SQS queue in the bucket's region)."""
    root = getattr(store, "root", None)
    if root is not None:
        return LocalQueue(Path(root) / "queues" / name)
    job_queue = getattr(store, "job_queue", None)
    if job_queue is None:
        raise ValueError(f"no queue transport for {store!r}")
    queue: Queue = job_queue(job_id, name)
    return queue
