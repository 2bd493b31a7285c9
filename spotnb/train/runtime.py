"""The API a training cell uses: ``from spotnb import runtime as spot``.

This module is the facade: what a cell sees as ``spot.*``, and the hooks the agent
calls in the kernel. On a spot instance the agent starts the user's kernel with the
environment described in :mod:`spotnb.kernel_remote.channel`, calls :func:`_bootstrap`
(connects to the agent's socket, loads the cell's inputs, binds ``spot`` in the
namespace), runs the cell, and calls :func:`_finish` (flushes, waits until every upload
is durable). The parts behind it: :mod:`~spotnb.train.process` (the session and
``spot.log``...), :mod:`~spotnb.train.checkpoint` (``spot.Checkpoint``: register,
restore), :mod:`~spotnb.train.saving` (when a checkpoint saves, and one save's states),
:mod:`~spotnb.train.upload` (a save's background upload),
:mod:`~spotnb.train.distributed` (the world a worker runs in),
:mod:`~spotnb.train.bootstrap` (the agent's hooks) and :mod:`~spotnb.train.syncdir`. The
same code also runs in a plain Python or notebook session without that environment,
for debugging a cell locally: then checkpoints go to ``./.spotnb-local/``, ``job_id``
is ``"local"``, ``attempt`` is 0, metrics are kept in memory (:func:`history`) and no
interruption notice ever comes.

A typical cell::

    ckpt = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched)
    for step in range(ckpt.restore(), total_steps):   # 0, or where the last run stopped
        loss = train_step()
        spot.log(step, loss=loss)                      # cheap: no sync, no I/O
        ckpt.maybe_save(step)                          # by policy, or now on a notice

Public API: :func:`log`, :func:`log_params`, :func:`progress`, :class:`Checkpoint`,
:func:`sync_dir`, :func:`last_checkpoint`, :func:`history`, the module attributes
``spot.interrupt_pending`` (an ``instance-action`` notice arrived; a ``rebalance``
recommendation does not set it), ``spot.save_requested`` (a notice asks for a save at
the next step), ``spot.job_id`` and ``spot.attempt``, ``spot.tensorboard()``
(:func:`spotnb.train.tb.tensorboard`) and ``spot.callbacks`` (the framework integrations of
:mod:`spotnb.train.integrations`: ``spot.callbacks.transformers()`` ...).

What happens on an interruption (the ``instance-action`` notice, about two minutes
before EC2 terminates the instance)::

    agent: notice -> runtime (receiver thread): force the next save, wake sync dirs
    cell:  ckpt.maybe_save(step) -> save(step) -> wait until durable
           -> "parked" -> hold the cell (sleep) until the instance is gone
    next attempt: cell re-runs from the top -> ckpt.restore() == step + 1

If an earlier save is still uploading when the notice comes, the forced save does not
queue behind it: it uploads alongside (written straight from the training tensors,
since the earlier save's host buffers are still being written) and is committed (made
``LATEST``) right after it, so the final checkpoint shares the link rather than waiting
for a whole upload first. A notice that arrives while a save is stalled writing live
tensors makes that save the final one. Otherwise each save waits for the previous
upload. A ``rebalance`` recommendation only forces the next save. A save that finds
the lease lost (another agent took over the job) never moves ``LATEST`` and holds the
cell too.

A save, in memory and time (see :mod:`spotnb.ckpt` for the format, and
:mod:`spotnb.train.saving` for its states)::

    save(step): capture (copy what fits the host_memory budget into reused buffers)
        -> background: DCP planner + StoreWriter stream every tensor into the store,
           live ones (not copied) first; the loop waits for those only
        -> .metadata, MANIFEST.json -> after the previous save: fence, LATEST
        -> "durable" (with the stall and the time to durable); after the first one,
           a warning if it would not fit in half the interruption notice
"""


from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

from spotnb.train import bootstrap
from spotnb.train import integrations as callbacks
from spotnb.train.bootstrap import OutputError
from spotnb.train.checkpoint import Checkpoint
from spotnb.train.process import current as _rt
from spotnb.train.process import (
    history,
    last_checkpoint,
    log,
    log_params,
    progress,
    sync_dir,
)
from spotnb.train.session import LOCAL_DIR
from spotnb.train.syncdir import SyncDir
from spotnb.train.tb import tensorboard

__all__ = ["LOCAL_DIR", "Checkpoint", "OutputError", "SyncDir", "callbacks", "history",
           "last_checkpoint", "log", "log_params", "progress", "sync_dir", "tensorboard"]


class _Module(types.ModuleType):
    """This module's class. The attributes that read the session are properties:
    ``spot.save_requested`` is read at every step (by training loops and by every
    framework integration), and a property costs one lookup where a module
    ``__getattr__`` costs a failed lookup and a call (about 8x more)."""

    @property
    def interrupt_pending(self) -> bool:
        return _rt().interrupt_pending

    @property
    def save_requested(self) -> bool:
        return _rt().save_requested

    @property
    def job_id(self) -> str:
        return _rt().job_id

    @property
    def attempt(self) -> int:
        return _rt().attempt


sys.modules[__name__].__class__ = _Module


def __getattr__(name: str) -> Any:
    # The session's attributes are _Module's properties; named here too for type
    # checkers.
    if name in ("interrupt_pending", "save_requested", "job_id", "attempt"):
        return getattr(sys.modules[__name__], name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), "interrupt_pending", "job_id", "attempt", "save_requested"])



# -- hooks the agent calls inside the kernel (spotnb.train.bootstrap) -----------------


def _bootstrap(user_ns: dict[str, Any] | None = None,
               env: dict[str, str] | None = None) -> None:
    """Before the cell: the attempt's environment, the cell's inputs, and ``spot`` (this
    module) in the namespace (:func:`spotnb.train.bootstrap.bootstrap`)."""
    bootstrap.bootstrap(sys.modules[__name__], user_ns, env)


def _finish() -> None:
    """After the cell: everything sent and durable (:func:`spotnb.train.bootstrap.finish`)."""
    bootstrap.finish()


def _sync(token: str) -> None:
    """After a failed cell: every row sent, then ``token`` (:func:`spotnb.train.bootstrap.
    sync`)."""
    bootstrap.sync(token)


def _save_outputs(names: Iterable[str], user_ns: dict[str, Any] | None = None) -> None:
    """After the cell: the outputs to ``outputs.pkl`` (:func:`spotnb.train.bootstrap.
    save_outputs`)."""
    bootstrap.save_outputs(names, user_ns)
