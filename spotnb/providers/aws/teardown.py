"""What an instance deletes when its job is over (Step 4 of :mod:`.instance`).

Every instance of the job that sees its result does the same; each step is
idempotent. The order: the queues, the secrets and the template first, the Auto
Scaling group (which terminates this instance), the network, and the role last (its
credentials are what the deletions run with). Only the group bills: its deletion is
retried through an outage, and if it still fails the caller ends the instance itself.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from spotnb.protocol import backoff
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import NotFound, Store
from spotnb.providers.aws import _boto

log = logging.getLogger(__name__)

__all__ = ["delete_job_resources", "queue_names"]


def queue_names(store: Store, job_id: str) -> list[str]:
    """The job's queues: its control queue and the registered followers' (a follower
    deletes its own when it stops; `spotnb aws cleanup` finds the rest)."""
    from spotnb.protocol.events.live import CONTROL_QUEUE, WATCHERS_PREFIX
    from spotnb.providers.aws.queue import sqs_name

    names = [sqs_name(job_id, CONTROL_QUEUE)]
    try:
        keys = store.list_keys(WATCHERS_PREFIX)
    except Exception:
        keys = []
    names += [k.rsplit("/", 1)[-1].removesuffix(".json") for k in keys]
    return names


def delete_job_resources(store: Store, spec: JobSpec, region: str,
                         group_patience: float) -> bool:
    """Delete the job's resources in ``region`` (where its group runs; its queues and
    secrets are in its home, the store's region) as its instance (its role's
    credentials). False if its Auto Scaling group is still there after
    ``group_patience`` seconds of tries; what else fails is logged (`spotnb aws cleanup`
    deletes it)."""
    from spotnb.providers.aws import AwsProvider

    provider = AwsProvider(region=region)
    job_id, home = spec.job_id, spec.resources.region
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("queues", lambda: provider._delete_queues(
            job_id, home, names=queue_names(store, job_id))),
        ("secrets", lambda: provider._delete_secrets(job_id, home, names=spec.secrets)
         if spec.secrets else None),
        ("launch template", lambda: provider._delete_template(job_id, region)),
        ("Auto Scaling group", lambda: backoff.patiently(
            "deleting the job's Auto Scaling group",
            functools.partial(provider._delete_group, job_id, region), group_patience,
            give_up_on=(NotFound,))),
        ("network", lambda: _delete_network(spec, region)),
        ("IAM role", lambda: provider._delete_role(job_id, region, own=True)),
    ]
    group_deleted = True
    for label, step in steps:
        try:
            step()
        except Exception:
            log.exception("could not delete the job's %s; `spotnb aws cleanup` will", label)
            if label == "Auto Scaling group":
                group_deleted = False
    return group_deleted


def _delete_network(spec: JobSpec, region: str) -> None:
    """A multi-node job's security and placement groups (:mod:`.cluster`): AWS keeps
    them while an instance (this one) is in them; the next multi-node launch or `spotnb
    aws cleanup` deletes those. A job of several regions: in each of them (a move
    leaves its old region's network to the job's end when AWS still keeps it then; two
    Describe calls a region)."""
    from spotnb.providers.aws import cluster

    if spec.resources.max_nodes <= 1:
        return
    for where in dict.fromkeys([region, *spec.resources.regions]):
        left = cluster.delete_network(_boto.client("ec2", where), spec.job_id)
        if left:
            log.info("still in use in %s, deleted later: %s", where, ", ".join(left))
