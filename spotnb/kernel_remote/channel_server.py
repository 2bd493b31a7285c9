"""The agent's end of the runtime channel (:mod:`spotnb.kernel_remote.channel`): a
Unix socket that every kernel's runtime connects to once.

:class:`ChannelServer` accepts the connections, reads each on its own thread and hands
every message to ``on_message`` (the agent's table of op to handler), and sends the
agent's messages to every runtime or answers one.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotnb.kernel_remote import channel

log = logging.getLogger(__name__)

#: A message from a runtime (decoded), and the connection to answer it on.
OnMessage = Callable[[dict[str, Any], socket.socket], None]


class ChannelServer:
    """The runtime channel's listener, connections and readers.

    ``on_connect(conn)``: called as a runtime connects, before its first message is
    read (the agent tells it of a pending notice).
    """

    def __init__(self, path: Path, on_message: OnMessage,
                 on_connect: Callable[[socket.socket], None]) -> None:
        self.path = path
        self._on_message = on_message
        self._on_connect = on_connect
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._done = threading.Event()

    def open(self) -> None:
        """Listen on :attr:`path` (before a kernel that connects to it is spawned)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen(4)
        self._listener = listener

    def serve(self) -> None:
        """Accept runtimes until :meth:`close` (the channel thread's loop)."""
        listener = self._listener
        assert listener is not None
        while not self._done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            self._on_connect(conn)
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            self._readers.append(reader)
            reader.start()

    def close(self) -> None:
        """Stop accepting (the attempt ended)."""
        self._done.set()
        if self._listener is not None:
            self._listener.close()

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            try:
                for line in lines:
                    try:
                        self._on_message(channel.decode(line), conn)
                    except Exception:
                        log.exception("bad message from the runtime: %r", line[:200])
            except OSError:
                pass
            finally:
                with self._lock:
                    if conn in self._conns:
                        self._conns.remove(conn)

    def send(self, msg: channel.Message) -> None:
        """Send to every runtime (one per kernel; a broken connection is dropped)."""
        data = channel.encode(msg)
        with self._lock:
            for conn in list(self._conns):
                try:
                    conn.sendall(data)
                except OSError:
                    self._conns.remove(conn)

    def reply(self, conn: socket.socket | None, msg: channel.Message) -> None:
        """Answer the runtime on ``conn`` (None: every runtime)."""
        if conn is None:
            self.send(msg)
            return
        with self._lock, contextlib.suppress(OSError):
            conn.sendall(channel.encode(msg))

    def drain(self, seconds: float) -> None:
        """Wait until every connection from the runtime is read to its end, at most
        ``seconds`` in all."""
        deadline = time.monotonic() + seconds
        for reader in list(self._readers):
            reader.join(max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                log.warning("the runtime's channel did not close within %gs; going on",
                            seconds)
                break
