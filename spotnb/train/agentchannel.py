"""The runtime's end of the agent's Unix socket (the protocol:
:mod:`spotnb.kernel_remote.channel`), and when a kernel whose agent fell silent must stop
(:func:`watchdog_verdict`; the watchdog itself is :mod:`spotnb.train.watchdog`).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any

from spotnb.kernel_remote import channel

_logger = logging.getLogger(__name__)

# The agent listens before it starts the kernel; wait a little in case it is slow.
_CONNECT_SECONDS = 5.0
# The agent pings every second or so; this much silence means it is frozen (or gone:
# then PR_SET_PDEATHSIG has already killed this kernel). Well above any scheduling
# hiccup of a busy machine. Only while no ping has said until when the lease is held
# (before the agent holds it); otherwise that time bounds the kernel, whatever the TTL.
AGENT_SILENT_SECONDS = 15.0
# Past the lease's time, the kernel stops only once its agent has also been silent this
# long: while the agent speaks, it pauses the kernel itself (a store outage), and a ping
# already in the socket when a stopped kernel resumes carries the renewed time. Below
# the lease's smallest safety margin (1 s, at the smallest TTL of 3 s): a frozen agent's
# last renewal is at most a heartbeat old, so the lease's time comes at least a third of
# the TTL after its last ping, and another agent may take over only after the margin.
LEASE_GRACE_SECONDS = 0.5


class AgentChannel:
    """The runtime's end of the agent's Unix socket (protocol: kernel_remote.channel)."""

    def __init__(self, path: str, on_message: Any) -> None:
        self.path = path
        self._sock = self._connect(path)
        self._send_lock = threading.Lock()
        self._broken = False
        self._reader = threading.Thread(target=self._read, args=(on_message,),
                                        name="spotnb-channel", daemon=True)
        self._reader.start()

    @staticmethod
    def _connect(path: str) -> socket.socket:
        deadline = time.monotonic() + _CONNECT_SECONDS
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return sock
            except OSError:
                sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    @property
    def broken(self) -> bool:
        """Whether the connection is gone (nothing more can be sent)."""
        return self._broken

    def send(self, message: channel.Message) -> bool:
        """Send one message; False if the agent is gone (then nothing more is sent)."""
        data = channel.encode(message)
        with self._send_lock:
            if self._broken:
                return False
            try:
                self._sock.sendall(data)
            except OSError as e:
                self._broken = True
                _logger.warning("lost the connection to the spotnb agent (%s); metrics and "
                                "checkpoint reports are no longer recorded", e)
                return False
        return True

    def _read(self, on_message: Any) -> None:
        with self._sock.makefile("rb") as f:
            try:
                for line in f:
                    try:
                        message = channel.decode(line)
                    except ValueError:
                        _logger.warning("ignoring a malformed message from the agent: %r", line)
                        continue
                    try:
                        on_message(message)
                    except Exception:
                        _logger.exception("handling %s from the agent failed", message)
            except OSError:
                pass

    def close(self) -> None:
        with self._send_lock:
            self._broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=5)
        self._sock.close()


def watchdog_verdict(silent: float, until: float | None, now: float) -> str | None:
    """Why a kernel must stop now, or None: its agent has been silent for ``silent``
    seconds, and said its lease counts as held until ``until`` (None: it did not say);
    ``now`` on :func:`spotnb.protocol.lease.clock`.

    The lease's time comes before anyone else may take the job: the TTL less the
    holder's safety margin after its last confirmed renewal. So with any TTL, the kernel
    of a frozen agent stops before the next attempt holds the lease.
    """
    if until is not None and now >= until and silent >= LEASE_GRACE_SECONDS:
        return (f"the spotnb agent has not answered for {silent:.1f} s and its lease is "
                f"no longer confirmed (for {now - until:.1f} s)")
    if silent >= AGENT_SILENT_SECONDS:
        return f"the spotnb agent has not answered for {silent:.0f} s"
    return None
