"""torchelastic's agent with IPython kernels as its workers.

torchrun is ``torch.distributed.run`` -> ``elastic_launch`` -> ``LocalElasticAgent``, a
:class:`~torch.distributed.elastic.agent.server.api.SimpleElasticAgent` whose workers
are processes running a script. spotnb's workers run a notebook cell in an IPython
kernel, so the node's agent uses the same engine with its own workers:
:class:`KernelElasticAgent` is a ``SimpleElasticAgent`` whose ``_start_workers``,
``_monitor_workers`` and ``_stop_workers`` act on kernels (through a :class:`Workers`
object, :class:`spotnb.kernel_remote.multinode.node.NodeRun`). Everything else is torchelastic's
own: the c10d rendezvous with ``min_nodes``/``max_nodes`` (``--nnodes MIN:MAX``), the
ranks, ``MASTER_ADDR``/``MASTER_PORT``, restarts on a failed or unhealthy worker group,
re-forming when a new node waits, the exit barrier.

Its loop (``SimpleElasticAgent._invoke_run``), as spotnb uses it::

    rendezvous (wait for MIN..MAX nodes) -> start workers (kernels run the cell)
    every MONITOR_SECONDS: workers HEALTHY -> a node waiting to join? re-form
                           UNHEALTHY (a peer lost, a node leaving after the
                           coordinated checkpoint) -> restart: stop, rendezvous, start
                           SUCCEEDED (every cell finished) -> exit barrier -> done

The workers' environment is the one ``LocalElasticAgent`` gives (:func:`worker_env`):
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and the rest, so the cell's
``torch.distributed.init_process_group()`` works as under torchrun.

:func:`elastic_agent` builds the agent of one generation as torchrun would, with
spotnb's rendezvous host as the endpoint and torchelastic's handler wrapped so that a
node waiting to join waits for the save before it (:class:`SaveBeforeJoin`);
:func:`round_shrank` reads from torchelastic's rendezvous state whether a node left
the round.
"""

from __future__ import annotations

import os
import signal
from typing import TYPE_CHECKING, Any, Protocol

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
)

from spotnb.kernel_remote.multinode import (
    EXIT_BARRIER_SECONDS,
    JOIN_TIMEOUT_SECONDS,
    KEEP_ALIVE_MISSES,
    KEEP_ALIVE_SECONDS,
    LAST_CALL_SECONDS,
    MAX_REFORMATIONS,
    MONITOR_SECONDS,
    ROLE,
)

if TYPE_CHECKING:
    from spotnb.protocol.spec import Resources

__all__ = ["KernelElasticAgent", "SaveBeforeJoin", "Workers", "elastic_agent",
           "round_shrank", "worker_env"]


class Workers(Protocol):
    """What runs the workers of :class:`KernelElasticAgent` (see
    :class:`spotnb.kernel_remote.multinode.node.NodeRun`)."""

    def start(self, group: WorkerGroup, envs: dict[int, dict[str, str]]) -> dict[int, Any]:
        """Start one kernel per local worker with its environment; their ids."""

    def monitor(self, group: WorkerGroup) -> RunResult:
        """The group's state now (may raise to end the elastic run)."""

    def stop(self) -> None:
        """Stop every worker of this node (idempotent)."""

    def before_restart(self) -> None:
        """Called before a restart's rendezvous: raise to end the elastic run instead
        (the job ended, or the rendezvous moved to a new generation)."""

    def nodes_waiting(self, waiting: int) -> int:
        """How many nodes wait to join as torchelastic is told, ``waiting`` by its
        rendezvous (:class:`SaveBeforeJoin`)."""


