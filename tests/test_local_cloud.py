"""The local cloud end to end: real supervisor and instance processes, real IMDS, a real
store. The instances run a stand-in agent (tests/local_cloud_agent.py) that behaves
towards the group as the real agent does."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import re
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import wait_until

from spotnb.protocol.events import Event, EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.layout import RESULT, STOP
from spotnb.protocol.signals import SignalModel
from spotnb.protocol.spec import JobSpec, Policy, Resources, SpecError
from spotnb.protocol.standby import STANDBY_WARMUP_SECONDS
from spotnb.protocol.store import LocalStore
from spotnb.providers import ProviderError, catalog
from spotnb.providers.imds import ImdsClient
from spotnb.providers.local import LocalProvider
from spotnb.providers.local.group import Supervisor
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.lifecycle import send_signals
from spotnb.providers.local.market import Market
from spotnb.providers.local.state import Settings, instance_dir

AGENT = Path(__file__).with_name("local_cloud_agent.py")


@dataclasses.dataclass
class Cloud:
    home: Path
    root: Path
    provider: LocalProvider

    def spec(self, job_id: str = "job-1", types: tuple[str, ...] = ("g4dn.xlarge",),
             **fields: Any) -> JobSpec:
        store = LocalStore(self.root / "store" / "jobs" / job_id)
        resources = Resources(types, "us-east-1", fields.pop("max_price", None),
                              min_nodes=fields.pop("min_nodes", 1),
                              max_nodes=fields.pop("max_nodes", 1))
        return JobSpec(job_id=job_id, name="test", code="pass", provider="local",
                       resources=resources, policy=fields.pop("policy", Policy()),
                       store_uri=store.uri, created=time.time(), **fields)


def _our_processes(home: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if (proc.environ().get("SPOTNB_HOME") == str(home)
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture
def cloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
          private_tmpdir: Path) -> Iterator[Cloud]:
    yield from local_cloud(tmp_path, monkeypatch)


def local_cloud(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cloud]:
    """The local cloud of a test (its own SPOTNB_HOME, the stand-in agent, no hazard, a
    short notice), and no process of it left afterwards (the ``cloud`` fixture)."""
    home = tmp_path / "home"
    monkeypatch.setenv("SPOTNB_HOME", str(home))
    for name in list(os.environ):
        if name.startswith(("SPOTNB_LOCAL_", "STANDIN_", "SPOTNB_IMDS")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("SPOTNB_LOCAL_AGENT_CMD", shlex.join([sys.executable, str(AGENT)]))
    # Instances start with a clean environment; the stand-in's settings are let through.
    monkeypatch.setenv("SPOTNB_LOCAL_INSTANCE_ENV", "STANDIN_*")
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "0.5")
    yield Cloud(home, tmp_path, LocalProvider())
    leftovers = _our_processes(home)
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            continue
    assert not leftovers, f"processes outlived the test: {leftovers}"


def group_events(spec: JobSpec, type: str | None = None, **match: Any) -> list[Event]:
    events = EventReader(LocalStore(spec.store_uri.removeprefix("file://"))).replay()
    return [e for e in events if e.attempt == 0 and (type is None or e.type == type)
            and all(e.data.get(k) == v for k, v in match.items())]


def store_of(spec: JobSpec) -> LocalStore:
    return LocalStore(spec.store_uri.removeprefix("file://"))


def result_of(spec: JobSpec) -> dict[str, Any] | None:
    store = store_of(spec)
    return json.loads(store.get(RESULT)) if store.exists(RESULT) else None


def identity_of(instance_id: str) -> dict[str, Any] | None:
    path = instance_dir(instance_id) / "identity.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet, or half-written: the stand-in
        return None  # writes it in place, not atomically


def group_gone(cloud: Cloud, spec: JobSpec) -> bool:
    info = cloud.provider.group(spec.job_id)
    return info is not None and not info["alive"]


def launched(spec: JobSpec, count: int = 1) -> list[Event]:
    """The group's launched events, once there are at least ``count``."""
    def enough() -> list[Event] | None:
        found = group_events(spec, "instance", action="launched")
        return found if len(found) >= count else None

    return wait_until(enough, 10, f"{count} launched instance(s)")


# ---------------------------------------------------------------------- lifecycle


def test_interruption_notice_then_termination_then_replacement(cloud: Cloud) -> None:
    spec = cloud.spec()
    cloud.provider.launch(spec)
    first = launched(spec)[0].data
    ident = wait_until(lambda: identity_of(first["instance_id"]), 10, "the agent's IMDS identity")
    # The agent learned who it is from its own IMDS, as on EC2.
    assert ident["instance_id"] == first["instance_id"]
    assert ident["instance_type"] == "g4dn.xlarge"
    assert ident["az_id"] == first["az"] and ident["region"] == "us-east-1"
    assert first["pool"] == f"g4dn.xlarge@{first['az']}"
    assert 0 < first["price"] <= first["ondemand"]
    assert group_events(spec, "price", pool=first["pool"])

    cloud.provider.interrupt(spec.job_id)
    notice_file = instance_dir(first["instance_id"]) / "notice.json"
    seen = json.loads(wait_until(lambda: notice_file.read_text() if notice_file.exists() else None,
                                 10, "the agent to see the notice"))
    assert seen["action"] == "terminate" and seen["rebalance"] is not None
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        10, "the notice event")[0]
    assert notice.instance == first["instance_id"] and notice.data["reason"] == "requested"

    second = launched(spec, 2)[1].data
    assert second["instance_id"] != first["instance_id"]
    ended = wait_until(lambda: group_events(spec, "instance", action="terminated",
                                            instance_id=first["instance_id"]),
                       10, "the terminated event")[0]
    assert ended.data["reason"] == "spot-interruption"
    assert ended.time - notice.time >= 0.45  # the notice period
    assert not psutil.pid_exists(ident["pid"]) or psutil.Process(
        ident["pid"]).status() == psutil.STATUS_ZOMBIE
    # The replacement's agent took the lease at once and works as attempt 2.
    wait_until(lambda: [e for e in EventReader(store_of(spec)).replay()
                        if e.attempt == 2 and e.instance == second["instance_id"]],
               10, "events of attempt 2")

    cloud.provider.terminate(spec.job_id)
    result = result_of(spec)
    assert result is not None and result["status"] == "stopped"


