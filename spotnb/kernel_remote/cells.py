"""Running code in a kernel and relaying what it prints and shows as events.

:class:`CellRunner` executes the cell (and the bootstrap, the outputs' save, the
runtime's finish) in a kernel, relays its stream, display and error outputs to the
attempt's log, and keeps the runtime's output marks (:data:`channel.OUTPUT_MARK`: a
checkpoint's question for the unlogged events waits for its mark) and sync marks (the
``mark`` op: every row logged before it has been sent).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from spotnb.kernel_remote import channel
from spotnb.kernel_remote.kernel import KernelProcess
from spotnb.kernel_remote.kernels import KernelSupervisor
from spotnb.kernel_remote.leasing import Fenced, LeaseKeeper
from spotnb.protocol.events import EventWriter

# After the cell, the runtime's last rows may still be in the socket: read them all,
# waiting at most this long for the runtime's side to close.
CHANNEL_DRAIN_SECONDS = 60.0


class CellRunner:
    """Executes code in the agent's kernels, relaying the outputs (module docstring).

    ``events``: the attempt's log (None before it); ``parked``: the final checkpoint is
    durable (the kernel is held, the lease released); ``stopping``: whether a stop was
    requested (the cell is interrupted); ``drain``: reads the channel to its end.
    """

    def __init__(self, kernels: KernelSupervisor, lease: LeaseKeeper,
                 events: Callable[[], EventWriter | None], parked: threading.Event,
                 stopping: Callable[[], bool], drain: Callable[[], None]) -> None:
        self.kernels = kernels
        self.lease = lease
        self._events = events
        self._parked = parked
        self._stopping = stopping
        self._drain = drain
        self._marks_waiting: dict[str, threading.Event] = {}
        # The runtime's marks seen on the kernels' output (channel.OUTPUT_MARK), newest
        # last: a checkpoint's question for the unlogged events waits for its mark.
        self._output_marks: collections.deque[str] = collections.deque(maxlen=64)
        self._output_seen = threading.Condition()

    def execute(self, kc: Any, code: str, silent: bool, kernel: KernelProcess | None = None,
                rank: int | None = None, sent: str | None = None) -> dict[str, Any] | None:
        """Run ``code`` in the kernel (this attempt's, or ``kernel``: a distributed
        job's worker of global rank ``rank``, whose outputs carry it), relaying its
        outputs; the error or None. ``sent``: the id of an execution sent already (a
        standby's cell): relay that one instead, from its first output."""
        ev = self._events()
        assert ev is not None
        tag = {} if rank is None else {"rank": rank}
        msg_id = sent or kc.execute(code, silent=silent, store_history=not silent,
                                    allow_stdin=False)
        while True:
            if not self._parked.is_set():
                self.lease.check()
            try:
                msg = kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                running = kernel if kernel is not None else self.kernels.current
                if running is not None and not running.alive:
                    reason = running.exit_reason()
                    return {"ename": "KernelDied", "evalue": reason, "traceback": [reason]}
                if self._stopping():
                    self.kernels.interrupt()
                continue
            except Exception:
                # The kernel's sockets were closed under us: the instance is going, or
                # another agent took the job.
                if self.lease.terminating.is_set() or self.lease.fenced.is_set():
                    raise Fenced() from None
                raise
            kind = msg["header"]["msg_type"]
            if kind == channel.OUTPUT_MARK:
                # Everything the kernel printed before it is relayed: a checkpoint's
                # question for the unlogged events may be answered (wait_for_output).
                with self._output_seen:
                    self._output_marks.append(str(msg["content"].get("token")))
                    self._output_seen.notify_all()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return self._reply_error(kc, msg_id)
            if kind == "stream":
                ev.emit("stream", name=content["name"], text=content["text"], **tag)
            elif kind in ("display_data", "execute_result", "update_display_data"):
                ev.emit("display", kind=kind, data=content.get("data", {}),
                        metadata=content.get("metadata", {}),
                        display_id=(content.get("transient") or {}).get("display_id"), **tag)
            elif kind == "clear_output":
                ev.emit("display", kind="clear_output", data={}, metadata={},
                        display_id=None, wait=content.get("wait", False), **tag)

    def _reply_error(self, kc: Any, msg_id: str) -> dict[str, Any] | None:
        """The error of an execution from its ``execute_reply`` (silent runs included)."""
        return reply_error(kc, msg_id, 30.0)

    def wait_for_output(self, mark: str, seconds: float) -> bool:
        """Wait until the runtime's output mark ``mark`` was relayed; False if it did
        not come within ``seconds``."""
        with self._output_seen:
            return self._output_seen.wait_for(lambda: mark in self._output_marks, seconds)

    def saw_mark(self, token: str) -> None:
        """The runtime's ``mark``: the rows it logged before are sent."""
        waiting = self._marks_waiting.get(token)
        if waiting is not None:
            waiting.set()

    def sync_runtime(self, kc: Any, kernel: KernelProcess | None = None) -> None:
        """Have the runtime send every row logged so far, and wait until they are read
        (the cell failed: its last rows may not have been sent yet)."""
        kernel = kernel if kernel is not None else self.kernels.current
        if kc is None or kernel is None or not kernel.alive:  # no kernel client to ask
            if kernel is self.kernels.current:
                self._drain()
            return
        marker = f"sync-{time.monotonic_ns()}"
        seen = threading.Event()
        self._marks_waiting[marker] = seen
        try:
            if self.execute(kc, f"_spotnb_runtime._sync({marker!r})", silent=True,
                            kernel=kernel) is None:
                seen.wait(CHANNEL_DRAIN_SECONDS)
        finally:
            self._marks_waiting.pop(marker, None)


def reply_error(kc: Any, msg_id: str, seconds: float) -> dict[str, Any] | None:
    """The error of execution ``msg_id`` from its ``execute_reply`` on ``kc``'s shell
    channel, waited for up to ``seconds``: None if it ran, ``KernelTimeout`` if no
    reply came."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            reply = kc.get_shell_msg(timeout=1)
        except queue.Empty:
            continue
        if reply.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        content = reply["content"]
        if content.get("status") == "ok":
            return None
        return {"ename": content.get("ename", "Error"),
                "evalue": content.get("evalue", ""),
                "traceback": content.get("traceback", [])}
    return {"ename": "KernelTimeout", "evalue": "the kernel did not reply", "traceback": []}
