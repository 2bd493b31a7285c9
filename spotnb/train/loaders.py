"""A plain ``DataLoader`` that resumes mid-epoch at the exact batch.

Registered in a checkpoint (``spot.Checkpoint(model=m, optimizer=opt, loader=loader)``),
a ``torch.utils.data.DataLoader`` that has no ``state_dict()`` of its own is made
resumable in place by :func:`resumable`: its class becomes a subclass of its own class
(the object, its dataset, sampler, workers and settings stay the user's) that adds
``state_dict()``/``load_state_dict()``, so the checkpoint saves and restores it like a
module. A loader that already has them (torchdata's ``StatefulDataLoader``) is saved
through its own, unchanged.

What a checkpoint holds of a loader (:meth:`_Position.state_dict`):

* the random states at the start of the epoch in progress: the global RNGs (Python,
  NumPy, torch CPU) and every generator the loader, its sampler or its batch sampler
  holds, taken as ``iter(loader)`` begins. These are what the epoch's draws come from:
  the worker seed (``base_seed``: each worker seeds with ``base_seed + worker_id``) and
  the sampler's shuffle (``RandomSampler`` without a generator draws its seed from the
  global torch RNG as the epoch's first batch is sampled);
* the batches consumed of that epoch (those ``iter(loader)`` handed to the loop), and
  whether the epoch was over;
* the generators' states at the save, and the epoch's length and ``DistributedSampler``
  epoch (a resume checks them).

What a resume does (the first ``iter(loader)`` after ``ckpt.restore()``): it sets the
epoch's start states, creates the epoch's iterator, which draws the same worker seed
and the same shuffle, skips the consumed batches at the index level (their indices are
drawn from the sampler, their data is never loaded: Accelerate's
``skip_first_batches``), then puts the global RNGs back where they were before the
``iter()`` (what the checkpoint restored: the training loop's own draws continue from
the save) and the generators where they were at the save. The loop's next batch is
then bitwise the one the uninterrupted run got, with the same RNG state. An epoch that
was over is not skipped: the next ``iter()`` is the next epoch, from the generators'
states at the save.

Limits, stated where they bite (a warning on the instance):

* an ``IterableDataset`` has no indices to skip: its consumed batches are read again
  and dropped (a dataset with its own ``state_dict`` under torchdata's
  ``StatefulDataLoader`` skips without reading);
* random draws made *inside worker processes* (augmentations in ``__getitem__`` with
  ``num_workers > 0``) continue from the workers' seeds, not from where the
  interrupted workers were, as with Accelerate and torchdata: seed such draws from the
  sample's index and the epoch for an exact resume.
"""

from __future__ import annotations

import copy
import logging
import random
import sys
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = ["FORMAT", "epoch_of", "in_last_batch", "resumable"]

_logger = logging.getLogger(__name__)

#: The version of a plain loader's saved position (``state_dict()["spotnb_loader"]``).
FORMAT = 1

# Where a loader's generators may be: attributes of these, by path.
_HOLDERS = ("", "sampler", "batch_sampler", "batch_sampler.sampler")

_classes: dict[type, type] = {}


def resumable(obj: Any) -> Any:
    """Make a plain ``DataLoader`` resumable in place (see the module docstring).

    Anything else, and a loader that has ``state_dict()``/``load_state_dict()`` of its
    own, is returned unchanged. Returns ``obj``.
    """
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.utils.data.DataLoader):
        return obj
    if "_spot_position" in vars(obj):
        return obj
    cls = type(obj)
    if callable(getattr(obj, "state_dict", None)) and \
            callable(getattr(obj, "load_state_dict", None)):
        # A loader with a state of its own: saved through it. torchdata's
        # StatefulDataLoader draws from the global RNGs as a resumed epoch's iterator
        # is made, which the uninterrupted run had drawn before the save: those draws
        # are undone, so that the loop's own continue from the save.
        stateful = sys.modules.get("torchdata.stateful_dataloader")
        if stateful is not None and isinstance(obj, stateful.StatefulDataLoader) and \
                "_spot_keeps_rng" not in cls.__dict__:
            sub = _classes.get(cls)
            if sub is None:
                sub = _classes[cls] = _rng_keeping_class(cls)
            obj.__class__ = sub
        return obj
    sub = _classes.get(cls)
    if sub is None:
        sub = _classes[cls] = _resumable_class(cls)
    # DataLoader refuses only its data settings after __init__: these are new names.
    obj._spot_position = _Position(obj)
    obj.__class__ = sub
    if obj._iterator is not None:
        _logger.warning("the data loader was iterated before it was registered in the "
                        "Checkpoint: its position is saved from its next iter() on")
    return obj