def test_a_multi_node_group_keeps_its_nodes_and_replaces_the_interrupted_one(
        cloud: Cloud) -> None:
    spec = cloud.spec(min_nodes=2, max_nodes=3)
    cloud.provider.launch(spec)
    nodes = [e.data for e in launched(spec, 3)]
    idents = [wait_until(lambda n=n: identity_of(n["instance_id"]),
                         10, "each node's IMDS identity") for n in nodes]
    # Three instances, each with its own metadata service.
    assert len({i["instance_id"] for i in idents}) == 3
    assert [i["instance_id"] for i in idents] == [n["instance_id"] for n in nodes]
    assert all(i["address"] == "127.0.0.1" for i in idents)
    # A notice for one named node: that node, and only it, is terminated and replaced.
    victim = nodes[1]["instance_id"]
    cloud.provider.interrupt(spec.job_id, instance=victim)
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        10, "the notice event")
    assert [e.instance for e in notice] == [victim]
    fourth = launched(spec, 4)[3].data
    assert fourth["instance_id"] not in {n["instance_id"] for n in nodes}
    ended = group_events(spec, "instance", action="terminated")
    assert [e.data["instance_id"] for e in ended] == [victim]
    assert ended[0].data["reason"] == "spot-interruption"
    cloud.provider.terminate(spec.job_id)
    ended = group_events(spec, "instance", action="terminated")
    assert {e.data["instance_id"] for e in ended} == {
        *(n["instance_id"] for n in nodes), fourth["instance_id"]}


def test_two_notices_in_one_tick_reach_two_nodes_and_a_kill_gives_none(
        cloud: Cloud) -> None:
    """Two interruption requests the supervisor reads in the same tick are two notices
    (the second overwrote the first); a kill ends a node at once, without a notice."""
    spec = cloud.spec(min_nodes=1, max_nodes=3)
    cloud.provider.launch(spec)
    nodes = [e.data["instance_id"] for e in launched(spec, 3)]
    idents = [wait_until(lambda n=n: identity_of(n), 30, "each node's agent")  # type: ignore[misc]
              for n in nodes]
    supervisor = psutil.Process(cloud.provider.group(spec.job_id)["supervisor"]["pid"])  # type: ignore[index]
    supervisor.suspend()  # both requests wait for the same tick
    try:
        cloud.provider.interrupt(spec.job_id)
        cloud.provider.interrupt(spec.job_id, instance=nodes[2])
    finally:
        supervisor.resume()
    try:
        _two_notices_and_a_kill(cloud, spec, nodes, idents)
    finally:
        cloud.provider.terminate(spec.job_id)


def _two_notices_and_a_kill(cloud: Cloud, spec: JobSpec, nodes: list[str],
                            idents: list[dict[str, Any]]) -> None:
    notices = wait_until(lambda: (found := group_events(spec, "instance", action="notice"))
                         and len(found) >= 2 and found, 30, "two notices")
    assert sorted(e.instance for e in notices) == sorted([nodes[0], nodes[2]])
    # A kill: the node's agent dies at once, no notice, and the group replaces it.
    cloud.provider.kill(spec.job_id, instance=nodes[1])
    ended = wait_until(lambda: group_events(spec, "instance", action="terminated",
                                            instance_id=nodes[1]), 30, "the kill")
    assert ended[0].data["reason"] == "killed"
    assert not psutil.pid_exists(idents[1]["pid"]) or psutil.Process(
        idents[1]["pid"]).status() == psutil.STATUS_ZOMBIE
    notices = group_events(spec, "instance", action="notice")
    assert nodes[1] not in {e.instance for e in notices}
    launched(spec, 4)


def test_no_capacity_falls_back_to_the_next_type(cloud: Cloud,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    g4dn = [p.az for p in catalog.pools("g4dn.xlarge", "us-east-1")]
    open_az = g4dn[-1]
    blocked = ["g5.xlarge"] + [f"g4dn.xlarge@{az}" for az in g4dn[:-1]]
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", ",".join(blocked))
    spec = cloud.spec(types=("g5.xlarge", "g4dn.xlarge"))
    cloud.provider.launch(spec)
    inst = launched(spec)[0]
    assert (inst.data["instance_type"], inst.data["az"]) == ("g4dn.xlarge", open_az)

    errors = group_events(spec, "instance", action="capacity_error")
    assert {e.data["reason"] for e in errors} == {"InsufficientInstanceCapacity"}
    expected = {p.name for p in catalog.pools("g5.xlarge", "us-east-1")} | set(blocked[1:])
    assert {e.data["pool"] for e in errors} == expected
    waiting = group_events(spec, "status", state="waiting_for_capacity")
    assert waiting and waiting[0].time <= inst.time
    cloud.provider.terminate(spec.job_id)


def test_capacity_returns_while_the_job_waits(cloud: Cloud) -> None:
    config = cloud.home / "cloud" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps({"no_capacity": ["g4dn.xlarge"], "boot_seconds": 0.5}))
    spec = cloud.spec()
    cloud.provider.launch(spec)
    waiting = wait_until(lambda: group_events(spec, "status", state="waiting_for_capacity"),
                         10, "the group to wait for capacity")[0]
    assert not group_events(spec, "instance", action="launched")
    config.write_text(json.dumps({"no_capacity": [], "boot_seconds": 0.5}))
    inst = launched(spec)[0]
    assert inst.time - waiting.time >= 2.5  # the group retries every few seconds
    # The agent starts after the simulated boot time.
    wait_until(lambda: identity_of(inst.data["instance_id"]), 10, "the agent")
    record = cloud.provider.instances(spec.job_id)[0]
    assert record["state"] == "running"
    identity_file = instance_dir(inst.data["instance_id"]) / "identity.json"
    assert identity_file.stat().st_mtime >= inst.time + 0.5
    cloud.provider.terminate(spec.job_id)


