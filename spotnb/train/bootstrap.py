"""What the agent calls inside the kernel, around the cell: the runtime's bootstrap
before it (the attempt's environment, the cell's inputs, ``spot`` in the namespace),
and after it the outputs and the end (everything sent and durable).

The agent calls these through the runtime's module (``_spotnb_runtime._bootstrap(...)``,
``_finish()``, ``_save_outputs(...)``, ``_sync(...)``: :mod:`spotnb.train.runtime`),
so that a kernel names one module of spotnb's.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

from spotnb.ckpt.checkpoints import CheckpointError, FencedOff
from spotnb.protocol import layout
from spotnb.protocol.store import NotFound, retrying
from spotnb.train import distributed, process
from spotnb.train.process import current as _rt
from spotnb.train.upload import join_writer_import

_logger = logging.getLogger(__name__)


class InputError(RuntimeError):
    """An input shipped with the job cannot be read on the instance."""


class OutputError(ValueError):
    """An output variable is missing or cannot be pickled."""


def _user_ns() -> dict[str, Any]:
    try:
        from IPython import get_ipython
    except ImportError:
        shell = None
    else:
        shell = get_ipython()
    if shell is None:
        raise RuntimeError("spotnb.train.runtime._bootstrap must run inside an IPython kernel "
                           "(or be given user_ns); this is a spotnb bug, please report it")
    ns: dict[str, Any] = shell.user_ns
    return ns


def bootstrap(spot: types.ModuleType, user_ns: dict[str, Any] | None = None,
              env: dict[str, str] | None = None) -> None:
    """Called by the agent in the fresh kernel before the cell runs.

    Adds ``env`` to the environment (the attempt's own settings: the agent spawns the
    kernel before it knows which attempt it runs; subprocesses of the cell inherit
    them too), connects to the agent (``SPOTNB_AGENT_SOCKET``), loads the cell's
    captured inputs (``inputs.pkl`` in the job store: :mod:`spotnb.protocol.inputs`;
    the notebook's functions among them linked to the namespace) into the namespace,
    and binds ``spot`` there (the runtime's module, :mod:`spotnb.train.runtime`).
    """
    from spotnb.protocol import inputs

    os.environ.update(env or {})
    threads = (env or {}).get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if threads and torch is not None:  # imported before the setting came: told now
        torch.set_num_threads(int(threads))
    # The agent unpacks the job's files while the kernel boots: forget any directory
    # listing the import system cached before they were there.
    importlib.invalidate_caches()
    distributed.bound_peer_waits()
    rt = _rt()
    ns = _user_ns() if user_ns is None else user_ns
    try:
        data = rt.store.get(layout.INPUTS)
    except NotFound:
        data = None
    if data is not None:
        # Each input is pickled on its own, so one that cannot be read here (its
        # class lives in a module the instance lacks) is named.
        try:
            inputs.load(data, ns)
        except inputs.InputUnreadable as err:
            raise InputError(
                f"input {err.name!r} could not be unpickled on the instance: "
                f"{type(err.error).__name__}: {err.error}. Make the module that defines it "
                "importable on the instance, or create it inside the cell."
            ) from err.error
        _logger.info("loaded the job's inputs")
    ns["spot"] = spot


def finish() -> None:
    """Called by the agent after the cell: blocks until everything is sent and durable.

    Flushes metrics, waits for the newest checkpoint upload, uploads every
    :func:`sync_dir` a last time, and closes the channel. Raises
    :class:`spotnb.ckpt.checkpoints.CheckpointError` (after all of that) if the newest
    checkpoint or a last directory upload is not durable. Safe to call twice; the
    next use of the API starts afresh.
    """
    rt = process.end()
    join_writer_import()
    if rt is None:
        return
    problems = rt.finish()
    if problems:
        raise CheckpointError("; ".join(problems))


def sync(token: str) -> None:
    """Called by the agent (after a failed cell): wait for the checkpoint upload in
    progress, send every row logged so far, then ``token``; the agent waits for it
    before it records the failure."""
    rt = process.existing()
    if rt is not None:
        rt.sync(token)


def _finish_at_exit() -> None:
    try:
        finish()
    except CheckpointError as e:
        _logger.error("%s", e)


process.at_exit(_finish_at_exit)


def save_outputs(names: Iterable[str], user_ns: dict[str, Any] | None = None) -> None:
    """Called by the agent after the cell: cloudpickle the outputs to ``outputs.pkl``.

    Raises :class:`OutputError` naming the variable that is missing or cannot be
    pickled, and :class:`spotnb.ckpt.checkpoints.FencedOff` if the lease was lost.
    """
    import cloudpickle

    rt = _rt()
    ns = _user_ns() if user_ns is None else user_ns
    names = list(names)
    missing = [name for name in names if name not in ns]
    if missing:
        raise OutputError(
            f"output {missing[0]!r} is not defined when the cell ends: assign it in the "
            "cell, or remove it from the cell's outputs"
        )
    outputs = {name: ns[name] for name in names}
    try:
        data = cloudpickle.dumps(outputs)
    except Exception as whole:
        # Name the culprit: pickle the values one by one (only on this error path).
        for name, value in outputs.items():
            try:
                cloudpickle.dumps(value)
            except Exception as e:
                raise OutputError(
                    f"output {name!r} (a {type(value).__name__}) cannot be pickled: {e}. "
                    "Return something picklable instead (e.g. model.state_dict() rather "
                    "than an object holding files, locks or sockets), or remove it from "
                    "the cell's outputs"
                ) from e
        raise OutputError(f"the outputs cannot be pickled together: {whole}") from whole
    if not rt.fence():
        raise FencedOff("outputs were not written: this agent lost the job's lease")
    retrying(lambda: rt.store.put(layout.OUTPUTS, data), "writing the outputs")
