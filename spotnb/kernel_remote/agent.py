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

Alongside, two loops run (:mod:`spotnb.kernel_remote.loops`). The *instance loop*
(every :data:`~spotnb.kernel_remote.loops.IMDS_POLL_SECONDS`, no remote call but
IMDS) watches IMDS for ``spot/instance-action`` and the rebalance recommendation (the
runtime is told and saves at once; once that save is durable the agent releases the
lease so the replacement can start), pings the runtime (a kernel whose agent stops
answering stops itself), tells the runtime which metric rows are durable in the log,
and keeps the kernel running only while the lease is confirmed: an unconfirmed lease
(a frozen agent, a store out of reach) pauses it, a lost one kills it. The *store
loop* renews the lease every :func:`lease.heartbeat_seconds` and looks for a stop
request; store errors there are retried with backoff, never fatal.
``SPOTNB_LEASE_TTL`` sets the lease's TTL (default :data:`lease.TTL_SECONDS`).

Fencing (invariant 3): every write of this agent (events, errors, the result) happens
only while :meth:`lease.HeldLease.status` is HELD; the runtime's checkpoint commits ask
the agent the same question over the channel.

A distributed job (several nodes, or several processes per node): the agent takes the
lease of a free node slot (Step 3), and Step 4-5 are :class:`spotnb.kernel_remote.multinode.node.
NodeRun`'s: torchelastic's rendezvous with the other nodes, one kernel per local worker
(each with its own channel connection), re-formed as nodes come and go.

The :class:`Agent` is the attempt's lifecycle (the steps and the loops above); it
composes parts, each with one responsibility and its own module:

    attempt         run_attempt, run_node_attempt: Step 4-5, on one node or on several
    loops           the instance loop and the store loop
    leasing         LeaseKeeper: the lease, fencing (Fenced), guarded writes, heartbeat
    kernels         KernelSupervisor: spawn, interrupt, kill the kernels; their env
    cells           CellRunner: run code in a kernel, relay its outputs, output marks
    channel_server  ChannelServer: the runtime channel's socket, readers and sends
    messages        RuntimeMessages: the table of op -> handler for the runtime's messages
    rows            RowRelay: metric rows into ``metrics`` events, and which are durable
    watch           NoticeWatcher (IMDS notices), StopWatcher (the stop request)
    standby         Standby: the warm-up of an agent that finds the lease held
    replay          record_carry: a restored checkpoint's carry into its attempt's log
    prefetch        the latest checkpoint, downloaded while the kernel starts
    procs           the process family (subreaper, sweep)

A distributed job's :class:`~spotnb.kernel_remote.multinode.node.NodeRun` (and an
attempt) uses the agent's public methods (``execute``, ``emit``, ``send``, ``retry``,
``write``, ``finish``, ...).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from spotnb.kernel_remote import channel, standby
from spotnb.kernel_remote.attempt import run_attempt, run_node_attempt
from spotnb.kernel_remote.cells import CHANNEL_DRAIN_SECONDS, CellRunner
from spotnb.kernel_remote.channel_server import ChannelServer
from spotnb.kernel_remote.kernel import KernelProcess
from spotnb.kernel_remote.kernels import KernelSupervisor
from spotnb.kernel_remote.leasing import Fenced, LeaseKeeper, retry_store
from spotnb.kernel_remote.loops import instance_loop, store_loop
from spotnb.kernel_remote.messages import Handler, RuntimeMessages
from spotnb.kernel_remote.prefetch import prefetch
from spotnb.kernel_remote.procs import become_subreaper, sweep_descendants
from spotnb.kernel_remote.rows import RowRelay
from spotnb.kernel_remote.watch import NoticeWatcher, StopWatcher, leaving_region
from spotnb.protocol import layout, usage
from spotnb.protocol.events import EventReader, EventWriter
from spotnb.protocol.events.fold import JobState, fold
from spotnb.protocol.events.live import CONTROL_QUEUE, LiveSender
from spotnb.protocol.events.queues import queue_for
from spotnb.protocol.lease import HeldLease
from spotnb.protocol.notify import FLUSH_SECONDS, Notifier
from spotnb.protocol.secretstore import NOTIFY_SECRET, SecretsUnavailable
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store, StoreUnavailable, open_store, outage_limit
from spotnb.providers.imds import ImdsClient

