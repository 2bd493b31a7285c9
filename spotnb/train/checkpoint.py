"""The checkpoint a cell registers and restores: ``spot.Checkpoint(model=m, optimizer=o)``.

:class:`Checkpoint` holds what is registered (the objects, and the cell variables that
follow them) and restores the newest intact checkpoint into them: the agent's prefetch
if it is that one, else the store's files; a damaged one is skipped for the one before
it; every rank of a distributed job restores the one rank 0 found. Its saves, and when
they happen, are :mod:`spotnb.train.saving`.
"""

from __future__ import annotations

import functools
import logging
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from spotnb.ckpt import snapshot
from spotnb.ckpt.checkpoints import CheckpointError, CorruptCheckpoint, Manifest
from spotnb.ckpt.memory import MemoryBudget
from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.train import distributed, loaders, process
from spotnb.train.carry import EVENTS_FILE, METRICS_FILE, Carry
from spotnb.train.cellvars import CellVariables
from spotnb.train.process import current as _rt
from spotnb.train.saving import Saves
from spotnb.train.session import Session
from spotnb.train.upload import import_writer_in_background

_logger = logging.getLogger(__name__)

# How long restore() waits for the agent's checkpoint download before doing its own.
PREFETCH_WAIT_SECONDS = 600.0


def _wait_for_prefetch(restore_dir: Path) -> None:
    """Wait while the agent is still downloading the checkpoint into ``restore_dir``.

    The agent downloads while the kernel starts and the cell's imports run; the first
    ``restore()`` may catch up with it. Give up after ``PREFETCH_WAIT_SECONDS`` and
    download directly (the agent may have died mid-way).
    """
    if not restore_dir.exists():
        return  # not an agent-managed restore dir (standalone, or an older agent)
    deadline = time.monotonic() + PREFETCH_WAIT_SECONDS
    while not (restore_dir / channel.PREFETCH_DONE).exists():
        if time.monotonic() > deadline:
            _logger.warning("the agent's checkpoint download did not finish; downloading")
            return
        time.sleep(0.02)