def test_a_shortage_names_types_pools_regions_or_types_in_a_region_for_a_while(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    """The capacity model: a type anywhere, a pool, a whole region, a type in a region;
    for ``no_capacity_seconds`` from a group's start, or as long as it is set; a name
    the catalog does not know is refused (a typo would leave the capacity there)."""
    use1 = catalog.pools("g5.xlarge", "us-east-1")[0].az
    usw2 = catalog.pools("g5.xlarge", "us-west-2")[0].az
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", f"us-east-1,g5.xlarge@us-west-2,"
                                                   f"g4dn.xlarge@{usw2}")
    settings = Settings.load()
    assert not settings.has_capacity("g4dn.xlarge", use1)  # the whole region
    assert not settings.has_capacity("g5.xlarge", usw2)  # the type in the region
    assert not settings.has_capacity("g4dn.xlarge", usw2)  # the pool
    assert settings.has_capacity("g6.xlarge", usw2)
    assert settings.has_capacity("g5.xlarge", catalog.pools("g5.xlarge", "eu-west-1")[0].az)
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY_SECONDS", "30")
    settings = Settings.load()
    assert not settings.has_capacity("g4dn.xlarge", use1, since_start=29.9)
    assert settings.has_capacity("g4dn.xlarge", use1, since_start=30.0)  # back
    assert not settings.has_capacity("g4dn.xlarge", use1)  # at a launch's checks: short
    for typo in ("us-east1", "g5.xlarge@us-east1", "g5.xlarg"):
        monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY", typo)
        with pytest.raises(SpecError, match=f"{re.escape(repr(typo))} is no instance "
                                            "type, pool or region"):
            Settings.load()


def test_a_failed_launch_leaves_nothing_behind(cloud: Cloud) -> None:
    spec = cloud.spec()
    store_of(spec).put("spec.json", b"{not json")
    with pytest.raises(ProviderError, match="could not start the capacity group"):
        cloud.provider.launch(spec)
    assert _our_processes(cloud.home) == []
    assert cloud.provider.group(spec.job_id) is None


def test_terminate_leaves_no_process_and_is_idempotent(cloud: Cloud) -> None:
    spec = cloud.spec()
    cloud.provider.launch(spec)
    instance_id = launched(spec)[0].data["instance_id"]
    agent_pid = wait_until(lambda: identity_of(instance_id), 10, "the agent")["pid"]
    group = cloud.provider.group(spec.job_id)
    assert group is not None and group["alive"]
    # The supervisor, the instance's first process (the reaper) and the agent.
    assert len(_our_processes(cloud.home)) == 3

    cloud.provider.terminate(spec.job_id)
    assert _our_processes(cloud.home) == []
    assert agent_pid not in {p.pid for p in _our_processes(cloud.home)}
    assert group_gone(cloud, spec)
    result = result_of(spec)
    assert result is not None and result["status"] == "stopped"
    ended = group_events(spec, "instance", action="terminated")
    assert [e.data["reason"] for e in ended] == ["group-terminated"]
    cloud.provider.terminate(spec.job_id)  # again: nothing left to do, no error
    cloud.provider.terminate("never-launched")


