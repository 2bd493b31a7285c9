"""The S3 store: the :class:`~spotnb.protocol.store.Store` contract on an S3 bucket prefix.

URI: ``s3://bucket/prefix`` (:func:`spotnb.protocol.store.open_store` returns an
:class:`S3Store` for it). How each part of the contract maps onto S3:

* every write is one ``PutObject`` (or a multipart upload, which S3 completes
  atomically): a reader sees the old object, the new one or none (invariant 2);
* ``put_if_absent`` is ``PutObject`` with ``IfNoneMatch="*"`` and ``put_if_match`` is
  ``PutObject`` with ``IfMatch=<etag>``: S3's conditional writes (August/November
  2024), atomic on S3's side. ``412 PreconditionFailed`` means "lost"; ``409
  ConditionalRequestConflict`` (a concurrent conditional write) is retried, then
  reported as lost; unless botocore retried the request after its answer was lost
  and the object holds exactly the bytes written: then the first try committed and
  the write is ours (:meth:`S3Store._conditional_put`);
* ETags are S3's (quoted MD5 for single-part objects), passed back unchanged;
* ``list_keys`` is ``ListObjectsV2`` with ``StartAfter``; ``list_children`` uses
  ``Delimiter="/"``;
* ``upload_file``/``download_file`` use boto3's managed transfer with
  :func:`~spotnb.providers.aws._boto.transfer_config` (16 MiB parts, 10 threads); a
  download lands in a temporary file that is renamed into place;
* ``open_writer`` streams an object (a checkpoint file) as a multipart upload: parts
  of :data:`STREAM_PART_BYTES` are sent by a thread pool shared by every writer of the
  store while the caller goes on writing, at most :data:`STREAM_PARTS_IN_FLIGHT` at a
  time (so a writer holds at most that many parts of memory), each with S3's own
  CRC32 checksum (fewer when the checkpoint's memory budget is small).
  ``CompleteMultipartUpload`` at close makes the object appear whole;
  an aborted or killed writer leaves none (the bucket's lifecycle rule cleans up parts
  a killed writer left). An object smaller than one part is a single ``PutObject``.

Every request carries ``ExpectedBucketOwner`` (the caller's account, from STS, unless
given): S3 refuses it with ``403`` if someone else owns the bucket, so a typo in a bucket
name can never send checkpoints to a stranger. Keys are checked like the local store's.

The default bucket and spotnb's settings on it (encryption, TLS only, the lifecycle
rules) are :mod:`.bucket`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.protocol.store import NotFound, ObjectWriter, Store, StoreError, _check_key
from spotnb.providers.aws import _boto

# Re-exported: tests import the bucket's names from here.
from spotnb.providers.aws.bucket import (
    LIFECYCLE_RULES,
    bucket_problem,
    default_bucket,
    ensure_bucket,
    tls_only_policy,
)
from spotnb.providers.aws.queue import SqsQueue, job_queue

__all__ = ["LIFECYCLE_RULES", "S3Store", "bucket_problem", "default_bucket", "ensure_bucket",
           "tls_only_policy"]

log = logging.getLogger(__name__)

_TMP_MARK = ".tmp-"
# A conditional write that met a concurrent one (409) is retried this often.
_CONFLICT_RETRIES = 5
_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys

#: A streamed object goes up in parts of this size: S3's minimum is 5 MiB and its
#: maximum part count 10,000, so one streamed object may reach 156 GiB (a checkpoint
#: is split into several files, each far smaller). 16 MiB parts keep a part's upload
#: long enough that request overhead is small, and are what boto3's transfer uses.
STREAM_PART_BYTES = 16 * 2**20
#: Parts uploading at once, per streamed object and across all of a store's objects
#: (one connection each): enough to fill an instance's link to S3 (boto3's transfer
#: uses 10 threads). A writer holds this many parts, plus the one it fills, in memory
#: (176 MiB), which a checkpoint's memory budget sets aside.
STREAM_PARTS_IN_FLIGHT = 10



def _retry_attempts(err: BaseException) -> int:
    """How often botocore retried the request that raised ``err`` (its response's
    ``RetryAttempts``)."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("RetryAttempts") or 0)
    return 0


def _parse(uri: str) -> tuple[str, str]:
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StoreError(f"not an S3 URI: {uri!r}; use s3://bucket/prefix")
    return parsed.netloc, parsed.path.strip("/")


