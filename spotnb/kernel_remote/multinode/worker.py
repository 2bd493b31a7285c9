"""One local worker of a node's round: a kernel that runs the cell, on its own thread.

A round of a distributed job (:class:`spotnb.kernel_remote.multinode.node.NodeRun`)
runs one :class:`WorkerRun` per local process: it connects to its kernel, bootstraps
the runtime with the round's settings (``RANK``, ``WORLD_SIZE``, ...), runs the cell,
saves the outputs (global rank 0) and waits for the uploads. How it ended is its
``state``, which the node reports to torchelastic; a cell's error is a peer's
(:func:`peer_error`: a collective's connection broke or timed out) or the user's code's.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.kernel_remote.kernel import KernelNotReady
from spotnb.kernel_remote.kernels import BOOTSTRAP
from spotnb.kernel_remote.leasing import Fenced

if TYPE_CHECKING:
    from spotnb.kernel_remote.kernel import KernelProcess
    from spotnb.kernel_remote.multinode.agentapi import Agent

__all__ = ["Node", "WorkerRun", "peer_error"]

log = logging.getLogger(__name__)


class Node(Protocol):
    """What a worker uses of its node's run
    (:class:`spotnb.kernel_remote.multinode.node.NodeRun`)."""

    @property
    def agent(self) -> Agent: ...

    @property
    def kernel_timeout(self) -> float: ...

    @property
    def stopping(self) -> bool: ...

    @property
    def wake(self) -> threading.Event: ...


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


class WorkerRun:
    """One local worker of one round: a kernel that runs the cell, on its own thread.

    ``state``: starting, running, succeeded, peer (a peer is gone), user (the cell
    failed), stopped (the node stopped it), fenced (the agent lost its lease).
    """

    def __init__(self, node: Node, local_rank: int, kernel: KernelProcess,
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
