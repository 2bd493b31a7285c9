"""The event log's mechanics on a real local store: chunks rolled into segments, readers
that see every event exactly once (in the middle of a compaction too), metric batches,
and the live channel (queues, followers)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from spotnb.protocol.events import (
    Event,
    EventReader,
    EventWriter,
    expand,
    last_values,
    metric_rows,
    metrics_data,
)
from spotnb.protocol.events.live import Follower, LiveSender
from spotnb.protocol.events.queues import LocalQueue, pack, queue_for, unpack
from spotnb.protocol.events.writer import COMPACT_FANOUT, StreamObject
from spotnb.protocol.store import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "job")


def _stream_objects(store: LocalStore, attempt: int = 1) -> list[StreamObject]:
    objs = [StreamObject.parse(k) for k in store.list_keys(f"events/{attempt:06d}/")]
    return [o for o in objs if o is not None]


def test_chunks_roll_into_segments_and_readers_see_each_event_once(store: LocalStore) -> None:
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    chunks = COMPACT_FANOUT * COMPACT_FANOUT + 7  # two levels of segments, and some
    for i in range(chunks):
        writer.emit("stream", name="stdout", text=f"line {i}\n")
        assert writer.flush()
    writer.close()
    objs = _stream_objects(store)
    assert len(objs) < 3 * COMPACT_FANOUT, "compaction keeps a stream small"
    assert {o.level for o in objs} >= {0, 2}
    events = EventReader(store).poll()
    assert [e.data["text"] for e in events] == [f"line {i}\n" for i in range(chunks)]
    assert [e.n for e in events] == list(range(chunks))


def test_a_hole_is_read_past_only_when_it_stays_polls_and_seconds(
        store: LocalStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk missing from an attempt's stream is a compaction caught half-way until it
    has stayed for several polls *and* some time (a tight loop of polls is no time for a
    loaded writer); only then is it a chunk lost for good, read past."""
    from spotnb.protocol.events import reader as reader_module

    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    for i in range(4):
        writer.emit("stream", name="stdout", text=f"{i}")
        writer.flush()
    writer.close()
    chunks = sorted(k for k in store.list_keys("events/") if StreamObject.parse(k))
    assert len(chunks) == 4
    store.delete(chunks[2])  # lost for good
    reader = EventReader(store)
    seen = [int(e.data["text"]) for _ in range(20) for e in reader.poll()]
    assert seen == [0, 1], "a tight loop of polls read past the hole"
    monkeypatch.setattr(reader_module, "_HOLE_SECONDS", 0.0)
    seen += [int(e.data["text"]) for _ in range(5) for e in reader.poll()]
    assert seen == [0, 1, 3]


def test_a_reader_in_the_middle_of_compactions_misses_and_repeats_nothing(
        store: LocalStore) -> None:
    total = COMPACT_FANOUT * 20
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    done = threading.Event()

    def write() -> None:
        for i in range(total):
            writer.emit("stream", name="stdout", text=f"{i}")
            writer.flush()
        done.set()

    reader = EventReader(store)
    seen: list[int] = []
    thread = threading.Thread(target=write)
    thread.start()
    while not done.is_set():
        seen += [int(e.data["text"]) for e in reader.poll()]
    thread.join()
    seen += [int(e.data["text"]) for e in reader.poll()]
    writer.close()
    assert seen == list(range(total))


def test_a_restarted_writer_continues_numbers_and_cleans_an_interrupted_compaction(
        store: LocalStore) -> None:
    first = EventWriter(store, 1, "i-1", flush_seconds=3600, compact=False)
    for i in range(COMPACT_FANOUT + 2):
        first.emit("stream", name="stdout", text=str(i))
        first.flush()
    first.close()
    # A compaction that wrote its segment but died before deleting the chunks.
    objs = _stream_objects(store)
    import gzip

    body = b"".join(store.get(o.key) for o in objs[:COMPACT_FANOUT])
    store.put(f"events/000001/{COMPACT_FANOUT - 1:08d}.00000000.L1.jsonl.gz",
              gzip.compress(body))
    assert EventReader(store).poll()[-1].n == COMPACT_FANOUT + 1  # no duplicate
    second = EventWriter(store, 1, "i-1", flush_seconds=3600)
    second.emit("stream", name="stdout", text="after")
    second.close()
    events = EventReader(store).poll()
    assert [e.n for e in events] == list(range(COMPACT_FANOUT + 3))
    assert len(_stream_objects(store)) == 4  # the segment, 2 chunks, the new one