def test_finished_job_ends_the_group(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_STEPS", "5")
    spec = cloud.spec()
    cloud.provider.launch(spec)
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    assert result_of(spec) == {"status": "completed", "reason": ""}
    ended = group_events(spec, "instance", action="terminated")
    assert [e.data["reason"] for e in ended] == ["job-finished"]
    assert ended[0].data["cost_usd"] > 0


def test_stop_request_lets_the_agent_stop_itself(cloud: Cloud) -> None:
    spec = cloud.spec()
    cloud.provider.launch(spec)
    instance_id = launched(spec)[0].data["instance_id"]
    wait_until(lambda: identity_of(instance_id), 10, "the agent")
    store_of(spec).put(STOP, json.dumps({"reason": "user"}).encode())
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    assert result_of(spec) == {"status": "stopped", "reason": "stop requested"}  # the agent's
    ended = group_events(spec, "instance", action="terminated")
    assert [e.data["reason"] for e in ended] == ["job-finished"]
    assert len(group_events(spec, "instance", action="launched")) == 1


@pytest.mark.parametrize("limit", ["budget", "deadline"])
def test_budget_and_deadline_stop_an_agent_that_ignores_stop(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    """The budget stops the job at the cost the header shows: the fold's, of the log as
    it stood at the check (before, the local cloud summed its own market's price over
    each instance's time, and AWS and every view the fold's)."""
    monkeypatch.setenv("STANDIN_MODE", "ignore-stop")
    monkeypatch.setenv("SPOTNB_LOCAL_STOP_GRACE", "0.5")
    # g4dn.xlarge costs about $0.18/h, $0.00005/s: the budget lasts well under a second.
    policy = Policy(budget_usd=0.00003) if limit == "budget" else Policy(max_duration=1.0)
    spec = cloud.spec(policy=policy)
    cloud.provider.launch(spec)
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    stop = json.loads(store_of(spec).get(STOP))
    assert stop["reason"] == limit and stop["detail"]
    if limit == "budget":
        logged = [e for e in EventReader(store_of(spec), batches=True).poll()
                  if e.time <= stop["time"]]
        shown = fold(logged).cost_usd(stop["time"])
        assert stop["cost_usd"] == pytest.approx(shown, rel=1e-9, abs=1e-12)
        assert stop["cost_usd"] > 0.00003 and f"${shown:.4f}" in stop["detail"]
    result = result_of(spec)
    assert result is not None and (result["status"], result["reason"]) == ("stopped", limit)
    assert group_events(spec, "result", status="stopped", reason=limit)
    ended = group_events(spec, "instance", action="terminated")
    assert [e.data["reason"] for e in ended] == ["stopped"]


def test_crash_loop_fails_the_job(cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_MODE", "crash")
    spec = cloud.spec()
    cloud.provider.launch(spec)
    wait_until(lambda: group_gone(cloud, spec), 20, "the group to give up")
    result = result_of(spec)
    assert result is not None and result["status"] == "failed"
    assert "crashed repeatedly" in result["reason"]
    log_path = result["reason"].rsplit("see ", 1)[1]
    assert "crashing on purpose" in Path(log_path).read_text()
    assert len(group_events(spec, "instance", action="launched")) == 5
    assert {e.data["reason"] for e in group_events(spec, "instance", action="terminated")} == {
        "agent-exited"}


# ---------------------------------------------------------- simulated interruptions


def test_simulated_interruption_waits_for_a_checkpoint_and_progress(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_CHECKPOINT_AT", "3")
    monkeypatch.setenv("STANDIN_STEPS", "15")
    spec = cloud.spec(simulate_interruptions={"count": 1})
    cloud.provider.launch(spec)
    wait_until(lambda: group_gone(cloud, spec), 20, "the job to finish")
    assert result_of(spec) == {"status": "completed", "reason": ""}

    notices = group_events(spec, "instance", action="notice")
    assert [n.data["reason"] for n in notices] == ["simulated"]  # one, as asked
    first = [e for e in EventReader(store_of(spec)).replay() if e.attempt == 1]
    durable = next(e for e in first if e.type == "checkpoint")
    assert any(e.type == "metric" and durable.time <= e.time <= notices[0].time for e in first)
    assert len(group_events(spec, "instance", action="launched")) == 2


def test_scheduled_interruption(cloud: Cloud) -> None:
    spec = cloud.spec(simulate_interruptions={"schedule": [1.0]})
    cloud.provider.launch(spec)
    first = launched(spec)[0]
    launched(spec, 2)
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        10, "the notice event")[0]
    assert notice.data["reason"] == "scheduled"
    assert notice.instance == first.data["instance_id"]
    assert 1.0 <= notice.time - first.time < 3.0
    cloud.provider.terminate(spec.job_id)


def test_price_above_max_price_interrupts(cloud: Cloud,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    pools = catalog.pools("g4dn.xlarge", "us-east-1")
    monkeypatch.setenv("SPOTNB_LOCAL_NO_CAPACITY",
                       ",".join(p.name for p in pools[1:]))
    # The whole 3-month history replays in about 20 s; the max price is its median.
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "400000")
    max_price = pools[0].spot
    spec = cloud.spec(job_id="price-2", max_price=max_price)
    cloud.provider.launch(spec)
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        30, "a price interruption")[0]
    assert notice.data["reason"] == "price" and notice.data["price"] > max_price
    launch = group_events(spec, "instance", action="launched")[0]
    assert launch.data["price"] <= max_price
    assert any(e.data["price"] > max_price for e in group_events(spec, "price"))
    cloud.provider.terminate(spec.job_id)


def test_hazard_interrupts_at_the_advisor_rate(cloud: Cloud,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # p3.2xlarge in us-east-1 is in the ">20%" bucket: read as one interruption a month.
    # Compressed 2.6 million times, that is about one a second.
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "1")
    monkeypatch.setenv("SPOTNB_LOCAL_SEED", "7")
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "2600000")
    spec = cloud.spec(types=("p3.2xlarge",))
    cloud.provider.launch(spec)
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        15, "a hazard interruption")[0]
    assert notice.data["reason"] == "hazard"
    cloud.provider.terminate(spec.job_id)


# ------------------------------------------------------------- provider contract


def test_validate_refuses_bad_specs_before_starting_anything(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    provider = cloud.provider
    with pytest.raises(SpecError, match=r"did you mean 'g5\.xlarge'"):
        provider.launch(cloud.spec(types=("g5.xlarg",)))
    with pytest.raises(SpecError, match="max_price must be a positive"):
        provider.launch(cloud.spec(max_price=0.0))
    with pytest.raises(SpecError, match="would never start"):
        provider.launch(cloud.spec(max_price=0.001))
    with pytest.raises(SpecError, match="simulate_interruptions"):
        provider.launch(cloud.spec(simulate_interruptions={"count": -1}))
    with pytest.raises(SpecError, match="job id"):
        provider.launch(cloud.spec(job_id="../escape"))
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "fast")
    with pytest.raises(SpecError, match="SPOTNB_LOCAL_TIME_SCALE"):
        provider.launch(cloud.spec())
    assert not (cloud.home / "cloud" / "groups").exists()
    with pytest.raises(ProviderError, match="no running capacity group"):
        provider.interrupt("job-1")


