"""A job's queues on AWS: Amazon SQS standard queues (see
:mod:`spotnb.protocol.events.queues` for what the queues carry and why).

An S3 store's jobs use an SQS queue ``spotnb-<job_id>-<name>`` in the bucket's region
(:func:`job_queue`, offered by ``S3Store.job_queue``), tagged so that ``spotnb aws
cleanup`` can judge it.
"""

from __future__ import annotations

import os
import time
import urllib.parse
from typing import Any

from spotnb.protocol.events.queues import RETENTION_SECONDS, Queue
from spotnb.providers.aws import _boto
from spotnb.providers.aws.resources import TAG_JOB, TAG_MANAGED, TAG_STORE

__all__ = ["SqsQueue", "job_queue", "sqs_name"]

#: SQS's longest wait for a receive (long polling), in whole seconds.
MAX_WAIT_SECONDS = 20


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

    @classmethod
    def from_uri(cls, uri: str) -> SqsQueue:
        parsed = urllib.parse.urlparse(uri)
        account, _, name = parsed.path.strip("/").partition("/")
        return cls(parsed.netloc, account, name)

    def __repr__(self) -> str:
        return f"SqsQueue({self.uri!r})"

    @property
    def url(self) -> str:
        return f"https://sqs.{self.region}.amazonaws.com/{self.account}/{self.name}"

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _boto.client("sqs", self.region)
        return self._client

    def _call(self, op: str, **kwargs: Any) -> Any:
        return getattr(self.client, op)(**kwargs)  # counted by spotnb.protocol.usage's hook

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
        """SQS waits in whole seconds (long polling): it waits the whole seconds of
        ``wait`` (at most MAX_WAIT_SECONDS); after an empty answer the fraction left is
        slept, so that a caller that polls again at once (a sweep's trials share a second:
        a wait of 0.25 s each) makes one request per ``wait``, not a loop of
        ReceiveMessage requests answered at once, each billed. A message that comes
        during that fraction is the next call's."""
        wait = max(0.0, min(float(MAX_WAIT_SECONDS), wait))
        started = time.monotonic()
        reply = self._call("receive_message", QueueUrl=self._url(), MaxNumberOfMessages=10,
                           WaitTimeSeconds=int(wait))
        bodies = [m["Body"] for m in reply.get("Messages", [])]
        left = wait - (time.monotonic() - started)
        if not bodies and left > 0:
            time.sleep(left)
        return bodies

    def _url(self) -> str:
        if self._cached_url is None:
            self._cached_url = self._resolved()
        return self._cached_url


def job_queue(store_uri: str, region: str | None, account: str, job_id: str,
              name: str) -> SqsQueue:
    """The queue ``name`` of a job whose store (at ``store_uri``, in ``region``: the
    session's if None) belongs to ``account``."""
    region = region or str(_boto.session().region_name or "us-east-1")
    return SqsQueue(region, account, sqs_name(job_id, name),
                    tags={TAG_JOB: job_id, TAG_STORE: store_uri, TAG_MANAGED: "true"})


def sqs_name(job_id: str, name: str) -> str:
    """The SQS queue name of a job's queue (80 characters at most, as SQS wants)."""
    return f"spotnb-{job_id}-{name}"[:80]
