"""The store, the event log and the lease: the protocol every other part stands on.

The store contract runs against both stores: the local directory and S3 on the
simulator (moto in server mode; S3's own duties are in ``tests/test_aws_store.py``).
Tests that look inside the local store's directory take ``local_store``.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import random
import secrets
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from spotnb.protocol import lease
from spotnb.protocol.events import EventReader, EventWriter
from spotnb.protocol.store import LocalStore, NotFound, Store, open_store


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


def test_list_keys_and_children(store: Store) -> None:
    for key in ["events/000001/00000002.jsonl", "events/000001/00000001.jsonl",
                "events/000000/00000000.jsonl", "spec.json", "events-not/x"]:
        store.put(key, b"x")
    assert store.list_keys("events/000001/") == [
        "events/000001/00000001.jsonl", "events/000001/00000002.jsonl"]
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


class _Gate:
    """A held lease's lock that holds chosen threads just before their n-th entry
    (``{thread name: n}``) until ``go[name]`` is set; ``arrived[name]`` says they are
    there."""

    def __init__(self, real: Any, stops: dict[str, int]) -> None:
        self.real, self.stops = real, stops
        self.entries: dict[str, int] = {}
        self.arrived = {name: threading.Event() for name in stops}
        self.go = {name: threading.Event() for name in stops}

    def __enter__(self) -> Any:
        name = threading.current_thread().name
        self.entries[name] = self.entries.get(name, 0) + 1
        if self.stops.get(name) == self.entries[name]:
            self.arrived[name].set()
            assert self.go[name].wait(30), f"{name} was never let go"
        return self.real.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        return self.real.__exit__(*exc)


def _start(name: str, target: Any) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()

    def run() -> None:
        try:
            target()
        except lease.LeaseLost:
            pass
        finally:
            done.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, done


def _reached(gate: _Gate, name: str, done: threading.Event) -> None:
    """Wait (bounded) until thread ``name`` is held at the gate or has finished."""
    deadline = time.monotonic() + 30
    while not (gate.arrived[name].is_set() or done.is_set()):
        assert time.monotonic() < deadline, f"{name} neither reached the gate nor ended"
        done.wait(0.01)


def test_a_renewal_racing_a_bump_never_puts_the_epoch_back(
        local_store: LocalStore) -> None:
    store = local_store
    # A renewal that was about to take the lock when a bump went through: the epoch
    # must stay the bumped one (it went back to 1 when renew() built its lease first).
    held = lease.acquire(store, "i-a")
    assert held is not None
    gate = _Gate(held._lock, {"renewer": 1})
    held._lock = gate  # type: ignore[assignment]
    renewer, renewed = _start("renewer", held.renew)
    _reached(gate, "renewer", renewed)
    held.bump()
    gate.go["renewer"].set()
    renewer.join(30)
    current = lease.read(store)
    assert current is not None and current[0].epoch == 2 and held.epoch == 2, \
        "a renewal put the epoch back after a bump"


def test_a_renewal_racing_a_release_never_undoes_it(local_store: LocalStore) -> None:
    store = local_store
    # A renewal held at the lock while release() runs (and, on old code, between the
    # release's write and the moment it marks itself lost): the lease stays released.
    held = lease.acquire(store, "i-a")
    assert held is not None
    gate = _Gate(held._lock, {"renewer": 1, "releaser": 2})
    held._lock = gate  # type: ignore[assignment]
    renewer, renewed = _start("renewer", held.renew)
    _reached(gate, "renewer", renewed)
    releaser, released = _start("releaser", held.release)
    _reached(gate, "releaser", released)
    gate.go["renewer"].set()
    renewer.join(30)
    gate.go["releaser"].set()
    releaser.join(30)
    current = lease.read(store)
    assert current is not None and current[0].released, "a renewal undid the release"
    assert held.status() is lease.Standing.LOST
    taken = lease.acquire(store, "i-b")
    assert taken is not None and taken.epoch == 2, "a released lease is free at once"


class _Recording(LocalStore):
    """A local store that records every lease write that went through, in order, and
    lets other threads run before each conditional write (to open race windows)."""

    def __init__(self, root: Path, seed: int) -> None:
        super().__init__(root)
        self.writes: list[lease.Lease] = []
        self.rng = random.Random(seed)
        self.record_lock = threading.Lock()

    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        time.sleep(self.rng.random() / 2000)  # up to 0.5 ms: let the other threads in
        with self.record_lock:
            new = super().put_if_match(key, data, etag)
            if new is not None:
                self.writes.append(lease.Lease.decode(data))
            return new


def _soak_round(store: _Recording, rng: random.Random) -> None:
    """Two renewing threads, one bumping, one renewing then releasing, at once."""
    held = lease.acquire(store, "i-a")
    assert held is not None

    def renewer(n: int) -> None:
        for _ in range(n):
            held.renew()

    def bumper(n: int) -> None:
        for _ in range(n):
            held.bump()

    def releaser(n: int) -> None:
        for _ in range(n):
            with contextlib.suppress(lease.LeaseLost):
                held.renew()
        held.release()

    plan = [(f"renew-{i}", renewer, rng.randrange(3, 8)) for i in range(2)]
    plan += [("bump", bumper, rng.randrange(2, 6)), ("release", releaser, rng.randrange(1, 6))]
    threads = [_start(name, functools.partial(work, n))[0] for name, work, n in plan]
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive(), "a lease operation hung"
    assert held.status() is lease.Standing.LOST


@pytest.mark.parametrize("seed", range(2))
def test_lease_unit_soak_epoch_never_decreases_and_a_release_sticks(
        tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    for round_ in range(8):
        store = _Recording(tmp_path / f"s{round_}", seed * 100 + round_)
        _soak_round(store, rng)
        epochs = [w.epoch for w in store.writes]
        assert epochs == sorted(epochs), f"round {round_}: the epoch went back: {epochs}"
        released = [i for i, w in enumerate(store.writes) if w.released]
        assert released, f"round {round_}: the release was never written"
        assert released[0] == len(store.writes) - 1, \
            f"round {round_}: the lease was written again after its release"


@pytest.mark.parametrize("ttl", [3.0, 6.0, 30.0, 180.0])
def test_a_frozen_agents_kernel_stops_before_anyone_may_take_the_lease(
        local_store: LocalStore, ttl: float) -> None:
    store = local_store
    # The agent renews (at C), pings its kernel with the lease's time, and freezes
    # right before its next renewal is due: the worst case. Another agent may take
    # over TTL seconds after the renewal; the kernel's watchdog must have stopped it
    # before then, whatever the TTL (it was fixed at 15 s: 60-74 steps trained after
    # the takeover with a TTL of 6 s).
    from spotnb.train.agentchannel import watchdog_verdict

    before = lease.clock()
    held = lease.acquire(store, "i-a", ttl=ttl)
    assert held is not None
    held.renew()
    after = lease.clock()
    until = held.held_until()  # what the agent's ping says (spotnb.kernel_remote.loops)
    assert until is not None
    frozen = after + lease.heartbeat_seconds(ttl)  # its last ping
    takeover = before + ttl  # the earliest another agent may take the lease
    assert lease.acquire(store, "i-b", now=time.time() + ttl - 1) is None
    stop = next((frozen + i / 100 for i in range(100 * 600)
                 if watchdog_verdict(i / 100, until, frozen + i / 100) is not None), None)
    assert stop is not None and stop < takeover, (
        f"TTL {ttl:g} s: the kernel of a frozen agent would stop {stop - frozen:.1f} s after "
        f"its agent's last ping, {stop - takeover:+.1f} s after another agent may hold the "
        "lease" if stop is not None else "the kernel never stops")
    # While the agent speaks (it pings after a pause, or after the store came back),
    # the kernel does not stop itself: the agent pauses and resumes it.
    assert watchdog_verdict(0.1, until, until + 5) is None
    held.release()
    assert held.held_until() is None


def test_backoff_doubles_to_its_cap_and_starts_over_after_a_success() -> None:
    from spotnb.protocol.backoff import Backoff

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
