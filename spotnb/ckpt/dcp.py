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

How a rank's items are written (:meth:`StoreWriter.write_data`):

1. Split the items into files ``__<rank>_<i>.distcp``: one per
   :data:`FILE_MIN_BYTES` of data, at most :data:`MAX_FILES`, each item to the
   lightest file. *Live* items (written from the training process's own tensors, so
   training waits for them) get files of their own, apart from the copied ones. In
   one process (:func:`save_state`) a tensor larger than :data:`CHUNK_BYTES` is first
   cut into DCP chunks (:func:`chunked`), items of their own: one large tensor is
   written by every file's thread, as a state of many tensors is.
2. One thread per file streams its items into the store, each at an offset aligned
   to :data:`ALIGN` bytes: a tensor as its raw bytes (from a GPU through a small
   pinned staging buffer), anything else as ``torch.save`` bytes. The file is
   checksummed as it is written (a running CRC-32C, :mod:`spotnb.ckpt.checksum`). When
   every live file's items are written,
   :attr:`StoreWriter.live_written` is set: training may go on. A file the store
   fails to take is written again (``spotnb.protocol.store.retrying``), a live one only while
   training still waits for it; a live file that fails later abandons the checkpoint
   (the next save retries).
3. Each file's size and checksum travel with the write results (an extra result per
   file), so that the coordinator, which gathers every rank's results, can list every
   file of every rank in the manifest.
4. With a ``fence`` (a distributed job: each rank's agent holds its own slot's lease),
   the rank asks it once its files are written, and the answer travels with the write
   results too: no rank's data counts unless its agent still held its lease then.

:meth:`StoreWriter.finish` (the coordinator) first checks every rank's fencing answer
(one that lost its lease, or gave none, fails the save: DCP raises on every rank, and
no ``.metadata``, manifest or ``LATEST`` is written), then writes ``.metadata``: DCP's
``Metadata`` pickled, whose ``storage_data`` maps each item to its
:class:`ItemLocation` (file, offset, length). The manifest and ``LATEST`` come after,
from :mod:`spotnb.ckpt.checkpoints`. A rank whose ``write_data`` raised (it died, its store
failed) makes DCP's gather fail before ``finish``: nothing is written either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import itertools
import logging
import math
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from spotnb.ckpt import (
    ALIGN,
    CHUNK_BYTES,
    DATA_SUFFIX,
    FILE_MIN_BYTES,
    MAX_FILES,
    METADATA_FILE,
    PIECE_BYTES,
    chunk_boxes,
)
from spotnb.ckpt.checkpoints import CheckpointStore
from spotnb.ckpt.errors import CheckpointError, FencedOff
from spotnb.ckpt.manifest import FileEntry, Manifest
from spotnb.ckpt.pending import PendingCheckpoint
from spotnb.protocol.store import retrying

__all__ = [
    "ALIGN",
    "CHUNK_BYTES",
    "FILE_MIN_BYTES",
    "MAX_FILES",
    "METADATA_FILE",
    "FenceAnswer",
    "FileReader",
    "ItemLocation",
    "StoreReader",
    "StoreWriter",
    "chunked",
    "load_state",
    "save_state",
    "state_key",
]

log = logging.getLogger(__name__)

#: How many files a :class:`StoreReader` downloads at once: as many as a rank writes
#: at once (MAX_FILES), so that a restore fills the link as the save did.
FETCH_THREADS = MAX_FILES
#: A StoreReader reads the items it needs of another rank's file in ranged requests,
#: one per span; items less than this far apart share one: a request costs as much
#: as reading this much more (S3: ~$0.0004 per 1,000 GETs, and a round trip).
RANGE_GAP_BYTES = 2**20
#: A span is read in ranged requests of at most this many bytes (a resharded rank may
#: read half of another rank's file): each is held in memory until written out, so
#: FETCH_THREADS of them at once bound the memory; 64 MiB costs a request per 64 MiB.
RANGE_PIECE_BYTES = 64 * 2**20
#: A FileReader reads a checkpoint's tensors in this many threads at once (each
#: ``preadv`` lets go of the GIL), a tensor of more than READ_PIECE_BYTES in pieces of
#: that size: a state of one large tensor is read as fast as one of many.
READ_THREADS = MAX_FILES
READ_PIECE_BYTES = 32 * 2**20

# The result that carries a file's size and checksum to the coordinator has this name.
_FILE_RESULT = "spotnb/file/"
# The result that carries a rank's fencing answer to the coordinator: this, then the rank.
_FENCE_RESULT = "spotnb/fence/"


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


