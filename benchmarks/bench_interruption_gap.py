"""Training time an interruption costs, with a warm standby and without, and what
standbys cost.

Run by hand: ``python benchmarks/bench_interruption_gap.py [--mb 256] [--rounds 1]``
(about a minute per case on a quiet machine).

A job with one tensor of ``--mb`` MB (an embedding table) trains on the local cloud,
time-compressed as ``bench_savings.py`` does: one real second is TIME_SCALE market
seconds, and so are EC2's boot (90 s) and notice period (120 s). One interruption is
scheduled, announced by a rebalance recommendation LEAD market seconds ahead (more than
a boot). Two cases in the same run, one after the other:

* ``standby``: the group starts a warm standby at the recommendation; the job moves to
  it once it is ready (the old instance ends through its termination hook), so the
  announced interruption finds it gone;
* ``no standby`` (``standby=False``): today's behaviour, a replacement launched once the
  old instance is gone.

Training time lost: from the last metric row of the interrupted attempt to the first of
the next (each row's own time). Parts of that gap run compressed (the rest of the notice
period after the final save, the replacement's boot): the market figure adds those back
at full length; the standby's gap has none. The figure is for the instance's wall clock;
the standby's own cost is reported with the job's.

What standbys cost besides, false alarms included, is computed from the local cloud's
signal model (:mod:`spotnb.providers.local.signals`: 0.7 of recommendations are false
alarms, 0.4 of notices come unannounced, leads log-normal around 15 minutes): the
group's policy (the job moves to a standby once it is booted) bills each standby its
boot, false alarms included; beside it, holding a standby for the notice up to a bound
and giving it back then. Per interruption, as a share of the instance-time between
interruptions at the pool's Spot Advisor rate and at the stressed rate of
``bench_savings.py`` (one every 2 market hours).
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


def _case(standby: bool, mb: int) -> dict[str, Any]:
    import spotnb
    from spotnb.protocol.events.fold import fold

    rows = mb * 2**20 // (64 * 4)
    notice_at = 35.0  # real seconds after the first launch: it has saved by the signal
    handle = spotnb.submit(
        CELL, inputs={"ROWS": rows, "STEP": STEP_SECONDS}, checkpoint_every="200 steps",
        standby=standby, simulate_interruptions=[notice_at],
        simulate_signals={"lead_median": LEAD_MARKET_SECONDS, "lead_sigma": 0,
                          "together": 0, "no_recommendation": 0, "false_alarm": 0,
                          "seed": "gap"})
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
    compressed = 0.0 if standby else max(0.0, ended - parked) + BOOT_MARKET_SECONDS / TIME_SCALE
    sb = next(iter(state.standbys.values()), None)
    end = events[-1].time
    return {"case": "standby" if standby else "no standby", "mb": mb,
            "gap_real_s": gap, "gap_market_s": gap + compressed * (TIME_SCALE - 1),
            "handover_s": state.handover_seconds(sb) if sb else None,
            "read_mb": sb.read_bytes / 2**20 if sb else None,
            "redone": state.redone_steps(),
            "standby_cost_share": state.standbys_cost(end) / max(state.cost(end)[0], 1e-12)}


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


def standby_seconds(hold: float, boot: float = BOOT_MARKET_SECONDS, draws: int = 200_000,
                    seed: int = 1) -> dict[str, float]:
    """Per interruption, from the signal model: market seconds of standby billed
    (followed recommendations: launch to notice, or to the give-back; false alarms:
    boot plus hold), and the share of notices a ready standby catches."""
    from spotnb.providers.local.signals import SignalModel

    model = SignalModel()
    rng = random.Random(seed)
    billed = caught = 0.0
    for _ in range(draws):
        lead = model.draw(rng)
        if lead is None:
            continue  # no recommendation: no standby, a cold replacement
        if lead <= boot + hold:
            billed += lead  # launched at the recommendation, the job's from the notice
            caught += lead >= boot  # ready (booted) by the notice
        else:
            billed += boot + hold  # given back before its notice came
    per = model.false_alarms_per_interruption
    return {"billed": billed / draws + per * (boot + hold), "caught": caught / draws,
            "false_alarms": per}


def move_seconds(boot: float = BOOT_MARKET_SECONDS, draws: int = 200_000,
                 seed: int = 1) -> dict[str, float]:
    """The group's policy, per interruption, from the signal model: each standby bills
    its boot (the job moves to it then; or less, when the notice came first), false
    alarms included; a notice announced more than a boot ahead finds the job gone."""
    from spotnb.providers.local.signals import SignalModel

    model = SignalModel()
    rng = random.Random(seed)
    billed = caught = 0.0
    for _ in range(draws):
        lead = model.draw(rng)
        if lead is None:
            continue  # no recommendation: no standby, a cold replacement
        billed += min(lead, boot)
        caught += lead >= boot
    per = model.false_alarms_per_interruption
    return {"billed": billed / draws + per * boot, "caught": caught / draws,
            "false_alarms": per}


def _cost_table() -> None:
    print("\nwhat standbys cost (signal model, per interruption; share of the instance-time "
          "between interruptions)")
    print(f"{'policy':>24} {'standby min/interr.':>20} {'caught':>7} "
          f"{'advisor rate':>13} {'every 2 h':>10}")
    advisor = MONTH_SECONDS / ADVISOR_PER_MONTH
    rows = [("move when ready (group)", move_seconds())]
    rows += [(f"hold {hold / 60:.0f} min", standby_seconds(hold))
             for hold in (300.0, 600.0, 1200.0, 1800.0)]
    for name, f in rows:
        print(f"{name:>24} {f['billed'] / 60:>20.1f} {f['caught']:>7.0%} "
              f"{f['billed'] / advisor:>13.2%} {f['billed'] / (STRESS_HOURS * 3600):>10.1%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="the state's size (one tensor)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    home = tempfile.mkdtemp(prefix="spotnb-bench-gap-")
    os.environ.update({
        "SPOTNB_HOME": home, "SPOTNB_LOCAL_TIME_SCALE": str(TIME_SCALE),
        "SPOTNB_LOCAL_BOOT_SECONDS": str(BOOT_MARKET_SECONDS / TIME_SCALE),
        "SPOTNB_LOCAL_NOTICE_SECONDS": str(NOTICE_MARKET_SECONDS / TIME_SCALE),
        "SPOTNB_LOCAL_HAZARD": "0"})
    print(f"local cloud at {TIME_SCALE:g}x: boot {BOOT_MARKET_SECONDS:g} s, notice "
          f"{NOTICE_MARKET_SECONDS:g} s, recommendation {LEAD_MARKET_SECONDS:g} s ahead "
          f"(market); one {args.mb} MB tensor; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    results: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for standby in (True, False):  # side by side, in the same run
            row = _case(standby, args.mb)
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
    _cost_table()
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
