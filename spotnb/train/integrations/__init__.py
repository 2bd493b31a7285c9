"""Hugging Face Transformers, PyTorch Lightning and Accelerate on spot instances.

Reached in a cell as ``spot.callbacks`` (``spotnb.train.runtime``'s attribute). Each entry
point imports its framework only when called, so importing spotnb, the runtime or the
magics never imports a framework (they need not even be installed in the notebook's
environment: ``pip install 'spotnb[transformers]'`` on the instance is enough).

What each integration does, with the framework's own APIs:

=================  ====================================  ==============================
                   resume                                notice (the next step)
=================  ====================================  ==============================
Transformers       ``trainer.train(resume_from_          ``control.should_save`` in
                   checkpoint=spot.last_checkpoint(      ``on_step_end``; ``on_save``
                   args.output_dir))``                   makes it durable, then parks
Lightning          ``trainer.fit(..., ckpt_path=         ``trainer.save_checkpoint``
                   "last")``                             (``last.ckpt``) at batch end
Accelerate         ``ckpt.restore()``:                   ``ckpt.maybe_save(step)``:
                   ``accelerator.load_state``            ``accelerator.save_state``
=================  ====================================  ==============================

In each, the framework's checkpoint directory is a synced directory
(``spot.sync_dir(path, every=None)``) snapshotted at the framework's save points only,
so a snapshot never holds a checkpoint half-written; after a notice the save at the
next step is made durable in the store and the cell is held until the instance goes
(the same end as :meth:`spotnb.train.runtime.Checkpoint.maybe_save`): no step is redone.
The framework's logging goes to ``spot.log`` (the Trainer's ``on_log``, a Lightning
``Logger``, an Accelerate tracker), its hyperparameters to ``spot.log_params`` and so
the job's record.

One process per instance: the integrations act on the main process only (the one
that writes checkpoints); multi-process training on one instance is not covered.
"""

from __future__ import annotations

from typing import Any

__all__ = ["accelerate", "accelerate_tracker", "lightning", "lightning_logger", "transformers"]


def transformers(**options: Any) -> Any:
    """A ``transformers.TrainerCallback``: ``Trainer(..., callbacks=[spot.callbacks.
    transformers()])``. See :class:`spotnb.train.integrations.for_transformers.SpotCallback`."""
    from spotnb.train.integrations.for_transformers import SpotCallback

    return SpotCallback(**options)


def lightning(dirpath: str = "checkpoints", **options: Any) -> Any:
    """A Lightning ``ModelCheckpoint`` on a synced directory (same arguments), which also
    adds the spotnb ``Logger``: ``L.Trainer(callbacks=[spot.callbacks.lightning()])`` and
    ``trainer.fit(model, ..., ckpt_path="last")``. See
    :class:`spotnb.train.integrations.for_lightning.SpotCheckpoint`."""
    from spotnb.train.integrations.for_lightning import SpotCheckpoint

    return SpotCheckpoint(dirpath=dirpath, **options)


def lightning_logger() -> Any:
    """The Lightning ``Logger`` alone (metrics to ``spot.log``, hparams to the record)."""
    from spotnb.train.integrations.for_lightning import SpotLogger

    return SpotLogger()


def accelerate(accelerator: Any, dirpath: str = "checkpoints", **options: Any) -> Any:
    """``accelerator.save_state``/``load_state`` on a synced directory, with the job's
    checkpoint policy and the notice: ``ckpt = spot.callbacks.accelerate(accelerator)``,
    ``for step in range(ckpt.restore(), n): ...; ckpt.maybe_save(step)``. See
    :class:`spotnb.train.integrations.for_accelerate.AccelerateCheckpoints`."""
    from spotnb.train.integrations.for_accelerate import AccelerateCheckpoints

    return AccelerateCheckpoints(accelerator, dirpath, **options)


def accelerate_tracker() -> Any:
    """An Accelerate tracker: ``Accelerator(log_with=[spot.callbacks.accelerate_tracker()])``;
    ``accelerator.log`` goes to ``spot.log``, ``init_trackers(config=...)`` to the record."""
    from spotnb.train.integrations.for_accelerate import SpotTracker

    return SpotTracker()
