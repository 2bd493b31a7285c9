"""Time to the first step when the first region has no capacity, with failover across
regions and without.

Run by hand: ``python benchmarks/bench_failover.py [--shortage 60] [--rounds 1]
[--cloud local|aws]`` (about three minutes plus four shortages on a quiet machine; on
the AWS simulator a few minutes more).

A small job (a Python loop that logs a step every STEP seconds and checkpoints every 10
steps) runs on the local cloud (``--cloud local``, the default) or on the AWS simulator
(``--cloud aws``, :class:`spotnb.testing.AwsSimulator` in both regions), real agent and
kernel, in two situations, each with failover (``--region us-east-1,us-west-2``) and
without (``--region us-east-1``), side by side in the same run:

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

On AWS (``--cloud aws``) the same, with EC2's signals as the simulator plays them: the
shortage is ``sim.no_capacity("us-east-1", seconds=shortage)`` (every type, every AZ of
home: ``InsufficientInstanceCapacity`` from RunInstances, Spot placement score 1); the
job names three types (EC2's placement scores of one or two are "always low" and demote
no region); the interruption is FIS's (``handle.interrupt()``); the notebook's capacity
watch polls every ``SPOTNB_AWS_CAPACITY_POLL`` seconds (default 5), and Auto Scaling
retries a failed round after 2 s. Also counted, by the simulator's request log: every
request spotnb made in the measured span (all its parts: notebook, instance and job
agents, runtime), priced at list prices (:mod:`spotnb.protocol.usage`), and the move's
own requests: those of ``AwsProvider.move_region`` (tagged ``move`` by this script),
the move's claim and its nodes' marks in the store (``group/moves/``,
``group/leaving/``) and the ``region`` event it writes.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HOME, OTHER = "us-east-1", "us-west-2"
STEP = 0.05  # real seconds a step
SHORTAGE_SECONDS = 60.0  # how long the home region has no capacity (real seconds)
NOTICE_SECONDS = 2.0  # EC2's two minutes at the local cloud's default 60x
#: On AWS, three types: EC2 scores one or two "always low", which demotes no region.
AWS_TYPES = ["g4dn.xlarge", "g5.xlarge", "g4dn.2xlarge"]

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


def _timed(handle: Any, situation: str, submitted: float, timeout: float,
           run_dry: Callable[[], None]) -> tuple[float, float | None]:
    """Follow the job of a case: (from when, its first step's time), the one figure
    both clouds measure. ``start``: from its submission to its first row. ``dry
    mid-run``: at its first durable checkpoint ``run_dry()`` takes home's capacity away
    and has EC2 take the instance back; from the notice to the next attempt's first
    row. None for the first step when the job ended or ``timeout`` passed first."""
    from spotnb.protocol.events import codec

    start, dried = submitted, False
    for event in handle.events(timeout=timeout):
        body = codec.peek(event)
        if situation == "start":
            if (t := _first_row(event)) is not None:
                return start, t
            continue
        if not dried and isinstance(body, codec.CheckpointEvent) and body.durable:
            dried = True
            run_dry()
        elif isinstance(body, codec.Instance) and body.noticed and start == submitted:
            start = event.time
        elif event.attempt >= 2 and (t := _first_row(event)) is not None:
            return start, t
    return start, None


def _row(situation: str, failover: bool, start: float, first: float | None, result: Any,
         state: Any) -> dict[str, Any]:
    """A case's figures, on either cloud: its time to the first step, where its last
    attempt ran, what it cost (the checkpoint's crossings from the job's fold), why it
    moved; ``end``, the first step's time."""
    if first is None:
        raise RuntimeError(f"{situation}: no first step ({result.status}: {result.reason})")
    last = max(state.attempts)
    return {"situation": situation, "failover": failover, "seconds": first - start,
            "end": first, "region": state.attempts[last].region,
            "cost_usd": result.cost_usd, "transfer_usd": state.transfer_usd(),
            "moved": next((r.reason for _t, r in state.regions if r.moved), None)}


def _case(situation: str, failover: bool, shortage: float, home: Path) -> dict[str, Any]:
    """One job: its time to the first step (``start``) or from the notice to the next
    attempt's first step (``dry mid-run``), where it ran, and its cost."""
    import spotnb
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
    back = threading.Timer(shortage, _config, args=(home,))  # the capacity returns

    def run_dry() -> None:
        # Home runs dry, EC2 takes the instance back; the capacity returns later.
        _config(home, no_capacity=[HOME])
        back.start()
        handle.interrupt()

    try:
        start, first = _timed(handle, situation, submitted, shortage + 240, run_dry)
    finally:
        back.cancel()  # this case's shortage must not end the next one's
        handle.stop()
    result = handle.wait(timeout=120)
    return _row(situation, failover, start, first, result, fold(handle.events(follow=False)))


# -- on the AWS simulator -----------------------------------------------------------


@contextlib.contextmanager
def _moves_traced() -> Iterator[list[tuple[float, float]]]:
    """Tag the requests of ``AwsProvider.move_region`` (origin ``move`` in their
    User-Agent, on the thread that moves); yields the moves' (start, end) times."""
    from spotnb.providers.aws import AwsProvider, _boto

    moving = threading.local()
    windows: list[tuple[float, float]] = []
    clients: dict[tuple[str, str], Any] = {}
    original_move, original_client = AwsProvider.move_region, AwsProvider.client

    def move_region(provider: AwsProvider, *args: Any, **kwargs: Any) -> None:
        moving.on, began = True, time.time()
        try:
            original_move(provider, *args, **kwargs)
        finally:
            moving.on = False
            windows.append((began, time.time()))

    def client(provider: AwsProvider, service: str, region: str) -> Any:
        if not getattr(moving, "on", False):
            return original_client(provider, service, region)
        if (service, region) not in clients:
            clients[(service, region)] = _boto.client(service, region, origin="move")
        return clients[(service, region)]

    AwsProvider.move_region = move_region  # type: ignore[method-assign,assignment]
    AwsProvider.client = client  # type: ignore[method-assign,assignment]
    try:
        yield windows
    finally:
        AwsProvider.move_region = original_move  # type: ignore[method-assign]
        AwsProvider.client = original_client  # type: ignore[method-assign]


def _requests(sim: Any, since: float, until: float) -> dict[str, Any]:
    """spotnb's requests between ``since`` and ``until`` (the simulator's own left
    out), and what they cost at list prices."""
    from spotnb.protocol import usage

    found = [r for r in sim.server.requests.snapshot()
             if r.origin != "simulator" and since <= r.time <= until]
    counts = collections.Counter(f"{r.service}:{r.operation}" for r in found)
    return {"requests": len(found), "requests_usd": usage.cost(dict(counts))}


def _move_requests(sim: Any, windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The requests the moves made (:func:`_moves_traced`): the provider's, tagged
    ``move``; the move's claim and its nodes' marks in the store; the group stream's
    write of its ``region`` event, within the move."""
    from spotnb.protocol import usage

    def the_moves(r: Any) -> bool:
        if r.origin == "move":
            return True
        key = str((r.call.params if r.call is not None else {}).get("Key", ""))
        if r.origin == "notebook" and r.service == "s3" and r.operation == "PutObject":
            return "/group/moves/" in key or "/group/leaving/" in key or (
                "/events/000000/" in key and any(a <= r.time <= b for a, b in windows))
        return False

    found = [r for r in sim.server.requests.snapshot() if the_moves(r)]
    counts = collections.Counter(f"{r.service}:{r.operation}" for r in found)
    return {"requests": dict(sorted(counts.items())), "usd": usage.cost(dict(counts))}


def _case_aws(sim: Any, situation: str, failover: bool, shortage: float) -> dict[str, Any]:
    """:func:`_case` on the AWS simulator (module docstring)."""
    import spotnb
    from spotnb.protocol.events.fold import fold

    regions = [HOME, OTHER] if failover else [HOME]
    sim.restore_capacity()  # capacity everywhere, unless this case's shortage says otherwise
    submitted = time.time()
    if situation == "start":
        sim.no_capacity(HOME, seconds=shortage)
    with _moves_traced() as moves:
        handle = spotnb.submit(CELL, provider="aws", instance_types=AWS_TYPES,
                               inputs={"STEP": STEP}, checkpoint_every="10 steps",
                               region=regions,
                               name=f"{situation}-{'failover' if failover else 'home'}")

        def run_dry() -> None:
            # Home runs dry, EC2 takes the instance back (FIS); the capacity returns
            # `shortage` seconds later.
            sim.no_capacity(HOME, seconds=shortage)
            handle.interrupt()

        try:
            start, first = _timed(handle, situation, submitted, shortage + 300, run_dry)
        finally:
            handle.stop()
        result = handle.wait(timeout=180)
        sim.wait_until_idle(120)
    # Read once every instance is gone: an instance away from home bills its crossings
    # as its job agent exits, after the result.
    row = _row(situation, failover, start, first, result, fold(handle.events(follow=False)))
    return {**row, **_requests(sim, start, row["end"]), "move": _move_requests(sim, moves)}


def _run_aws(args: argparse.Namespace, home: Path) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    from spotnb.providers.aws.capacity import MOVE_AFTER_FAILED_ROUNDS
    from spotnb.testing import AwsSimulator
    from spotnb.testing.autoscaling import CAPACITY_RETRY_SECONDS

    os.environ.setdefault("SPOTNB_ALLOWED_REGIONS", f"{HOME},{OTHER}")
    poll = os.environ.get("SPOTNB_AWS_CAPACITY_POLL", "5")
    rows: dict[tuple[str, bool], list[dict[str, Any]]] = {}
    with AwsSimulator(home / "sim", regions=(HOME, OTHER)) as sim:
        print(f"AWS simulator: {HOME} without capacity for {args.shortage:g} s; failover "
              f"after {MOVE_AFTER_FAILED_ROUNDS} failed launch rounds (Auto Scaling "
              f"retries after {CAPACITY_RETRY_SECONDS:g} s), the capacity watch polls "
              f"every {poll} s; types {', '.join(AWS_TYPES)}; a step every {STEP:g} s; "
              f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for _ in range(args.rounds):
            for situation in ("start", "dry mid-run"):
                for failover in (True, False):  # side by side, one run
                    row = _case_aws(sim, situation, failover, args.shortage)
                    rows.setdefault((situation, failover), []).append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shortage", type=float, default=SHORTAGE_SECONDS,
                        help="seconds the home region has no capacity (default %(default)g)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--cloud", choices=("local", "aws"), default="local",
                        help="the local cloud, or the AWS simulator (default %(default)s)")
    args = parser.parse_args(argv)
    home = Path(tempfile.mkdtemp(prefix="spotnb-bench-failover-"))
    os.environ.update({"SPOTNB_HOME": str(home), "SPOTNB_LOCAL_HAZARD": "0",
                       "SPOTNB_LOCAL_NOTICE_SECONDS": str(NOTICE_SECONDS)})
    aws = args.cloud == "aws"
    rows = _run_aws(args, home) if aws else _run_local(args, home)
    print(f"\n{'situation':>12} {'case':>12} {'ran in':>10} {'to 1st step s':>14} "
          f"{'ratio':>6} {'cost $':>9} {'transfer $':>11}"
          + (f" {'requests':>9} {'requests $':>11}" if aws else ""))
    for situation in ("start", "dry mid-run"):
        with_, without = rows[(situation, True)], rows[(situation, False)]
        fast = statistics.median(r["seconds"] for r in with_)
        slow = statistics.median(r["seconds"] for r in without)
        for case, found, seconds in (("failover", with_, fast), ("home only", without, slow)):
            print(f"{situation:>12} {case:>12} {found[-1]['region']:>10} {seconds:14.1f} "
                  f"{slow / seconds if case == 'failover' else 1.0:6.1f} "
                  f"{statistics.median(r['cost_usd'] for r in found):9.5f} "
                  f"{statistics.median(r['transfer_usd'] for r in found):11.1e}"
                  + (f" {statistics.median(r['requests'] for r in found):9.0f} "
                     f"{statistics.median(r['requests_usd'] for r in found):11.7f}"
                     if aws else ""))
        if with_[-1]["moved"]:
            print(f"{'':>12} moved: {with_[-1]['moved']}")
        if aws and with_[-1]["move"]["requests"]:
            move = with_[-1]["move"]
            print(f"{'':>12} the move's requests: "
                  + ", ".join(f"{op} {n}" for op, n in move["requests"].items())
                  + f" = ${move['usd']:.7f} at list prices")
    print(f"load after: {os.getloadavg()[0]:.1f}")


def _run_local(args: argparse.Namespace,
               home: Path) -> dict[tuple[str, bool], list[dict[str, Any]]]:
    from spotnb.providers.failover import MOVE_AFTER_FAILED_ROUNDS
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
    return rows


if __name__ == "__main__":
    main()