def epoch_of(obj: Any) -> int | None:
    """Which epoch of ``obj`` (a loader made resumable here) is in progress: a number
    that changes at each of its ``iter()``; None for anything else."""
    position = vars(obj).get("_spot_position") if hasattr(obj, "__dict__") else None
    return position.epochs if isinstance(position, _Position) else None


def in_last_batch(obj: Any) -> bool:
    """Whether ``obj``, a loader made resumable here, has handed out the last batch of its
    epoch and not been asked for the next one: the loop over it is in its last iteration,
    and the code after that loop (the epoch's evaluation, its scheduler step, its
    bookkeeping) has not run yet. A save there would be restored into a run that starts
    the next epoch and never runs that code: :meth:`Checkpoint.maybe_save
    <spotnb.train.runtime.Checkpoint.maybe_save>` takes it at its next call instead."""
    position = vars(obj).get("_spot_position") if hasattr(obj, "__dict__") else None
    return isinstance(position, _Position) and position.in_last_batch()


def _resumable_class(cls: type) -> type:
    """``cls`` with a position: a subclass of it alone (a mixin placed before a
    class with a managed ``__dict__`` would change the layout, and CPython refuses
    to swap the class of an object to one of another layout)."""

    class Resumable(cls):
        __slots__ = ()
        _spot_position: _Position

        def __iter__(self) -> Any:
            return self._spot_position.iterate(super().__iter__)

        @property
        def _index_sampler(self) -> Any:
            # What the loader's iterators draw indices from: the batch sampler (or the
            # sampler) seen through the position, which marks each epoch's start and
            # skips what a resume skips.
            return self._spot_position.indices

        def state_dict(self) -> dict[str, Any]:
            """Where the loader is: see :mod:`spotnb.train.loaders`."""
            return self._spot_position.state_dict()

        def load_state_dict(self, state: dict[str, Any]) -> None:
            """Resume at the saved position at the next ``iter()``."""
            self._spot_position.load_state_dict(state)

    Resumable.__name__ = cls.__name__
    Resumable.__qualname__ = cls.__qualname__
    Resumable.__module__ = cls.__module__
    Resumable.__doc__ = cls.__doc__
    return Resumable


def _rng_keeping_class(cls: type) -> type:
    """``cls`` (torchdata's ``StatefulDataLoader``) whose first ``iter()`` after a
    mid-epoch ``load_state_dict`` leaves the global RNGs as they were."""

    class KeepsRng(cls):
        __slots__ = ()
        _spot_keeps_rng = True

        def load_state_dict(self, state: dict[str, Any]) -> None:
            super().load_state_dict(state)
            self.__dict__["_spot_resuming"] = not state.get("_iterator_finished", True)

        def __iter__(self) -> Any:
            if not self.__dict__.pop("_spot_resuming", False):
                return super().__iter__()
            now = _global_states()
            try:
                return super().__iter__()
            finally:
                _set_global(now)

    KeepsRng.__name__ = cls.__name__
    KeepsRng.__qualname__ = cls.__qualname__
    KeepsRng.__module__ = cls.__module__
    KeepsRng.__doc__ = cls.__doc__
    return KeepsRng


_iterator_classes: dict[type, type] = {}


def _tracking_end(it: Any) -> Any:
    """``it`` (the epoch's iterator torch made) with its class swapped for a subclass of
    its own that notes when it ends (``StopIteration``): the loop over it is then over."""
    cls = type(it)
    if not hasattr(it, "__dict__"):
        return it
    # Persistent workers: the same iterator again, for a new epoch.
    vars(it).pop("_spot_ended", None)
    if "_spot_tracks_end" in cls.__dict__:
        return it
    sub = _iterator_classes.get(cls)
    if sub is None:

        class TracksEnd(cls):  # type: ignore[valid-type,misc]
            __slots__ = ()
            _spot_tracks_end = True

            def __next__(self) -> Any:
                try:
                    return super().__next__()
                except StopIteration:
                    self.__dict__["_spot_ended"] = True
                    raise

        TracksEnd.__name__ = cls.__name__
        TracksEnd.__qualname__ = cls.__qualname__
        TracksEnd.__module__ = cls.__module__
        sub = _iterator_classes[cls] = TracksEnd
    it.__class__ = sub
    return it


# -- random states ----------------------------------------------------------------------


def _global_states() -> dict[str, Any]:
    """Python's, NumPy's legacy and torch's CPU RNG states (what a sampler may draw from)."""
    import torch

    states: dict[str, Any] = {"python": random.getstate(),
                              "torch": bytes(torch.get_rng_state().numpy().tobytes())}
    np = sys.modules.get("numpy")
    if np is not None:
        states["numpy"] = np.random.get_state()
    return states


def _set_global(states: dict[str, Any]) -> None:
    import torch

    random.setstate(states["python"])
    torch.set_rng_state(_byte_tensor(states["torch"]))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in states:
        np.random.set_state(states["numpy"])


