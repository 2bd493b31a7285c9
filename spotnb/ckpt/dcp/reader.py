"""Reading a local copy of a DCP checkpoint of :class:`~spotnb.ckpt.dcp.StoreWriter`:
:class:`FileReader` (see :mod:`spotnb.ckpt.dcp`), and :func:`tensor_names`.
"""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import pickle
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from spotnb.ckpt import MAX_FILES, METADATA_FILE, PIECE_BYTES
from spotnb.ckpt.dcp import ItemLocation, byte_view

__all__ = ["FileReader", "narrow", "tensor_names"]

#: A FileReader reads a checkpoint's tensors in this many threads at once (each
#: ``preadv`` lets go of the GIL), a tensor of more than READ_PIECE_BYTES in pieces of
#: that size: a state of one large tensor is read as fast as one of many.
READ_THREADS = MAX_FILES
READ_PIECE_BYTES = 32 * 2**20


class FileReader(StorageReader):
    """Reads a checkpoint of :class:`~spotnb.ckpt.dcp.StoreWriter` from a local directory.

    A tensor is read straight into its destination when that is a contiguous CPU
    tensor and the request covers the whole saved chunk (no temporary copy), in pieces
    by :data:`READ_THREADS` threads at once (a chunked tensor's chunks, a large
    tensor of an older checkpoint in pieces of :data:`READ_PIECE_BYTES`); through a
    staging buffer into a GPU tensor; through a temporary of one saved chunk when DCP
    reshards (a request for part of a chunk). Also usable with ``dcp.load``:
    ``dcp.load(state_dict, storage_reader=FileReader(path))``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__()
        self.path = Path(path)
        self.metadata: Metadata | None = None
        self._maps: dict[str, mmap.mmap] = {}
        self._staging: torch.Tensor | None = None

    def _staging_buffer(self) -> torch.Tensor:
        # One pinned buffer for every read into a GPU tensor (pinning is slow).
        if self._staging is None:
            self._staging = torch.empty(PIECE_BYTES, dtype=torch.uint8,
                                        pin_memory=torch.cuda.is_available())
        return self._staging

    def __repr__(self) -> str:
        return f"FileReader({str(self.path)!r})"

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            self.path = Path(checkpoint_id)
        self.metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            with open(self.path / METADATA_FILE, "rb") as f:
                self.metadata = pickle.load(f)  # trusted: the job's own checkpoint
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return (Path(checkpoint_id) / METADATA_FILE).is_file()

    def _local_file(self, name: str) -> Path:
        """Where the local copy of data file ``name`` is."""
        return self.path / name

    def _location(self, index: MetadataIndex) -> ItemLocation:
        md = self.read_metadata()
        loc = md.storage_data[index]
        assert isinstance(loc, ItemLocation), f"{index} was not written by spotnb"
        return loc

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        md = self.read_metadata()
        by_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            by_file.setdefault(self._location(req.storage_index).file, []).append(req)
        # Reads straight into contiguous CPU tensors are gathered and made at the end,
        # READ_THREADS at a time; the others (into a GPU tensor through the staging
        # buffer, into a temporary when resharding) one by one, as they come.
        pieces: list[tuple[Any, int, memoryview]] = []
        read: list[tuple[ReadItem, torch.Tensor]] = []
        with contextlib.ExitStack() as files:
            for name, reqs in by_file.items():
                f = files.enter_context(open(self._local_file(name), "rb", buffering=0))
                for req in sorted(reqs, key=lambda r: self._location(r.storage_index).offset):
                    loc = self._location(req.storage_index)
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(_pread(f, loc.offset, loc.length)))
                        continue
                    saved = md.state_dict_metadata[req.storage_index.fqn]
                    assert isinstance(saved, TensorStorageMetadata)
                    chunk = next(c for c in saved.chunks
                                 if tuple(c.offsets) == tuple(req.storage_index.offset or ()))
                    target = planner.resolve_tensor(req).detach()
                    whole = (not any(req.storage_offsets)
                             and tuple(req.lengths) == tuple(chunk.sizes))
                    with torch.no_grad():
                        if whole and target.is_contiguous() and \
                                target.dtype == saved.properties.dtype:
                            if target.device.type == "cpu":
                                pieces += _pieces(f, loc.offset, target)
                                read.append((req, target))
                                continue
                            _read_into(f, loc.offset, target, self._staging_buffer)
                        else:
                            tmp = torch.empty(tuple(chunk.sizes), dtype=saved.properties.dtype)
                            _read_into(f, loc.offset, tmp, self._staging_buffer)
                            target.copy_(narrow(tmp, req.storage_offsets, req.lengths))
                    planner.commit_tensor(req, target)
            _read_pieces(pieces)
        for req, target in read:
            planner.commit_tensor(req, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def mapped(self, fqn: str) -> torch.Tensor | None:
        """Tensor ``fqn`` as a copy-on-write view of its file, or None if it cannot be.

        Costs no anonymous memory: the pages come from the page cache as they are
        read, and only pages written to are copied. Possible when the tensor was saved
        as one chunk (one rank held it whole).
        """
        md = self.read_metadata()
        saved = md.state_dict_metadata.get(fqn)
        if not isinstance(saved, TensorStorageMetadata) or len(saved.chunks) != 1:
            return None
        chunk = saved.chunks[0]
        if any(chunk.offsets) or tuple(chunk.sizes) != tuple(saved.size):
            return None
        numel = math.prod(saved.size)
        dtype = saved.properties.dtype
        loc = self._location(MetadataIndex(fqn, chunk.offsets))
        if numel == 0 or loc.offset % torch.empty((), dtype=dtype).element_size():
            return None
        area = self._maps.get(loc.file)
        if area is None:
            with open(self.path / loc.file, "rb") as f:
                area = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[loc.file] = area
        return torch.frombuffer(area, dtype=dtype, count=numel,
                                offset=loc.offset).view(tuple(saved.size))


def _pread(f: Any, offset: int, length: int) -> bytes:
    data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise OSError(f"{f.name}: expected {length} bytes at {offset}, found {len(data)}")
    return data


def _pieces(f: Any, offset: int, t: torch.Tensor) -> list[tuple[Any, int, memoryview]]:
    """The reads that fill the contiguous CPU tensor ``t`` from ``offset`` of file ``f``:
    ``(file, offset, bytes of t)``, at most READ_PIECE_BYTES each."""
    view = byte_view(t)
    return [(f, offset + start, view[start:start + READ_PIECE_BYTES])
            for start in range(0, len(view), READ_PIECE_BYTES)]


def _read_piece(f: Any, offset: int, view: memoryview) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:done + PIECE_BYTES]], offset + done)
        if n <= 0:
            raise OSError(f"{f.name}: the file ends before its tensor at {offset + done}")
        done += n


def _read_pieces(pieces: list[tuple[Any, int, memoryview]]) -> None:
    """Make the reads of :func:`_pieces`, READ_THREADS at a time (``preadv`` lets go of
    the GIL); raise the first failure."""
    if len(pieces) <= 1:
        for piece in pieces:
            _read_piece(*piece)
        return
    with ThreadPoolExecutor(min(READ_THREADS, len(pieces)),
                            thread_name_prefix="spotnb-read") as pool:
        for future in [pool.submit(_read_piece, *piece) for piece in pieces]:
            future.result()


def _read_into(f: Any, offset: int, t: torch.Tensor,
               staging: Callable[[], torch.Tensor]) -> None:
    """Fill the contiguous tensor ``t`` with the bytes at ``offset`` of file ``f``.

    A GPU tensor is filled piece by piece through the host buffer ``staging()``.
    """
    if t.device.type == "cpu":
        _read_piece(f, offset, byte_view(t))
        return
    flat = t.reshape(-1).view(torch.uint8)
    host = staging()
    for start in range(0, flat.numel(), PIECE_BYTES):
        piece = host[:min(PIECE_BYTES, flat.numel() - start)]
        _read_into(f, offset + start, piece, staging)
        flat[start:start + piece.numel()].copy_(piece)


def narrow(t: torch.Tensor, offsets: Iterable[int], sizes: Iterable[int],
           always: bool = False) -> torch.Tensor:
    """A view of the box of ``t`` at ``offsets`` of ``sizes``; a dimension the box spans
    whole is left as it is, unless ``always``."""
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size < t.size(dim) or always:
            t = t.narrow(dim, offset, size)
    return t


def tensor_names(metadata: Metadata) -> Iterator[tuple[str, TensorStorageMetadata]]:
    """The tensors of a checkpoint: ``(name, metadata)``."""
    for fqn, saved in metadata.state_dict_metadata.items():
        if isinstance(saved, TensorStorageMetadata):
            yield fqn, saved
