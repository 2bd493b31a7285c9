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
``SqsQueue`` (``sqs://region/account/name``; S3 stores)
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

__all__ = ["LocalQueue", "Queue", "SqsQueue", "open_queue", "pack", "queue_for", "unpack"]

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
    """One queue. Every method may raise OSError or ``spotnb.store.StoreError``."""

    uri: str
    #: How often an agent sends live events through queues of this kind: each send is
    #: a request that SQS bills; a local queue costs nothing.
    live_seconds: float = 1.0

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


class SqsQueue(Queue):
    """An Amazon SQS standard queue, ``sqs://region/account/name``."""

    def __init__(self, region: str, account: str, name: str,
                 tags: dict[str, str] | None = None) -> None:
        self.region = region
        self.account = account
        self.name = name
        self.tags = tags or {}
        self.uri = f"sqs://{region}/{account}/{name}"
        self._client: Any = None
        self._cached_url: str | None = None

    def __repr__(self) -> str:
        return f"SqsQueue({self.uri!r})"

    @property
    def url(self) -> str:
        return f"https://sqs.{self.region}.amazonaws.com/{self.account}/{self.name}"

    @property
    def client(self) -> Any:
        if self._client is None:
            from spotnb.providers.aws import _boto

            self._client = _boto.client("sqs", self.region)
        return self._client

    def _call(self, op: str, **kwargs: Any) -> Any:
        return getattr(self.client, op)(**kwargs)  # counted by spotnb.usage's hook

    def create(self) -> None:
        """Create the queue, tagged so that ``spotnb aws cleanup`` can judge it."""
        self._call("create_queue", QueueName=self.name, tags=self.tags, Attributes={
            "MessageRetentionPeriod": str(RETENTION_SECONDS),
            "VisibilityTimeout": str(12 * 3600),
            "ReceiveMessageWaitTimeSeconds": "0",
        })

    def delete(self) -> None:
        try:
            self._call("delete_queue", QueueUrl=self._resolved())
        except Exception as err:
            from spotnb.providers.aws import _boto

            if _boto.error_code(err) not in ("AWS.SimpleQueueService.NonExistentQueue",
                                              "QueueDoesNotExist"):
                raise

    def _resolved(self) -> str:
        # moto answers with its own endpoint's URLs; real SQS accepts the canonical one.
        if os.environ.get("AWS_ENDPOINT_URL"):
            reply = self._call("get_queue_url", QueueName=self.name,
                               QueueOwnerAWSAccountId=self.account)
            return str(reply["QueueUrl"])
        return self.url

    def send(self, body: str) -> None:
        self._call("send_message", QueueUrl=self._url(), MessageBody=body)

    def receive(self, wait: float) -> list[str]:
        reply = self._call("receive_message", QueueUrl=self._url(), MaxNumberOfMessages=10,
                           WaitTimeSeconds=max(0, min(20, round(wait))))
        return [m["Body"] for m in reply.get("Messages", [])]

    def _url(self) -> str:
        if self._cached_url is None:
            self._cached_url = self._resolved()
        return self._cached_url


def open_queue(uri: str) -> Queue:
    """The queue at ``uri``: ``file:///path`` or ``sqs://region/account/name``."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "file":
        return LocalQueue(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "sqs":
        account, _, name = parsed.path.strip("/").partition("/")
        return SqsQueue(parsed.netloc, account, name)
    raise ValueError(f"not a queue URI: {uri!r}")


def queue_for(store: Any, job_id: str, name: str) -> Queue:
    """The queue ``name`` of a job whose store is ``store``: a directory under a local
    job prefix, or an SQS queue ``spotnb-<job_id>-<name>`` in the bucket's region."""
    root = getattr(store, "root", None)
    if root is not None:
        return LocalQueue(Path(root) / "queues" / name)
    from spotnb.providers.aws.store import S3Store

    if isinstance(store, S3Store):
        from spotnb.providers.aws.resources import TAG_JOB, TAG_MANAGED, TAG_STORE

        region = store.region or _region_of(store)
        return SqsQueue(region, store.owner, sqs_name(job_id, name),
                        tags={TAG_JOB: job_id, TAG_STORE: store.uri, TAG_MANAGED: "true"})
    raise ValueError(f"no queue transport for {store!r}")


def sqs_name(job_id: str, name: str) -> str:
    """The SQS queue name of a job's queue (80 characters at most, as SQS wants)."""
    return f"spotnb-{job_id}-{name}"[:80]


def _region_of(store: Any) -> str:
    from spotnb.providers.aws import _boto

    return str(_boto.session().region_name or "us-east-1")