def _byte_tensor(data: bytes) -> Any:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _is_generator(x: Any) -> bool:
    if isinstance(x, random.Random):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Generator):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.random.Generator)


def _generators(loader: Any) -> dict[str, Any]:
    """The generators the loader, its sampler and its batch sampler hold, by path."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for path in _HOLDERS:
        holder = loader
        for part in filter(None, path.split(".")):
            holder = getattr(holder, part, None)
        if holder is None:
            continue
        attrs = vars(holder) if hasattr(holder, "__dict__") else {}
        for name, value in attrs.items():
            if _is_generator(value) and id(value) not in seen:
                seen.add(id(value))
                found[f"{path}.{name}" if path else name] = value
    return found


def _generator_state(g: Any) -> Any:
    if isinstance(g, random.Random):
        return g.getstate()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Generator):
        return bytes(g.get_state().numpy().tobytes())
    return copy.deepcopy(g.bit_generator.state)


def _set_generator(g: Any, state: Any) -> None:
    if isinstance(g, random.Random):
        g.setstate(state)
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(g, torch.Generator):
        g.set_state(_byte_tensor(state))
        return
    g.bit_generator.state = state


def _states(loader: Any) -> dict[str, Any]:
    return {"global": _global_states(),
            "generators": {p: _generator_state(g) for p, g in _generators(loader).items()}}


def _set_generators(loader: Any, states: dict[str, Any]) -> None:
    for path, g in _generators(loader).items():
        if path in states:
            _set_generator(g, states[path])


# -- the position -----------------------------------------------------------------------


class _Indices:
    """The loader's index sampler as its iterators see it (``loader._index_sampler``)."""

    def __init__(self, position: _Position) -> None:
        self._position = weakref.ref(position)

    @property
    def inner(self) -> Any:
        return self.position.inner()

    @property
    def position(self) -> _Position:
        position = self._position()
        assert position is not None, "the loader is gone"
        return position

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> _EpochIndices:
        # Called once or twice per epoch (a multi-worker iterator calls it in its
        # __init__ and again when it starts): only the one that is drawn from counts.
        it = _EpochIndices(self.position, self.inner)
        self.position.latest = it
        return it


class _EpochIndices:
    """One epoch's indices: begins (or resumes) the epoch at the first draw."""

    __slots__ = ("_inner", "_it", "_position")

    def __init__(self, position: _Position, inner: Any) -> None:
        self._position = position
        self._inner = inner
        self._it: Iterator[Any] | None = None

    def __iter__(self) -> _EpochIndices:
        return self

    def begin(self) -> None:
        """Start drawing: skip what a resume skips (its first draws, under the epoch's
        start states: a sampler's shuffle is drawn at its first index)."""
        if self._it is not None:
            return
        position = self._position
        resume, position.resume = position.resume, None
        it = iter(self._inner)
        if resume is not None:
            skip, fresh = resume
            if not fresh:
                # The epoch reused persistent workers (no worker seed drawn), this
                # iterator is new (drew one): the shuffle draws from the start states.
                position.set_start()
            for n in range(skip):
                try:
                    next(it)
                except StopIteration:
                    _logger.warning("the data loader's epoch has %d batches now, fewer than "
                                    "the %d consumed when it was saved", n, skip)
                    break
            else:
                if skip == 0:  # the shuffle's draw happens at the first index: now
                    try:
                        first = next(it)
                    except StopIteration:
                        pass
                    else:
                        it = _chain(first, it)
        self._it = it

    def __next__(self) -> Any:
        if self._it is None:
            self.begin()
            assert self._it is not None
        return next(self._it)


