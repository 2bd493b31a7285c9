"""Sharded state (FSDP2, DTensor, ShardedTensor) in a distributed job: every rank writes.

A distributed job whose registered modules hold sharded tensors cannot be saved by one
rank: each rank holds only its shards. So every rank calls ``dcp.save`` with a
:class:`~spotnb.ckpt.dcp.StoreWriter` on the same checkpoint id (the runtime agrees on
it first); DCP's planner gives each rank its own shards to write
(``__<rank>_<i>.distcp``) and a replicated tensor (a plain one that every rank holds)
to one rank only; the coordinator (global rank 0) gathers every rank's write results,
with each rank's fencing answer, and writes ``.metadata`` (see
:mod:`spotnb.ckpt.dcp`); the runtime's rank 0 then writes the manifest and moves
``LATEST``.

What is saved, by registered object:

* modules (``torch.nn.Module``) and the optimizers over their parameters:
  ``get_model_state_dict`` / ``get_optimizer_state_dict`` of
  ``torch.distributed.checkpoint.state_dict``, as DCP's documentation recommends
  (FSDP's and DDP's wrappers give fully qualified names; an optimizer's state is keyed
  by parameter name, so it reshards too); restored with the ``set_*`` functions;
* everything else (schedulers, generators, values, plain tensors): the runtime's own
  capture (:mod:`spotnb.ckpt.snapshot`): its tensors by name (replicated: saved once), its
  state tree as one item per rank, :func:`~spotnb.ckpt.dcp.state_key` ``(rank)``,
  with that rank's RNG states.

Restoring at another world size: DCP's load planner reads each rank's part of every
tensor from whichever saved chunks hold it (resharding). A rank reads its own state
tree if the checkpoint has one for its rank, else rank 0's (a world that grew).

Asynchronous save (:func:`save`): the training thread copies this rank's local shards
(and the other objects' tensors) into host buffers of the checkpoint's
:class:`~spotnb.ckpt.buffers.BufferPool`, reused from one save to the next; that copy is
the stall. ``dcp.async_save`` then plans, writes and gathers in its own thread, its
collectives on a gloo group of the checkpoint's own (:func:`checkpoint_group`), so
they never interleave with the training loop's collectives on the default group.
When this rank's share does not fit the memory budget, nothing is copied and the
save is written before :func:`save` returns (the stall is the write).

What a rank downloads to restore: through a :class:`~spotnb.ckpt.dcp.StoreReader`,
``.metadata``, the files it reads most of (its own, at the same world size), verified,
and ranges of the others' it reads a little of; never the whole checkpoint. A damaged
file fails :func:`load` with ``CorruptCheckpoint`` on every rank at once (whichever
rank verified it), so that the runtime's ranks fall back together.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.staging import AsyncStager

from spotnb.ckpt import snapshot
from spotnb.ckpt.buffers import BufferPool
from spotnb.ckpt.dcp import FileReader, StoreWriter, state_key, tensor_names
from spotnb.ckpt.errors import CheckpointError, CorruptCheckpoint
from spotnb.ckpt.memory import CopyBatch
from spotnb.ckpt.pending import PendingCheckpoint
from spotnb.ckpt.tensors import nbytes, streamable, synchronize

__all__ = ["DCP_KIND", "checkpoint_group", "holds_sharded", "load", "save", "stage_specs"]

#: The kind, in a sharded checkpoint's state tree, of an object whose state is DCP's
#: (a module or an optimizer): its tensors are items of the checkpoint, not the tree's.
DCP_KIND = "dcp"


def _is_sharded(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return True
    sharded = getattr(getattr(torch.distributed, "_shard", None), "sharded_tensor", None)
    return sharded is not None and isinstance(t, sharded.ShardedTensor)


def holds_sharded(objects: dict[str, Any]) -> bool:
    """Whether a registered module holds sharded tensors (so every rank must write).

    Cheap: ``state_dict()`` returns references.
    """
    return any(_is_sharded(t) for obj in objects.values()
               if isinstance(obj, torch.nn.Module) for t in obj.state_dict().values())


def _dcp_objects(objects: dict[str, Any]
                 ) -> tuple[dict[str, torch.nn.Module],
                            dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]]:
    """The modules, and each optimizer with the registered module that owns its
    parameters (DCP names optimizer state by parameter name, so it needs the module)."""
    modules = {n: o for n, o in objects.items() if isinstance(o, torch.nn.Module)}
    optimizers: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    for name, opt in objects.items():
        if not isinstance(opt, torch.optim.Optimizer):
            continue
        first = next((p for group in opt.param_groups for p in group["params"]), None)
        owner = next((m for m in modules.values()
                      if first is not None and any(p is first for p in m.parameters())), None)
        if owner is None:
            raise CheckpointError(
                f"cannot checkpoint optimizer {name!r} of a sharded model: none of the "
                "registered modules holds its parameters. Register the model too: "
                f"spot.Checkpoint(model=model, {name}={name})")
        optimizers[name] = (owner, opt)
    return modules, optimizers


def _state_dicts(modules: dict[str, torch.nn.Module],
                 optimizers: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
                 ) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    out: dict[str, Any] = {name: get_model_state_dict(m) for name, m in modules.items()}
    out.update({name: get_optimizer_state_dict(m, opt)
                for name, (m, opt) in optimizers.items()})
    return out


#: Where the staged copies of DCP's tensors sit in the buffer pool's keys (the other
#: objects' keys start with their names, Python identifiers: no clash).
_STAGED = "spotnb/dcp"


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds (a DTensor's local shard, else ``t``)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _tensors(tree: Any, key: tuple[Hashable, ...] = (_STAGED,)
             ) -> list[tuple[tuple[Hashable, ...], torch.Tensor]]:
    """Every tensor of a (nested) state dict, with its pool key."""
    if isinstance(tree, torch.Tensor):
        return [(key, tree)]
    if isinstance(tree, dict):
        return [found for k, v in tree.items() for found in _tensors(v, (*key, k))]
    if isinstance(tree, list | tuple):
        return [found for i, v in enumerate(tree) for found in _tensors(v, (*key, i))]
    return []


def _stageable(tree: Any) -> bool:
    """Whether every tensor is one :func:`_stage` copies (dense, DTensor or plain)."""
    from torch.distributed.tensor import DTensor

    return all(type(t) in (torch.Tensor, torch.nn.Parameter, DTensor)
               and streamable(torch, _local(t)) for _, t in _tensors(tree))


def _stage(tree: Any, pool: BufferPool, batch: CopyBatch,
           key: tuple[Hashable, ...] = (_STAGED,)) -> tuple[Any, bool]:
    """A copy of a state dict that training cannot change: every tensor's local data
    in a host buffer of ``pool`` (a DTensor stays a DTensor over its copied shard, with
    the same mesh and placements). The second item: whether a copy from a GPU is still
    in flight (the caller synchronises). Copies from CPU tensors are queued in
    ``batch``: the caller runs it."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        done = pool.copy(key, tree.to_local(), batch=batch)
        assert done is not None
        return DTensor(done[0], tree._spec, requires_grad=False), done[1]
    if isinstance(tree, torch.Tensor):
        done = pool.copy(key, tree, batch=batch)
        assert done is not None
        return done
    pending = False
    if isinstance(tree, dict):
        out: dict[Any, Any] = {}
        for k, v in tree.items():
            out[k], in_flight = _stage(v, pool, batch, (*key, k))
            pending |= in_flight
        return out, pending
    if isinstance(tree, list | tuple):
        items = []
        for i, v in enumerate(tree):
            item, in_flight = _stage(v, pool, batch, (*key, i))
            items.append(item)
            pending |= in_flight
        return type(tree)(items), pending
    return tree, False  # numbers, strings: immutable


