"""What spotnb's own AWS traffic costs per job-hour, counted on the AWS simulator.

Run by hand: ``python benchmarks/bench_requests.py [SECONDS] [--reattach-only]
[--nodes N]`` (default 60; the 10x runs take ten times that; ``--reattach-only``: only
the re-attach cases; ``--nodes N``: only the unattended case, on one node and on N
nodes, side by side: EC2 and Auto Scaling calls, and all requests, per instance-hour).
Every request that reaches the simulator's moto server is
recorded with its service, operation and origin (the ``spotnb-origin/...`` part of the
User-Agent: job-agent, runtime, instance-agent, notebook, cli); the simulator's own
fulfilment traffic (origin ``simulator``) is left out. Prices are us-east-1 list
prices (:mod:`spotnb.protocol.usage`).

Cases, each at SECONDS and at 10 x SECONDS of run length:

* unattended: a job logs a metric every 0.1 s and checkpoints by the default policy
  (every 60 s); nobody follows it (the benchmark waits by looking into moto's memory);
* followed live: the same job followed by ``JobHandle.events()`` from submit to end;
* re-attach: a job that logged 1,000,000 metrics over 24 simulated hours (and one of
  2.4 hours) is attached to after it ended: ``spotnb.attach(...).wait()``, the
  dashboard's replay (``display.follow`` with the widget dashboard), ``spotnb logs``.

Per job-hour figures separate what a job costs once (submit, launch, boot, teardown)
from what it costs per hour of running (the difference between the 10x and the 1x run,
divided by the extra hours). The baseline printed beside them: the g4dn.xlarge spot
price of the simulated pool, and the targets of 1% (unattended) and 3% (followed) of it.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import spotnb
from spotnb.protocol import usage
from spotnb.protocol.events import Event, EventWriter, metrics_data
from spotnb.providers import catalog
from spotnb.testing import AwsSimulator

CELL = """
import time
state = {"w": 0.0}
ckpt = spot.Checkpoint(state=state)
end = time.time() + DURATION
step = ckpt.restore()
while time.time() < end:
    state["w"] += 0.001
    spot.log(step, loss=1.0 / (step + 1))
    time.sleep(0.1)
    ckpt.maybe_save(step)
    step += 1
