"""Training time an interruption costs, with a warm standby and without, and what
standbys cost.

Run by hand: ``python benchmarks/bench_interruption_gap.py [--mb 256] [--rounds 1]
[--aws]`` (about a minute per case on a quiet machine).

A job with one tensor of ``--mb`` MB (an embedding table) trains on the local cloud,
time-compressed as ``bench_savings.py`` does: one real second is TIME_SCALE market
seconds, and so are EC2's boot (90 s) and notice period (120 s). One interruption is
scheduled, announced by a rebalance recommendation LEAD market seconds ahead (more than
a boot). Two cases in the same run, one after the other:

* ``standby``: the group starts a warm standby at the recommendation (at once, with
  ``standby_first_hour``: by default, in an instance's first hour it is timed to be
  ready as that hour ends, and this interruption comes in the first); the job moves to
  it once it is ready (the old instance ends through its termination hook), so the
  announced interruption finds it gone;
* ``notice only``: the same job, but the interruption comes with no recommendation
  ahead (EC2 sends 0.4 of notices so): the group launches the replacement at the notice
  (AWS: the noticed instance leaves its group without lowering its desired capacity),
  so it boots during the notice period and warms up while the old agent saves;
* ``no standby`` (``standby=False``): a replacement launched once the old instance is
  gone.

``--aws``: the same on the AWS simulator (:mod:`spotnb.testing`, with EC2's boot and
notice scaled the same): the recommendation from ``AwsSimulator.interrupt(lead=...)``,
the standby asked of the Auto Scaling group by the job's instance agent (the simulator
launches it; the old instance ends itself through the termination hook once the
standby is ready).

Training time lost: from the last metric row of the interrupted attempt to the first of
the next (each row's own time). Parts of that gap run compressed (the rest of the notice
period after the final save, the replacement's boot): the market figure adds those back
at full length; the standby's gap has none. The figure is for the instance's wall clock;
the standby's own cost is reported with the job's.

What standbys cost besides, false alarms included, is computed from the local cloud's
signal model (:mod:`spotnb.protocol.signals`: 0.7 of recommendations are false
alarms, 0.4 of notices come unannounced, leads log-normal around 15 minutes): the
group's policy (the job moves to a standby once it is ready) bills each standby its
boot (EC2's 90 s) and its warm-up (the kernel, the cell's imports, the prefetch: this
run's, in real seconds, as they would take on an instance), false alarms included;
net of what each interruption it catches no longer bills (the notice window after the
final save, this run's, and a cold replacement's start, which the standby's time
replaced). Per interruption, as a share of the instance-time between interruptions at
the pool's Spot Advisor rate and at the stressed rate of ``bench_savings.py`` (one
every 2 market hours). ``bench_savings.py`` measures the same end to end on the
stressed schedule, with standbys and without.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

TIME_SCALE = 60.0  # one market minute a real second: the notice is 2 s, a boot 1.5 s
BOOT_MARKET_SECONDS = 90.0
NOTICE_MARKET_SECONDS = 120.0
LEAD_MARKET_SECONDS = 600.0  # the recommendation 10 market minutes ahead: > a boot
STEP_SECONDS = 0.05  # real
STRESS_HOURS = 2.0
ADVISOR_PER_MONTH = 22.0  # g4dn.xlarge us-east-1's bucket "15-20%", read as in bench_savings
MONTH_SECONDS = 30 * 86400.0

CELL = """
import time
import torch
table = torch.nn.Embedding(ROWS, 64)
ckpt = spot.Checkpoint(table=table)
for step in range(ckpt.restore(), 10**9):
    with torch.no_grad():
        table.weight[step % ROWS] += 1.0
    spot.log(step, w=float(table.weight[0, 0]))
    time.sleep(STEP)
    ckpt.maybe_save(step)
