"""The user's IPython kernel, started by the agent as a plain child process.

jupyter_client's ``KernelManager`` spends about 0.25 s before the kernel process even
exists (kernel-spec lookup, provisioner entry points, probing five TCP ports), and its
``wait_for_ready`` then idles 0.2 s flushing IOPub. On a replacement instance all of
that sits between the process start and the first training step, so the agent starts
``python -m ipykernel_launcher`` itself, as its first action, and connects a
``BlockingKernelClient`` over IPC sockets in a private directory (no TCP port is opened,
nothing is reachable from outside the instance).

What ``KernelManager`` gave and this keeps: the kernel leads its own session, so an
interrupt (SIGINT) and the final SIGKILL reach its children too (a ``!cmd``, data
loader workers); the exit status says why a kernel died. The kernel must never outlive
its agent (a kernel without an agent trains unsupervised and writes checkpoints that no
event records): it is started with ``PR_SET_PDEATHSIG`` = SIGKILL on Linux, so the
agent's death kills it at once, whatever killed the agent; ``JPY_PARENT_PID`` (which
ipykernel polls every few seconds) covers other systems. Linux delivers that signal
when the parent *thread* exits, not the parent process, so every kernel is spawned by
one thread that lives as long as the agent (:func:`_spawn`), whichever thread asks
(a distributed job's spare kernels are asked for by torchelastic's per-generation
thread, which ends when the generation does). The agent also pauses the
kernel (SIGSTOP to its process group) while it cannot confirm the job's lease, and the
runtime stops its own kernel when the agent stops answering (a frozen agent).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["KernelNotReady", "KernelProcess"]

# How long one kernel_info round may take before it is sent again. A reply also proves
# the shell channel; an IOPub message after it proves the subscription is live (ZMQ
# drops what a subscriber publishes before it has joined).
INFO_RETRY_SECONDS = 1.0
IOPUB_PROOF_SECONDS = 0.2

# The kernel's launcher: ask Linux to SIGKILL this process when its parent (the agent)
# dies, make sure the agent did not die before that, then run ipykernel_launcher in the
# same process (no second interpreter start). Standard library only, a few ms.
_LAUNCH = """\
import os, sys
agent = int(sys.argv[1])
if sys.platform.startswith("linux"):
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != agent:
    sys.exit("spotnb: the agent exited before its kernel started")
sys.argv = ["ipykernel_launcher", *sys.argv[2:]]
import runpy
runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
"""


class _Spawner:
    """One long-lived daemon thread that makes every kernel process.

    ``PR_SET_PDEATHSIG`` fires when the thread that forked the child exits; a kernel
    forked by a short-lived thread would be SIGKILLed with that thread. This thread
    ends only with the process, so a kernel dies with its agent and with nothing else.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: queue.SimpleQueue[
            tuple[Callable[[], Any], list[Any], threading.Event]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def run(self, make: Callable[[], Any]) -> Any:
        """``make()`` on the spawner thread; its value (or its exception raised here)."""
        with self._lock:
            if self._thread is None or self._pid != os.getpid() or \
                    not self._thread.is_alive():
                self._pid = os.getpid()  # a forked child needs a thread of its own
                self._requests = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._serve, args=(self._requests,),
                                                name="spotnb-kernel-spawner", daemon=True)
                self._thread.start()
            requests = self._requests
        box: list[Any] = []
        done = threading.Event()
        requests.put((make, box, done))
        done.wait()
        ok, value = box
        if not ok:
            raise value
        return value

    @staticmethod
    def _serve(requests: queue.SimpleQueue[
            tuple[Callable[[], Any], list[Any], threading.Event]]) -> None:
        while True:
            make, box, done = requests.get()
            try:
                box.extend((True, make()))
            except BaseException as e:  # handed to the caller
                box.extend((False, e))
            finally:
                done.set()


_spawner = _Spawner()


class KernelNotReady(RuntimeError):
    """The kernel died or did not answer in time while starting."""


