"""What spotnb's own requests cost: every AWS request this process makes, counted.

On AWS each S3 request is billed and each EC2 call counts against a rate limit; moto's
are free, so nothing would show them but counting. :func:`count` is called by every
place that makes a request (the S3 store, the queues, the boto3 clients of the AWS
provider); :func:`snapshot` says what this process did, :func:`cost` prices it at
list prices. Agents report their counts in their events, so the cost a job shows
includes spotnb's own traffic.

List prices (us-east-1, S3 Standard and SQS standard queues, November 2026):

* S3 PUT, COPY, POST and LIST requests: $0.005 per 1,000
* S3 GET, HEAD and every other request: $0.0004 per 1,000; DELETE requests are free
* SQS: $0.40 per million requests (each 64 KiB of a payload is a request)
* EC2, Auto Scaling, IAM, STS: no charge (rate-limited)
"""

from __future__ import annotations

import collections
import threading
from typing import Any

__all__ = ["PRICES", "classify", "cost", "count", "reset", "snapshot"]

#: USD per request, by class.
PRICES = {
    "s3-write": 0.005 / 1000,   # PUT, COPY, POST, LIST
    "s3-read": 0.0004 / 1000,   # GET, HEAD, other
    "s3-delete": 0.0,           # DELETE is free
    "sqs": 0.40 / 1_000_000,
    "api": 0.0,                 # EC2, Auto Scaling, IAM, STS: free, rate-limited
}

_S3_WRITES = {"put_object", "copy_object", "list_objects_v2", "list_objects",
              "create_multipart_upload", "upload_part", "complete_multipart_upload",
              "delete_objects", "PutObject", "CopyObject", "ListObjectsV2",
              "ListObjects", "CreateMultipartUpload", "UploadPart",
              "CompleteMultipartUpload", "DeleteObjects", "UploadPartCopy"}
_S3_DELETES = {"delete_object", "DeleteObject", "AbortMultipartUpload",
               "abort_multipart_upload"}

_lock = threading.Lock()
_counts: collections.Counter[tuple[str, str]] = collections.Counter()


def classify(service: str, operation: str) -> str:
    """The price class of one request (a key of :data:`PRICES`)."""
    if service == "s3":
        if operation in _S3_WRITES:
            return "s3-write"
        if operation in _S3_DELETES:
            return "s3-delete"
        return "s3-read"
    if service == "sqs":
        return "sqs"
    return "api"


def count(service: str, operation: str, n: int = 1) -> None:
    """Record ``n`` requests of ``operation`` to ``service`` made by this process."""
    with _lock:
        _counts[(service, operation)] += n


def snapshot() -> dict[str, int]:
    """Requests made so far by this process: ``{"service:operation": n}``."""
    with _lock:
        return {f"{s}:{o}": n for (s, o), n in sorted(_counts.items())}


def reset() -> None:
    """Forget the counts (tests and benchmarks)."""
    with _lock:
        _counts.clear()


def cost(counts: dict[str, Any]) -> float:
    """USD at list prices for counts shaped like :func:`snapshot`'s."""
    total = 0.0
    for key, n in counts.items():
        service, _, operation = key.partition(":")
        total += PRICES[classify(service, operation)] * float(n)
    return total