"""

# The same cell as torchrun's workers on N nodes (gloo, so every rank's maybe_save agrees).
DISTRIBUTED = """
import torch.distributed as dist
dist.init_process_group("gloo")
""" + CELL

TYPE = "g4dn.xlarge"
REGION = "us-east-1"


def spot_price() -> float:
    return min(float(p.spot or 0.0) for p in catalog.pools(TYPE, REGION))


def _counts(sim: AwsSimulator, since: float = 0.0) -> collections.Counter[tuple[str, str, str]]:
    return collections.Counter(
        (r.origin, r.service, r.operation) for r in sim.server.requests.snapshot()
        if r.origin != "simulator" and r.time >= since)


def _cost(counts: collections.Counter[tuple[str, str, str]]) -> float:
    return sum(usage.cost({f"{s}:{o}": n}) for (_, s, o), n in counts.items())


def _result_in_moto(store_uri: str) -> bool:
    """Whether the job's result.json exists, asked of moto's memory (no request)."""
    from moto.s3.models import s3_backends

    bucket, _, prefix = store_uri.removeprefix("s3://").partition("/")
    for account in s3_backends.values():
        found = account["global"].buckets.get(bucket)
        if found is not None and f"{prefix}/result.json" in found.keys:
            return True
    return False


def run_job(sim: AwsSimulator, seconds: float, follow: bool,
            nodes: int = 1) -> dict[str, Any]:
    sim.server.requests.clear()
    started = time.monotonic()
    handle = spotnb.submit(CELL if nodes == 1 else DISTRIBUTED, provider="aws",
                           instance_types=[TYPE], region=REGION, nodes=nodes,
                           inputs={"DURATION": seconds}, name="bench")
    if follow:
        for _ in handle.events():
            pass
    else:
        while not _result_in_moto(handle.store.uri):
            time.sleep(0.5)
    sim.wait_until_idle(120)
    counts = _counts(sim)
    result = handle.summary()
    return {"seconds": seconds, "wall": time.monotonic() - started, "counts": counts,
            "status": result.status, "billed_hours": _billed_hours(result), "nodes": nodes}


def _billed_hours(result: spotnb.JobResult) -> float:
    return sum(((a.end or a.start) - a.start) for a in result.attempts) / 3600.0


# -- re-attach ---------------------------------------------------------------------


def long_job(hours: float, metrics: int, provider: str = "aws") -> spotnb.JobHandle:
    """A job whose log is that of a run of ``hours`` that logged ``metrics`` rows, as
    its agent would have written it (a chunk a minute, rolled into segments), on the
    AWS simulator (``provider="aws"``) or the local cloud and store (``"local"``)."""
    where: dict[str, Any] = ({"instance_types": [TYPE], "region": REGION}
                             if provider == "aws" else {})
    handle = spotnb.submit("x = 1", provider=provider, name=f"long-{hours:g}h", **where)
    handle.wait(timeout=300)  # a real (short) job first: its spec, group, result
    store = handle.store
    t0 = time.time() - hours * 3600
    writer = EventWriter(store, 2, "i-long", flush_seconds=1e9)
    group = EventWriter(store, 0, "i-long", flush_seconds=1e9)
    group.emit_event(Event("instance", t0, 0, "i-long", {
        "action": "launched", "instance_id": "i-long", "instance_type": TYPE,
        "az": "use1-az1", "pool": f"{TYPE}@use1-az1", "price": spot_price(),
        "ondemand": catalog.ondemand_price(TYPE, REGION)}))
    writer.emit_event(Event("status", t0 + 60, 2, "i-long", {
        "state": "booting", "detail": "attempt 2", "instance_type": TYPE}))
    seconds = int(hours * 3600)
    per_second = metrics / seconds
    step = 0
    owed = 0.0
    for second in range(seconds):
        t = t0 + 120 + second
        owed += per_second
        rows = []
        while owed >= 1:
            rows.append((step, round(t, 3), {"loss": 1.0 / (step + 1)}))
            step += 1
            owed -= 1
        if rows:
            writer.emit_event(Event("metrics", t, 2, "i-long",
                                    metrics_data(rows)))
        if second % 10 == 0:
            writer.emit_event(Event("sys", t, 2, "i-long", {
                "kind": "cpu", "util": 50.0, "mem_used": 1 << 30, "mem_total": 8 << 30}))
        if second % 60 == 59:
            writer.emit_event(Event("checkpoint", t, 2, "i-long", {
                "phase": "durable", "id": f"c{second}", "step": step, "bytes": 1 << 20,
                "seconds": 0.2, "forced": False}))
            writer.flush()
    writer.emit_event(Event("result", t0 + 120 + seconds, 2, "i-long",
                            {"status": "completed", "reason": "the cell finished"}))
    writer.close()
    group.emit_event(Event("instance", t0 + 121 + seconds, 0, "i-long", {
        "action": "terminated", "instance_id": "i-long", "reason": "job-finished"}))
    group.close()
    return spotnb.attach(handle.job_id)


def reattach(sim: AwsSimulator | None,
             handle: spotnb.JobHandle) -> dict[str, tuple[int, float]]:
    """Requests (counted on the simulator; 0 without one) and seconds of each way of
    showing a long job's history."""
    from spotnb.client import display
    from spotnb.client.cli import main as cli

    out: dict[str, tuple[int, float]] = {}

    def measure(name: str, fn: Any) -> None:
        mark = time.time()
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):  # what it shows, outside a notebook
            fn()
        seconds = time.perf_counter() - started
        out[name] = (0 if sim is None else sum(_counts(sim, since=mark).values()), seconds)

    measure("attach + wait()", lambda: spotnb.attach(handle.job_id).wait())
    try:
        from spotnb.widgets import Dashboard

        measure("%spot_attach (dashboard)",
                lambda: display.follow(spotnb.attach(handle.job_id), Dashboard(show=False)))
    except ImportError:
        pass
    measure("%spot_attach (text)", lambda: display.follow(spotnb.attach(handle.job_id),
                                                          display.TextRenderer()))
    # Two runs (the same job twice): twice what one re-attach costs, no more.
    with contextlib.suppress(ImportError):  # without the widgets
        measure("%spot_compare (2 runs)",
                lambda: spotnb.compare(handle.job_id, handle.job_id, follow=False))
    measure("spotnb logs", lambda: cli(["logs", handle.job_id]))
    return out


# -- report --------------------------------------------------------------------------