"""


def _case(case: str, mb: int, sim: Any = None) -> dict[str, Any]:
    """One interruption (``case``: "standby" or "no standby", announced LEAD ahead;
    "notice only", unannounced, standbys on), on the local cloud or (``sim``) on the AWS
    simulator."""
    import spotnb
    from spotnb.protocol.events.fold import fold

    rows = mb * 2**20 // (64 * 4)
    # Real seconds after the first launch: it has saved by the recommendation.
    notice_at = 35.0 + LEAD_MARKET_SECONDS / TIME_SCALE
    # The interruption comes in the first instance's first hour, where the group times
    # a standby to be ready as the hour ends by default (an interruption before then is
    # free): standby_first_hour starts it at once, for the handover measured here.
    standby = case != "no standby"
    announced = case != "notice only"
    common: dict[str, Any] = dict(inputs={"ROWS": rows, "STEP": STEP_SECONDS},
                                  checkpoint_every="200 steps", standby=standby,
                                  standby_first_hour=True)
    if sim is None:
        handle = spotnb.submit(
            CELL, simulate_interruptions=[notice_at],
            simulate_signals={"lead_median": LEAD_MARKET_SECONDS, "lead_sigma": 0,
                              "together": 0, "no_recommendation": 0 if announced else 1,
                              "false_alarm": 0, "seed": "gap"}, **common)
    else:
        handle = spotnb.submit(CELL, provider="aws", instance_types=["g4dn.xlarge"],
                               **common)
        first = sim.wait_for_instance(handle.job_id, timeout=120)
        deadline = time.monotonic() + 240
        while not any(e.type == "checkpoint" and e.data.get("phase") == "durable"
                      for e in handle.events(follow=False)):
            if time.monotonic() > deadline:
                raise RuntimeError("no checkpoint before the recommendation")
            time.sleep(1.0)
        if not announced:  # the moment the announced case's notice would come
            time.sleep(LEAD_MARKET_SECONDS / TIME_SCALE)
        sim.interrupt(first.id, lead=LEAD_MARKET_SECONDS / TIME_SCALE if announced else None)
    deadline = time.monotonic() + 240
    state = fold([])
    try:
        while time.monotonic() < deadline:
            state = fold(handle.events(follow=False))
            later = [a for n, a in state.attempts.items() if n > 1]
            if later and (later[0].last_step or 0) >= (later[0].first_step or 0) + 20:
                break
            time.sleep(1.0)
    finally:
        handle.stop()
    handle.wait(timeout=120)
    events = list(handle.events(follow=False))
    state = fold(events)
    rows1, rows2 = _row_times(events, 1), _row_times(events, 2)
    if not rows1 or not rows2:
        raise RuntimeError(f"the job did not resume (status {state.status})")
    gap = min(rows2) - max(rows1)
    group = [e for e in events if e.attempt == 0 and e.type == "instance"]
    ended = next(e.time for e in group if e.data.get("action") == "terminated"
                 and e.data.get("reason") in ("spot-interruption", "rebalanced"))
    parked = state.attempts[1].last_time
    # The gap's compressed parts, added back at full length in the market figure: without
    # a standby the notice window after the last row and the replacement's boot; at an
    # unannounced notice the replacement's boot (launched at the notice, it boots while
    # the old agent saves: at full length, a 90 s boot outlasts a save of seconds, so the
    # whole of it is in the gap, less the save; counted whole, an upper bound, as is the
    # replacement's wait for the lease at this scale, counted as its work).
    if not standby:
        compressed = max(0.0, ended - parked) + BOOT_MARKET_SECONDS / TIME_SCALE
    elif not announced:
        compressed = BOOT_MARKET_SECONDS / TIME_SCALE
    else:
        compressed = 0.0
    sb = next(iter(state.standbys.values()), None) if announced else None
    end = events[-1].time
    launches = [e.time for e in group if e.data.get("action") == "launched"]
    # a cold replacement's start: EC2's boot, then its own start-up in real seconds
    cold = (BOOT_MARKET_SECONDS + max(0.0, min(rows2) - launches[1]
                                      - BOOT_MARKET_SECONDS / TIME_SCALE)
            if not standby and len(launches) > 1 else None)
    return {"case": case, "mb": mb,
            "gap_real_s": gap, "gap_market_s": gap + compressed * (TIME_SCALE - 1),
            "handover_s": state.handover_seconds(sb) if sb else None,
            "read_mb": sb.read_bytes / 2**20 if sb else None,
            "redone": state.redone_steps(),
            # the standby's warm-up after its (compressed) boot: real seconds, as on EC2
            "warmup_s": (sb.ready - sb.launched - BOOT_MARKET_SECONDS / TIME_SCALE)
            if sb and sb.ready and sb.launched else None,
            # the notice window billed after the last row (market seconds)
            "parked_market_s": None if standby else max(0.0, ended - parked) * TIME_SCALE,
            "cold_market_s": cold,
            "standby_cost_share": state.standbys_cost(end) / max(state.cost(end)[0], 1e-12)}


def med_of(rows: list[dict[str, Any]], key: str) -> float | None:
    """The median of ``key`` over ``rows`` (None where absent)."""
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _row_times(events: list[Any], attempt: int) -> list[float]:
    """The times of an attempt's metric rows (single rows and batches)."""
    from spotnb.protocol.events import metric_rows

    out: list[float] = []
    for e in events:
        if e.attempt != attempt:
            continue
        if e.type == "metric":
            out.append(float(e.data.get("t") or e.time))
        elif e.type == "metrics":
            out.extend(t for _step, t, _values in metric_rows(e))
    return out