def stage_specs(objects: dict[str, Any]) -> list[tuple[Hashable, str, Any]]:
    """``[(key, name, tensor), ...]`` that :func:`save` copies for this rank (local
    shards, not whole tensors), to warm a buffer pool ahead of the first save."""
    modules, optimizers = _dcp_objects(objects)
    others = {n: o for n, o in objects.items() if n not in modules and n not in optimizers}
    specs = [(key, ".".join(map(str, key[1:])), _local(t))
             for key, t in _tensors(_state_dicts(modules, optimizers))]
    return specs + snapshot.tensor_specs(others)


_group: tuple[Any, Any] | None = None


def checkpoint_group() -> Any:
    """The checkpoints' own gloo process group over the whole world (created on first
    use: collective, so every rank calls it at the same point, which the save is).

    ``dcp.async_save``'s thread runs its gathers and broadcasts on it while training
    goes on: on the default group they could interleave with the loop's collectives.
    Gloo, because the staged copies are in host memory.
    """
    global _group
    default = dist.distributed_c10d._get_default_group()
    if _group is None or _group[0] is not default:
        _group = (default, dist.new_group(backend="gloo"))
    return _group[1]


class _Staged(AsyncStager):
    """The stager of an already staged state dict (:func:`_stage` ran on the training
    thread, into spotnb's reusable buffers, within its memory budget)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None  # staged before async_save was called

    def close(self) -> None:
        return None  # the buffers are the pool's


def save(objects: dict[str, Any], pending: PendingCheckpoint, *, step: int, rank: int,
         fence: Callable[[], bool] | None, pool: BufferPool,
         copy_budget: int | None = None, parts_in_flight: int | None = None
         ) -> tuple[Future[Any], bool]:
    """Start this rank's part of a sharded checkpoint (every rank calls it; collective).

    Returns DCP's future, done once every rank's files are written and the coordinator
    has written ``.metadata`` (it raises on every rank if any rank's write failed or
    any rank's agent lost its lease), and whether training may change its state
    before the future is done: True when this rank's state fit ``copy_budget`` (bytes;
    None: no limit) and was copied; else nothing was copied and the caller waits for
    the future. The manifest and ``LATEST`` are the caller's (rank 0's) next steps.
    """
    import torch.distributed.checkpoint as dcp

    writer = StoreWriter(pending, parts_in_flight=parts_in_flight, fence=fence)
    copied = False
    try:
        modules, optimizers = _dcp_objects(objects)
        others = {n: o for n, o in objects.items()
                  if n not in modules and n not in optimizers}
        dicts = _state_dicts(modules, optimizers)
        local = sum(nbytes(_local(t)) for _, t in _tensors(dicts))
        budget = copy_budget if copy_budget is not None else local + \
            sum(nbytes(t) for *_, t in snapshot.tensor_specs(others))
        stage_it = local <= budget and _stageable(dicts)
        batch = CopyBatch()
        staged, in_flight = _stage(dicts, pool, batch) if stage_it else (dicts, False)
        batch.run()
        keep = {key for key, _ in _tensors(dicts)} if stage_it else set()
        # The rest as the runtime captures it; the tree (with this rank's RNG states)
        # is pickled into one item so that DCP's flattening leaves it whole.
        captured = snapshot.capture(others, pool, step, budget - local if stage_it else 0,
                                    keep=keep)
        if in_flight:
            synchronize(torch, (_local(t) for _, t in _tensors(dicts)))
        copied = stage_it and not captured.live
        tree = dict(captured.state)
        tree["objects"] = {**tree["objects"],
                           **{name: (DCP_KIND, None) for name in (*modules, *optimizers)}}
        state = {**staged, **captured.tensors,
                 state_key(rank): snapshot.Pickled(
                     pickle.dumps(tree, protocol=pickle.HIGHEST_PROTOCOL))}
    except Exception as e:
        # This rank cannot save (an unpicklable object...). It still takes part in
        # DCP's collectives, failing its plan, so that every rank raises together
        # instead of the others waiting for it in a gather.
        writer = _FailedWriter(pending, e)
        state = {}
    future = dcp.async_save(state, storage_writer=writer, process_group=checkpoint_group(),
                            async_stager=_Staged())
    assert isinstance(future, Future)
    return future, copied


class _FailedWriter(StoreWriter):
    """The writer of a rank whose state could not be captured: it fails its local
    plan, which DCP reports to every rank."""

    def __init__(self, pending: PendingCheckpoint, error: Exception) -> None:
        super().__init__(pending)
        self.error = error

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        raise self.error


def load(objects: dict[str, Any], reader: FileReader, rank: int) -> dict[str, Any]:
    """Load a sharded checkpoint into the registered objects (collective in a
    distributed job: every rank calls it). Returns the state tree (objects other than
    modules and optimizers not yet restored; see :func:`save`).

    ``reader``: a :class:`~spotnb.ckpt.dcp.StoreReader` (each rank fetches and verifies
    the files it reads) or a :class:`~spotnb.ckpt.dcp.FileReader` of a verified local
    copy. A damaged or missing file raises :class:`~spotnb.ckpt.errors.CorruptCheckpoint`
    on every rank, whichever rank found it (see :func:`_together`), so that the ranks
    agree on falling back to an older checkpoint.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    metadata = _together(reader.read_metadata)
    modules, optimizers = _dcp_objects(objects)
    state_dicts = _state_dicts(modules, optimizers)
    key = state_key(rank)
    if key not in metadata.state_dict_metadata:
        key = state_key(0)  # more ranks now than saved: rank 0's RNG states
    targets: dict[str, Any] = {**state_dicts, key: None}
    owned = tuple(f"{name}." for name in state_dicts)
    for name, saved in tensor_names(metadata):  # the other objects' tensors
        if not name.startswith(owned):
            targets[name] = torch.empty(tuple(saved.size), dtype=saved.properties.dtype)
    try:
        dcp.load(targets, storage_reader=reader,
                 planner=DefaultLoadPlanner(allow_partial_load=True))
    except CheckpointException as e:
        # A rank's read_data raised; DCP raises this on every rank, with every failure.
        corrupt = [(found_rank, exc) for found_rank, (exc, _) in sorted(e.failures.items())
                   if isinstance(exc, CorruptCheckpoint)]
        if corrupt:
            found_rank, exc = corrupt[0]
            raise CorruptCheckpoint(f"{exc} (read by rank {found_rank})") from e
        raise
    for name, module in modules.items():
        set_model_state_dict(module, targets[name])
    for name, (module, opt) in optimizers.items():
        set_optimizer_state_dict(module, opt, targets[name])
    pickled = targets.pop(key)
    if not isinstance(pickled, snapshot.Pickled):
        raise CheckpointError(f"checkpoint in {reader.path} has no spotnb state; it was "
                              "not written by spot.Checkpoint")
    tree: dict[str, Any] = pickled.loads()
    tensors = {name: t for name, t in targets.items() if isinstance(t, torch.Tensor)}
    tree["objects"] = {name: (kind, snapshot.resolve_refs(payload, tensors))
                       for name, (kind, payload) in tree["objects"].items()}
    return tree


def _together(read: Callable[[], Metadata]) -> Metadata:
    """``read()`` on every rank, failing on every rank if it fails on any (one
    all-gather of each rank's outcome): a rank that finds ``.metadata`` damaged must
    not leave the others waiting in DCP's collectives for it. Outside a distributed
    job, just ``read()``."""
    import torch.distributed as dist

    outcome: Metadata | Exception
    try:
        outcome = read()
    except Exception as e:
        outcome = e
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    failure = None if not isinstance(outcome, Exception) else \
        (isinstance(outcome, CorruptCheckpoint), f"{type(outcome).__name__}: {outcome}")
    failures: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    if isinstance(outcome, Exception):
        raise outcome
    for found_rank, seen in enumerate(failures):
        if seen is not None:
            corrupt, what = seen
            error = CorruptCheckpoint if corrupt else CheckpointError
            raise error(f"rank {found_rank} could not read the checkpoint's metadata ({what})")
    return outcome
