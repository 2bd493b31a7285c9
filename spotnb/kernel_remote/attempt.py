"""One attempt, Steps 4-5 of :mod:`spotnb.kernel_remote.agent`: a single-node job's
(:func:`run_attempt`), or a distributed job's on this node (:func:`run_node_attempt`).

A single-node job's::

    Step 4  prefetch the latest checkpoint while the kernel finishes booting and the
            cell's imports run (or take over a warm standby's kernel, bootstrapped and
            at its restore point); bootstrap the runtime in the kernel (attempt,
            inputs, `spot`), run the cell, relay stream/display/error outputs as events.
    Step 5  completed -> save outputs, wait for uploads, read every row the runtime
            sent, write result.json.
            user error -> retry in place under a new epoch if the policy allows
            (the outcome is "retry"), else write a failed result.

A distributed job's attempt on a node starts the same way (its events, the job's
files, a warm standby's kernels and download) and is then :class:`spotnb.kernel_remote.
multinode.node.NodeRun`'s: torchelastic's rendezvous with the other nodes, one kernel
per local worker, re-formed as nodes come and go.
"""

from __future__ import annotations

import json
import os
import threading
from typing import TYPE_CHECKING, Any, Protocol

from spotnb.kernel_remote import channel, standby
from spotnb.kernel_remote.kernel import KernelNotReady
from spotnb.kernel_remote.kernels import BOOTSTRAP, KERNEL_READY_TIMEOUT, import_ahead
from spotnb.kernel_remote.leasing import Fenced
from spotnb.kernel_remote.multinode import agentapi
from spotnb.kernel_remote.procs import process_started
from spotnb.kernel_remote.sampler import Sampler
from spotnb.protocol.events import EventWriter

if TYPE_CHECKING:
    from spotnb.kernel_remote.cells import CellRunner
    from spotnb.kernel_remote.kernel import KernelProcess
    from spotnb.kernel_remote.kernels import KernelSupervisor
    from spotnb.kernel_remote.leasing import LeaseKeeper
    from spotnb.kernel_remote.watch import StopWatcher
    from spotnb.protocol.events.live import LiveSender
    from spotnb.protocol.notify import Notifier

__all__ = ["KERNEL_TEARDOWN_SECONDS", "run_attempt", "run_node_attempt"]

# How long a kernel that died while starting waits for the instance's SIGTERM before it
# counts as the cell's error (the group signals the kernel and the agent one by one).
KERNEL_TEARDOWN_SECONDS = 2.0


class Agent(agentapi.Agent, Protocol):
    """What an attempt uses of its agent (:class:`spotnb.kernel_remote.agent.Agent`):
    what a distributed job's node uses of it (:class:`~spotnb.kernel_remote.multinode.
    agentapi.Agent`), and more."""

    events: EventWriter | None
    live: LiveSender | None
    notifier: Notifier
    warm: standby.Standby | None
    node: Any
    kernels: KernelSupervisor
    cells: CellRunner
    lease: LeaseKeeper
    stops: StopWatcher
    secrets_error: str | None

    def where(self) -> str: ...

    def on_sample(self, data: dict[str, Any]) -> None: ...

    def on_stop(self, request: dict[str, Any]) -> None: ...

    def report_usage(self) -> None: ...


