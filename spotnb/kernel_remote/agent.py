"""The agent: runs one job's cell on an instance, in a real IPython kernel.

Started on every instance (local cloud process or EC2 spot instance) as
``python -m spotnb.kernel_remote --job <store-uri>``. It needs only the store and the
instance-metadata endpoint: no inbound network, no SSH.

An attempt, narrated::

    Step 1  read spec.json; if the job already has a result, exit.
    Step 2  spawn the kernel now: it boots while the rest of the start-up happens.
    Step 3  take the lease (wait while a live agent holds it; take over at once from
            a holder whose process or instance is gone); attempt = lease epoch.
    Step 4  prefetch the latest checkpoint while the kernel finishes booting and the
            cell's imports run; bootstrap the runtime in the kernel (attempt, inputs,
            `spot`), run the cell, relay stream/display/error outputs as events.
    Step 5  completed -> save outputs, wait for uploads, read every row the runtime
            sent, write result.json.
            user error -> retry in place under a new epoch if the policy allows,
            else write a failed result.
    Step 6  release the lease, stop the kernel, exit. The capacity group sees the
            result and deletes itself (DESIGN invariant 6).

Alongside, two loops run. The *instance loop* (every :data:`IMDS_POLL_SECONDS`, no
remote call but IMDS) watches IMDS for ``spot/instance-action`` and the rebalance
recommendation (the runtime is told and saves at once; once that save is durable the
agent releases the lease so the replacement can start), pings the runtime (a kernel
whose agent stops answering stops itself), tells the runtime which metric rows are
durable in the log, and keeps the kernel running only while the lease is confirmed:
an unconfirmed lease (a frozen agent, a store out of reach) pauses it, a lost one
kills it. The *store loop* renews the lease every :func:`lease.heartbeat_seconds` and
looks for a stop request; store errors there are retried with backoff, never fatal.
``SPOTNB_LEASE_TTL`` sets the lease's TTL (default :data:`lease.TTL_SECONDS`).

Fencing (invariant 3): every write of this agent (events, errors, the result) happens
only while :meth:`lease.HeldLease.status` is HELD; the runtime's checkpoint commits ask
the agent the same question over the channel.

A distributed job (several nodes, or several processes per node): the agent takes the
lease of a free node slot (Step 3), and Step 4-5 are :class:`spotnb.multinode.node.
NodeRun`'s: torchelastic's rendezvous with the other nodes, one kernel per local worker
(each with its own channel connection), re-formed as nodes come and go.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import io
import json
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import psutil

from spotnb import layout, lease, usage
from spotnb.backoff import Backoff
from spotnb.events import (
    EVENTS_PREFIX,
    Event,
    EventWriter,
    codec,
    metric_rows,
    metrics_data,
    parse_chunk,
    stream_name,
)
from spotnb.events.live import CONTROL_QUEUE, LiveSender
from spotnb.events.queues import queue_for
from spotnb.events.writer import StreamObject, read_object
from spotnb.kernel_remote import channel
from spotnb.kernel_remote.imds import ImdsClient
from spotnb.kernel_remote.kernel import KernelNotReady, KernelProcess
from spotnb.kernel_remote.sampler import Sampler
from spotnb.lease import Standing
from spotnb.notify import Notifier
from spotnb.secretstore import NOTIFY_SECRET, SecretsUnavailable
from spotnb.spec import JobSpec
from spotnb.store import (
    NotFound,
    Store,
    StoreError,
    StoreUnavailable,
    open_store,
    outage_limit,
    retrying,
    transient,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often the instance loop looks at IMDS, pings the runtime and checks the lease's
# standing. IMDS is on the instance: free. EC2 gives two minutes of notice; half a
# second leaves the runtime the most time.
IMDS_POLL_SECONDS = 0.5
# How often the store loop reads control/stop.json (a GET: 60/h = $0.000024/h). A stop
# also arrives at once as a message on the job's control queue; the object is the
# record, read here in case the message was lost. A distributed job's agents also look
# for a result another node wrote (one more request each time).
STOP_POLL_SECONDS = 60.0
# Metric rows become one `metrics` event this often (or at the live channel's pace, if
# faster), or at once when this many have gathered.
ROWS_SECONDS = 1.0
ROWS_PER_EVENT = 5000
# GPU/CPU samples are kept one in this many seconds while nobody watches.
SYS_IDLE_SECONDS = 10.0
# How often the agent reports the requests it made (a `usage` event; the cost a job
# shows includes them).
USAGE_SECONDS = 300.0
KERNEL_READY_TIMEOUT = 120.0
# EC2 gives processes a moment between SIGTERM and power-off; use well under it.
TERMINATION_GRACE_SECONDS = 0.8
# After the cell, the runtime's last rows may still be in the socket: read them all,
# waiting at most this long for the runtime's side to close.
CHANNEL_DRAIN_SECONDS = 60.0
#: While it waits for a lease (a node slot), an agent asks the provider whether a
#: holder's instance is gone (on AWS one DescribeInstances: free, but rate-limited) at
#: most this often per holder. A replacement that boots while its predecessor is in its
#: two-minute notice period asks 24 times, not 240 (the wait loop runs every 0.5 s), and
#: a multi-node job's replacement, which finds every slot held, as often per slot; a
#: holder that is gone is found within this (its lease is usually released before).
HOLDER_GONE_RECHECK_SECONDS = 5.0
# A failing store is retried with backoff (spotnb.store.retrying); the lease's
# heartbeat backs off from STORE_RETRY_SECONDS up to STORE_MAX_RETRY_SECONDS. After
# spotnb.store.outage_limit() without a success the attempt gives up (exit code
# EXIT_STORE: the group backs off before it starts another instance).
STORE_RETRY_SECONDS = 0.5
STORE_MAX_RETRY_SECONDS = 30.0
# Exit codes: the capacity group only cares whether a result exists, and whether the
# store was out of reach (then launching another instance at once would not help).
# A checkpoint carries the events of these types that the log has not confirmed (the
# cell's output, earlier saves, rows an earlier replay recorded...), so a later attempt
# records what this agent dies with (DESIGN invariant 8). Metric batches are carried
# by the runtime itself (its rows); GPU samples and statuses are not worth it.
CARRIED_TYPES = frozenset({"stream", "checkpoint", "metric", "params", "progress", "warning"})
# How long a checkpoint's question for those events waits for the runtime's mark on the
# kernel's output channel (everything printed before the save has arrived by then).
OUTPUT_MARK_SECONDS = 5.0

EXIT_OK = 0
EXIT_FENCED = 3
EXIT_STORE = 4

_BOOTSTRAP = "import spotnb.runtime as _spotnb_runtime; _spotnb_runtime._bootstrap(env={env!r})"


class Fenced(Exception):
    """This agent lost the lease, or its instance is being terminated: stop without
    writing anything more (the job is another agent's now)."""


class Agent:
    """Runs one attempt (or several, when user-code errors are retried in place)."""

    def __init__(self, job_uri: str, imds: ImdsClient | None = None) -> None:
        self.job_uri = job_uri
        self.store: Store = open_store(job_uri)
        self.imds = imds or ImdsClient()
        self.spec: JobSpec = JobSpec.from_json(
            _retry_store(lambda: self.store.get(layout.SPEC), "reading the spec"))
        # Notifications (spotnb.notify): a no-op until the job's secrets name a webhook
        # (_read_secrets, at the start of run).
        self.notifier = Notifier(None, self.spec.job_id, self.spec.name,
                                 max_nodes=self.spec.resources.max_nodes)
        # The job's secrets (spotnb.secretstore): for the kernels' environment; why they
        # could not be read, if so (the attempt then fails saying it).
        self._secrets: dict[str, str] = {}
        self._secrets_error: str | None = None
        self.identity: dict[str, Any] = {}
        self.held: lease.HeldLease | None = None
        self.events: EventWriter | None = None
        self.notice: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None
        self.parked = threading.Event()
        self.stop_requested: dict[str, Any] | None = None
        self.fenced = threading.Event()
        self.terminating = threading.Event()
        self._done = threading.Event()
        self._conns: list[socket.socket] = []
        self._conn_lock = threading.Lock()
        self._readers: list[threading.Thread] = []
        self._kernel: KernelProcess | None = None
        # A distributed job's kernels (one per local worker, and those spawned ahead).
        self._kernels: list[KernelProcess] = []
        self._kernels_started = 0
        self.node: Any = None  # spotnb.multinode.node.NodeRun, in a distributed job
        self._paused_since: float | None = None
        # (events emitted once a metric batch was queued, its newest row's time): once
        # the writer has written that many events, the runtime may forget those rows.
        self._metric_marks: collections.deque[tuple[int, float]] = collections.deque()
        self._marks_lock = threading.Lock()
        self._marks_waiting: dict[str, threading.Event] = {}
        # The runtime's marks seen on the kernels' output (channel.OUTPUT_MARK), newest
        # last: a checkpoint's question for the unlogged events waits for its mark.
        self._output_marks: collections.deque[str] = collections.deque(maxlen=64)
        self._output_seen = threading.Condition()
        # Metric rows from the runtime, not yet an event (see _emit_rows).
        self._rows: list[list[Any]] = []
        self._rows_at = time.monotonic()
        self._rows_lock = threading.Lock()
        self._sampled_at = -SYS_IDLE_SECONDS
        self._scratch = Path(tempfile.mkdtemp(prefix="spotnb-agent-", dir=os.getcwd()))
        # The runtime's channel and the kernel's sockets. Unix socket paths are
        # limited to ~107 bytes: keep it short, in /tmp. On the local cloud the
        # instance's first process made it, and removes it however this agent ends
        # (spotnb.providers.local.reaper).
        given = os.environ.get("SPOTNB_AGENT_SOCKET_DIR")
        self._socket_dir = Path(given) if given and os.path.isdir(given) else \
            Path(tempfile.mkdtemp(prefix="spotnb-"))
        self._socket_path = self._socket_dir / "agent.sock"
        self._listener: socket.socket | None = None
        self.live: LiveSender | None = None

    # -- the attempt -----------------------------------------------------------------

    def run(self) -> int:
        """Run the job until it ends or this instance goes away; the exit code."""
        _become_subreaper()
        try:
            if _retry_store(lambda: self.store.exists(layout.RESULT), "reading the result"):
                log.info("job %s already has a result; nothing to do", self.spec.job_id)
                return EXIT_OK
            # Step 1b: the job's secrets, before a kernel is spawned (its environment).
            self._read_secrets()
            # Step 2: the kernel boots (~0.5 s) while the identity and lease are read.
            # (A distributed job's kernels are spawned by its NodeRun.)
            self._listener = self._open_listener()
            if not self.spec.resources.distributed:
                self._spawn_kernel()
            self.identity = self._identity()
            # Step 3: the lease. A live holder means another agent works on the job.
            self.held = self._take_lease(self.identity["instance_id"])
            if self.held is None:
                return EXIT_OK
            signal.signal(signal.SIGTERM, self._on_sigterm)
            return self._run_attempts()
        except Fenced:
            log.warning("stopping without writing: %s", "the instance is being terminated"
                        if self.terminating.is_set() else "lost the lease")
            return EXIT_FENCED
        except StoreUnavailable as err:
            log.error("giving up: %s", err)
            return EXIT_STORE
        finally:
            self._done.set()
            self.notifier.close()  # bounded: the last message's send, at most
            if self.live is not None:
                self.live.stop()
            self._shutdown_kernel()
            if self._listener is not None:
                self._listener.close()
            _sweep_descendants()
            shutil.rmtree(self._scratch, ignore_errors=True)
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _read_secrets(self) -> None:
        """The job's secrets from the provider's secret store (spotnb.secretstore);
        the webhook among them starts the notifier. A failure is kept, not raised: the
        attempt fails with it once it holds the lease (its message names, never quotes)."""
        if not self.spec.secrets:
            return
        from spotnb.providers import get_provider

        try:
            self._secrets = get_provider(self.spec.provider).read_secrets(self.spec)
        except Exception as err:
            # str() of a SecretsUnavailable names the secrets; of anything else only its
            # type is kept (a library's message might quote what it was given).
            why = str(err) if isinstance(err, SecretsUnavailable) else type(err).__name__
            self._secrets_error = f"the job's secrets could not be read: {why}"
            log.error("%s", self._secrets_error)
            return
        url = self._secrets.get(NOTIFY_SECRET)
        if url:
            self.notifier = Notifier(url, self.spec.job_id, self.spec.name,
                                     max_nodes=self.spec.resources.max_nodes)

    def _run_attempts(self) -> int:
        assert self.held is not None and self._listener is not None
        try:
            control = queue_for(self.store, self.spec.job_id, CONTROL_QUEUE)
            control.create()
            self.live = LiveSender(control, self._on_stop_message, self.store,
                                   before_send=self._emit_rows).start()
        except Exception as err:
            log.warning("no live channel (%s): followers read the log", err)
        threads = [
            threading.Thread(target=self._instance_loop, name="instance", daemon=True),
            threading.Thread(target=self._store_loop, name="store", daemon=True),
            threading.Thread(target=self._serve_channel, args=(self._listener,),
                             name="channel", daemon=True),
        ]
        for t in threads:
            t.start()
        if self.spec.resources.distributed:
            self._node_attempt()
            return EXIT_OK
        while True:
            outcome = self._one_attempt()
            if outcome != "retry":
                break
            # A user-code error the policy allows to retry: new kernel, new epoch.
            self._close_events()
            self._renew_or_fence(self.held.bump)
        return EXIT_OK

    def _one_attempt(self) -> str:
        assert self.held is not None
        attempt = self.held.epoch
        held = self.held
        self.events = EventWriter(self.store, attempt, self.identity["instance_id"],
                                  may_write=held.status)
        ev = self.events
        if self.live is not None:
            self.live.attach(ev)
        ev.emit("status", state="booting", detail=f"attempt {attempt} on {self._where()}",
                instance_type=self.identity.get("instance_type"),
                az=self.identity.get("az_id") or self.identity.get("az"),
                region=self.identity.get("region"), pid=os.getpid(),
                process_started=_process_started())
        ev.flush_soon()
        self.notifier.where = self._where()
        if self._secrets_error is not None:
            return self._finish("failed", self._secrets_error)
        sampler = Sampler(self._on_sample)
        sampler.start()
        try:
            # Step 4: the checkpoint downloads while the kernel finishes booting and
            # the cell's imports run; restore() waits for the download to finish.
            restore_dir = self._scratch / f"restore-{attempt}"
            restore_dir.mkdir(parents=True, exist_ok=True)
            prefetch = threading.Thread(target=self._prefetch, args=(restore_dir,), daemon=True)
            prefetch.start()
            self._retry(self._unpack_workdir, "reading the job's files")
            try:
                kc = self._connect_kernel()
            except KernelNotReady as e:
                # Killed while it started (out of memory in an import, say): an error
                # like one in the cell, retried as far as the job's policy allows.
                return self._on_user_error(None, {
                    "ename": "KernelDied", "evalue": f"the kernel could not start: {e}",
                    "traceback": [str(e)]})
            self._check_fence()
            # The attempt's own settings reach the kernel with the bootstrap: the
            # kernel was spawned before the lease said which attempt this is.
            boot_error = self._execute(kc, _BOOTSTRAP.format(env={
                channel.ENV_ATTEMPT: str(attempt),
                channel.ENV_INSTANCE_ID: self.identity["instance_id"],
                channel.ENV_RESTORE_DIR: str(restore_dir),
            }), silent=True)
            if self.stop_requested:
                return self._finish("stopped", self._stop_reason())
            if boot_error:
                return self._finish("failed", "the runtime could not start in the kernel",
                                    error=boot_error)
            ev.emit("status", state="running", detail="running the cell")
            ev.flush_soon()
            error = self._execute(kc, self.spec.code, silent=False)
            self._check_fence()
            if self.stop_requested:
                return self._finish("stopped", self._stop_reason())
            if error:
                return self._on_user_error(kc, error)
            # Step 5: outputs, then wait for uploads (the runtime's _finish).
            if self.spec.outputs:
                out_error = self._execute(
                    kc, f"_spotnb_runtime._save_outputs({list(self.spec.outputs)!r})",
                    silent=True)
                if out_error:
                    return self._finish("failed", "could not save the outputs",
                                        error=out_error)
            fin_error = self._execute(kc, "_spotnb_runtime._finish()", silent=True)
            if fin_error:
                return self._finish("failed", "uploading the last checkpoint failed",
                                    error=fin_error)
            # The runtime closed its end: read what is still in the socket.
            self._drain_channel()
            return self._finish("completed", "the cell finished")
        finally:
            sampler.stop()

    def _node_attempt(self) -> str:
        """A distributed job's attempt on this node: the NodeRun's (module docstring)."""
        from spotnb.multinode.node import NodeRun

        assert self.held is not None
        self.events = EventWriter(self.store, self.held.epoch, self.identity["instance_id"],
                                  may_write=self.held.status)
        if self.live is not None:
            self.live.attach(self.events)
        res = self.spec.resources
        self.events.emit("status", state="booting",
                         detail=f"attempt {self.held.epoch} on {self._where()}, node slot "
                                f"{self.held.lease.slot} of {res.max_nodes}",
                         instance_type=self.identity.get("instance_type"),
                         az=self.identity.get("az_id") or self.identity.get("az"),
                         region=self.identity.get("region"), pid=os.getpid(),
                         process_started=_process_started(), slot=self.held.lease.slot)
        self.events.flush_soon()
        if self._secrets_error is not None:
            return self._finish("failed", self._secrets_error)
        sampler = Sampler(self._on_sample)
        sampler.start()
        try:
            self._retry(self._unpack_workdir, "reading the job's files")
            self.node = NodeRun(self, KERNEL_READY_TIMEOUT)
            return str(self.node.run())
        finally:
            sampler.stop()

    def _close_quietly(self) -> None:
        """End this attempt without a result of its own: the events, then the lease."""
        if self.events is not None and not self.fenced.is_set():
            self._close_events()
        if self.held is not None:
            self.held.release()

    def _on_user_error(self, kc: Any | None, error: dict[str, Any]) -> str:
        self._check_fence()
        # The rows the cell logged before it failed are still on their way.
        self._sync_runtime(kc)
        self._check_fence()
        errors_so_far = len(self._retry(lambda: self.store.list_keys("errors/"),
                                        "counting earlier errors"))
        retrying = errors_so_far < self.spec.policy.max_restarts_on_error
        assert self.held is not None
        key = f"errors/{self.held.epoch:06d}.json"
        self._write(lambda: self.store.put(key, json.dumps(error).encode()), "the error")
        assert self.events is not None
        if retrying:
            self.events.emit("error", retrying=True, **error)
            self.events.emit("status", state="booting",
                             detail=f"retrying after {error['ename']} "
                                    f"({errors_so_far + 1} of "
                                    f"{self.spec.policy.max_restarts_on_error})")
            self._report_usage()
            self._shutdown_kernel()
            self._drain_channel()
            return "retry"
        return self._finish("failed", f"{error['ename']}: {error['evalue']}", error=error)

    def _finish(self, status: str, reason: str, error: dict[str, Any] | None = None) -> str:
        """Step 5-6: write the result (once, only while holding the lease)."""
        assert self.held is not None and self.events is not None
        self._check_fence()
        self._renew_or_fence(self.held.renew)
        result = {"status": status, "reason": reason, "attempt": self.held.epoch,
                  "instance_id": self.identity["instance_id"], "time": time.time(),
                  "error": error, "outputs": list(self.spec.outputs)}
        written = self._write(
            lambda: self.store.put_if_absent(layout.RESULT, json.dumps(result).encode()),
            "the result")
        if written is None:
            log.warning("a result already exists; leaving it as it is")
        self._emit_rows()
        if error is not None:
            self.events.emit("error", retrying=False, **error)
        self._report_usage()
        self.events.emit("result", status=status, reason=reason)
        self.events.emit("status", state=status, detail=reason)
        if self.live is not None:
            self.live.send_now()
            self.live.attach(None)
        self._close_events()
        self.held.release()
        self.notifier.ended(status, reason, self.held.epoch)
        return status

    # -- kernel ----------------------------------------------------------------------

    @property
    def _workdir(self) -> Path:
        return Path(os.getcwd()) / "work"

    def _spawn_kernel(self) -> None:
        """Start a kernel process if none is running; it boots while the agent goes on.

        Its environment holds what is the same for every attempt of the job; the
        attempt's own settings come with the bootstrap (:data:`_BOOTSTRAP`).
        """
        if self._kernel is not None:
            return
        self._kernel = self._start_kernel(None)

    def _start_kernel(self, name: str | None) -> KernelProcess:
        """Spawn a kernel process (see :meth:`_spawn_kernel`); a distributed job's are
        named and kept in ``_kernels`` until :meth:`_forget_kernel`."""
        self._workdir.mkdir(exist_ok=True)
        every = self.spec.policy.checkpoint_every
        env = dict(os.environ)
        # The job's own variables (submit's env); those without a value are passed to
        # the instance by the local cloud, from the user's environment.
        env.update({k: v for k, v in self.spec.env.items() if v is not None})
        # Its secrets; the webhook is the agent's alone.
        env.update({k: v for k, v in self._secrets.items() if k != NOTIFY_SECRET})
        env.update({
            channel.ENV_JOB_URI: self.job_uri,
            channel.ENV_JOB_ID: self.spec.job_id,
            channel.ENV_SOCKET: str(self._socket_path),
            channel.ENV_CHECKPOINT_EVERY: json.dumps(
                {"seconds": every.seconds, "steps": every.steps}),
            channel.ENV_KEEP_CHECKPOINTS: str(self.spec.policy.keep_checkpoints),
            channel.ENV_SCRATCH: str(self._scratch),
            channel.ENV_NOTICE_SECONDS: str(_notice_seconds(self.spec.provider)),
            channel.ENV_PEER_TIMEOUT: str(self.spec.policy.peer_timeout),
            "PYTHONUNBUFFERED": "1",
            "SPOTNB_ORIGIN": "runtime",
        })
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self._workdir), env.get("PYTHONPATH", "")) if p)
        self._kernels_started += 1
        kernel = KernelProcess.start(socket_dir=self._socket_dir,
                                     name=f"k{self._kernels_started}{name or ''}",
                                     cwd=self._workdir, env=env)
        if name is not None:
            with self._conn_lock:
                self._kernels.append(kernel)
        return kernel

    def _forget_kernel(self, kernel: KernelProcess) -> None:
        """A distributed job's kernel that was killed."""
        with self._conn_lock:
            if kernel in self._kernels:
                self._kernels.remove(kernel)

    def _all_kernels(self) -> list[KernelProcess]:
        """Every kernel of this agent: the one of a single-node job, or a distributed
        job's workers."""
        with self._conn_lock:
            kernels = list(self._kernels)
        kernel = self._kernel
        return [kernel, *kernels] if kernel is not None else kernels

    def _connect_kernel(self) -> Any:
        """The client of this attempt's kernel, once it answers. Raises KernelNotReady."""
        self._spawn_kernel()  # a retry in place needs a fresh kernel
        assert self._kernel is not None
        return self._kernel.connect(timeout=KERNEL_READY_TIMEOUT)

    def _unpack_workdir(self) -> None:
        """The files shipped with the job (helper modules), into the kernel's cwd.

        The kernel may already be running: the bootstrap refreshes its import caches.
        """
        try:
            archive = self.store.get(layout.WORKDIR)
        except NotFound:
            return
        self._workdir.mkdir(exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            tar.extractall(self._workdir, filter="data")

    def _shutdown_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            kernel.kill()
        with self._conn_lock:
            kernels, self._kernels = self._kernels, []
        for extra in kernels:
            extra.kill()

    def _interrupt_kernel(self) -> None:
        for kernel in self._all_kernels():
            kernel.resume()  # a paused kernel cannot take the interrupt
            kernel.interrupt()

    def _execute(self, kc: Any, code: str, silent: bool, kernel: KernelProcess | None = None,
                 rank: int | None = None) -> dict[str, Any] | None:
        """Run ``code`` in the kernel (this attempt's, or ``kernel``: a distributed
        job's worker of global rank ``rank``, whose outputs carry it), relaying its
        outputs; the error or None."""
        assert self.events is not None
        ev = self.events
        tag = {} if rank is None else {"rank": rank}
        msg_id = kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        while True:
            if not self.parked.is_set():
                self._check_fence()
            try:
                msg = kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                running = kernel if kernel is not None else self._kernel
                if running is not None and not running.alive:
                    reason = running.exit_reason()
                    return {"ename": "KernelDied", "evalue": reason, "traceback": [reason]}
                if self.stop_requested:
                    self._interrupt_kernel()
                continue
            except Exception:
                # The kernel's sockets were closed under us: the instance is going, or
                # another agent took the job.
                if self.terminating.is_set() or self.fenced.is_set():
                    raise Fenced() from None
                raise
            kind = msg["header"]["msg_type"]
            if kind == channel.OUTPUT_MARK:
                # Everything the kernel printed before it is relayed: a checkpoint's
                # question for the unlogged events may be answered (on_message).
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
        deadline = time.monotonic() + 30
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
        return {"ename": "KernelTimeout", "evalue": "the kernel did not reply",
                "traceback": []}

    def _sync_runtime(self, kc: Any, kernel: KernelProcess | None = None) -> None:
        """Have the runtime send every row logged so far, and wait until they are read
        (the cell failed: its last rows may not have been sent yet)."""
        kernel = kernel if kernel is not None else self._kernel
        if kc is None or kernel is None or not kernel.alive:  # no kernel client to ask
            if kernel is self._kernel:
                self._drain_channel()
            return
        marker = f"sync-{time.monotonic_ns()}"
        seen = threading.Event()
        self._marks_waiting[marker] = seen
        try:
            if self._execute(kc, f"_spotnb_runtime._sync({marker!r})", silent=True,
                             kernel=kernel) is None:
                seen.wait(CHANNEL_DRAIN_SECONDS)
        finally:
            self._marks_waiting.pop(marker, None)

    # -- lease, notices, stop ----------------------------------------------------------

    def _take_lease(self, instance: str) -> lease.HeldLease | None:
        """Wait for the lease (a distributed job's: of the first free node slot); None
        if the job ended or was stopped meanwhile."""
        gone = _rechecked(_holder_gone_check(self.spec), HOLDER_GONE_RECHECK_SECONDS)
        slots = self.spec.resources.max_nodes if self.spec.resources.distributed else 1
        while True:
            try:
                if self.store.exists(layout.RESULT) or self.store.exists(layout.STOP):
                    log.info("job ended while waiting for the lease; exiting without writing")
                    return None
                held = None
                for slot in range(slots):
                    held = lease.acquire(self.store, holder=instance, holder_gone=gone,
                                         ttl=lease.configured_ttl(), slot=slot,
                                         stride=slots)
                    if held is not None:
                        break
                if held is not None and self.store.exists(layout.RESULT):
                    # The previous holder finished the job and released the lease.
                    held.release()
                    return None
            except Exception as err:
                if not transient(err):
                    raise
                log.warning("the store failed while taking the lease (%s); retrying", err)
                held = None
            if held is not None:
                return held
            time.sleep(0.5)

    def _instance_loop(self) -> None:
        """IMDS, pings, durable-row acknowledgements, and the kernel's pause/resume:
        everything that needs no store request, every IMDS_POLL_SECONDS."""
        pace = IMDS_POLL_SECONDS if self.live is None else min(IMDS_POLL_SECONDS,
                                                               self.live.cadence)
        while not self._done.wait(pace):
            try:
                self._watch_imds()
                self._ping()
                pace = ROWS_SECONDS if self.live is None else self.live.cadence
                if time.monotonic() - self._rows_at >= pace:
                    self._emit_rows()
                self._acknowledge_rows()
                self._mind_kernel()
            except Exception:
                log.exception("the instance loop failed; going on")

    def _ping(self) -> None:
        """Tell the kernels this agent is alive, and until when (on the host's
        :func:`spotnb.lease.clock`) its lease counts as held if no renewal lands: a
        kernel whose agent falls silent stops itself by then, before another agent may
        take the job over whatever the TTL (the session's watchdog)."""
        held = self.held
        self._send({"op": "ping", "until": None if held is None else held.held_until()})

    def _store_loop(self) -> None:
        """The lease's heartbeat and the stop request: the agent's store requests that
        repeat. A failure is retried sooner, with backoff, and never ends the loop."""
        every = lease.heartbeat_seconds(self.held.lease.ttl if self.held else lease.TTL_SECONDS)
        next_renew = time.monotonic() + every
        next_stop = time.monotonic() + STOP_POLL_SECONDS
        next_usage = time.monotonic() + USAGE_SECONDS
        retry = Backoff(STORE_RETRY_SECONDS, STORE_MAX_RETRY_SECONDS)
        while not self._done.wait(
                max(0.05, min(next_renew, next_stop, next_usage) - time.monotonic())):
            now = time.monotonic()
            held = self.held
            if held is not None and now >= next_renew and held.status() is not Standing.LOST:
                try:
                    held.renew()
                    next_renew = now + every
                    retry.reset()
                except lease.LeaseLost:
                    self._fence_off()
                    return
                except Exception as err:
                    delay = retry.next()
                    log.warning("renewing the lease failed (%s); retrying in %.1f s", err,
                                delay)
                    next_renew = now + delay
            if now >= next_stop and self.stop_requested is None:
                next_stop = now + STOP_POLL_SECONDS
                self._watch_stop()
            if now >= next_usage:
                next_usage = now + USAGE_SECONDS
                self._report_usage()

    def _mind_kernel(self) -> None:
        """Keep the kernel running only while the lease is confirmed.

        UNCONFIRMED (no successful renewal for the TTL less the safety margin: the store
        is out of reach, or this agent was frozen): pause the kernel, so nothing trains
        that no agent can record. HELD again: resume it (also a kernel that stopped
        itself when this agent stopped answering). LOST: fence off.
        """
        held, kernels = self.held, self._all_kernels()
        if held is None or not kernels or self.parked.is_set():
            return
        standing = held.status()
        if standing is Standing.LOST:
            if not self.fenced.is_set():
                self._fence_off()
        elif standing is Standing.UNCONFIRMED:
            if self._paused_since is None:
                self._paused_since = time.time()
                for kernel in kernels:
                    kernel.pause()
                log.warning("the lease was not confirmed for %.0f s: the kernel is paused "
                            "until it is", held.confirmed_age())
                self._emit("status", state="paused", detail=(
                    "paused: the job's lease could not be confirmed in the store (store "
                    "unavailable?); training resumes when it is"))
                self._flush_soon()
        else:
            if self._paused_since is not None:
                paused = time.time() - self._paused_since
                self._paused_since = None
                self._emit("status", state="running",
                           detail=f"the lease is confirmed again; resumed after {paused:.0f} s")
            for kernel in kernels:
                if kernel.stopped:
                    log.warning("the kernel was stopped (its agent did not answer); "
                                "resuming it")
                    kernel.resume()

    def _fence_off(self) -> None:
        """Another agent took the job: write nothing more, and stop the kernel at once
        (it must not train or commit anything on its own)."""
        self.fenced.set()
        if self.events is not None:
            self.events.stop_writing()
        for kernel in self._all_kernels():
            log.warning("the lease was lost: killing the kernel")
            kernel.kill()

    def _check_fence(self) -> None:
        # Terminating: the kernel is killed under the cell, and what fails then is no
        # result of the job's; the replacement runs the attempt again. Released (after
        # the final checkpoint) or lost: the job is another agent's.
        held = self.held
        if (self.fenced.is_set() or self.terminating.is_set()
                or (held is not None and held.status() is Standing.LOST)):
            raise Fenced()

    def _watch_imds(self) -> None:
        try:
            action = self.imds.instance_action()
            rebalance = None if self.rebalance else self.imds.rebalance()
        except Exception:
            log.debug("IMDS poll failed", exc_info=True)
            return
        # The termination first: when both arrive in one poll, the runtime's next
        # save must already know it is the last one (a rebalance save alone
        # would wait for the upload in flight and keep training).
        if action and not self.notice:
            self.notice = action
            self._emit("notice", kind="instance-action", action=action.get("action"),
                       notice_time=action.get("time"))
            self._emit("status", state="interrupted",
                       detail=f"spot interruption notice: {action.get('action')} at "
                              f"{action.get('time')}; saving a checkpoint")
            self._flush_soon()
            if self._paused_since is None:
                for kernel in self._all_kernels():
                    kernel.resume()
            if self.node is not None:
                self.node.on_notice()  # a rendezvous host vacates first
            self._send({"op": "notice", "kind": "instance-action",
                        "action": action.get("action"), "time": action.get("time")})
            if self.held is not None:
                self.notifier.interrupted(self.held.epoch, action.get("action"),
                                          action.get("time"))
        if rebalance and not self.rebalance:
            self.rebalance = rebalance
            self._emit("notice", kind="rebalance", action="rebalance",
                       notice_time=rebalance.get("noticeTime"))
            self._flush_soon()
            self._send({"op": "notice", "kind": "rebalance", "action": "rebalance",
                        "time": rebalance.get("noticeTime")})

    def _watch_stop(self) -> None:
        node = self.node
        if node is not None and not node.ended.is_set():
            try:
                if self.store.exists(layout.RESULT):
                    node.on_job_ended()  # another node wrote it (a failure, the end)
            except Exception:
                log.debug("looking for the result failed", exc_info=True)
        try:
            raw = self.store.get(layout.STOP)
        except NotFound:
            return
        except Exception:
            log.debug("reading the stop request failed", exc_info=True)
            return
        try:
            request = json.loads(raw or b"{}")
        except ValueError:
            request = {}
        self._on_stop(request if isinstance(request, dict) else {})

    def _on_stop_message(self, msg: dict[str, Any]) -> None:
        """A stop request on the control queue (the notebook wrote stop.json too)."""
        self._on_stop({k: v for k, v in msg.items() if k != "op"})

    def _on_stop(self, request: dict[str, Any]) -> None:
        if self.stop_requested is not None:
            return
        self.stop_requested = request
        self._emit("status", state="stopped", detail=f"stopping: {self._stop_reason()}")
        self._flush_soon()
        self._interrupt_kernel()
        if self.node is not None:
            self.node.on_job_ended()

    def _stop_reason(self) -> str:
        req = self.stop_requested or {}
        reason = req.get("reason", "requested")
        detail = req.get("detail")
        return f"stop requested ({reason}{': ' + detail if detail else ''})"

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The instance is being terminated: flush what we have and go.

        The handler runs between two bytecodes of the main thread, which may hold a
        lock: do the work on a thread, with a hard deadline.
        """
        if self.terminating.is_set():
            return
        self.terminating.set()

        def shut() -> None:
            self._emit("status", state="interrupted", detail="the instance was terminated")
            if self.events is not None:
                with contextlib.suppress(Exception):
                    self.events.flush()
            self._shutdown_kernel()
            _sweep_descendants()
            os._exit(EXIT_OK)

        threading.Timer(TERMINATION_GRACE_SECONDS, os._exit, args=(EXIT_OK,)).start()
        threading.Thread(target=shut, daemon=True).start()

    # -- the runtime channel ---------------------------------------------------------

    def _open_listener(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._socket_path))
        listener.listen(4)
        return listener

    def _serve_channel(self, listener: socket.socket) -> None:
        while not self._done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._conn_lock:
                self._conns.append(conn)
            if self.notice:
                self._reply(conn, {"op": "notice", "kind": "instance-action",
                                   "action": self.notice.get("action"),
                                   "time": self.notice.get("time")})
            reader = threading.Thread(target=self._read_channel, args=(conn,), daemon=True)
            self._readers.append(reader)
            reader.start()

    def _read_channel(self, conn: socket.socket) -> None:
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
                with self._conn_lock:
                    if conn in self._conns:
                        self._conns.remove(conn)

    def _drain_channel(self) -> None:
        """Wait until every connection from the runtime is read to its end (bounded):
        the rows the cell logged last must be in the log before the result."""
        deadline = time.monotonic() + CHANNEL_DRAIN_SECONDS
        for reader in list(self._readers):
            reader.join(max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                log.warning("the runtime's channel did not close within %gs; going on",
                            CHANNEL_DRAIN_SECONDS)
                break
        self._emit_rows()

    def _on_message(self, msg: dict[str, Any], conn: socket.socket | None = None) -> None:
        ev = self.events
        if ev is None:
            return
        op = msg["op"]
        if op == "metrics":
            # Rows are gathered into one `metrics` event a second (the live channel's
            # pace): a day of logging is ~86,000 events, whatever the rate of spot.log.
            with self._rows_lock:
                self._rows.extend(msg["rows"])
                full = len(self._rows) >= ROWS_PER_EVENT

            self.notifier.saw_metrics(msg["rows"])
            if full:
                self._emit_rows()
            return
        # Anything else comes after the rows sent before it.
        self._emit_rows()
        if op == "checkpoint":
            data = {k: v for k, v in msg.items() if k != "op"}
            ev.emit("checkpoint", **data)
            if data.get("phase") == "begin":
                ev.emit("status", state="checkpointing",
                        detail=f"saving a checkpoint at step {data.get('step')}")
            else:
                if not self.notice:
                    ev.emit("status", state="running", detail="running the cell")
                if data.get("phase") == "failed" or data.get("forced") or data.get("join"):
                    ev.flush_soon()  # a periodic save waits for the next flush
        elif op == "restored":
            ev.emit("status", state="running",
                    detail=f"restored checkpoint of step {msg.get('step')} "
                           f"in {msg.get('seconds', 0):.1f}s")
            if self.node is not None and msg.get("step") is not None:
                self.node.on_restored(int(msg["step"]))
            ev.flush_soon()
        elif op == "sync":
            ev.emit("checkpoint", kind="sync", **{k: v for k, v in msg.items() if k != "op"})
        elif op == "usage":
            ev.emit("usage", process="runtime", requests=msg.get("requests") or {})
        elif op == "replay":
            self._replay(int(msg.get("attempt", 0)), msg.get("rows") or [],
                         msg.get("events") or [], msg.get("checkpoint"), msg.get("saved"))
        elif op == "unlogged":
            # A checkpoint being saved asks for the events the log has not confirmed
            # (after its mark on the kernel's output: every line printed before the
            # save is among them): it carries them.
            mark = msg.get("mark")
            if mark:
                with self._output_seen:
                    if not self._output_seen.wait_for(lambda: mark in self._output_marks,
                                                      OUTPUT_MARK_SECONDS):
                        log.warning("the kernel's output mark did not arrive within %g s; "
                                    "a checkpoint carries the output relayed so far",
                                    OUTPUT_MARK_SECONDS)
            lines, following = ev.unwritten(CARRIED_TYPES)
            self._reply(conn, {"op": "unlogged", "id": msg.get("id"), "events": lines,
                               "next": following})
        elif op == "fence":
            # The runtime asks before it moves LATEST or writes the outputs.
            # UNCONFIRMED (the store did not answer the last renewals) is not LOST:
            # the runtime asks again until the lease is confirmed or lost.
            held = self.held
            standing = held.status() if held is not None else Standing.LOST
            fenced = self.fenced.is_set()
            self._reply(conn, {"op": "fence", "id": msg.get("id"),
                               "ok": standing is Standing.HELD and not fenced,
                               "unknown": standing is Standing.UNCONFIRMED and not fenced})
        elif op == "mark":
            waiting = self._marks_waiting.get(str(msg.get("token")))
            if waiting is not None:
                waiting.set()
        elif op == "parked":
            # The save forced by the notice is durable: steps after it would only be
            # redone. Let the replacement start now rather than after the lease's TTL.
            if self.parked.is_set():
                return  # another local worker of this node said so first
            self.parked.set()
            ev.emit("status", state="interrupted",
                    detail=f"final checkpoint at step {msg.get('step')} is durable; "
                           "waiting for the instance to be terminated")
            self._report_usage()
            if self.live is not None:
                self.live.send_now()
            if self.held is not None:
                self._done_with_lease()
            if self.node is not None:
                self.node.on_parked()
        elif op == "reform":
            # A node of the world leaves after the coordinated checkpoint (or one waits
            # to join): re-form (torchelastic restarts this node's workers).
            if msg.get("join"):
                saved = (f"the checkpoint of step {msg.get('step')} is durable"
                         if msg.get("step") is not None else
                         "no checkpoint to save (the cell has made none yet)")
                ev.emit("status", state="restoring", detail=(
                    f"{saved}; re-forming the world with the node that waits to join"))
            else:
                ev.emit("status", state="restoring", detail=(
                    f"a node leaves after the checkpoint of step {msg.get('step')}; "
                    "re-forming the world without it"))
            if self.node is not None:
                step = msg.get("step")
                self.node.on_reform(int(step) if step is not None else None,
                                    join=bool(msg.get("join")))
        elif op == "warning":
            ev.emit("warning", kind=msg.get("kind"), text=msg.get("text", ""))
        elif op == "params":
            ev.emit("params", **{k: v for k, v in msg.items() if k != "op"})
        elif op == "progress":
            ev.emit("progress", total=msg.get("total"), source=msg.get("source"))
            self.notifier.saw_total(msg.get("total"))
        elif op == "hello":
            pass
        else:
            log.warning("unknown message from the runtime: %s", op)

    def _replay(self, source: int, rows: list[list[Any]], lines: list[str],
                durable: Any = None, saved: Any = None) -> None:
        """Record what a restored checkpoint carried that the log of the attempt that
        saved it lacks (its agent died with it unwritten): metric rows, and events (the
        cell's output, earlier saves...). Rows are logged in time order, so those after
        the newest metric in that attempt's log are the missing ones; events are
        numbered, so those after the newest number in it.

        They are appended to that attempt's own stream as one chunk, under the numbers
        its agent gave them, as if it had written them: the log reads as if that agent
        had lived, and a later restore of the same checkpoint finds them there and
        records nothing twice. That agent writes nothing more (it lost the lease this
        agent holds), so the stream still has one writer at a time. The restored save's
        own ``checkpoint`` event (``durable``, saved at time ``saved``) is added when
        that log lacks it too (its agent died between the save and the next write of
        its log), and the rows as one batch: both unnumbered, since that agent may
        have given any later number to an event another checkpoint carries; a
        checkpoint event is recorded once by its id and phase."""
        held = self.held
        if self.events is None or held is None or source == held.epoch:
            return
        if not isinstance(durable, dict) or not isinstance(saved, (int, float)) \
                or not isinstance(durable.get("id"), str):
            durable = None
        carried = []
        for line in lines:
            try:
                event = Event.from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not an event: the carry is read from the store, not trusted
            if event.n is not None:
                carried.append(event)

        def append() -> tuple[int, int]:
            prefix = f"{EVENTS_PREFIX}{stream_name(source)}/"
            objs = [o for k in self.store.list_keys(prefix)
                    if (o := StreamObject.parse(k)) is not None]
            since = min([float(saved or 0.0), *(e.time for e in carried)])
            newest_n, newest_t, recent = _newest_logged(self.store, objs, since)
            saves: set[tuple[str | None, str]] = {(b.id, b.phase) for e in recent
                     if isinstance(b := e.body, codec.CheckpointEvent) and b.id}
            # Compared as logged: the log keeps each row's time to the millisecond.
            missing = [(step, _row_time(t), values) for step, t, values in rows
                       if _row_time(t) > newest_t]
            events = []
            for e in sorted(carried, key=lambda e: e.n or 0):
                kind = e.body
                save = (kind.id, kind.phase) if isinstance(kind, codec.CheckpointEvent) \
                    else None
                if (e.n or 0) <= newest_n or (save is not None and save in saves):
                    continue
                if save is not None:
                    saves.add(save)
                events.append(dataclasses.replace(e, data={**e.data,
                                                           "replayed_by": held.epoch}))
            if durable is not None and (durable["id"], "durable") not in saves:
                events.append(Event(type="checkpoint", time=float(saved), attempt=source,
                                    instance=None, data={**durable, "replayed_by": held.epoch}))
            if missing:
                data = {**metrics_data(missing), "replayed_by": held.epoch}
                events.append(Event(type="metrics", time=missing[-1][1], attempt=source,
                                    instance=None, data=data))
            if events:
                seq = max((o.last for o in objs), default=-1) + 1
                body = "".join(e.to_json() + "\n" for e in events).encode()
                if self.store.put_if_absent(f"{prefix}{seq:08d}.jsonl", body) is None:
                    raise StoreError("the restored attempt's log changed meanwhile")
            return len(missing), len(events) - (1 if missing else 0)

        try:
            recorded = self._write(append, "the rows and events the restored checkpoint "
                                           "carried")
        except (StoreUnavailable, Fenced):
            return
        if any(recorded):
            log.info("recorded %d metric row(s) and %d event(s) of attempt %d that its log "
                     "lacked", *recorded, source)

    def _done_with_lease(self) -> None:
        assert self.held is not None and self.events is not None
        self.events.flush(timeout=TERMINATION_GRACE_SECONDS * 10)
        self.held.release()
        # From here on this agent writes nothing: the replacement owns the job. The
        # kernel stays parked until the instance is terminated.
        self.events.stop_writing()

    def _on_sample(self, data: dict[str, Any]) -> None:
        """A GPU/CPU sample: every one while a follower watches, else one in
        SYS_IDLE_SECONDS (the history needs no more; a day is 8,640 events)."""
        self.notifier.saw_sys(data)
        now = time.monotonic()
        watched = self.live is not None and self.live.watched
        if watched or now - self._sampled_at >= SYS_IDLE_SECONDS:
            self._sampled_at = now
            self._emit("sys", **data)

    def _emit_rows(self) -> None:
        """The metric rows gathered so far, as one ``metrics`` event."""
        ev = self.events
        with self._rows_lock:
            rows, self._rows = self._rows, []
            self._rows_at = time.monotonic()
            if ev is None or not rows:
                return
            ev.emit_metrics((step, _row_time(t), values) for step, t, values in rows)
            with self._marks_lock:
                self._metric_marks.append((ev.emitted, float(rows[-1][1])))

    def _acknowledge_rows(self) -> None:
        """Tell the runtime up to which time its metric rows are durable in the log, so
        it keeps only the rest (a checkpoint carries those: spotnb.runtime)."""
        ev = self.events
        if ev is None:
            return
        newest = None
        with self._marks_lock:
            while self._metric_marks and self._metric_marks[0][0] <= ev.written:
                newest = self._metric_marks.popleft()[1]
        if newest is not None:
            self._send({"op": "durable", "t": newest})

    def _send(self, msg: dict[str, Any]) -> None:
        """Send to every runtime (one per kernel; a broken connection is dropped)."""
        data = channel.encode(msg)
        with self._conn_lock:
            for conn in list(self._conns):
                try:
                    conn.sendall(data)
                except OSError:
                    self._conns.remove(conn)

    def _reply(self, conn: socket.socket | None, msg: dict[str, Any]) -> None:
        if conn is None:
            self._send(msg)
            return
        with self._conn_lock, contextlib.suppress(OSError):
            conn.sendall(channel.encode(msg))

    # -- helpers ---------------------------------------------------------------------

    def _emit(self, type: str, **data: Any) -> None:
        if self.events is not None and not self.fenced.is_set():
            self.events.emit(type, **data)

    def _report_usage(self) -> None:
        """A ``usage`` event: the requests this agent made so far (spotnb.usage)."""
        self._emit("usage", process="job-agent", requests=usage.snapshot())

    def _flush_soon(self) -> None:
        if self.events is not None:
            self.events.flush_soon()

    def _close_events(self) -> None:
        limit = outage_limit()
        if self.events is not None and not self.events.close(timeout=limit):
            raise StoreUnavailable(
                f"the job's events could not be written to {self.store.uri} for "
                f"{limit:g} s: {self.events.last_error}")

    def _retry(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried with backoff while the store fails; StoreUnavailable after
        the outage limit. Fenced if the lease is lost meanwhile."""
        return _retry_store(fn, what, check=self._check_fence)

    def _renew_or_fence(self, step: Callable[[], None]) -> None:
        """Renew (or bump) the lease now, retrying a failing store; Fenced if lost."""
        try:
            self._retry(step, "renewing the lease")
        except lease.LeaseLost:
            self._fence_off()
            raise Fenced() from None

    def _write(self, fn: Callable[[], T], what: str) -> T:
        """A write of this agent's (errors, result): only while the lease is HELD."""
        def guarded() -> T:
            self._check_fence()
            held = self.held
            if held is not None and held.status() is not Standing.HELD:
                raise StoreError(f"not writing {what}: the lease is not confirmed")
            return fn()
        return self._retry(guarded, f"writing {what}")

    def _prefetch(self, dest: Path, ranks: Sequence[int] | None = None,
                  world_size: int | None = None) -> None:
        """Download the latest checkpoint while the kernel starts (runtime verifies it).

        ``ranks``, ``world_size``: the global ranks this node hosts in a world of that
        size (a multi-node job). Of a sharded checkpoint (saved by every rank) the node
        then fetches only its share: the manifest, ``.metadata`` and, when the
        checkpoint was saved by a world of the same size (a node replaced, the world
        re-formed as it was), the files its ranks wrote, which hold nearly all they
        read (:func:`spotnb.ckpt.node_share`). The ranks' readers fetch the rest
        (ranges of the replicated items other ranks wrote; another world size's shards).
        """
        try:
            from spotnb.checkpoints import CHECKPOINT_FORMATS, CheckpointStore
            from spotnb.ckpt import node_share

            ckpts = CheckpointStore(self.store, prefix=layout.CHECKPOINTS,
                                    keep=self.spec.policy.keep_checkpoints,
                                    formats=CHECKPOINT_FORMATS)
            manifest = ckpts.latest()
            if manifest is None:
                return
            assert self.events is not None
            self.events.emit("status", state="restoring",
                             detail=f"downloading the checkpoint of step {manifest.step}")
            names = None if ranks is None or world_size is None else \
                node_share(manifest, ranks, world_size)
            ckpts.download(manifest, dest, names=names)
        except Exception:
            log.exception("prefetching the checkpoint failed; the runtime will download it")
        finally:
            (dest / channel.PREFETCH_DONE).touch()

    def _identity(self) -> dict[str, Any]:
        try:
            ident = dict(self.imds.identity())
        except Exception:
            log.warning("no instance metadata endpoint; using the host name as identity")
            ident = {}
        ident.setdefault("instance_id", f"host-{socket.gethostname()}-{os.getpid()}")
        return ident

    def _where(self) -> str:
        ident = self.identity
        parts = [ident.get("instance_type"), ident.get("az_id") or ident.get("az"),
                 ident.get("instance_id")]
        return " ".join(str(p) for p in parts if p)


def _row_time(t: Any) -> float:
    """A metric row's time as the log keeps it: to the millisecond (a smaller column;
    replays compare carried rows with logged ones in this form)."""
    return round(float(t), 3)


def _newest_logged(store: Store, objs: list[StreamObject], since: float
                   ) -> tuple[int, float, list[Event]]:
    """The newest event number and metric row time among a stream's objects (-1 and
    -inf without any), and its events from time ``since`` on: read from the last one
    back until one holds a metric and one an event older than ``since`` (the first
    read gives the newest number: objects are in event order)."""
    newest_n, newest_t = -1, None
    recent: list[Event] = []
    for obj in sorted(objs, key=lambda o: (o.last, o.first), reverse=True):
        try:
            events = parse_chunk(read_object(store, obj))
        except NotFound:
            continue
        newest_n = max([newest_n, *(e.n for e in events if e.n is not None)])
        recent += [e for e in events if e.time >= since]
        times = [float(t) for e in events for _, t, _ in metric_rows(e)]
        if times and newest_t is None:
            newest_t = max(times)
        if newest_t is not None and any(e.time < since for e in events):
            break
    return newest_n, float("-inf") if newest_t is None else newest_t, recent


def _retry_store(fn: Callable[[], T], what: str,
                 check: Callable[[], None] | None = None) -> T:
    """:func:`spotnb.store.retrying`: ``fn()`` retried while the store fails."""
    return retrying(fn, what, check=check)


def _holder_gone_check(spec: JobSpec) -> lease.HolderGone | None:
    """The provider's check that a lease holder's instance is terminated, if it has one."""
    try:
        from spotnb.providers import get_provider

        check = getattr(get_provider(spec.provider), "instance_gone", None)
    except Exception:
        log.debug("no provider check for gone instances", exc_info=True)
        return None
    if check is None:
        return None
    return lambda held: bool(check(spec.job_id, held.holder))


def _rechecked(check: lease.HolderGone | None,
               seconds: float) -> lease.HolderGone | None:
    """``check``, asked about one holder at most once every ``seconds`` (the answers
    in between are "not gone"); a holder found gone stays gone."""
    if check is None:
        return None
    asked: dict[str, float] = {}
    found_gone: set[str] = set()

    def gone(held: lease.Lease) -> bool:
        if held.holder in found_gone:
            return True
        now = time.monotonic()
        if held.holder in asked and now - asked[held.holder] < seconds:
            return False
        asked[held.holder] = now
        if check(held):
            found_gone.add(held.holder)
            return True
        return False

    return gone


def _become_subreaper() -> None:
    """Make orphans of the kernel's descendants (a double fork, a daemon) this
    process's children rather than init's, so the end of the agent can end them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        log.debug("cannot become a child subreaper", exc_info=True)


def _sweep_descendants() -> None:
    """SIGKILL every process this agent started, however it detached (new session,
    double fork: as a subreaper they stay below us), so none outlives the attempt."""
    try:
        family = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(family, timeout=5)


def _notice_seconds(provider: str) -> float:
    """The job's interruption notice period: the runtime judges its checkpoints by it."""
    from spotnb.providers import notice_seconds

    try:
        return notice_seconds(provider)
    except Exception:  # a bad local cloud setting: the group reports it, not the agent
        log.warning("cannot tell the notice period of provider %s; assuming EC2's",
                    provider, exc_info=True)
        from spotnb.ckpt.notice import EC2_NOTICE_SECONDS

        return EC2_NOTICE_SECONDS


def _process_started() -> float | None:
    """When this process started (epoch seconds, to 10 ms), for the resume benchmark.

    From ``/proc/self/stat`` against the boot clock: psutil's ``create_time`` counts
    from the boot time in whole seconds, up to a second off.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of proc(5), in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m spotnb.kernel_remote``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m spotnb.kernel_remote",
                                     description="Run a spotnb job on this instance.")
    parser.add_argument("--job", required=True, help="the job's store URI")
    parser.add_argument("--log-level", default=os.environ.get("SPOTNB_LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ["SPOTNB_ORIGIN"] = "job-agent"  # in the User-Agent of its AWS requests
    return Agent(args.job).run()
