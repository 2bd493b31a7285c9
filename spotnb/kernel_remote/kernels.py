"""Kernel supervision: the agent's kernels, spawned, paused, resumed, interrupted and
killed.

A single-node job has one kernel (:attr:`KernelSupervisor.current`), spawned before the
lease is taken and again for a retry in place; a distributed job's kernels (one per
local worker, and those spawned ahead) are named and kept until forgotten. Every
kernel's environment holds what is the same for every attempt of the job (the channel's
variables: :mod:`spotnb.kernel_remote.channel`); the attempt's own settings reach it
with the bootstrap (:data:`BOOTSTRAP`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import queue
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from spotnb.ckpt import compile_cache
from spotnb.kernel_remote import channel
from spotnb.kernel_remote.kernel import KernelNotReady, KernelProcess
from spotnb.protocol import layout
from spotnb.protocol.secretstore import NOTIFY_SECRET
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import NotFound, Store

log = logging.getLogger(__name__)

KERNEL_READY_TIMEOUT = 120.0
#: The code that starts spotnb's runtime in a kernel, with the attempt's settings
#: (``env``: the channel's ``SPOTNB_ATTEMPT``, ``SPOTNB_INSTANCE_ID``, ...).
BOOTSTRAP = ("import spotnb.train.runtime as _spotnb_runtime; "
             "_spotnb_runtime._bootstrap(env={env!r})")
#: What a distributed job's kernels import as soon as they answer, before their round
#: forms (binding no name in the cell's namespace): the runtime a worker's bootstrap
#: starts, torch.distributed, which every distributed cell and the runtime's coordinated
#: saves use, and torch._dynamo, which DistributedDataParallel's constructor imports
#: (as FSDP and torch.compile do): 1 s on a quiet CPU, 2.5 s on a busy one
#: (:func:`import_ahead`).
NODE_PREIMPORT = ("__import__('torch.distributed'); __import__('torch._dynamo'); "
                  "__import__('spotnb.train.runtime')")
# How often a kernel importing ahead is checked for being alive while it imports.
_IMPORT_POLL_SECONDS = 0.5


def import_ahead(kernel: KernelProcess, code: str = NODE_PREIMPORT,
                 timeout: float = KERNEL_READY_TIMEOUT) -> threading.Thread:
    """Run ``code`` in ``kernel`` once it answers, on a thread of its own (started and
    returned), through a client of its own that it closes after.

    A distributed job's node starts its kernels before its own import of torchelastic
    and the rendezvous, and each imports torch ahead meanwhile: a round's workers then
    bootstrap and run the cell in a kernel that has it (seconds a round, on every node,
    after each re-formation too). A worker's bootstrap sent meanwhile waits its turn in
    the kernel. Whatever goes wrong here (the kernel killed by a re-formation, an
    import that fails) costs only the time it would have saved: the cell imports what
    it needs itself, and says so if it cannot.
    """
    def run() -> None:
        try:
            kc = kernel.connect(timeout=timeout, keep=False)
        except KernelNotReady:
            return  # killed before it answered; its round's worker says why, if it matters
        try:
            msg_id = kc.execute(code, silent=True, store_history=False, allow_stdin=False)
            deadline = time.monotonic() + timeout
            while kernel.alive and time.monotonic() < deadline:
                try:
                    reply = kc.get_shell_msg(timeout=_IMPORT_POLL_SECONDS)
                except queue.Empty:
                    continue
                if reply.get("parent_header", {}).get("msg_id") == msg_id:
                    if reply["content"].get("status") != "ok":
                        log.info("importing ahead failed in kernel %s: %s: %s",
                                 kernel.proc.pid, reply["content"].get("ename"),
                                 reply["content"].get("evalue"))
                    return
        except Exception:  # a kernel killed under the client
            log.debug("importing ahead in kernel %s ended early", kernel.proc.pid,
                      exc_info=True)
        finally:
            kc.stop_channels()

    thread = threading.Thread(target=run, name=f"import-ahead-{kernel.proc.pid}",
                              daemon=True)
    thread.start()
    return thread


def notice_seconds(provider: str) -> float:
    """The job's interruption notice period: the runtime judges its checkpoints by it."""
    from spotnb.providers import notice_seconds

    try:
        return notice_seconds(provider)
    except Exception:  # a bad local cloud setting: the group reports it, not the agent
        log.warning("cannot tell the notice period of provider %s; assuming EC2's",
                    provider, exc_info=True)
        from spotnb.ckpt.notice import EC2_NOTICE_SECONDS

        return EC2_NOTICE_SECONDS


