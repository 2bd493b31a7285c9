"""A new supervisor for a job whose supervisor died: the instances it takes over.

Supervisor death (a crash, SIGKILL, a laptop that rebooted): any spotnb entry point that
finds the job without a result and without a live supervisor starts a new one with
``--adopt`` (:meth:`spotnb.providers.local.LocalProvider.ensure_supervised`), and so does
an instance whose supervisor is gone when it boots or when its agent ends
(:mod:`.reaper`). The new group (:mod:`.group`) reads what the old one did from its event
stream and, through :func:`take_over`, adopts the instances still running (their
metadata service comes back on the same port, notices included) and ends those it
cannot adopt; it then ends those whose termination was due, writes a pending result,
and carries on: the job resumes as after an interruption.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Any

from spotnb.protocol.spec import JobSpec
from spotnb.providers import catalog
from spotnb.providers.local.instance import LocalInstance
from spotnb.providers.local.pools import Emit, Pools
from spotnb.providers.local.state import (
    ProcessRecord,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
    write_json,
)

__all__ = ["LOST", "take_over"]

log = logging.getLogger(__name__)

#: The termination reason of an instance no supervisor could adopt.
LOST = "lost-while-unsupervised"


def take_over(spec: JobSpec, pools: Pools, emit: Emit, ended: Collection[str], now: float,
              grace: float) -> list[LocalInstance]:
    """The job's instances on record that a new supervisor adopts; the others (not in
    ``ended``, which the group's stream says ended) are ended (:func:`lose`).

    Each instance on record: its first process alive -> adopted (same IMDS endpoint,
    same notice, same region: the group carries on there, :meth:`.Pools.resume`);
    gone, never recorded or not adoptable -> what is left of it ended (``grace``:
    between SIGTERM and SIGKILL) and logged ``terminated`` (:data:`LOST`).
    """
    from spotnb.providers.local import LocalProvider

    adopted = []
    for meta in LocalProvider().instances(spec.job_id):
        instance_id = meta.get("instance_id")
        if meta.get("state") == "terminated" or instance_id in ended:
            continue
        # Where it runs: a job away from home (:mod:`.failover`) is there still.
        region = str(meta.get("region") or spec.resources.region)
        pool = next((p for p in catalog.pools(meta["instance_type"], region)
                     if p.az == meta.get("az")), None)
        record = ProcessRecord.from_dict(read_json(Path(meta["dir"]) / "pid.json"))
        if pool is None or record is None or not record.alive():
            lose(spec, emit, meta, record, grace)
            continue
        try:
            inst = LocalInstance.adopt(meta, pool, pools.market(pool), now)
        except OSError as e:
            log.warning("cannot adopt %s (its metadata endpoint: %s); ending it",
                        instance_id, e)
            lose(spec, emit, meta, record, grace)
            continue
        log.info("adopted instance %s (agent pid %d)", inst.id, record.pid)
        adopted.append(inst)
    return adopted


def lose(spec: JobSpec, emit: Emit, meta: dict[str, Any], record: ProcessRecord | None,
         grace: float) -> None:
    """End an instance on record that this supervisor cannot adopt: its first process
    gone, never recorded (the supervisor died between starting it and writing its
    ``pid.json``) or its metadata endpoint taken. Whatever still runs of it (its reaper,
    an agent, what they started) is ended, as EC2 ends an instance: left running, it
    would work on the job with no metadata service and no supervisor to end it."""
    instance_id = str(meta.get("instance_id"))
    if record is not None:
        kill_tree(record, grace)
    strays = [proc for proc, instance, _ in marked_processes(spec.job_id)
              if instance == instance_id]
    if strays:
        log.warning("ending %d process(es) of instance %s, which no supervisor "
                    "adopted", len(strays), instance_id)
        kill_processes(strays, grace)
    with contextlib.suppress(OSError):
        path = Path(meta["dir"]) / "meta.json"
        write_json(path, {**(read_json(path) or {}), "state": "terminated", "reason": LOST})
    emit("instance", instance_id, action="terminated", reason=LOST, instance_id=instance_id,
         instance_type=meta.get("instance_type"), az=meta.get("az"), pool=meta.get("pool"))