def run_attempt(agent: Agent) -> str:
    """One attempt under the lease's current epoch (module docstring): its outcome, a
    result's status, or "retry" (a user error the policy retries: new kernel, new
    epoch)."""
    assert agent.held is not None
    attempt = agent.held.epoch
    held = agent.held
    agent.events = EventWriter(agent.store, attempt, agent.identity["instance_id"],
                               may_write=held.status)
    ev = agent.events
    if agent.live is not None:
        agent.live.attach(ev)
    ev.emit("status", state="booting", detail=f"attempt {attempt} on {agent.where()}",
            instance_type=agent.identity.get("instance_type"),
            az=agent.identity.get("az_id") or agent.identity.get("az"),
            region=agent.identity.get("region"), pid=os.getpid(),
            process_started=process_started())
    ev.flush_soon()
    agent.notifier.where = agent.where()
    if agent.secrets_error is not None:
        return agent.finish("failed", agent.secrets_error)
    sampler = Sampler(agent.on_sample)
    sampler.start()
    try:
        warm, agent.warm = agent.warm, None
        sent: str | None = None
        if warm is not None and warm.kc is not None and warm.bootstrapped:
            # A standby's kernel is bootstrapped, its cell at its restore point:
            # refresh the checkpoint and let it go on (standby, Step 5).
            kc, boot_error, sent = warm.kc, warm.boot_error, warm.cell_msg
            agent.warm = warm  # for the `restored` message
            warm.took_over(attempt, ev)
        else:
            # Step 4: the checkpoint downloads while the kernel finishes booting and
            # the cell's imports run; restore() waits for the download to finish.
            restore_dir = agent.scratch / f"restore-{attempt}"
            restore_dir.mkdir(parents=True, exist_ok=True)
            threading.Thread(target=agent.prefetch, args=(restore_dir,),
                             daemon=True).start()
            agent.retry(lambda: agent.kernels.unpack_workdir(agent.store),
                        "reading the job's files")
            try:
                kc = agent.kernels.connect()
            except KernelNotReady as e:
                # The instance's teardown may reach the kernel a moment before the
                # agent's own SIGTERM: a kernel killed so is no error of the cell's.
                if agent.terminating.wait(KERNEL_TEARDOWN_SECONDS):
                    raise Fenced("the instance is being terminated") from e
                # Killed while it started (out of memory in an import, say): an error
                # like one in the cell, retried as far as the job's policy allows.
                return _retry_or_fail(agent, None, {
                    "ename": "KernelDied", "evalue": f"the kernel could not start: {e}",
                    "traceback": [str(e)]})
            agent.lease.check()
            # The attempt's own settings reach the kernel with the bootstrap: the
            # kernel was spawned before the lease said which attempt this is.
            boot_error = agent.execute(kc, BOOTSTRAP.format(env={
                channel.ENV_ATTEMPT: str(attempt),
                channel.ENV_INSTANCE_ID: agent.identity["instance_id"],
                channel.ENV_RESTORE_DIR: str(restore_dir),
            }), silent=True)
        if agent.stop_requested or (boot_error and _stop_seen(agent)):
            return agent.finish("stopped", agent.stops.reason())
        if boot_error:
            return agent.finish("failed", "the runtime could not start in the kernel",
                                error=boot_error)
        ev.emit("status", state="running", detail="running the cell")
        ev.flush_soon()
        agent.notifier.started(attempt)
        error = agent.cells.execute(kc, agent.spec.code, silent=False, sent=sent)
        agent.warm = None
        agent.lease.check()
        if agent.stop_requested:
            return agent.finish("stopped", agent.stops.reason())
        if error:
            return _retry_or_fail(agent, kc, error)
        # Step 5: outputs, then wait for uploads (the runtime's _finish).
        if agent.spec.outputs:
            out_error = agent.execute(
                kc, f"_spotnb_runtime._save_outputs({list(agent.spec.outputs)!r})",
                silent=True)
            if out_error:
                return agent.finish("failed", "could not save the outputs",
                                    error=out_error)
        fin_error = agent.execute(kc, "_spotnb_runtime._finish()", silent=True)
        if fin_error:
            return agent.finish("failed", "uploading the last checkpoint failed",
                                error=fin_error)
        # The runtime closed its end: read what is still in the socket.
        agent.drain_channel()
        return agent.finish("completed", "the cell finished")
    finally:
        sampler.stop()


