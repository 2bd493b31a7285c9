"""One node of a distributed job, as its agent runs it: torchelastic, generation by
generation, with the cell in one kernel per local worker.

The agent (:mod:`spotnb.kernel_remote.agent`) holds the lease of one node slot and
writes the event stream of its attempt; :class:`NodeRun` is the rest of its tenure::

    Step 1  the rendezvous record (spotnb.kernel_remote.multinode.rendezvous): join its generation,
            or become the host of the first one / of the next one when the host left.
    Step 2  run torchelastic's agent (KernelElasticAgent) for that generation, in a
            thread: rendezvous with the other nodes (MIN..MAX), start one kernel per
            local worker with torchrun's environment, run the cell in each.
    Step 3  whatever ends the elastic run decides what next:
              every cell finished         -> the node of global rank 0 writes the
                                             result; the others wait for it; done
              this node leaves (its notice, after the coordinated checkpoint)
                                          -> the lease is released; done
              the job ended (result, stop) -> done
              a user error in the cell    -> failed result (or a retry: re-form)
              the rendezvous moved on     -> Step 1 with the new generation
              the rendezvous store is lost (its host died) -> Step 1: elect a host

Worker outcomes, as :meth:`NodeRun.monitor` reports them to torchelastic: a cell
still running is HEALTHY; every local cell finished is SUCCEEDED; a cell that failed
because a peer is gone (a collective's connection broke or timed out:
:func:`peer_error`), a round that lost a node (its rendezvous heartbeat stopped), or a
runtime asking to re-form after the checkpoint of a node's notice, is UNHEALTHY:
torchelastic restarts the workers, which re-runs the cell from its last checkpoint in a
new round (N-1 nodes, or N again when a replacement waits). An error in the user's code
is neither: it fails the job like on one node (or is retried, re-forming the world,
within ``--max-restarts-on-error``).

Kernels boot ahead: the next round's kernels are spawned as soon as the previous ones
are stopped, so they start while the rendezvous completes; a round's settings
(``RANK``, ``WORLD_SIZE``, ...) reach them with the bootstrap. A warm standby's node
(:class:`spotnb.kernel_remote.standby.NodeStandby`) joins with the kernels it started
while it waited for its slot, and the checkpoint it downloaded meanwhile.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from spotnb.kernel_remote import channel
from spotnb.kernel_remote.kernel import KernelNotReady, KernelProcess
from spotnb.kernel_remote.kernels import BOOTSTRAP
from spotnb.kernel_remote.leasing import Fenced, holder_gone_check
from spotnb.kernel_remote.multinode import (
    EXIT_BARRIER_SECONDS,
    JOIN_SAVE_SECONDS,
    JOIN_TIMEOUT_SECONDS,
    KEEP_ALIVE_MISSES,
    KEEP_ALIVE_SECONDS,
    LAST_CALL_SECONDS,
    MAX_REFORMATIONS,
    MONITOR_SECONDS,
    RESULT_WAIT_SECONDS,
    RETRY_SECONDS,
    ROLE,
)
from spotnb.kernel_remote.multinode import rendezvous as rdzv
from spotnb.kernel_remote.multinode.elastic import KernelElasticAgent
from spotnb.protocol import layout, lease

if TYPE_CHECKING:
    from spotnb.kernel_remote.standby import NodeStandby
    from spotnb.protocol.lease import HeldLease
    from spotnb.protocol.spec import JobSpec
    from spotnb.protocol.store import Store

__all__ = ["Agent", "NodeRun", "peer_error"]

T = TypeVar("T")


class Agent(Protocol):
    """What a node's run uses of its agent: the public interface of
    :class:`spotnb.kernel_remote.agent.Agent`, which makes the run."""

    spec: JobSpec
    store: Store
    identity: dict[str, Any]
    scratch: Path

    @property
    def held(self) -> HeldLease | None: ...

    @property
    def fenced(self) -> threading.Event: ...

    @property
    def terminating(self) -> threading.Event: ...

    @property
    def stop_requested(self) -> dict[str, Any] | None: ...

    def stop_reason(self) -> str: ...

    def emit(self, type: str, **data: Any) -> None: ...

    def flush_soon(self) -> None: ...

    def send(self, msg: channel.Message) -> None: ...

    def drain_channel(self) -> None: ...

    def execute(self, kc: Any, code: str, silent: bool, kernel: KernelProcess | None = None,
                rank: int | None = None) -> dict[str, Any] | None: ...

    def sync_runtime(self, kc: Any, kernel: KernelProcess | None = None) -> None: ...

    def start_kernel(self, name: str | None) -> KernelProcess: ...

    def forget_kernel(self, kernel: KernelProcess) -> None: ...

    def prefetch(self, dest: Path, ranks: Sequence[int] | None = None,
                 world_size: int | None = None) -> None: ...

    def retry(self, fn: Callable[[], T], what: str) -> T: ...

    def write(self, fn: Callable[[], T], what: str) -> T: ...

    def finish(self, status: str, reason: str, error: dict[str, Any] | None = None) -> str: ...

    def close_quietly(self) -> None: ...

log = logging.getLogger(__name__)

# Error names of torch.distributed's own failures (NCCL raises these, and stores).
_DIST_ERRORS = frozenset({"DistError", "DistBackendError", "DistNetworkError",
                          "DistStoreError"})
# What gloo says when a peer's connection breaks or a collective times out: gloo
# raises a plain RuntimeError from its transport ("[.../gloo/transport/tcp/pair.cc:537]
# Read error ...: Connection reset by peer", "Timed out waiting ... for recv").
_GLOO_MARKS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
               "Connection refused", "Broken pipe")


def peer_error(error: dict[str, Any]) -> bool:
    """Whether a cell's error says that a peer is gone rather than that the code failed.

    torch.distributed's own errors (``DistBackendError``: NCCL; ``DistStoreError``,
    ``DistNetworkError``) and gloo's transport errors (a ``RuntimeError`` naming its
    transport or a broken connection).
    """
    name = str(error.get("ename", ""))
    if name in _DIST_ERRORS:
        return True
    text = str(error.get("evalue", ""))
    return name == "RuntimeError" and any(mark in text for mark in _GLOO_MARKS)


class _Ended(Exception):
    """The job ended (a result, or a stop request) while this node trained."""


class _Moved(Exception):
    """The rendezvous moved to a new generation (its host left)."""


class _Leave(Exception):
    """This node leaves: its final checkpoint is durable, its instance goes."""


class _UserError(Exception):
    def __init__(self, run: WorkerRun) -> None:
        super().__init__(run.error)
        self.run = run


class _SaveBeforeJoin:
    """torchelastic's rendezvous handler, whose ``num_nodes_waiting`` answers once the
    checkpoint before a join is durable (:meth:`NodeRun.nodes_waiting`); everything
    else is the handler's own."""

    def __init__(self, handler: Any, node: NodeRun) -> None:
        self._handler = handler
        self._node = node

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def num_nodes_waiting(self) -> int:
        return self._node.nodes_waiting(int(self._handler.num_nodes_waiting()))


