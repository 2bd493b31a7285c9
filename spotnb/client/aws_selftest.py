"""``spotnb aws selftest``: spotnb on your own AWS account, end to end, within a budget.

Everything else in spotnb's tests runs against a simulator (moto plus real agents) that
is held to AWS's published contracts; this is the run on AWS itself. It starts billed
spot instances, so it refuses to start without a budget (``--budget USD``, about $1),
or with one below the plan's bound: each step's instance-hours at most (its time limit
times its instances) at the dearest spot price the catalog has for the types in the
region, plus their EBS volumes. Every job it starts carries its share as its own
``budget_usd`` and a time limit, which the instance agent enforces.

The plan, and what each step proves that only AWS can::

    setup       the printed notebook-user policy is enough to create the bucket, the
                security group and the FIS role on a fresh account
    doctor      credentials, region, image (the PyTorch Deep Learning AMI), spot vCPU
                quotas (a new account's are 0) and permissions, as AWS answers them
    quickstart  a cell runs on a spot GPU from the Auto Scaling group, survives one FIS
                interruption (notice -> final save -> replacement -> resume) and ends
                with the result of an uninterrupted run
    standby     a rebalance recommendation (FIS, 10 minutes ahead of its notice) starts
                a warm standby, and the job moves to it before the notice, no step lost
    multinode   a 1:2-node job forms its world across two instances (one AZ, the
                job's placement and security groups), loses a node to FIS, goes on with
                one and re-forms at two when the replacement joins
    cleanup     nothing of spotnb is left in the account: no group, template, instance,
                role, queue, secret, security or placement group

A step that fails is reported with why and the plan stops there (the jobs' own limits
still hold); the cleanup always runs. ``pytest -m aws`` runs the same plan
(``tests/test_aws_selftest.py``, with ``SPOTNB_AWS_TESTS=1`` and
``SPOTNB_AWS_SELFTEST_BUDGET``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from spotnb.protocol.events import codec
from spotnb.protocol.spec import SpecError

__all__ = ["DEFAULT_TYPES", "STEPS", "Outcome", "Sizes", "Step", "expected_result", "plan",
           "run"]

log = logging.getLogger(__name__)

#: The cheapest GPU type the default image supports (an NVIDIA T4, about $0.18/h on
#: spot in us-east-1); ``--types`` names others (the bound follows the dearest).
DEFAULT_TYPES = ("g4dn.xlarge",)
#: The Deep Learning AMI's root volume (gp3) and its price per GB-month (us-east-1):
#: billed per second while an instance runs, as its spot price is.
EBS_GB = 100
EBS_USD_PER_GB_MONTH = 0.08
HOURS_PER_MONTH = 730.0
#: Spot prices move: the catalog's dearest price of the types is taken this much higher.
PRICE_MARGIN = 1.25


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of the plan: what it proves, and its bound (instances x minutes)."""

    name: str
    proves: str
    instances: int = 0
    minutes: float = 0.0

    @property
    def instance_hours(self) -> float:
        return self.instances * self.minutes / 60.0


