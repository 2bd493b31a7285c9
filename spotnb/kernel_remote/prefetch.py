"""The latest checkpoint, downloaded while the kernel starts and the cell's imports run,
and the job's compile cache (:mod:`spotnb.ckpt.compile_cache`) unpacked where the kernel
compiles (``dest``'s parent is the agent's scratch, the kernel's too).

The runtime's ``restore()`` waits for :data:`channel.PREFETCH_DONE` in the directory
(created however the download ends) and verifies what it finds; what is missing it
downloads itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from spotnb.ckpt import compile_cache
from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.protocol.events import EventWriter
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store

log = logging.getLogger(__name__)


def prefetch(store: Store, spec: JobSpec, events: EventWriter | None, dest: Path,
             ranks: Sequence[int] | None = None, world_size: int | None = None) -> None:
    """Download the latest checkpoint into ``dest`` (the runtime verifies it).

    ``ranks``, ``world_size``: the global ranks this node hosts in a world of that
    size (a multi-node job). Of a sharded checkpoint (saved by every rank) the node
    then fetches only its share: the manifest, ``.metadata`` and, when the
    checkpoint was saved by a world of the same size (a node replaced, the world
    re-formed as it was), the files its ranks wrote, which hold nearly all they
    read (:func:`spotnb.ckpt.node_share`). The ranks' readers fetch the rest
    (ranges of the replicated items other ranks wrote; another world size's shards).
    """
    # The compiler's caches first: small, and what the cell needs right after restore().
    compile_cache.fetch(store, compile_cache.cache_dirs(dest.parent, {
        **os.environ, **{k: v for k, v in spec.env.items() if v is not None}}))
    try:
        from spotnb.ckpt import node_share
        from spotnb.ckpt.checkpoints import CHECKPOINT_FORMATS, CheckpointStore

        ckpts = CheckpointStore(store, prefix=layout.CHECKPOINTS,
                                keep=spec.policy.keep_checkpoints,
                                formats=CHECKPOINT_FORMATS)
        manifest = ckpts.latest()
        if manifest is None:
            return
        assert events is not None  # the attempt's log exists before its download
        events.emit("status", state="restoring",
                    detail=f"downloading the checkpoint of step {manifest.step}")
        names = None if ranks is None or world_size is None else \
            node_share(manifest, ranks, world_size)
        ckpts.download(manifest, dest, names=names)
    except Exception:
        log.exception("prefetching the checkpoint failed; the runtime will download it")
    finally:
        (dest / channel.PREFETCH_DONE).touch()