class WorkerRun:
    """One local worker of one round: a kernel that runs the cell, on its own thread.

    ``state``: starting, running, succeeded, peer (a peer is gone), user (the cell
    failed), stopped (the node stopped it), fenced (the agent lost its lease).
    """

    def __init__(self, node: NodeRun, local_rank: int, kernel: KernelProcess,
                 env: dict[str, str]) -> None:
        self.node = node
        self.local_rank = local_rank
        self.rank = int(env["RANK"])
        self.kernel = kernel
        self.env = env
        self.kc: Any = None
        self.state = "starting"
        self.error: dict[str, Any] | None = None
        self.thread = threading.Thread(target=self._run, name=f"worker-{local_rank}",
                                       daemon=True)

    def _run(self) -> None:
        agent = self.node.agent
        try:
            try:
                self.kc = self.kernel.connect(timeout=self.node.kernel_timeout)
            except KernelNotReady as e:
                self._end("user", {"ename": "KernelDied", "evalue": str(e),
                                   "traceback": [str(e)]})
                return
            boot = agent.execute(self.kc, BOOTSTRAP.format(env=self.env), silent=True,
                                  kernel=self.kernel, rank=self.rank)
            if boot:
                self._end("stopped" if self.node.stopping else "user", boot)
                return
            self.state = "running"
            if self.local_rank == 0:
                agent.emit("status", state="running", detail="running the cell")
            error = agent.execute(self.kc, agent.spec.code, silent=False,
                                   kernel=self.kernel, rank=self.rank)
            if error:
                self._end(self._classify(error), error)
                return
            # Global rank 0's outputs are the job's; every rank waits for its uploads.
            if self.rank == 0 and agent.spec.outputs:
                out = agent.execute(self.kc, "_spotnb_runtime._save_outputs("
                                     f"{list(agent.spec.outputs)!r})", silent=True,
                                     kernel=self.kernel, rank=self.rank)
                if out:
                    self._end("stopped" if self.node.stopping else "user", out)
                    return
            fin = agent.execute(self.kc, "_spotnb_runtime._finish()", silent=True,
                                 kernel=self.kernel, rank=self.rank)
            if fin:
                self._end(self._classify(fin), fin)
                return
            self.state = "succeeded"
        except Fenced:
            self.state = "fenced"
        except Exception:
            if self.node.stopping:
                # Its kernel was killed under it (a re-formation): expected.
                log.debug("worker %d ended while stopping", self.local_rank, exc_info=True)
                self.state = "stopped"
                return
            log.exception("worker %d failed", self.local_rank)
            if not self.node.stopping:
                self._end("user", {"ename": "AgentError", "evalue": "the agent failed "
                                   "running the cell (see the agent's log)", "traceback": []})
        finally:
            self.node.wake.set()

    def _classify(self, error: dict[str, Any]) -> str:
        if self.node.stopping or self.node.agent.stop_requested:
            return "stopped"
        return "peer" if peer_error(error) else "user"

    def _end(self, state: str, error: dict[str, Any] | None) -> None:
        self.error = error
        self.state = state


