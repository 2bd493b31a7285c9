"""The S3 store against moto in server mode: S3's own duties (paging, multipart
transfers, the expected bucket owner, the default bucket). The store contract runs
against S3 in ``tests/test_store.py``."""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

from spotnb.protocol.spec import SpecError
from spotnb.protocol.store import NotFound, StoreError, open_store
from spotnb.providers.aws import _boto
from spotnb.providers.aws.store import (
    LIFECYCLE_RULES,
    S3Store,
    bucket_problem,
    default_bucket,
    ensure_bucket,
)
from spotnb.testing import DEFAULT_ACCOUNT

OTHER_ACCOUNT = "111111111111"


@pytest.fixture
def bucket(moto_endpoint: str) -> str:
    name = f"spotnb-test-{secrets.token_hex(4)}"
    _boto.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def store(bucket: str) -> S3Store:
    found = open_store(f"s3://{bucket}/root/prefix")
    assert isinstance(found, S3Store)
    return found


def _other_account_s3() -> Any:
    """An S3 client acting as another AWS account (moto's account header)."""
    s3 = _boto.client("s3")
    s3.meta.events.register("before-sign.s3.*", lambda request, **kw: request.headers
                            .__setitem__("x-moto-account-id", OTHER_ACCOUNT))
    return s3


# ------------------------------------------------------------------- listings


def test_listing_pages_past_a_thousand_keys(store: S3Store) -> None:
    from moto.s3.models import s3_backends

    backend = s3_backends[DEFAULT_ACCOUNT]["aws"]
    for i in range(1100):  # through moto's backend: 1,100 PUTs over HTTP take seconds
        backend.put_object(store.bucket, f"{store.prefix}/many/{i:05d}", b"")
    keys = store.list_keys("many/")
    assert len(keys) == 1100 and keys == sorted(keys)
    store.delete_prefix("many/")
    assert store.list_keys("many/") == []


# ------------------------------------------------------------------- transfers


def test_upload_and_download_large_files_multipart(store: S3Store, tmp_path: Path) -> None:
    small = S3Store(store.bucket, store.prefix,
                    transfer=_boto.transfer_config(threshold=5 * 2**20, chunk=5 * 2**20))
    data = os.urandom(12 * 2**20 + 123)
    src = tmp_path / "ckpt.bin"
    src.write_bytes(data)
    small.upload_file("checkpoints/1/model.pt", src)
    head = store.client.head_object(Bucket=store.bucket,
                                    Key=f"{store.prefix}/checkpoints/1/model.pt")
    assert head["ETag"].strip('"').endswith("-3"), "uploaded in three parts"
    dest = tmp_path / "out" / "model.pt"
    small.download_file("checkpoints/1/model.pt", dest)
    assert dest.read_bytes() == data
    assert [p.name for p in dest.parent.iterdir()] == ["model.pt"], "no temporary left"
    # A ranged GET across a part boundary (a rank reading a few items of a file).
    start = 5 * 2**20 - 3
    assert store.get_range("checkpoints/1/model.pt", start, 10) == data[start:start + 10]
    with pytest.raises(NotFound):
        store.get_range("checkpoints/1/missing.pt", 0, 10)
    with pytest.raises(NotFound):
        store.download_file("checkpoints/1/missing.pt", tmp_path / "missing.pt")
    assert not (tmp_path / "missing.pt").exists()


def test_every_request_names_the_expected_bucket_owner(store: S3Store, tmp_path: Path) -> None:
    seen: list[tuple[str, str | None]] = []

    def record(event_name: str, params: dict[str, Any], **kwargs: Any) -> None:
        headers = {k.lower(): v for k, v in params.get("headers", {}).items()}
        seen.append((event_name.rsplit(".", 1)[1], headers.get("x-amz-expected-bucket-owner")))

    remove = _boto.add_hook("before-call.s3.*", record)
    try:
        etag = store.put("a", b"1")
        store.get("a")
        store.exists("a")
        store.put_if_absent("b", b"1")
        store.put_if_match("a", b"2", etag)
        store.list_keys()
        store.list_children()
        src = tmp_path / "f"
        src.write_bytes(b"x" * 100)
        store.upload_file("f", src)
        store.download_file("f", tmp_path / "g")
        assert store.get_range("f", 10, 5) == b"x" * 5
        store.delete("a")
        store.delete_prefix("")
    finally:
        remove()
    operations = {op for op, _ in seen}
    assert {"PutObject", "GetObject", "HeadObject", "ListObjectsV2", "DeleteObject",
            "DeleteObjects"} <= operations
    assert all(owner == DEFAULT_ACCOUNT for _, owner in seen), seen


