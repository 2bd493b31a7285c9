"""Reading a DCP checkpoint of :class:`~spotnb.ckpt.dcp.StoreWriter` from the store,
fetching only what the load plans read: :class:`StoreReader` (see :mod:`spotnb.ckpt.dcp`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from spotnb.ckpt import MAX_FILES, METADATA_FILE
from spotnb.ckpt.checkpoints import CheckpointStore
from spotnb.ckpt.dcp import ItemLocation
from spotnb.ckpt.dcp.reader import FileReader
from spotnb.ckpt.manifest import Manifest

__all__ = ["StoreReader"]

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


@dataclasses.dataclass(frozen=True)
class _Whole:
    """The files a rank fetches whole (the coordinator's choice; see StoreReader)."""

    files: frozenset[str]


class StoreReader(FileReader):
    """Reads a checkpoint of :class:`~spotnb.ckpt.dcp.StoreWriter` from the store,
    fetching only what the load plans read: a rank of a sharded checkpoint downloads its
    part, not the whole.

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
