"""PyTorch Lightning on spot instances: ``spot.callbacks.lightning()``.

In a ``%%spot_train`` cell::

    trainer = L.Trainer(max_steps=1000, callbacks=[spot.callbacks.lightning()])
    trainer.fit(model, train_loader, ckpt_path="last")

:class:`SpotCheckpoint` is a ``ModelCheckpoint`` (it takes the same arguments; use it
in place of yours) whose ``dirpath`` (default ``checkpoints``) is a synced directory:

* made: the directory is restored from the store, so ``ckpt_path="last"`` finds the
  ``last.ckpt`` of the previous attempt (``save_last`` is on). The restored callback
  state names the previous instance's directory; its paths are moved to this one
  (``load_state_dict``), so Lightning keeps writing ``last.ckpt`` rather than
  starting ``last-v1.ckpt`` beside it (whose mtime, restored, would not tell
  ``ckpt_path="last"`` which of the two is newer);
* ``setup``: adds :class:`SpotLogger` to the trainer's loggers (unless one is there):
  ``self.log(...)`` values go to ``spot.log``, the LightningModule's (and
  DataModule's) hparams to the job's record;
* after each of Lightning's own saves (``every_n_train_steps``, epoch ends,
  validation): a snapshot of the directory, uploaded in the background, taken at the
  next hook, once Lightning has logged the batch's metrics (the snapshot carries the
  rows the log has not confirmed: spotnb.train.carry.Carry);
* at the end of a training batch after an interruption notice: ``trainer.
  save_checkpoint`` to ``last.ckpt``, uploaded at once; at the next hook, once
  Lightning has logged the batch's metrics, the cell waits until it is durable and is
  held until the instance goes. The replacement resumes after that batch.

Lightning stores the RNG states of neither Python, NumPy nor torch in a checkpoint;
this callback adds them (``state_dict``/``load_state_dict`` of the callback, Lightning's
API for callback state), so a seeded run continues as if uninterrupted. A resume in
the middle of an epoch continues the epoch's batches exactly when the data loader
can say where it was (``torchdata``'s ``StatefulDataLoader``, or any loader with
``state_dict``); a plain ``DataLoader`` restarts the epoch's iteration.
"""

from __future__ import annotations

import os
import random
from argparse import Namespace
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger

from spotnb.train import process
from spotnb.train.integrations._common import log_params, numeric
from spotnb.train.syncdir import SyncDir

__all__ = ["SpotCheckpoint", "SpotLogger"]


class SpotLogger(Logger):
    """A Lightning ``Logger``: metrics to ``spot.log``, hparams to the job's record."""

    @property
    def name(self) -> str:
        return "spotnb"

    @property
    def version(self) -> int:
        return process.current().attempt

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        values = numeric(metrics)
        if values:
            process.log(0 if step is None else step, **values)

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any,
                        **kwargs: Any) -> None:
        if isinstance(params, Namespace):
            params = vars(params)
        log_params(dict(params), source="lightning")


class SpotCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` on a synced directory that also saves on a spot notice (see
    the module docstring). ``log=False`` leaves the trainer's loggers alone."""

    def __init__(self, dirpath: str = "checkpoints", *, log: bool = True,
                 save_last: bool | Literal["link"] = True, **kwargs: Any) -> None:
        super().__init__(dirpath=dirpath, save_last=save_last, **kwargs)
        self._log = log
        self._written = False
        self._snapshot_due = False  # a periodic save to snapshot at the next hook
        self._hold_at: int | None = None  # the step whose save a notice forced
        # Restored now, before fit(ckpt_path="last") looks for last.ckpt.
        self._dir: SyncDir = process.sync_dir(dirpath, every=None)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self._log and not any(isinstance(lg, SpotLogger) for lg in trainer.loggers):
            trainer.loggers = [*trainer.loggers, SpotLogger()]

    # -- RNG states, as this callback's state in every checkpoint ----------------------

    def state_dict(self) -> dict[str, Any]:
        import torch

        state: dict[str, Any] = dict(super().state_dict())
        state["spotnb_rng"] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy
        except ImportError:
            return state
        # As plain values: Lightning loads checkpoints with torch.load(weights_only=True).
        raw: Any = numpy.random.get_state()  # the legacy tuple (MT19937)
        kind, keys, pos, has_gauss, cached = raw
        state["spotnb_rng"]["numpy"] = [kind, keys.tolist(), pos, has_gauss, cached]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import torch

        rng = state_dict.get("spotnb_rng")
        super().load_state_dict(self._moved_here(
            {k: v for k, v in state_dict.items() if k != "spotnb_rng"}))
        if rng:
            random.setstate(rng["python"])
            torch.set_rng_state(rng["torch"])
            if "numpy" in rng:
                import numpy

                kind, keys, pos, has_gauss, cached = rng["numpy"]
                numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos,
                                        has_gauss, cached))

    def _moved_here(self, state: dict[str, Any]) -> dict[str, Any]:
        """The callback state of a checkpoint saved in the previous attempt's directory
        (another instance's path), with its paths in this directory, which holds the
        same files (restored). Lightning drops ``last_model_path`` and the top-k of a
        state whose ``dirpath`` differs, and its next ``save_last`` then writes
        ``last-v1.ckpt`` beside the ``last.ckpt`` it does not recognise as its own."""
        before, here = state.get("dirpath"), self.dirpath
        if not before or not here or before == here:
            return state

        def moved(path: Any) -> Any:
            if not isinstance(path, str) or not path:
                return path
            relative = os.path.relpath(path, before)
            if relative == os.pardir or relative.startswith(os.pardir + os.sep):
                return path  # not in the synced directory: left as it was
            return os.path.join(here, relative)

        state = dict(state, dirpath=here)
        for key in ("last_model_path", "best_model_path", "kth_best_model_path"):
            if key in state:
                state[key] = moved(state[key])
        if isinstance(state.get("best_k_models"), dict):
            state["best_k_models"] = {moved(k): v for k, v in state["best_k_models"].items()}
        return state

    # -- saves ---------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        # Called for every checkpoint the trainer writes (ours, another callback's, a
        # trainer.save_checkpoint of the user's): it is on disk when the hook that
        # asked for it returns, and the hooks below snapshot it then.
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        self._written = True

    def _snapshot(self, trainer: pl.Trainer, hold: bool = True) -> None:
        if self._written and trainer.is_global_zero:
            self._written = False
            self._dir.save(trainer.global_step, hold=hold)  # holds the cell after a notice

    def _hold(self, trainer: pl.Trainer) -> None:
        # The batch's metrics are logged by now (Lightning logs them after the
        # on_train_batch_end hooks): snapshot a periodic save, so that it carries them;
        # wait until the forced save is durable, then park.
        if self._snapshot_due:
            self._snapshot_due = False
            self._snapshot(trainer)
        step, self._hold_at = self._hold_at, None
        if step is not None:
            self._dir.hold(step)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # Resumed from a "last" checkpoint of this directory: it is this callback's
        # last one, whatever the restored state said (a copy made elsewhere,
        # or the user's own save), so the next save_last replaces it.
        resumed = trainer.ckpt_path
        if resumed and self.dirpath and os.path.dirname(os.path.abspath(resumed)) == \
                os.path.abspath(self.dirpath) and \
                os.path.basename(resumed).startswith(self.CHECKPOINT_NAME_LAST):
            self.last_model_path = os.path.join(self.dirpath, os.path.basename(resumed))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        notice = process.current().save_requested and trainer.is_global_zero
        if notice:
            path = os.path.join(str(self.dirpath), self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            if os.path.islink(path):
                os.unlink(path)  # save_last="link": never write through the link
            # Named before the save, as Lightning's own save_last does: the state saved
            # in it says that last.ckpt is this callback's, so the next attempt's
            # periodic saves go on writing last.ckpt (not last-v1.ckpt beside it).
            self.last_model_path = path
            trainer.save_checkpoint(path)
            self._hold_at = trainer.global_step
            self._snapshot(trainer, hold=False)
        else:
            self._snapshot_due = self._written  # at the next hook (_hold)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        self._hold(trainer)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hold(trainer)
        super().on_train_epoch_end(trainer, pl_module)
        self._snapshot(trainer)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hold(trainer)
        super().on_validation_start(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._snapshot(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._hold(trainer)
        super().on_train_end(trainer, pl_module)
