"""Checkpoint data at model scale: spotnb's on-store format, streamed, in bounded memory.

``spot.Checkpoint`` writes the training state in the format of
``torch.distributed.checkpoint`` (DCP), as one rank of a DCP checkpoint: a single-node
job is the one-shard case of a multi-node one, and the same writer, reader and
manifest serve both.

Layout of one checkpoint in the job's store (the protocol around it, manifest then
``LATEST``, is :mod:`spotnb.ckpt.checkpoints`')::

    checkpoints/<id>/__<rank>_<i>.distcp   rank <rank>'s items, file <i> (one file per
                                           FILE_MIN_BYTES, at most MAX_FILES per rank,
                                           written in parallel): each tensor's raw bytes
                                           (C order, its own dtype) at an ALIGN-aligned
                                           offset, a tensor over CHUNK_BYTES as several
                                           chunks spread over the files; other items as
                                           torch.save bytes
    checkpoints/<id>/.metadata             DCP's Metadata, pickled: every tensor's name,
                                           dtype, global shape and chunks (which part of
                                           it each rank saved), and storage_data: where
                                           each item's bytes are (ItemLocation)
    checkpoints/<id>/MANIFEST.json         spotnb's: step, attempt, format "dcp", every
                                           file of every rank with its size and CRC-32C
    checkpoints/LATEST                     the newest complete checkpoint

Names follow DCP's flattening of ``{"model": model.state_dict(), ...}``:
``model.fc.weight``, ``optimizer.state.0.exp_avg``; ``spotnb/state/rank<r>`` holds
rank ``r``'s state tree (object kinds, RNG states, small non-tensor values; see
:mod:`spotnb.ckpt.snapshot`). So ``dcp.load({"model": m.state_dict()},
storage_reader=FileReader(dir))`` loads a downloaded spotnb checkpoint into a model,
and DCP's planners reshard it: a checkpoint saved by N ranks loads on M.

What multi-node training adds is the process group, not a format: each rank
calls ``dcp.save``/``dcp.async_save`` with a :class:`~spotnb.ckpt.dcp.StoreWriter` on
the same :class:`~spotnb.ckpt.pending.PendingCheckpoint` id; DCP gathers every rank's
write results on the coordinator, whose ``finish`` writes ``.metadata`` and lists every
rank's files (their sizes and checksums travel with the results, and so does each
rank's fencing answer: the coordinator writes nothing unless every rank's agent still
held its lease), then the coordinator writes the manifest and moves ``LATEST`` after
its own fencing check. A rank that died mid-save leaves no manifest, so invariant 2
holds across all shards. :mod:`spotnb.ckpt.sharded` drives it for sharded state (FSDP).

Memory (:mod:`spotnb.ckpt.memory`): a save copies into host buffers only what its
budget allows; the rest is written straight from the training tensors while the loop
waits (from a GPU through a pinned staging buffer of :data:`PIECE_BYTES` per file).
A restore reads each saved tensor straight into the registered object's own tensor.

Timing (:mod:`spotnb.ckpt.notice`): whether a final checkpoint fits in the
interruption notice.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spotnb.ckpt.manifest import Manifest

__all__ = ["ALIGN", "CHUNK_BYTES", "DATA_SUFFIX", "FILE_MIN_BYTES", "MAX_FILES",
           "METADATA_FILE", "PIECE_BYTES", "chunk_boxes", "node_share"]

#: DCP's name for the pickled ``Metadata`` of a checkpoint.
METADATA_FILE = ".metadata"
#: Data files of a rank's items: ``__<rank>_<i>.distcp``, as DCP names them.
DATA_SUFFIX = ".distcp"
#: A file per this many bytes of a rank's data: small checkpoints stay one file (one
#: object to create and fsync), large ones are written by several threads at once.
FILE_MIN_BYTES = 256 * 2**20
#: At most this many files (threads) per rank: each streams its part of the state
#: while the others wait on the store; more would only contend for the disk or the link.
MAX_FILES = 4
#: Items start at offsets aligned to this many bytes, so that a tensor read back can
#: be a view of a memory-mapped file (any dtype's alignment, and a cache line).
ALIGN = 64
#: Tensor bytes go to the store in pieces of this size: a GPU tensor needs a staging
#: buffer of this size only, and a simulated network delivers them steadily.
PIECE_BYTES = 8 * 2**20
#: A tensor larger than this is written as DCP chunks of about this size (runs of whole
#: rows, each contiguous in memory), spread over the files like separate tensors: one
#: 1 GB embedding table is written by every file's thread, not by one, and read back by
#: several threads. 64 MiB: the size of the tensors of a state that already spreads well.
CHUNK_BYTES = 64 * 2**20

Box = tuple[tuple[int, ...], tuple[int, ...]]


def chunk_boxes(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> list[Box]:
    """``[(offsets, sizes), ...]``: a tensor of ``shape`` cut into boxes of about
    ``chunk_bytes`` each, in memory order; one box (the whole) if it is no larger.

    Every box is contiguous in a C-contiguous tensor: a run of whole rows, or, when
    there are fewer rows than boxes, a run of whole sub-rows within one row (and so
    on down the dimensions).
    """
    shape = tuple(int(n) for n in shape)
    nbytes = math.prod(shape) * itemsize
    if not shape or nbytes <= chunk_bytes:
        return [((0,) * len(shape), shape)]
    return _boxes(shape, -(-nbytes // chunk_bytes))


def _boxes(shape: tuple[int, ...], want: int) -> list[Box]:
    rows, rest = shape[0], shape[1:]
    if rows >= want or not rest:
        parts = min(want, rows)
        return [((rows * i // parts, *(0,) * len(rest)),
                 (rows * (i + 1) // parts - rows * i // parts, *rest)) for i in range(parts)]
    per_row = -(-want // rows)
    return [((row, *offsets), (1, *sizes))
            for row in range(rows) for offsets, sizes in _boxes(rest, per_row)]


_RANK_FILE = re.compile(r"^__(\d+)_\d+" + re.escape(DATA_SUFFIX) + "$")


def node_share(manifest: Manifest, ranks: Collection[int], world_size: int
               ) -> list[str] | None:
    """The files of a checkpoint that a node hosting global ``ranks`` of a world of
    ``world_size`` processes prefetches; None for every file.

    Of a sharded checkpoint (its manifest names the world size that saved it,
    ``metadata["ranks"]``): ``.metadata``, and the files of ``ranks`` when that world
    size is ``world_size`` (then DCP gives each rank back the shards it saved, so its
    own files hold nearly all it reads). At another world size only ``.metadata``:
    which files a rank reads after resharding only its load plan tells, and its reader
    fetches them (:class:`spotnb.ckpt.dcp.StoreReader`). A checkpoint one rank wrote
    (single node, or a DDP job's rank 0) is read whole by every rank: every file.
    """
    saved_by = manifest.metadata.get("ranks")
    if not saved_by:
        return None
    own = set(ranks) if saved_by == world_size else set()
    return [f.name for f in manifest.files if f.name == METADATA_FILE or (
        (m := _RANK_FILE.match(f.name)) is not None and int(m.group(1)) in own)]