@dataclasses.dataclass(frozen=True)
class FenceAnswer:
    """Whether rank ``rank``'s agent still held its lease once the rank's files were
    written (step 4 of the module docstring)."""

    rank: int
    holds: bool


@dataclasses.dataclass(frozen=True)
class _Prefix:
    prefix: str


def _item_bytes(item: WriteItem) -> int:
    return item.tensor_storage_size() or 0


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(cast(Any, t.reshape(-1).view(torch.uint8).numpy()))


class StoreWriter(StorageWriter):
    """Writes DCP checkpoints into the store (see the module docstring).

    ``live``: names of tensors written from the training process's own memory (the
    caller waits for :attr:`live_written` before it changes them). ``parts_in_flight``:
    how many upload parts each file may have in flight (stores that upload in parts).
    ``fence``: asked once this rank's files are written, whether its agent still holds
    its lease (a distributed job; the coordinator then requires every rank's answer).
    """

    def __init__(self, pending: PendingCheckpoint, *, live: Iterable[str] = (),
                 max_files: int = MAX_FILES, parts_in_flight: int | None = None,
                 live_written: threading.Event | None = None,
                 fence: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.pending = pending
        self.fence = fence
        self.live = frozenset(live)
        self.max_files = max(1, max_files)
        self.parts_in_flight = parts_in_flight
        self.rank = 0
        self.is_coordinator = True
        #: Set once every live item is written (or the write failed).
        self.live_written = live_written if live_written is not None else threading.Event()
        self._failed = threading.Event()
        self._staging = threading.local()

    def __repr__(self) -> str:
        return f"StoreWriter({self.pending!r})"

    # -- the StorageWriter protocol ----------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass  # one writer per checkpoint: the pending checkpoint names it

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return dataclasses.replace(plan, storage_data=_Prefix(f"__{self.rank}_"))

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(plan, storage_data=_Prefix(f"__{i}_"))
                for i, plan in enumerate(plans)]

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.pending.key(METADATA_FILE).rsplit("/", 1)[0],
                           save_id=self.pending.id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by path: pass the writer explicitly

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _Prefix) else \
            f"__{self.rank}_"
        files = self._files(plan.items)
        live_files = sum(1 for _, live in files if live)
        if not live_files:
            self.live_written.set()
        counter = _Countdown(live_files, self.live_written)
        results: list[list[WriteResult]] = [[] for _ in files]
        errors: list[BaseException] = []

        def run(i: int) -> None:
            items, live = files[i]
            name = f"{prefix}{i}{DATA_SUFFIX}"
            handed_over = threading.Event()

            def once() -> list[WriteResult]:
                if live and handed_over.is_set() and self.live_written.is_set():
                    # Training has gone on: these tensors are no longer what was saved.
                    raise CheckpointError(
                        f"{name} failed after training went on, so it cannot be written "
                        "again; this checkpoint is abandoned and the next save retries")
                return self._write_file(name, items, planner,
                                        None if handed_over.is_set() else counter,
                                        handed_over if live else None)

            try:
                # A store that fails for a while (full, read-only, unreachable) delays
                # the file rather than failing the checkpoint.
                results[i] = retrying(once, f"writing {self.pending.key(name)}",
                                      check=self._check_cancelled)
            except BaseException as e:
                errors.append(e)
                self._failed.set()  # the other files stop at their next item
                self.live_written.set()  # nobody waits for a write that failed

        threads = [threading.Thread(target=run, args=(i,), name=f"spotnb-write-{i}",
                                    daemon=True) for i in range(1, len(files))]
        for thread in threads:
            thread.start()
        run(0)
        for thread in threads:
            thread.join()
        if errors:
            raise next((e for e in errors if not isinstance(e, _Cancelled)), errors[0])
        written = list(itertools.chain.from_iterable(results))
        if self.fence is not None:
            # Step 4: asked after the data is out, so a lease lost while writing counts.
            holds = bool(self.fence())
            written.append(WriteResult(index=MetadataIndex(f"{_FENCE_RESULT}{self.rank}"),
                                       size_in_bytes=0,
                                       storage_data=FenceAnswer(self.rank, holds)))
        future: Future[list[WriteResult]] = Future()
        future.set_result(written)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.fence is not None:
            self._check_fences(results)
        storage: dict[MetadataIndex, ItemLocation] = {}
        for result in itertools.chain.from_iterable(results):
            if isinstance(result.storage_data, FenceAnswer):
                continue
            if isinstance(result.storage_data, FileEntry):
                self.pending.add_entry(result.storage_data)  # this or another rank's file
            else:
                storage[result.index] = result.storage_data
        metadata.storage_data = storage
        metadata.version = "1.0.0"  # the DCP metadata version this layout follows
        self.pending.put_bytes(METADATA_FILE, pickle.dumps(metadata,
                                                           protocol=pickle.HIGHEST_PROTOCOL))

    def _check_fences(self, results: list[list[WriteResult]]) -> None:
        """Every rank's agent held its lease once its files were written, or raise
        :class:`FencedOff` (nothing of this checkpoint is made complete)."""
        answers = {result.storage_data.rank: result.storage_data.holds
                   for result in itertools.chain.from_iterable(results)
                   if isinstance(result.storage_data, FenceAnswer)}
        lost = sorted(rank for rank, holds in answers.items() if not holds)
        silent = sorted(set(range(len(results))) - answers.keys())
        if lost or silent:
            why = (f"the agent of rank(s) {lost} lost its lease" if lost else
                   f"rank(s) {silent} sent no fencing answer")
            raise FencedOff(f"checkpoint {self.pending.id} (step {self.pending.step}) was "
                            f"written but not made complete: {why}, so their data may be "
                            "stale; the job carries on from the previous checkpoint")

    # -- writing ---------------------------------------------------------------------

    def _files(self, items: list[WriteItem]) -> list[tuple[list[WriteItem], bool]]:
        """Items per file, and whether the file holds live items (step 1).

        Live items get files of their own: a file that fails is written again, which
        is possible for live items only while training still waits for them.
        """
        live = [item for item in items if item.index.fqn in self.live]
        rest = [item for item in items if item.index.fqn not in self.live]
        files = [(bucket, True) for bucket in self._spread(live)]
        files += [(bucket, False) for bucket in self._spread(rest)]
        return files or [([], False)]

    def _spread(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        """One file per FILE_MIN_BYTES (at most max_files), each item to the lightest."""
        if not items:
            return []
        total = sum(_item_bytes(item) for item in items)
        count = max(1, min(self.max_files, math.ceil(total / FILE_MIN_BYTES)))
        buckets: list[list[WriteItem]] = [[] for _ in range(count)]
        sizes = [0] * count
        for item in sorted(items, key=_item_bytes, reverse=True):
            i = min(range(count), key=sizes.__getitem__)
            buckets[i].append(item)
            sizes[i] += _item_bytes(item)
        return buckets

    def _check_cancelled(self) -> None:
        if self._failed.is_set():
            raise _Cancelled("another file of this checkpoint failed")

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner,
                    counter: _Countdown | None, handed_over: threading.Event | None
                    ) -> list[WriteResult]:
        """Write one file; ``handed_over`` is set once its items are all written."""
        results = []
        with self.pending.open(name, parts_in_flight=self.parts_in_flight) as out:
            for item in items:
                self._check_cancelled()
                pad = -out.size % ALIGN
                if pad:
                    out.write(bytes(pad))
                offset = out.size
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    assert isinstance(data, io.BytesIO)
                    out.write(data.getbuffer())
                else:
                    assert isinstance(data, torch.Tensor)
                    self._write_tensor(out, data)
                length = out.size - offset
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=ItemLocation(name, offset, length)))
            # Every live byte is out of the training tensors (in the page cache, or in
            # upload part buffers): training may go on once every live file is here.
            if handed_over is not None:
                handed_over.set()
                if counter is not None:
                    counter.done()
        entry = FileEntry(name, out.size, out.checksum)
        results.append(WriteResult(index=MetadataIndex(_FILE_RESULT + name),
                                   size_in_bytes=out.size, storage_data=entry))
        return results

    def _write_tensor(self, out: Any, t: torch.Tensor) -> None:
        t = t.detach()
        if t.device.type == "cpu":
            view = _byte_view(t if t.is_contiguous() else t.contiguous())
            for start in range(0, len(view), PIECE_BYTES):
                out.write(view[start:start + PIECE_BYTES])
            return
        # From an accelerator: piece by piece through a pinned buffer of this thread.
        flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
        staging = self._staging_buffer()
        for start in range(0, flat.numel(), PIECE_BYTES):
            piece = flat[start:start + PIECE_BYTES]
            host = staging[:piece.numel()]
            host.copy_(piece)  # synchronous: the bytes are in host memory after this
            out.write(_byte_view(host))

    def _staging_buffer(self) -> torch.Tensor:
        buf = getattr(self._staging, "buf", None)
        if buf is None:
            buf = torch.empty(PIECE_BYTES, dtype=torch.uint8,
                              pin_memory=torch.cuda.is_available())
            self._staging.buf = buf
        return buf


