"""The saving spotnb realizes, against the saving the spot market offers.

Run by hand: ``python benchmarks/bench_savings.py [MARKET_HOURS] [--requests-usd-per-hour X]``
(default 24 market hours; about ten real minutes per case at the time scale below).

A long job runs on the local cloud with the bundled real price history replayed,
time-compressed (``SPOTNB_LOCAL_TIME_SCALE``): one real second is TIME_SCALE market
seconds, and so are EC2's boot (90 s) and notice period (120 s). Cases, for
g4dn.xlarge in us-east-1:

* at its Spot Advisor rate (bucket "15-20%", read as 22 interruptions a month per
  instance; at this length, usually none);
* stressed: an interruption every STRESS_HOURS market hours (scheduled), far above any
  pool's rate, to show what each one costs; run twice, side by side, with warm standbys
  (the default: the local cloud plays EC2's rebalance recommendations, false alarms
  included, :mod:`spotnb.protocol.signals`) and without (``standby=False``), so
  the difference between the two is what standbys cost or save, all included.

For each it reports the realized saving against the pool's own discount:

* discount = 1 - (time-weighted spot price paid) / on-demand price;
* the on-demand reference pays for the useful time only: one boot and start-up, and
  every step once;
* realized = instances billed from launch to termination at the replayed spot price,
  but nothing for an instance EC2 interrupted in its first hour (AWS's rule,
  :mod:`spotnb.protocol.billing`; reported as "refunded") + spotnb's own requests
  (``--requests-usd-per-hour``: the per-hour figure of ``bench_requests.py`` on the
  AWS simulator; the local cloud's cost nothing);
* saving = 1 - realized / on-demand reference; the figure of merit is saving /
  discount (goal: at least 0.95).

The overheads are broken down in instance-time at the spot price: the boot and start-up
of every replacement (launch to its first metric, restore included), the same for warm
standbys (launch to their first metric, or to their give-back: billed beside the
instance that trains), the notice windows billed after the final checkpoint was durable,
steps redone, and the requests.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from collections.abc import Iterable
from typing import Any

TIME_SCALE = 240.0  # 4 market minutes a real second: EC2's 120 s notice is 0.5 s
BOOT_MARKET_SECONDS = 90.0  # a Deep Learning AMI boots in about this long
STEP_MARKET_SECONDS = 20.0  # one training step (a real 1/12 s)
STRESS_HOURS = 2.0
TYPE, REGION = "g4dn.xlarge", "us-east-1"

CELL = """
import time
state = {"w": 0.0}
ckpt = spot.Checkpoint(state=state)
for step in range(ckpt.restore(), STEPS):
    state["w"] += 1.0
    spot.log(step, w=state["w"])
    time.sleep(STEP)
    ckpt.maybe_save(step)