class Checkpoint:
    """Saves and restores training state: ``spot.Checkpoint(model=m, optimizer=opt)``.

    Register everything the loop needs to continue exactly: objects with
    ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR schedulers,
    GradScaler), ``random.Random``/``torch.Generator``/``numpy.random.Generator``,
    tensors, arrays, dicts and lists are restored in place; a plain ``DataLoader``
    resumes its epoch at the batch it was at (:mod:`spotnb.train.loaders`); any other
    picklable value is read back as ``ckpt["name"]`` (and updated with
    ``ckpt["name"] = value``).
    The global RNG states (``random``, NumPy, torch CPU and CUDA) are always included,
    so seeded code continues bitwise-identically after an interruption.

    Step convention: ``save(step)`` means "step ``step`` is done", and
    :meth:`restore` returns ``step + 1``, the first step still to do (0 if there is
    no checkpoint). So ``for step in range(ckpt.restore(), n)`` resumes correctly.

    ``host_memory`` bounds the extra host memory a save uses (bytes, ``"8GB"``, or a
    share of the free RAM, ``"25%"``; default ``SPOTNB_CHECKPOINT_MEMORY``, else half
    the free RAM): a state that fits is copied whole and written in the background
    (the save stalls only for the copy); of a larger one, what does not fit is written
    straight from the training tensors while the save stalls. Either way a save never
    holds more than the budget. The copy's buffers are kept between saves (that is
    what makes a save a fast memory copy).

    Use one ``Checkpoint`` per job.
    """


    def __init__(self, *, host_memory: int | str | None = None, **state: Any) -> None:
        if not state:
            raise TypeError("Checkpoint() needs the state to save, e.g. "
                            "spot.Checkpoint(model=model, optimizer=optimizer)")
        budget = MemoryBudget(host_memory)
        # A plain DataLoader becomes resumable in place (its position is saved): the
        # same object, which then restores in place, so it may live in any variable.
        self._objects: dict[str, Any] = {name: loaders.resumable(obj)
                                         for name, obj in state.items()}
        # The entries that follow a variable of the cell (spotnb.train.cellvars).
        self._cell = CellVariables.of_caller(self._objects, Checkpoint)
        if "torch" in sys.modules:
            import_writer_in_background()
        rt = _rt()
        rt.has_checkpoint = True  # a node joining a distributed job waits for its save
        # What its saves share, and when they save (spotnb.train.saving).
        self._saves = Saves(self._objects, functools.partial(self._cell.refresh, self._objects),
                            budget)

    def __repr__(self) -> str:
        return f"Checkpoint({', '.join(self._objects)})"

    @property
    def _rt(self) -> Session:
        # The current session (a new one after _finish(), e.g. when a cell re-runs).
        return _rt()

    def __getitem__(self, name: str) -> Any:
        self._cell.refresh(self._objects)
        return self._objects[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self._objects[name] = value
        self._cell.assign(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._objects

    # -- restore ---------------------------------------------------------------------

    def restore(self) -> int:
        """Load the latest checkpoint into the registered objects; return the next step.

        Returns 0 when the job has no checkpoint yet, else ``saved_step + 1``. Saved
        tensors are read straight into the registered objects' tensors where shapes
        and dtypes match, so a restore needs no second copy of the state in memory.
        """
        process.wait_for_lease(self._rt)  # a standby's restore point: nothing read before it
        self.wait()
        last = self._rt.last_upload
        if last is not None:
            last.wait()  # another Checkpoint's save of this session: it may be the newest
        started = time.monotonic()
        world = distributed.world()
        damaged: list[str] = []
        self._cell.refresh(self._objects, restoring=True)  # into what the variables hold
        while True:
            found = self._fetch_newest_intact(damaged)
            if world is not None:
                found = self._agree(found)
            if found is None:
                _logger.info("no checkpoint yet: starting from step 0")
                return 0
            manifest, directory, downloaded = found
            try:
                state, carry = self._load(manifest, directory, world)
                break
            except CorruptCheckpoint as e:
                if not manifest.metadata.get("ranks"):
                    raise  # verified whole before it was read: not damage found reading
                # A sharded checkpoint is verified file by file as each rank reads its
                # part: sharded.load raised this on every rank at once, so every rank
                # skips it here and agrees on the one before it.
                _logger.error("%s; trying the checkpoint before it", e)
                damaged.append(manifest.id)
            finally:
                if downloaded:
                    shutil.rmtree(directory, ignore_errors=True)
        if world is None or world[0] == 0:
            # Rows and output the checkpoint's attempt logged that its agent may not
            # have written (it died with them): the agent records those its log lacks.
            # In a distributed job global rank 0's agent alone, as spot.log records
            # rank 0's rows: agents of several nodes appending the same rows would
            # repeat them.
            durable = channel.CheckpointPhase(phase="durable", id=manifest.id,
                                              step=manifest.step, bytes=manifest.total_bytes)
            carry.replay(self._rt, manifest.attempt, durable.event_data(), manifest.created)
        saved = state["objects"]
        for name, obj in list(self._objects.items()):
            if name in saved and saved[name][0] == "dcp":
                continue  # loaded by DCP already (spotnb.ckpt.sharded)
            if name not in saved:
                _logger.warning("%r is not in checkpoint %s (added since?); it keeps its "
                                "current value", name, manifest.id)
                continue
            kind, payload = saved[name]
            self._objects[name] = snapshot.restore(name, obj, kind, payload)
            self._cell.assign(name, self._objects[name])  # best_val_loss = the saved one
        for name in saved.keys() - self._objects.keys():
            _logger.warning("checkpoint %s also holds %r, which is not registered now; "
                            "ignored", manifest.id, name)
        del saved  # the loaded copy is in the objects now
        # The state exists in full now (optimizer state too): allocate the host buffers
        # for the first save in the background, so that save is a memory copy.
        self._saves.warm()
        # The global RNGs last: the warm-up reads every state_dict(), and some draw (a
        # StatefulDataLoader's makes its iterator, which draws its worker seed).
        snapshot.restore_rng(state.pop("rng"))
        del state
        self._saves.count_from(manifest.step)
        seconds = time.monotonic() - started
        self._rt.send(channel.Restored(id=manifest.id, step=manifest.step,
                                       seconds=round(seconds, 3)))
        _logger.info("restored checkpoint %s in %.1f s: continuing at step %d", manifest.id,
                     seconds, manifest.step + 1)
        return manifest.step + 1

    def _load(self, manifest: Manifest, directory: Path, world: tuple[int, int] | None
              ) -> tuple[dict[str, Any], Carry]:
        """The state tree of a fetched checkpoint, and what it carries of the log."""
        if not manifest.metadata.get("ranks"):
            return self._read(manifest, directory), _read_carry(manifest, directory)
        # Written by every rank (sharded): DCP reshards it to this world, each rank
        # fetching and reading only the files its part is in (collective in a
        # distributed job; a damaged file raises CorruptCheckpoint on every rank).
        from spotnb.ckpt import sharded
        from spotnb.ckpt.dcp import StoreReader

        reader = StoreReader(self._saves.store, manifest, directory)
        state = sharded.load(self._objects, reader, world[0] if world else 0)
        if world is not None and world[0] != 0:
            return state, Carry()  # global rank 0 replays (its agent records them)
        carried = [n for n in (METRICS_FILE, EVENTS_FILE) if manifest.entry(n) is not None]
        if carried:
            try:
                reader.fetch_files(carried)
            except (CheckpointError, OSError) as e:
                # Not the training state: the restore goes on (as _read_carry does).
                _logger.warning("what checkpoint %s carries of the log cannot be fetched "
                                "(%s); the history may miss the steps just before it",
                                manifest.id, e)
                return state, Carry()
        return state, _read_carry(manifest, directory)

    def _read(self, manifest: Manifest, directory: Path) -> dict[str, Any]:
        """The saved state tree of a verified local copy, tensors resolved."""
        if manifest.format == "pickle":  # one state file: a state saved without torch
            entry = next((f for f in manifest.files if f.name.startswith("state.")), None)
            if entry is None:
                raise CheckpointError(f"checkpoint {manifest.id} has no state file; it "
                                      "was not written by spot.Checkpoint")
            state: dict[str, Any] = snapshot.load(directory / entry.name, manifest.format)
            return state
        if manifest.format != "dcp":
            raise CheckpointError(f"checkpoint {manifest.id} is in format "
                                  f"{manifest.format!r}, which spot.Checkpoint does not "
                                  "read: it was written by sync_dir or a newer spotnb")
        import torch

        from spotnb.ckpt.dcp import FileReader, load_state, state_key, tensor_names

        reader = FileReader(directory)
        live = snapshot.live_tensors(self._objects)
        targets: dict[str, Any] = {}
        tensors: dict[str, Any] = {}
        for name, saved in tensor_names(reader.read_metadata()):
            own = live.get(name)
            if own is not None and tuple(own.shape) == tuple(saved.size) and \
                    own.dtype == saved.properties.dtype:
                targets[name] = own  # read in place: no second copy of the state
                continue
            mapped = reader.mapped(name)  # no own tensor (fresh optimizer state): a view
            if mapped is not None:
                tensors[name] = mapped
            else:
                targets[name] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
        key = state_key()
        targets[key] = None
        load_state(targets, reader)
        tree = targets.pop(key)
        if tree is None:
            raise CheckpointError(f"checkpoint {manifest.id} has no spotnb state; it was "
                                  "not written by spot.Checkpoint")
        tensors.update(targets)
        tree["objects"] = {name: (kind, snapshot.resolve_refs(payload, tensors))
                           for name, (kind, payload) in tree["objects"].items()}
        return dict(tree)

    def _fetch_newest_intact(self, damaged: list[str] | None = None
                             ) -> tuple[Manifest, Path, bool] | None:
        """The newest checkpoint whose files verify, fetched; None if there is none.

        A damaged checkpoint (its files disagree with its manifest) is skipped for the
        one before it: redoing some steps beats failing the job. ``damaged``: ids found
        damaged already (by a restore that read them); those found here are added.

        A sharded checkpoint is not fetched whole here: each rank fetches and verifies
        the files it reads as it reads them (:meth:`_fetch`, :meth:`_load`).
        """
        damaged = damaged if damaged is not None else []
        for manifest in self._saves.store.manifests():
            if manifest.id in damaged:
                continue
            try:
                directory, downloaded = self._fetch(manifest)
            except CorruptCheckpoint as e:
                _logger.error("%s; trying the checkpoint before it", e)
                damaged.append(manifest.id)
                continue
            return manifest, directory, downloaded
        if damaged:
            raise CorruptCheckpoint(
                f"every checkpoint of this job is damaged ({', '.join(damaged)}); delete "
                f"the {layout.CHECKPOINTS}/ prefix of the job's store to start from step 0"
            )
        return None

    def _agree(self, found: tuple[Manifest, Path, bool] | None
               ) -> tuple[Manifest, Path, bool] | None:
        """In a distributed job: every rank restores the checkpoint rank 0 found (one
        broadcast), so that no two ranks resume from different steps."""
        import torch.distributed as dist

        chosen: list[str | None] = [found[0].id if found is not None else None]
        dist.broadcast_object_list(chosen, src=0)
        if (found[0].id if found is not None else None) == chosen[0]:
            return found
        if found is not None and found[2]:
            shutil.rmtree(found[1], ignore_errors=True)
        if chosen[0] is None:
            return None
        manifest = self._saves.store.manifest(str(chosen[0]))
        return (manifest, *self._fetch(manifest))

    def _fetch(self, manifest: Manifest) -> tuple[Path, bool]:
        """A local copy of the checkpoint: the agent's prefetch if it is this
        checkpoint, else the store's own files if the store is local (verified where
        they are), else a fresh download. The second item says whether we downloaded
        it (and remove it after the restore).

        Verified whole, except a sharded checkpoint's: of that, only the directory is
        chosen here, and each rank's :class:`~spotnb.ckpt.dcp.StoreReader` fetches
        into it the files it reads. The ranks of a node share the agent's restore
        directory (or a subdirectory of it named after the checkpoint, when the
        prefetch brought another one): nobody removes it while another rank reads.
        """
        restore_dir = self._rt.restore_dir
        sharded = bool(manifest.metadata.get("ranks"))
        if restore_dir is not None:
            _wait_for_prefetch(restore_dir)
        if restore_dir is not None and (restore_dir / "MANIFEST.json").exists():
            try:
                local = Manifest.read_local(restore_dir)
                if local.id == manifest.id:
                    if not sharded:  # the agent's download verified every file
                        self._saves.store.verify_local(manifest, restore_dir, downloaded=True)
                    return restore_dir, False
                _logger.info("the prefetched checkpoint %s is not the latest (%s); "
                             "downloading", local.id, manifest.id)
            except (CheckpointError, OSError, ValueError, KeyError) as e:
                _logger.warning("the prefetched checkpoint in %s is unusable (%s); "
                                "downloading", restore_dir, e)
        if sharded and restore_dir is not None and restore_dir.exists():
            own = restore_dir / manifest.id
            own.mkdir(exist_ok=True)
            return own, False
        here = None if sharded else self._saves.store.local_dir(manifest)
        if here is not None:  # a local store: its files are read where they are
            self._saves.store.verify_local(manifest, here)
            return here, False
        dest = self._rt.scratch / f"runtime-restore-{uuid.uuid4().hex[:8]}"
        if sharded:
            dest.mkdir(parents=True)
            return dest, True
        try:
            self._saves.store.download(manifest, dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)
            raise
        return dest, True


    # -- save (spotnb.train.saving) ----------------------------------------------------

    def save(self, step: int) -> None:
        """Checkpoint now: "step ``step`` is done". Stalls only to copy state to memory.

        Writing to the store happens in the background; the next save (or the end of
        the job) waits for this one. Of a state larger than the memory budget, the part
        that does not fit is written before this returns. After an interruption notice
        the save waits until it is durable and then holds the cell (see
        :mod:`spotnb.train.runtime`).
        """
        self._saves.save(int(step))

    def maybe_save(self, step: int) -> bool:
        """Save if the policy says so or a notice is pending; return whether it saved.

        The policy (``checkpoint_every`` of the job; 5 minutes standalone) counts seconds
        and steps since the last save or restore. Cheap when there is nothing to do.
        """
        return self._saves.maybe_save(step)

    def wait(self) -> Manifest | None:
        """Wait for the save in progress; its manifest, or None (none, it failed, or
        this rank of a sharded checkpoint is not the one that commits it)."""
        return self._saves.wait()


def _read_carry(manifest: Manifest, directory: Path) -> Carry:
    """What a checkpoint carries of the log (verified with the rest), or nothing."""
    names = {f.name for f in manifest.files}
    return Carry.read(directory, names, f"checkpoint {manifest.id}")