class KernelProcess:
    """One IPython kernel process and the files it needs (connection file, sockets)."""

    def __init__(self, proc: subprocess.Popen[bytes], connection_file: Path) -> None:
        self.proc = proc
        self.connection_file = connection_file
        self._client: Any = None

    @classmethod
    def start(cls, *, socket_dir: Path, name: str, cwd: Path,
              env: dict[str, str]) -> KernelProcess:
        """Spawn ``python -m ipykernel_launcher`` on IPC sockets ``socket_dir/name-N``.

        Returns at once; :meth:`connect` waits for the kernel. ``socket_dir`` must be a
        short path (Unix socket paths are limited to ~107 bytes) only this user can read.
        """
        connection = {
            "transport": "ipc", "ip": str(socket_dir / name),
            "shell_port": 1, "iopub_port": 2, "stdin_port": 3, "control_port": 4,
            "hb_port": 5, "key": secrets.token_hex(32), "signature_scheme": "hmac-sha256",
            "kernel_name": "",
        }
        connection_file = socket_dir / f"{name}.json"
        fd = os.open(connection_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(connection, f)
        proc = _spawner.run(lambda: subprocess.Popen(
            [sys.executable, "-c", _LAUNCH, str(os.getpid()), "-f", str(connection_file)],
            cwd=cwd, env={**env, "JPY_PARENT_PID": str(os.getpid())},
            stdin=subprocess.DEVNULL, start_new_session=True))
        return cls(proc, connection_file)

    def connect(self, timeout: float, keep: bool = True) -> Any:
        """A started ``BlockingKernelClient`` once the kernel answers on shell and IOPub.

        ``keep``: the kernel's client, whose channels :meth:`kill` stops; else a passing
        one, whose channels its caller stops. Raises :class:`KernelNotReady` if the
        kernel exits or ``timeout`` passes first.
        """
        from jupyter_client.blocking import BlockingKernelClient

        kc = BlockingKernelClient(connection_file=str(self.connection_file))
        kc.load_connection_file()
        kc.start_channels()
        if keep:
            self._client = kc
        deadline = time.monotonic() + timeout
        try:
            while True:
                msg_id = kc.kernel_info()
                if self._await_info_reply(kc, msg_id, deadline):
                    try:
                        kc.get_iopub_msg(timeout=IOPUB_PROOF_SECONDS)
                    except queue.Empty:
                        pass  # not subscribed yet: ask again
                    else:
                        return kc
                if time.monotonic() > deadline:
                    raise KernelNotReady(
                        f"the kernel did not answer within {timeout:.0f} s")
        except BaseException:
            if not keep:
                kc.stop_channels()
            raise

    def _await_info_reply(self, kc: Any, msg_id: str, deadline: float) -> bool:
        until = min(deadline, time.monotonic() + INFO_RETRY_SECONDS)
        while time.monotonic() < until:
            if not self.alive:
                raise KernelNotReady(self.exit_reason())
            try:
                reply = kc.get_shell_msg(timeout=0.05)
            except queue.Empty:
                continue
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return True
        return False

    @property
    def alive(self) -> bool:
        """Whether the kernel process is still running."""
        return self.proc.poll() is None

    def exit_reason(self) -> str:
        """Why the kernel is gone, for a person (or that it stopped responding)."""
        code = self.proc.poll()
        if code is None:
            return "the kernel stopped responding"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else ""
            hint = " (out of memory?)" if -code == signal.SIGKILL else ""
            return f"the kernel died: killed by signal {-code} {name}{hint}".strip()
        return f"the kernel died: exit code {code}"

    def pause(self) -> None:
        """SIGSTOP the kernel's process group: nothing in it runs until :meth:`resume`."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the kernel's process group (harmless if it runs)."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    @property
    def stopped(self) -> bool:
        """Whether the kernel process is stopped (paused by the agent, or by itself
        when its agent stopped answering)."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (OSError, IndexError):
            return False

    def interrupt(self) -> None:
        """SIGINT to the kernel's process group: a KeyboardInterrupt in the running cell."""
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL the kernel and everything it started; remove its files."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.stop_channels()
            self._client = None
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)  # reap it: the agent is its parent
        prefix = self.connection_file.with_suffix("")
        for path in (self.connection_file,
                     *(prefix.with_name(f"{prefix.name}-{n}") for n in range(1, 6))):
            path.unlink(missing_ok=True)
