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

**The kernel's status.** The kernel reports busy and idle around every request it
handles, a click on the subshell included; JupyterLab shows the last report as the
kernel's status, whichever request it was about (jupyterlab/jupyterlab#10701), so after
a click the status bar would say "Idle" while the cell still runs; and so after any
request on the control channel (JupyterLab asks for a subshell, the debugger's
requests), which the kernel answers at once while a cell runs. :class:`_StatusKeeper`
follows the main shell's request and, when another request ends while it runs (a
subshell's, or one on the control channel), reports busy again on its behalf: the
status bar stays "Busy" until the cell ends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotnb.protocol import layout

if TYPE_CHECKING:
    from spotnb.client.jobs import JobHandle

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


class _StatusKeeper:
    """Wraps a kernel's ``_publish_status`` (see the module docstring): while the main
    shell runs an ``execute_request``, a status idle about any other request (handled
    on a subshell, or nested on the main thread) is followed by a status busy with the
    running request as parent."""

    def __init__(self, kernel: Any) -> None:
        self._kernel = kernel
        self._publish = kernel._publish_status
        self._lock = threading.Lock()
        # Installed from a running cell: its request is the one in progress.
        parent = kernel.get_parent("shell") if _on_main_thread() else {}
        self.running: dict[str, Any] | None = parent if _msg_type(parent) == \
            "execute_request" else None
        #: The request on whose behalf busy was said when installed (once each).
        self.announced: str | None = None

    def __call__(self, status: str, channel: str, parent: Any = None) -> None:
        # One lock for every thread's reports: a busy on the cell's behalf never
        # follows the cell's own idle.
        with self._lock:
            self._publish(status, channel, parent)
            if channel != "shell":
                # A control request answered while the cell runs (a subshell created,
                # the debugger asked): its idle is not the cell's.
                if status == "idle" and self.running is not None:
                    self._publish("busy", "shell", self.running)
                return
            msg = parent or self._kernel.get_parent(channel)
            if _on_main_thread():
                if status == "busy" and _msg_type(msg) == "execute_request" and \
                        self.running is None:
                    self.running = msg
                    return
                if status == "idle" and _msg_id(msg) == _msg_id(self.running):
                    self.running = None
                    return
            # An idle about another request (a click on the subshell, or one the cell
            # handled nested on the main thread) while the cell runs: busy again.
            if status == "idle" and self.running is not None:
                self._publish("busy", channel, self.running)


def _on_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _msg_id(msg: Any) -> str | None:
    return ((msg or {}).get("header") or {}).get("msg_id")


def _msg_type(msg: Any) -> str | None:
    return ((msg or {}).get("header") or {}).get("msg_type")


def _keep_status(kernel: Any) -> None:
    """Install :class:`_StatusKeeper` on ``kernel`` (once). Installed from a running
    cell, it says busy once at once: a control request answered since the cell began
    (the subshell's creation) may have said idle."""
    keeper = getattr(kernel, "_publish_status", None)
    if not isinstance(keeper, _StatusKeeper):
        keeper = kernel._publish_status = _StatusKeeper(kernel)
    elif _on_main_thread():
        parent = kernel.get_parent("shell")
        if _msg_type(parent) == "execute_request" and keeper.running is None:
            keeper.running = parent
    with keeper._lock:
        running = keeper.running
        if running is not None and _msg_id(running) != keeper.announced:
            keeper.announced = _msg_id(running)
            keeper._publish("busy", "shell", running)


def serve_while_busy(widget: Any) -> bool:
    """Have the kernel handle ``widget``'s messages on a subshell thread, so its
    handlers run while a cell is busy (and the kernel's status stays busy meanwhile).
    Whether that is possible here."""
    kernel = _kernel()
    comm = getattr(widget, "comm", None)
    if kernel is None or comm is None:
        return False
    subshell_id = _subshell(kernel)
    if subshell_id is None:
        return False
    with _lock:
        _keep_status(kernel)
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
    from spotnb.train.tb import download_logs

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