def _chain(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


class _Position:
    """Where a resumable loader is in its epoch, and the resume it owes (if any)."""

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)
        self.indices = _Indices(self)
        self.latest: _EpochIndices | None = None
        self.epochs = 0  # iter() calls since registration (plus those restored)
        self.start: dict[str, Any] | None = None  # the epoch's start states
        self.fresh = True  # the epoch's iterator was new (it drew the worker seed)
        self.offset = 0  # batches skipped (not yielded) at the epoch's start
        self.batches: int | None = None  # the epoch's length, when known
        self.sampler_epoch: int | None = None
        # The epoch's iterator: torch counts what it yielded (_num_yielded). Held, so
        # that a save after the loop still knows how the epoch ended.
        self.iterator: Any = None
        self.pending: dict[str, Any] | None = None  # loaded, applied at the next iter()
        self.resume: tuple[int, bool] | None = None  # (skip, fresh) for begin()
        self.warned_iterable = False

    @property
    def loader(self) -> Any:
        loader = self._loader()
        assert loader is not None, "the loader is gone"
        return loader

    def inner(self) -> Any:
        loader = self.loader
        return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler

    def set_start(self) -> None:
        assert self.start is not None
        _set_global(self.start["global"])
        _set_generators(self.loader, self.start["generators"])

    def _length(self) -> int | None:
        try:
            return len(self.loader)  # an IterableDataset's own length, if it has one
        except TypeError:
            return None

    def _iterable(self) -> bool:
        import torch

        return isinstance(self.loader.dataset, torch.utils.data.IterableDataset)

    def _usable(self, saved: dict[str, Any]) -> bool:
        """Whether the saved epoch is the one this iter() starts (else warn)."""
        loader = self.loader
        batches = self._length()
        if saved.get("batches") is not None and batches is not None and \
                batches != saved["batches"]:
            _logger.warning("the data loader has %d batches an epoch now, %d when it was "
                            "saved: this epoch starts at its first batch, not at batch %d",
                            batches, saved["batches"], saved["consumed"])
            return False
        epoch = getattr(loader.sampler, "epoch", None)
        if saved.get("sampler_epoch") is not None and epoch is not None and \
                epoch != saved["sampler_epoch"]:
            _logger.warning("the data loader was saved in epoch %s of its sampler "
                            "(set_epoch) at batch %d; this iter() is for epoch %s: it starts "
                            "at its first batch", saved["sampler_epoch"], saved["consumed"],
                            epoch)
            return False
        return True

    def iterate(self, make: Any) -> Any:
        """``iter(loader)``: begin an epoch (or resume the saved one)."""
        loader = self.loader
        pending, self.pending = self.pending, None
        if pending is not None and not self._usable(pending):
            pending = None
        reuses = loader.persistent_workers and loader.num_workers > 0 and \
            loader._iterator is not None
        self.iterator = None  # a finished epoch's iterator goes (its workers with it)
        self.epochs += 1
        self.batches = self._length()
        self.sampler_epoch = getattr(loader.sampler, "epoch", None)
        if pending is None:
            self.start, self.fresh, self.offset = _states(loader), not reuses, 0
            it = _tracking_end(make())
            self.iterator = it
            return it
        # A resume: the epoch's start states, the same iterator, the consumed skipped.
        now = _global_states()
        self.start, self.fresh = pending["start"], bool(pending["fresh"])
        skip = int(pending["consumed"])
        iterable = self._iterable()
        self.offset = 0 if iterable else skip
        try:
            self.set_start()
            if not iterable:
                self.resume = (skip, self.fresh)
            it = make()
            if iterable:
                self._read_and_drop(it, skip)
            else:
                latest = self.latest
                if latest is not None:
                    latest.begin()  # the skip and the shuffle now, under these states
        finally:
            self.resume = None
            _set_global(now)  # what the checkpoint restored: the loop's draws go on
            _set_generators(loader, pending["generators"])
        self.iterator = _tracking_end(it)
        _logger.info("data loader: resumed its epoch at batch %d", skip)
        return it

    def _read_and_drop(self, it: Any, skip: int) -> None:
        if not self.warned_iterable:
            self.warned_iterable = True
            _logger.warning("the data loader's dataset is an IterableDataset: resuming "
                            "mid-epoch reads and drops the %d batches already trained on "
                            "(torchdata's StatefulDataLoader over a dataset with "
                            "state_dict() skips without reading)", skip)
        for _ in range(skip):
            try:
                next(it)
            except StopIteration:
                return

    def in_last_batch(self) -> bool:
        """The epoch's last batch is out, and its iterator was not asked for more."""
        it = self.iterator
        return it is not None and self.batches is not None and \
            self._consumed() >= self.batches and not vars(it).get("_spot_ended", False)

    def _consumed(self) -> int:
        yielded = getattr(self.iterator, "_num_yielded", 0) if self.iterator is not None \
            else 0
        return self.offset + int(yielded)

    def state_dict(self) -> dict[str, Any]:
        loader = self.loader
        generators = {p: _generator_state(g) for p, g in _generators(loader).items()}
        if self.pending is not None:
            # Restored, not iterated since: the position is still the restored one.
            return {**self.pending, "generators": generators}
        consumed = self._consumed()
        complete = self.start is None or (self.batches is not None and
                                          consumed >= self.batches)
        return {"spotnb_loader": FORMAT, "epochs": self.epochs, "consumed": consumed,
                "complete": complete, "batches": self.batches, "fresh": self.fresh,
                "start": None if complete else self.start, "generators": generators,
                "sampler_epoch": self.sampler_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("spotnb_loader") != FORMAT:
            raise ValueError(
                "this is not the state of a plain data loader saved by this spotnb "
                f"(format {FORMAT}): was the checkpoint's loader a StatefulDataLoader, or "
                "saved by a newer spotnb?")
        self.epochs = int(state.get("epochs", 0))
        # The next epoch's draws come from where the generators were at the save.
        _set_generators(self.loader, state.get("generators", {}))
        self.pending = None if state["complete"] or state.get("start") is None else \
            dict(state)
