"""``dcp.save`` and ``dcp.load`` in one process, without a process group:
:func:`save_state` and :func:`load_state` drive :class:`~spotnb.ckpt.dcp.StoreWriter`
and :class:`~spotnb.ckpt.dcp.FileReader` as DCP would. A save cuts each tensor larger
than :data:`~spotnb.ckpt.CHUNK_BYTES` into DCP chunks (:func:`chunked`), items of their
own: one large tensor is written by every file's thread, as a state of many tensors is.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from spotnb.ckpt import CHUNK_BYTES, chunk_boxes
from spotnb.ckpt.dcp.reader import FileReader, narrow
from spotnb.ckpt.dcp.writer import StoreWriter

__all__ = ["chunked", "load_state", "save_state"]


def chunked(plan: SavePlan, chunk_bytes: int | None = None) -> SavePlan:
    """``plan`` with each whole tensor larger than ``chunk_bytes`` (default
    :data:`CHUNK_BYTES`) cut into DCP chunks (:func:`spotnb.ckpt.chunk_boxes`): shard
    items whose metadata lists the chunks, which DCP's load planner reads back into the
    one tensor (and reshards like any sharded tensor's). The writer spreads the chunks
    over its files like separate tensors. Items of sharded tensors stay as they are.
    """
    limit = CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    items: list[WriteItem] = []
    for item in plan.items:
        data = item.tensor_data
        if item.type != WriteItemType.TENSOR or data is None:
            items.append(item)
            continue
        boxes = chunk_boxes(data.size, data.properties.dtype.itemsize, limit)
        if len(boxes) == 1:
            items.append(item)
            continue
        for offsets, sizes in boxes:
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(WriteItem(
                index=MetadataIndex(item.index.fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=data.properties,
                                            size=data.size)))
    return dataclasses.replace(plan, items=items)


class _ChunkingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with large tensors cut into chunks (:func:`chunked`)."""

    def create_local_plan(self) -> SavePlan:
        self.plan = chunked(super().create_local_plan())
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        obj = self.state_dict.get(write_item.index.fqn)
        data = write_item.tensor_data
        if write_item.type == WriteItemType.SHARD and data is not None and \
                isinstance(obj, torch.Tensor) and not hasattr(obj, "__get_tensor_shard__"):
            return narrow(obj, data.chunk.offsets, data.chunk.sizes, always=True)
        return cast(Any, super().resolve_data(write_item))


def save_state(state_dict: Mapping[str, Any], writer: StoreWriter) -> Metadata:
    """What ``dcp.save`` does, in one process without a process group.

    ``state_dict`` is flat: names to tensors, and :func:`state_key` to the state tree.
    """
    planner = _ChunkingSavePlanner(flatten_state_dict=False)
    planner.set_up_planner(state_dict=dict(state_dict), storage_meta=writer.storage_meta(),
                           is_coordinator=True)
    writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    plan = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan([plan])
    plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
    future = writer.write_data(plan, planner)
    future.wait()
    writer.finish(metadata, [future.value()])
    return metadata


def load_state(targets: dict[str, Any], reader: FileReader) -> None:
    """What ``dcp.load`` does, in one process: fill ``targets`` ({name: tensor or None}).

    Tensors are filled in place; other items (the state tree) are set in the dict.
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    metadata = reader.read_metadata()
    planner = DefaultLoadPlanner(flatten_state_dict=False, allow_partial_load=True)
    planner.set_up_planner(targets, metadata, is_coordinator=True)
    reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=False)
    plan = reader.prepare_local_plan(planner.create_local_plan())
    plan = planner.finish_plan(reader.prepare_global_plan(planner.create_global_plan([plan]))[0])
    reader.read_data(plan, planner).wait()
    for fqn, value in targets.items():
        if not isinstance(value, torch.Tensor):  # set by the planner in its own dict
            targets[fqn] = planner.state_dict.get(fqn)