STEPS: tuple[Step, ...] = (
    Step("setup", "the printed notebook-user policy is enough to create the bucket, the "
                  "security group and the FIS role"),
    Step("doctor", "credentials, region, image, spot vCPU quotas and permissions, as AWS "
                   "answers them"),
    Step("quickstart", "a cell on a spot GPU survives an FIS interruption (notice, final "
                       "save, replacement, resume) with the result of an uninterrupted run",
         instances=2, minutes=30),
    Step("standby", "a rebalance recommendation starts a warm standby and the job moves "
                    "to it before the notice, no step lost", instances=2, minutes=30),
    Step("multinode", "a 1:2-node job loses a node to FIS, goes on with one and re-forms "
                      "at two when the replacement joins", instances=3, minutes=30),
    Step("cleanup", "nothing of spotnb is left in the account"),
)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """How long the jobs train (steps and seconds per step) and what they must show:
    on AWS long enough for a replacement or a standby to boot (a Deep Learning AMI
    boots in 3-6 minutes); on the simulator far less."""

    steps: int = 600
    step_seconds: float = 1.0
    #: FIS's rebalance recommendation this long before its notice (standby step).
    standby_lead: float = 600.0
    #: The instances must have a CUDA GPU (AWS); the simulator's have none.
    require_gpu: bool = True
    #: How long a step may take (seconds) before it is given up, at most.
    step_timeout: float = 2400.0


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a step did: ``ok`` (None: not run), what it found, what it cost."""

    step: str
    ok: bool | None
    detail: str
    cost_usd: float = 0.0


def expected_result(steps: int) -> int:
    """What the selftest cells compute, uninterrupted: ``steps`` rounds of a 64-bit LCG
    from 1 (integers: the same on every machine, so an interrupted run must match)."""
    x = 1
    for _ in range(steps):
        x = (6364136223846793005 * x + 1442695040888963407) % (1 << 64)
    return x


#: The single-node cell: the LCG under spot.Checkpoint, one step a STEP_SECONDS, and
#: which GPU it ran on (the image's PyTorch, with CUDA). The first attempt holds its
#: last step until it ends (each step interrupts it or moves it to a standby, well
#: before): the interruption lands in training however fast the steps or slow the
#: notice, and the check cannot pass by a race.
SINGLE_CELL = """
import time
ckpt = spot.Checkpoint(lcg=1)
start = ckpt.restore()
x = ckpt["lcg"]
for step in range(start, STEPS):
    x = (6364136223846793005 * x + 1442695040888963407) % (1 << 64)
    ckpt["lcg"] = x
    spot.log(step, lcg=x % 1000)
    ckpt.maybe_save(step)
    time.sleep(STEP_SECONDS)
    while step == STEPS - 1 and spot.attempt == 1:
        ckpt.maybe_save(step)
        time.sleep(STEP_SECONDS)
try:
    import torch
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
except ImportError:
    gpu = "no torch"
