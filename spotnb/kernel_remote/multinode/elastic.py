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
"""

from __future__ import annotations

import os
import signal
from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
)

__all__ = ["KernelElasticAgent", "Workers", "worker_env"]


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
