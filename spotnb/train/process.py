"""This process's session, and the API that only uses it: ``spot.log``,
``spot.log_params``, ``spot.progress``, ``spot.history``, ``spot.sync_dir`` and
``spot.last_checkpoint`` (:mod:`spotnb.train.runtime` hands them out as ``spot.*``).

The session (:class:`spotnb.train.session.Session`) is created from the environment the
agent gave the kernel on first use (:func:`current`), forgotten in a forked child, and
detached at the end of the cell (:func:`end`). The framework integrations and
TensorBoard (``spot.callbacks``, ``spot.tensorboard``) use this module, not the
runtime that offers them.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from spotnb.kernel_remote import channel
from spotnb.protocol.spec import parse_duration
from spotnb.train.metrics import ROWS
from spotnb.train.session import Session
from spotnb.train.syncdir import Select, SyncDir, find_checkpoints, sync_name

__all__ = ["at_exit", "current", "end", "existing", "history", "last_checkpoint", "log",
           "log_params", "progress", "sync_dir"]

_logger = logging.getLogger(__name__)

# log_params keeps a record small: a model config or TrainingArguments has ~100 fields.
MAX_PARAMS = 300
MAX_PARAM_CHARS = 200
MAX_PARAM_ITEMS = 32

# The hot path of log(): bound once, so a call is one global lookup each.
_append = ROWS.append
_now = time.time

_runtime: Session | None = None
_runtime_lock = threading.Lock()
# Whether this process records metric rows: a distributed job records global rank 0's
# only (spotnb.kernel_remote.multinode). Decided once, when the session starts
# (current), never per call: os.environ.get alone costs more than the whole of log().
# A worker's RANK is fixed for its kernel's life (a new round of the world starts new
# kernels), and it is in the environment before the first session (the agent's
# bootstrap sets it).
_records_rows = True
_atexit_registered = False
_at_exit: list[Callable[[], None]] = []
# The first log() call looks once for the range of the loop it is in (progress.py).
_total_pending = True


def current() -> Session:
    """The process's session, created from the environment on first use."""
    global _runtime, _atexit_registered, _records_rows
    rt = _runtime
    if rt is not None:
        return rt
    with _runtime_lock:
        if _runtime is None:
            _records_rows = os.environ.get("RANK", "0") == "0"
            _runtime = Session.from_env()
            if not _atexit_registered:
                # A plain script must not exit with an upload half done.
                for fn in _at_exit:
                    atexit.register(fn)
                _atexit_registered = True
        return _runtime



def existing() -> Session | None:
    """The process's session if one started (none is created)."""
    return _runtime


def end() -> Session | None:
    """Detach the process's session (the next use of the API starts afresh); it."""
    global _runtime, _total_pending
    with _runtime_lock:
        rt, _runtime = _runtime, None
        _total_pending = True  # the next session looks for its loop's total again
    return rt


