"""The runtime's per-process session: the agent channel, notices, metrics, parking.

One :class:`Session` exists per kernel process (``spotnb.train.runtime`` creates it on first
use from the environment that :mod:`spotnb.kernel_remote.channel` describes, or in
standalone mode without it). It owns:

* the channel to the agent's Unix socket (:mod:`spotnb.train.agentchannel`) and the
  receiver thread that turns ``notice`` messages into flags the cell's thread reads
  (``force_save``, ``park_requested``, ``interrupt_pending``) and wakes the synced
  directories;
* the metrics thread that drains :data:`~spotnb.train.metrics.ROWS` (filled by
  ``spot.log``) every 0.2 s (:class:`~spotnb.train.metrics.MetricRows`: the values
  converted with ``float()``, sent in batches);
* the uploads in progress and the synced directories, so that :meth:`Session.finish`
  can wait for all of them;
* parking: once the save forced by an interruption notice is durable, the cell is
  held in a sleep loop until the instance is terminated;
* what a checkpoint carries so that a resume can record what died with an agent
  (DESIGN invariant 8, :mod:`spotnb.train.carry`): the rows sent but not yet durable
  in the event log (the agent says up to which time they are,
  :class:`~spotnb.kernel_remote.channel.Durable`), and the events the agent holds
  unwritten (the cell's output lines among them), asked for at the save
  (:class:`~spotnb.kernel_remote.channel.Unlogged`);
* the fencing question: before a checkpoint becomes ``LATEST`` or the outputs are
  written, the agent is asked whether it still holds the job's lease;
* the watchdog (:class:`~spotnb.train.watchdog.Watchdog`): a kernel whose agent falls
  silent (frozen) stops itself by the time the agent's lease stops counting as held,
  so that nothing trains that nobody records.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

from spotnb.ckpt.notice import EC2_NOTICE_SECONDS, NoticeFit
from spotnb.kernel_remote import channel
from spotnb.protocol import lease as lease_mod
from spotnb.protocol import usage
from spotnb.protocol.spec import CheckpointEvery
from spotnb.protocol.store import LocalStore, Store, open_store
from spotnb.train.agentchannel import AgentChannel
from spotnb.train.carry import Carry, mark_output
from spotnb.train.metrics import MetricRows
from spotnb.train.watchdog import Watchdog

if TYPE_CHECKING:
    from spotnb.ckpt.checkpoints import Manifest

__all__ = ["LOCAL_DIR", "Session"]

_logger = logging.getLogger(__name__)

# The background thread sends metrics this often; the notebook promises ~1 s latency.
_DRAIN_SECONDS = 0.2
# A parked cell sleeps in steps of this length until the instance is terminated.
_PARK_SLEEP_SECONDS = 1.0
# How long a fencing question waits for the agent's answer.
FENCE_REPLY_SECONDS = 30.0
# Between two questions while the agent cannot confirm the lease (a store outage).
FENCE_RETRY_SECONDS = 1.0
# How often the kernel reports the AWS requests it made (its uploads) to the agent.
USAGE_SECONDS = 300.0
# How long a save waits for the agent's list of unlogged events (it answers once the
# kernel's output up to the save has reached it: milliseconds, unless it is frozen).
UNLOGGED_REPLY_SECONDS = 10.0
# Standalone mode keeps its store here, relative to the working directory.
LOCAL_DIR = ".spotnb-local"


class FenceUnknown(RuntimeError):
    """The agent did not answer whether it still holds the lease: nothing was made
    current; the next save tries again."""


class Upload(Protocol):
    """A checkpoint upload (``spotnb.train.runtime``'s) that :meth:`Session.finish` waits for."""

    step: int
    error: BaseException | None

    def wait(self) -> Manifest | None: ...


class SyncedDir(Protocol):
    """A directory kept in the job's store (``spotnb.train.syncdir.SyncDir``), as the session
    drives it: woken by a notice, saved before the cell parks, closed at the end."""

    path: Path

    def wake(self) -> None: ...

    def sync_quietly(self) -> BaseException | None: ...

    def stop(self) -> None: ...

    def close(self) -> BaseException | None: ...


class Session:
    """Per-process state: where the job lives, the channel, notices, background work."""

    def __init__(
        self,
        *,
        remote: bool,
        job_id: str,
        attempt: int,
        instance_id: str,
        store: Store,
        every: CheckpointEvery,
        keep: int,
        scratch: Path | None,
        restore_dir: Path | None,
        socket_path: str | None,
        notice_seconds: float = EC2_NOTICE_SECONDS,
        slot: int = 0,
    ) -> None:
        self.remote = remote
        self.job_id = job_id
        self.attempt = attempt
        self.instance_id = instance_id
        #: The lease this attempt's agent holds: its node slot's in a distributed job
        #: (``SPOTNB_SLOT``), else the job's (slot 0).
        self.slot = slot
        self.store = store
        self.every = every
        self.keep = keep
        self._scratch = scratch
        self._own_scratch = False
        self.restore_dir = restore_dir
        self.notice_seconds = notice_seconds
        self._notice_fit_checked = False
        # Notice state, written by the receiver thread, read by the cell's thread.
        self.notice: str | None = None
        self.interrupt_pending = False
        self.force_save = False
        self.park_requested = False
        self.join_requested = False  # a node waits to join (a distributed job)
        self.has_checkpoint = False  # the cell made a spot.Checkpoint
        self.fenced = False
        #: The rows of ``spot.log``: sent, and kept until durable (or, standalone, kept).
        self.rows = MetricRows(remote=remote)
        #: What this kernel knows of its agent's life; it stops the kernel while silent.
        self.watchdog = Watchdog()
        # The questions asked of the agent (fence, unlogged), by id, awaiting replies.
        self._asks_lock = threading.Lock()
        self._fence_replies: dict[int, tuple[threading.Event, list[bool | None]]] = {}
        self._unlogged_replies: dict[
            int, tuple[threading.Event, list[channel.UnloggedReply]]] = {}
        self._fence_ids = 0
        #: Hyperparameters given to ``spot.log_params`` (also sent to the agent).
        self.params: dict[str, Any] = {}
        self.total: int | None = None
        self.sync_dirs: dict[str, SyncedDir] = {}
        # The newest checkpoint upload: the end of the job waits until it is durable.
        self.last_upload: Upload | None = None
        self._stop = threading.Event()
        self.channel: AgentChannel | None = None
        if socket_path:
            try:
                self.channel = AgentChannel(socket_path, self._on_message)
            except OSError as e:
                _logger.warning("cannot connect to the spotnb agent at %s (%s); metrics and "
                                "notices are not available in this kernel", socket_path, e)
            else:
                self.send(channel.Hello(pid=os.getpid()))
        self._drainer = threading.Thread(target=self._drain_loop, name="spotnb-metrics",
                                         daemon=True)
        self._drainer.start()
        if self.channel is not None:
            self.watchdog.start(self.channel, self._stop)

    @classmethod
    def from_env(cls) -> Session:
        """A session for this process: a job's if ``SPOTNB_JOB_URI`` is set (then the
        other variables of :mod:`spotnb.kernel_remote.channel` apply), else standalone."""
        env = os.environ
        uri = env.get(channel.ENV_JOB_URI)
        if not uri:
            return cls(remote=False, job_id="local", attempt=0, instance_id="local",
                       store=LocalStore(Path.cwd() / LOCAL_DIR), every=CheckpointEvery(),
                       keep=3, scratch=None, restore_dir=None, socket_path=None)
        every = CheckpointEvery()
        raw_every = env.get(channel.ENV_CHECKPOINT_EVERY)
        if raw_every:
            try:
                parsed = json.loads(raw_every)
                every = CheckpointEvery(seconds=parsed.get("seconds"), steps=parsed.get("steps"))
            except (ValueError, TypeError, AttributeError):
                _logger.warning("ignoring %s=%r: not JSON like {\"seconds\": 60}; saving "
                                "every 5 minutes", channel.ENV_CHECKPOINT_EVERY, raw_every)
        scratch = env.get(channel.ENV_SCRATCH)
        restore = env.get(channel.ENV_RESTORE_DIR)
        try:
            notice = float(env.get(channel.ENV_NOTICE_SECONDS) or EC2_NOTICE_SECONDS)
        except ValueError:
            notice = EC2_NOTICE_SECONDS
        return cls(
            remote=True,
            job_id=env.get(channel.ENV_JOB_ID, "unknown"),
            attempt=int(env.get(channel.ENV_ATTEMPT, "0")),
            instance_id=env.get(channel.ENV_INSTANCE_ID, socket.gethostname()),
            store=open_store(uri),
            every=every,
            keep=int(env.get(channel.ENV_KEEP_CHECKPOINTS, "3")),
            scratch=Path(scratch) if scratch else None,
            restore_dir=Path(restore) if restore else None,
            socket_path=env.get(channel.ENV_SOCKET),
            notice_seconds=notice,
            slot=int(env.get(channel.ENV_SLOT) or 0),
        )

    @property
    def scratch(self) -> Path:
        """A local directory for this attempt's temporary files."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="spotnb-scratch-"))
            self._own_scratch = True
        self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def fence(self) -> bool:
        """Whether this attempt still holds its lease (the job's, or its node slot's in a
        distributed job; always true standalone).

        Asks the agent, which knows (its last confirmed renewal); raises
        :class:`FenceUnknown` if it does not answer. Without a channel to the agent,
        reads the lease from the store.
        """
        if not self.remote:
            return True
        while True:
            chan = self.channel
            if chan is None or chan.broken or not self.watchdog.pinged:
                return lease_mod.still_holds(self.store, self.attempt, self.instance_id,
                                             slot=self.slot)
            with self._asks_lock:
                self._fence_ids += 1
                ask = self._fence_ids
                answer: tuple[threading.Event, list[bool | None]] = (threading.Event(), [])
                self._fence_replies[ask] = answer
            try:
                if not chan.send(channel.Fence(id=ask)):
                    return lease_mod.still_holds(self.store, self.attempt,
                                                 self.instance_id, slot=self.slot)
                if not answer[0].wait(FENCE_REPLY_SECONDS):
                    raise FenceUnknown(
                        f"the spotnb agent did not answer within {FENCE_REPLY_SECONDS:g} s "
                        "whether it still holds the job's lease")
                holds = answer[1][0]
            finally:
                self._fence_replies.pop(ask, None)
            if holds is not None:
                return holds
            # The agent could not confirm the lease (the store fails): neither held nor
            # lost. Wait until it knows; it pauses this kernel meanwhile anyway.
            time.sleep(FENCE_RETRY_SECONDS)

    def send(self, message: channel.Message) -> None:
        """Send ``message`` to the agent (standalone: nowhere)."""
        if self.channel is not None:
            self.channel.send(message)

    @property
    def _say_level(self) -> int:
        # Under an agent, notices and parking are events the notebook shows as its own
        # one line each; a warning on the kernel's stderr would say it twice.
        return logging.INFO if self.channel is not None else logging.WARNING

    def report_total(self, total: int, source: str) -> None:
        """The run's total number of steps (``spot.progress``, or the loop's range)."""
        self.total = total
        self.send(channel.Progress(total=total, source=source))

    # -- notices ---------------------------------------------------------------------

    def check_notice_fit(self, nbytes: int, seconds: float) -> None:
        """After a durable save: warn once if a save this long would not fit a notice.

        The first save of the session tells the real size and the measured time to
        durable (:class:`spotnb.ckpt.notice.NoticeFit`); the warning becomes an event
        the notebook shows.
        """
        if not self.remote or self._notice_fit_checked:
            return
        self._notice_fit_checked = True
        fit = NoticeFit(nbytes, seconds, self.notice_seconds, measured=True)
        if fit.fits:
            return
        text = fit.advice()
        _logger.warning("%s", text)
        self.send(channel.Caution(kind="notice-fit", text=text))

    def _on_message(self, message: dict[str, Any]) -> None:
        """A message from the agent, handled through :meth:`handlers` (by its op); an op
        the runtime does not know is ignored (an agent of a newer spotnb)."""
        self.watchdog.on_message()
        try:
            typed = channel.parse(message, channel.TO_RUNTIME)
        except channel.UnknownOp as err:
            _logger.debug("ignoring %s from the agent", err.op)
            return
        self.handlers()[typed.op](typed)

    def handlers(self) -> dict[str, Callable[[Any], None]]:
        """The handler of each op the runtime accepts (:data:`channel.TO_RUNTIME`)."""
        return {channel.Ping.op: self._on_ping, channel.Durable.op: self._on_durable,
                channel.UnloggedReply.op: self._on_unlogged,
                channel.FenceReply.op: self._on_fence, channel.Error.op: self._on_error,
                channel.Notice.op: self._on_notice}

    def _on_ping(self, message: channel.Ping) -> None:
        self.watchdog.on_ping(message.until)

    def _on_durable(self, message: channel.Durable) -> None:
        self.rows.durable_until(message.t)

    def _on_unlogged(self, message: channel.UnloggedReply) -> None:
        asked = self._unlogged_replies.get(message.id)
        if asked is not None:
            asked[1].append(message)
            asked[0].set()

    def _on_fence(self, message: channel.FenceReply) -> None:
        answer = self._fence_replies.get(message.id)
        if answer is not None:
            answer[1].append(None if message.unknown else message.ok)
            answer[0].set()

    def _on_error(self, message: channel.Error) -> None:
        _logger.warning("the spotnb agent could not handle a message (%s): %s",
                        message.about, message.error)

    def _on_notice(self, message: channel.Notice) -> None:
        kind = message.kind
        if kind == "join":
            # A node waits to join this distributed job: every rank saves at the same
            # step, then the world re-forms with it (spotnb.kernel_remote.multinode.node).
            if not self.has_checkpoint:  # nothing to save: re-form now
                self.send(channel.Reform(step=None, join=True))
                return
            _logger.log(self._say_level, "a node waits to join: saving at the next "
                        "maybe_save, then the world re-forms")
            self.join_requested = True
            self.force_save = True
            return
        _logger.log(self._say_level, "spot %s notice (%s): saving at the next opportunity",
                    kind, message.action)
        self.notice = kind
        if kind == "instance-action":
            self.interrupt_pending = True
            self.park_requested = True
        self.force_save = True
        for sd in list(self.sync_dirs.values()):
            sd.wake()

    @property
    def save_requested(self) -> bool:
        """Whether the next step should save: a notice is pending (or the lease was
        lost, which a save turns into holding the cell)."""
        return self.force_save or self.park_requested or self.fenced

    def park(self, step: int) -> NoReturn:
        """Report the forced save durable and hold the cell until the instance is gone."""
        self.drain()
        for sd in list(self.sync_dirs.values()):
            sd.sync_quietly()
            sd.stop()  # the agent gives the lease up on "parked": no upload after it
        self.send(channel.Parked(step=step))
        _logger.log(self._say_level, "interruption: the checkpoint of step %d is durable; "
                    "holding the cell until the instance is terminated (the job resumes on "
                    "a new instance)", step)
        while True:
            time.sleep(_PARK_SLEEP_SECONDS)

    def hold_for_reform(self, step: int) -> NoReturn:
        """A node of this distributed job leaves after the checkpoint of ``step``: ask
        the agent to re-form the world without it, and hold the cell until it does
        (torchelastic restarts this worker; spotnb.kernel_remote.multinode)."""
        self.drain()
        if self.join_requested and not self.interrupt_pending:
            self.send(channel.Reform(step=step, join=True))
            _logger.log(self._say_level, "the checkpoint of step %d is durable; holding "
                        "the cell while the world re-forms with the node that joins", step)
        else:
            self.send(channel.Reform(step=step))
            _logger.warning("a node leaves after the checkpoint of step %d; holding the "
                            "cell while the world re-forms without it", step)
        while True:
            time.sleep(_PARK_SLEEP_SECONDS)

    def hold_fenced(self) -> NoReturn:
        """Another agent took the job over: write nothing more, run nothing more."""
        self.drain()
        _logger.error("this instance lost the job's lease to another agent; the cell is "
                      "held and nothing more is written (the other agent carries on)")
        while True:
            time.sleep(_PARK_SLEEP_SECONDS)

    # -- metrics ---------------------------------------------------------------------

    def rows_not_durable(self) -> list[list[Any]]:
        """Every row logged so far that the log has not confirmed: what a checkpoint
        must carry so that no step it covers loses its metrics."""
        self.drain()
        return self.rows.not_durable()

    def carry(self) -> Carry:
        """What a checkpoint saved now must carry so that no step it covers loses its
        metrics or output (DESIGN invariant 8): every row logged so far that the log
        has not confirmed, and the events (output lines...) the agent holds unwritten."""
        rows = self.rows_not_durable()  # sent first: the agent records them before it answers
        return Carry(rows, self.unlogged_events())

    def unlogged_events(self) -> list[str]:
        """The events this attempt's agent has emitted and not yet written (JSON lines),
        everything printed so far included; [] without an agent that answers."""
        chan = self.channel
        if not self.remote or chan is None or chan.broken or not self.watchdog.pinged \
                or os.environ.get("RANK", "0") != "0":
            return []  # a distributed job: global rank 0's checkpoints carry its node's
        token = uuid.uuid4().hex
        marked = mark_output(token)
        with self._asks_lock:
            self._fence_ids += 1
            ask = self._fence_ids
            asked: tuple[threading.Event, list[channel.UnloggedReply]] = (threading.Event(),
                                                                         [])
            self._unlogged_replies[ask] = asked
        try:
            if not chan.send(channel.Unlogged(id=ask, mark=token if marked else None)):
                return []
            if not asked[0].wait(UNLOGGED_REPLY_SECONDS):
                _logger.warning("the spotnb agent did not say within %g s which events its "
                                "log lacks; this checkpoint carries none",
                                UNLOGGED_REPLY_SECONDS)
                return []
            events = asked[1][0].events
        finally:
            self._unlogged_replies.pop(ask, None)
        return events

    def sync(self, token: str) -> None:
        """After a failed cell: wait for the checkpoint upload in progress (a save the
        cell asked for before it failed is durable before the failure is recorded, so
        that a retry resumes from it), send every row logged so far, then a marker the
        agent waits for. Not in a distributed job: there a failed cell is most often a
        broken world (a peer gone), whose save may never commit, and the survivors
        re-form from the last durable checkpoint at once."""
        if self.last_upload is not None and int(os.environ.get("WORLD_SIZE") or 1) <= 1:
            self.last_upload.wait()
        self.drain()
        self.send(channel.Mark(token=token))

    def _drain_loop(self) -> None:
        reported = time.monotonic()
        while not self._stop.wait(_DRAIN_SECONDS):
            try:
                self.drain()
                if time.monotonic() - reported >= USAGE_SECONDS:
                    reported = time.monotonic()
                    self.report_usage()
            except Exception:
                _logger.exception("sending metrics failed; will retry")

    def report_usage(self) -> None:
        """Tell the agent the AWS requests this kernel made (checkpoint uploads...): the
        cost a job shows includes them (spotnb.protocol.usage)."""
        counts = usage.snapshot()
        if counts:
            self.send(channel.Usage(requests=counts))

    def drain(self) -> None:
        """Convert the rows logged so far and send them (or keep them, standalone)."""
        self.rows.drain(self.send if self.channel is not None else None)

    # -- the end ---------------------------------------------------------------------

    def finish(self) -> list[str]:
        """Wait until everything is sent and durable, then close; return what failed.

        Waits for the newest checkpoint upload, uploads every synced directory a last
        time, sends the remaining metrics and closes the channel.
        """
        problems = []
        if self.last_upload is not None and self.last_upload.wait() is None \
                and self.last_upload.error is not None:
            problems.append(f"the checkpoint of step {self.last_upload.step} could not be "
                            f"made durable: {self.last_upload.error}")
        for sd in list(self.sync_dirs.values()):
            error = sd.close()
            if error is not None:
                problems.append(f"the last upload of {sd.path} failed: {error}")
        self._stop.set()
        self._drainer.join(timeout=10)
        self.drain()
        self.report_usage()
        if self.channel is not None:
            self.channel.close()
        if self._own_scratch and self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        return problems
