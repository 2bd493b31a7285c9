"""Hugging Face Accelerate on spot instances: ``spot.callbacks.accelerate(accelerator)``.

An Accelerate loop is the user's own, so the integration is a small object used like
:class:`spotnb.train.runtime.Checkpoint`, saving with Accelerate's own ``save_state`` and
``load_state`` (model, optimizer, scheduler, RNG states, registered objects)::

    accelerator = Accelerator(log_with=[spot.callbacks.accelerate_tracker()])
    model, opt = accelerator.prepare(model, opt)
    ckpt = spot.callbacks.accelerate(accelerator, "checkpoints")
    for step in range(ckpt.restore(), total_steps):    # 0, or where the last run stopped
        ...
        accelerator.log({"loss": loss.item()}, step=step)
        ckpt.maybe_save(step)                           # by policy, or now on a notice

:class:`AccelerateCheckpoints` keeps ``dirpath`` (a synced directory) with one folder per
save, ``step_<step>``, the newest ``keep`` of them on disk and the newest in the
store. ``maybe_save`` saves by the job's checkpoint policy (``--checkpoint-every``,
the same as ``spot.Checkpoint``) or ``every_steps``, and at once after a notice; that
save is made durable and the cell is held until the instance goes.

:class:`SpotTracker` is an Accelerate tracker: ``accelerator.log`` goes to ``spot.log``,
``accelerator.init_trackers(name, config=...)`` to the job's record.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker

from spotnb.train import process
from spotnb.train.integrations._common import log_params, numeric
from spotnb.train.syncdir import CHECKPOINT_NAME, find_checkpoints, newest_checkpoint_only

__all__ = ["AccelerateCheckpoints", "SpotTracker"]

#: Save folders on the instance's disk (the store keeps the newest only).
DEFAULT_KEEP = 2


class AccelerateCheckpoints:
    """``save_state``/``load_state`` in a synced directory (see the module docstring).

    ``every_steps`` overrides the job's checkpoint policy; ``keep`` is how many save
    folders stay on disk.
    """

    def __init__(self, accelerator: Any, dirpath: str | os.PathLike[str] = "checkpoints", *,
                 every_steps: int | None = None, keep: int = DEFAULT_KEEP) -> None:
        if every_steps is not None and every_steps < 1:
            raise ValueError(f"every_steps must be 1 or more, not {every_steps}")
        self.accelerator = accelerator
        self.path = Path(dirpath)
        self.every_steps = every_steps
        self.keep = max(1, keep)
        self._last_step = -1
        self._last_time = time.monotonic()
        # Restored now (every process reads it; the main one uploads it).
        self._dir = process.sync_dir(dirpath, every=None, select=newest_checkpoint_only())

    def __repr__(self) -> str:
        return f"AccelerateCheckpoints({str(self.path)!r}, keep={self.keep})"

    def restore(self) -> int:
        """Load the newest save into the prepared objects; the step to continue from
        (0 without one, else the saved step + 1)."""
        found = find_checkpoints(self.path)
        if not found:
            return 0
        match = CHECKPOINT_NAME.match(found[-1].name)
        assert match is not None  # find_checkpoints only returns matching names
        self.accelerator.load_state(os.fspath(found[-1]))
        self._last_step = int(match.group(1))
        self._last_time = time.monotonic()
        return self._last_step + 1

    def maybe_save(self, step: int) -> bool:
        """Save if the policy says so or a notice is pending; whether it saved."""
        if process.current().save_requested:
            self.save(step)
            return True
        every = process.current().every
        steps = self.every_steps if self.every_steps is not None else every.steps
        seconds = None if self.every_steps is not None else every.seconds
        if (steps is not None and step - self._last_step >= steps) or (
                seconds is not None and time.monotonic() - self._last_time >= seconds):
            self.save(step)
            return True
        return False

    def save(self, step: int) -> None:
        """``accelerator.save_state`` of "step ``step`` is done", then its snapshot
        (after a notice: durable, then the cell is held)."""
        self.accelerator.save_state(os.fspath(self.path / f"step_{step}"))
        self._last_step = step
        self._last_time = time.monotonic()
        if not self.accelerator.is_main_process:
            return
        for old in find_checkpoints(self.path)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        self._dir.save(step)


class SpotTracker(GeneralTracker):
    """An Accelerate tracker: ``Accelerator(log_with=[SpotTracker()])``."""

    name = "spotnb"
    requires_logging_directory = False
    main_process_only = True

    def __init__(self, run_name: str | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.run_name = run_name

    @property
    def tracker(self) -> Any:
        return process  # spot.log, spot.log_params ...

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        log_params(values, source="accelerate")

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        kept = numeric(values)
        if kept:
            process.log(0 if step is None else step, **kept)
