"""Hugging Face ``Trainer`` on spot instances: ``spot.callbacks.transformers()``.

In a ``%%spot_train`` cell::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[spot.callbacks.transformers()])
    trainer.train(resume_from_checkpoint=spot.last_checkpoint(args.output_dir))

What the callback does, with the Trainer's own callback API:

* ``on_init_end``: ``args.output_dir`` becomes a synced directory, restored from the
  store (so ``spot.last_checkpoint`` finds the newest ``checkpoint-N``), snapshotted
  at the Trainer's save points only, each snapshot holding the newest checkpoint (and
  the best one, with ``load_best_model_at_end``) rather than every one kept on disk;
  the ``TrainingArguments`` (and the model config's non-default values, as
  ``model.*``) go to the job's record.
* ``on_step_end``: after an interruption notice, ``control.should_save = True``: the
  Trainer saves a checkpoint of this step, with its optimizer, scheduler, RNG and
  trainer state, as at any save.
* ``on_save``: the snapshot of that checkpoint; after a notice, it is made durable and
  the cell is held until the instance goes. The replacement resumes at the next step.
* ``on_log``: the numbers of each log (``loss``, ``learning_rate``, ``grad_norm``,
  evaluation metrics ...) go to ``spot.log`` at ``state.global_step``.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from spotnb.train import process
from spotnb.train.integrations._common import log_params, numeric
from spotnb.train.syncdir import SyncDir, newest_checkpoint_only

__all__ = ["SpotCallback"]


class SpotCallback(TrainerCallback):
    """Keeps a ``Trainer``'s checkpoints in the job's store, saves on a spot notice,
    and sends its logs and arguments to spotnb (see the module docstring).

    ``log_params=False`` keeps the ``TrainingArguments`` out of the record.
    """

    def __init__(self, log_params: bool = True) -> None:
        self.log_params = log_params
        self._dir: SyncDir | None = None
        self._state: TrainerState | None = None

    def _kept(self) -> list[str]:
        # The best checkpoint is kept in every snapshot too: load_best_model_at_end
        # reads it back at the end of training.
        best = self._state.best_model_checkpoint if self._state is not None else None
        return [os.path.basename(os.path.normpath(best))] if best else []

    def _sync_dir(self, args: TrainingArguments, state: TrainerState) -> SyncDir:
        self._state = state
        if self._dir is None:
            # TrainingArguments defaults output_dir to "trainer_output".
            self._dir = process.sync_dir(args.output_dir or "trainer_output", every=None,
                                      select=newest_checkpoint_only(keep=self._kept))
        return self._dir

    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        if not state.is_world_process_zero:
            return
        self._sync_dir(args, state)
        if self.log_params:
            params: dict[str, Any] = dict(args.to_dict())
            config = getattr(kwargs.get("model"), "config", None)
            if config is not None and hasattr(config, "to_diff_dict"):
                params.update({f"model.{k}": v for k, v in config.to_diff_dict().items()})
            log_params(params, source="transformers")

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        # Added with trainer.add_callback after the Trainer was made: set up now.
        if state.is_world_process_zero:
            self._sync_dir(args, state)

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if process.current().save_requested:
            control.should_save = True
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> None:
        if state.is_world_process_zero:
            self._sync_dir(args, state).save(state.global_step)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and state.is_world_process_zero:
            values = numeric(logs)
            if values:
                process.log(state.global_step, **values)