def test_the_group_stream_keeps_every_writer_s_events(store: LocalStore) -> None:
    # Several processes write the group's stream (supervisor, instance agents, the
    # notebook's capacity watch): nothing may be taken for a duplicate.
    writers = [EventWriter(store, 0, f"i-{k}", flush_seconds=3600) for k in range(3)]
    for round_ in range(5):
        for k, w in enumerate(writers):
            w.emit("instance", action="launched", instance_id=f"i-{k}-{round_}")
            w.flush()
    for w in writers:
        w.close()
    ids = sorted(e.data["instance_id"] for e in EventReader(store).poll())
    assert ids == sorted(f"i-{k}-{r}" for k in range(3) for r in range(5))


def test_metric_batches_round_trip_with_sparse_metrics(store: LocalStore) -> None:
    rows = [(0, 1.0, {"loss": 2.0}), (1, 1.1, {"loss": 1.5, "acc": 0.25}),
            (2, 1.2, {"loss": float("nan")}), (3, 1.3, {"lr": 0.1, "loss": 1.0})]
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    writer.emit_metrics(rows)
    writer.close()
    (batch,) = EventReader(store, batches=True).poll()
    assert batch.type == "metrics"
    got = list(metric_rows(batch))
    assert [r[0] for r in got] == [0, 1, 2, 3] and got[1][2] == {"loss": 1.5, "acc": 0.25}
    assert got[2][2]["loss"] != got[2][2]["loss"]  # NaN kept
    assert last_values(batch) == {"loss": 1.0, "acc": 0.25, "lr": 0.1}
    singles = EventReader(store).poll()
    assert [e.type for e in singles] == ["metric"] * 4
    assert [e.to_json() for e in singles] == [e.to_json() for e in expand(batch)]
    assert [e.data["step"] for e in singles] == [0, 1, 2, 3]


def test_last_values_read_from_the_tail_equal_the_whole_columns() -> None:
    # last_values decodes only each column's last bytes: every length, so that the
    # last item falls at each place of a base64 group, and sparse columns.
    for n in range(1, 25):
        rows = [(s, float(s), {"loss": 1.0 / (s + 1), **({"acc": s / 7} if s % 3 == 0 else {})})
                for s in range(n)]
        batch = Event("metrics", 0.0, 1, "i-1", metrics_data(rows))
        want: dict[str, float] = {}
        for _step, _t, values in metric_rows(batch):
            want.update(values)
        assert last_values(batch) == want


def test_queue_messages_pack_small_and_survive_the_trip(tmp_path: Path) -> None:
    queue = LocalQueue(tmp_path / "q")
    queue.create()
    big = {"op": "events", "lines": ["x" * 100] * 200}
    assert len(pack(big)) < 2000 and unpack(pack(big)) == big
    for i in range(5):
        queue.send_message({"op": "n", "i": i})
    assert [m["i"] for m in queue.receive_messages(1.0)] == list(range(5))
    assert queue.receive(0.1) == []


def test_a_follower_gets_each_event_once_live_and_fills_gaps_from_the_log(
        store: LocalStore) -> None:
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    for i in range(5):
        writer.emit("stream", name="stdout", text=f"early {i}")
    writer.flush()  # the log holds events 0..4
    for i in range(5, 8):
        writer.emit("stream", name="stdout", text=f"early {i}")  # 5..7 only queued
    control = queue_for(store, "job-1", "control")
    control.create()
    stops: list[dict[str, object]] = []
    sender = LiveSender(control, stops.append).start()
    sender.attach(writer)
    got: list[Event] = []
    try:
        with Follower(store, "job-1") as follower:
            got += follower.poll(wait=1.0)  # the log, then it registers
            deadline = time.monotonic() + 60
            while len(got) < 8 and time.monotonic() < deadline:
                got += follower.poll(wait=1.0)
            # Live from here: these arrive without any write to the log.
            flushed = writer.written
            for i in range(8, 20):
                writer.emit("stream", name="stdout", text=f"live {i}")
            while len(got) < 20 and time.monotonic() < deadline:
                got += follower.poll(wait=1.0)
            assert writer.written == flushed, "the live events were not written to the log"
            control.send_message({"op": "stop", "reason": "test"})
            while not stops and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        sender.stop()
        writer.close()
    assert [e.n for e in got] == list(range(20))
    assert stops and stops[0]["reason"] == "test"