class S3Store(Store):
    """A store under ``s3://bucket/prefix``. See the module docstring."""

    def __init__(self, bucket: str, prefix: str = "", *, region: str | None = None,
                 expected_owner: str | None = None, client: Any = None,
                 transfer: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        # On an instance outside the job's home, its user data names the bucket's region.
        self.region = region or os.environ.get("SPOTNB_STORE_REGION") or None
        self.uri = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        # Shared with child views: one client (thread-safe), one owner lookup, one pool
        # of part uploads (so every streamed object of the store shares the link).
        self._shared: dict[str, Any] = {"client": client, "owner": expected_owner,
                                        "transfer": transfer, "lock": threading.Lock(),
                                        "parts": None}
        self.part_bytes = STREAM_PART_BYTES

    @classmethod
    def from_uri(cls, uri: str, **kwargs: Any) -> S3Store:
        bucket, prefix = _parse(uri)
        return cls(bucket, prefix, **kwargs)

    def job_queue(self, job_id: str, name: str) -> SqsQueue:
        """The queue ``name`` of a job in this store: SQS, in the bucket's region
        (:func:`spotnb.protocol.events.queues.queue_for`)."""
        return job_queue(self.uri, self.region, self.owner, job_id, name)

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"

    # -- plumbing

    @property
    def client(self) -> Any:
        shared = self._shared
        if shared["client"] is None:
            with shared["lock"]:
                if shared["client"] is None:
                    shared["client"] = _boto.client("s3", self.region)
        return shared["client"]

    @property
    def owner(self) -> str:
        """The account that must own the bucket (``ExpectedBucketOwner``)."""
        shared = self._shared
        if shared["owner"] is None:
            try:
                shared["owner"] = _boto.account_id(region=self.region)
            except SpecError as err:
                raise StoreError(str(err)) from None
        return str(shared["owner"])

    def _part_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        shared = self._shared
        if shared["parts"] is None:
            with shared["lock"]:
                if shared["parts"] is None:
                    shared["parts"] = concurrent.futures.ThreadPoolExecutor(
                        STREAM_PARTS_IN_FLIGHT, thread_name_prefix="spotnb-s3-part")
        pool: concurrent.futures.ThreadPoolExecutor = shared["parts"]
        return pool

    def _transfer(self) -> Any:
        if self._shared["transfer"] is None:
            self._shared["transfer"] = _boto.transfer_config()
        return self._shared["transfer"]

    def _key(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _under(self, prefix: str) -> str:
        """The absolute S3 prefix for a relative listing prefix (may end inside a name)."""
        if not prefix:
            return f"{self.prefix}/" if self.prefix else ""
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def _strip(self, full: str) -> str:
        return full[len(self.prefix) + 1:] if self.prefix else full

    def _fail(self, err: BaseException, what: str) -> StoreError:
        kind = _boto.classify(err)
        if _boto.error_code(err) in ("AccessDenied", "403"):
            return StoreError(
                f"{what} in {self.uri}: access denied. Either the bucket belongs to another "
                f"AWS account (spotnb only uses buckets of account {self._shared['owner']}) "
                "or the credentials lack the permission; `spotnb aws doctor` tells which")
        if kind == "fatal":
            return StoreError(str(_boto.fatal_error(err, f"{what} in {self.uri}")))
        if _boto.error_code(err) in ("NoSuchBucket",):
            return StoreError(f"{what}: the bucket {self.bucket} does not exist; create it "
                              "with `spotnb aws setup` or choose another store")
        return StoreError(f"{what} in {self.uri} failed ({kind}): {err}")

    # -- the contract (see spotnb.protocol.store)

    def put(self, key: str, data: bytes) -> str:
        full = self._key(key)
        try:
            reply = self.client.put_object(Bucket=self.bucket, Key=full, Body=data,
                                           ExpectedBucketOwner=self.owner)
        except Exception as err:
            raise self._fail(err, f"writing {key}") from None
        return str(reply["ETag"])

    def get(self, key: str) -> bytes:
        return self.get_with_etag(key)[0]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if length <= 0:
            return b""
        full = self._key(key)
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=full,
                                           Range=f"bytes={offset}-{offset + length - 1}",
                                           ExpectedBucketOwner=self.owner)
            return bytes(reply["Body"].read())
        except Exception as err:
            if _boto.error_code(err) in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(key) from None
            raise self._fail(err, f"reading {key}") from None

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        full = self._key(key)
        try:
            reply = self.client.get_object(Bucket=self.bucket, Key=full,
                                           ExpectedBucketOwner=self.owner)
            return reply["Body"].read(), str(reply["ETag"])
        except Exception as err:
            if _boto.error_code(err) in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(key) from None
            raise self._fail(err, f"reading {key}") from None

    def exists(self, key: str) -> bool:
        full = self._key(key)
        try:
            self.client.head_object(Bucket=self.bucket, Key=full,
                                    ExpectedBucketOwner=self.owner)
        except Exception as err:
            if _boto.error_code(err) in ("NoSuchKey", "404", "NotFound"):
                return False
            raise self._fail(err, f"looking for {key}") from None
        return True

    def _conditional_put(self, key: str, data: bytes, **condition: str) -> str | None:
        """One conditional PutObject (``condition``: IfNoneMatch or IfMatch); its ETag,
        or None when the condition did not hold.

        botocore retries a request whose answer was lost (a connection closed or timed
        out after S3 had the request, a 5xx: ``botocore.retries.standard``'s transient
        errors), and the retry of a conditional write that had committed gets 412: the
        object is then ours already. So a 412 (or a last 409) after such a retry is
        checked against the object: if it holds exactly these bytes, the write is ours
        (one GET, only then)."""
        full = self._key(key)
        retried = False
        for attempt in range(_CONFLICT_RETRIES):
            try:
                reply = self.client.put_object(Bucket=self.bucket, Key=full,
                                               Body=data, ExpectedBucketOwner=self.owner,
                                               **condition)
                return str(reply["ETag"])
            except Exception as err:
                code = _boto.error_code(err)
                retried = retried or _retry_attempts(err) > 0
                if code in ("NoSuchKey", "404"):
                    return None
                if code in ("PreconditionFailed", "412"):
                    return self._ours(key, data) if retried else None
                if code in ("ConditionalRequestConflict", "409") and \
                        attempt < _CONFLICT_RETRIES - 1:
                    time.sleep(0.05 * 2 ** attempt)
                    continue
                if code in ("ConditionalRequestConflict", "409"):
                    return self._ours(key, data) if retried else None
                raise self._fail(err, f"writing {key} conditionally") from None
        return None

    def _ours(self, key: str, data: bytes) -> str | None:
        """The ETag of ``key`` if it holds exactly ``data`` (a write of ours whose answer
        was lost), else None."""
        try:
            found, etag = self.get_with_etag(key)
        except NotFound:
            return None
        if found != data:
            return None
        log.info("a conditional write of %s was retried after S3 had it: it is ours", key)
        return etag

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        return self._conditional_put(key, data, IfNoneMatch="*")

    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        return self._conditional_put(key, data, IfMatch=etag)

    def list_keys(self, prefix: str = "") -> list[str]:
        keys: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self._under(prefix),
                    ExpectedBucketOwner=self.owner):
                keys += [self._strip(o["Key"]) for o in page.get("Contents", ())]
        except Exception as err:
            raise self._fail(err, f"listing {prefix or '/'}") from None
        return keys  # S3 lists in UTF-8 binary order, which is lexicographic for our keys

    def list_children(self, prefix: str = "") -> list[str]:
        base = self._under(prefix)
        if base and not base.endswith("/"):
            base += "/"
        names: set[str] = set()
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base, Delimiter="/",
                    ExpectedBucketOwner=self.owner):
                names.update(p["Prefix"][len(base):].rstrip("/")
                             for p in page.get("CommonPrefixes", ()))
                names.update(o["Key"][len(base):] for o in page.get("Contents", ()))
        except Exception as err:
            raise self._fail(err, f"listing {prefix or '/'}") from None
        return sorted(n for n in names if n)

    def delete(self, key: str) -> None:
        full = self._key(key)
        try:
            self.client.delete_object(Bucket=self.bucket, Key=full,
                                      ExpectedBucketOwner=self.owner)
        except Exception as err:
            if _boto.error_code(err) in ("NoSuchKey", "404"):
                return
            raise self._fail(err, f"deleting {key}") from None

    def delete_prefix(self, prefix: str) -> None:
        self._delete_full([self._key(k) for k in self.list_keys(prefix)], prefix)

    def delete_many(self, keys: list[str]) -> None:
        """One DeleteObjects per 1,000 keys."""
        self._delete_full([self._key(k) for k in keys], f"{len(keys)} objects")

    def _delete_full(self, keys: list[str], prefix: str) -> None:
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": k} for k in keys[start:start + _DELETE_BATCH]]
            try:
                reply = self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True},
                    ExpectedBucketOwner=self.owner)
            except Exception as err:
                raise self._fail(err, f"deleting {prefix}") from None
            if reply.get("Errors"):
                first = reply["Errors"][0]
                raise StoreError(f"deleting {prefix} in {self.uri}: {len(reply['Errors'])} "
                                 f"objects failed, e.g. {first.get('Key')}: "
                                 f"{first.get('Code')} {first.get('Message')}")

    def upload_file(self, key: str, path: str | os.PathLike[str]) -> None:
        full = self._key(key)
        try:
            self.client.upload_file(os.fspath(path), self.bucket, full,
                                    ExtraArgs={"ExpectedBucketOwner": self.owner},
                                    Config=self._transfer())
        except Exception as err:
            raise self._fail(_boto.unwrap_transfer_error(err), f"uploading {key}") from None

    def open_writer(self, key: str, *, parts_in_flight: int | None = None) -> ObjectWriter:
        return _S3Writer(self, key, self._key(key),
                         max(1, parts_in_flight or STREAM_PARTS_IN_FLIGHT))

    def download_file(self, key: str, path: str | os.PathLike[str]) -> None:
        full = self._key(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_TMP_MARK)
        os.close(fd)
        try:
            self.client.download_file(self.bucket, full, tmp,
                                      ExtraArgs={"ExpectedBucketOwner": self.owner},
                                      Config=self._transfer())
            os.replace(tmp, dest)
        except BaseException as err:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            inner = _boto.unwrap_transfer_error(err)
            if _boto.error_code(inner) in ("NoSuchKey", "404", "NotFound"):
                raise NotFound(key) from None
            if isinstance(err, Exception):
                raise self._fail(inner, f"downloading {key}") from None
            raise

    def child(self, prefix: str) -> S3Store:
        sub = _check_key(prefix.strip("/"))
        view = S3Store(self.bucket, f"{self.prefix}/{sub}" if self.prefix else sub,
                       region=self.region)
        view._shared = self._shared
        return view


