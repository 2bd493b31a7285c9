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
:func:`~spotnb.kernel_remote.multinode.worker.peer_error`), a round that lost a node
(its rendezvous heartbeat stopped), or a runtime asking to re-form after the checkpoint
of a node's notice, is UNHEALTHY: torchelastic restarts the workers, which re-runs the
cell from its last checkpoint in a new round (N-1 nodes, or N again when a replacement
waits). An error in the user's code is neither: it fails the job like on one node (or
is retried, re-forming the world, within ``--max-restarts-on-error``).

Kernels boot ahead: the first round's are spawned before the agent imports torchelastic,
the next round's as soon as the previous ones are stopped, so they start while the
rendezvous completes, and each imports torch.distributed meanwhile (:func:`spotnb.
kernel_remote.kernels.import_ahead`); a round's settings (``RANK``, ``WORLD_SIZE``,
...) reach them with the bootstrap. A warm standby's node
(:class:`spotnb.kernel_remote.standby.NodeStandby`) joins with the kernels it started
while it waited for its slot, and the checkpoint it downloaded meanwhile.

The run's parts, a module each: :mod:`.worker` (``WorkerRun``: one local worker, a
kernel running the cell), :mod:`.joins` (``Joins``: the save before a node joins, and
who joined), :mod:`.elastic` (torchelastic's agent with kernels as workers, built for a
generation), :mod:`.rendezvous` (who hosts which generation), :mod:`.agentapi` (what
the run uses of its agent).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from spotnb.kernel_remote import channel
from spotnb.kernel_remote.kernel import KernelProcess
from spotnb.kernel_remote.kernels import import_ahead
from spotnb.kernel_remote.leasing import Fenced, holder_gone_check
from spotnb.kernel_remote.multinode import (
    MAX_REFORMATIONS,
    MONITOR_SECONDS,
    RESULT_WAIT_SECONDS,
    RETRY_SECONDS,
)
from spotnb.kernel_remote.multinode import rendezvous as rdzv
from spotnb.kernel_remote.multinode.elastic import elastic_agent, round_shrank
from spotnb.kernel_remote.multinode.joins import Joins
from spotnb.kernel_remote.multinode.worker import WorkerRun
from spotnb.protocol import layout, lease

if TYPE_CHECKING:
    from spotnb.kernel_remote.multinode.agentapi import Agent
    from spotnb.kernel_remote.standby import NodeStandby

__all__ = ["NodeRun"]

log = logging.getLogger(__name__)


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


class NodeRun:
    """The agent's tenure of a node slot in a distributed job (module docstring)."""

    def __init__(self, agent: Agent, kernel_timeout: float,
                 warm: NodeStandby | None = None,
                 spares: Sequence[KernelProcess] = ()) -> None:
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
        # The first round's kernels, if the agent spawned them (attempt.run_node_attempt).
        self.spares: list[KernelProcess] = list(spares)
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
        # A node waits to join (torchelastic's num_nodes_waiting): the save before it,
        # and who joined (spotnb.kernel_remote.multinode.joins).
        self.joins = Joins(agent, self.slot, self._instance_gone)
        # Set by the agent's threads: wake the waiting loop.
        self.wake = threading.Event()
        self.leaving = threading.Event()
        self.reform = threading.Event()
        self.ended = threading.Event()
        self._lock = threading.Lock()
        # A round's workers are being started (start()); a notice found this node with
        # none, and it leaves (on_notice): no round starts after that.
        self._starting = False
        self._gone_idle = False

    # -- called by the agent -----------------------------------------------------------

    def on_notice(self) -> None:
        """This instance got its interruption notice: if it hosts the rendezvous, vacate
        the generation now, before the runtime hears of the notice, so the staying
        nodes find a new host when they re-form after the coordinated checkpoint. A
        node that is not training (no round of its runs: fewer nodes than the job's
        minimum, or a round re-forming) has nothing to save since the checkpoint its
        workers restored from: it leaves now, its node slot given up at once (the job's
        move to another region launches there once its nodes left here have gone)."""
        record = self.record
        if record is not None and record.host == self.me and not record.vacant:
            try:
                self.agent.retry(lambda: rdzv.vacate(
                    self.store, record, f"its host {self.me} got an interruption notice"),
                    "vacating the rendezvous")
            except Exception:
                log.warning("could not vacate the rendezvous; the staying nodes elect a "
                            "new host when they lose this one", exc_info=True)
        with self._lock:
            idle = not self.workers and not self._starting and not self.leaving.is_set()
            self._gone_idle = self._gone_idle or idle  # start() refuses a round now
        if not idle:
            return
        self.agent.emit("status", state="interrupted", detail=(
            "this node is not training (no round of the world runs): nothing to save "
            "since the last checkpoint; it gives up its node slot and goes"))
        if self.agent.held is not None:
            self.agent.done_with_lease()
        self.leaving.set()
        self.wake.set()

    def on_parked(self) -> None:
        """This node's final checkpoint is durable: it leaves the world."""
        self.leaving.set()
        self.wake.set()

    def on_reform(self, step: int | None = None, join: bool = False) -> None:
        """A runtime asks to re-form: a node leaves after the coordinated checkpoint,
        or (``join``) one waits to join and the checkpoint of ``step`` is durable."""
        if join:
            self.joins.join_step = step
        self.reform.set()
        self.wake.set()

    def nodes_waiting(self, waiting: int) -> int:
        """torchelastic's ``num_nodes_waiting``, after the save before a join
        (:meth:`Joins.nodes_waiting`)."""
        return self.joins.nodes_waiting(waiting, self.workers, self.reform.is_set())

    def on_restored(self, step: int) -> None:
        """A runtime restored the checkpoint of ``step`` (after a join, rank 0's node
        says who joined: :meth:`Joins.restored`)."""
        self.joins.restored(step, self.group, self.rank0_here)

    def on_job_ended(self) -> None:
        self.ended.set()
        self.wake.set()

    # -- the tenure --------------------------------------------------------------------

    def run(self) -> str:
        """Train until the job ends for this node; what happened: completed, failed,
        stopped, ended (someone else wrote the result), left (after its notice)."""
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # see elastic_agent
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
                assert record.endpoint is not None
                agent = elastic_agent(self, record.endpoint, record.run_id,
                                      self.spec.resources, self.address, self.peer_timeout)
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

    # -- Workers (KernelElasticAgent's side) -------------------------------------------

    def start(self, group: WorkerGroup, envs: dict[int, dict[str, str]]) -> dict[int, Any]:
        """A round formed: start the local workers with their ranks (not once a notice
        found this node idle: it leaves)."""
        with self._lock:
            if self._gone_idle:
                raise _Leave()
            self._starting = True
        try:
            return self._start(group, envs)
        finally:
            with self._lock:
                self._starting = False

    def _start(self, group: WorkerGroup, envs: dict[int, dict[str, str]]) -> dict[int, Any]:
        agent = self.agent
        assert agent.held is not None and self.record is not None
        self.stopping = False
        self.reform.clear()
        self.group = group
        self.rounds += 1
        self.joins.round_started(0 in [w.global_rank for w in group.workers])
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
        if round_shrank(group):
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
        kernel = self.agent.start_kernel(f"r{local_rank}")
        import_ahead(kernel)
        return kernel

    def _spawn_spares(self) -> None:
        while len(self.spares) < self.procs:
            self.spares.append(self._spawn(len(self.spares)))

    def _kill_spares(self) -> None:
        spares, self.spares = self.spares, []
        for kernel in spares:
            kernel.kill()
            self.agent.forget_kernel(kernel)