class KernelSupervisor:
    """The kernels of one agent (module docstring).

    ``secrets``: the job's secrets, for the kernels' environment (set once read).
    """

    def __init__(self, job_uri: str, spec: JobSpec, socket_dir: Path, socket_path: Path,
                 scratch: Path) -> None:
        self.job_uri = job_uri
        self.spec = spec
        self.socket_dir = socket_dir
        self.socket_path = socket_path
        self.scratch = scratch
        self.secrets: dict[str, str] = {}
        #: A single-node job's kernel.
        self.current: KernelProcess | None = None
        # A distributed job's kernels (one per local worker, and those spawned ahead).
        self._named: list[KernelProcess] = []
        self._started = 0
        self._lock = threading.Lock()

    @property
    def workdir(self) -> Path:
        """The kernels' working directory (the job's shipped files)."""
        return Path(os.getcwd()) / "work"

    def spawn(self) -> None:
        """Start a kernel process if none is running; it boots while the agent goes on.

        Its environment holds what is the same for every attempt of the job; the
        attempt's own settings come with the bootstrap (:data:`BOOTSTRAP`).
        """
        if self.current is not None:
            return
        self.current = self.start(None)

    def start(self, name: str | None) -> KernelProcess:
        """Spawn a kernel process (see :meth:`spawn`); a distributed job's are named,
        and kept until :meth:`forget`."""
        self.workdir.mkdir(exist_ok=True)
        every = self.spec.policy.checkpoint_every
        env = dict(os.environ)
        # The job's own variables (submit's env); those without a value are passed to
        # the instance by the local cloud, from the user's environment.
        env.update({k: v for k, v in self.spec.env.items() if v is not None})
        # Its secrets; the webhook is the agent's alone.
        env.update({k: v for k, v in self.secrets.items() if k != NOTIFY_SECRET})
        env.update({
            channel.ENV_JOB_URI: self.job_uri,
            channel.ENV_JOB_ID: self.spec.job_id,
            channel.ENV_SOCKET: str(self.socket_path),
            channel.ENV_CHECKPOINT_EVERY: json.dumps(
                {"seconds": every.seconds, "steps": every.steps}),
            channel.ENV_KEEP_CHECKPOINTS: str(self.spec.policy.keep_checkpoints),
            channel.ENV_SCRATCH: str(self.scratch),
            channel.ENV_NOTICE_SECONDS: str(notice_seconds(self.spec.provider)),
            channel.ENV_PEER_TIMEOUT: str(self.spec.policy.peer_timeout),
            "PYTHONUNBUFFERED": "1",
            "SPOTNB_ORIGIN": "runtime",
        })
        # torch.compile's caches in directories the agent fills from the job's store
        # before the cell runs, and the runtime uploads after a save (compile_cache).
        env.update(compile_cache.cache_env(self.scratch, env))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self.workdir), env.get("PYTHONPATH", "")) if p)
        self._started += 1
        kernel = KernelProcess.start(socket_dir=self.socket_dir,
                                     name=f"k{self._started}{name or ''}",
                                     cwd=self.workdir, env=env)
        if name is not None:
            with self._lock:
                self._named.append(kernel)
        return kernel

    def forget(self, kernel: KernelProcess) -> None:
        """A distributed job's kernel that was killed."""
        with self._lock:
            if kernel in self._named:
                self._named.remove(kernel)

    def all(self) -> list[KernelProcess]:
        """Every kernel: the one of a single-node job, or a distributed job's workers."""
        with self._lock:
            kernels = list(self._named)
        kernel = self.current
        return [kernel, *kernels] if kernel is not None else kernels

    def connect(self, timeout: float = KERNEL_READY_TIMEOUT) -> Any:
        """The client of this attempt's kernel, once it answers. Raises KernelNotReady."""
        self.spawn()  # a retry in place needs a fresh kernel
        assert self.current is not None
        return self.current.connect(timeout=timeout)

    def unpack_workdir(self, store: Store) -> None:
        """The files shipped with the job (helper modules), into the kernel's cwd.

        The kernel may already be running: the bootstrap refreshes its import caches.
        """
        try:
            archive = store.get(layout.WORKDIR)
        except NotFound:
            return
        self.workdir.mkdir(exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            tar.extractall(self.workdir, filter="data")

    def shutdown(self) -> None:
        """Kill every kernel."""
        kernel, self.current = self.current, None
        if kernel is not None:
            kernel.kill()
        with self._lock:
            kernels, self._named = self._named, []
        for extra in kernels:
            extra.kill()

    def interrupt(self) -> None:
        """Interrupt the cell in every kernel (resumed first: a paused kernel cannot
        take the interrupt)."""
        for kernel in self.all():
            kernel.resume()
            kernel.interrupt()