result = x
"""

#: The multi-node cell: the same LCG on every rank, agreed each step with an
#: all-reduce over the job's nodes (gloo: the nodes reach each other through the job's
#: security group). It trains STEPS steps at least, and on until its world has been
#: smaller than NODES and is whole again (every rank sees the same world size and
#: restores the same ``shrunk``, which the save before a node joins carries: they stop
#: at the same step), so the job ends once the replacement joined, however long the
#: notice took to land or the replacement to boot, never before; then every rank of
#: the final world must hold the same state. (NODES=1: nothing to wait for.)
MULTI_CELL = """
import time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
ckpt = spot.Checkpoint(lcg=1, shrunk=False)
start = ckpt.restore()
x = ckpt["lcg"]
ckpt["shrunk"] = ckpt["shrunk"] or dist.get_world_size() < NODES or NODES == 1
step = start
while step < STEPS or dist.get_world_size() < NODES or not ckpt["shrunk"]:
    x = (6364136223846793005 * x + 1442695040888963407) % (1 << 64)
    agreed = torch.tensor([x % 1000], dtype=torch.int64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    ckpt["lcg"] = x
    spot.log(step, lcg=int(agreed.item()), world=dist.get_world_size())
    ckpt.maybe_save(step)
    time.sleep(STEP_SECONDS)
    step += 1
final = torch.tensor([x % 1000, -(x % 1000)], dtype=torch.int64)
dist.all_reduce(final, op=dist.ReduceOp.MAX)
if final.tolist() != [x % 1000, -(x % 1000)]:
    raise RuntimeError(f"the ranks of the final world disagree: {final.tolist()}")
result, steps, world = x, step, dist.get_world_size()
dist.destroy_process_group()
"""


def hourly_bound(region: str, instance_types: Sequence[str]) -> float:
    """What one instance of ``instance_types`` is taken to cost an hour in ``region``:
    the dearest spot price of their pools in the bundled catalog times
    :data:`PRICE_MARGIN` (prices move; on-demand where the catalog has no spot price),
    plus the image's EBS volume. The jobs' own budgets, which the instance agent
    enforces from the prices it sees, are what holds the spending to the bound."""
    from spotnb.providers import catalog

    prices = []
    for instance_type in instance_types:
        catalog.check_instance_type(instance_type, region)
        spot = [p.spot for p in catalog.pools(instance_type, region) if p.spot]
        ondemand = catalog.ondemand_price(instance_type, region)
        if spot:
            prices.append(max(spot) * PRICE_MARGIN)
        elif ondemand:
            prices.append(ondemand)
    if not prices:
        raise SpecError(f"the catalog has no price for {', '.join(instance_types)} in "
                        f"{region}: choose types it lists (spotnb's instance picker)")
    return max(prices) + EBS_GB * EBS_USD_PER_GB_MONTH / HOURS_PER_MONTH


def plan(region: str, instance_types: Sequence[str] = DEFAULT_TYPES,
         steps: Sequence[str] | None = None) -> list[tuple[Step, float]]:
    """The steps to run (all, or those named: ``setup`` and ``cleanup`` always) with
    each one's cost bound in USD."""
    names = {s.name for s in STEPS}
    unknown = sorted(set(steps or ()) - names)
    if unknown:
        raise SpecError(f"no selftest step {', '.join(unknown)}: the steps are "
                        f"{', '.join(s.name for s in STEPS)}")
    chosen = [s for s in STEPS if steps is None or s.name in steps
              or s.name in ("setup", "cleanup")]
    hourly = hourly_bound(region, instance_types)
    return [(s, round(s.instance_hours * hourly, 4)) for s in chosen]


def run(budget_usd: float | None, *, region: str | None = None,
        instance_types: Sequence[str] = DEFAULT_TYPES, steps: Sequence[str] | None = None,
        sizes: Sizes | None = None, dry_run: bool = False,
        say: Callable[[str], None] = log.info) -> list[Outcome]:
    """Run the plan (see the module docstring) within ``budget_usd``; each step's
    :class:`Outcome`. Refuses (SpecError, nothing started) without a budget or with
    one below the plan's bound. ``dry_run``: the plan only."""
    from spotnb.providers.aws import _boto

    if budget_usd is None:
        raise SpecError("spotnb aws selftest starts billed spot instances: give it a "
                        "budget, e.g. --budget 1 (USD); `--dry-run` shows the plan and "
                        "its bound")
    if budget_usd <= 0:
        raise SpecError(f"the budget must be a positive amount of USD, not {budget_usd}")
    region = _boto.check_region(region or str(_boto.session().region_name or "us-east-1"))
    chosen = plan(region, instance_types, steps)
    bound = sum(cost for _, cost in chosen)
    for step, cost in chosen:
        say(f"{step.name:<10} at most ${cost:.2f}: proves {step.proves}")
    say(f"at most ${bound:.2f} in {region} on {', '.join(instance_types)}")
    if bound > budget_usd:
        raise SpecError(f"the plan may cost up to ${bound:.2f}, above the budget of "
                        f"${budget_usd:.2f}: raise --budget, or run fewer steps "
                        "(--steps quickstart)")
    if dry_run:
        return [Outcome(s.name, None, "planned", cost) for s, cost in chosen]
    return _Run(region, tuple(instance_types), sizes or Sizes(), say).all(chosen)


class _Run:
    """One run of the plan."""

    def __init__(self, region: str, instance_types: tuple[str, ...], sizes: Sizes,
                 say: Callable[[str], None]) -> None:
        self.region = region
        self.types = instance_types
        self.sizes = sizes
        self.say = say

    def all(self, chosen: list[tuple[Step, float]]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        failed = False
        for step, cost in chosen:
            if step.name == "cleanup":
                continue
            if failed:
                outcomes.append(Outcome(step.name, None, "not run: an earlier step failed"))
                continue
            self.say(f"{step.name}: {step.proves} ...")
            try:
                outcome = getattr(self, f"_{step.name}")(step, cost)
            except Exception as err:  # a step's failure is its outcome; cleanup follows
                log.debug("selftest step %s failed", step.name, exc_info=True)
                outcome = Outcome(step.name, False, f"{type(err).__name__}: {err}")
            outcomes.append(outcome)
            self.say(f"{step.name}: {'ok' if outcome.ok else 'FAILED'}: {outcome.detail}")
            failed = failed or not outcome.ok
        outcomes.append(self._cleanup())
        self.say(f"cleanup: {'ok' if outcomes[-1].ok else 'FAILED'}: {outcomes[-1].detail}")
        return outcomes

    # ---------------------------------------------------------------- the steps

    def _setup(self, step: Step, cost: float) -> Outcome:
        from spotnb.providers.aws import admin

        report = admin.setup(self.region)
        return Outcome(step.name, True, "; ".join(report.actions))

    def _doctor(self, step: Step, cost: float) -> Outcome:
        from spotnb.providers.aws import admin

        checks = admin.doctor(self.region)
        problems = [f"{c.name}: {c.detail}" for c in checks if c.ok is False]
        if problems:
            return Outcome(step.name, False, "; ".join(problems))
        unknown = [c.name for c in checks if c.ok is None]
        return Outcome(step.name, True, f"{len(checks)} checks"
                       + (f" ({', '.join(unknown)} could not be told)" if unknown else ""))

    def _submit(self, code: str, name: str, cost: float, step: Step, steps: int,
                step_seconds: float, **extra: Any) -> Any:
        import spotnb

        return spotnb.submit(
            code, provider="aws", region=self.region, instance_types=list(self.types),
            name=f"selftest-{name}",
            inputs={"STEPS": steps, "STEP_SECONDS": step_seconds, **extra.pop("inputs", {})},
            outputs=extra.pop("outputs", ["result"]), checkpoint_every="25 steps",
            budget_usd=max(cost, 0.01), max_duration=step.minutes * 60, **extra)

    def _follow(self, handle: Any) -> Generator[Any, None, None]:
        """The job's events, followed live, for :meth:`_wait_for`: one follower for all
        of a step's waits (a new one registers with the job's agent anew and gets
        live events only once the agent saw that: with a second follower the
        multinode step, waiting for step 80, sent its FIS notice at step ~300),
        closed after them."""
        yield from handle.events(timeout=self.sizes.step_timeout)

    def _when_step(self, events: Iterator[Any], step: int) -> None:
        """Wait until the job logged ``step``."""
        self._wait_for(events, lambda e: isinstance(e.body, codec.Metric) and
                       e.body.step is not None and e.body.step >= step, f"step {step}")

    def _wait_for(self, events: Iterator[Any], seen: Callable[[Any], bool],
                  what: str) -> None:
        """Follow the job's ``events`` until one is ``seen``; an error if the job ends
        or the step's time runs out first."""
        for event in events:
            if seen(event):
                return
            if isinstance(event.body, codec.Result):
                raise RuntimeError(f"the job ended before {what}: {event.body.reason}")
        raise TimeoutError(f"no {what} within {self.sizes.step_timeout:g} s")

    def _check_result(self, result: Any, steps: int) -> list[str]:
        wrong = []
        if result.status != "completed":
            wrong.append(f"it ended {result.status}: {result.reason}")
            return wrong
        if result.outputs.get("result") != expected_result(steps):
            wrong.append("its result differs from the uninterrupted run's")
        gpu = str(result.outputs.get("gpu", ""))
        if self.sizes.require_gpu and "gpu" in result.outputs and gpu.startswith("no "):
            wrong.append(f"the instance had {gpu}")
        return wrong

    def _quickstart(self, step: Step, cost: float) -> Outcome:
        sizes = self.sizes
        handle = self._submit(SINGLE_CELL, "quickstart", cost, step, sizes.steps,
                              sizes.step_seconds, outputs=["result", "gpu"], standby=False)
        self._when_step(self._follow(handle), sizes.steps // 3)
        handle.interrupt()  # FIS: the notice, two minutes before EC2 takes the instance
        result = handle.wait(timeout=sizes.step_timeout)
        wrong = self._check_result(result, sizes.steps)
        if result.interruptions != 1:
            wrong.append(f"{result.interruptions} interruptions, not 1")
        types = sorted({a.instance_type for a in result.attempts if a.instance_type})
        return Outcome(step.name, not wrong, "; ".join(wrong) or (
            f"completed on {', '.join(types)} ({result.outputs.get('gpu')}) across 1 FIS "
            f"interruption, {len(result.attempts)} attempts, the uninterrupted result; "
            f"${result.cost_usd:.4f}"), result.cost_usd)

    def _standby(self, step: Step, cost: float) -> Outcome:
        sizes = self.sizes
        handle = self._submit(SINGLE_CELL, "standby", cost, step, sizes.steps,
                              sizes.step_seconds, outputs=["result", "gpu"], standby=True,
                              standby_first_hour=True)
        self._when_step(self._follow(handle), sizes.steps // 4)
        # FIS: the rebalance recommendation now, its notice standby_lead later.
        handle.provider.interrupt(handle.job_id, rebalance_lead=sizes.standby_lead)
        result = handle.wait(timeout=sizes.step_timeout)
        wrong = self._check_result(result, sizes.steps)
        moved = [a for a in result.attempts if a.end_reason == "moved to its standby"]
        if not moved:
            wrong.append("no attempt moved to a standby: "
                         + ", ".join(a.end_reason for a in result.attempts))
        if result.interruptions:
            wrong.append(f"{result.interruptions} interruptions: the notice came before "
                         "the move")
        return Outcome(step.name, not wrong, "; ".join(wrong) or (
            f"moved to its warm standby before the notice ({len(result.attempts)} "
            f"attempts), the uninterrupted result; ${result.cost_usd:.4f}"),
            result.cost_usd)

    def _multinode(self, step: Step, cost: float) -> Outcome:
        # The cell trains on past its steps while its world is not whole: the job ends
        # once the replacement joined (it boots after EC2 ended the node), never before.
        sizes = self.sizes
        handle = self._submit(MULTI_CELL, "multinode", cost, step, sizes.steps,
                              sizes.step_seconds * 0.75, nodes="1:2", standby=False,
                              inputs={"NODES": 2}, outputs=["result", "steps", "world"])
        # Both nodes in the world, and training: then one node's FIS notice.
        with contextlib.closing(self._follow(handle)) as events:
            self._wait_for(events, lambda e: isinstance(e.body, codec.World)
                           and e.body.nodes == 2, "the world to form at 2 nodes")
            self._when_step(events, sizes.steps // 3)
        handle.interrupt(node=1)  # FIS, to one node
        result = handle.wait(timeout=sizes.step_timeout)
        steps = int(result.outputs.get("steps") or 0)
        wrong = self._check_result(result, steps)
        if result.status == "completed" and (steps < sizes.steps
                                             or result.outputs.get("world") != 2):
            wrong.append(f"it ended after {steps} steps in a world of "
                         f"{result.outputs.get('world')}, not {sizes.steps}+ in one of 2")
        worlds = [nodes for _, nodes, _ in result.worlds]
        if 1 not in worlds or worlds[-1] != 2:
            wrong.append(f"the world went {worlds}, not 2 -> 1 -> 2")
        return Outcome(step.name, not wrong, "; ".join(wrong) or (
            f"the world went {' -> '.join(map(str, worlds))} across one node's FIS "
            f"interruption ({steps} steps), the uninterrupted result; "
            f"${result.cost_usd:.4f}"), result.cost_usd)

    def _cleanup(self) -> Outcome:
        """Delete what the jobs left (AWS keeps a security or placement group while an
        instance is in it: tried again for a few minutes) and check nothing is."""
        from spotnb.providers.aws import AwsProvider, CleanupIncomplete

        provider = AwsProvider(region=self.region)
        done: list[str] = []
        deadline = time.monotonic() + CLEANUP_SECONDS
        while True:
            try:
                done += provider.cleanup()
            except CleanupIncomplete as err:
                done += err.done
                if time.monotonic() > deadline:
                    return Outcome("cleanup", False, "; ".join(err.failed))
            left = provider.cleanup(dry_run=True)
            running = provider._instances(self.region, None, ("pending", "running"))
            if not left and not running:
                return Outcome("cleanup", True, f"nothing left ({len(done)} deleted)")
            if time.monotonic() > deadline:
                return Outcome("cleanup", False, "left: " + "; ".join(
                    left + [i["InstanceId"] for i in running]))
            time.sleep(CLEANUP_POLL_SECONDS)


#: How long the cleanup waits for the last instances to end (their groups go first).
CLEANUP_SECONDS = 600.0
CLEANUP_POLL_SECONDS = 15.0