def job_cost(policy: str, ready: float, cold: float, parked: float, rate_per_hour: float,
             useful_hours: float = 20_000.0, seed: int = 1) -> dict[str, float]:
    """A long job's instance time under one standby policy, from the signal model, with
    AWS's first-hour refund (:mod:`spotnb.protocol.billing`), in market seconds.

    Each instance is interrupted at ``rate_per_hour`` (a constant hazard, drawn anew for
    each instance), gets false alarms at 1.4 times that rate, and a real interruption's
    recommendation comes its drawn lead ahead (or none). ``policy``: ``"none"`` (no
    standby: the replacement launches once the old instance is gone and trains after
    its ``cold`` start; the old one bills the notice period, ``parked`` of it after the
    final save), ``"at once"`` (a standby launched at the recommendation, the job moved
    to it after ``ready``: the old instance ended by us, always billed) or
    ``"deferred"`` (spotnb's default: in the instance's first hour the standby is
    launched to be ready as the hour ends, so an interruption before then stays free).
    A notice that finds the standby not yet ready makes it the replacement; one that
    finds none booting (with either standby policy) launches the replacement at once.

    Returns billed market seconds per useful second (``per_useful``) and the share of
    it that is the refund (``refunded``); ``standbys``: the standbys' time beside the
    instance they stand by for, as a share of the billed time; ``at_notice``: the same
    of the replacements launched at a notice (the notice period, which each buys back
    in training time)."""
    from spotnb.protocol.billing import FREE_HOUR_SECONDS, free_of_charge
    from spotnb.protocol.signals import SignalModel
    from spotnb.protocol.standby import STANDBY_WARMUP_SECONDS

    # A cold start does what a warm-up does (the kernel, the cell's imports, the
    # download) after the same boot: a cell whose warm-up is long starts cold as slowly.
    cold = max(cold, ready)
    model = SignalModel()
    rng = random.Random(seed)
    rate = rate_per_hour / 3600.0
    fa_rate = model.false_alarms_per_interruption * rate
    target = useful_hours * 3600.0
    useful = billed = refunded = overlap = early = 0.0
    start = 0.0  # the instance's launch (billing)
    train_from = cold  # when it trains (a cold first start)
    while useful < target:
        interrupt = start + rng.expovariate(rate)
        lead = model.draw(rng)
        recommended = None if lead is None else max(start, interrupt - lead)
        alarm = start + rng.expovariate(fa_rate)
        # The standby, if one: launched on the first recommendation (real or not).
        rec = min(t for t in (recommended, alarm) if t is not None) \
            if recommended is not None or alarm < interrupt else None
        launch = None
        if policy != "none" and rec is not None and rec < interrupt:
            launch = rec
            if policy == "deferred":  # as the local group times it
                launch = max(rec, start + FREE_HOUR_SECONDS - BOOT_MARKET_SECONDS
                             - STANDBY_WARMUP_SECONDS)
        if launch is not None and launch + ready <= interrupt:
            # Moved: the old instance ends at the standby's readiness, billed; the
            # standby, billed from its launch, trains on (about a second lost).
            moved = launch + ready
            useful += moved - train_from
            billed += moved - start
            overlap += ready
            start, train_from = launch, moved
            continue
        # The notice: the final save, the notice period, then EC2 ends the instance.
        end = interrupt + NOTICE_MARKET_SECONDS
        useful += max(0.0, end - parked - train_from)
        if free_of_charge("spot-interruption", end - start):
            refunded += end - start
        else:
            billed += end - start
        # A replacement already there takes the lease once the old agent released it,
        # after its final save (``parked`` before the end), as soon as it is ready.
        if launch is not None and launch <= interrupt:
            # The standby launched before the notice is the replacement.
            overlap += end - launch
            start, train_from = launch, max(launch + ready, end - parked)
        elif policy != "none":
            # No standby booting (none asked for, or deferred past the notice): the
            # replacement launches at the notice and warms up during the notice period
            # (the local group; AWS: the noticed instance leaves its group).
            early += end - interrupt
            start, train_from = interrupt, max(interrupt + ready, end - parked)
        else:
            start, train_from = end, end + cold
    return {"per_useful": billed / useful, "refunded": refunded / (billed + refunded),
            "standbys": overlap / billed, "at_notice": early / billed}