def _stop_seen(agent: Agent) -> bool:
    """Whether the job was asked to stop, reading the store's request if this agent has
    not seen it yet. A stop can end the kernel before the agent's look at the store
    (its group ending the instance; or the stop's interrupt reaching a kernel still
    starting, before its SIGINT handler: it dies of the signal): the attempt's end is
    then the stop's, not an error of the cell's."""
    if agent.stop_requested is None:
        request = agent.stops.read()
        if request is not None:
            agent.on_stop(request)
    return bool(agent.stop_requested)


def _retry_or_fail(agent: Agent, kc: Any | None, error: dict[str, Any]) -> str:
    """The cell (or its kernel's start) failed with ``error``: record it, and "retry"
    if the job's policy allows another try, else the failed result's status; a stopped
    job's, if the job was asked to stop (:func:`_stop_seen`)."""
    if _stop_seen(agent):
        return agent.finish("stopped", agent.stops.reason())
    agent.lease.check()
    # The rows the cell logged before it failed are still on their way.
    agent.sync_runtime(kc)
    agent.lease.check()
    errors_so_far = len(agent.retry(lambda: agent.store.list_keys("errors/"),
                                    "counting earlier errors"))
    retrying = errors_so_far < agent.spec.policy.max_restarts_on_error
    assert agent.held is not None
    key = f"errors/{agent.held.epoch:06d}.json"
    agent.write(lambda: agent.store.put(key, json.dumps(error).encode()), "the error")
    assert agent.events is not None
    if retrying:
        agent.events.emit("error", retrying=True, **error)
        agent.events.emit("status", state="booting", retrying=True,
                          detail=f"retrying after {error['ename']} "
                                 f"({errors_so_far + 1} of "
                                 f"{agent.spec.policy.max_restarts_on_error})")
        agent.report_usage()
        agent.kernels.shutdown()
        agent.drain_channel()
        return "retry"
    return agent.finish("failed", f"{error['ename']}: {error['evalue']}", error=error)


def run_node_attempt(agent: Agent) -> str:
    """A distributed job's attempt on this node: the NodeRun's (module docstring)."""
    assert agent.held is not None
    agent.events = EventWriter(agent.store, agent.held.epoch, agent.identity["instance_id"],
                               may_write=agent.held.status)
    if agent.live is not None:
        agent.live.attach(agent.events)
    res = agent.spec.resources
    agent.events.emit("status", state="booting",
                      detail=f"attempt {agent.held.epoch} on {agent.where()}, node slot "
                             f"{agent.held.lease.slot} of {res.max_nodes}",
                      instance_type=agent.identity.get("instance_type"),
                      az=agent.identity.get("az_id") or agent.identity.get("az"),
                      region=agent.identity.get("region"), pid=os.getpid(),
                      process_started=process_started(), slot=agent.held.lease.slot)
    agent.events.flush_soon()
    if agent.secrets_error is not None:
        return agent.finish("failed", agent.secrets_error)
    agent.notifier.where = agent.where()
    agent.notifier.started(agent.held.epoch)
    sampler = Sampler(agent.on_sample)
    sampler.start()
    try:
        agent.retry(lambda: agent.kernels.unpack_workdir(agent.store),
                    "reading the job's files")
        found, agent.warm = agent.warm, None
        warm = found if isinstance(found, standby.NodeStandby) else None
        first: list[KernelProcess] = []
        if warm is not None:
            # A standby's kernels are started and its download is there: the node
            # joins with them (standby.NodeStandby, Step 5).
            warm.took_over(agent.held.epoch, agent.events)
            agent.warm = warm  # for the first `restored` message: the handover
        else:
            # The first round's kernels boot, and import torch, beside this agent's
            # import of torchelastic (seconds) and the rendezvous.
            for rank in range(res.procs_per_node):
                first.append(agent.start_kernel(f"r{rank}"))
                import_ahead(first[-1])
        from spotnb.kernel_remote.multinode.node import NodeRun

        agent.node = NodeRun(agent, KERNEL_READY_TIMEOUT, warm=warm, spares=first)
        return str(agent.node.run())
    finally:
        sampler.stop()
