"""Widget clicks while the cell is busy, and TensorBoard for a job.

A ``%%spot_train`` cell blocks its kernel until the job ends: it follows the job. The
kernel handles a widget's messages (a button click) on the same thread, so the
dashboard's Stop, Detach and Interrupt-now buttons would only act once the job is over.
ipykernel 7 has *subshells*: threads with their own event loop that handle shell
messages concurrently with the main one, and it routes a comm's messages to the
subshell the comm names. :func:`serve_while_busy` creates one subshell per kernel
(lazily) and routes the given widget's messages to it, so its click handlers run
while the cell is busy. Handlers must then be quick and thread-safe (set a flag, start
a thread). Without subshells (ipykernel 6, a terminal) nothing changes: the buttons
act when the kernel is next idle, and the notebook's own stop button still detaches.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotnb import layout

if TYPE_CHECKING:
    from spotnb.jobs import JobHandle

__all__ = ["open_tensorboard", "serve_while_busy", "tensorboard_dir"]

log = logging.getLogger(__name__)

# Creating a subshell is a hop to the kernel's shell-channel thread and back.
_CREATE_TIMEOUT_SECONDS = 10.0
_lock = threading.Lock()
_subshells: dict[int, str | None] = {}  # id(kernel) -> subshell id (None: unsupported)


def _kernel() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return getattr(get_ipython(), "kernel", None)


def _subshell(kernel: Any) -> str | None:
    """This kernel's subshell for widget messages, created on first use."""
    with _lock:
        key = id(kernel)
        if key not in _subshells:
            _subshells[key] = _create_subshell(kernel)
        return _subshells[key]


def _create_subshell(kernel: Any) -> str | None:
    channel = getattr(kernel, "shell_channel_thread", None)
    if not getattr(kernel, "_supports_kernel_subshells", False) or channel is None:
        return None
    done: concurrent.futures.Future[str] = concurrent.futures.Future()

    def create() -> None:  # runs on the shell-channel thread, as the kernel requires
        try:
            done.set_result(channel.manager._create_subshell())
        except BaseException as err:
            done.set_exception(err)

    try:
        channel.io_loop.add_callback(create)
        subshell_id = done.result(timeout=_CREATE_TIMEOUT_SECONDS)
    except Exception:
        log.warning("could not create a kernel subshell for the dashboard's buttons; "
                    "they will act when the kernel is idle", exc_info=True)
        return None
    log.debug("widget messages of the dashboard go to subshell %s", subshell_id)
    return subshell_id


def serve_while_busy(widget: Any) -> bool:
    """Have the kernel handle ``widget``'s messages on a subshell thread, so its
    handlers run while a cell is busy. Whether that is possible here."""
    kernel = _kernel()
    comm = getattr(widget, "comm", None)
    if kernel is None or comm is None:
        return False
    subshell_id = _subshell(kernel)
    if subshell_id is None:
        return False
    # ipykernel asks the comm where to route each incoming message (BaseComm).
    comm._reply_subshell_for = lambda _data, _default: subshell_id
    return True


def tensorboard_dir(job_id: str) -> Path:
    """Where a job's TensorBoard logs are fetched to: ``$SPOTNB_HOME/tensorboard/JOB``."""
    return layout.home() / "tensorboard" / job_id


def open_tensorboard(handle: JobHandle) -> str:
    """Fetch the job's TensorBoard logs and show them with the ``%tensorboard`` magic.

    Returns a line saying what happened (no logs yet, or where they are).
    """
    from spotnb.tb import download_logs

    dest = tensorboard_dir(handle.job_id)
    found = download_logs(handle, dest)
    if not found:
        return (f"job {handle.job_id} has no TensorBoard logs yet: write them with "
                "writer = spot.tensorboard() in the cell; they are uploaded every 30s")
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        return f"TensorBoard logs of job {handle.job_id} are in {dest}"
    ip.run_line_magic("load_ext", "tensorboard")
    ip.run_line_magic("tensorboard", f"--logdir {dest}")
    return f"TensorBoard logs of job {handle.job_id} are in {dest}"