def _cost_table(warmup: float | None, parked: float | None, cold: float | None) -> None:
    """What standbys cost, for this run's warm-up and longer ones: a long job's instance
    time under each policy (:func:`job_cost`), against no standby."""
    parked = NOTICE_MARKET_SECONDS if parked is None else parked
    cold = BOOT_MARKET_SECONDS + 60.0 if cold is None else cold
    print(f"\nwhat standbys cost (signal model, a 20,000-hour job, AWS's first-hour "
          f"refund): instance time per useful hour against no standby; boot "
          f"{BOOT_MARKET_SECONDS:g} s, a cold start {cold:.0f} s, {parked:.0f} s of the "
          "notice window after the final save (this run's where measured)")
    rates = (("advisor rate", ADVISOR_PER_MONTH / (MONTH_SECONDS / 3600)),
             (f"every {STRESS_HOURS:g} h", 1 / STRESS_HOURS))
    print(f"{'warm-up':>16} " + " ".join(
        f"{name + ': at once':>22} {'deferred':>9} {'(standbys)':>10} {'(notice)':>9} "
        f"{'refund':>7}" for name, _ in rates))
    warmups = [(f"{warmup:.0f} s (this run)", warmup)] if warmup is not None else []
    warmups += [(f"{w:.0f} s", w) for w in (30.0, 60.0, 120.0)]
    for name, warm in warmups:
        ready = BOOT_MARKET_SECONDS + warm
        cells = []
        for _, rate in rates:
            base = job_cost("none", ready, cold, parked, rate)
            at_once = job_cost("at once", ready, cold, parked, rate)
            deferred = job_cost("deferred", ready, cold, parked, rate)
            cells.append(f"{at_once['per_useful'] / base['per_useful'] - 1:>22.2%} "
                         f"{deferred['per_useful'] / base['per_useful'] - 1:>9.2%} "
                         f"{deferred['standbys']:>10.2%} {deferred['at_notice']:>9.2%} "
                         f"{base['refunded']:>7.1%}")
        print(f"{name:>16} " + " ".join(cells))


def main(argv: list[str] | None = None) -> None:
    global TIME_SCALE
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="the state's size (one tensor)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=TIME_SCALE,
                        help="market seconds a real second (default %(default)g): lower it "
                             "for a large state, whose final save takes real seconds, so "
                             "that it fits in the compressed notice period")
    parser.add_argument("--aws", action="store_true",
                        help="on the AWS simulator (standbys through the group, lifecycle hooks; "
                             "EC2's boot and notice scaled the same) instead of the local "
                             "cloud")
    args = parser.parse_args(argv)
    TIME_SCALE = args.time_scale
    home = tempfile.mkdtemp(prefix="spotnb-bench-gap-")
    os.environ.update({
        "SPOTNB_HOME": home, "SPOTNB_LOCAL_TIME_SCALE": str(TIME_SCALE),
        "SPOTNB_LOCAL_BOOT_SECONDS": str(BOOT_MARKET_SECONDS / TIME_SCALE),
        "SPOTNB_LOCAL_NOTICE_SECONDS": str(NOTICE_MARKET_SECONDS / TIME_SCALE),
        "SPOTNB_LOCAL_HAZARD": "0"})
    where = "AWS simulator" if args.aws else "local cloud"
    print(f"{where} at {TIME_SCALE:g}x: boot {BOOT_MARKET_SECONDS:g} s, notice "
          f"{NOTICE_MARKET_SECONDS:g} s, recommendation {LEAD_MARKET_SECONDS:g} s ahead "
          f"(market); one {args.mb} MB tensor; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for case in ("standby", "notice only", "no standby"):  # side by side, one run
            if args.aws:
                from spotnb.testing import AwsSimulator

                with AwsSimulator(notice_seconds=NOTICE_MARKET_SECONDS / TIME_SCALE,
                                  boot_seconds=BOOT_MARKET_SECONDS / TIME_SCALE) as sim:
                    row = _case(case, args.mb, sim)
            else:
                row = _case(case, args.mb)
            results.setdefault(row["case"], []).append(row)
    print(f"\n{'case':>11} {'lost (real s)':>14} {'lost (market s)':>16} {'handover s':>11} "
          f"{'read MB':>8} {'redone':>7} {'standby/job':>13}")
    for case, rows in results.items():
        def med(key: str, rows: list[dict[str, Any]] = rows) -> float | None:
            vals = [r[key] for r in rows if r[key] is not None]
            return statistics.median(vals) if vals else None

        def fmt(v: float | None, spec: str) -> str:
            return format("-", ">" + spec.split(".")[0]) if v is None else format(v, spec)

        print(f"{case:>11} {fmt(med('gap_real_s'), '14.1f')} "
              f"{fmt(med('gap_market_s'), '16.1f')} {fmt(med('handover_s'), '11.1f')} "
              f"{fmt(med('read_mb'), '8.0f')} {fmt(med('redone'), '7.0f')} "
              f"{fmt(med('standby_cost_share'), '13.1%')}")
    _cost_table(med_of(results.get("standby", []), "warmup_s"),
                med_of(results.get("no standby", []), "parked_market_s"),
                med_of(results.get("no standby", []), "cold_market_s"))
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
