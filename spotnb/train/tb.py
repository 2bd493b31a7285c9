"""TensorBoard for a job: event files written on the instance, opened in the notebook.

On the instance, :func:`tensorboard` (``spot.tensorboard()`` in a cell) returns a
``SummaryWriter`` whose directory is kept in the job's store like any
:func:`spotnb.train.process.sync_dir` (uploaded every ``every``, at once on an interruption
notice, and at the end; restored into the directory on a resume, so the curves of every
attempt stay together). In the notebook, :func:`download_logs` fetches the latest
snapshot of every synced directory that holds TensorBoard event files; the magic
``%spot_tensorboard JOB`` and the dashboard's TensorBoard button then run
``%tensorboard --logdir`` on it.
"""

from __future__ import annotations

import importlib
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.protocol import layout
from spotnb.train import process
from spotnb.train.syncdir import sync_name

if TYPE_CHECKING:
    from spotnb.protocol.store import Store

__all__ = ["TB_DIR", "TB_SYNC_NAME", "download_logs", "tensorboard"]

log = logging.getLogger(__name__)

#: Where :func:`tensorboard` writes by default, relative to the cell's working directory.
TB_DIR = "tensorboard"
#: The store name of that directory's snapshots (``sync/<name>``).
TB_SYNC_NAME = sync_name(TB_DIR)
# TensorBoard names its files events.out.tfevents.<time>.<host>...
_EVENT_FILE_MARK = "tfevents"


def tensorboard(logdir: str | os.PathLike[str] = TB_DIR, every: float | str = "30s",
                **writer_args: Any) -> Any:
    """A TensorBoard ``SummaryWriter`` writing to ``logdir``, kept in the job's store.

    ``every`` is how often the directory is uploaded when it changed (``"30s"``,
    ``"5m"``). Other keyword arguments go to ``SummaryWriter``. Needs
    ``torch.utils.tensorboard`` (PyTorch and the ``tensorboard`` package) or
    ``tensorboardX``. Example::

        writer = spot.tensorboard()
        writer.add_scalar("loss", loss, step)

    Open the curves in the notebook with ``%spot_tensorboard``.
    """
    writer_class: Any = None
    for module in ("torch.utils.tensorboard", "tensorboardX"):
        try:
            writer_class = importlib.import_module(module).SummaryWriter
            break
        except ImportError:
            continue
    if writer_class is None:
        raise ImportError(
            "spot.tensorboard() needs torch.utils.tensorboard (pip install torch "
            "tensorboard) or tensorboardX (pip install tensorboardX) on the instance")
    process.sync_dir(logdir, every=every)
    return writer_class(log_dir=os.fspath(logdir), **writer_args)


class _Job(Protocol):
    """What :func:`download_logs` reads of a job (a :class:`spotnb.JobHandle`)."""

    @property
    def job_id(self) -> str: ...

    @property
    def store(self) -> Store: ...


def download_logs(handle: _Job, dest: str | os.PathLike[str]) -> list[Path]:
    """Fetch the latest snapshot of each of the job's synced directories that holds
    TensorBoard event files into ``dest/<name>``; the directories written (maybe none).

    Each call replaces what an earlier call fetched, so a job still running can be
    looked at again later.
    """
    from spotnb.ckpt.checkpoints import CheckpointStore

    found = []
    for name in handle.store.list_children(layout.SYNC):
        snapshots = CheckpointStore(handle.store, f"{layout.SYNC}/{name}")
        manifest = snapshots.latest()
        if manifest is None or not any(_EVENT_FILE_MARK in f.name for f in manifest.files):
            continue
        target = Path(dest) / name
        stage = Path(dest) / f".{name}.download"
        shutil.rmtree(stage, ignore_errors=True)
        files = snapshots.download(manifest, stage)
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for key, path in files.items():
            # Snapshot files sit under files/ (see spotnb.train.syncdir.SyncDir).
            rel = key.split("/", 1)[1] if key.startswith("files/") else key
            (target / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(path, target / rel)
        shutil.rmtree(stage, ignore_errors=True)
        log.info("fetched TensorBoard logs of job %s (%s) into %s", handle.job_id, name, target)
        found.append(target)
    return found