class NodeRun:
    """The agent's tenure of a node slot in a distributed job (module docstring)."""

    def __init__(self, agent: Agent, kernel_timeout: float,
                 warm: NodeStandby | None = None) -> None:
        self.agent = agent
        self.spec = agent.spec
        self.store = agent.store
        self.kernel_timeout = kernel_timeout
        assert agent.held is not None
        self.slot = agent.held.lease.slot
        self.me = str(agent.identity["instance_id"])
        self.address = str(agent.identity.get("address") or "127.0.0.1")
        res = self.spec.resources
        self.procs = res.procs_per_node
        self.peer_timeout = self.spec.policy.peer_timeout
        gone = holder_gone_check(self.spec)
        # The provider's check reads a lease's holder: ask it about an instance.
        self._instance_gone = (
            lambda instance: bool(gone(lease.Lease(epoch=0, holder=instance, heartbeat=0.0)))
        ) if gone is not None else None
        self.record: rdzv.Record | None = None
        self.hosted: dict[int, rdzv.HostedStore] = {}  # generation -> our store server
        self.workers: list[WorkerRun] = []
        self.spares: list[KernelProcess] = []
        # A standby's warm-up (spotnb.kernel_remote.standby.NodeStandby): its kernels
        # are the first round's workers, its download that round's restore directory.
        self._warm_dir: Path | None = None
        if warm is not None:
            for kernel in warm.spares:
                if kernel.alive:
                    self.spares.append(kernel)
                else:
                    kernel.kill()
                    agent.forget_kernel(kernel)
            self._warm_dir = warm.restore_dir
        self.group: WorkerGroup | None = None
        self.rank0_here = False
        # stopping: the workers are being stopped (a kernel that dies now was killed);
        # closing: this tenure ends, no more kernels are spawned ahead.
        self.stopping = False
        self.closing = False
        self.rounds = 0
        # A node waits to join (torchelastic's num_nodes_waiting): when this node asked
        # its runtimes for the save before the join (monotonic), and the step of that
        # save once durable; the slots held at this round's start (rank 0's node).
        self.join_asked: float | None = None
        self.join_step: int | None = None
        self.after_join: int | None = None
        self.round_slots: set[int] | None = None
        self._slots_before: set[int] | None = None
        # Set by the agent's threads: wake the waiting loop.
        self.wake = threading.Event()
        self.leaving = threading.Event()
        self.reform = threading.Event()
        self.ended = threading.Event()
        self._lock = threading.Lock()

    # -- called by the agent -----------------------------------------------------------

    def on_notice(self) -> None:
        """This instance got its interruption notice: if it hosts the rendezvous, vacate
        the generation now, before the runtime hears of the notice, so the staying
        nodes find a new host when they re-form after the coordinated checkpoint."""
        record = self.record
        if record is None or record.host != self.me or record.vacant:
            return
        try:
            self.agent.retry(lambda: rdzv.vacate(
                self.store, record, f"its host {self.me} got an interruption notice"),
                "vacating the rendezvous")
        except Exception:
            log.warning("could not vacate the rendezvous; the staying nodes elect a new "
                        "host when they lose this one", exc_info=True)

    def on_parked(self) -> None:
        """This node's final checkpoint is durable: it leaves the world."""
        self.leaving.set()
        self.wake.set()

    def on_reform(self, step: int | None = None, join: bool = False) -> None:
        """A runtime asks to re-form: a node leaves after the coordinated checkpoint,
        or (``join``) one waits to join and the checkpoint of ``step`` is durable."""
        if join:
            self.join_step = step
        self.reform.set()
        self.wake.set()

    def nodes_waiting(self, waiting: int) -> int:
        """torchelastic's ``num_nodes_waiting``, after the save before a join.

        A node waiting to join makes torchelastic restart the workers, which would
        redo every step since the last checkpoint on every rank. So the first time a
        node waits while the cell runs, the runtimes are asked to save (the notice's
        coordinated checkpoint: every rank at the same step), and torchelastic is told
        no node waits until that save is durable and the runtimes ask to re-form (the
        workers are then UNHEALTHY: the same restart, from the new checkpoint). A cell
        that saves nothing within JOIN_SAVE_SECONDS re-forms without it.
        """
        if waiting <= 0 or self.reform.is_set():
            return waiting
        runs = list(self.workers)
        if not runs or any(r.state != "running" for r in runs):
            return waiting  # no cell runs yet: nothing to lose
        if self.join_asked is None:
            self.join_asked = time.monotonic()
            self.agent.emit("status", state="checkpointing", detail=(
                f"{waiting} node{'s' if waiting != 1 else ''} waiting to join: every rank "
                "saves at its next maybe_save, then the world re-forms"))
            self.agent.send(channel.Notice(kind="join"))
            return 0
        if time.monotonic() - self.join_asked > JOIN_SAVE_SECONDS:
            return waiting
        return 0

    def on_restored(self, step: int) -> None:
        """A runtime restored the checkpoint of ``step``: after a join, global rank 0's
        node says who joined, the step saved before re-forming and the one restored
        (``joined`` event; the steps redone are the fold's, from the rows that follow:
        every rank held at the join's save, so none, unless that save could not be read
        and an older one was)."""
        if self.after_join is None or not self.rank0_here or self.group is None:
            return
        before, self.after_join = self.after_join, None
        joined = sorted((self.round_slots or set()) - self._slots_before) \
            if self._slots_before is not None else []
        self.agent.emit("joined", nodes=joined, node_count=self.group.group_world_size,
                         world_size=self.group.workers[0].world_size, step=step,
                         saved_step=before)
        self.agent.flush_soon()

    def _held_slots(self) -> set[int] | None:
        """The node slots whose lease is held now (who is in the world), or None."""
        try:
            found = set()
            for slot in range(self.spec.resources.max_nodes):
                current = lease.read(self.store, slot)
                if current is None or current[0].released:
                    continue
                gone = self._instance_gone
                if slot == self.slot or gone is None or not gone(current[0].holder):
                    found.add(slot)
            return found
        except Exception:
            return None

    def on_job_ended(self) -> None:
        self.ended.set()
        self.wake.set()

    # -- the tenure --------------------------------------------------------------------

    def run(self) -> str:
        """Train until the job ends for this node; what happened: completed, failed,
        stopped, ended (someone else wrote the result), left (after its notice)."""
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see _elastic_agent
        self._spawn_spares()
        try:
            while True:
                if self.ended.is_set() or self._job_ended():
                    return self._end_of_job()
                record = self._generation()
                outcome = self._run_generation(record)
                if outcome is not None:
                    return outcome
        finally:
            self.closing = True
            self.stop()
            self._kill_spares()
            for hosted in self.hosted.values():
                hosted.close()

    def _generation(self) -> rdzv.Record:
        """Step 1: the generation to join; become its host if it has none (or a dead
        one)."""
        while True:
            current = self.agent.retry(lambda: rdzv.read(self.store), "reading rendezvous")
            if current is not None and not current[0].vacant and (
                    current[0].host == self.me
                    or rdzv.host_alive(self.store, current[0], self._instance_gone)):
                self.record = current[0]
                return current[0]
            if current is None:
                reason = "the first node"
            elif current[0].vacant:
                reason = current[0].reason or "the generation had no host"
            else:
                reason = f"its host {current[0].host} is gone"
            record, hosted = rdzv.elect(self.store, self.spec.job_id, self.me, self.slot,
                                        self.address, current, reason, self.peer_timeout)
            if hosted is not None:
                self.hosted[record.generation] = hosted
                self.agent.emit("status", state="launching", detail=(
                    f"this node hosts the rendezvous, generation {record.generation} "
                    f"({reason})"))
            self.record = record
            if not record.vacant:
                return record

    def _run_generation(self, record: rdzv.Record) -> str | None:
        """Step 2-3: one elastic run; the job's outcome for this node, or None to go on
        with the next generation."""
        outcome: list[Any] = []

        def elastic() -> None:
            agent = None
            try:
                agent = self._elastic_agent(record)
                outcome.append(agent.run())
                if outcome and isinstance(outcome[0], RunResult) and \
                        outcome[0].state == WorkerState.SUCCEEDED:
                    # torchrun closes the rendezvous when the job succeeded.
                    agent.get_worker_group().spec.rdzv_handler.shutdown()
            except _Leave as e:
                # Out of the round now: the staying nodes re-form without this node
                # at once, however long this process lives on (rdzv.leave_round).
                if agent is not None:
                    rdzv.leave_round(agent.get_worker_group().spec.rdzv_handler,
                                     self.peer_timeout)
                outcome.append(e)
            except BaseException as e:
                outcome.append(e)
            finally:
                self.wake.set()

        thread = threading.Thread(target=elastic, name=f"elastic-g{record.generation}",
                                  daemon=True)
        thread.start()
        while not outcome:
            self.wake.wait(MONITOR_SECONDS)
            self.wake.clear()
            # torchelastic may be blocked in a rendezvous: do not wait for it to notice.
            if (self.leaving.is_set() or self.ended.is_set()) and not self.workers:
                break
        result = outcome[0] if outcome else (_Leave() if self.leaving.is_set() else _Ended())
        return self._after(record, result)

    def _after(self, record: rdzv.Record, result: Any) -> str | None:
        if isinstance(result, Fenced):
            raise result
        if isinstance(result, _Leave) or self.leaving.is_set():
            return "left"
        if isinstance(result, _Ended):
            return self._end_of_job()
        if isinstance(result, _Moved):
            return None
        if isinstance(result, _UserError):
            return self._user_error(result.run)
        if isinstance(result, RunResult):
            if result.state == WorkerState.SUCCEEDED:
                return self._succeeded()
            if result.state == WorkerState.FAILED:
                # MAX_REFORMATIONS restarts in one generation: something is broken.
                return self.agent.finish(
                    "failed", f"the workers failed {MAX_REFORMATIONS} times in a row")
            return None  # ended without a result: graceful exit of a closed rendezvous
        # The rendezvous failed (its store is gone, or it timed out waiting for nodes):
        # Step 1 decides whether the host is gone.
        if self._job_ended():
            return self._end_of_job()
        log.warning("the elastic run of generation %d ended: %s: %s; looking at the "
                    "rendezvous again", record.generation, type(result).__name__, result)
        self.wake.wait(RETRY_SECONDS)
        return None

    def _elastic_agent(self, record: rdzv.Record) -> KernelElasticAgent:
        """torchelastic's agent for one generation (what ``torchrun --nnodes MIN:MAX
        --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` builds), with spotnb's store
        host as the rendezvous endpoint, joined as a client."""
        from torch.distributed.elastic.agent.server.api import WorkerSpec
        from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

        res = self.spec.resources
        assert record.endpoint is not None
        params = RendezvousParameters(
            backend="c10d", endpoint=record.endpoint, run_id=record.run_id,
            min_nodes=res.min_nodes, max_nodes=res.max_nodes, local_addr=self.address,
            is_host=False, join_timeout=JOIN_TIMEOUT_SECONDS,
            last_call_timeout=LAST_CALL_SECONDS, close_timeout=LAST_CALL_SECONDS,
            keep_alive_interval=KEEP_ALIVE_SECONDS, keep_alive_max_attempt=KEEP_ALIVE_MISSES,
            read_timeout=max(1, int(self.peer_timeout)))
        # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set in run()): each round's rank 0
        # publishes a fresh MASTER_ADDR/PORT. With sharing, a node that joins later
        # waits forever for a MASTER_ADDR that a rank 0 kept from an earlier round
        # never writes again (seen with torch 2.13: the new round hangs).
        handler: Any = _SaveBeforeJoin(registry.get_rendezvous_handler(params), self)
        spec = WorkerSpec(role=ROLE, local_world_size=self.procs, entrypoint="ipykernel",
                          rdzv_handler=handler,
                          max_restarts=MAX_REFORMATIONS, monitor_interval=MONITOR_SECONDS,
                          local_addr=self.address)
        return KernelElasticAgent(spec, self, exit_barrier_timeout=EXIT_BARRIER_SECONDS)

    # -- Workers (KernelElasticAgent's side) -------------------------------------------

    def start(self, group: WorkerGroup, envs: dict[int, dict[str, str]]) -> dict[int, Any]:
        """A round formed: start the local workers with their ranks."""
        agent = self.agent
        assert agent.held is not None and self.record is not None
        self.stopping = False
        self.reform.clear()
        self.group = group
        self.rounds += 1
        self.after_join = self.join_step
        self.join_asked = self.join_step = None
        if 0 in [w.global_rank for w in group.workers]:
            self._slots_before = self.round_slots
            self.round_slots = self._held_slots()
        restore_dir = (self._warm_dir
                       or agent.scratch / f"restore-{agent.held.epoch}-{self.rounds}")
        self._warm_dir = None
        restore_dir.mkdir(parents=True, exist_ok=True)
        ranks = [w.global_rank for w in group.workers]
        self.rank0_here = 0 in ranks
        world = group.workers[0].world_size
        # This node's share of a sharded checkpoint, not the whole (spotnb.ckpt.node_share).
        threading.Thread(target=agent.prefetch, args=(restore_dir, ranks, world),
                         daemon=True).start()
        agent.emit("world", generation=self.record.generation, run_id=self.record.run_id,
                    round=self.rounds, nodes=group.group_world_size, world_size=world,
                    node_rank=group.group_rank, ranks=ranks,
                    master=f"{group.master_addr}:{group.master_port}",
                    rendezvous_host=self.record.host, min_nodes=self.spec.resources.min_nodes,
                    max_nodes=self.spec.resources.max_nodes)
        agent.emit("status", state="restoring", detail=(
            f"world formed: {group.group_world_size} node(s), {world} process(es); this "
            f"node is node {group.group_rank} (ranks {', '.join(map(str, ranks))})"))
        agent.flush_soon()
        base = {channel.ENV_ATTEMPT: str(agent.held.epoch),
                channel.ENV_INSTANCE_ID: self.me,
                channel.ENV_RESTORE_DIR: str(restore_dir),
                channel.ENV_SLOT: str(self.slot)}
        # The job's own --env OMP_NUM_THREADS wins over torchrun's default of one thread.
        threads = "OMP_NUM_THREADS" if self.spec.env.get("OMP_NUM_THREADS") else None
        runs = []
        for worker in group.workers:
            kernel = self.spares.pop(0) if self.spares else self._spawn(worker.local_rank)
            env = {k: v for k, v in envs[worker.local_rank].items() if k != threads}
            runs.append(WorkerRun(self, worker.local_rank, kernel, {**base, **env}))
        with self._lock:
            self.workers = runs
        for run in runs:
            run.thread.start()
        return {run.local_rank: run.kernel.proc.pid for run in runs}

    def monitor(self, group: WorkerGroup) -> RunResult:
        """The workers' state for torchelastic (module docstring); raises to end the
        elastic run when this node leaves, the job ended, or the cell failed."""
        if self.leaving.is_set():
            raise _Leave()
        if self.ended.is_set():
            raise _Ended()
        if self.agent.fenced.is_set() or self.agent.terminating.is_set():
            raise Fenced()
        runs = list(self.workers)
        if any(r.state == "fenced" for r in runs):
            raise Fenced()
        failed = next((r for r in runs if r.state == "user"), None)
        if failed is not None:
            raise _UserError(failed)
        if self.reform.is_set() or any(r.state in ("peer", "stopped") for r in runs):
            return RunResult(state=WorkerState.UNHEALTHY)
        if runs and all(r.state == "succeeded" for r in runs):
            # torchelastic records each worker's return value (the cell's: none).
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={r.rank: None for r in runs})
        if self._round_shrank(group):
            log.warning("a node of this round is gone (its rendezvous heartbeat stopped); "
                        "re-forming")
            return RunResult(state=WorkerState.UNHEALTHY)
        return RunResult(state=WorkerState.HEALTHY)

    def stop(self) -> None:
        """Stop this round's workers; spawn the next round's kernels ahead."""
        with self._lock:
            runs, self.workers = self.workers, []
        if not runs:
            return
        self.stopping = True
        for run in runs:
            run.kernel.kill()
            self.agent.forget_kernel(run.kernel)
        for run in runs:
            run.thread.join(timeout=5)
        if not (self.closing or self.leaving.is_set() or self.ended.is_set()):
            self._spawn_spares()

    def before_restart(self) -> None:
        """Before torchelastic re-forms: the job may have ended, or the rendezvous moved
        to a new generation (its host left): then this elastic run ends."""
        if self.ended.is_set() or self._job_ended():
            raise _Ended()
        current = self.agent.retry(lambda: rdzv.read(self.store), "reading rendezvous")
        if current is not None and self.record is not None and \
                current[0].generation != self.record.generation:
            log.info("the rendezvous moved to generation %d (%s)", current[0].generation,
                     current[0].reason)
            raise _Moved()
        self.agent.emit("status", state="restoring", detail="re-forming the world")

    # -- outcomes --------------------------------------------------------------------

    def _succeeded(self) -> str:
        """Every node's cell finished (torchelastic's exit barrier is passed)."""
        agent = self.agent
        agent.drain_channel()
        if self.rank0_here:
            return agent.finish("completed", "the cell finished")
        # The node of global rank 0 writes the result: wait for it, so the capacity
        # group does not take this agent's exit for a crash.
        deadline = time.monotonic() + RESULT_WAIT_SECONDS
        while not self._job_ended() and time.monotonic() < deadline:
            time.sleep(RETRY_SECONDS)
        agent.close_quietly()
        return "ended"

    def _user_error(self, run: WorkerRun) -> str | None:
        """The cell failed on this node: like one node's (the agent's), except
        that a retry re-forms the world rather than bumping the epoch."""
        agent = self.agent
        assert run.error is not None and agent.held is not None
        if run.kc is not None and run.kernel.alive:
            agent.sync_runtime(run.kc, run.kernel)
        errors = len(agent.retry(lambda: self.store.list_keys("errors/"),
                                  "counting earlier errors"))
        retrying = errors < self.spec.policy.max_restarts_on_error
        key = f"errors/{agent.held.epoch:06d}-{errors:04d}.json"
        body = json.dumps({**run.error, "rank": run.rank}).encode()
        agent.write(lambda: self.store.put(key, body), "the error")
        if retrying:
            agent.emit("error", retrying=True, rank=run.rank, **run.error)
            agent.emit("status", state="booting", retrying=True, detail=(
                f"retrying after {run.error['ename']} on rank {run.rank} ({errors + 1} of "
                f"{self.spec.policy.max_restarts_on_error}): re-forming the world"))
            self.stop()  # the peers' collectives fail now: they re-form too
            return None
        outcome = agent.finish("failed", f"{run.error['ename']} on rank {run.rank}: "
                                              f"{run.error['evalue']}", error=run.error)
        self.stop()
        return outcome

    def _end_of_job(self) -> str:
        """The job ended elsewhere (a result), or a stop request came."""
        agent = self.agent
        if agent.stop_requested and not self._job_ended():
            return agent.finish("stopped", agent.stop_reason())
        agent.close_quietly()
        return "ended"

    def _job_ended(self) -> bool:
        try:
            return self.store.exists(layout.RESULT)
        except Exception:
            return False

    # -- kernels -----------------------------------------------------------------------

    def _spawn(self, local_rank: int) -> KernelProcess:
        return self.agent.start_kernel(f"r{local_rank}")

    def _spawn_spares(self) -> None:
        while len(self.spares) < self.procs:
            self.spares.append(self._spawn(len(self.spares)))

    def _kill_spares(self) -> None:
        spares, self.spares = self.spares, []
        for kernel in spares:
            kernel.kill()
            self.agent.forget_kernel(kernel)

    def _round_shrank(self, group: WorkerGroup) -> bool:
        """Whether a node of this round left it (torchelastic dropped it when its
        rendezvous heartbeat stopped: KEEP_ALIVE_MISSES x KEEP_ALIVE_SECONDS), read
        from the rendezvous state its last sync brought. That state is not public
        API: if its shape changes, this check is skipped (a dead peer then shows as a
        failed collective, within the peer timeout)."""
        holder = getattr(group.spec.rdzv_handler, "_state_holder", None)
        participants = getattr(getattr(holder, "state", None), "participants", None)
        if not isinstance(participants, dict) or group.group_world_size is None:
            return False
        return len(participants) < group.group_world_size