def test_compaction_rolls_metric_batches_and_readers_still_get_each_row_once(
        store: LocalStore) -> None:
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    reader = EventReader(store)  # reads along the way: some chunks before their merge
    got: list[int] = []
    step = 0
    for chunk in range(COMPACT_FANOUT * 3 + 5):
        for _ in range(4):  # four batches a chunk, with another event between them
            writer.emit_metrics([(step + i, 100.0 + step + i, {"loss": 1.0 / (step + i + 1),
                                                              **({"acc": 0.5} if i == 0
                                                                 else {})})
                                 for i in range(3)])
            step += 3
            writer.emit("sys", kind="cpu", util=1.0)
        writer.flush()
        if chunk % 7 == 3:
            got += [e.data["step"] for e in reader.poll() if e.type == "metric"]
    writer.close()
    got += [e.data["step"] for e in reader.poll() if e.type == "metric"]
    assert got == list(range(step))
    fresh = EventReader(store, batches=True).poll()
    batches = [e for e in fresh if e.type == "metrics"]
    assert len(batches) < 40, "the segments' batches were rolled into one each"
    rows = [r for e in batches for r in metric_rows(e)]
    assert [r[0] for r in rows] == list(range(step))
    assert all(("acc" in r[2]) == (r[0] % 3 == 0) for r in rows)
    assert all(r[2]["loss"] == 1.0 / (r[0] + 1) for r in rows)


def test_the_fold_tells_one_story_and_ignores_types_it_does_not_know(
        store: LocalStore) -> None:
    from spotnb.protocol.events import codec
    from spotnb.protocol.events.fold import EndReason, JobStatus, fold

    t0 = 1_800_000_000.0
    launched = {"action": "launched", "pool": "p@a", "price": 0.36, "ondemand": 1.0}
    events = [
        Event("instance", t0, 0, "i-1", {**launched, "instance_id": "i-1"}),
        Event("status", t0 + 1, 1, "i-1", {"state": "booting", "instance_type": "g5.xlarge"}),
        Event("hologram", t0 + 2, 1, "i-1", {"from": "a newer spotnb"}),
        Event("notice", t0 + 10, 1, "i-1", {"kind": "instance-action"}),
        Event("instance", t0 + 12, 0, "i-2", {**launched, "instance_id": "i-2"}),
        Event("instance", t0 + 20, 0, "i-1", {"action": "terminated", "instance_id": "i-1"}),
        Event("status", t0 + 30, 2, "i-2", {"state": "booting"}),
        Event("result", t0 + 40, 2, "i-2", {"status": "completed"}),
    ]
    # Written and read back: the unknown event survives the log and decodes once.
    writer = EventWriter(store, 1, "i-1", flush_seconds=3600)
    writer.emit_event(events[2])
    writer.close()
    (read,) = EventReader(store).poll()
    assert isinstance(read.body, codec.Unknown) and read.body is read.body
    state = fold(events)
    assert [a.reason for a in state.attempts.values()] == [EndReason.INTERRUPTED,
                                                           EndReason.COMPLETED]
    # The result makes the status final: no later status changes it.
    assert state.status is JobStatus.COMPLETED and state.final and state.result is not None
    assert state.interruptions() == 1
    spot, ondemand = state.cost(t0 + 40)
    assert spot == pytest.approx(0.36 * (20 + 28) / 3600)
    assert ondemand == pytest.approx(1.0 * (20 + 28) / 3600)
    assert fold(e for e in events if e.type != "hologram").cost(t0 + 40) == (spot, ondemand)


