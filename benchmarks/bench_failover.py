"""Time to the first step when the first region has no capacity, with failover across
regions and without.

Run by hand: ``python benchmarks/bench_failover.py [--shortage 60] [--rounds 1]`` (about
three minutes plus four shortages on a quiet machine).

A small job (a Python loop that logs a step every STEP seconds and checkpoints every 10
steps) runs on the local cloud, real agent and kernel, in two situations, each with
failover (``--region us-east-1,us-west-2``) and without (``--region us-east-1``), side
by side in the same run:

* ``start``: us-east-1, the job's home, has no spot capacity for the first
  ``--shortage`` seconds after the job's group starts
  (``SPOTNB_LOCAL_NO_CAPACITY=us-east-1``, ``SPOTNB_LOCAL_NO_CAPACITY_SECONDS``). With
  failover the launch's ranking (the simulated Spot placement scores put us-east-1
  last) starts the job in us-west-2 at once; without, the group retries us-east-1 every
  3 s until the capacity returns. Measured: from ``submit`` to the first step's row.
* ``dry mid-run``: the job runs in us-east-1; once its first checkpoint is durable,
  us-east-1 runs out of capacity (the settings file) and EC2 takes the instance back
  (an interruption notice); the capacity returns ``--shortage`` seconds later. With
  failover the replacement's launch fails MOVE_AFTER_FAILED_ROUNDS rounds (3 s apart),
  then the job moves to us-west-2 and resumes there from the checkpoint in the home
  store; without, it waits for us-east-1. Measured: from the notice to the first row of
  the next attempt.

Without failover the wait is the shortage itself (plus start-up), so the ratio grows
with the shortage: the figures say how much of the time failover saves for one that
lasts ``--shortage`` seconds, and what the move costs besides (the checkpoint's
transfer between regions, in the job's cost).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HOME, OTHER = "us-east-1", "us-west-2"
STEP = 0.05  # real seconds a step
SHORTAGE_SECONDS = 60.0  # how long the home region has no capacity (real seconds)
NOTICE_SECONDS = 2.0  # EC2's two minutes at the local cloud's default 60x

CELL = """
import time
state = {"w": 0.0}
ckpt = spot.Checkpoint(state=state)
for step in range(ckpt.restore(), 10**9):
    state["w"] += 1.0
    spot.log(step, w=state["w"])
    time.sleep(STEP)
    ckpt.maybe_save(step)
"""


def _config(home: Path, **settings: Any) -> None:
    path = home / "cloud" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings))
    tmp.replace(path)


def _first_row(event: Any) -> float | None:
    if event.type == "metric":
        return float(event.data.get("t") or event.time)
    return None


def _case(situation: str, failover: bool, shortage: float, home: Path) -> dict[str, Any]:
    """One job: its time to the first step (``start``) or from the notice to the next
    attempt's first step (``dry mid-run``), where it ran, and its cost."""
    import spotnb
    from spotnb.protocol.events import codec
    from spotnb.protocol.events.fold import fold

    regions = [HOME, OTHER] if failover else [HOME]
    _config(home)  # capacity everywhere, unless this case's shortage says otherwise
    if situation == "start":
        os.environ["SPOTNB_LOCAL_NO_CAPACITY"] = HOME
        os.environ["SPOTNB_LOCAL_NO_CAPACITY_SECONDS"] = str(shortage)
    else:
        os.environ.pop("SPOTNB_LOCAL_NO_CAPACITY", None)
        os.environ.pop("SPOTNB_LOCAL_NO_CAPACITY_SECONDS", None)
    submitted = time.time()
    handle = spotnb.submit(CELL, instance_types=["g4dn.xlarge"], inputs={"STEP": STEP},
                           checkpoint_every="10 steps", region=regions,
                           name=f"{situation}-{'failover' if failover else 'home'}")
    start = submitted
    first: float | None = None
    restored = None
    back = threading.Timer(shortage, _config, args=(home,))  # the capacity returns
    try:
        for event in handle.events(timeout=shortage + 240):
            body = codec.peek(event)
            if situation == "start":
                if (t := _first_row(event)) is not None:
                    first = t
                    break
                continue
            if restored is None and isinstance(body, codec.CheckpointEvent) and body.durable:
                # Home runs dry, EC2 takes the instance back; the capacity returns later.
                restored = body.step
                _config(home, no_capacity=[HOME])
                back.start()
                handle.interrupt()
            elif isinstance(body, codec.Instance) and body.noticed:
                start = event.time
            elif event.attempt >= 2 and (t := _first_row(event)) is not None:
                first = t
                break
    finally:
        back.cancel()  # this case's shortage must not end the next one's
        handle.stop()
    result = handle.wait(timeout=120)
    state = fold(handle.events(follow=False))
    if first is None:
        raise RuntimeError(f"{situation}: no first step ({result.status}: {result.reason})")
    last = max(state.attempts)
    return {"situation": situation, "failover": failover, "seconds": first - start,
            "region": state.attempts[last].region, "cost_usd": result.cost_usd,
            "transfer_usd": result.transfer_usd,
            "moved": next((r.reason for _t, r in state.regions if r.moved), None)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shortage", type=float, default=SHORTAGE_SECONDS,
                        help="seconds the home region has no capacity (default %(default)g)")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="spotnb-bench-failover-"))
    os.environ.update({"SPOTNB_HOME": str(home), "SPOTNB_LOCAL_HAZARD": "0",
                       "SPOTNB_LOCAL_NOTICE_SECONDS": str(NOTICE_SECONDS)})
    from spotnb.providers.local.failover import MOVE_AFTER_FAILED_ROUNDS
    from spotnb.providers.local.group import CAPACITY_RETRY_SECONDS

    print(f"local cloud: {HOME} without capacity for {args.shortage:g} s; failover after "
          f"{MOVE_AFTER_FAILED_ROUNDS} launch rounds {CAPACITY_RETRY_SECONDS:g} s apart; "
          f"a step every {STEP:g} s; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for situation in ("start", "dry mid-run"):
            for failover in (True, False):  # side by side, one run
                row = _case(situation, failover, args.shortage, home)
                rows.setdefault((situation, failover), []).append(row)
    print(f"\n{'situation':>12} {'case':>12} {'ran in':>10} {'to 1st step s':>14} "
          f"{'ratio':>6} {'cost $':>9} {'transfer $':>11}")
    for situation in ("start", "dry mid-run"):
        with_, without = rows[(situation, True)], rows[(situation, False)]
        fast = statistics.median(r["seconds"] for r in with_)
        slow = statistics.median(r["seconds"] for r in without)
        for case, found, seconds in (("failover", with_, fast), ("home only", without, slow)):
            print(f"{situation:>12} {case:>12} {found[-1]['region']:>10} {seconds:14.1f} "
                  f"{slow / seconds if case == 'failover' else 1.0:6.1f} "
                  f"{statistics.median(r['cost_usd'] for r in found):9.5f} "
                  f"{statistics.median(r['transfer_usd'] for r in found):11.7f}")
        if with_[-1]["moved"]:
            print(f"{'':>12} moved: {with_[-1]['moved']}")
    print(f"load after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