class _Cancelled(Exception):
    pass


class _Countdown:
    """Sets ``event`` when ``done`` has been called ``count`` times (from any thread)."""

    def __init__(self, count: int, event: threading.Event) -> None:
        self._left = count
        self._event = event
        self._lock = threading.Lock()

    def done(self) -> None:
        with self._lock:
            self._left -= 1
            if self._left == 0:
                self._event.set()


class FileReader(StorageReader):
    """Reads a checkpoint of :class:`StoreWriter` from a local directory.

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
                            target.copy_(_narrow(tmp, req.storage_offsets, req.lengths))
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


@dataclasses.dataclass(frozen=True)
class _Whole:
    """The files a rank fetches whole (the coordinator's choice; see StoreReader)."""

    files: frozenset[str]


class StoreReader(FileReader):
    """Reads a checkpoint of :class:`StoreWriter` from the store, fetching only what the
    load plans read: a rank of a sharded checkpoint downloads its part, not the whole.

    ``directory`` receives the local copies: the agent's prefetch (shared by the ranks
    of a node, which may fetch the same file at once: see
    :meth:`~spotnb.ckpt.checkpoints.CheckpointStore.fetch`), or a fresh directory.

    1. :meth:`read_metadata` fetches ``.metadata`` (one request, unless the prefetch
       brought it).
    2. :meth:`prepare_global_plan` (the coordinator, which sees every rank's load plan)
       gives each file that some rank reads to one rank, the one that reads the most
       of it (at the world size that saved it: the rank that wrote it), to fetch
       whole; the choice travels in each plan's ``storage_data``.
    3. :meth:`read_data` maps the plan's items to their files (each item's storage
       index -> ``storage_data`` -> :class:`ItemLocation`). Its files are fetched
       whole and verified against the manifest (size, then checksum), a copy already
       in ``directory`` included; of another rank's file it reads only its items'
       bytes, in ranged requests (spans less than :data:`RANGE_GAP_BYTES` apart
       merged, at most :data:`RANGE_PIECE_BYTES` each), into a sparse local file.
       Then it reads them as :class:`FileReader` does. At the world size that saved
       the checkpoint a rank thus downloads its own files and a few ranges of the
       others' (the replicated items DCP saved on another rank: an optimizer's step
       counts, its param groups); resharded, the parts of other ranks' files that
       hold its new part (whole, where it reads most of one).

    Every byte read comes from a file verified whole in the same load: by this rank,
    or by the rank chosen in step 2, whose ``read_data`` raises
    :class:`~spotnb.ckpt.checkpoints.CorruptCheckpoint` for a file that is missing or
    differs; DCP reports that to every rank before any rank's load returns
    (:func:`spotnb.ckpt.sharded.load` turns it into the same ``CorruptCheckpoint``
    everywhere), so no rank goes on with bytes of a damaged file. :attr:`fetched`
    names the files this reader verified; :attr:`ranges` counts its ranged requests.
    """

    def __init__(self, checkpoints: CheckpointStore, manifest: Manifest,
                 directory: str | os.PathLike[str]) -> None:
        super().__init__(directory)
        self.checkpoints = checkpoints
        self.manifest = manifest
        #: The files verified in ``directory`` so far (each is verified once).
        self.fetched: set[str] = set()
        #: Ranged requests made so far ({file: count}).
        self.ranges: dict[str, int] = {}
        self._partial: dict[str, Path] = {}

    def __repr__(self) -> str:
        return f"StoreReader({self.manifest.id!r}, {str(self.path)!r})"

    def _fetch(self, name: str) -> None:
        if name not in self.fetched:
            self.checkpoints.fetch(self.manifest, name, self.path)
            self.fetched.add(name)

    def fetch_files(self, names: Iterable[str]) -> None:
        """Make the files ``names`` present and verified in the directory."""
        self._run([functools.partial(self._fetch, name)
                   for name in sorted(set(names) - self.fetched)])

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self._fetch(METADATA_FILE)  # step 1
        return super().read_metadata()

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        readers: dict[str, dict[int, int]] = {}  # step 2: file -> {rank: bytes read}
        for rank, plan in enumerate(plans):
            for req in plan.items:
                loc = self._location(req.storage_index)
                by_rank = readers.setdefault(loc.file, {})
                by_rank[rank] = by_rank.get(rank, 0) + loc.length
        chosen = {name: max(by_rank, key=lambda r: (by_rank[r], -r))
                  for name, by_rank in readers.items()}
        return [dataclasses.replace(plan, storage_data=_Whole(frozenset(
                    name for name, rank in chosen.items() if rank == i)))
                for i, plan in enumerate(plans)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        spans: dict[str, list[ItemLocation]] = {}
        for req in plan.items:
            loc = self._location(req.storage_index)
            spans.setdefault(loc.file, []).append(loc)
        whole = plan.storage_data.files if isinstance(plan.storage_data, _Whole) else \
            frozenset(spans)  # no coordinator's choice (one process): every file whole
        jobs = [functools.partial(self._fetch, name)
                for name in sorted(spans.keys() & whole - self.fetched)]
        jobs += [functools.partial(self._read_ranges, name, locs)
                 for name, locs in sorted(spans.items())
                 if name not in whole and name not in self.fetched]
        try:
            self._run(jobs)  # step 3
            return super().read_data(plan, planner)
        finally:
            for path in self._partial.values():
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self._partial.clear()

    def _read_ranges(self, name: str, locs: list[ItemLocation]) -> None:
        """The bytes of ``locs`` of file ``name``, at their offsets of a sparse file."""
        merged: list[list[int]] = []
        for loc in sorted(locs, key=lambda loc: loc.offset):
            if merged and loc.offset - merged[-1][1] <= RANGE_GAP_BYTES:
                merged[-1][1] = max(merged[-1][1], loc.offset + loc.length)
            else:
                merged.append([loc.offset, loc.offset + loc.length])
        path = self.path / f".ranges-{os.getpid()}-{threading.get_ident()}-{name}"
        self._partial[name] = path
        with open(path, "wb", buffering=0) as f:
            for span_start, span_end in merged:
                for start in range(span_start, span_end, RANGE_PIECE_BYTES):
                    end = min(span_end, start + RANGE_PIECE_BYTES)
                    data = self.checkpoints.read_range(self.manifest, name, start,
                                                       end - start)
                    os.pwrite(f.fileno(), data, start)
                    self.ranges[name] = self.ranges.get(name, 0) + 1

    def _local_file(self, name: str) -> Path:
        return self._partial.get(name, self.path / name)

    @staticmethod
    def _run(jobs: Sequence[Callable[[], object]]) -> None:
        """Run ``jobs`` (:data:`FETCH_THREADS` at a time); raise the first failure."""
        if len(jobs) <= 1:
            for job in jobs:
                job()
            return
        with ThreadPoolExecutor(min(FETCH_THREADS, len(jobs)),
                                thread_name_prefix="spotnb-fetch") as pool:
            for future in [pool.submit(job) for job in jobs]:
                future.result()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by path: pass the reader explicitly


def _pread(f: Any, offset: int, length: int) -> bytes:
    data = os.pread(f.fileno(), length, offset)
    if len(data) != length:
        raise OSError(f"{f.name}: expected {length} bytes at {offset}, found {len(data)}")
    return data


def _pieces(f: Any, offset: int, t: torch.Tensor) -> list[tuple[Any, int, memoryview]]:
    """The reads that fill the contiguous CPU tensor ``t`` from ``offset`` of file ``f``:
    ``(file, offset, bytes of t)``, at most READ_PIECE_BYTES each."""
    view = _byte_view(t)
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
        _read_piece(f, offset, _byte_view(t))
        return
    flat = t.reshape(-1).view(torch.uint8)
    host = staging()
    for start in range(0, flat.numel(), PIECE_BYTES):
        piece = host[:min(PIECE_BYTES, flat.numel() - start)]
        _read_into(f, offset + start, piece, staging)
        flat[start:start + piece.numel()].copy_(piece)


def _narrow(t: torch.Tensor, offsets: Iterable[int], sizes: Iterable[int],
            always: bool = False) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if size < t.size(dim) or always:
            t = t.narrow(dim, offset, size)
    return t


# -- single-process drivers -----------------------------------------------------------------


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
            return _narrow(obj, data.chunk.offsets, data.chunk.sizes, always=True)
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


def tensor_names(metadata: Metadata) -> Iterator[tuple[str, TensorStorageMetadata]]:
    """The tensors of a checkpoint: ``(name, metadata)``."""
    for fqn, saved in metadata.state_dict_metadata.items():
        if isinstance(saved, TensorStorageMetadata):
            yield fqn, saved