class _S3Writer(ObjectWriter):
    """A streamed object of an :class:`S3Store` (see the module docstring).

    Sequence: ``write`` fills a part buffer; each full part is handed to the store's
    part pool (blocking while ``parts_in_flight`` parts of this object are already
    going up: back-pressure, so memory stays bounded) -> ``close`` sends the last part, waits
    for every part, then ``CompleteMultipartUpload`` with the parts' CRC32s. Any
    failure aborts the multipart upload and raises :class:`StoreError`.
    """

    def __init__(self, store: S3Store, key: str, full: str, parts_in_flight: int) -> None:
        self.key = key
        self._store = store
        self._full = full
        self._slots = threading.BoundedSemaphore(parts_in_flight)
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[concurrent.futures.Future[dict[str, Any]]] = []
        self._done = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        total = len(view)
        while view:
            room = STREAM_PART_BYTES - len(self._buf)
            self._buf += view[:room]
            view = view[room:]
            if len(self._buf) >= STREAM_PART_BYTES:
                self._send_part()
        return total

    def _params(self) -> dict[str, Any]:
        return {"Bucket": self._store.bucket, "Key": self._full,
                "ExpectedBucketOwner": self._store.owner}

    def _send_part(self) -> None:
        client = self._store.client
        if self._upload_id is None:
            try:
                reply = client.create_multipart_upload(**self._params(),
                                                       ChecksumAlgorithm="CRC32")
            except Exception as err:
                raise self._store._fail(err, f"starting the upload of {self.key}") from None
            self._upload_id = str(reply["UploadId"])
        for part in self._parts:
            if part.done() and part.exception() is not None:
                self.abort()
                raise self._part_error(part.exception())  # type: ignore[arg-type]
        number, body = len(self._parts) + 1, self._buf  # handed over, not copied
        self._buf = bytearray()
        slots = self._slots
        slots.acquire()  # back-pressure: at most parts_in_flight parts in memory
        try:
            future = self._store._part_pool().submit(self._upload_part, number, body)
        except BaseException:
            slots.release()
            raise
        future.add_done_callback(lambda _: slots.release())
        self._parts.append(future)

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        reply = self._store.client.upload_part(**self._params(), UploadId=self._upload_id,
                                               PartNumber=number, Body=body,
                                               ChecksumAlgorithm="CRC32")
        part = {"PartNumber": number, "ETag": reply["ETag"]}
        if reply.get("ChecksumCRC32"):
            part["ChecksumCRC32"] = reply["ChecksumCRC32"]
        return part

    def _part_error(self, err: BaseException) -> StoreError:
        return self._store._fail(_boto.unwrap_transfer_error(err), f"uploading {self.key}")

    def close(self) -> None:
        if self._done:
            return
        if self._upload_id is None:
            # Smaller than one part: one PutObject (atomic like every S3 write).
            self._done = True
            try:
                self._store.client.put_object(**self._params(), Body=bytes(self._buf))
            except Exception as err:
                raise self._store._fail(err, f"uploading {self.key}") from None
            return
        if self._buf:
            self._send_part()
        try:
            parts = [future.result() for future in self._parts]
        except Exception as err:
            self.abort()
            raise self._part_error(err) from None
        try:
            self._store.client.complete_multipart_upload(
                **self._params(), UploadId=self._upload_id,
                MultipartUpload={"Parts": parts})
        except Exception as err:
            self.abort()
            raise self._store._fail(err, f"completing the upload of {self.key}") from None
        self._done = True

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        for future in self._parts:
            future.cancel()
        concurrent.futures.wait(self._parts)
        if self._upload_id is not None:
            try:
                self._store.client.abort_multipart_upload(**self._params(),
                                                          UploadId=self._upload_id)
            except Exception:
                # The bucket's lifecycle rule removes the parts after a day.
                log.warning("aborting the upload of %s failed; its parts expire in a day",
                            self.key, exc_info=True)
