"""A job across regions on the local cloud: it starts where its expected cost is lowest
among the regions with capacity, moves to the next region after repeated capacity
failures (resuming from its checkpoint, bitwise), keeps a multi-node job's nodes in one
region and AZ, bills the checkpoint's crossings between regions, and says where each
attempt ran and why it moved. Real supervisors and instances (the stand-in agent of
tests/local_cloud_agent.py, or the real agent and kernel); every wait is on an event."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import run_uninterrupted, wait_until
from test_engine import TORCH_TRAINING, wait_no_processes
from test_local_cloud import Cloud, group_events, launched, local_cloud

import spotnb
from spotnb.client import display
from spotnb.client.listing import format_event
from spotnb.protocol.events import Event, codec
from spotnb.protocol.events.fold import fold
from spotnb.protocol.spec import JobSpec, Policy, Resources, SpecError
from spotnb.protocol.store import LocalStore
from spotnb.providers.failover import MOVE_AFTER_FAILED_ROUNDS
from spotnb.providers.regions import transfer_price

HOME, OTHER = "us-east-1", "us-west-2"


@pytest.fixture
def cloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          private_tmpdir: Path) -> Iterator[Cloud]:
    yield from local_cloud(tmp_path, monkeypatch)


def regional_spec(cloud: Cloud, job_id: str, regions: tuple[str, ...] = (HOME, OTHER),
                  types: tuple[str, ...] = ("g4dn.xlarge",), nodes: int = 1) -> JobSpec:
    store = LocalStore(cloud.root / "store" / "jobs" / job_id)
    resources = Resources(types, regions[0], min_nodes=nodes, max_nodes=nodes,
                          regions=regions)
    return JobSpec(job_id=job_id, name="test", code="pass", provider="local",
                   resources=resources, policy=Policy(), store_uri=store.uri,
                   created=time.time())


def config(cloud: Cloud, **settings: Any) -> None:
    """The local cloud's settings file, which each launch reads again."""
    path = cloud.home / "cloud" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings))
    tmp.replace(path)


def test_the_plan_ranks_moves_after_the_bound_and_cycles_through_dry_regions() -> None:
    """RegionPlan, scripted: capacity by region as a test sets it, no process."""
    from spotnb.providers import catalog
    from spotnb.providers.failover import RegionPlan

    short: set[str] = {HOME}
    store = "file:///nowhere"
    spec = JobSpec(job_id="j", name="t", code="pass", provider="local", store_uri=store,
                   resources=Resources(("g4dn.xlarge",), HOME,
                                       regions=(HOME, OTHER, "eu-west-1")),
                   policy=Policy(), created=0.0)
    plan = RegionPlan(spec, lambda t, az: catalog.region_of(az) not in short)
    start = plan.start(None)
    assert start.region == OTHER and start.cause == "start" and plan.region == OTHER
    assert start.reason.endswith(f"{HOME} has none for g4dn.xlarge (placement score 1)")
    assert [plan.failed() for _ in range(MOVE_AFTER_FAILED_ROUNDS)] == [
        False] * (MOVE_AFTER_FAILED_ROUNDS - 1) + [True]
    short.add(OTHER)
    move = plan.move(10**8)
    assert move is not None and (move.previous, move.region) == (OTHER, "eu-west-1")
    assert move.tries == MOVE_AFTER_FAILED_ROUNDS and plan.failed_rounds == 0
    # eu-west-1 runs dry too: home, the one region not left yet (its capacity is back).
    short = {"eu-west-1"}
    again = plan.move(10**8)
    assert again is not None and again.region == HOME
    # And home again: every region has been left, so all are open again, the best
    # first (us-west-2, cheaper than eu-west-1), but not the one just left.
    short = {HOME}
    cycled = plan.move(10**8)
    assert cycled is not None and cycled.region == OTHER and plan.dry == {HOME}
    # A new owner (a restarted supervisor, a notebook attached to an AWS job) resumes
    # from the choices in the log as the plan that made them stands after each.
    choices = [start, move, again, cycled]
    for seen in range(1, len(choices) + 1):
        resumed = RegionPlan(spec, lambda t, az: True)
        resumed.resume(choices[:seen])
        assert resumed.region == choices[seen - 1].region
    assert (resumed.region, resumed.dry, resumed.failed_rounds) == (plan.region, plan.dry, 0)
    halfway = RegionPlan(spec, lambda t, az: True)
    halfway.resume(choices[:3])
    assert halfway.dry == {OTHER, "eu-west-1"}
    assert [p.region for p in plan.pools(lambda p: p.spot or 0.0)] == [OTHER] * len(
        catalog.pools("g4dn.xlarge", OTHER))
    # One region: never a move.
    alone = RegionPlan(JobSpec(job_id="k", name="t", code="pass", provider="local",
                               store_uri=store, resources=Resources(("g4dn.xlarge",), HOME),
                               policy=Policy(), created=0.0), lambda t, az: False)
    alone.start(None)
    assert not any(alone.failed() for _ in range(3 * MOVE_AFTER_FAILED_ROUNDS))