def test_a_job_has_one_group(cloud: Cloud) -> None:
    spec = cloud.spec()
    cloud.provider.launch(spec)
    with pytest.raises(ProviderError, match="already has a running capacity group"):
        cloud.provider.launch(spec)
    cloud.provider.terminate(spec.job_id)


def test_cleanup_kills_orphans_of_a_dead_supervisor(cloud: Cloud) -> None:
    spec = cloud.spec()
    cloud.provider.launch(spec)
    instance_id = launched(spec)[0].data["instance_id"]
    agent_pid = wait_until(lambda: identity_of(instance_id), 10, "the agent")["pid"]
    group = cloud.provider.group(spec.job_id)
    assert group is not None
    os.kill(group["supervisor"]["pid"], signal.SIGKILL)  # the supervisor dies hard
    wait_until(lambda: group_gone(cloud, spec), 10, "the supervisor to die")

    planned = cloud.provider.cleanup(dry_run=True)
    assert any("would remove capacity group job-1" in line for line in planned)
    assert any(instance_id in line and "would kill" in line for line in planned)
    assert psutil.pid_exists(agent_pid)  # a dry run changes nothing

    done = cloud.provider.cleanup()
    assert any(instance_id in line for line in done)
    assert _our_processes(cloud.home) == []
    assert not (cloud.home / "cloud" / "groups" / "job-1").exists()
    assert cloud.provider.cleanup() == []


def escapees_of(instance_id: str) -> list[psutil.Process] | None:
    """The processes the stand-in started to outlive its instance (STANDIN_ESCAPEES)."""
    try:
        pids = json.loads((instance_dir(instance_id) / "escapees.json").read_text())
    except (OSError, ValueError):
        return None
    return [psutil.Process(pid) for pid in pids.values()]


def _running(proc: psutil.Process) -> bool:
    try:  # a zombie has ended: reaping it is its parent's business (pid 1's here)
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ended(procs: list[psutil.Process], what: str, timeout: float = 30.0) -> None:
    try:
        wait_until(lambda: not any(_running(p) for p in procs), timeout, what)
    finally:
        alive = [p for p in procs if _running(p)]
        for proc in alive:  # not our fixture's to find: they lack SPOTNB_HOME
            proc.kill()
    assert not alive, f"{what}: {alive} outlived their instance"