__all__ = ["Agent", "Fenced", "main"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# GPU/CPU samples are kept one in this many seconds while nobody watches.
SYS_IDLE_SECONDS = 10.0
# EC2 gives processes a moment between SIGTERM and power-off; use well under it.
TERMINATION_GRACE_SECONDS = 0.8

# Exit codes: the capacity group only cares whether a result exists, and whether the
# store was out of reach (then launching another instance at once would not help).
EXIT_OK = 0
EXIT_FENCED = 3
EXIT_STORE = 4


class Agent:
    """Runs one attempt (or several, when user-code errors are retried in place)."""

    def __init__(self, job_uri: str, imds: ImdsClient | None = None) -> None:
        self.job_uri = job_uri
        self.store: Store = open_store(job_uri)
        self.imds = imds or ImdsClient()
        self.spec: JobSpec = JobSpec.from_json(
            retry_store(lambda: self.store.get(layout.SPEC), "reading the spec"))
        # Notifications (spotnb.protocol.notify): a no-op until the job's secrets name a webhook
        # (read at the start of run).
        self.notifier = Notifier(None, self.spec.job_id, self.spec.name,
                                 max_nodes=self.spec.resources.max_nodes)
        # Why the job's secrets (spotnb.protocol.secretstore: for the kernels' environment) could
        # not be read, if so (the attempt then fails saying it).
        self.secrets_error: str | None = None
        self.identity: dict[str, Any] = {}
        self.events: EventWriter | None = None
        self.parked = threading.Event()
        self.done = threading.Event()  # set once run() ends: the loops stop
        self.node: Any = None  # spotnb.kernel_remote.multinode.node.NodeRun, in a distributed job
        # This agent's warm-up as a standby (it found the lease held), until its first
        # attempt has used it.
        self.warm: standby.Standby | None = None
        self.paused_since: float | None = None  # the kernel paused (lease unconfirmed)
        self._sampled_at = -SYS_IDLE_SECONDS
        self.scratch = Path(tempfile.mkdtemp(prefix="spotnb-agent-", dir=os.getcwd()))
        # The runtime's channel and the kernel's sockets. Unix socket paths are
        # limited to ~107 bytes: keep it short, in /tmp. On the local cloud the
        # instance's first process made it, and removes it however this agent ends
        # (spotnb.providers.local.reaper).
        given = os.environ.get("SPOTNB_AGENT_SOCKET_DIR")
        self._socket_dir = Path(given) if given and os.path.isdir(given) else \
            Path(tempfile.mkdtemp(prefix="spotnb-"))
        self.live: LiveSender | None = None
        # The parts (module docstrings): each has one responsibility; the agent
        # composes them into the attempt.
        self.lease = LeaseKeeper(on_lost=self._on_lease_lost)
        self.notices = NoticeWatcher(self.imds, leaving=self._leaving_region)
        self.stops = StopWatcher(self.store)
        self.kernels = KernelSupervisor(job_uri, self.spec, self._socket_dir,
                                        self._socket_dir / "agent.sock", self.scratch)
        self.server = ChannelServer(self.kernels.socket_path, self.handle_message,
                                    self._on_connect)
        self.rows = RowRelay(lambda: self.events)
        self.cells = CellRunner(self.kernels, self.lease, lambda: self.events, self.parked,
                                lambda: bool(self.stop_requested), self.drain_channel)
        self.messages = RuntimeMessages(self)

    # -- the state the parts keep ------------------------------------------------------

    @property
    def held(self) -> HeldLease | None:
        """The lease this agent holds (None before it took it)."""
        return self.lease.held

    @property
    def fenced(self) -> threading.Event:
        """Set once the lease was lost: another agent took the job."""
        return self.lease.fenced

    @property
    def terminating(self) -> threading.Event:
        """Set once the instance is being terminated (SIGTERM)."""
        return self.lease.terminating

    @property
    def notice(self) -> dict[str, Any] | None:
        """The instance's interruption notice, once it came."""
        return self.notices.notice

    @property
    def stop_requested(self) -> dict[str, Any] | None:
        """The job's stop request, once it came."""
        return self.stops.requested

    # -- the attempt -----------------------------------------------------------------

    def run(self) -> int:
        """Run the job until it ends or this instance goes away; the exit code."""
        become_subreaper()
        try:
            if retry_store(lambda: self.store.exists(layout.RESULT), "reading the result"):
                log.info("job %s already has a result; nothing to do", self.spec.job_id)
                return EXIT_OK
            # Step 1b: the job's secrets, before a kernel is spawned (its environment).
            self._read_secrets()
            # Step 2: the kernel boots (~0.5 s) while the identity and lease are read.
            # (A distributed job's kernels are spawned by its NodeRun.)
            self.server.open()
            if not self.spec.resources.distributed:
                self.kernels.spawn()
            self.identity = self._identity()
            # Step 3: the lease. A live holder means another agent works on the job:
            # this one is its standby (spotnb.kernel_remote.standby) and warms up first.
            self.lease.held = self._take_lease()
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
            self.done.set()
            self.notifier.close()  # bounded: the last message's send, at most
            if self.live is not None:
                self.live.stop()
            self.kernels.shutdown()
            self.server.close()
            sweep_descendants()
            shutil.rmtree(self.scratch, ignore_errors=True)
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _take_lease(self) -> HeldLease | None:
        """The job's lease (Step 3), warming up as a standby while a live agent holds
        it (:func:`standby.take_lease`); None if the job ended meanwhile."""
        self.notifier.where = self.where()
        held, self.warm = standby.take_lease(self.store, self.spec, self.kernels,
                                             self.scratch, self.identity["instance_id"],
                                             self.notifier.standby_ready)
        return held

    def _read_secrets(self) -> None:
        """The job's secrets from the provider's secret store (spotnb.protocol.secretstore);
        the webhook among them starts the notifier. A failure is kept, not raised: the
        attempt fails with it once it holds the lease (its message names, never quotes)."""
        if not self.spec.secrets:
            return
        from spotnb.providers import get_provider

        try:
            self.kernels.secrets = get_provider(self.spec.provider).read_secrets(self.spec)
        except Exception as err:
            # str() of a SecretsUnavailable names the secrets; of anything else only its
            # type is kept (a library's message might quote what it was given).
            why = str(err) if isinstance(err, SecretsUnavailable) else type(err).__name__
            self.secrets_error = f"the job's secrets could not be read: {why}"
            log.error("%s", self.secrets_error)
            return
        url = self.kernels.secrets.get(NOTIFY_SECRET)
        if url:
            self.notifier = Notifier(url, self.spec.job_id, self.spec.name,
                                     max_nodes=self.spec.resources.max_nodes,
                                     job_state=self._job_state)

    def _job_state(self) -> JobState:
        """The job's log folded now: a notification's job-wide figures (its cost,
        saving, interruptions, steps redone). One read of the log per message that
        needs it (a start, a resume, the end), and only for a job with a webhook."""
        if self.events is not None:
            self.events.flush(timeout=FLUSH_SECONDS)  # this attempt's own events first
        events = EventReader(self.store, batches=True).poll()
        return fold(events, self.spec.resources.max_nodes)

    def _run_attempts(self) -> int:
        assert self.held is not None
        try:
            control = queue_for(self.store, self.spec.job_id, CONTROL_QUEUE)
            control.create()
            self.live = LiveSender(control, self._on_stop_message, self.store,
                                   before_send=self.rows.emit).start()
        except Exception as err:
            log.warning("no live channel (%s): followers read the log", err)
        threads = [
            threading.Thread(target=instance_loop, args=(self,), name="instance",
                             daemon=True),
            threading.Thread(target=store_loop, args=(self,), name="store", daemon=True),
            threading.Thread(target=self.server.serve, name="channel", daemon=True),
        ]
        for t in threads:
            t.start()
        if self.spec.resources.distributed:
            run_node_attempt(self)
            return EXIT_OK
        while True:
            outcome = run_attempt(self)
            if outcome != "retry":
                break
            # A user-code error the policy allows to retry: new kernel, new epoch.
            self._close_events()
            self.lease.renew_or_fence(self.held.bump)
        return EXIT_OK

    def close_quietly(self) -> None:
        """End this attempt without a result of its own: the events, then the lease."""
        if self.events is not None and not self.fenced.is_set():
            self._close_events()
        if self.held is not None:
            self.held.release()

    def finish(self, status: str, reason: str, error: dict[str, Any] | None = None) -> str:
        """Step 5-6: write the result (once, only while holding the lease), record the
        end, release the lease; ``status``."""
        assert self.held is not None and self.events is not None
        self.lease.check()
        self.lease.renew_or_fence(self.held.renew)
        result = {"status": status, "reason": reason, "attempt": self.held.epoch,
                  "instance_id": self.identity["instance_id"], "time": time.time(),
                  "error": error, "outputs": list(self.spec.outputs)}
        written = self.write(
            lambda: self.store.put_if_absent(layout.RESULT, json.dumps(result).encode()),
            "the result")
        if written is None:
            log.warning("a result already exists; leaving it as it is")
        self.rows.emit()
        if error is not None:
            self.events.emit("error", retrying=False, **error)
        self.report_usage()
        self.events.emit("result", status=status, reason=reason)
        self.events.emit("status", state=status, detail=reason)
        if self.live is not None:
            self.live.send_now()
            self.live.attach(None)
        self._close_events()
        self.held.release()
        self.notifier.ended(status, reason, self.held.epoch)
        return status

    # -- the lease lost, a stop, the instance's end -------------------------------------

    def _on_lease_lost(self) -> None:
        """Another agent took the job: write nothing more, and stop the kernel at once
        (it must not train or commit anything on its own)."""
        if self.events is not None:
            self.events.stop_writing()
        for kernel in self.kernels.all():
            log.warning("the lease was lost: killing the kernel")
            kernel.kill()

    def on_stop(self, request: dict[str, Any]) -> None:
        """A stop request (read from the store, or on the control queue): the first
        one interrupts the cell (and ends a distributed job's node)."""
        if not self.stops.request(request):
            return
        self.emit("status", state="stopped", detail=f"stopping: {self.stops.reason()}")
        self.flush_soon()
        self.kernels.interrupt()
        if self.node is not None:
            self.node.on_job_ended()

    def _on_stop_message(self, msg: dict[str, Any]) -> None:
        """A stop request on the control queue (the notebook wrote stop.json too)."""
        self.on_stop({k: v for k, v in msg.items() if k != "op"})

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The instance is being terminated: flush what we have and go.

        The handler runs between two bytecodes of the main thread, which may hold a
        lock: do the work on a thread, with a hard deadline.
        """
        if self.terminating.is_set():
            return
        self.terminating.set()

        def shut() -> None:
            self.emit("status", state="interrupted", detail="the instance was terminated")
            if self.events is not None:
                with contextlib.suppress(Exception):
                    self.events.flush()
            self.kernels.shutdown()
            sweep_descendants()
            os._exit(EXIT_OK)

        threading.Timer(TERMINATION_GRACE_SECONDS, os._exit, args=(EXIT_OK,)).start()
        threading.Thread(target=shut, daemon=True).start()

    def _leaving_region(self) -> dict[str, Any] | None:
        """The job's move to another region's mark on this instance (its notice's
        reason), once it knows who it is."""
        iid = self.identity.get("instance_id")
        return leaving_region(self.store, str(iid)) if iid else None

    # -- the runtime channel ---------------------------------------------------------

    def _on_connect(self, conn: socket.socket) -> None:
        """A runtime connected: tell it of a pending notice."""
        notice = self.notice
        if notice:
            self.server.reply(conn, channel.Notice(kind="instance-action",
                                                   action=notice.get("action"),
                                                   time=notice.get("time")))

    @property
    def handlers(self) -> dict[str, Handler]:
        """The handler of each op the agent accepts (:data:`channel.TO_AGENT`)."""
        return dict(self.messages.table)

    def handle_message(self, msg: dict[str, Any], conn: socket.socket | None = None) -> None:
        """A message from the runtime (:meth:`RuntimeMessages.handle`)."""
        self.messages.handle(msg, conn)

    def done_with_lease(self) -> None:
        assert self.held is not None and self.events is not None
        self.events.flush(timeout=TERMINATION_GRACE_SECONDS * 10)
        self.held.release()
        # From here on this agent writes nothing: the replacement owns the job. The
        # kernel stays parked until the instance is terminated.
        self.events.stop_writing()

    def on_sample(self, data: dict[str, Any]) -> None:
        """A GPU/CPU sample: every one while a follower watches, else one in
        SYS_IDLE_SECONDS (the history needs no more; a day is 8,640 events)."""
        self.notifier.saw_sys(data)
        now = time.monotonic()
        watched = self.live is not None and self.live.watched
        if watched or now - self._sampled_at >= SYS_IDLE_SECONDS:
            self._sampled_at = now
            self.emit("sys", **data)

    # -- the interface a distributed job's NodeRun uses (and the attempt) --------------

    def send(self, msg: channel.Message) -> None:
        """Send to every runtime (one per kernel; a broken connection is dropped)."""
        self.server.send(msg)

    def drain_channel(self) -> None:
        """Wait until every connection from the runtime is read to its end (bounded):
        the rows the cell logged last must be in the log before the result."""
        self.server.drain(CHANNEL_DRAIN_SECONDS)
        self.rows.emit()

    def execute(self, kc: Any, code: str, silent: bool, kernel: KernelProcess | None = None,
                rank: int | None = None) -> dict[str, Any] | None:
        """Run ``code`` in the kernel (this attempt's, or ``kernel``: a distributed
        job's worker of global rank ``rank``, whose outputs carry it), relaying its
        outputs as events; the error or None (:meth:`CellRunner.execute`)."""
        return self.cells.execute(kc, code, silent, kernel=kernel, rank=rank)

    def sync_runtime(self, kc: Any, kernel: KernelProcess | None = None) -> None:
        """Have the runtime send every row logged so far, and wait until they are read
        (the cell failed: its last rows may not have been sent yet)."""
        self.cells.sync_runtime(kc, kernel)

    def start_kernel(self, name: str | None) -> KernelProcess:
        """Spawn a named kernel (a distributed job's worker), kept until
        :meth:`forget_kernel`."""
        return self.kernels.start(name)

    def forget_kernel(self, kernel: KernelProcess) -> None:
        """A distributed job's kernel that was killed."""
        self.kernels.forget(kernel)

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """``fn()``, retried with backoff while the store fails; StoreUnavailable after
        the outage limit. Fenced if the lease is lost meanwhile."""
        return self.lease.retry(fn, what)

    def write(self, fn: Callable[[], T], what: str) -> T:
        """A write of this agent's (errors, result): only while the lease is HELD."""
        return self.lease.write(fn, what)

    def stop_reason(self) -> str:
        """Why the job is stopping, from the stop request (its reason and detail)."""
        return self.stops.reason()

    # -- helpers ---------------------------------------------------------------------

    def emit(self, type: str, **data: Any) -> None:
        """An event in this attempt's log (nothing once fenced, or before the log)."""
        if self.events is not None and not self.fenced.is_set():
            self.events.emit(type, **data)

    def report_usage(self) -> None:
        """A ``usage`` event: the requests this agent made so far (spotnb.protocol.usage)."""
        self.emit("usage", process="job-agent", requests=usage.snapshot())

    def flush_soon(self) -> None:
        """Have the log's writer write what it holds now rather than at its pace."""
        if self.events is not None:
            self.events.flush_soon()

    def _close_events(self) -> None:
        limit = outage_limit()
        if self.events is not None and not self.events.close(timeout=limit):
            raise StoreUnavailable(
                f"the job's events could not be written to {self.store.uri} for "
                f"{limit:g} s: {self.events.last_error}")

    def prefetch(self, dest: Path, ranks: Sequence[int] | None = None,
                 world_size: int | None = None) -> None:
        """Download the latest checkpoint into ``dest`` while the kernel starts
        (:func:`spotnb.kernel_remote.prefetch.prefetch`; ``ranks``, ``world_size``: a
        multi-node job's share)."""
        prefetch(self.store, self.spec, self.events, dest, ranks, world_size)

    def _identity(self) -> dict[str, Any]:
        try:
            ident = dict(self.imds.identity())
        except Exception:
            log.warning("no instance metadata endpoint; using the host name as identity")
            ident = {}
        ident.setdefault("instance_id", f"host-{socket.gethostname()}-{os.getpid()}")
        return ident

    def where(self) -> str:
        """Where this agent runs: its instance type, AZ and instance id."""
        ident = self.identity
        parts = [ident.get("instance_type"), ident.get("az_id") or ident.get("az"),
                 ident.get("instance_id")]
        return " ".join(str(p) for p in parts if p)


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
