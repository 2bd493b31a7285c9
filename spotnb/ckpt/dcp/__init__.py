"""``torch.distributed.checkpoint`` storage on spotnb's store: streamed, checksummed, parallel.

:class:`StoreWriter` is a DCP ``StorageWriter`` that writes each rank's items straight
into the store through a :class:`~spotnb.ckpt.pending.PendingCheckpoint` (no scratch
file, no second pass to checksum); :class:`FileReader` is the ``StorageReader`` for a
local copy of such a checkpoint (the agent's prefetch, or a download), and
:class:`StoreReader` the one that fetches into such a copy only what a rank reads
(a rank of a sharded checkpoint downloads its part of the state, not the whole). The planning,
the metadata and resharding are DCP's own (``DefaultSavePlanner``,
``DefaultLoadPlanner``): the same writer serves ``dcp.save``/``dcp.async_save`` on N
ranks, and :func:`save_state`/:func:`load_state` drive it in one process without a
process group. See :mod:`spotnb.ckpt` for the layout.

The parts:

* :mod:`~spotnb.ckpt.dcp.writer`: how a rank's items are written, and how the
  coordinator completes the checkpoint (``.metadata``), fenced;
* :mod:`~spotnb.ckpt.dcp.reader`: reading a local copy into the registered tensors;
* :mod:`~spotnb.ckpt.dcp.store_reader`: fetching from the store only what a rank reads;
* :mod:`~spotnb.ckpt.dcp.one_process`: ``dcp.save``/``dcp.load`` in one process, a
  large tensor cut into chunks.

This module holds what they share: the name of a rank's state tree, where an item's
bytes are (:class:`ItemLocation`, pickled into every checkpoint's ``.metadata`` by this
module's name, so it stays here) and what a tensor's bytes are (:func:`byte_view`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

__all__ = [
    "FileReader",
    "ItemLocation",
    "StoreReader",
    "StoreWriter",
    "byte_view",
    "load_state",
    "save_state",
    "state_key",
    "tensor_names",
]


def state_key(rank: int = 0) -> str:
    """The item holding a rank's spotnb state tree (kinds, RNG states, small objects).

    The slash keeps it apart from every tensor's name (those start with the name of a
    registered object, a Python identifier); the rank keeps each rank's RNG states.
    """
    return f"spotnb/state/rank{rank}"


@dataclasses.dataclass(frozen=True)
class ItemLocation:
    """Where an item's bytes are: ``length`` bytes at ``offset`` of data file ``file``.

    A tensor's bytes are its elements, C-contiguous, in the dtype of its metadata; any
    other item's are ``torch.save`` of the object.
    """

    file: str
    offset: int
    length: int


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))


# The parts, imported once what they import from here is defined.
from spotnb.ckpt.dcp.one_process import load_state, save_state  # noqa: E402
from spotnb.ckpt.dcp.reader import FileReader, tensor_names  # noqa: E402
from spotnb.ckpt.dcp.store_reader import StoreReader  # noqa: E402
from spotnb.ckpt.dcp.writer import StoreWriter  # noqa: E402
