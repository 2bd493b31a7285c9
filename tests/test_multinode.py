"""Multi-node jobs: node counts, node-slot leases, the rendezvous record.

Real parts: a LocalStore for the job's prefix, a real c10d TCPStore for the hosted
rendezvous store.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from helpers import Watch, wait_until

from spotnb.protocol import lease
from spotnb.protocol.layout import LEASE, lease_key
from spotnb.protocol.spec import MAX_NODES, JobSpec, Resources, SpecError, parse_nodes
from spotnb.protocol.store import LocalStore

pytestmark = pytest.mark.timeout(120)


# -- node counts ---------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    (1, (1, 1)), (4, (4, 4)), ("4", (4, 4)), ("3:4", (3, 4)), (" 2 : 3 ", (2, 3)),
    ((3, 4), (3, 4)), ([1, 2], (1, 2)),
])
def test_parse_nodes(value: object, expected: tuple[int, int]) -> None:
    assert parse_nodes(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value, words", [
    (0, "at least one node"), ("0", "at least one node"), ("0:2", "at least one node"),
    ("4:3", "MIN must not exceed MAX"), ("x", "MIN:MAX"), ("3:", "MIN:MAX"),
    (True, "MIN:MAX"), ((1, 2, 3), "MIN:MAX"), (MAX_NODES + 1, "limit"),
])
def test_bad_node_counts_are_refused_with_the_next_step(value: object, words: str) -> None:
    with pytest.raises(SpecError, match=words):
        parse_nodes(value)  # type: ignore[arg-type]


def test_resources_say_whether_a_job_is_distributed() -> None:
    assert not Resources(("g5.xlarge",)).distributed
    assert Resources(("g5.xlarge",), min_nodes=3, max_nodes=4).distributed
    assert Resources(("g5.xlarge",), procs_per_node=2).distributed


def test_node_counts_survive_the_spec_round_trip() -> None:
    spec = JobSpec.from_json(JobSpec.from_json(_spec_json()).to_json())
    assert (spec.resources.min_nodes, spec.resources.max_nodes,
            spec.resources.procs_per_node) == (3, 4, 2)


def _spec_json() -> str:
    import json

    from spotnb.protocol.spec import Policy

    base = {
        "job_id": "j-1", "name": "n", "code": "pass", "provider": "local",
        "store_uri": "/tmp/none", "created": 0.0,
        "resources": {"instance_types": ["g5.xlarge"], "min_nodes": 3, "max_nodes": 4,
                      "procs_per_node": 2},
        "policy": {"checkpoint_every": {"seconds": 60.0, "steps": None}},
    }
    assert Policy().peer_timeout > 0
    return json.dumps(base)


# -- node-slot leases ----------------------------------------------------------------


def test_each_node_slot_has_its_own_lease_and_epochs_are_unique_job_wide(
        tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "job")
    nodes = 3
    held = [lease.acquire(store, f"i-{k}", slot=k, stride=nodes) for k in range(nodes)]
    assert all(h is not None for h in held)
    assert [lease_key(k) for k in range(nodes)] == [LEASE, "lease.1.json", "lease.2.json"]
    assert all(store.exists(lease_key(k)) for k in range(nodes))
    # A slot with a live holder is taken; the others are unaffected.
    assert lease.acquire(store, "i-x", slot=1, stride=nodes) is None
    epochs = [h.lease.epoch for h in held if h is not None]
    assert epochs == [1, 2, 3]
    # Retries in place and takeovers move each slot's epoch by the node count.
    held[0].bump()  # type: ignore[union-attr]
    held[2].release()  # type: ignore[union-attr]
    again = lease.acquire(store, "i-y", slot=2, stride=nodes)
    assert again is not None
    seen = {held[0].lease.epoch, held[1].lease.epoch,  # type: ignore[union-attr]
            again.lease.epoch}
    assert seen == {4, 2, 6}
    assert all((e - 1) % nodes == k for k, e in
               ((0, 4), (1, 2), (2, 6)))
    # Fencing checks read the right slot.
    assert lease.still_holds(store, 6, "i-y", slot=2)
    assert not lease.still_holds(store, 6, "i-y", slot=1)


def test_a_worker_without_its_agent_checks_its_own_slots_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's runtime asks its agent whether it still holds its lease; before the
    agent's first ping (a loaded machine) it reads the lease from the store: its node
    slot's (SPOTNB_SLOT), not the job's slot 0 (a survivor on slot 1 took itself for
    fenced and failed the job)."""
    from spotnb.kernel_remote import channel
    from spotnb.train.session import Session

    store = LocalStore(tmp_path / "job")
    held = [lease.acquire(store, f"i-{k}", slot=k, stride=2) for k in range(2)]
    assert all(h is not None for h in held)
    for key, value in {channel.ENV_JOB_URI: f"file://{tmp_path / 'job'}",
                       channel.ENV_ATTEMPT: str(held[1].lease.epoch),  # type: ignore[union-attr]
                       channel.ENV_INSTANCE_ID: "i-1", channel.ENV_SLOT: "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv(channel.ENV_SOCKET, raising=False)
    session = Session.from_env()
    try:
        assert session.slot == 1 and session.channel is None
        assert session.fence()
        held[1].release()  # type: ignore[union-attr]
        assert not session.fence()
    finally:
        session.finish()  # its metrics thread drains the process's rows: stop it


def test_a_single_node_job_keeps_its_one_lease_and_epochs(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "job")
    held = lease.acquire(store, "i-a")
    assert held is not None and held.lease.epoch == 1 and held.lease.key == LEASE
    held.bump()
    assert held.lease.epoch == 2
    held.release()
    nxt = lease.acquire(store, "i-b")
    assert nxt is not None and nxt.lease.epoch == 3
    assert not store.exists(lease_key(1))


def test_a_waiting_replacement_asks_whether_holders_are_gone_rarely(tmp_path: Path) -> None:
    # A replacement that finds every node slot held (a multi-node job while a noticed
    # node is still in its notice period) retries every half second; the provider's
    # "is that instance gone?" (a DescribeInstances on AWS) is asked once per holder per
    # HOLDER_GONE_RECHECK_SECONDS, and a holder found gone is not asked again.
    from spotnb.kernel_remote.leasing import rechecked

    store = LocalStore(tmp_path / "job")
    for k in range(3):
        assert lease.acquire(store, f"i-{k}", slot=k, stride=3) is not None
    asked: list[str] = []
    dead: set[str] = set()

    def instance_gone(held: lease.Lease) -> bool:
        asked.append(held.holder)
        return held.holder in dead

    gone = rechecked(instance_gone, seconds=3600)
    assert gone is not None
    for _ in range(20):  # the wait loop's tries, well within the recheck interval
        assert all(lease.acquire(store, "i-new", holder_gone=gone, slot=k, stride=3) is None
                   for k in range(3))
    assert sorted(asked) == ["i-0", "i-1", "i-2"], "once per holder, not once per try"
    # A holder found gone stays gone: its slot is taken without asking again.
    dead.add("i-1")
    fresh = rechecked(instance_gone, seconds=3600)
    assert fresh is not None and fresh(lease.read(store, 1)[0])  # type: ignore[index]
    taken = lease.acquire(store, "i-new", holder_gone=fresh, slot=1, stride=3)
    assert taken is not None and taken.lease.epoch == 2 + 3
    assert asked.count("i-1") == 2


# -- the rendezvous record -----------------------------------------------------------


def test_first_node_hosts_the_rendezvous_and_the_others_join(tmp_path: Path) -> None:
    from torch.distributed import TCPStore

    from spotnb.kernel_remote.multinode import rendezvous as rdzv

    store = LocalStore(tmp_path / "job")
    held = lease.acquire(store, "i-a", slot=0, stride=2)
    assert held is not None
    record, hosted = rdzv.elect(store, "j-1", "i-a", 0, "127.0.0.1", None,
                                "the first node", timeout=30)
    assert hosted is not None and record.generation == 1 and not record.vacant
    assert record.run_id == "j-1-g1" and record.host == "i-a"
    assert rdzv.host_alive(store, record)
    # A second node that raced on the same empty record loses and gets the winner's.
    lost, none = rdzv.elect(store, "j-1", "i-b", 1, "127.0.0.1", None, "the first node",
                            timeout=30)
    assert none is None and lost == record
    # The endpoint is a real c10d store the others connect to.
    host, port = str(record.endpoint).rsplit(":", 1)
    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert client.get("k") == b"v"
    hosted.close()


def test_a_host_with_notice_vacates_and_one_survivor_hosts_the_next_generation(
        tmp_path: Path) -> None:
    from spotnb.kernel_remote.multinode import rendezvous as rdzv

    store = LocalStore(tmp_path / "job")
    a = lease.acquire(store, "i-a", slot=0, stride=3)
    assert a is not None
    record, hosted = rdzv.elect(store, "j-1", "i-a", 0, "127.0.0.1", None, "first", 30)
    assert hosted is not None
    vacant = rdzv.vacate(store, record, "its host got an interruption notice")
    assert vacant is not None and vacant.vacant and vacant.generation == 2
    assert not rdzv.host_alive(store, vacant)
    assert rdzv.vacate(store, record, "again") is None  # the record moved on
    hosted.close()
    current = rdzv.read(store)
    assert current is not None
    # Two survivors race on the vacant generation: exactly one hosts it.
    b = rdzv.elect(store, "j-1", "i-b", 1, "127.0.0.1", current, "vacant", 30)
    c = rdzv.elect(store, "j-1", "i-c", 2, "127.0.0.1", current, "vacant", 30)
    hosts = [h for _, h in (b, c) if h is not None]
    assert len(hosts) == 1
    assert b[0] == c[0] and b[0].generation == 2 and b[0].host == "i-b"
    for h in hosts:
        h.close()


def test_a_dead_host_is_replaced_by_the_next_generation(tmp_path: Path) -> None:
    from spotnb.kernel_remote.multinode import rendezvous as rdzv

    store = LocalStore(tmp_path / "job")
    a = lease.acquire(store, "i-a", slot=0, stride=2)
    b = lease.acquire(store, "i-b", slot=1, stride=2)
    assert a is not None and b is not None
    record, hosted = rdzv.elect(store, "j-1", "i-a", 0, "127.0.0.1", None, "first", 30)
    assert hosted is not None and rdzv.host_alive(store, record)
    # The provider says the host's instance is terminated (a kill without notice).
    assert not rdzv.host_alive(store, record, instance_gone=lambda i: i == "i-a")
    # Its lease released (or expired): gone as well.
    a.release()
    assert not rdzv.host_alive(store, record)
    current = rdzv.read(store)
    new, mine = rdzv.elect(store, "j-1", "i-b", 1, "127.0.0.1", current,
                           "its host i-a is gone", 30)
    assert mine is not None and new.generation == 2 and new.run_id == "j-1-g2"
    assert new.host_slot == 1 and rdzv.host_alive(store, new)
    hosted.close()
    mine.close()


def test_a_node_that_leaves_is_out_of_the_round_while_its_process_lives(
        tmp_path: Path) -> None:
    """A node leaves after its notice's checkpoint, but its agent process lives on (on
    AWS until EC2 ends the instance, two minutes after the notice). The staying node
    re-forms without it at once. It waited in torchelastic's wait list for as long as
    the leaver's heartbeat ran, that is while its process lived: the selftest's
    replacement then joined first and the world went 2 -> 2, never 1."""
    import threading

    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    from spotnb.kernel_remote.multinode import rendezvous as rdzv

    store = LocalStore(tmp_path / "job")
    record, hosted = rdzv.elect(store, "j-1", "i-a", 0, "127.0.0.1", None, "first", 30)
    assert hosted is not None

    def handler(node: str) -> Any:
        # What NodeRun gives torchelastic (1:2 nodes); the join timeout is only a bound
        # for this test: the leaver's heartbeat runs on here until the test ends.
        return registry.get_rendezvous_handler(RendezvousParameters(
            backend="c10d", endpoint=str(record.endpoint), run_id=record.run_id,
            min_nodes=1, max_nodes=2, local_addr=node, is_host=False, join_timeout=60,
            last_call_timeout=2, close_timeout=2, keep_alive_interval=1,
            keep_alive_max_attempt=3, read_timeout=30))

    stays, leaves = handler("127.0.0.1"), handler("127.0.0.2")
    sizes: dict[str, int] = {}

    def join(name: str, h: Any) -> None:
        sizes[name] = h.next_rendezvous().world_size

    threads = [threading.Thread(target=join, args=(n, h)) for n, h in
               (("stays", stays), ("leaves", leaves))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sizes == {"stays": 2, "leaves": 2}
    # The leaver's final save is durable: it leaves; its process (this one) lives on.
    assert rdzv.leave_round(leaves, timeout=30)
    # The staying node restarts its workers: a round of 1, without waiting for the
    # leaver's heartbeat to stop (it would wait out its join timeout, then fail).
    assert stays.next_rendezvous().world_size == 1
    stays.shutdown()
    hosted.close()


# -- kernels outlive the thread that started them -----------------------------------


def test_a_kernel_started_from_a_short_lived_thread_outlives_that_thread() -> None:
    """Linux sends PR_SET_PDEATHSIG when the parent *thread* exits. A distributed job
    starts spare kernels from torchelastic's per-generation thread: they must live on
    after it ends (they died with it: "KernelDied ... killed by signal 9")."""
    import os
    import tempfile
    import threading

    from spotnb.kernel_remote.kernel import KernelProcess

    socket_dir = Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))
    started: list[KernelProcess] = []
    thread_ids: list[int] = []
    may_end = threading.Event()

    def starter() -> None:
        thread_ids.append(threading.get_native_id())
        started.append(KernelProcess.start(socket_dir=socket_dir, name="spare",
                                           cwd=socket_dir, env=dict(os.environ)))
        may_end.wait(120)

    thread = threading.Thread(target=starter)
    thread.start()
    try:
        # The kernel answers while its starter lives (its launcher has set the death
        # signal by then), then the starter thread ends and is gone from the process.
        for _ in range(600):
            if started:
                break
            threading.Event().wait(0.1)
        assert started, "the kernel was not started"
        kernel = started[0]
        kc = kernel.connect(timeout=300)
        may_end.set()
        thread.join(30)
        assert not thread.is_alive(), "the starter thread did not end"
        task = Path(f"/proc/self/task/{thread_ids[0]}")
        for _ in range(600):
            if not task.exists():
                break
            threading.Event().wait(0.05)
        assert not task.exists(), "the starter thread's task is still there"
        # The kernel still runs code.
        msg_id = kc.execute("x = 6 * 7", silent=False)
        reply = None
        for _ in range(3000):  # a bound for a loaded machine, not a timing
            assert kernel.alive, f"the kernel died with its starter thread: " \
                                 f"{kernel.exit_reason()}"
            try:
                reply = kc.get_shell_msg(timeout=0.1)
            except Exception:
                continue
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply is not None and reply["parent_header"].get("msg_id") == msg_id, \
            "the kernel did not answer"
        assert reply["content"]["status"] == "ok", reply
    finally:
        may_end.set()
        for kernel in started:
            kernel.kill()


