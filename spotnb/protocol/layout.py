"""Where things live: ``SPOTNB_HOME`` on this machine and the keys of a job's prefix.

Job prefix (in the store, one per job)::

    spec.json                   the JobSpec (written once)
    inputs.pkl                  cloudpickled {name: cloudpickled value} of the inputs
    workdir.tar.gz              files shipped with the job (helper modules), unpacked
                                into the kernel's working directory
    lease.json                  who runs the job: {"epoch", "holder", "heartbeat", ...}
                                (a multi-node job: who runs node slot 0)
    lease.<k>.json              multi-node jobs: who runs node slot k (k >= 1)
    rendezvous.json             multi-node jobs: which agent hosts the rendezvous store
                                of which generation (spotnb.kernel_remote.multinode.rendezvous)
    events/<stream>/<seq>.jsonl the event log (see spotnb.protocol.events)
    checkpoints/<id>/...        checkpoint data, then checkpoints/<id>/MANIFEST.json
    checkpoints/LATEST          pointer to the newest complete checkpoint
    sync/<name>/...             spot.sync_dir snapshots (same protocol as checkpoints)
    control/stop.json           a stop request (from the notebook or the CLI)
    standby/<instance>.json     a warm standby is ready (spotnb.kernel_remote.standby)
    standby.json                jobs on AWS: the instance (node) the group's one warm
                                standby is for (spotnb.providers.aws.standby)
    group/moves/<n>.json        jobs on AWS of several regions: the claim of the job's
                                move after its n-th region choice by the one notebook
                                that makes it (spotnb.providers.aws.capacity)
    group/leaving/<instance>.json
                                jobs on AWS of several regions: a node that the job's
                                move to another region ends, written before Auto Scaling
                                ends it (its agents read it: their notice's reason;
                                spotnb.providers.aws.launching)
    boot/<instance>.log         jobs on AWS: the whole boot log of an instance whose
                                bootstrap failed (spotnb.providers.aws.bootstrap)
    boot/<instance>.ok          jobs on AWS: an instance whose agent came up; the boot
                                failures after the newest of these are "in a row"
    outputs.pkl                 cloudpickled {name: value} of the job's outputs
    result.json                 the final result, written once by the agent
    summary.json                the job's record (spotnb.records): attempts, cost,
                                final metrics, checkpoints; written by the notebook
                                when the job ends, derived from the rest, rewritable

``SPOTNB_HOME`` (default ``~/.spotnb``)::

    store/jobs/<job_id>/        the default local store's job prefixes
    index/<job_id>.json         where each job submitted from here lives (its store
                                URI, which may be a bucket), for attach and listing
    index/listing/<job_id>.json an ended job's row of ``spotnb jobs`` with the state
                                of its event log it was computed from (a cache)
    cloud/                      the local cloud's state (groups, instances)
"""

from __future__ import annotations

import os
from pathlib import Path

SPEC = "spec.json"
INPUTS = "inputs.pkl"
WORKDIR = "workdir.tar.gz"
LEASE = "lease.json"
RENDEZVOUS = "rendezvous.json"
CHECKPOINTS = "checkpoints"
SYNC = "sync"
STOP = "control/stop.json"
OUTPUTS = "outputs.pkl"
RESULT = "result.json"
SUMMARY = "summary.json"
STANDBY_CLAIM = "standby.json"
REGION_MOVES = "group/moves/"
BOOT = "boot/"


def lease_key(slot: int = 0) -> str:
    """The lease of node slot ``slot``: ``lease.json`` for slot 0 (every single-node
    job's one lease), ``lease.<slot>.json`` for the other slots of a multi-node job."""
    return LEASE if slot == 0 else f"lease.{slot}.json"


def standby_ready_key(instance_id: str) -> str:
    """Where a warm standby's agent says it is ready (one PUT per standby; see
    :mod:`spotnb.kernel_remote.standby`): its group reads it."""
    return f"standby/{instance_id}.json"


def leaving_region_key(instance_id: str) -> str:
    """Where the move of a job to another region says that it ends ``instance_id``, a
    node left in the region it leaves (one PUT per node; its agents read it once, when
    Auto Scaling ends the instance: :mod:`spotnb.providers.aws.launching`)."""
    return f"group/leaving/{instance_id}.json"


def boot_log_key(instance_id: str) -> str:
    """The boot log of an instance whose bootstrap failed (AWS: written by its user
    data's failure handler, :mod:`spotnb.providers.aws.bootreport`)."""
    return f"{BOOT}{instance_id}.log"


def boot_ok_key(instance_id: str) -> str:
    """The mark of an instance whose agent came up: boot failures older than the newest
    mark do not count towards the job's limit (:mod:`spotnb.providers.aws.bootstrap`)."""
    return f"{BOOT}{instance_id}.ok"


#: The instance a warm standby stands by for, where its instance knows it (AWS: from the
#: claim, spotnb.providers.aws.standby): in the job agent's environment, and said in its
#: ready mark (``standby_for``), so that no other instance moves to it.
STANDBY_FOR_ENV = "SPOTNB_STANDBY_FOR"


def node_slot(attempt: int, max_nodes: int) -> int:
    """The node slot whose agent writes attempt (epoch) ``attempt`` of a job of
    ``max_nodes`` nodes: slot k's epochs are k+1, k+1+MAX, k+1+2*MAX, ... (one stride of
    MAX per tenure, :mod:`spotnb.protocol.lease`), so an epoch of MAX or less is its slot's first
    tenure (a node joining) and a later one a replacement."""
    return (attempt - 1) % max(1, max_nodes)


def home() -> Path:
    """The directory for spotnb's local state (``$SPOTNB_HOME``, default ``~/.spotnb``)."""
    env = os.environ.get("SPOTNB_HOME")
    return Path(env).expanduser().absolute() if env else Path.home() / ".spotnb"


def default_store_root() -> Path:
    """The default local store: job prefixes live under ``jobs/`` in it."""
    return home() / "store"


def index_dir() -> Path:
    """Pointers to the jobs submitted from this machine, whatever their store."""
    return home() / "index"


def cloud_dir() -> Path:
    """The local cloud's state directory."""
    return home() / "cloud"