@pytest.mark.parametrize(("data", "retrying"), [
    # The agent says it in the field, whatever its words.
    ({"state": "booting", "retrying": True, "detail": "the cell again (1 of 2)"}, True),
    ({"state": "booting", "retrying": False, "detail": "retrying the kernel"}, False),
    ({"state": "booting", "detail": "boot"}, False),
    # A log of spotnb before the field: its agent's words are all it has.
    ({"state": "booting", "detail": "retrying after ValueError (1 of 2)"}, True),
    ({"state": "running", "detail": "retrying the download"}, False),
])
def test_a_status_says_whether_the_same_attempt_boots_again(data: dict[str, object],
                                                             retrying: bool) -> None:
    """Whether a boot is a retry of the attempt after an error is the status event's
    ``retrying`` field, which the agent sets where it decides; older logs without the
    field read as they always did."""
    from spotnb.protocol.events import codec

    body = Event("status", 1_800_000_000.0, 1, "i-1", data).body
    assert isinstance(body, codec.Status) and body.retrying is retrying


@pytest.mark.parametrize("pruned_read_last", [False, True])
def test_a_job_stopped_after_its_pruned_event_is_pruned_whichever_is_read_first(
        pruned_read_last: bool) -> None:
    """A sweep writes ``pruned`` into the group's stream, then stops the job: a reader
    may get the group's stream after the attempt's. Either way the fold's status, its
    outcome with or without result.json, and the summary say pruned, with the step and
    the metric's value; one stopped without a pruned event stays stopped."""
    from spotnb.client.jobs import summarize_state
    from spotnb.protocol.events.fold import JobStatus, fold
    from spotnb.protocol.spec import JobSpec, Policy, Resources

    t0 = 1_800_000_000.0
    pruned = Event("pruned", t0 + 10, 0, None,
                   {"step": 140, "metric": "val_loss", "value": 0.44521, "sweep": "s-1",
                    "trial": 3})
    attempt = [Event("status", t0 + 1, 1, "i-1", {"state": "booting"}),
               Event("result", t0 + 20, 1, "i-1", {"status": "stopped",
                                                  "reason": "stopped by the sweep"})]
    events = [*attempt, pruned] if pruned_read_last else [pruned, *attempt]
    state = fold(events)
    assert state.status is JobStatus.PRUNED and state.final
    assert state.detail == "pruned at step 140 (val_loss 0.4452)"
    assert state.outcome() == ("pruned", "pruned at step 140 (val_loss 0.4452)")
    result_json = {"status": "stopped", "reason": "stopped by the sweep"}
    assert state.outcome(result_json)[0] == "pruned"
    spec = JobSpec(job_id="j-t3", name="t3", code="x", provider="local",
                   resources=Resources(instance_types=("g4dn.xlarge",)), policy=Policy(),
                   store_uri="file:///nowhere", created=t0)
    assert summarize_state(spec, state, result_json).status == "pruned"
    alone = fold(attempt)
    assert alone.status is JobStatus.STOPPED
    assert alone.outcome(result_json) == ("stopped", "stopped by the sweep")


