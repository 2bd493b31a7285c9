"""What a distributed job's node uses of its agent, named as a protocol.

The agent (:class:`spotnb.kernel_remote.agent.Agent`) makes a node's run
(:class:`spotnb.kernel_remote.multinode.node.NodeRun`) and hands itself to it; the run,
its workers (:mod:`.worker`) and its joins (:mod:`.joins`) use only this of it. It
imports nothing heavy (torch is the node's), so an attempt's own protocol
(:mod:`spotnb.kernel_remote.attempt`) extends it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from spotnb.kernel_remote import channel
    from spotnb.kernel_remote.kernel import KernelProcess
    from spotnb.protocol.lease import HeldLease
    from spotnb.protocol.spec import JobSpec
    from spotnb.protocol.store import Store

__all__ = ["Agent"]

T = TypeVar("T")


class Agent(Protocol):
    """What a node's run uses of its agent: the public interface of
    :class:`spotnb.kernel_remote.agent.Agent`, which makes the run (module
    docstring)."""

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

    def done_with_lease(self) -> None: ...