def test_a_job_whose_first_region_has_no_capacity_starts_in_the_second(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    # With capacity everywhere, home: the cheapest once an hour of saves sent home
    # from us-west-2 is counted (g4dn.xlarge is $0.0005/h cheaper there).
    spec = regional_spec(cloud, "job-home")
    cloud.provider.launch(spec)
    assert launched(spec)[0].data["region"] == HOME
    (start,) = group_events(spec, "region")
    assert isinstance(start.body, codec.Region)
    assert (start.body.region, start.body.cause, start.body.previous) == (HOME, "start", None)
    cloud.provider.terminate(spec.job_id)

    # Home has none: the job starts in the second region at once (the placement
    # scores rank home last), without a launch tried at home.
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", HOME)
    spec = regional_spec(cloud, "job-away")
    cloud.provider.launch(spec)
    first = launched(spec)[0]
    assert first.data["region"] == OTHER
    (start,) = group_events(spec, "region")
    assert isinstance(start.body, codec.Region) and start.body.region == OTHER
    assert f"{HOME} has none for g4dn.xlarge (placement score 1)" in start.body.reason
    assert not group_events(spec, "instance", action="capacity_error")
    line = format_event(start)
    assert line is not None and f"region {OTHER}" in line and "placement score 1" in line
    cloud.provider.terminate(spec.job_id)


def test_a_type_offered_outside_home_only_runs_where_it_is_offered(cloud: Cloud) -> None:
    # p3.2xlarge is not offered in us-west-1 (the catalog): home, but no pool there.
    spec = regional_spec(cloud, "job-p3", regions=("us-west-1", OTHER),
                         types=("g4dn.xlarge", "p3.2xlarge"))
    cloud.provider.validate(spec)
    nowhere = regional_spec(cloud, "job-nowhere", regions=("us-west-1", "sa-east-1"),
                            types=("p3.2xlarge",))
    with pytest.raises(SpecError, match=r"p3.2xlarge has no spot pool in any of the "
                                        r"job's regions \(us-west-1, sa-east-1\).*Add one "
                                        r"of them to the job's regions \(--region\)"):
        cloud.provider.validate(nowhere)
    # A type offered only away from home, and home short of the other: it runs there.
    config(cloud, no_capacity=["g4dn.xlarge"])
    cloud.provider.launch(spec)
    first = launched(spec)[0]
    assert (first.data["instance_type"], first.data["region"]) == ("p3.2xlarge", OTHER)
    cloud.provider.terminate(spec.job_id)


def test_a_restarted_supervisor_stays_in_the_region_and_bills_each_save_once(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_CHECKPOINT_AT", "3")  # each attempt saves at its step 3
    config(cloud, no_capacity=[HOME])
    spec = regional_spec(cloud, "job-adopt")
    cloud.provider.launch(spec)
    assert launched(spec)[0].data["region"] == OTHER
    (save,) = wait_until(lambda: group_events(spec, "transfer"), 30, "the save billed")
    assert (save.data["kind"], save.data["source"], save.data["destination"]) == (
        "save", OTHER, HOME)
    group = cloud.provider.group(spec.job_id)
    assert group is not None
    os.kill(group["supervisor"]["pid"], signal.SIGKILL)  # the supervisor dies hard
    wait_until(lambda: not (cloud.provider.group(spec.job_id) or {}).get("alive"), 10,
               "the supervisor to die")
    config(cloud)  # home's capacity is back meanwhile
    assert cloud.provider.ensure_supervised(spec.job_id) is not None
    cloud.provider.interrupt(spec.job_id)
    # The new supervisor goes on where its predecessor launched, not back home, and
    # reads the whole log again without billing a save twice.
    assert launched(spec, 2)[1].data["region"] == OTHER
    keys = wait_until(lambda: [e.data["key"] for e in group_events(spec, "transfer")]
                      if len(group_events(spec, "transfer")) >= 2 else None,
                      30, "the second attempt's save billed")
    assert len(keys) == len(set(keys)) == 2
    cloud.provider.terminate(spec.job_id)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_a_multi_node_job_keeps_its_nodes_in_one_region_and_az_also_after_a_move(
        cloud: Cloud) -> None:
    spec = regional_spec(cloud, "job-2n", nodes=2)
    cloud.provider.launch(spec)
    first = launched(spec, 2)
    assert {(e.data["region"], e.data["az"]) for e in first} == {
        (HOME, first[0].data["az"])}
    # Home runs dry, and EC2 takes one node back: the other cannot train alone (the
    # job needs 2), so after the bound the group moves, noticing the node left there;
    # the new region's nodes launch once it has gone.
    config(cloud, no_capacity=[HOME])
    cloud.provider.interrupt(spec.job_id, first[0].data["instance_id"])
    moves = wait_until(lambda: [e for e in group_events(spec, "region")
                                if isinstance(e.body, codec.Region) and e.body.moved],
                       60, "the move to the next region")
    move = moves[0].body
    assert isinstance(move, codec.Region)
    assert (move.previous, move.region, move.tries) == (HOME, OTHER, MOVE_AFTER_FAILED_ROUNDS)
    assert move.reason == (f"no capacity in {HOME} for g4dn.xlarge after "
                           f"{MOVE_AFTER_FAILED_ROUNDS} tries")
    after = launched(spec, 4)[2:]
    assert {(e.data["region"], e.data["az"]) for e in after} == {(OTHER, after[0].data["az"])}
    left = group_events(spec, "instance", action="notice", reason="region-move")
    assert [e.data["instance_id"] for e in left] == [first[1].data["instance_id"]]
    ended = wait_until(lambda: {e.data["instance_id"]: e for e in
                                group_events(spec, "instance", action="terminated")}
                       if len(group_events(spec, "instance", action="terminated")) >= 2
                       else None, 30, "the first two nodes' end")
    assert ended[first[1].data["instance_id"]].data["reason"] == "region-move"
    cloud.provider.terminate(spec.job_id)
    # Never two regions at once: each node's life from its launch to its end.
    events = group_events(spec, "instance")
    life = {e.data["instance_id"]: [e.time, float("inf"), e.data["region"]]
            for e in events if e.data["action"] == "launched"}
    for e in events:
        if e.data["action"] == "terminated":
            life[e.data["instance_id"]][1] = e.time
    spans = list(life.values())
    assert not [(a, b) for a in spans for b in spans
                if a[2] != b[2] and _overlap((a[0], a[1]), (b[0], b[1]))]


@pytest.mark.slow
def test_a_job_whose_region_runs_dry_moves_and_ends_bitwise(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The real agent and kernel: home runs dry mid-run and EC2 takes the instance
    back; after the bound the job moves to the next region, restores its checkpoint
    from the home store there, and ends with the weights of a run never interrupted.
    Each crossing of the checkpoint is billed in the job's cost, and every view says
    where each attempt ran and why the job moved."""
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    inputs = {"STEPS": 120, "STEP_SECONDS": 0.03}
    baseline: dict[str, Any] = {}
    uninterrupted = threading.Thread(target=lambda: baseline.update(run_uninterrupted(
        TORCH_TRAINING, {**inputs, "STEP_SECONDS": 0}, ["digest"], tmp_path)))
    uninterrupted.start()

    handle = spotnb.submit(TORCH_TRAINING, instance_types=["g4dn.xlarge"], inputs=inputs,
                           outputs=["digest"], checkpoint_every="20 steps",
                           region=[HOME, OTHER], name="failover")
    asked = False
    seen: list[Event] = []
    for event in handle.events(timeout=240):
        seen.append(event)
        body = codec.peek(event)
        if not asked and isinstance(body, codec.CheckpointEvent) and body.durable:
            asked = True  # home runs dry, and EC2 takes the instance back
            path = spotnb_home / "cloud" / "config.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"no_capacity": [HOME]}))
            handle.interrupt()
    result = handle.wait(timeout=60)
    uninterrupted.join(timeout=300)
    assert baseline, "the uninterrupted run failed (see the output)"
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs["digest"] == baseline["digest"]  # bitwise

    state = fold(handle.events(follow=False))
    assert [state.attempts[n].region for n in sorted(state.attempts)] == [HOME, OTHER]
    move = state.region_choice(2)
    assert move is not None and move.moved and move.previous == HOME
    assert move.reason == (f"no capacity in {HOME} for g4dn.xlarge after "
                           f"{MOVE_AFTER_FAILED_ROUNDS} tries")
    # The crossings: attempt 2 restored the checkpoint from home, and each of its saves
    # went home, at the sending region's price; the cost counts them once each.
    kinds = [t.kind for t in state.transfers.values()]
    assert kinds[0] == "restore" and "save" in kinds and set(kinds) == {"restore", "save"}
    restore = next(t for t in state.transfers.values() if t.kind == "restore")
    assert (restore.source, restore.destination) == (HOME, OTHER)
    assert restore.usd == pytest.approx(restore.bytes / 1e9 * transfer_price(HOME, OTHER))
    saves = [t for t in state.transfers.values() if t.kind == "save"]
    assert all((t.source, t.destination) == (OTHER, HOME) for t in saves)
    assert state.transfer_usd() > 0
    assert result.cost_usd == pytest.approx(state.cost(state.last_time or 0)[0]
                                            + state.requests_usd() + state.transfer_usd())
    # Every view: the attempts of the result and of its record, the log's lines.
    assert [(a.number, a.region) for a in result.attempts] == [(1, HOME), (2, OTHER)]
    assert result.attempts[1].moved == move.reason
    assert result.transfer_usd == pytest.approx(state.transfer_usd())
    (row,) = [r for r in spotnb.jobs() if r.job_id == handle.job_id]
    assert row.instance_type == f"g4dn.xlarge in {OTHER}"  # spotnb jobs
    lines = [line for e in seen if (line := format_event(e))]
    assert any(f"region {OTHER} (from {HOME}): {move.reason}" in line for line in lines)
    view = display.JobView(handle.job_id, "failover", created=time.time())
    said = []
    for event in sorted(handle.events(follow=False), key=lambda e: e.time):
        view.apply(event)
        if (text := display.milestone(event, view)) is not None:
            said.append(text)
    assert f"moving to {OTHER}: {move.reason}; resuming there from the checkpoint in the " \
           f"store in {HOME}" in " ".join(said)
    assert any(text.startswith("attempt 2: resuming on a replacement instance, "
                               "g4dn.xlarge") and f" in {OTHER} (" in text for text in said)
    wait_no_processes(spotnb_home)
