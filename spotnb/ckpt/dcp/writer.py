"""Writing a DCP checkpoint into the store: :class:`StoreWriter`, how each rank writes
its items and how the coordinator completes the checkpoint (see :mod:`spotnb.ckpt.dcp`).

How a rank's items are written (:meth:`StoreWriter.write_data`):

1. Split the items into files ``__<rank>_<i>.distcp``: one per
   :data:`~spotnb.ckpt.FILE_MIN_BYTES` of data, at most :data:`~spotnb.ckpt.MAX_FILES`,
   each item to the lightest file. *Live* items (written from the training process's
   own tensors, so training waits for them) get files of their own, apart from the
   copied ones. In one process (:func:`~spotnb.ckpt.dcp.save_state`) a tensor larger
   than :data:`~spotnb.ckpt.CHUNK_BYTES` is first cut into DCP chunks
   (:func:`~spotnb.ckpt.dcp.one_process.chunked`), items of their own: one large tensor
   is written by every file's thread, as a state of many tensors is.
2. One thread per file streams its items into the store, each at an offset aligned
   to :data:`~spotnb.ckpt.ALIGN` bytes: a tensor as its raw bytes (from a GPU through a small
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
:class:`~spotnb.ckpt.dcp.ItemLocation` (file, offset, length). The manifest and
``LATEST`` come after, from :mod:`spotnb.ckpt.checkpoints`. A rank whose ``write_data``
raised (it died, its store failed) makes DCP's gather fail before ``finish``: nothing
is written either.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import math
import os
import pickle
import threading
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from spotnb.ckpt import ALIGN, DATA_SUFFIX, FILE_MIN_BYTES, MAX_FILES, METADATA_FILE, PIECE_BYTES
from spotnb.ckpt.dcp import ItemLocation, byte_view
from spotnb.ckpt.errors import CheckpointError, FencedOff
from spotnb.ckpt.manifest import FileEntry
from spotnb.ckpt.pending import PendingCheckpoint
from spotnb.protocol.store import retrying

__all__ = ["FenceAnswer", "StoreWriter"]

# The result that carries a file's size and checksum to the coordinator has this name.
_FILE_RESULT = "spotnb/file/"
# The result that carries a rank's fencing answer to the coordinator: this, then the rank.
_FENCE_RESULT = "spotnb/fence/"


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
            view = byte_view(t if t.is_contiguous() else t.contiguous())
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
            out.write(byte_view(host))

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