@pytest.mark.parametrize(("reason", "minutes", "scale", "billed"), [
    ("spot-interruption", 59, 1.0, False),  # EC2 took it in its first hour: free
    ("spot-interruption", 61, 1.0, True),  # after its first hour: its seconds
    ("rebalanced", 30, 1.0, True),  # Auto Scaling (for us) ended it: its seconds
    ("job-finished", 30, 1.0, True),
    ("spot-interruption", 2, 60.0, True),  # 2 real minutes at 60x: 2 market hours
    ("spot-interruption", 0.5, 60.0, False),  # 30 market minutes
])
def test_an_instance_ec2_interrupts_in_its_first_hour_costs_nothing(
        reason: str, minutes: float, scale: float, billed: bool) -> None:
    """AWS's rule ("Billing for interrupted Spot Instances"): every view of the cost
    reads it from the fold; the time the interruption took (cost_between) too."""
    from spotnb.protocol.events.fold import fold

    t0, end = 1_800_000_000.0, 1_800_000_000.0 + 60 * minutes
    launched = {"action": "launched", "pool": "p@a", "price": 0.36, "ondemand": 1.0,
                "time_scale": scale}
    events = [
        Event("instance", t0, 0, "i-1", {**launched, "instance_id": "i-1"}),
        Event("instance", end, 0, "i-1", {"action": "terminated", "instance_id": "i-1",
                                          "reason": reason}),
    ]
    state = fold(events)
    full = 0.36 * (end - t0) / 3600
    spot, ondemand = state.cost(end + 100)
    assert spot == pytest.approx(full if billed else 0.0)
    assert ondemand == pytest.approx(1.0 * (end - t0) / 3600)  # on demand: always billed
    assert state.instance_cost("i-1") == pytest.approx(spot)
    assert state.cost_between(t0, end) == pytest.approx(spot)
    assert [i.instance_id for i in state.refunded()] == ([] if billed else ["i-1"])
    # While it runs, it bills: only its end says whether AWS refunds it.
    assert fold(events[:1]).cost(end)[0] == pytest.approx(full)


def test_the_fold_says_where_each_attempt_ran_why_it_moved_and_what_moving_cost(
        store: LocalStore) -> None:
    """A job that started in us-west-2 (home us-east-1 had no capacity) and moved back:
    each attempt's region, the choice before it (start, move), and the checkpoint's
    crossings summed once each into the cost (a transfer written twice, by a supervisor
    and by the one that took over from it, counts once)."""
    from spotnb.protocol.events import codec
    from spotnb.protocol.events.fold import fold

    t0 = 1_800_000_000.0
    launched = {"action": "launched", "pool": "p@a", "price": 0.36, "ondemand": 1.0}
    save = {"kind": "save", "bytes": 2 * 10**9, "source": "us-west-2",
            "destination": "us-east-1", "usd_per_gb": 0.02, "usd": 0.04,
            "key": "save:1:c1", "step": 10}
    events = [
        Event("region", t0, 0, None, {"region": "us-west-2", "cause": "start",
                                      "reason": "us-east-1 has none", "home": "us-east-1"}),
        Event("instance", t0, 0, "i-1", {**launched, "instance_id": "i-1",
                                         "region": "us-west-2"}),
        Event("status", t0 + 1, 1, "i-1", {"state": "booting", "region": "us-west-2"}),
        Event("transfer", t0 + 5, 0, None, save),
        Event("transfer", t0 + 5, 0, None, save),
        Event("region", t0 + 20, 0, None, {
            "region": "us-east-1", "previous": "us-west-2", "cause": "no-capacity",
            "reason": "no capacity in us-west-2 for g5.xlarge after 3 tries",
            "home": "us-east-1", "tries": 3}),
        Event("instance", t0 + 21, 0, "i-2", {**launched, "instance_id": "i-2",
                                              "region": "us-east-1"}),
        Event("status", t0 + 22, 2, "i-2", {"state": "booting"}),  # its launch says where
        Event("status", t0 + 23, 3, "i-2", {"state": "booting", "region": "us-east-1"}),
    ]
    state = fold(events)
    assert [state.attempts[n].region for n in (1, 2, 3)] == [
        "us-west-2", "us-east-1", "us-east-1"]
    first, second = state.region_choice(1), state.region_choice(2)
    assert first is not None and first.cause == "start" and not first.moved
    assert second is not None and second.moved and second.previous == "us-west-2"
    assert second.reason == "no capacity in us-west-2 for g5.xlarge after 3 tries"
    assert state.region_choice(3) is None  # it runs where attempt 2 ran
    assert isinstance(events[3].body, codec.Transfer) and events[3].body.bytes == 2 * 10**9
    assert state.transfer_usd() == pytest.approx(0.04)
    end = t0 + 30
    assert state.cost_usd(end) == pytest.approx(state.cost(end)[0] + 0.04)
    # The money as heard (a sweep's trials', a comparison's running jobs') counts it too.
    assert state.cost_heard_usd()[0] == pytest.approx(state.cost_heard()[0] + 0.04)