"""


def _run(market_hours: float, schedule: list[float] | None, hazard: bool,
         standby: bool = True) -> Any:
    import spotnb

    os.environ["SPOTNB_LOCAL_TIME_SCALE"] = str(TIME_SCALE)
    os.environ["SPOTNB_LOCAL_BOOT_SECONDS"] = str(BOOT_MARKET_SECONDS / TIME_SCALE)
    os.environ["SPOTNB_LOCAL_HAZARD"] = "1" if hazard else "0"
    step = STEP_MARKET_SECONDS / TIME_SCALE
    steps = int(market_hours * 3600 / STEP_MARKET_SECONDS)
    handle = spotnb.submit(CELL, instance_types=[TYPE], region=REGION,
                           inputs={"STEPS": steps, "STEP": step},
                           checkpoint_every="60s", standby=standby,
                           simulate_interruptions=schedule or None)
    result = handle.wait(timeout=market_hours * 3600 / TIME_SCALE * 3 + 600)
    return handle, result, step


def _breakdown(handle: Any, result: Any, step_seconds: float,
               requests_per_hour: float) -> dict[str, Any]:
    from spotnb.protocol.events import GROUP_STREAM, EventReader, metric_rows
    from spotnb.protocol.events.fold import fold, integrate

    events = EventReader(handle.store, batches=True).poll()
    launched = {e.data["instance_id"]: e for e in events if e.attempt == GROUP_STREAM
                and e.type == "instance" and e.data.get("action") == "launched"}
    ended = {e.data["instance_id"]: e for e in events if e.attempt == GROUP_STREAM
             and e.type == "instance" and e.data.get("action") == "terminated"}
    first_metric: dict[str | None, float] = {}
    steps_by_attempt: dict[int, list[int]] = {}
    durable_forced: dict[str | None, float] = {}
    for e in events:
        for row_step, t, _ in metric_rows(e):
            first_metric.setdefault(e.instance, float(t))
            steps_by_attempt.setdefault(e.attempt, []).append(row_step)
        if e.type == "checkpoint" and e.data.get("phase") == "durable" and e.data.get("forced"):
            durable_forced[e.instance] = e.time
    billed = sum(ended[i].time - launched[i].time for i in launched if i in ended)
    order = sorted(launched, key=lambda i: launched[i].time)
    startup = [first_metric.get(i, ended[i].time if i in ended else 0) - launched[i].time
               for i in order]
    standbys = {i for i in order if launched[i].data.get("standby_for")}
    replacements_startup = sum(s for i, s in zip(order[1:], startup[1:], strict=True)
                               if i not in standbys)
    standbys_startup = sum(s for i, s in zip(order, startup, strict=True) if i in standbys)
    parked = sum(ended[i].time - durable_forced[i] for i in order
                 if i in durable_forced and i in ended)
    redone = 0
    seen: set[int] = set()
    for attempt in sorted(steps_by_attempt):
        current = set(steps_by_attempt[attempt])
        redone += len(current & seen)
        seen |= current
    redone_seconds = redone * step_seconds
    overhead = replacements_startup + standbys_startup + parked + redone_seconds
    useful = billed - overhead
    from spotnb.providers import catalog

    ondemand = float(catalog.ondemand_price(TYPE, REGION) or 0.0)
    instances_usd = result.cost_usd - result.requests_usd
    # EC2's refund of an instance it interrupts in its first hour (protocol/billing.py):
    # in the job's cost, not in the market's discount (the prices the pool charged).
    state = fold(events)
    refunded = state.refunded()
    refunded_usd = sum(integrate(state.prices.get(i.pool, []), i.start, i.end or i.start,
                                 i.price or 0.0) for i in refunded)
    # The local cloud bills each real second at the market's price per hour, so every
    # dollar here is on that basis; the requests' dollars per job-hour go on it too.
    avg_spot = (instances_usd + refunded_usd) / (billed / 3600.0) if billed else 0.0
    requests_usd = requests_per_hour * billed / 3600.0
    realized = (instances_usd + requests_usd)
    reference = ondemand * useful / 3600.0
    discount = 1 - avg_spot / ondemand
    saving = 1 - realized / reference if reference else 0.0
    return {
        "market_hours": billed * TIME_SCALE / 3600.0, "interruptions": result.interruptions,
        "instances": len(order), "standbys": len(standbys), "avg_spot": avg_spot,
        "ondemand": ondemand,
        "discount": discount, "saving": saving, "ratio": saving / discount,
        "overheads_pct": {
            "boot and start-up of replacements": 100 * replacements_startup / billed,
            "warm standbys until they train (or given back)": 100 * standbys_startup / billed,
            "notice windows after the final checkpoint": 100 * parked / billed,
            "steps redone": 100 * redone_seconds / billed,
            "spotnb's requests": 100 * requests_usd / max(realized, 1e-12),
        },
        "redone_steps": redone,
        "refunded": len(refunded),
        "refunded_pct": 100 * refunded_usd / max(instances_usd + refunded_usd, 1e-12),
    }


def _print(name: str, row: dict[str, Any]) -> None:
    print(f"\n== {name}: {row['market_hours']:.1f} market hours, {row['instances']} "
          f"instance(s) ({row['standbys']} warm standbys), {row['interruptions']} "
          f"interruption(s)")
    print(f"spot paid ${row['avg_spot']:.4f}/h vs on-demand ${row['ondemand']:.4f}/h: the "
          f"market's discount {100 * row['discount']:.1f}%")
    print(f"realized saving {100 * row['saving']:.1f}% = {row['ratio']:.3f}x the discount "
          f"(goal 0.95x: {'met' if row['ratio'] >= 0.95 else 'NOT met'})")
    for what, pct in row["overheads_pct"].items():
        print(f"  {what:<45}{pct:>8.3f}% of the billed time")
    print(f"  ({row['redone_steps']} steps redone)")
    print(f"  refunded: {row['refunded']} instance(s) EC2 interrupted in their first hour, "
          f"{row['refunded_pct']:.1f}% of the instances' cost at the spot price")


def _schedule(market_hours: float, every_hours: float, seed: int) -> list[float]:
    """Interruption times (real seconds after launch), one per ``every_hours`` on
    average (exponential gaps, as a constant hazard gives)."""
    rng = random.Random(seed)
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / every_hours)
        if t >= market_hours * 0.95:
            return out
        out.append(t * 3600 / TIME_SCALE)


def main(argv: Iterable[str] | None = None) -> None:
    global TIME_SCALE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("market_hours", nargs="?", type=float, default=24.0)
    parser.add_argument("--requests-usd-per-hour", type=float, default=0.0,
                        help="spotnb's own request cost per job-hour on AWS "
                             "(bench_requests.py); the local cloud's is 0")
    parser.add_argument("--only-stressed", action="store_true",
                        help="leave out the Spot Advisor rate's case")
    parser.add_argument("--time-scale", type=float, default=TIME_SCALE,
                        help="market seconds a real second (default %(default)g); what "
                             "runs in real time (a kernel's start, the cell's imports, "
                             "the agents' polls) is billed this many times over, so a "
                             "lower scale bills a warm-up closer to a real instance's")
    args = parser.parse_args(list(argv) if argv is not None else None)
    TIME_SCALE = args.time_scale
    print(f"local cloud at {TIME_SCALE:g} market seconds a real second; load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as home:
        os.environ["SPOTNB_HOME"] = home
        os.environ["SPOTNB_LOCAL_SEED"] = "7"
        stressed = _schedule(args.market_hours, STRESS_HOURS, seed=1)
        every = f"an interruption every {STRESS_HOURS:g} market hours on average"
        cases = [
            (f"{TYPE} at its Spot Advisor rate", None, True, True),
            (f"{TYPE}, {every}, warm standbys", stressed, False, True),
            (f"{TYPE}, {every}, no standby (standby=False)", stressed, False, False),
        ]
        if args.only_stressed:
            cases = cases[1:]
        rows = {}
        for name, schedule, hazard, standby in cases:
            handle, result, step = _run(args.market_hours, schedule, hazard, standby)
            assert result.status == "completed", result
            rows[standby, hazard] = row = _breakdown(handle, result, step,
                                                     args.requests_usd_per_hour)
            _print(name, row)
        on, off = rows[True, False], rows[False, False]
        print(f"\nside by side, {every}: realized saving with warm standbys "
              f"{100 * on['saving']:.1f}% ({on['ratio']:.3f}x the discount), without "
              f"{100 * off['saving']:.1f}% ({off['ratio']:.3f}x); what standbys cost, net "
              f"of what they saved: {100 * (off['saving'] - on['saving']):+.2f} points of "
              f"the on-demand reference")


if __name__ == "__main__":
    main()
