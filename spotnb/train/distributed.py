"""The distributed job, as the runtime inside a worker sees it: the world the cell runs
in (its rank and size, asked of torch once per process group), whether a registered
module holds sharded tensors, and how long a collective may wait on a silent peer.

torchelastic owns rendezvous and restarts (:mod:`spotnb.kernel_remote.multinode`); these
only ask ``torch.distributed`` what the cell set up, and never import it: a cell that
did not import it runs in no world.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from spotnb.kernel_remote import channel


def holds_sharded(objects: dict[str, Any]) -> bool:
    """Whether a registered module holds sharded tensors (FSDP, DTensor)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False  # nothing can be sharded without it having been imported
    from spotnb.ckpt.sharded import holds_sharded as holds

    return holds(objects)


def initialised() -> bool:
    """Whether the cell runs in an initialised ``torch.distributed`` world (any size)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def world() -> tuple[int, int] | None:
    """``(rank, world size)`` when the cell runs in an initialised ``torch.distributed``
    world of more than one process (a distributed job), else None.

    Called at every ``maybe_save``: the rank and size are asked of a process group once,
    when it is first seen (a new default group, after a re-formation, is asked again).
    """
    global _world_seen
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = dist.GroupMember.WORLD
    seen_group, seen = _world_seen
    if group is not seen_group:
        size = int(dist.get_world_size())
        seen = (int(dist.get_rank()), size) if size > 1 else None
        _world_seen = (group, seen)
    return seen


# The default process group world() last asked, and its answer.
_world_seen: tuple[Any, tuple[int, int] | None] = (None, None)


def bound_peer_waits() -> None:
    """In a distributed job's worker: make the job's peer timeout the default timeout
    of every process group the cell creates without one of its own.

    torch's defaults are 30 minutes (gloo) and 10 (NCCL): a rank whose peer froze
    (no connection reset: a stopped process, a partitioned network) would wait that
    long in a collective. With the job's ``peer_timeout`` the collective fails in
    time, the worker ends and the node re-forms without the peer (spotnb.kernel_remote.multinode).
    A group created with an explicit ``timeout=`` keeps it.
    """
    seconds = os.environ.get(channel.ENV_PEER_TIMEOUT)
    if not seconds or "RANK" not in os.environ:
        return  # not a torchrun worker
    try:
        import torch.distributed.distributed_c10d as c10d
    except ImportError:
        return  # no torch: nothing can wait on a peer
    import datetime

    timeout = datetime.timedelta(seconds=float(seconds))
    c10d.default_pg_timeout = timeout  # read by init_process_group and new_group
    if isinstance(c10d.default_pg_nccl_timeout, datetime.timedelta):  # NCCL built in
        c10d.default_pg_nccl_timeout = timeout