def _by_origin(counts: collections.Counter[tuple[str, str, str]]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = collections.defaultdict(collections.Counter)
    for (origin, service, op), n in counts.items():
        table[origin][f"{service}:{op}"] += n
    return table


def report_jobs(name: str, short: dict[str, Any], long: dict[str, Any], price: float,
                target: float) -> None:
    extra_hours = (long["seconds"] - short["seconds"]) / 3600.0
    marginal = long["counts"] - short["counts"]
    rate = _cost(marginal) / extra_hours
    fixed = max(0.0, _cost(short["counts"]) - rate * short["seconds"] / 3600.0)
    per_hour = fixed + rate
    print(f"\n== {name}: {short['seconds']:g} s and {long['seconds']:g} s runs "
          f"({short['status']}, {long['status']})")
    print(f"{'origin':<16}{'service:operation':<34}{'1x':>8}{'10x':>8}{'per hour':>12}")
    for origin, ops in sorted(_by_origin(long["counts"]).items()):
        short_ops = _by_origin(short["counts"]).get(origin, {})
        for op, n in sorted(ops.items()):
            extra = n - short_ops.get(op, 0)
            print(f"{origin:<16}{op:<34}{short_ops.get(op, 0):>8}{n:>8}"
                  f"{extra / extra_hours:>12.0f}")
    ec2 = sum(n for (o, s, _), n in marginal.items() if s in ("ec2", "autoscaling"))
    print(f"once per job: ${fixed:.5f}; per running hour: ${rate:.5f}; a one-hour job: "
          f"${per_hour:.5f}/job-hour = {100 * per_hour / price:.2f}% of the spot price "
          f"${price:.4f}/h (target {100 * target:.0f}%: "
          f"{'met' if per_hour <= target * price else 'NOT met'}); "
          f"EC2 + Auto Scaling calls per instance-hour: {ec2 / extra_hours:.0f}")


def report_nodes(single: list[dict[str, Any]], multi: list[dict[str, Any]]) -> None:
    """EC2/Auto Scaling calls and all requests per instance-hour: N nodes against one."""
    def per_instance_hour(runs: list[dict[str, Any]]) -> tuple[float, float, float]:
        short, long = runs
        extra = (long["seconds"] - short["seconds"]) / 3600.0 * long["nodes"]
        marginal = long["counts"] - short["counts"]
        ec2 = sum(n for (_, svc, _), n in marginal.items() if svc in ("ec2", "autoscaling"))
        once = sum(n for (_, svc, _), n in short["counts"].items()
                   if svc in ("ec2", "autoscaling"))
        return ec2 / extra, sum(marginal.values()) / extra, once / long["nodes"]

    nodes = multi[0]["nodes"]
    one, many = per_instance_hour(single), per_instance_hour(multi)
    print(f"\n== unattended, 1 node against {nodes} nodes ({[r['status'] for r in single]}, "
          f"{[r['status'] for r in multi]})")
    print(f"{'':<44}{'1 node':>10}{f'{nodes} nodes':>10}{'ratio':>8}")
    for label, a, b in (("EC2 + Auto Scaling calls per instance-hour", one[0], many[0]),
                        ("all requests per instance-hour", one[1], many[1]),
                        ("EC2 + Auto Scaling calls once, per node", one[2], many[2])):
        print(f"{label:<44}{a:>10.0f}{b:>10.0f}{b / a if a else float('nan'):>8.2f}")
    for origin, ops in sorted(_by_origin(multi[1]["counts"] - multi[0]["counts"]).items()):
        for op, n in sorted(ops.items()):
            if op.startswith(("ec2:", "autoscaling:")):
                print(f"  {nodes} nodes, per running hour: {origin:<16}{op:<34}"
                      f"{n / ((multi[1]['seconds'] - multi[0]['seconds']) / 3600):>8.0f}")


def main() -> None:
    reattach_only = "--reattach-only" in sys.argv[1:]
    flags = sys.argv[1:]
    nodes = int(flags[flags.index("--nodes") + 1]) if "--nodes" in flags else 1
    args = [a for i, a in enumerate(flags) if not a.startswith("--")
            and not (i and flags[i - 1] == "--nodes")]
    seconds = float(args[0]) if args else 60.0
    price = spot_price()
    with tempfile.TemporaryDirectory() as home, AwsSimulator(Path(home) / "sim") as sim:
        import os

        os.environ["SPOTNB_HOME"] = home
        print(f"spot price of {TYPE} in {REGION} (bundled catalog): ${price:.4f}/h; "
              f"targets: 1% = ${0.01 * price:.5f}/h unattended, "
              f"3% = ${0.03 * price:.5f}/h followed")
        if nodes > 1:
            single = [run_job(sim, s, False) for s in (seconds, 10 * seconds)]
            multi = [run_job(sim, s, False, nodes) for s in (seconds, 10 * seconds)]
            report_nodes(single, multi)
            return
        if not reattach_only:
            runs = {}
            for follow in (False, True):
                runs[follow] = [run_job(sim, s, follow) for s in (seconds, 10 * seconds)]
            report_jobs("unattended", runs[False][0], runs[False][1], price, 0.01)
            report_jobs("followed live", runs[True][0], runs[True][1], price, 0.03)
        print("\n== re-attach to a job that has ended")
        print(f"{'job':<28}{'how':<28}{'requests':>10}{'seconds':>10}")
        for hours, metrics in ((2.4, 100_000), (24.0, 1_000_000)):
            handle = long_job(hours, metrics)
            for how, (n, secs) in reattach(sim, handle).items():
                print(f"{f'{hours:g} h, {metrics:,} metrics':<28}{how:<28}{n:>10}"
                      f"{secs:>10.2f}", flush=True)
        print(json.dumps({"price": price}))


if __name__ == "__main__":
    main()