def worker_env(group: WorkerGroup, worker: Worker, restart_count: int) -> dict[str, str]:
    """The environment torchrun's ``LocalElasticAgent`` gives a worker."""
    spec = group.spec
    env = {
        "RANK": str(worker.global_rank),
        "GROUP_RANK": str(group.group_rank),
        "ROLE_RANK": str(worker.role_rank),
        "ROLE_NAME": spec.role,
        "LOCAL_RANK": str(worker.local_rank),
        "LOCAL_WORLD_SIZE": str(spec.local_world_size),
        "WORLD_SIZE": str(worker.world_size),
        "GROUP_WORLD_SIZE": str(group.group_world_size),
        "ROLE_WORLD_SIZE": str(worker.role_world_size),
        "MASTER_ADDR": str(group.master_addr),
        "MASTER_PORT": str(group.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
        "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    # torchrun's default: several workers on a node compute on one thread each unless
    # OMP_NUM_THREADS says otherwise (each would start a thread per core, and they
    # would fight over the cores).
    if spec.local_world_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"
    return env


class KernelElasticAgent(SimpleElasticAgent):
    """A ``SimpleElasticAgent`` whose workers are kernels (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, workers: Workers,
                 exit_barrier_timeout: float) -> None:
        super().__init__(spec, exit_barrier_timeout=exit_barrier_timeout)
        self._workers = workers

    @property
    def restart_count(self) -> int:
        """How many times the workers were restarted (failures, not re-formations)."""
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        envs = {w.local_rank: worker_env(worker_group, w, self.restart_count)
                for w in worker_group.workers}
        return self._workers.start(worker_group, envs)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._workers.stop()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self._workers.monitor(worker_group)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: int = 30) -> None:
        self._workers.stop()

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self._workers.before_restart()
        super()._restart_workers(worker_group)


class SaveBeforeJoin:
    """torchelastic's rendezvous handler, whose ``num_nodes_waiting`` answers once the
    checkpoint before a join is durable (:meth:`Workers.nodes_waiting`:
    :mod:`spotnb.kernel_remote.multinode.joins`); everything else is the handler's
    own."""

    def __init__(self, handler: Any, workers: Workers) -> None:
        self._handler = handler
        self._workers = workers

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def num_nodes_waiting(self) -> int:
        return self._workers.nodes_waiting(int(self._handler.num_nodes_waiting()))


def elastic_agent(workers: Workers, endpoint: str, run_id: str, res: Resources,
                  address: str, peer_timeout: float) -> KernelElasticAgent:
    """torchelastic's agent for one generation (what ``torchrun --nnodes MIN:MAX
    --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` builds), with spotnb's store
    host as the rendezvous endpoint, joined as a client."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    params = RendezvousParameters(
        backend="c10d", endpoint=endpoint, run_id=run_id,
        min_nodes=res.min_nodes, max_nodes=res.max_nodes, local_addr=address,
        is_host=False, join_timeout=JOIN_TIMEOUT_SECONDS,
        last_call_timeout=LAST_CALL_SECONDS, close_timeout=LAST_CALL_SECONDS,
        keep_alive_interval=KEEP_ALIVE_SECONDS, keep_alive_max_attempt=KEEP_ALIVE_MISSES,
        read_timeout=max(1, int(peer_timeout)))
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (set in NodeRun.run()): each round's rank 0
    # publishes a fresh MASTER_ADDR/PORT. With sharing, a node that joins later
    # waits forever for a MASTER_ADDR that a rank 0 kept from an earlier round
    # never writes again (seen with torch 2.13: the new round hangs).
    handler: Any = SaveBeforeJoin(registry.get_rendezvous_handler(params), workers)
    spec = WorkerSpec(role=ROLE, local_world_size=res.procs_per_node, entrypoint="ipykernel",
                      rdzv_handler=handler,
                      max_restarts=MAX_REFORMATIONS, monitor_interval=MONITOR_SECONDS,
                      local_addr=address)
    return KernelElasticAgent(spec, workers, exit_barrier_timeout=EXIT_BARRIER_SECONDS)


def round_shrank(group: WorkerGroup) -> bool:
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
