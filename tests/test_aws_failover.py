"""A job across regions on the AWS simulator: it starts where its expected cost is lowest
among the regions with capacity (EC2's Spot placement scores), its group, template and
image are made in the region where it runs and deleted there, while its store stays in
the home region's bucket; cleanup looks in every allowed region. Real agents on
simulated EC2 instances in each region; every wait is on an event."""

from __future__ import annotations

import base64
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import Watch, run_uninterrupted, spot_group, wait_until
from test_aws_provider import EMPTY_ROLE, assert_no_request_refused, assert_nothing_left

import spotnb
from spotnb.protocol.events import codec
from spotnb.providers.aws import AwsProvider
from spotnb.providers.regions import ENV_ALLOWED
from spotnb.testing import AwsSimulator

HOME, OTHER = "us-east-1", "us-west-2"
#: Three types: EC2's placement scores of one or two types are "always low", so only
#: scores of three rank a region without capacity last (spotnb.providers.placement).
TYPES = ["g4dn.xlarge", "g5.xlarge", "g4dn.2xlarge"]


@pytest.fixture
def sim(spotnb_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> Iterator[AwsSimulator]:
    """The simulator in two regions, both allowed; afterwards nothing is left in either
    (``spotnb aws cleanup --dry-run`` looks in every allowed region) and no request was
    refused."""
    monkeypatch.setenv("SPOTNB_AWS_CAPACITY_POLL", "0.5")
    monkeypatch.setenv(ENV_ALLOWED, f"{HOME},{OTHER}")
    with AwsSimulator(tmp_path / "sim", regions=(HOME, OTHER)) as simulator:
        yield simulator
        try:
            assert_nothing_left(simulator)
            assert everything(simulator) == {r: NOTHING for r in (HOME, OTHER)}
            # Every S3 client asked the bucket's own region (S3 refuses another's, and
            # botocore's redirect costs a request per client).
            assert simulator.server.s3_wrong_region == []
        finally:
            assert_no_request_refused(simulator)


NOTHING: dict[str, list[str]] = {"groups": [], "templates": [], "instances": [],
                                 "queues": [], "security groups": []}


def everything(simulator: AwsSimulator) -> dict[str, dict[str, list[str]]]:
    """Every job resource in each region: groups, templates, live instances, queues,
    and security groups spotnb made (the shared no-inbound one is kept, as in one
    region)."""
    found = {}
    for region in simulator.regions:
        asg, ec2, sqs = (simulator.admin_client(s, region)
                         for s in ("autoscaling", "ec2", "sqs"))
        found[region] = {
            "groups": [g["AutoScalingGroupName"] for g in
                       asg.describe_auto_scaling_groups()["AutoScalingGroups"]],
            "templates": [t["LaunchTemplateName"] for t in
                          ec2.describe_launch_templates()["LaunchTemplates"]],
            "instances": [i["InstanceId"] for r in ec2.describe_instances(Filters=[
                {"Name": "instance-state-name", "Values": ["pending", "running"]}])[
                "Reservations"] for i in r["Instances"]],
            "queues": sqs.list_queues(QueueNamePrefix="spotnb-").get("QueueUrls", []),
            "security groups": [g["GroupName"] for g in ec2.describe_security_groups(
                Filters=[{"Name": "tag-key", "Values": ["spotnb:job-id"]}])[
                "SecurityGroups"]],
        }
    return found


def group_bodies(handle: spotnb.JobHandle, kind: type) -> list[Any]:
    return [e.body for e in handle.events(follow=False)
            if e.attempt == 0 and isinstance(e.body, kind)]


GATED = """
import os, time
while not os.path.exists({gate!r}):
    time.sleep(0.1)
x = 6 * 7
"""


def test_a_job_whose_first_region_has_no_capacity_starts_in_the_second(
        sim: AwsSimulator, tmp_path: Path) -> None:
    sim.no_capacity(HOME)  # every type, every AZ of home
    gate = tmp_path / "gate"
    handle = spotnb.submit(GATED.format(gate=str(gate)), provider="aws", outputs=["x"],
                           instance_types=TYPES, region=[HOME, OTHER])
    job = handle.job_id
    # The store stays home, in home's default bucket.
    assert handle.store.uri == f"s3://spotnb-123456789012-{HOME}/jobs/{job}"
    inst = sim.wait_for_instance(job)
    assert inst.region == OTHER
    # Made where it runs: the group, and the template with the region's own image (its
    # own public parameter's); nothing of the job's capacity at home.
    ec2 = sim.admin_client("ec2", OTHER)
    data = ec2.describe_launch_template_versions(
        LaunchTemplateName=f"spotnb-{job}")["LaunchTemplateVersions"][0]["LaunchTemplateData"]
    assert data["ImageId"] == sim.images[OTHER] != sim.images[HOME]
    assert b"SPOTNB_STORE_REGION" in base64.b64decode(data["UserData"])
    assert sim.admin_client("autoscaling", OTHER).describe_auto_scaling_groups(
        AutoScalingGroupNames=[f"spotnb-{job}"])["AutoScalingGroups"]
    assert everything(sim)[HOME]["groups"] == []
    # %spot_interrupt reaches it there (FIS in its region); its replacement runs there
    # too (a job stays in its region while it finds capacity there).
    handle.interrupt()
    wait_until(lambda: inst.terminated, 60, "the interrupted instance's end")
    assert sim.wait_for_instance(job, timeout=60, exclude=(inst.id,)).region == OTHER
    gate.touch()
    result = handle.wait(timeout=90)
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs == {"x": 42}
    assert {a.region for a in result.attempts} == {OTHER}
    # Why it runs there: the launch's ranking, EC2's placement scores putting home last;
    # no launch was tried at home (no capacity error).
    (start,) = group_bodies(handle, codec.Region)
    assert (start.region, start.cause, start.previous, start.home) == (
        OTHER, "start", None, HOME)
    assert f"{HOME} has none for {', '.join(TYPES)} (placement score 1)" in start.reason
    assert not [b for b in group_bodies(handle, codec.Instance)
                if b.action == "capacity_error"]
    # The queues stay home with the store (its followers find them there).
    assert not everything(sim)[OTHER]["queues"]


def test_with_capacity_everywhere_a_job_runs_at_home(sim: AwsSimulator) -> None:
    handle = spotnb.submit("x = 1", provider="aws", outputs=["x"], instance_types=TYPES,
                           region=[HOME, OTHER])
    result = handle.wait(timeout=90)
    assert result.status == "completed", (result.reason, result.error)
    assert [a.region for a in result.attempts] == [HOME]
    (start,) = group_bodies(handle, codec.Region)
    assert (start.region, start.cause) == (HOME, "start")
    assert AwsProvider().regions()[:2] == [HOME, OTHER]


# Deterministic work: a hash chain over the global RNG (which every checkpoint holds),
# a save every 5 steps; at step 30 it waits for the gate, which the test opens once it
# has seen what it waits for.
HELD = """
import hashlib, os, random, time
random.seed(7)
state = {{"h": "0"}}
ckpt = spot.Checkpoint(state=state)
for step in range(ckpt.restore(), 60):
    state["h"] = hashlib.sha256((state["h"] + repr(random.random())).encode()).hexdigest()
    spot.log(step, loss=1.0 / (step + 1))
    time.sleep(0.02)
    ckpt.maybe_save(step)
    while step == 30 and not os.path.exists({gate!r}):
        time.sleep(0.05)
digest = state["h"]
"""


def test_a_job_whose_region_runs_dry_mid_run_moves_and_ends_bitwise(
        sim: AwsSimulator, tmp_path: Path) -> None:
    """Home runs dry mid-run after the launching notebook closed: with no notebook open,
    the account's mover (a Lambda function that EventBridge invokes on the group's
    failed launches, run from its zip by the simulator) moves the job once its rounds
    at home failed; it resumes in the other region from the checkpoint at home, and a
    notebook that attaches later gets the uninterrupted run's result, its crossings
    billed."""
    import json

    from spotnb.protocol import layout
    from spotnb.protocol.events.fold import fold
    from spotnb.providers import failover
    from spotnb.providers.aws import mover, stop_capacity_watches
    from spotnb.providers.aws.capacity import MOVE_AFTER_FAILED_ROUNDS, watching

    assert MOVE_AFTER_FAILED_ROUNDS == failover.MOVE_AFTER_FAILED_ROUNDS  # one rule
    open_gate = tmp_path / "open"
    open_gate.touch()
    expected = run_uninterrupted(HELD.format(gate=str(open_gate)), {}, ["digest"], tmp_path)

    gate = tmp_path / "gate"
    handle = spotnb.submit(HELD.format(gate=str(gate)), provider="aws", outputs=["digest"],
                           instance_types=TYPES, checkpoint_every="5 steps",
                           region=[HOME, OTHER])
    job = handle.job_id
    first = sim.wait_for_instance(job)
    assert first.region == HOME
    # The launch deployed the mover in both regions (its code: this spotnb's).
    for region in (HOME, OTHER):
        assert mover.problem(handle.provider, region) is None
    # Held at step 30, its save of step 29 durable: the launching notebook closes, home
    # runs dry, and EC2 takes the instance back.
    for event in handle.events(timeout=120):
        body = event.body
        if isinstance(body, codec.CheckpointEvent) and body.durable and body.step >= 29:
            break
    stop_capacity_watches()
    assert not watching(job)
    sim.no_capacity(HOME)
    sim.interrupt(first.id)
    # Nobody follows the job: its group fails round after round at home, and the
    # mover moves it.
    second = sim.wait_for_instance(job, timeout=180, exclude=(first.id,))
    assert second.region == OTHER
    assert not watching(job), "no notebook's watch moved it"
    claims = [json.loads(handle.store.get(key)) for key in
              handle.store.list_keys(layout.REGION_MOVES)]
    assert [c["owner"].startswith("mover-") for c in claims] == [True]
    assert everything(sim)[HOME]["groups"] == []
    # A notebook attaches, later.
    attached = spotnb.attach(job)
    gate.touch()
    result = attached.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs["digest"] == expected["digest"], "bitwise the uninterrupted run's"
    assert [a.region for a in result.attempts] == [HOME, OTHER]
    # Why: the start, then one move, after the bound of rounds without capacity at home.
    start, move = group_bodies(attached, codec.Region)
    assert (start.region, start.cause) == (HOME, "start")
    assert (move.previous, move.region, move.cause, move.home) == (
        HOME, OTHER, "no-capacity", HOME)
    assert move.tries >= MOVE_AFTER_FAILED_ROUNDS
    assert move.reason.startswith(f"no capacity in {HOME} for ")
    # The checkpoint crossed regions: restored from home once, each save after sent
    # home, with the measured bytes; the job's cost counts them.
    transfers = group_bodies(attached, codec.Transfer)
    restores = [t for t in transfers if t.kind == "restore"]
    saves = [t for t in transfers if t.kind == "save"]
    assert len(restores) == 1 and (restores[0].source, restores[0].destination) == (
        HOME, OTHER) and restores[0].bytes > 0
    assert saves and all((t.source, t.destination) == (OTHER, HOME) and t.bytes > 0
                         for t in saves)
    assert len({t.key for t in transfers}) == len(transfers), "each crossing once"
    state = fold(list(attached.events(follow=False)))
    billed = sum(t.usd for t in transfers)
    assert billed > 0 and state.transfer_usd() == pytest.approx(billed)


def test_a_multi_node_job_keeps_its_nodes_in_one_region_and_az(sim: AwsSimulator) -> None:
    sim.no_capacity(HOME)
    handle = spotnb.submit("import os\nrank = int(os.environ.get('RANK', '0'))",
                           provider="aws", instance_types=TYPES, region=[HOME, OTHER],
                           nodes=2)
    job = handle.job_id
    result = handle.wait(timeout=180)
    assert result.status == "completed", (result.reason, result.error)
    nodes = [i for i in sim.instances.values() if i.job_id == job]
    assert len(nodes) == 2
    assert {(i.region, i.az_id) for i in nodes} == {(OTHER, nodes[0].az_id)}
    assert {i.placement_group for i in nodes} == {f"spotnb-{job}"}
    assert sim.placement_groups_in[HOME] == {}
    # The end: AWS keeps a placement or security group while an instance is still in
    # it, and IAM may refuse a role's deletion by itself: what the teardown could not
    # delete yet is all cleanup may find, where the job ran, and deletes.
    sim.wait_until_idle(60)
    left = AwsProvider().cleanup()
    assert all((re.fullmatch(rf"deleted (security group spotnb-\S+ \(sg-\w+\)|placement "
                             rf"group spotnb-\S+) in {OTHER} \(its job has a result\)", line)
                or EMPTY_ROLE.fullmatch(line)) and job in line for line in left), left
    assert sim.placement_groups_in == {HOME: {}, OTHER: {}}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
def test_a_multi_node_job_moves_mid_run_once_its_node_left_at_home_saved_and_went(
        sim: AwsSimulator, tmp_path: Path, standby: bool) -> None:
    """Two nodes (its minimum is its size) of seeded DDP code train at home; home runs
    dry and EC2 takes one node back: every rank saves at the notice, that node goes,
    and the job cannot train (one node of two). After the bound of failed rounds it
    moves: the node left at home gets its notice first (Auto Scaling ends it through
    its group's termination hook, a ``region-move``: a group with warm standbys has
    the hook, one without gets it for the move), gives up its node slot with nothing
    to save (it was not training) and goes; only then do the other region's two nodes
    launch, in one AZ. The job ends with the uninterrupted run's weights, bitwise
    (every round had both nodes), no step redone, one save forced (the
    interruption's); nothing is left in either region (the fixture)."""
    torch = pytest.importorskip("torch")
    from test_multinode import DDP_TRAINING, Uninterrupted

    from spotnb.kernel_remote.multinode import rendezvous as rdzv
    from spotnb.protocol.events.fold import fold
    from spotnb.providers.failover import REGION_MOVE

    sim.notice_seconds = 20.0  # EC2's two minutes: time for the coordinated checkpoint
    go = tmp_path / "go"
    reference = Uninterrupted(DDP_TRAINING, {"STEPS": 16, "PAUSE_AT": -1, "GO": ""}, 2,
                              tmp_path)
    handle = spotnb.submit(DDP_TRAINING, inputs={"STEPS": 16, "PAUSE_AT": 8, "GO": str(go)},
                           provider="aws", nodes=2, instance_types=TYPES,
                           region=[HOME, OTHER], outputs=["weights"],
                           checkpoint_every="4 steps", standby=standby)
    job = handle.job_id
    nodes = wait_until(lambda: len(sim.running(job)) == 2 and sim.running(job), 240,
                       "two nodes at home")
    assert {n.region for n in nodes} == {HOME}

    def said(events: list[Any], instance: str, words: str) -> list[Any]:
        return [e for e in events if e.instance == instance and e.type == "status"
                and words in str(e.data.get("detail"))]

    with Watch(handle) as watch:  # live: unwatched, the log has the steps once a minute
        watch.until(lambda _: 8 in watch.steps(), 240, "training to reach the gate (step 8)")
        record = rdzv.read(handle.store)
        assert record is not None
        staying = sim.instances[record[0].host]  # it hosts the rendezvous
        (leaving,) = [n for n in nodes if n.id != staying.id]
        sim.no_capacity(HOME)
        sim.interrupt(leaving.id)
        watch.until(lambda events: said(events, leaving.id, "interruption notice"), 240,
                    "the interrupted node's agent to see its notice")
        go.write_text("go")
        watch.until(lambda events: said(events, leaving.id, "final checkpoint at step 8"),
                    240, "the interrupted node's save at the notice")
    sim.take_back(leaving.id)  # its save is durable: the rest of its notice is no matter
    result = handle.wait(timeout=480)
    assert result.status == "completed", (result.reason, result.error)
    events = list(handle.events(follow=False))
    state = fold(events, 2)
    # Bitwise the uninterrupted run's weights (min nodes = max: every round had both).
    assert {e.data["world_size"] for e in events if e.type == "world"} == {2}
    assert all(torch.equal(a, b) for a, b in zip(
        result.outputs["weights"], reference.weights(), strict=True))
    forced = [e.data["step"] for e in events if e.type == "checkpoint"
              and e.data.get("phase") == "durable" and e.data.get("forced")]
    assert forced == [8], "one save forced: the interruption's; none for the move"
    assert state.redone_steps() == 0
    # The move: after the bound of failed rounds at home, to the other region, where
    # both nodes ran in one AZ.
    start, move = group_bodies(handle, codec.Region)
    assert (start.region, move.previous, move.region, move.cause) == (
        HOME, HOME, OTHER, "no-capacity")
    assert [a.region for a in result.attempts] == [HOME, HOME, OTHER, OTHER]
    away = [i for i in sim.instances.values() if i.job_id == job and i.region == OTHER]
    assert len(away) == 2 and len({i.az_id for i in away}) == 1
    # The node left at home had its notice (the group's, and its agent's word of where
    # the job goes), ended as an interruption, not lost; the other region's nodes
    # booted only once both nodes at home were gone: never two regions at once.
    assert (staying.id, REGION_MOVE) in state.group_notices
    assert said(events, staying.id, f"the job moves to {OTHER}")
    (mine,) = [n for n, a in state.attempts.items() if a.instance_id == staying.id]
    assert state.end_reason(mine) == "interrupted"
    assert state.instances[staying.id].end_reason == REGION_MOVE
    home = [i for i in sim.instances.values() if i.job_id == job and i.region == HOME]
    assert sorted(i.id for i in home) == sorted(n.id for n in nodes), "no launch at home"
    ends = [i.ended for i in home]
    assert None not in ends and max(e for e in ends if e is not None) <= min(
        i.booted for i in away)
    # The end: nothing of the job at home (the move deleted it); where it ended, only
    # what AWS keeps while an instance is in it (and the role IAM may not let delete
    # itself), which cleanup deletes.
    sim.wait_until_idle(60)
    left = AwsProvider().cleanup()
    assert all((re.fullmatch(rf"deleted (security group spotnb-\S+ \(sg-\w+\)|placement "
                             rf"group spotnb-\S+) in {OTHER} \(its job has a result\)", line)
                or EMPTY_ROLE.fullmatch(line)) and job in line for line in left), left


class NotebookClosed(BaseException):
    """The notebook's process ends in the middle of a move."""


def test_a_move_its_notebook_left_half_done_is_finished_by_the_next_that_attaches(
        sim: AwsSimulator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A move's notebook closes after the node it leaves went, before the new region's
    group (made with no instance) was told to launch: the job has no instance
    anywhere. The next notebook that attaches finishes the move: the new group
    launches, the old one is deleted, and the job ends there."""
    import dataclasses

    from spotnb.protocol.events import GROUP_STREAM, EventWriter
    from spotnb.providers.aws import stop_capacity_watches

    gate = tmp_path / "gate"
    handle = spotnb.submit(GATED.format(gate=str(gate)), provider="aws", outputs=["x"],
                           instance_types=TYPES, region=[HOME, OTHER])
    job = handle.job_id
    first = sim.wait_for_instance(job)
    assert first.region == HOME
    home_asg = sim.admin_client("autoscaling", HOME)
    wait_until(lambda: [i for g in home_asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=[f"spotnb-{job}"])["AutoScalingGroups"]
        for i in g["Instances"] if i["LifecycleState"] == "InService"], 60,
        "its instance in service (its launch hook completed)")
    stop_capacity_watches()  # the notebook moves it by hand below, its watch aside
    provider = handle.provider
    assert isinstance(provider, AwsProvider)
    plan = provider._plans[job]
    choice = plan.move(None)
    assert choice is not None and choice.region == OTHER

    def tell() -> None:
        writer = EventWriter(handle.store, GROUP_STREAM)
        writer.emit("region", **dataclasses.asdict(choice))
        writer.close()

    def closes(*_args: Any) -> None:
        raise NotebookClosed()

    with monkeypatch.context() as patched, pytest.raises(NotebookClosed):
        patched.setattr(AwsProvider, "_release_group", closes)
        provider.move_region(handle.spec, OTHER, nodes=[first.id], tell=tell)
    wait_until(lambda: first.terminated, 60, "the node left at home to go")
    asg = sim.admin_client("autoscaling", OTHER)
    (held,) = asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=[f"spotnb-{job}"])["AutoScalingGroups"]
    assert (held["MinSize"], held["DesiredCapacity"], held["Instances"]) == (0, 0, [])
    attached = spotnb.attach(job)
    second = sim.wait_for_instance(job, timeout=120, exclude=(first.id,))
    assert second.region == OTHER
    gate.touch()
    result = attached.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    assert result.outputs == {"x": 42}
    assert everything(sim)[HOME]["groups"] == []


def test_a_move_is_claimed_by_one_owner_and_a_stale_claim_is_taken_over(
        tmp_path: Path) -> None:
    """Two notebooks watching one job: only the one whose conditional write made the
    claim moves it (a write whose answer was lost is recognised as its own); a claim
    whose move never came (its notebook closed) is another's after MOVE_CLAIM_SECONDS."""
    import json

    from spotnb.protocol import layout
    from spotnb.protocol.store import LocalStore
    from spotnb.providers.aws.capacity import MOVE_CLAIM_SECONDS, claim_move

    store = LocalStore(tmp_path / "job")
    assert claim_move(store, 1, "a")
    assert not claim_move(store, 1, "b")
    assert claim_move(store, 1, "a"), "its own claim (a retried write) is still its own"
    assert claim_move(store, 2, "b"), "the next move is a new claim"
    store.put(f"{layout.REGION_MOVES}3.json", json.dumps(
        {"owner": "a", "time": time.time() - MOVE_CLAIM_SECONDS - 1}).encode())
    assert claim_move(store, 3, "b"), "a stale claim is taken over"
    assert not claim_move(store, 3, "a")


def test_a_group_left_after_its_jobs_end_is_deleted_by_the_mover_at_its_failed_launch(
        sim: AwsSimulator) -> None:
    """A job's group that outlived the job (a move cut short between the new group's
    making and the old one's deletion leaves one) would launch a billed instance for
    nothing once capacity comes back: its next failed launch invokes the mover, which
    deletes it with its template."""
    from spotnb.providers.aws import mover
    from spotnb.providers.aws.resources import TAG_JOB, TAG_STORE

    handle = spotnb.submit("x = 6 * 7", provider="aws", outputs=["x"],
                           instance_types=TYPES, region=[HOME, OTHER])
    job = handle.job_id
    result = handle.wait(timeout=120)
    assert result.status == "completed", (result.reason, result.error)
    wait_until(lambda: not everything(sim)[HOME]["groups"], 60, "its instance's teardown")
    # The leftover, where there is no capacity: made as the launch makes it.
    sim.no_capacity(HOME)
    spot_group(sim, f"spotnb-{job}", TYPES, desired=1, min_size=1, subnets=None,
               tags={TAG_JOB: job, TAG_STORE: handle.spec.store_uri}, region=HOME)
    sim.wait_for_invocations(mover.FUNCTION, region=HOME, timeout=120, until=lambda done: any(
        i.ok and "the job has ended" in i.output for i in done))
    wait_until(lambda: everything(sim)[HOME] == NOTHING, 60, "the leftover's deletion")