def test_an_agent_killed_outright_leaves_no_process_behind(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_ESCAPEES", "1")
    spec = cloud.spec()
    cloud.provider.launch(spec)
    first = launched(spec)[0].data["instance_id"]
    agent_pid = wait_until(lambda: identity_of(first), 10, "the agent")["pid"]
    escapees = wait_until(lambda: escapees_of(first), 10, "the agent's escapees")
    os.kill(agent_pid, signal.SIGKILL)
    _ended(escapees, "a child with env={} and a SIGTERM-proof daemon of a killed agent")
    wait_until(lambda: group_events(spec, "instance", action="terminated",
                                    instance_id=first), 10, "the instance's end")
    # Its replacement's escapees end with the job too.
    second = launched(spec, 2)[1].data["instance_id"]
    replaced = wait_until(lambda: escapees_of(second), 10, "the replacement's escapees")
    cloud.provider.terminate(spec.job_id)
    _ended(replaced, "the escapees of a terminated job")


def test_cleanup_finds_processes_without_markers_whose_instance_died(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_ESCAPEES", "1")
    spec = cloud.spec()
    cloud.provider.launch(spec)
    instance_id = launched(spec)[0].data["instance_id"]
    agent_pid = wait_until(lambda: identity_of(instance_id), 10, "the agent")["pid"]
    escapees = wait_until(lambda: escapees_of(instance_id), 10, "the agent's escapees")
    group = cloud.provider.group(spec.job_id)
    assert group is not None
    reaper = json.loads((instance_dir(instance_id) / "pid.json").read_text())["pid"]
    # Everything spotnb started for the instance dies at once (a machine's OOM killer):
    # what the agent started is left under pid 1, one of them without spotnb's markers.
    spotnbs = []
    for pid in (group["supervisor"]["pid"], reaper, agent_pid):
        with contextlib.suppress(psutil.NoSuchProcess):  # the agent dies with the reaper
            spotnbs.append(psutil.Process(pid))
            spotnbs[-1].kill()
    wait_until(lambda: not any(_running(p) for p in spotnbs), 10, "spotnb's processes to die")
    try:
        planned = cloud.provider.cleanup(dry_run=True)
        for proc in escapees:
            assert any(f"would kill orphan process {proc.pid} of instance {instance_id}"
                       in line for line in planned), planned
        cloud.provider.cleanup()
    finally:
        _ended(escapees, "processes of a dead instance after `spotnb cleanup`", 10.0)


def test_prices_come_from_the_catalog(cloud: Cloud) -> None:
    price = cloud.provider.prices("g4dn.xlarge", "us-east-1")
    cheapest = catalog.pools("g4dn.xlarge", "us-east-1")[0]
    assert (price.az, price.spot, price.ondemand) == (cheapest.az, cheapest.spot, 0.526)
    assert "catalog" in price.source
    with pytest.raises(SpecError):
        cloud.provider.prices("g4dn.xlarge", "mars-1")


# ---------------------------------------------------------------------- market


def test_market_replays_the_trace_time_compressed() -> None:
    pool = catalog.pools("p3.2xlarge", "us-east-1")[0]
    market = Market(pool, start_wall=1000.0, time_scale=60.0, seed="job-a")
    t = 1000.0
    prices = []
    for _ in range(5):
        change = market.next_change_after(t)
        assert change is not None and change > t
        assert market.price_at(change) != market.price_at(change - 1e-3)
        prices.append(market.price_at(change))
        t = change
    trace_prices = {p for _, p in market.trace.points}
    assert set(prices) <= trace_prices
    # One cycle later the market repeats itself.
    cycle = market.period / 60.0
    assert market.price_at(1234.5 + cycle) == market.price_at(1234.5)
    # The start in the trace depends on the seed only.
    same = Market(pool, 1000.0, 60.0, seed="job-a")
    other = Market(pool, 1000.0, 60.0, seed="job-b")
    assert same.offset == market.offset != other.offset


def test_market_knows_when_the_price_first_rises_above_a_limit() -> None:
    pool = catalog.pools("p3.2xlarge", "us-east-1")[0]
    market = Market(pool, start_wall=1000.0, time_scale=60.0, seed="job-a")
    prices = sorted({p for _, p in market.trace.points})
    limit = prices[len(prices) // 2]
    crossing = market.next_above(1000.0, limit)
    assert crossing is not None and market.price_at(crossing) > limit
    t = 1000.0  # no change before it rises above the limit
    while (change := market.next_change_after(t)) is not None and change < crossing:
        assert market.price_at(change) <= limit
        t = change
    assert market.next_above(1000.0, prices[-1]) is None  # never above its highest


def test_market_cost_integrates_price_over_time() -> None:
    pool = catalog.pools("p3.2xlarge", "us-east-1")[0]
    market = Market(pool, start_wall=0.0, time_scale=60.0, seed="job-a")
    start = 10.0
    end = market.next_change_after(start)
    assert end is not None
    # Between changes the price holds: cost is price x hours.
    expected = market.price_at(start) * (end - 1e-3 - start) / 3600
    assert market.cost(start, end - 1e-3) == pytest.approx(expected, rel=1e-6)
    # Over a long run the cost is bounded by the cheapest and dearest price.
    long_run = market.cost(0.0, 7200.0)
    low, high = (f(p for _, p in market.trace.points) for f in (min, max))
    assert 2 * low <= long_run <= 2 * high


def test_a_process_record_taken_as_the_exec_ends_still_knows_the_process(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """An agent's record is taken right after it is started, when its command line may
    still read empty (the kernel finishing the exec): a record of that would never
    recognise the agent again, and a restarted supervisor would leave it running."""
    import subprocess

    from spotnb.providers.local.state import ProcessRecord

    cmd = [sys.executable, "-c", "import sys; sys.stdin.read()", "spotnb-test-agent"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE)
    try:
        wait_until = time.monotonic() + 60
        while psutil.Process(proc.pid).cmdline() != cmd:  # the exec is over
            assert time.monotonic() < wait_until, "the child never showed its command line"
            time.sleep(0.05)
        real = psutil.Process.cmdline
        exec_window = True  # what /proc shows while the kernel finishes an exec

        def cmdline(self: psutil.Process) -> list[str]:
            return [] if exec_window else real(self)

        monkeypatch.setattr(psutil.Process, "cmdline", cmdline)
        record = ProcessRecord.of(proc.pid, cmd)
        exec_window = False
        assert record.cmdline == tuple(cmd)
        assert record.process() is not None and record.alive()
        # What a later supervisor reads back from pid.json recognises it too.
        again = ProcessRecord.from_dict(record.to_dict())
        assert again is not None and again.alive()
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(timeout=60)
    assert not record.alive()  # gone: nothing to kill


def test_a_job_that_ends_while_its_supervisor_is_dead_logs_its_instances_end(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STANDIN_STEPS", "40")
    spec = cloud.spec()
    cloud.provider.launch(spec)
    instance_id = launched(spec)[0].data["instance_id"]
    wait_until(lambda: identity_of(instance_id), 10, "the agent")
    group = cloud.provider.group(spec.job_id)
    assert group is not None and group["state"] == "ready"
    os.kill(group["supervisor"]["pid"], signal.SIGKILL)  # the supervisor alone
    wait_until(lambda: result_of(spec), 30, "the job's result")
    # Nobody looks at the job: its instance's end is logged all the same, and its
    # group says it exited.
    ended = wait_until(lambda: group_events(spec, "instance", action="terminated",
                                            instance_id=instance_id),
                       30, "the instance's end in the group's log")
    assert len(ended) == 1
    wait_until(lambda: (cloud.provider.group(spec.job_id) or {}).get("state") == "exited",
               30, "group.json to say the group exited")
    wait_until(lambda: group_gone(cloud, spec), 10, "the supervisor to exit")
    assert not any(e.type == "status" and e.data.get("state") == "launching"
                   and e.time > ended[0].time for e in group_events(spec))


# ------------------------------------------------------------ rebalance signals


def test_signal_model_draws_follow_its_stated_distribution() -> None:
    model = SignalModel(seed="s")
    rng = random.Random("draws")
    leads = [model.draw(rng) for _ in range(20000)]
    assert [model.draw(random.Random("x")) for _ in range(3)] == \
        [model.draw(random.Random("x")) for _ in range(3)]  # seeded: the same draws
    given = [lead for lead in leads if lead is not None]
    assert abs(1 - len(given) / len(leads) - model.no_recommendation) < 0.015
    assert all(0 <= lead <= model.lead_max for lead in given)
    assert abs(sum(lead == 0 for lead in given) / len(given) - model.together) < 0.01
    ahead = sorted(lead for lead in given if lead > 0)
    assert abs(ahead[len(ahead) // 2] - model.lead_median) < 0.05 * model.lead_median
    in_band = sum(600 <= lead <= 1200 for lead in ahead) / len(ahead)
    assert 0.40 < in_band < 0.47  # "often 10-20 minutes": 43% by the stated model

    # Instances interrupted at rate 1: the share of recommendations no notice follows.
    followed = false = 0
    for _ in range(20000):
        end = rng.expovariate(1.0)
        followed += model.draw(rng) is not None
        t = 0.0
        while (t := t + (model.false_alarm_gap(rng, 1.0) or math.inf)) < end:
            false += 1
    assert abs(false / (false + followed) - model.false_alarm) < 0.015
    assert SignalModel(false_alarm=0).false_alarm_gap(rng, 1.0) is None


@pytest.mark.parametrize("raw, field", [
    ({"false_alarm": 1}, "false_alarm"), ({"lead_median": -1}, "lead_median"),
    ({"together": 1.5}, "together"), ({"leads": 3}, "no leads"),
    ({"false_alarms": "1"}, "false_alarms"), ("x", "a dict"),
])
def test_a_bad_signal_model_is_refused(cloud: Cloud, raw: Any, field: str) -> None:
    with pytest.raises(SpecError, match=field):
        cloud.spec(simulate_signals=raw)


def _agent_notices(spec: JobSpec) -> list[str]:
    """The kinds of notice the job's agent logged, in order."""
    return [e.data["kind"] for e in EventReader(store_of(spec)).replay()
            if e.attempt == 1 and e.type == "notice"]


@pytest.mark.parametrize("recommended", [True, False], ids=["recommended", "unannounced"])
def test_a_recommendation_comes_minutes_before_its_notice_or_not_at_all(
        cloud: Cloud, recommended: bool) -> None:
    # 180 market seconds ahead, 3 s at the default scale: the recommendation at 1 s.
    signals = {"lead_median": 180, "lead_sigma": 0, "together": 0, "false_alarm": 0,
               "no_recommendation": 0 if recommended else 1, "seed": "t"}
    spec = cloud.spec(simulate_interruptions={"schedule": [4.0]}, simulate_signals=signals)
    cloud.provider.launch(spec)
    first = launched(spec)[0].data["instance_id"]
    notice_file = instance_dir(first) / "notice.json"
    seen = json.loads(wait_until(lambda: notice_file.exists() and notice_file.read_text(),
                                 15, "the agent to see the notice"))
    notice = wait_until(lambda: group_events(spec, "instance", action="notice"),
                        10, "the notice event")[0]
    rebalances = group_events(spec, "instance", action="rebalance")
    if recommended:
        assert [(e.instance, e.data["reason"]) for e in rebalances] == [(first, "scheduled")]
        assert rebalances[0].time < notice.time
        # Read at the instance's metadata service before its notice, and logged.
        assert _agent_notices(spec) == ["rebalance", "instance-action"]
        assert seen["rebalance"]["noticeTime"] <= seen["time"]
        state = fold(EventReader(store_of(spec)).replay())
        assert [(i, r) for _, i, r in state.group_rebalances] == [(first, "scheduled")]
    else:
        assert rebalances == [] and seen["rebalance"] is None
        assert _agent_notices(spec) == ["instance-action"]
    cloud.provider.terminate(spec.job_id)


def test_a_false_alarm_is_a_recommendation_no_notice_follows(cloud: Cloud) -> None:
    signals = {"false_alarms": [0.5], "false_alarm": 0, "seed": "f"}
    spec = cloud.spec(simulate_signals=signals)
    cloud.provider.launch(spec)
    first = launched(spec)[0].data["instance_id"]
    wait_until(lambda: _agent_notices(spec), 15, "the agent to log the recommendation")
    store_of(spec).put(STOP, json.dumps({"reason": "user"}).encode())
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    assert _agent_notices(spec) == ["rebalance"]
    assert [(e.instance, e.data["reason"])
            for e in group_events(spec, "instance", action="rebalance")] == \
        [(first, "false-alarm")]
    assert group_events(spec, "instance", action="notice") == []
    assert result_of(spec) == {"status": "stopped", "reason": "stop requested"}


def test_a_recommendation_lead_is_market_time_compressed_as_the_notice(cloud: Cloud) -> None:
    # Driven tick by tick at chosen times, with no process: 600 market seconds ahead of
    # a hazard interruption is 5 real seconds at a time scale of 120.
    signals = {"lead_median": 600, "lead_sigma": 0, "together": 0, "no_recommendation": 0,
               "false_alarm": 0}
    spec = cloud.spec(simulate_signals=signals)
    store_of(spec).put("spec.json", spec.to_json().encode())
    settings = Settings(time_scale=120.0, hazard=False)
    group = Supervisor(store_of(spec), spec, settings, cloud.home / "group")
    pool = catalog.pools("g4dn.xlarge", "us-east-1")[0]
    now = time.time()
    inst = LocalInstance.create(pool, group.pools.market(pool), index=1, now=now,
                                boot_seconds=0, hazard_at=now + 100, job_id=spec.job_id)
    try:
        send_signals(group, inst, now + 94.9)
        assert inst.rebalance_at is None
        send_signals(group, inst, now + 95.1)
        assert inst.rebalance_at == now + 95.1
        assert ImdsClient(inst.imds.endpoint, timeout=30).rebalance() is not None
        send_signals(group, inst, now + 99)
        assert inst.rebalance_at == now + 95.1  # one recommendation per interruption
    finally:
        inst.imds.stop()
        group.events.close()
    rebalances = group_events(spec, "instance", action="rebalance")
    assert [(e.time, e.data["reason"]) for e in rebalances] == [(now + 95.1, "hazard")]


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
def test_a_standby_no_notice_follows_is_given_back_and_billed(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch, standby: bool) -> None:
    # At 600x the standby's hold (600 market seconds) is 1 s. The stand-in agent never
    # warms up as a standby: not ready by the end of its hold, it is given back (a
    # ready one takes the job over: test_engine).
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "600")
    signals = {"false_alarms": [0.5], "false_alarm": 0, "seed": "g"}
    # Started at once, in the instance's first hour too (the default waits for its end:
    # the next test).
    spec = cloud.spec(simulate_signals=signals,
                      policy=Policy(standby=standby, standby_first_hour=True))
    cloud.provider.launch(spec)
    first = launched(spec)[0].data["instance_id"]
    wait_until(lambda: group_events(spec, "instance", action="rebalance"), 15,
               "the recommendation")
    if standby:
        given_back = wait_until(
            lambda: group_events(spec, "instance", reason="standby-given-back"), 15,
            "the standby to be given back")
    store_of(spec).put(STOP, json.dumps({"reason": "user"}).encode())
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    state = fold(EventReader(store_of(spec)).replay())
    if not standby:  # today's behaviour: one instance, nothing launched on the signal
        assert [e.data["instance_id"] for e in launched(spec)] == [first]
        assert state.standbys == {}
        return
    (sb,) = state.standbys.values()
    assert sb.standby_for == first and sb.instance_id != first
    assert sb.given_back == given_back[0].time and sb.attempt is None
    assert group_events(spec, "instance", action="notice") == []
    cost = state.instance_cost(sb.instance_id)
    assert cost > 0 and state.standbys_cost(time.time()) == pytest.approx(cost)
    assert cost < state.cost(time.time())[0]  # billed to the job, with the first
    assert sb.story(state)[-1][1] == f"standby given back (not ready in time): ${cost:.3f}"


def test_in_its_first_hour_an_instance_s_standby_waits_for_the_hour_to_end(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby launched at once would move the job off an instance that EC2 does not
    bill if it interrupts it in its first hour: it is launched to be ready as the hour
    ends (boot + STANDBY_WARMUP_SECONDS before it)."""
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "600")  # a market hour: 6 real s
    signals = {"false_alarms": [0.5], "false_alarm": 0, "seed": "d"}
    spec = cloud.spec(simulate_signals=signals)
    cloud.provider.launch(spec)
    first = launched(spec)[0]
    (deferred,) = wait_until(lambda: group_events(spec, "instance", action="standby-deferred"),
                             15, "the standby deferred")
    assert deferred.instance == first.data["instance_id"]
    due = first.time + (3600 - STANDBY_WARMUP_SECONDS) / 600
    assert deferred.data["standby_due"] == pytest.approx(due, abs=0.05)
    from spotnb.client.display import milestone

    said = milestone(deferred)
    assert said is not None and said.startswith(
        f"rebalance recommendation for {deferred.instance} in its first hour: its standby "
        "starts at "), said
    standby = launched(spec, 2)[1]  # launched, once the wait is over
    assert standby.data["standby_for"] == first.data["instance_id"]
    assert standby.time >= deferred.data["standby_due"]
    store_of(spec).put(STOP, json.dumps({"reason": "user"}).encode())
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")


def test_an_interruption_in_an_instance_s_first_hour_is_free_and_replaced_at_the_notice(
        cloud: Cloud, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notice comes while the standby waits for the first hour to end: the
    replacement launches at the notice (it boots during the notice period, as on AWS),
    and the interrupted instance costs nothing."""
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "600")
    # Interrupted at 2 real s (1,200 market s), recommended 600 market s (1 s) ahead.
    signals = {"lead_median": 600, "lead_sigma": 0, "together": 0, "false_alarm": 0,
               "no_recommendation": 0, "seed": "i"}
    spec = cloud.spec(simulate_interruptions={"schedule": [2.0]}, simulate_signals=signals)
    cloud.provider.launch(spec)
    first = launched(spec)[0].data["instance_id"]
    ended = wait_until(lambda: group_events(spec, "instance", action="terminated",
                                            reason="spot-interruption"),
                       15, "the first instance interrupted")
    assert [e.instance for e in ended] == [first]
    assert [e.instance for e in group_events(spec, "instance", action="standby-deferred")] \
        == [first]
    assert ended[0].data["cost_usd"] == 0  # as AWS bills it
    second = launched(spec, 2)[1]
    assert second.data.get("standby_for") == first  # launched at the notice,
    assert second.time < ended[0].time  # before the loss
    store_of(spec).put(STOP, json.dumps({"reason": "user"}).encode())
    wait_until(lambda: group_gone(cloud, spec), 10, "the group to exit")
    state = fold(EventReader(store_of(spec)).replay())
    assert [i.instance_id for i in state.refunded()] == [first]
    assert state.instance_cost(first) == 0
    assert state.cost(time.time())[0] == pytest.approx(
        state.instance_cost(second.data["instance_id"]))