# -- end to end on the local cloud ---------------------------------------------------

ALL_REDUCE = """
import os
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
total = t.item()
world = dist.get_world_size()
seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
threads = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
# How long a collective of this group waits on a silent peer (gloo's own option).
peer_wait = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_nodes_of_two_processes_run_one_cell_as_torchrun_workers(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (One process per node, the common case, is what every other multi-node job here
    # runs: DDP code whose process group reads torchrun's variables.)
    import spotnb

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    # Nothing says how many compute threads: torchrun's default for 2 workers a node.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    job = spotnb.submit(ALL_REDUCE, nodes=2, procs_per_node=2,
                        outputs=["total", "world", "seen", "peer_wait", "threads"],
                        instance_types="g4dn.xlarge", peer_timeout="45s")
    result = job.wait(timeout=240)
    assert result.status == "completed", (result.status, result.reason)
    # Rank 0's values come back: the all-reduce saw every rank (1 + 2 + 3 + 4).
    assert result.outputs["world"] == 4 and result.outputs["total"] == 1 + 2 + 3 + 4
    assert result.outputs["seen"] == {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                                      "MASTER_ADDR": "127.0.0.1"}
    # The job's peer timeout bounds the collectives of a group the cell made without
    # a timeout (torch's default is 30 minutes).
    assert result.outputs["peer_wait"] == 45.0
    # As under torchrun, each of a node's workers computes on one thread.
    assert tuple(result.outputs["threads"]) == ("1", 1)
    # Each node is an attempt of its own (its slot's epoch) on its own instance, and
    # the cost counts both instances.
    assert sorted(a.number for a in result.attempts) == [1, 2]
    assert len({a.instance_id for a in result.attempts}) == 2
    assert result.cost_usd > 0
    # %spot_jobs and `spotnb jobs` show the nodes.
    row = next(r for r in spotnb.jobs() if r.job_id == job.job_id)
    assert row.nodes == "2 nodes (2x2)"
    assert (row.instance_type or "").startswith("g4dn.xlarge x2")


@pytest.mark.timeout(300)
def test_the_jobs_own_thread_count_wins_over_torchruns_default(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import spotnb

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    job = spotnb.submit(ALL_REDUCE, procs_per_node=2, env={"OMP_NUM_THREADS": "2"},
                        outputs=["world", "threads"], instance_types="g4dn.xlarge")
    result = job.wait(timeout=240)
    assert result.status == "completed", (result.status, result.reason)
    assert result.outputs["world"] == 2
    assert tuple(result.outputs["threads"]) == ("2", 2)


@pytest.mark.parametrize("nodes, words", [
    (0, "at least one node"), ("4:3", "MIN must not exceed MAX")])
def test_submit_refuses_bad_node_counts_before_launch(
        spotnb_home: Path, nodes: object, words: str) -> None:
    import spotnb

    with pytest.raises(SpecError, match=words):
        spotnb.submit("pass", nodes=nodes)  # type: ignore[arg-type]
    assert not (spotnb_home / "local").exists() or not any(
        (spotnb_home / "local").rglob("group.json"))


UNTIL_GO = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
ckpt = spot.Checkpoint(state={})
steps = ckpt.restore()
while True:
    flag = torch.tensor([1.0 if os.path.exists(GO) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
    if flag.item() > 0:
        break
    spot.log(steps, steps=float(steps))
    ckpt.maybe_save(steps)  # by policy (every 5 minutes), and at once before a join
    steps += 1
    time.sleep(0.05)
world = dist.get_world_size()
dist.destroy_process_group()
"""


