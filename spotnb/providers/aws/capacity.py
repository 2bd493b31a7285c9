"""Waiting for capacity: the group's failed activities as events, and the on-demand
fallback.

EC2 Auto Scaling tries the group's other pools by itself when one has no spot capacity;
it records each failure as a scaling activity (``InsufficientInstanceCapacity`` ...).
While the notebook that launched a job is open, a :class:`CapacityWatch` thread reads
those activities until the first instance boots and writes them to the group's stream
as ``capacity_error`` events with a ``waiting_for_capacity`` status, so the dashboard
says why nothing runs yet. With ``SPOTNB_AWS_ONDEMAND_AFTER`` set, it also switches the
group to on-demand after that many seconds without spot capacity.

Not needed for recovery: the group keeps trying by itself, and the instance agent
(:mod:`.instance`) reports the same failures when an instance boots.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, EventReader, EventWriter, codec
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store
from spotnb.providers.aws.resources import capacity_failures, group_name, mixed_instances_policy

if TYPE_CHECKING:
    from spotnb.providers.aws import AwsProvider

__all__ = ["CapacityWatch", "stop_capacity_watches"]

log = logging.getLogger(__name__)

# The watcher gives up after this long without a first instance; the group keeps
# trying, and the instance agent reports what happened when it boots.
CAPACITY_WATCH_SECONDS = 3600.0

_WATCHES: set[CapacityWatch] = set()
_WATCHES_LOCK = threading.Lock()


def stop_capacity_watches() -> None:
    """Stop every capacity watcher of this process (the simulator does at its end)."""
    with _WATCHES_LOCK:
        watches = list(_WATCHES)
    for watch in watches:
        watch.stop()
    for watch in watches:
        if watch.is_alive():
            watch.join(timeout=5)


class CapacityWatch(threading.Thread):
    """Reports a job's capacity failures until its first instance boots; see the module
    docstring."""

    def __init__(self, provider: AwsProvider, spec: JobSpec, store: Store) -> None:
        super().__init__(name=f"spotnb-capacity-{spec.job_id}", daemon=True)
        self.provider = provider
        self.spec = spec
        self.store = store
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def start(self) -> None:
        with _WATCHES_LOCK:
            _WATCHES.add(self)
        super().start()

    def run(self) -> None:
        try:
            self._watch()
        except Exception:
            log.debug("the capacity watch of job %s ended", self.spec.job_id, exc_info=True)
        finally:
            with _WATCHES_LOCK:
                _WATCHES.discard(self)

    def _watch(self) -> None:
        settings = self.provider.settings
        reader = EventReader(self.store)
        reported = set()
        started = time.monotonic()
        ondemand = settings.ondemand_after == 0
        asg = self.provider.client("autoscaling", self.spec.resources.region)
        writer: EventWriter | None = None
        try:
            while not self._halt.wait(settings.capacity_poll):
                events = [e for e in reader.poll() if e.attempt == GROUP_STREAM]
                reported |= {e.data.get("activity_id") for e in events}
                if any(isinstance(e.body, codec.Instance) and e.body.launched
                       for e in events) or self.store.exists(layout.RESULT):
                    return
                if time.monotonic() - started > CAPACITY_WATCH_SECONDS:
                    return
                activities = asg.describe_scaling_activities(
                    AutoScalingGroupName=group_name(self.spec.job_id))["Activities"]
                fresh = [f for f in capacity_failures(activities)
                         if f["activity_id"] not in reported]
                if fresh and writer is None:
                    writer = EventWriter(self.store, GROUP_STREAM)
                for failure in fresh:
                    assert writer is not None
                    reported.add(failure["activity_id"])
                    writer.emit("status", state="waiting_for_capacity", detail=(
                        f"waiting for capacity: {failure['reason']}"
                        f"{' for ' + failure['instance_type'] if failure['instance_type'] else ''}"
                        "; Auto Scaling tries the other pools"))
                    writer.emit("instance", **failure)
                waited = time.monotonic() - started
                if (not ondemand and settings.ondemand_after is not None and reported
                        and waited > settings.ondemand_after):
                    self._fall_back_to_ondemand(asg, writer, waited)
                    ondemand = True
        finally:
            if writer is not None:
                writer.close()

    def _fall_back_to_ondemand(self, asg: Any, writer: EventWriter | None,
                               waited: float) -> None:
        group = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(self.spec.job_id)])["AutoScalingGroups"]
        if not group:
            return
        template = group[0]["MixedInstancesPolicy"]["LaunchTemplate"][
            "LaunchTemplateSpecification"]["LaunchTemplateId"]
        asg.update_auto_scaling_group(
            AutoScalingGroupName=group_name(self.spec.job_id),
            MixedInstancesPolicy=mixed_instances_policy(
                template_id=template, instance_types=self.spec.resources.instance_types,
                max_price=self.spec.resources.max_price, ondemand=True,
                strategy=group[0]["MixedInstancesPolicy"]["InstancesDistribution"].get(
                    "SpotAllocationStrategy") or self.provider.settings.spot_strategy))
        if writer is not None:
            writer.emit("status", state="waiting_for_capacity", detail=(
                f"no spot capacity for {waited:.0f} s: falling back to on-demand "
                "(SPOTNB_AWS_ONDEMAND_AFTER)"))
