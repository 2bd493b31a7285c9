"""The store, the event log and the lease: the protocol every other part stands on.

The store contract runs against both stores: the local directory and S3 on the
simulator (moto in server mode; S3's own duties are in ``tests/test_aws_store.py``).
Tests that look inside the local store's directory take ``local_store``.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spotnb import lease
from spotnb.events import EventReader, EventWriter
from spotnb.store import LocalStore, NotFound, Store, open_store


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """The store under the contract: a local directory, or a prefix of an S3 bucket on
    the simulator."""
    if request.param == "local":
        return LocalStore(tmp_path / "store")
    request.getfixturevalue("moto_endpoint")
    from spotnb.providers.aws import _boto

    bucket = f"spotnb-test-{secrets.token_hex(4)}"
    _boto.client("s3").create_bucket(Bucket=bucket)
    return open_store(f"s3://{bucket}/root/prefix")


@pytest.fixture
def local_store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def test_put_get_and_etags(store: Store) -> None:
    etag = store.put("a/b.json", b"one")
    assert store.get("a/b.json") == b"one"
    assert store.get_with_etag("a/b.json") == (b"one", etag)
    assert store.put("a/b.json", b"two") != etag
    with pytest.raises(NotFound):
        store.get("a/missing")
    store.delete("a/missing")  # no error


def test_put_if_absent_creates_once(store: Store) -> None:
    assert store.put_if_absent("k", b"first") is not None
    assert store.put_if_absent("k", b"second") is None
    assert store.get("k") == b"first"


def test_put_if_match_is_compare_and_swap(store: Store) -> None:
    etag = store.put("k", b"v1")
    new = store.put_if_match("k", b"v2", etag)
    assert new is not None
    assert store.put_if_match("k", b"v3", etag) is None, "a stale etag must lose"
    assert store.get("k") == b"v2"
    assert store.put_if_match("missing", b"x", etag) is None


def _processes(store: Store) -> Any:
    """How to start the racing processes: forked for the local store (quick), spawned
    for S3 (a forked child would inherit the simulator's server threads)."""
    return multiprocessing.get_context("fork" if isinstance(store, LocalStore) else "spawn")


def _race_cas(uri: str, n: int, wins: Any) -> None:
    s = open_store(uri)
    won = 0
    for _ in range(n):
        data, etag = s.get_with_etag("counter")
        if s.put_if_match("counter", str(int(data) + 1).encode(), etag) is not None:
            won += 1
    wins.put(won)


@pytest.mark.slow  # about 30 s on S3 (3 processes, each connecting to the simulator)
def test_compare_and_swap_across_processes_loses_no_update(store: Store) -> None:
    store.put("counter", b"0")
    ctx = _processes(store)
    wins = ctx.Queue()
    procs = [ctx.Process(target=_race_cas, args=(store.uri, 40, wins)) for _ in range(3)]
    for p in procs:
        p.start()
    total_wins = sum(wins.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert int(store.get("counter")) == total_wins > 0


def test_put_if_absent_has_one_winner_among_threads(store: Store) -> None:
    wins: list[str] = []
    barrier = threading.Barrier(8)

    def race(i: int) -> None:
        barrier.wait()
        if store.put_if_absent("once", str(i).encode()) is not None:
            wins.append(str(i))

    threads = [threading.Thread(target=race, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1
    assert store.get("once").decode() == wins[0]


def test_list_keys_start_after_and_children(store: Store) -> None:
    for key in ["events/000001/00000002.jsonl", "events/000001/00000001.jsonl",
                "events/000000/00000000.jsonl", "spec.json", "events-not/x"]:
        store.put(key, b"x")
    assert store.list_keys("events/000001/") == [
        "events/000001/00000001.jsonl", "events/000001/00000002.jsonl"]
    assert store.list_keys("events/000001/", start_after="events/000001/00000001.jsonl") == [
        "events/000001/00000002.jsonl"]
    assert store.list_children("events/") == ["000000", "000001"]
    assert store.list_children("events") == ["000000", "000001"]
    assert store.list_children() == ["events", "events-not", "spec.json"]
    assert store.list_keys("events/0000") == [
        "events/000000/00000000.jsonl", "events/000001/00000001.jsonl",
        "events/000001/00000002.jsonl"], "a prefix may end inside a name"
    assert store.list_keys("nothing/") == []


def test_child_views_share_the_store(store: Store) -> None:
    job = store.child("jobs/j1")
    assert job.uri == store.uri + "/jobs/j1"
    job.put("spec.json", b"{}")
    assert store.get("jobs/j1/spec.json") == b"{}"
    assert open_store(job.uri).get("spec.json") == b"{}"
    assert store.list_children("jobs") == ["j1"]
    job.delete("spec.json")
    job.delete("spec.json")  # deleting a missing key is not an error
    assert not job.exists("spec.json")


def test_local_listings_hide_temporaries(local_store: LocalStore) -> None:
    local_store.put("events/000001/00000001.jsonl", b"x")
    (local_store.root / "events" / "000001" / ".tmp-half").write_bytes(b"partial")
    assert local_store.list_keys("events/000001/") == ["events/000001/00000001.jsonl"]


def test_readers_never_see_a_half_written_object(store: Store) -> None:
    big_a, big_b = b"a" * 4_000_000, b"b" * 4_000_000
    store.put("big", big_a)
    stop = threading.Event()
    seen: set[bytes] = set()

    def read() -> None:
        while not stop.is_set():
            data = store.get("big")
            seen.add(data[:1] + data[-1:] + str(len(data)).encode())

    reader = threading.Thread(target=read)
    reader.start()
    for i in range(20):
        store.put("big", big_b if i % 2 else big_a)
    stop.set()
    reader.join()
    assert seen <= {b"aa4000000", b"bb4000000"}


def test_a_streamed_object_appears_whole_at_close_or_not_at_all(store: Store) -> None:
    # Larger than an S3 part (16 MiB), written in pieces that straddle part boundaries.
    data = os.urandom(17 * 2**20 + 12_345)
    writer = store.open_writer("ckpt/1/data")
    for start in range(0, len(data), 3_000_001):
        writer.write(memoryview(data)[start:start + 3_000_001])
    assert not store.exists("ckpt/1/data")
    assert store.list_keys("ckpt/") == []
    writer.close()
    assert store.get("ckpt/1/data") == data

    with store.open_writer("ckpt/1/small") as small:
        small.write(b"tiny")
    assert store.get("ckpt/1/small") == b"tiny"

    with pytest.raises(RuntimeError, match="mid-write"), store.open_writer("ckpt/2/x") as w:
        w.write(data)
        raise RuntimeError("the writer failed mid-write")
    aborted = store.open_writer("ckpt/2/y")
    aborted.write(data[:1000])
    aborted.abort()
    assert store.list_keys("ckpt/") == ["ckpt/1/data", "ckpt/1/small"]


def test_keys_that_escape_the_prefix_are_refused(store: Store) -> None:
    for bad in ["../x", "/abs", "a//b", "a/./b", ""]:
        with pytest.raises(ValueError):
            store.put(bad, b"x")


def test_open_store_accepts_paths_and_file_uris(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path), LocalStore)
    s = open_store(tmp_path.as_uri())
    s.put("x", b"1")
    assert (tmp_path / "x").read_bytes() == b"1"
    assert s.child("jobs/j1").uri == (tmp_path / "jobs" / "j1").as_uri()


def test_event_log_round_trip_in_order_across_streams(store: Store) -> None:
    group = EventWriter(store, 0, flush_seconds=0.05)
    agent = EventWriter(store, 1, instance="i-1", flush_seconds=0.05)
    group.emit("instance", action="launched", instance_id="i-1")
    agent.emit("status", state="booting")
    agent.emit("metric", step=0, t=time.time(), values={"loss": 1.0})
    # Both streams written before the read (under load one writer's background flush
    # can land a poll earlier than the other's: a poll orders what it reads, and an
    # event that arrives later comes in a later poll).
    group.flush()
    agent.flush()
    reader = EventReader(store)
    events = reader.poll()
    assert [e.type for e in events] == ["instance", "status", "metric"]
    assert events[2].attempt == 1 and events[2].instance == "i-1"
    assert all(e.v == 1 for e in events)
    agent.emit("metric", step=1, t=time.time(), values={"loss": 0.5})
    agent.close()
    group.close()
    assert [e.data["step"] for e in reader.poll()] == [1], "only the new event"
    assert len(EventReader(store).poll()) == 4, "a new reader replays everything"


def test_event_chunks_are_immutable_and_a_fenced_writer_writes_nothing(store: Store) -> None:
    writer = EventWriter(store, 1, flush_seconds=60)
    writer.emit("status", state="running")
    writer.flush()
    chunks = store.list_keys("events/000001/")
    first = store.get(chunks[0])
    writer.emit("stream", name="stdout", text="hi")
    writer.flush()
    assert store.get(chunks[0]) == first
    assert len(store.list_keys("events/000001/")) == 2
    writer.stop_writing()
    writer.emit("stream", name="stdout", text="after the lease was lost")
    writer.close()
    assert len(store.list_keys("events/000001/")) == 2


def test_a_restarted_writer_continues_the_stream(store: Store) -> None:
    w = EventWriter(store, 0, flush_seconds=60)
    w.emit("status", state="launching")
    w.close()
    w2 = EventWriter(store, 0, flush_seconds=60)
    w2.emit("status", state="launching")
    w2.close()
    assert len(store.list_keys("events/000000/")) == 2
    assert len(EventReader(store).poll()) == 2


def test_lease_one_holder_then_takeover_after_release_or_ttl(store: Store) -> None:
    a = lease.acquire(store, "i-a")
    assert a is not None and a.epoch == 1
    assert lease.acquire(store, "i-b") is None, "a live holder keeps the lease"
    a.renew()
    # Silent for longer than the TTL: presumed dead, the lease can be taken.
    b = lease.acquire(store, "i-b", now=time.time() + lease.TTL_SECONDS + 1)
    assert b is not None and b.epoch == 2
    with pytest.raises(lease.LeaseLost):
        a.renew()
    assert not lease.still_holds(store, 1, "i-a")
    assert lease.still_holds(store, 2, "i-b")
    b.release()
    c = lease.acquire(store, "i-c")
    assert c is not None and c.epoch == 3, "a released lease is free at once"


def _grab(uri: str, holder: str, go: Any, out: Any, done: Any) -> None:
    store = open_store(uri)
    store.exists("warm-up")  # connect (S3: look up the account) before the race
    go.wait(30)
    held = lease.acquire(store, holder)
    out.put(None if held is None else held.epoch)
    done.wait(60)  # the winner stays alive: a holder whose process is gone loses it


@pytest.mark.slow  # over 30 s on S3 (4 processes, each connecting to the simulator)
def test_lease_race_between_processes_has_one_winner(store: Store) -> None:
    ctx = _processes(store)
    out, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [ctx.Process(target=_grab, args=(store.uri, f"i-{i}", go, out, done))
             for i in range(4)]
    for p in procs:
        p.start()
    go.set()
    results = [out.get(timeout=60) for _ in procs]
    done.set()
    for p in procs:
        p.join(30)
    assert sorted(results, key=lambda r: r is None) == [1] + [None] * 3
    assert store.exists("lease.json")


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_success() -> None:
    from spotnb.backoff import Backoff

    # The store's retries: 0.5 s doubling up to 30 s, as every retry loop had them.
    delays = Backoff(0.5, 30.0)
    assert [delays.next() for _ in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]
    delays.reset()
    assert delays.next() == 0.5
    # AWS calls: jittered between half and all of the same doubling (up to 8 s).
    jittered = Backoff(0.5, 8.0, jitter=0.5)
    for expected in (0.5, 1, 2, 4, 8, 8):
        assert expected / 2 <= jittered.next() <= expected
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)