def _worlds(store: LocalStore) -> list[dict[str, object]]:
    from spotnb.protocol.events import EventReader

    return [dict(e.data, instance=e.instance) for e in EventReader(store).replay()
            if e.type == "world"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_losing_the_rendezvous_host_shrinks_the_world_then_it_re_forms(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--nodes 1:2: the node hosting the rendezvous is killed outright (no notice); the
    survivor elects itself host of the next generation and trains on alone while no
    capacity is left for a replacement; capacity returns, the replacement joins and
    the world re-forms at 2: every rank saved first, so the join redoes no step (with
    the default checkpoint interval of 5 minutes, it redid every step since the start)."""
    import json
    import os
    import signal

    import spotnb
    from spotnb.kernel_remote.multinode import rendezvous as rdzv
    from spotnb.providers.local import LocalProvider

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    go = tmp_path / "go"
    job = spotnb.submit(UNTIL_GO, nodes="1:2", inputs={"GO": str(go)},
                        outputs=["world", "steps"], instance_types="g4dn.xlarge")
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))
    wait_until(lambda: [w for w in _worlds(store) if w["world_size"] == 2], 240, "a world of 2")
    current = rdzv.read(store)
    assert current is not None and current[0].generation == 1
    host = current[0].host
    # No capacity from now on: the killed node is not replaced yet.
    config = spotnb_home / "cloud" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"no_capacity": ["g4dn.xlarge"]}))
    meta = next(m for m in LocalProvider().instances(job.job_id)
                if m["instance_id"] == host)
    os.kill(int(meta["pid"]), signal.SIGKILL)
    # The survivor hosts generation 2 and trains on alone.
    alone = wait_until(lambda: [w for w in _worlds(store)
                                if w["world_size"] == 1 and w["generation"] == 2],
                       240, "the survivor alone in generation 2")
    survivor = alone[0]["instance"]  # type: ignore[index]
    assert survivor != host
    record = rdzv.read(store)
    assert record is not None and record[0].host == survivor
    # Capacity returns: the replacement joins, the world re-forms at 2.
    config.write_text(json.dumps({"no_capacity": []}))
    wait_until(lambda: [w for w in _worlds(store) if w["world_size"] == 2
                        and w["generation"] == 2], 240, "the world re-formed at 2")
    go.write_text("go")
    result = job.wait(timeout=240)
    assert result.status == "completed", (result.status, result.reason)
    assert result.outputs["world"] == 2
    # The join: one save at the step the survivor had reached, restored at 2 nodes.
    from spotnb.client import display
    from spotnb.protocol.events import EventReader

    view = display.JobView(job_id=job.job_id, name="", created=0.0, min_nodes=1,
                           max_nodes=2)
    lines = []
    for event in EventReader(store).replay():
        view.apply(event)
        lines += [text for about, text in display.milestones(event, view)
                  if about.type == "joined"]
    # The replacement took the killed host's node slot; the steps redone are the
    # fold's, told once the training went on after the join.
    assert lines and str(lines[-1]).startswith(
        f"node {current[0].host_slot} joined: world 2, 0 steps redone"), lines


DDP_TRAINING = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
X = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
y = X @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
model = torch.nn.Linear(16, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
ckpt = spot.Checkpoint(model=model, optimizer=opt)
start = ckpt.restore()
GLOBAL_BATCH = 48  # the same global batch at any world size (1, 2 or 3 ranks)
for step in range(start, STEPS):
    idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(step))[:GLOBAL_BATCH]
    mine = idx.chunk(world)[rank]
    loss = ((ddp(X[mine]) - y[mine]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    spot.log(step, loss=loss.item())
    while step == PAUSE_AT and not os.path.exists(GO):
        time.sleep(0.05)  # the test's gate: it delivers the notice meanwhile
    ckpt.maybe_save(step)
weights = [p.detach().clone() for p in model.parameters()]
dist.destroy_process_group()
"""


# The uninterrupted run that a job's final weights are compared with: the same cell as
# plain torchrun workers on this machine (no instances, no agents), with `spot` reduced
# to what an uninterrupted run does with it (helpers.PLAIN_SPOT: never restores, saves
# nothing that matters). GATED_TRAINING without pauses is DDP_TRAINING: the tests that
# pause ask for DDP_TRAINING's run, which they share.


class Uninterrupted:
    """``code`` run by ``world`` torchrun workers with ``inputs``, started at once (it
    runs beside the job); :meth:`weights` waits for rank 0's ``weights``.

    One run per test run for the same code, inputs and world size, whichever tests (and
    pytest-xdist workers) ask for it: the first to ask starts it (its weights are kept
    in a directory the workers share, :func:`helpers.shared_dir`), the others wait for
    its weights, or run it themselves if that run failed."""

    def __init__(self, code: str, inputs: dict[str, object], world: int,
                 tmp_path: Path) -> None:
        import hashlib

        from helpers import shared_dir

        self.code, self.inputs, self.world, self.tmp_path = code, inputs, world, tmp_path
        key = hashlib.sha256(repr((code, sorted(inputs.items()), world)).encode())
        cache = shared_dir(tmp_path) / "uninterrupted"
        cache.mkdir(exist_ok=True)
        self.out = cache / f"{key.hexdigest()[:16]}.pt"
        self.failed = self.out.with_suffix(".failed")
        self.log = self.out.with_suffix(".log")
        self.proc: Any = None
        try:  # the first to ask runs it
            os.close(os.open(self.out.with_suffix(".claim"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        self._start(self.out)

    def _start(self, out: Path) -> None:
        import subprocess
        import sys

        from helpers import PLAIN_SPOT

        script = self.tmp_path / "uninterrupted.py"
        given = "".join(f"{k} = {v!r}\n" for k, v in self.inputs.items())
        # os._exit: no interpreter teardown after the process group is gone (gloo's
        # threads there can abort the process: "terminate called without an active
        # exception", seen beside two busy loops).
        script.write_text(f"{PLAIN_SPOT}{given}{self.code}\n"
                          f"if os.environ['RANK'] == '0':\n"
                          f"    torch.save(weights, {str(out)!r} + '.tmp')\n"
                          f"    os.replace({str(out)!r} + '.tmp', {str(out)!r})\n"
                          f"sys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={self.world}", str(script)],
                stdout=log, stderr=subprocess.STDOUT, cwd=self.tmp_path,
                start_new_session=True)

    def __del__(self) -> None:
        # A test that failed before weights(): its workers are ended, not left running
        # into the next test (whose set-up then reported the running subprocess), and
        # the tests waiting for them are told.
        if self.proc is None:
            return
        if self.proc.poll() is None:
            import signal

            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)  # the launcher and its workers
            self.proc.wait()
        if not self.out.exists():
            self.failed.touch()

    def weights(self, timeout: float = 300) -> list[object]:
        import torch

        if self.proc is not None:
            rc = self.proc.wait(timeout=timeout)
            if rc != 0:
                self.failed.touch()
            assert rc == 0, self.log.read_text()[-3000:]
        else:
            wait_until(lambda: self.out.exists() or self.failed.exists(), timeout,
                       "the uninterrupted run another test started")
            if not self.out.exists():  # that run failed: this test runs its own
                self.log = self.tmp_path / "uninterrupted.log"
                self._start(self.tmp_path / "uninterrupted.pt")
                rc = self.proc.wait(timeout=timeout)
                assert rc == 0, self.log.read_text()[-3000:]
                return torch.load(self.tmp_path / "uninterrupted.pt")  # type: ignore[no-any-return]
        return torch.load(self.out)  # type: ignore[no-any-return]


# The same training sharded with FSDP2: every rank writes its shards (asynchronously,
# spotnb.ckpt.sharded), and a world that shrank reads them resharded. The bias (one
# element) leaves rank 1 of two an empty shard.
FSDP_TRAINING = DDP_TRAINING.replace(
    "ddp = torch.nn.parallel.DistributedDataParallel(model)",
    "from torch.distributed.fsdp import fully_shard\nddp = fully_shard(model)").replace(
    "weights = [p.detach().clone() for p in model.parameters()]",
    "weights = [p.full_tensor().detach().clone() for p in model.parameters()]")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("code", [DDP_TRAINING, FSDP_TRAINING], ids=["ddp", "fsdp"])
def test_notice_to_the_rendezvous_host_saves_once_and_the_run_ends_as_uninterrupted(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    """Two nodes of seeded DDP (or FSDP) code (--nodes 1:2, the same global batch at
    any world size). The node hosting the rendezvous gets its notice mid-training:
    every rank saves at the same step (DDP: rank 0 writes; FSDP: every rank its
    shards), the host leaves, the other node re-forms (alone, or with the replacement
    if it already joined) from that checkpoint, and the replacement joins. The final
    weights match an uninterrupted run of the same code: bitwise where every round had
    2 ranks, else within float tolerance (the gradient of the same global batch is then
    reduced in a different order)."""

    import torch

    import spotnb
    from spotnb.kernel_remote.multinode import rendezvous as rdzv
    from spotnb.protocol.events import EventReader

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "20")
    go = tmp_path / "go"
    common = {"nodes": "1:2", "outputs": ["weights"], "instance_types": "g4dn.xlarge",
              "checkpoint_every": "5 steps"}
    reference = Uninterrupted(code, {"STEPS": 30, "PAUSE_AT": -1, "GO": ""}, 2, tmp_path)
    job = spotnb.submit(code, inputs={"STEPS": 30, "PAUSE_AT": 12, "GO": str(go)},
                        **common)
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def events(type: str) -> list[object]:
        return [e for e in EventReader(store).replay() if e.type == type]

    with Watch(job) as watch:
        watch.until(lambda _: 12 in watch.steps(), 240, "training to reach the gate (step 12)")
    current = rdzv.read(store)
    assert current is not None
    host = current[0].host
    job.provider.interrupt(job.job_id, instance=host)
    wait_until(lambda: [e for e in events("status") if e.instance == host  # type: ignore[attr-defined]
                        and "interruption notice" in str(e.data.get("detail"))],
               240, "the host's agent to see its notice")
    go.write_text("go")
    result = job.wait(timeout=300)
    assert result.status == "completed", (result.status, result.reason)
    want = reference.weights()
    # The coordinated checkpoint: one forced save, at the gate's step.
    forced = [e for e in events("checkpoint") if e.data.get("phase") == "durable"  # type: ignore[attr-defined]
              and e.data.get("forced")]  # type: ignore[attr-defined]
    assert [e.data["step"] for e in forced] == [12]  # type: ignore[attr-defined]
    record = rdzv.read(store)
    assert record is not None and record[0].generation >= 2 and record[0].host != host
    sizes = {w["world_size"] for w in _worlds(store)}
    got = result.outputs["weights"]
    if sizes == {2}:
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(got, want, strict=True))


# DDP_TRAINING held at each step of PAUSES until the file GO/<step> exists.
GATED_TRAINING = DDP_TRAINING.replace(
    "    while step == PAUSE_AT and not os.path.exists(GO):\n",
    "    while step in PAUSES and not os.path.exists(os.path.join(GO, str(step))):\n")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_notices_at_once_then_the_rendezvous_host_killed_end_as_uninterrupted(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of seeded DDP code. Both nodes get their notice 0.3 s apart (aimed with
    interrupt(node=K)): every rank saves once, at the same step, and two replacements
    re-form the world from it. Then the node hosting the rendezvous is killed without
    notice (`spotnb kill --node K`): the survivor hosts the next generation, the
    replacement joins, the steps since the last checkpoint are redone. The job
    completes with the weights of an uninterrupted run, bitwise (every round had 2
    ranks). Both faults failed jobs before: the spare kernels that the generation's
    thread had started died with it (PR_SET_PDEATHSIG), and two notices in one tick of
    the local cloud were one."""
    import time

    import torch

    import spotnb
    from spotnb.client import cli
    from spotnb.kernel_remote.multinode import rendezvous as rdzv
    from spotnb.protocol.events import EventReader

    assert GATED_TRAINING != DDP_TRAINING
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "10")
    common = {"nodes": 2, "outputs": ["weights"], "instance_types": "g4dn.xlarge",
              "checkpoint_every": "5 steps"}
    inputs = {"STEPS": 30, "PAUSES": [12, 20], "PAUSE_AT": -1}
    reference = Uninterrupted(DDP_TRAINING, {"STEPS": 30, "PAUSE_AT": -1, "GO": ""}, 2, tmp_path)
    go = tmp_path / "go"
    go.mkdir()
    job = spotnb.submit(GATED_TRAINING, inputs={**inputs, "GO": str(go)}, **common)
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def noticed() -> set[str]:
        return {e.instance for e in EventReader(store).replay() if e.type == "status"
                and "interruption notice" in str(e.data.get("detail"))}

    with Watch(job) as watch:
        watch.until(lambda _: 12 in watch.steps(), 240, "training to reach step 12")
        first = {w["instance"] for w in _worlds(store)}
        job.interrupt(node=0)
        time.sleep(0.3)  # the fault itself: the second notice 0.3 s after the first
        job.interrupt(node=1)
        wait_until(lambda: noticed() >= first, 240, "both nodes' agents to see their notices")
        (go / "12").write_text("go")
        watch.until(lambda _: 20 in watch.steps(), 240,
                    "training to reach step 20 on the replacements")
    record = rdzv.read(store)
    assert record is not None and record[0].host not in first
    host = record[0].host
    assert cli.main(["kill", job.job_id, "--node", str(record[0].host_slot)]) == 0
    # The kill is a request the group carries out at its next tick: the gate opens once
    # the host is gone, else the survivor can train the last steps before it is.
    wait_until(lambda: [e for e in EventReader(store).replay() if e.type == "instance"
                        and e.data.get("action") == "terminated"
                        and e.data.get("reason") == "killed"
                        and e.instance == host], 60, "the host to be killed")
    (go / "20").write_text("go")
    result = job.wait(timeout=400)
    assert result.status == "completed", (result.status, result.reason)
    want = reference.weights()
    # One coordinated save for the two notices, at the gate's step.
    forced = [e for e in EventReader(store).replay() if e.type == "checkpoint"
              and e.data.get("phase") == "durable" and e.data.get("forced")]
    assert [e.data["step"] for e in forced] == [12]
    assert {w["world_size"] for w in _worlds(store)} == {2}
    later = rdzv.read(store)
    assert later is not None and later[0].generation > record[0].generation
    got = result.outputs["weights"]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_warm_standby_joins_in_a_recommended_nodes_place_with_no_step_redone(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two nodes of seeded DDP code (--nodes 2). EC2 recommends a rebalance of one node
    (held at step 6): every rank saves at once, and the world goes on as it is (it
    re-formed around the node before). The group starts a warm standby for the node,
    which starts its kernels and downloads the newest checkpoint without joining the
    world. Once it is ready the group ends the node through its termination hook
    (capacity rebalancing): every rank saves at one step, the node leaves, and the
    standby takes its slot and joins: the world re-forms at 2 from that save, with no
    boot in the gap (no instance launched but the two nodes and the standby), no step
    redone, and the weights of an uninterrupted run, bitwise. The fold and the display
    tell a move to the standby, not an interruption."""
    import time

    import spotnb
    from spotnb.client import display
    from spotnb.kernel_remote.multinode import rendezvous as rdzv
    from spotnb.protocol import layout
    from spotnb.protocol.events import Event, EventReader, metric_rows
    from spotnb.protocol.events.fold import EndReason, fold
    from spotnb.protocol.events.live import Follower
    from spotnb.providers.local import LocalProvider

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    # A standby's hold is 600 market seconds after its boot: 150 s at this scale, for
    # two nodes' kernels and a standby's warm-up on a busy machine.
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "4")
    # An instance boots in 5 s: the standby's boot comes before the move, not in it.
    monkeypatch.setenv("SPOTNB_LOCAL_BOOT_SECONDS", "5")
    # The termination hook's wait; the node ends as soon as it released its slot.
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "60")
    inputs = {"STEPS": 16, "PAUSES": [6, 12], "PAUSE_AT": -1}
    reference = Uninterrupted(DDP_TRAINING, {"STEPS": 16, "PAUSE_AT": -1, "GO": ""}, 2, tmp_path)
    go = tmp_path / "go"
    go.mkdir()
    # standby_first_hour: the standby starts at the recommendation, not as the node's
    # first hour ends (when an interruption by EC2 would no longer be free).
    job = spotnb.submit(GATED_TRAINING, inputs={**inputs, "GO": str(go)}, nodes=2,
                        outputs=["weights"], instance_types="g4dn.xlarge",
                        checkpoint_every="5 steps", standby_first_hour=True)
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def steps() -> list[int]:
        return [step for step, _ in job.metrics().get("loss", [])]

    def rounds() -> set[tuple[object, ...]]:
        return {(w["instance"], w["generation"], w["round"]) for w in _worlds(store)}

    # Followed: the agents send their events live (unwatched, they write once a minute).
    with Follower(job.store, job.job_id) as follower:
        seen: list[Event] = []

        def follow_until(found: Callable[[Event], bool], what: str) -> None:
            deadline = time.monotonic() + 240
            while not any(found(e) for e in seen):
                assert time.monotonic() < deadline, f"gave up waiting for {what}"
                seen.extend(follower.poll(wait=0.5))

        follow_until(lambda e: e.type == "metric" and e.data.get("step") == 6,
                     "training to reach step 6")
        record = rdzv.read(store)
        assert record is not None
        (node,) = [m["instance_id"] for m in LocalProvider().instances(job.job_id)
                   if m.get("state") == "running" and m["instance_id"] != record[0].host]
        before = rounds()
        LocalProvider().recommend(job.job_id, instance=node)
        follow_until(lambda e: e.type == "notice" and e.instance == node
                     and e.data.get("kind") == "rebalance", "the node to see its recommendation")
        (go / "6").write_text("go")  # every rank saves at step 6 while the standby boots
        # The standby warms up outside the world; once it is ready, the node is ended
        # through its hook and its agent takes that for its notice.
        follow_until(lambda e: e.type == "status" and e.instance == node and "the warm "
                     "standby is ready: moving to it" in str(e.data.get("detail")),
                     "the node to be moved to its standby")
        assert rounds() == before, "the world re-formed while the node was in it"
        (go / "12").write_text("go")
    result = job.wait(timeout=300)
    assert result.status == "completed", (result.status, result.reason)
    want = reference.weights()
    got = result.outputs["weights"]
    assert all(torch_equal(a, b) for a, b in zip(got, want, strict=True))

    events = list(EventReader(store).replay())
    state = fold(events, 2)
    (sb,) = state.standbys.values()

    def group(action: str) -> list[object]:
        return [e for e in events if e.attempt == 0 and e.type == "instance"
                and e.data.get("action") == action]

    (moved,) = [e for e in group("terminated") if e.instance == node]  # type: ignore[attr-defined]
    assert moved.data["reason"] == "rebalanced"  # type: ignore[attr-defined]
    assert sb.standby_for == node and sb.given_back is None and sb.attempt is not None
    # Warm before the node left: its kernels started, it said it was ready.
    assert sb.kernel_started is not None and sb.ready is not None
    assert sb.kernel_started <= sb.ready < moved.time  # type: ignore[attr-defined]
    # It took the node's slot; the node's attempt ended moved to its standby, not
    # interrupted; no instance launched but the two nodes and the standby.
    (gone,) = [a for a in state.attempts.values() if a.instance_id == node]
    assert layout.node_slot(sb.attempt, 2) == gone.node
    assert state.end_reason(gone.number, final=True) == EndReason.MOVED.value
    assert state.interruptions() == 0 and not group("notice")
    assert len(group("launched")) == 3
    # A save at once at step 6, where the recommendation found the job (the policy's
    # are every 5th step), one coordinated save before the node left; every step
    # logged once: none redone.
    durable = [e.data for e in events if e.type == "checkpoint"
               and e.data.get("phase") == "durable"]
    assert 6 in [d["step"] for d in durable], durable
    assert len([d for d in durable if d.get("forced")]) == 1, durable
    assert sorted(steps()) == list(range(16))
    assert {w["world_size"] for w in _worlds(store)} == {2}
    handover = state.handover_seconds(sb)
    assert handover is not None
    # What the notebook shows.
    view = display.JobView(job_id=job.job_id, name="", created=0.0, min_nodes=2,
                           max_nodes=2)
    lines = []
    for event in events:
        view.apply(event)
        if (text := display.milestone(event, view)) is not None:
            lines.append(text)
    assert view.folded.redone_steps() == 0
    slot = gone.node
    assert any(line.startswith(f"node {slot} (attempt {gone.number}): its warm standby "
                               f"{sb.instance_id} is ready: moving to it") for line in lines), lines
    assert any(line.startswith(f"node {slot} (attempt {sb.attempt}): its warm standby "
                               "joining in its place") for line in lines), lines
    for text in ("rebalance recommendation: standby booting", "standby ready",
                 f"handed over in {handover:.1f} s"):
        assert text in lines, lines
    # The gap: the node's save durable -> the next step logged (printed for the record).
    (saved,) = [e for e in events if e.type == "checkpoint"
                and e.data.get("phase") == "durable" and e.data.get("forced")]
    resumed = min(t for e in EventReader(store, batches=True).poll()
                  for step, t, _values in metric_rows(e) if step == saved.data["step"] + 1)
    print(f"standby handover: {handover:.1f} s; save of step {saved.data['step']} durable "
          f"-> next step: {resumed - saved.time:.1f} s; rounds: "
          f"{sorted({(w['generation'], w['round']) for w in _worlds(store)})}")


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_three_nodes_one_killed_at_random_mid_epoch_end_as_uninterrupted(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three nodes of seeded DDP code (--nodes 2:3); one node, chosen at random, is
    killed outright mid-epoch (no notice). The survivors' collectives fail, they
    re-form from the last checkpoint (the steps since it are redone), the replacement
    joins, and the final weights match an uninterrupted 3-node run: bitwise where
    every round had 3 ranks, else within float tolerance (see the notice test)."""
    import os
    import random
    import signal

    import torch

    import spotnb
    from spotnb.providers.local import LocalProvider

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    go = tmp_path / "go"
    common = {"nodes": "2:3", "outputs": ["weights"], "instance_types": "g4dn.xlarge",
              "checkpoint_every": "5 steps"}
    reference = Uninterrupted(DDP_TRAINING, {"STEPS": 24, "PAUSE_AT": -1, "GO": ""}, 3,
                              tmp_path)
    job = spotnb.submit(DDP_TRAINING, inputs={"STEPS": 24, "PAUSE_AT": 12, "GO": str(go)},
                        **common)
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def metric_steps() -> list[int]:
        return [step for step, _ in job.metrics().get("loss", [])]

    # Mid-epoch: past a checkpoint (step 9), held at step 12 before its maybe_save.
    with Watch(job) as watch:
        watch.until(lambda _: 12 in watch.steps(), 240, "training to reach step 12")
    nodes = [m for m in LocalProvider().instances(job.job_id) if m.get("state") == "running"]
    assert len(nodes) == 3
    victim = random.choice(nodes)
    os.kill(int(victim["pid"]), signal.SIGKILL)
    go.write_text("go")
    result = job.wait(timeout=300)
    assert result.status == "completed", (result.status, result.reason)
    want = reference.weights()
    # Every step was logged, the last one last. (Whether step 12 appears twice depends
    # on the victim: rank 0's rows not yet flushed die with it, and the redone steps
    # are then logged once. The weights below show the steps since the checkpoint were
    # redone from it.)
    steps = metric_steps()
    assert sorted(set(steps)) == list(range(24)) and steps[-1] == 23, steps
    worlds = _worlds(store)
    assert any(w["instance"] == victim["instance_id"] for w in worlds)
    sizes = {w["world_size"] for w in worlds}
    got = result.outputs["weights"]
    if sizes == {3}:
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    else:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6)
                   for a, b in zip(got, want, strict=True))


# -- what the notebook shows of a multi-node job (offline, from its events) ----------

T0 = 1_800_000_000.0
SPOT, ONDEMAND = 0.5, 1.5  # USD/hour of every instance of the synthetic job


def _three_node_job() -> tuple[JobSpec, list[object]]:
    """The events of a --nodes 2:3 job as its streams write them: three nodes join and
    form a world of 3; node 1 (attempt 2) gets its notice, the world re-forms at 2; its
    replacement (attempt 5, node slot 1 again) joins and the world re-forms at 3; the
    job completes. Every node samples its CPU; global rank 0 (node 0) logs the loss."""
    import json

    from spotnb.protocol.events import GROUP_STREAM, Event

    raw = json.loads(_spec_json())
    raw["resources"].update(min_nodes=2, max_nodes=3, procs_per_node=1)
    raw["created"] = T0
    spec = JobSpec.from_json(json.dumps(raw))
    ev: list[object] = []

    def group(at: float, type_: str, **data: object) -> None:
        ev.append(Event(type_, T0 + at, GROUP_STREAM, data.get("instance_id"), data))  # type: ignore[arg-type]

    def agent(at: float, attempt: int, type_: str, **data: object) -> None:
        ev.append(Event(type_, T0 + at, attempt, f"i-{attempt}", data))

    def launch(t: float, attempt: int) -> None:
        group(t, "instance", action="launched", instance_id=f"i-{attempt}",
              instance_type="g4dn.xlarge", az="us-east-1a", pool="g4dn.xlarge/us-east-1a",
              price=SPOT, ondemand=ONDEMAND)

    def boot(t: float, attempt: int) -> None:
        agent(t, attempt, "status", state="booting", detail=f"attempt {attempt}",
              instance_type="g4dn.xlarge", az="us-east-1a")

    def world(t: float, attempts: list[int], generation: int) -> None:
        for rank, attempt in enumerate(attempts):
            agent(t, attempt, "world", generation=generation, nodes=len(attempts),
                  world_size=len(attempts), node_rank=rank, ranks=[rank], min_nodes=2,
                  max_nodes=3)

    for a in (1, 2, 3):
        launch(0, a)
        boot(10, a)
    world(20, [1, 2, 3], 1)
    for t in (25, 30, 35):
        for a in (1, 2, 3):
            agent(t, a, "sys", kind="cpu", util=30.0 * a, mem_used=1, mem_total=4)
        agent(t, 1, "metric", step=int(t), t=T0 + t, values={"loss": 1.0 / t})
    agent(40, 2, "notice", kind="instance-action", action="terminate",
          notice_time="2027-01-15T08:00:00Z")
    group(40, "instance", action="notice", instance_id="i-2")
    agent(50, 2, "status", state="interrupted", detail="the instance was terminated")
    group(50, "instance", action="terminated", instance_id="i-2")
    world(55, [1, 3], 1)
    # The noticed node's stream, read late, repeats its report of the world of 3.
    agent(20, 2, "world", generation=1, nodes=3, world_size=3, node_rank=1, ranks=[1],
          min_nodes=2, max_nodes=3)
    group(58, "status", state="launching", instance_type="g4dn.xlarge", az="us-east-1a")
    launch(60, 5)
    boot(70, 5)
    world(80, [1, 3, 5], 1)
    agent(85, 5, "sys", kind="cpu", util=90.0, mem_used=1, mem_total=4)
    agent(90, 1, "result", status="completed", reason="the cell finished")
    for a in (1, 3, 5):
        group(100, "instance", action="terminated", instance_id=f"i-{a}")
    return spec, ev


def test_the_display_tells_a_multi_node_job_in_nodes_and_worlds() -> None:
    from spotnb.client import display

    spec, events = _three_node_job()
    view = display.JobView(job_id=spec.job_id, name=spec.name, created=T0,
                           min_nodes=2, max_nodes=3)
    lines = []
    launching = []
    for event in events:
        view.apply(event)  # type: ignore[arg-type]
        text = display.milestone(event, view)  # type: ignore[arg-type]
        if text is not None:
            lines.append(text)
        launching.append(display.header(view).attempt)
    assert lines[:3] == [f"node {k} (attempt {k + 1}): joining, g4dn.xlarge us-east-1a "
                         f"(i-{k + 1})" for k in range(3)]
    assert lines[3] == "world formed: 3 nodes, world size 3 (--nodes 2:3)"
    assert lines[4].startswith("node 1 (attempt 2): spot interruption notice for i-2")
    assert lines[4].endswith("the job goes on with 2 nodes while a replacement boots")
    assert lines[5] == ("world re-formed at 2 nodes, world size 2: going on without "
                        "1 lost node while a replacement boots")
    assert lines[6] == ("node 1 (attempt 5): a replacement instance joining in the lost "
                        "node's place, g4dn.xlarge us-east-1a (i-5)")
    assert lines[7] == "world re-formed at 3 nodes, world size 3: 1 node joined"
    assert len(lines) == 8, lines  # one line per change, not one per node's report
    assert not any("resuming on a replacement" in line for line in lines)
    # Nodes joining are not interruptions; the noticed node is the only one.
    assert [b.attempt for b in view.folded.breaks()] == [2] and view.interruptions == 1
    assert view.worlds == [(T0 + 20, 3, 3), (T0 + 55, 2, 2), (T0 + 80, 3, 3)]
    assert display.header(view).world == "3 nodes (--nodes 2:3), world size 3"
    # While the replacement launches, the header says so (not "attempt 4": a node's
    # attempts are its slot's).
    assert "a replacement node: launching g4dn.xlarge us-east-1a" in launching
    assert not any(text.startswith("attempt") for text in launching)


def test_a_world_change_read_after_a_newer_one_keeps_its_place_in_the_history() -> None:
    # A live follower reads each node's stream as it comes: the re-form at 2 nodes
    # (t=55) may be read only after the re-form at 3 (t=80). The job's worlds are its
    # history, in time order, whatever the reading order; the late change is no news.
    from spotnb.client import display
    from spotnb.protocol.events import codec
    from spotnb.protocol.events.fold import fold

    spec, events = _three_node_job()
    shrunk = [e for e in events if isinstance(codec.peek(e), codec.World)
              and e.time == T0 + 55]
    assert len(shrunk) == 2
    late = [e for e in events if e not in shrunk] + shrunk
    assert fold(late).worlds == [(T0 + 20, 3, 3), (T0 + 55, 2, 2), (T0 + 80, 3, 3)]
    view = display.JobView(job_id=spec.job_id, name=spec.name, created=T0,
                           min_nodes=2, max_nodes=3)
    lines = []
    for event in late:
        view.apply(event)  # type: ignore[arg-type]
        text = display.milestone(event, view)  # type: ignore[arg-type]
        if text is not None and text.startswith("world"):
            lines.append(text)
    assert lines == ["world formed: 3 nodes, world size 3 (--nodes 2:3)"], lines


def test_the_cost_of_a_multi_node_job_counts_every_node() -> None:
    from spotnb.client import display
    from spotnb.client.results import instances_label, nodes_label, summarize

    spec, events = _three_node_job()
    result = summarize(spec, events, {"status": "completed"})  # type: ignore[arg-type]
    # Two nodes for 100 s, the noticed one for 50 s, its replacement for 40 s.
    seconds = 2 * 100 + 50 + 40
    assert result.cost_usd == pytest.approx(SPOT * seconds / 3600)
    assert result.ondemand_cost_usd == pytest.approx(ONDEMAND * seconds / 3600)
    assert result.interruptions == 1
    assert [(a.number, a.node) for a in result.attempts] == [(1, 0), (2, 1), (3, 2), (5, 1)]
    # The nodes without global rank 0 write no result: they ended with the job.
    assert [a.end_reason for a in result.attempts] == [
        "completed", "interrupted", "ended with the job (completed)",
        "ended with the job (completed)"]
    assert result.worlds == ((T0 + 20, 3, 3), (T0 + 55, 2, 2), (T0 + 80, 3, 3))
    # %spot_jobs and `spotnb jobs`: the nodes now, and each node's instance.
    assert nodes_label(spec.resources, result) == "3 nodes (2:3)"
    assert instances_label(result, multinode=True) == "g4dn.xlarge x3 us-east-1a"
    # While it runs, the header's price and projection are those of every node.
    view = display.JobView(job_id=spec.job_id, name=spec.name, created=T0,
                           min_nodes=2, max_nodes=3)
    for event in events[:-4]:  # before the end: three instances billing
        view.apply(event)  # type: ignore[arg-type]
    assert display.header(view).price == (f"spot ${3 * SPOT:.4f}/h for 3 instances "
                                          f"(on-demand ${3 * ONDEMAND:.4f}/h)")


def test_a_multi_node_record_names_its_nodes_and_the_dashboard_plots_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np = pytest.importorskip("numpy")
    from spotnb.client.jobs import JobHandle, summarize
    from spotnb.records.summary import job_record
    from spotnb.widgets import plots, series

    spec, events = _three_node_job()
    result = summarize(spec, events, {"status": "completed"})  # type: ignore[arg-type]
    record = job_record(JobHandle(LocalStore(tmp_path), spec), events=events,  # type: ignore[arg-type]
                        result=result)
    nodes = record["nodes"]
    assert (nodes["min"], nodes["max"], nodes["label"]) == (2, 3, "3 nodes (2:3)")
    assert [w["nodes"] for w in nodes["worlds"]] == [3, 2, 3]
    assert [(i["node"], i["instance_id"], i["instance_type"], i["az"])
            for i in nodes["instances"]] == [
        (0, "i-1", "g4dn.xlarge", "us-east-1a"), (1, "i-5", "g4dn.xlarge", "us-east-1a"),
        (2, "i-3", "g4dn.xlarge", "us-east-1a")]
    assert record["options"]["peer_timeout"] == spec.policy.peer_timeout
    # `spotnb records show` lists each node's instance.
    import argparse

    import nbformat

    from spotnb.records import cli as records_cli

    path = tmp_path / "run.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.metadata["spotnb"] = {"run": {"status": "completed"}, "jobs": [record]}
    nbformat.write(nb, path)
    records_cli.cmd_show(argparse.Namespace(record=str(path), json=False))
    shown = capsys.readouterr().out
    assert "nodes 3 nodes (2:3), world 3 -> 2 -> 3" in shown, shown
    assert ("node 1: g4dn.xlarge us-east-1a (i-5, attempt 5, ended with the job "
            "(completed))") in shown, shown
    # The dashboard: a utilisation line per node (node 1's replacement continues its
    # line after a gap), the world size over time, and no false "lost" marks.
    data = series.DashboardData(max_nodes=3)
    data.add(events)  # type: ignore[arg-type]
    assert {k: len(v) for k, v in data.node_util.items()} == {0: 3, 1: 4, 2: 3}
    _x, y = data.sys_points(data.node_util[1], gaps=data.node_gaps[1])
    assert np.isnan(y).sum() == 1 and y[-1] == 90.0
    assert data.sys_gaps == []  # the nodes' turns in the job's series are no gaps
    t, size, _nodes = data.world_points()
    assert list(size) == [3, 2, 3, 3] and t[-1] == data.last_time
    assert [(m.kind, m.attempt) for m in data.markers] == [("interrupted", 2),
                                                            ("resumed", 5)]
    figure = plots.Plots()
    figure.draw(data)
    names = [trace["name"] for trace in figure.figure.plot_data]
    assert [n for n in names if n.startswith("node ")] == ["node 0 CPU %", "node 1 CPU %",
                                                         "node 2 CPU %"]
    assert "world size" in names
    layout = figure.figure.plot_layout
    # The notice and the replacement are marked on the system panel too.
    assert len(layout["shapes"]) == 2
    assert any(axis.get("title", {}).get("text") == "world size"
               for key, axis in layout.items() if key.startswith("yaxis"))


def _standby_move_job() -> tuple[JobSpec, list[object]]:
    """The events of a --nodes 2 job whose node 1 (attempt 2, i-2) gets a rebalance
    recommendation: standby i-3 launches, is ready, node 1 is ended through its
    termination hook (its notice from Auto Scaling), and the standby joins in its
    place as node 1's next attempt (4): the world re-forms at 2."""
    import json

    from spotnb.protocol.events import GROUP_STREAM, Event

    raw = json.loads(_spec_json())
    raw["resources"].update(min_nodes=2, max_nodes=2, procs_per_node=1)
    raw["created"] = T0
    spec = JobSpec.from_json(json.dumps(raw))
    ev: list[object] = []

    def group(at: float, type_: str, **data: object) -> None:
        ev.append(Event(type_, T0 + at, GROUP_STREAM, data.get("instance_id"), data))  # type: ignore[arg-type]

    def agent(at: float, attempt: int, instance: str, type_: str, **data: object) -> None:
        ev.append(Event(type_, T0 + at, attempt, instance, data))

    where = {"instance_type": "g4dn.xlarge", "az": "us-east-1a",
             "pool": "g4dn.xlarge/us-east-1a"}
    for a in (1, 2):
        group(0, "instance", action="launched", instance_id=f"i-{a}", price=SPOT,
              ondemand=ONDEMAND, **where)
        agent(10, a, f"i-{a}", "status", state="booting", detail=f"attempt {a}",
              instance_type="g4dn.xlarge", az="us-east-1a")
    for rank, a in enumerate((1, 2)):
        agent(20, a, f"i-{a}", "world", generation=1, round=1, nodes=2, world_size=2,
              node_rank=rank, ranks=[rank], min_nodes=2, max_nodes=2)
    agent(25, 1, "i-1", "metric", step=0, t=T0 + 25, values={"loss": 1.0})
    group(30, "instance", action="rebalance", reason="requested", instance_id="i-2", **where)
    agent(30, 2, "i-2", "notice", kind="rebalance", action="rebalance")
    group(30, "instance", action="launched", instance_id="i-3", price=SPOT,
          ondemand=ONDEMAND, standby_for="i-2", **where)
    group(40, "instance", action="standby-ready", instance_id="i-3", standby_for="i-2",
          kernel_started=T0 + 38, **where)
    agent(41, 2, "i-2", "notice", kind="instance-action", action="terminate",
          notice_time="2027-01-15T08:00:00Z", source="auto-scaling")
    agent(41, 2, "i-2", "status", state="interrupted",
          detail="the warm standby is ready: moving to it (this instance ends at "
                 "2027-01-15T08:00:00Z); saving a checkpoint")
    agent(42, 1, "i-1", "metric", step=1, t=T0 + 42, values={"loss": 0.5})
    group(44, "instance", action="terminated", reason="rebalanced", instance_id="i-2",
          **where)
    agent(44, 4, "i-3", "status", state="booting", detail="attempt 4",
          instance_type="g4dn.xlarge", az="us-east-1a")
    agent(44, 4, "i-3", "standby", phase="took-over", kernel_started=T0 + 38,
          ready=T0 + 40, lease_at=T0 + 44, read_bytes=0)
    for rank, (a, i) in enumerate(((1, "i-1"), (4, "i-3"))):
        agent(46, a, i, "world", generation=1, round=2, nodes=2, world_size=2,
              node_rank=rank, ranks=[rank], min_nodes=2, max_nodes=2)
    agent(47, 4, "i-3", "standby", phase="restored", step=1)
    agent(48, 1, "i-1", "metric", step=2, t=T0 + 48, values={"loss": 0.25})
    agent(50, 1, "i-1", "result", status="completed", reason="the cell finished")
    for i in ("i-1", "i-3"):
        group(52, "instance", action="terminated", reason="job-finished", instance_id=i,
              **where)
    return spec, ev


def test_the_display_tells_a_nodes_move_to_its_warm_standby() -> None:
    """A node moved to its warm standby is not an interruption: the node's attempt
    ended "moved to its standby", the standby joins in its place, and the fold tells
    the standby's story (booting, ready, handed over)."""
    from spotnb.client import display
    from spotnb.client.jobs import summarize
    from spotnb.protocol.events.fold import fold

    spec, events = _standby_move_job()
    view = display.JobView(job_id=spec.job_id, name=spec.name, created=T0,
                           min_nodes=2, max_nodes=2)
    lines = []
    for event in events:
        view.apply(event)  # type: ignore[arg-type]
        text = display.milestone(event, view)  # type: ignore[arg-type]
        if text is not None:
            lines.append(text)
    assert lines == [
        "node 0 (attempt 1): joining, g4dn.xlarge us-east-1a (i-1)",
        "node 1 (attempt 2): joining, g4dn.xlarge us-east-1a (i-2)",
        "world formed: 2 nodes, world size 2 (--nodes 2:2)",
        "node 1 (attempt 2): rebalance recommendation for i-2: it is at elevated risk of "
        "interruption; every rank saves a checkpoint",
        "rebalance recommendation: standby booting",
        "standby ready",
        "node 1 (attempt 2): its warm standby i-3 is ready: moving to it; every rank "
        "saves a checkpoint, then the standby joins the world in its place",
        "node 1 (attempt 4): its warm standby joining in its place, g4dn.xlarge "
        "us-east-1a (i-3)",
        "handed over in 6.0 s",
    ], lines
    state = fold(events, 2)  # type: ignore[arg-type]
    (sb,) = state.standbys.values()
    assert (sb.standby_for, sb.attempt, state.handover_seconds(sb)) == ("i-2", 4, 6.0)
    result = summarize(spec, events, {"status": "completed"})  # type: ignore[arg-type]
    assert result.interruptions == 0
    assert [(a.number, a.node, a.end_reason) for a in result.attempts] == [
        (1, 0, "completed"), (2, 1, "moved to its standby"),
        (4, 1, "ended with the job (completed)")]


def _joined_job(kill: bool) -> tuple[JobSpec, list[object]]:
    """A --nodes 2:3 job whose global rank 0 is node 0 (attempt 1) throughout, logging
    a step a second. With ``kill``, node 2 (attempt 3) is lost without a notice after
    step 40 and the survivors restore the checkpoint of step 30 (steps 31-40 run
    again). Then node 2's replacement (attempt 6) joins; the save before the join (at
    step 60) cannot be read and the world restores step 55's: steps 56-60 run again."""
    import json

    from spotnb.protocol.events import GROUP_STREAM, Event

    raw = json.loads(_spec_json())
    raw["resources"].update(min_nodes=2, max_nodes=3, procs_per_node=1)
    raw["created"] = T0
    spec = JobSpec.from_json(json.dumps(raw))
    ev: list[object] = []

    def agent(at: float, attempt: int, type_: str, **data: object) -> None:
        ev.append(Event(type_, T0 + at, attempt, f"i-{attempt}", data))

    def rows(attempt: int, steps: range, at: float) -> None:
        for k, step in enumerate(steps):
            agent(at + k, attempt, "metric", step=step, t=T0 + at + k,
                  values={"loss": 1.0 / (step + 1)})

    for a in (1, 2, 3):
        ev.append(Event("instance", T0, GROUP_STREAM, f"i-{a}", {
            "action": "launched", "instance_id": f"i-{a}", "pool": "p", "price": SPOT,
            "ondemand": ONDEMAND}))
        agent(1, a, "status", state="booting")
    if kill:
        rows(1, range(41), 10)
        agent(60, 1, "status", state="restoring", detail="re-forming without node 2")
        rows(1, range(31, 61), 70)  # steps 31-40 again
        at = 100
    else:
        rows(1, range(61), 10)
        at = 71
    agent(at + 10, 6, "status", state="booting")
    agent(at + 20, 1, "joined", nodes=[2], node_count=3, world_size=3, step=55,
          saved_step=60)
    rows(1, range(56, 100), at + 21)  # steps 56-60 again
    agent(at + 80, 1, "result", status="completed", reason="the cell finished")
    return spec, ev


@pytest.mark.parametrize("kill", [False, True])
def test_the_steps_redone_are_one_number_in_the_header_the_record_the_joined_line_and_slack(
        tmp_path: Path, kill: bool) -> None:
    """The steps a multi-node job redid are the fold's, wherever they are said: the
    header, the record, the notification at the end, and the "joined" line, which tells
    the join's own (before: the header counted rows logged again, the record and the
    notification only attempts that ended, the joined line the agent's own count: a job
    could show four numbers)."""
    from spotnb.client import display
    from spotnb.client.jobs import JobHandle
    from spotnb.protocol import notify
    from spotnb.records.summary import job_record

    spec, events = _joined_job(kill)
    view = display.JobView(job_id=spec.job_id, name=spec.name, created=T0, min_nodes=2,
                           max_nodes=3)
    joined = []
    for event in events:
        view.apply(event)  # type: ignore[arg-type]
        joined += [text for about, text in display.milestones(event, view)  # type: ignore[arg-type]
                   if about.type == "joined"]
    total = 5 + (10 if kill else 0)
    view.now = view.folded.last_time or T0
    assert display.header(view).lost.endswith(f"; {total} steps redone"), display.header(view)
    assert joined == ["node 2 joined: world 3, 5 steps redone (saved at step 60 before "
                      "re-forming)"], joined
    store = LocalStore(tmp_path)
    record = job_record(JobHandle(store, spec), events=events)  # type: ignore[arg-type]
    assert record["redone_steps"] == total
    assert f" · {total} steps redone" in notify.job_summary(view.folded, view.now)