def at_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter exits, if a session started by then."""
    _at_exit.append(fn)


def _forget_in_child() -> None:
    # A forked child (a DataLoader worker) must not send the parent's rows or use its
    # threads and socket; if it logs, it opens its own session.
    global _runtime, _runtime_lock, _total_pending
    _runtime = None
    _total_pending = True
    _runtime_lock = threading.Lock()  # another thread may have held it at fork time
    ROWS.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def log(step: int, **metrics: Any) -> None:
    """Record metrics for ``step``: ``spot.log(step, loss=loss, lr=lr)``.

    As cheap as a ``deque.append``: the values (numbers, NumPy scalars, one-element
    tensors) are converted with ``float()`` in a background thread, so logging a CUDA
    tensor does not wait for the GPU here. A tensor is referenced until it is
    converted, within about 0.2 s. Values that are not numbers are dropped with a
    warning; NaN and infinities are kept.
    """
    if _runtime is None:
        current()
    if not _records_rows:
        return  # a distributed job records global rank 0's rows (spotnb.kernel_remote.multinode)
    if _total_pending:
        _find_total()
    _append((step, _now(), metrics))


def log_params(params: Mapping[str, Any] | None = None, /, *, source: str | None = None,
               **more: Any) -> None:
    """Record the run's hyperparameters: ``spot.log_params(lr=0.1, batch_size=64)``.

    They appear in the job's record (``params``, see :mod:`spotnb.records`). Values are
    kept when they are numbers, booleans, ``None`` or short strings, and short lists of
    those; anything else is kept as its ``repr``, shortened. A later call adds to (and
    overrides) the names of earlier ones. ``source`` says where they come from (the
    integrations pass ``"transformers"``, ``"lightning"`` ...).
    """
    merged = {**(params or {}), **more}
    clean = {str(k): _param_value(v) for k, v in list(merged.items())[:MAX_PARAMS]}
    if len(merged) > MAX_PARAMS:
        _logger.warning("log_params: %d parameters given; the record keeps the first %d",
                        len(merged), MAX_PARAMS)
    rt = current()
    rt.params.update(clean)
    rt.send(channel.Params(params=clean, source=source or None))


def _param_value(value: Any) -> Any:
    """What the record keeps of one hyperparameter (JSON, bounded)."""
    import enum
    import math

    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, str):
        return value if len(value) <= MAX_PARAM_CHARS else value[:MAX_PARAM_CHARS] + "…"
    if isinstance(value, (list, tuple)) and len(value) <= MAX_PARAM_ITEMS:
        items = [_param_value(v) for v in value]
        if all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
            return items
    text = repr(value)
    return text if len(text) <= MAX_PARAM_CHARS else text[:MAX_PARAM_CHARS] + "…"


def progress(total: int) -> None:
    """Say how many steps the run has: ``spot.progress(total=epochs * len(loader))``.

    The notebook then shows step N of ``total``, the pace and the time left. Not
    needed when the loop that calls :func:`log` is ``for step in range(..., N)`` with
    ``spot.log(step, ...)``: the first ``log`` call finds ``N`` by itself.
    """
    global _total_pending
    _total_pending = False
    current().report_total(int(total), "spot.progress")


def _find_total() -> None:
    """Once per process: the total of the loop around the first ``log`` call."""
    global _total_pending
    _total_pending = False
    from spotnb.train.looptotal import loop_total

    try:
        total = loop_total(sys._getframe(2))
    except Exception:  # a guess that fails costs nothing but the total
        _logger.debug("could not find the loop's range", exc_info=True)
        return
    if total is not None:
        current().report_total(total, "range")


def history() -> list[tuple[int, float, dict[str, float]]]:
    """Standalone mode: every row logged so far as ``(step, time, {name: value})``.

    In a job the rows go to the agent and are not kept here (the list stays empty).
    """
    rt = current()
    rt.drain()
    return list(rt.rows.history)


def wait_for_lease(rt: Session) -> None:
    """A warm standby's kernel (``SPOTNB_STANDBY``): say the cell reached its restore
    point, then wait until the agent holds the lease, and take the attempt it names.

    No time limit: a standby that is not needed is terminated with its instance.
    """
    restore_dir = rt.restore_dir
    if os.environ.get(channel.ENV_STANDBY) != "1" or restore_dir is None:
        return
    (restore_dir / channel.STANDBY_WAITING).touch()
    leased = restore_dir / channel.STANDBY_LEASED
    while not leased.exists():
        time.sleep(0.02)
    rt.attempt = int(json.loads(leased.read_text())["attempt"])
    os.environ[channel.ENV_ATTEMPT] = str(rt.attempt)
    del os.environ[channel.ENV_STANDBY]


def sync_dir(path: str | os.PathLike[str], every: float | str | None = "5m", *,
             select: Select | None = None) -> SyncDir:
    """Keep a directory you write your own checkpoint files to in the job's store.

    Before returning, restores the directory's latest snapshot (files of the snapshot
    are written into it; other files are left alone). Then uploads it every ``every``
    (``"5m"``, the default, ``"60s"``, or seconds) when something changed, at once on an
    interruption notice, and a last time at the end of the job. Each upload is a
    complete snapshot (files, then manifest, then ``LATEST``), so a resume never sees
    half a directory; write each file atomically (to a temporary name, then rename)
    so a snapshot never catches a file half-written.

    ``every=None``: no timer and no upload on the notice by itself; call
    ``sd.save(step)`` (:meth:`SyncDir.save`) each time your code has written a
    complete checkpoint into the directory, and after a notice make the next step
    save (``spot.save_requested``): that save is made durable and the cell is held
    until the instance goes. The integrations (``spot.callbacks``) do this for you.
    ``select`` narrows what a snapshot holds (see :mod:`spotnb.train.syncdir`). Called again
    with the same path it returns the same :class:`SyncDir`, with the new ``every``
    unless it uploads at save points (``every=None`` stays).

    The snapshot's name comes from ``path`` as written: use the same path, relative
    to the working directory, on every run.
    """
    seconds = None if every is None else parse_duration(every, "sync_dir every")
    rt = current()
    name = sync_name(path)
    existing = rt.sync_dirs.get(name)
    if existing is not None:
        assert isinstance(existing, SyncDir)  # only this function adds to sync_dirs
        # A directory saved at a framework's save points (every=None, set by an
        # integration) stays so: a timer must not catch a checkpoint half-written.
        if existing.every is not None:
            existing.every = seconds
        if select is not None:
            existing.select = select
        return existing
    sd = SyncDir(rt, path, seconds, select=select)
    # A standby's restore point, as Checkpoint.restore's: what the framework resumes
    # from is read once this instance holds the job (and knows its attempt).
    wait_for_lease(rt)
    sd.restore()
    rt.sync_dirs[name] = sd
    sd.start()
    return sd


def last_checkpoint(path: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint in ``path``, restored from the job's store; None if none.

    ``path`` becomes a synced directory (:func:`sync_dir`) if it is not one yet, which
    restores its latest snapshot first. The checkpoint is the numbered folder (or
    file) with the highest number: Hugging Face's ``checkpoint-500``, Accelerate's
    ``checkpoints/checkpoint_3`` or ``step_500`` (:data:`spotnb.train.syncdir.CHECKPOINT_NAME`).
    Pass it to the framework's own resume argument::

        trainer.train(resume_from_checkpoint=spot.last_checkpoint(args.output_dir))

    On the first attempt (nothing saved yet) it returns None, which starts afresh.
    """
    if sync_name(path) not in current().sync_dirs:
        sync_dir(path)
    found = find_checkpoints(path)
    return os.fspath(found[-1]) if found else None