@pytest.mark.slow  # over 30 s: torch, and a 20 MiB checkpoint through the simulator
def test_a_checkpoint_streams_to_s3_in_parts_with_checksums(
        store: S3Store, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.ckpt.dcp import FileReader, StoreWriter, load_state, save_state, state_key

    seen: list[tuple[str, str | None]] = []

    def record(event_name: str, params: dict[str, Any], **kwargs: Any) -> None:
        headers = {k.lower(): v for k, v in params.get("headers", {}).items()}
        seen.append((event_name.rsplit(".", 1)[1], headers.get("x-amz-expected-bucket-owner")))

    weights = torch.randn(5 * 2**20)  # 20 MiB: two parts of a multipart upload
    cs = CheckpointStore(store, "checkpoints")
    pending = cs.begin(3, attempt=1)
    writer = StoreWriter(pending, live=["w"], parts_in_flight=1)
    remove = _boto.add_hook("before-call.s3.*", record)
    try:
        save_state({"w": weights, state_key(): {"step": 3}}, writer)
    finally:
        remove()
    assert writer.live_written.is_set()
    manifest = cs.commit(pending.finish("dcp"))
    operations = [op for op, _ in seen]
    assert operations.count("UploadPart") == 2
    assert {"CreateMultipartUpload", "CompleteMultipartUpload", "PutObject"} <= set(operations)
    assert all(owner == DEFAULT_ACCOUNT for _, owner in seen), seen
    data = next(f for f in manifest.files if f.name.endswith(".distcp"))
    head = store.client.head_object(Bucket=store.bucket, ChecksumMode="ENABLED",
                                    Key=f"{store.prefix}/checkpoints/{manifest.id}/{data.name}")
    assert head["ContentLength"] == data.size and head.get("ChecksumCRC32")
    assert not store.client.list_multipart_uploads(Bucket=store.bucket).get("Uploads")

    cs.download(manifest, tmp_path / "copy")  # checks sizes and SHA-256
    targets: dict[str, Any] = {"w": torch.empty_like(weights), state_key(): None}
    load_state(targets, FileReader(tmp_path / "copy"))
    assert torch.equal(targets["w"], weights) and targets[state_key()] == {"step": 3}


# ------------------------------------------------------------- the live queue


def test_a_live_queue_makes_one_request_per_wait_even_under_a_second(
        moto_endpoint: str) -> None:
    """SQS waits in whole seconds. A wait under one second (a sweep's trials share its
    one-second round; a test's watch polls every 0.5 s) was sent as WaitTimeSeconds=0,
    answered at once, and the follower asked again at once: a loop of billed
    ReceiveMessage requests (about 100 a second on this machine) that also took the
    machine's CPU. An empty answer is now followed by the rest of the wait."""
    from spotnb.providers.aws.queue import SqsQueue

    queue = SqsQueue("us-east-1", DEFAULT_ACCOUNT, f"spotnb-test-{secrets.token_hex(4)}")
    queue.create()
    asked: list[int] = []
    queue.client.meta.events.register(
        "before-parameter-build.sqs.ReceiveMessage",
        lambda params, **kw: asked.append(params["WaitTimeSeconds"]))
    try:
        for wait in (0.0, 0.5, 1.0):
            assert queue.receive(wait) == []
        assert asked == [0, 0, 1], "SQS's whole seconds"
        asked.clear()
        # Followed for at least two seconds in waits of 0.5 s: a request each.
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            assert queue.receive(0.5) == []
        assert len(asked) <= 5, f"{len(asked)} ReceiveMessage requests in 2 s"
        # What is there is taken at once, whatever the wait.
        queue.send("hello")
        assert wait_until(lambda: queue.receive(0.5), 10, "the message") == ["hello"]
    finally:
        queue.delete()


# ------------------------------------------------------------- buckets, errors


def test_a_bucket_of_another_account_is_refused(moto_endpoint: str) -> None:
    name = f"spotnb-foreign-{secrets.token_hex(4)}"
    _other_account_s3().create_bucket(Bucket=name)
    problem = bucket_problem(_boto.client("s3"), name, DEFAULT_ACCOUNT)
    assert problem is not None and "belongs to another AWS account" in problem
    store = open_store(f"s3://{name}/spotnb")
    with pytest.raises(StoreError, match="another AWS account"):
        store.put("x", b"1")
    with pytest.raises(StoreError, match="access denied"):
        store.get("x")
    with pytest.raises(SpecError, match="belongs to another AWS account"):
        ensure_bucket(_boto.client("s3"), name, "us-east-1", DEFAULT_ACCOUNT)
    assert _other_account_s3().list_objects_v2(Bucket=name).get("KeyCount") == 0


def test_default_bucket_is_private_encrypted_and_expires_checkpoints(
        moto_endpoint: str) -> None:
    s3 = _boto.client("s3")
    name = default_bucket(DEFAULT_ACCOUNT, "us-east-1")
    assert name == "spotnb-123456789012-us-east-1"
    planned = ensure_bucket(s3, name, "us-east-1", DEFAULT_ACCOUNT, dry_run=True)
    assert planned[0].startswith("would create bucket")
    assert bucket_problem(s3, name, DEFAULT_ACCOUNT) == "missing", "a dry run creates nothing"
    ensure_bucket(s3, name, "us-east-1", DEFAULT_ACCOUNT)
    ensure_bucket(s3, name, "us-east-1", DEFAULT_ACCOUNT)  # idempotent
    block = s3.get_public_access_block(Bucket=name)["PublicAccessBlockConfiguration"]
    assert all(block.values()) and len(block) == 4
    rules = s3.get_bucket_encryption(Bucket=name)["ServerSideEncryptionConfiguration"]["Rules"]
    assert rules[0]["ApplyServerSideEncryptionByDefault"]["SSEAlgorithm"] == "AES256"
    lifecycle = s3.get_bucket_lifecycle_configuration(Bucket=name)["Rules"]
    assert {r["ID"] for r in lifecycle} == {r["ID"] for r in LIFECYCLE_RULES}
    expire = next(r for r in lifecycle if "Expiration" in r)
    assert expire["Filter"]["And"]["Prefix"] == "jobs/"
    assert any("AbortIncompleteMultipartUpload" in r for r in lifecycle)


def test_missing_credentials_are_a_clear_error(moto_endpoint: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setattr(_boto, "_ACCOUNTS", {})
    with pytest.raises(StoreError, match="no AWS credentials found"):
        open_store("s3://any-bucket/p").get("x")


# ------------------------------------------------------------------ real AWS


def _real_aws() -> bool:
    if os.environ.get("SPOTNB_AWS_TESTS") != "1" or os.environ.get("AWS_ENDPOINT_URL"):
        return False
    try:
        return _boto.session().get_credentials() is not None
    except Exception:
        return False


@pytest.mark.aws
@pytest.mark.skipif(not _real_aws(), reason="needs AWS credentials and SPOTNB_AWS_TESTS=1")
def test_real_s3_keeps_the_store_contract(tmp_path: Path) -> None:
    """The contract on real S3, in a throw-away prefix of the default bucket."""
    region = _boto.session().region_name or "us-east-1"
    account = _boto.account_id(region=region)
    bucket = default_bucket(account, region)
    ensure_bucket(_boto.client("s3", region), bucket, region, account)
    store = S3Store(bucket, f"spotnb-tests/{secrets.token_hex(6)}", region=region)
    try:
        etag = store.put("a/b.json", b"one")
        assert store.put_if_absent("a/b.json", b"two") is None
        assert store.put_if_match("a/b.json", b"three", '"stale"') is None
        assert store.put_if_match("a/b.json", b"three", etag) is not None
        assert store.get("a/b.json") == b"three"
        for i in range(3):
            store.put(f"events/000001/{i:08d}.jsonl", b"{}")
        assert store.list_keys("events/000001/") == [
            f"events/000001/{i:08d}.jsonl" for i in range(3)]
        assert store.list_children() == ["a", "events"]
        big = tmp_path / "big"
        big.write_bytes(os.urandom(40 * 2**20))
        store.upload_file("ckpt/big", big)
        store.download_file("ckpt/big", tmp_path / "back")
        assert (tmp_path / "back").read_bytes() == big.read_bytes()
    finally:
        store.delete_prefix("")


# ------------------------------------------------- a conditional write whose answer was lost


def _lose_the_first_answer(store: S3Store) -> list[int]:
    """The store's next PutObject reaches S3 (and commits) but its answer is lost:
    botocore retries it, as it retries a connection closed or timed out after sending
    (botocore.retries.standard: transient errors)."""
    lost: list[int] = []

    def retry_once(attempts: int = 1, response: Any = None, **kwargs: Any) -> float | None:
        if not lost and response is not None:
            lost.append(attempts)
            return 0.0  # "retry now"
        return None

    store.client.meta.events.register("needs-retry.s3.PutObject", retry_once)
    return lost


def test_a_conditional_write_whose_answer_was_lost_is_still_the_writers(
        store: S3Store) -> None:
    # The lease and the LATEST pointer: S3 committed the first try, the retry got 412.
    # The write is the writer's all the same (the object holds its bytes); reporting it
    # lost would fence a lease holder that holds the lease.
    fresh = S3Store(store.bucket, f"{store.prefix}/lost-answer")
    lost = _lose_the_first_answer(fresh)
    etag = fresh.put_if_absent("lease.json", b'{"epoch": 1, "holder": "i-1"}')
    assert lost == [1], "the answer of the first try was lost and botocore retried"
    assert etag is not None and etag == fresh.get_with_etag("lease.json")[1]
    lost.clear()
    renewed = fresh.put_if_match("lease.json", b'{"epoch": 1, "holder": "i-1", "hb": 2}',
                                 etag)
    assert lost == [1] and renewed is not None
    assert renewed == fresh.get_with_etag("lease.json")[1]
    # A write that really lost (another writer's bytes are there) stays lost.
    lost.clear()
    assert fresh.put_if_match("lease.json", b'{"epoch": 2, "holder": "i-2"}', etag) is None
    assert fresh.put_if_absent("lease.json", b"someone else") is None
