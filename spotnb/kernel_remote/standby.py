"""A warm standby: an agent that starts while another holds the job's lease.

The capacity group starts a second instance when EC2 recommends a rebalance of the one
that runs the job (on AWS the job's instance agent raises its Auto Scaling group's
desired capacity, in an instance's first hour timed to be ready as that hour ends; the
local group the same). Its agent finds the lease held by a live holder and, instead of
only waiting for it, warms up (jobs whose ``policy.standby`` is on; a single-node job's, below, a
distributed job's: :class:`NodeStandby`)::

    Step 1  unpack the job's files; the kernel (spawned already) answers.
    Step 2  download the newest checkpoint into the restore directory (no lease needed:
            checkpoints are immutable once LATEST names them).
    Step 3  bootstrap the runtime with ``SPOTNB_STANDBY=1`` and send the cell: its
            imports and set-up run, and ``restore()`` stops at its restore point
            (:data:`channel.STANDBY_WAITING`) until the lease is this agent's.
    Step 4  say so in the store (``standby/<instance>.json``: the local group logs it
            as "standby ready"), then wait for the lease as any agent does.
    Step 5  the old instance made its final save at its notice and released the lease:
            take it, download only the files of the newest checkpoint that differ from
            the prefetched one, tell the runtime its attempt (:data:`channel.
            STANDBY_LEASED`), and let ``restore()`` go on (:data:`channel.
            PREFETCH_DONE`). The agent relays the cell, whose outputs so far wait in the
            kernel client's queue, from here as in any attempt.

Nothing is written to the job's log before Step 5 (the standby holds no lease); its
``standby`` event (``phase="took-over"``) then records when its kernel started, when
it was ready and what it read at the takeover. A standby that no notice follows is
terminated by its group (:data:`spotnb.protocol.standby.STANDBY_HOLD_SECONDS`).

What a standby cannot do ahead: run a cell whose job has no checkpoint yet up to a
restore point (the cell is then sent at the takeover, as in any attempt: only the
kernel's start and the runtime's import were saved), nor keep more than the kernel
client's queue of the cell's output before its restore point (ZeroMQ's default of
1,000 messages).

A distributed job's standby (:class:`NodeStandby`) stands by for one node: it finds
every node slot held and warms up without joining the world (its ranks are
torchelastic's to give, at a rendezvous it must not join while the node it stands by
for is in the world: that would make the world re-form around it). Once that node has
saved with every rank and released its slot, the standby takes the slot and joins in
its place, its kernels and download ready.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spotnb.ckpt import compile_cache
from spotnb.kernel_remote import channel, leasing
from spotnb.kernel_remote.cells import reply_error
from spotnb.kernel_remote.kernel import KernelNotReady, KernelProcess
from spotnb.kernel_remote.kernels import (
    BOOTSTRAP,
    KERNEL_READY_TIMEOUT,
    NODE_PREIMPORT,
    KernelSupervisor,
)
from spotnb.kernel_remote.leasing import holder_gone_check
from spotnb.protocol import layout, lease
from spotnb.protocol.events import EventWriter
from spotnb.protocol.spec import JobSpec
from spotnb.protocol.store import Store, retrying

__all__ = ["NodeStandby", "Standby", "lease_now", "take_lease", "wanted"]

log = logging.getLogger(__name__)

#: How long the bootstrap may take in a standby's kernel (it imports the runtime).
BOOTSTRAP_SECONDS = 120.0
#: How long the cell may take to reach its restore point before the standby says it is
#: ready anyway (its kernel is started; the rest of the cell's set-up goes on).
RESTORE_POINT_SECONDS = 300.0


def lease_now(store: Store, spec: JobSpec, instance: str) -> lease.HeldLease | None:
    """One try at the job's lease (a distributed job's: of a free node slot; free,
    released, expired, or its holder gone); None while live agents hold it (every
    slot), or once the job ended."""
    if store.exists(layout.RESULT) or store.exists(layout.STOP):
        return None
    return leasing.free_slot(store, spec, instance, holder_gone_check(spec))


def wanted(spec: JobSpec) -> bool:
    """Whether an agent that finds the lease (every node slot) held warms up as a
    standby."""
    return spec.policy.standby


def take_lease(store: Store, spec: JobSpec, kernels: KernelSupervisor, scratch: Path,
               instance: str, on_ready: Callable[[], None] | None = None
               ) -> tuple[lease.HeldLease | None, Standby | None]:
    """The job's lease, as :func:`spotnb.kernel_remote.leasing.take_lease` waits for it;
    when a live agent holds it first (and :func:`wanted`), warmed up as its standby
    meanwhile. (The lease or None if the job ended meanwhile, the warm-up or None.)"""
    warm = None
    if wanted(spec):
        held = retrying(lambda: lease_now(store, spec, instance), "taking the lease")
        if held is not None:
            return held, None
        kind = NodeStandby if spec.resources.distributed else Standby
        warm = kind(store, spec, kernels, scratch, instance, on_ready)
        warm.warm()
    return leasing.take_lease(store, spec, instance), warm


class Standby:
    """The warm-up of an agent whose job's lease another agent holds (module docstring)."""

    def __init__(self, store: Store, spec: JobSpec, kernels: KernelSupervisor,
                 scratch: Path, instance_id: str,
                 on_ready: Callable[[], None] | None = None) -> None:
        self.store = store
        self._on_ready = on_ready  # a notification, once ready
        self.spec = spec
        self.kernels = kernels
        self.instance_id = instance_id
        self.scratch = scratch
        self.restore_dir = scratch / "restore-standby"
        self.restore_dir.mkdir(parents=True, exist_ok=True)
        self.kc: Any = None
        #: The cell's execution, once sent (its outputs are relayed after the takeover).
        self.cell_msg: str | None = None
        #: The bootstrap's error in the standby's kernel, if it failed.
        self.boot_error: dict[str, Any] | None = None
        self.kernel_started: float | None = None
        self.ready_at: float | None = None
        self.prefetched: Any = None  # the checkpoint's Manifest downloaded ahead
        #: Whether the bootstrap ran in its kernel: only then may the agent use that
        #: kernel at the takeover (else it bootstraps it as any attempt's).
        self.bootstrapped = False
        self._taken = threading.Event()

    # -- before the lease --------------------------------------------------------------

    def warm(self) -> None:
        """Steps 1-4 (module docstring); never raises: a standby that cannot warm up
        is an agent that waits for the lease."""
        try:
            self._warm()
        except Exception:
            log.exception("the standby could not warm up; waiting for the lease cold")

    def _warm(self) -> None:
        log.info("the job's lease is held by a live agent: warming up as its standby")
        self.kernels.unpack_workdir(self.store)
        try:
            self.kc = self.kernels.connect()
        except KernelNotReady as err:
            log.warning("the standby's kernel did not start (%s)", err)
            return
        self.kernel_started = time.time()
        # The compiler's caches too: the cell compiles right after its restore, which
        # is after the takeover (compile_cache).
        compile_cache.fetch(self.store, compile_cache.cache_dirs(self.scratch, {
            **os.environ, **{k: v for k, v in self.spec.env.items() if v is not None}}))
        try:
            self.prefetched = self._download(None)
        except Exception:  # a full disk, a damaged checkpoint: the takeover downloads it
            log.warning("the standby could not prefetch the checkpoint; its cell runs "
                        "after the takeover", exc_info=True)
            self.prefetched = None
        self.boot_error = self._run_quietly(BOOTSTRAP.format(env={
            channel.ENV_ATTEMPT: "0", channel.ENV_INSTANCE_ID: self.instance_id,
            channel.ENV_RESTORE_DIR: str(self.restore_dir), channel.ENV_STANDBY: "1"}))
        self.bootstrapped = True
        if self.boot_error is not None or self.prefetched is None:
            self._say_ready()  # the cell runs after the takeover, as in any attempt
            return
        self.cell_msg = self.kc.execute(self.spec.code, silent=False, store_history=True,
                                        allow_stdin=False)
        threading.Thread(target=self._await_restore_point, name="standby",
                         daemon=True).start()

    def _run_quietly(self, code: str) -> dict[str, Any] | None:
        """Run ``code`` in the kernel and wait for its reply: its error, or None."""
        msg_id = self.kc.execute(code, silent=True, store_history=False, allow_stdin=False)
        return reply_error(self.kc, msg_id, BOOTSTRAP_SECONDS)

    def _await_restore_point(self) -> None:
        waiting = self.restore_dir / channel.STANDBY_WAITING
        deadline = time.monotonic() + RESTORE_POINT_SECONDS
        while not waiting.exists() and not self._taken.is_set() and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        if not self._taken.is_set():
            self._say_ready()

    def _say_ready(self) -> None:
        self.ready_at = time.time()
        body = {"instance_id": self.instance_id, "kernel_started": self.kernel_started,
                "ready": self.ready_at, "cell_waiting": self.cell_msg is not None,
                "step": getattr(self.prefetched, "step", None),
                "standby_for": os.environ.get(layout.STANDBY_FOR_ENV) or None}
        try:
            self.store.put(layout.standby_ready_key(self.instance_id),
                           json.dumps(body).encode())
        except Exception:
            log.warning("could not say the standby is ready", exc_info=True)
        log.info("standby ready (checkpoint of step %s prefetched)", body["step"])
        if self._on_ready is not None:
            self._on_ready()

    def _checkpoints(self) -> Any:
        from spotnb.ckpt.checkpoints import CHECKPOINT_FORMATS, CheckpointStore

        return CheckpointStore(self.store, prefix=layout.CHECKPOINTS,
                               keep=self.spec.policy.keep_checkpoints,
                               formats=CHECKPOINT_FORMATS)

    def _share(self, manifest: Any) -> list[str] | None:
        """The files of ``manifest`` to download ahead (None: every file)."""
        return None

    def _download(self, previous: Any) -> Any:
        """The newest checkpoint into the restore directory (files already there that
        verify are kept); its manifest, or None if the job has none."""
        ckpts = self._checkpoints()
        manifest = ckpts.latest()
        if manifest is not None and (previous is None or manifest.id != previous.id):
            ckpts.download(manifest, self.restore_dir, names=self._share(manifest))
        return manifest

    def _read_since(self, newest: Any) -> int:
        """Bytes of ``newest``'s files that the download ahead did not bring."""
        if newest is None:
            return 0
        if self.prefetched is None:
            return int(newest.total_bytes)
        before = {(f.name, f.size, f.checksum) for f in self.prefetched.files}
        return sum(f.size for f in newest.files if (f.name, f.size, f.checksum) not in before)

    def _said_took_over(self, events: EventWriter, taken: float, newest: Any,
                        read: int) -> None:
        events.emit("standby", phase="took-over", kernel_started=self.kernel_started,
                    ready=self.ready_at, lease_at=taken,
                    prefetched_step=getattr(self.prefetched, "step", None),
                    step=getattr(newest, "step", None), read_bytes=read,
                    cell_waiting=self.cell_msg is not None)
        events.flush_soon()

    # -- at the takeover -------------------------------------------------------------

    def took_over(self, attempt: int, events: EventWriter) -> None:
        """Step 5: this agent holds the lease of ``attempt``; let the cell restore."""
        self._taken.set()
        taken = time.time()
        read = 0
        try:
            newest = self._download(self.prefetched)
            read = self._read_since(newest) if newest is not None and (
                self.prefetched is None or newest.id != self.prefetched.id) else 0
        except Exception:
            log.exception("refreshing the prefetched checkpoint failed; the runtime "
                          "downloads what it lacks")
            newest = None
        tmp = self.restore_dir / (channel.STANDBY_LEASED + ".tmp")
        tmp.write_text(json.dumps({"attempt": attempt}))
        os.replace(tmp, self.restore_dir / channel.STANDBY_LEASED)
        (self.restore_dir / channel.PREFETCH_DONE).touch()
        self._said_took_over(events, taken, newest, read)


class NodeStandby(Standby):
    """The warm-up of a distributed job's agent that finds every node slot held: the
    capacity group's standby for a node with a rebalance recommendation (or a
    replacement that came while the node it replaces still holds its slot)::

        Step 1  unpack the job's files; spawn the node's P kernels (the first round's
                workers) and wait until each answers.
        Step 2  import torch.distributed and spotnb's runtime in each (:data:`spotnb.
                kernel_remote.kernels.NODE_PREIMPORT`): the workers' bootstrap and
                the cell's imports find them loaded.
        Step 3  download the newest checkpoint: a replicated one (DDP: global rank 0
                wrote it) whole; of a sharded one its ``.metadata`` (which shards this
                node reads only its ranks tell, given at the rendezvous).
        Step 4  say so in the store (``standby/<instance>.json``), then wait for a free
                slot as any agent does, outside the rendezvous: the world is not
                disturbed while the node stood by for is in it.
        Step 5  that node saved with every rank (its notice, or the group's move) and
                released its slot: take it; the kernels become the first round's
                workers and the download its restore directory (refreshed there with
                this node's share), and the node joins the rendezvous in its place
                (:class:`spotnb.kernel_remote.multinode.node.NodeRun`).
    """

    def __init__(self, store: Store, spec: JobSpec, kernels: KernelSupervisor,
                 scratch: Path, instance_id: str,
                 on_ready: Callable[[], None] | None = None) -> None:
        super().__init__(store, spec, kernels, scratch, instance_id, on_ready)
        #: The node's kernels, spawned ahead: the first round's workers.
        self.spares: list[KernelProcess] = []

    def _share(self, manifest: Any) -> list[str] | None:
        from spotnb.ckpt import node_share

        return node_share(manifest, (), 0)

    def _warm(self) -> None:
        log.info("every node slot is held by a live agent: warming up as a standby")
        self.kernels.unpack_workdir(self.store)
        self.spares = [self.kernels.start(f"r{rank}")
                       for rank in range(self.spec.resources.procs_per_node)]
        clients = []
        for kernel in self.spares:
            try:
                clients.append(kernel.connect(timeout=KERNEL_READY_TIMEOUT))
            except KernelNotReady as err:
                log.warning("a standby's kernel did not start (%s)", err)
        self.kernel_started = time.time()
        sent = [(kc, kc.execute(NODE_PREIMPORT, silent=True, store_history=False,
                                allow_stdin=False)) for kc in clients]
        for kc, msg_id in sent:
            try:
                error = reply_error(kc, msg_id, BOOTSTRAP_SECONDS)
                if error is not None:
                    log.warning("importing ahead in a standby's kernel failed: %s: %s",
                                error["ename"], error["evalue"])
            finally:
                kc.stop_channels()  # each worker connects a client of its own
        try:
            self.prefetched = self._download(None)
        except Exception:  # a full disk, a damaged checkpoint: the first round reads it
            log.warning("the standby could not prefetch the checkpoint; the node's first "
                        "round downloads it", exc_info=True)
            self.prefetched = None
        self._say_ready()

    def took_over(self, attempt: int, events: EventWriter) -> None:
        """Step 5: this agent holds a node slot's lease (``attempt``). The first
        round's prefetch refreshes the download; here only what it will read."""
        self._taken.set()
        taken = time.time()
        try:
            newest = self._checkpoints().latest()
        except Exception:
            log.warning("could not read the newest checkpoint's manifest", exc_info=True)
            newest = None
        read = 0
        if newest is not None and (self.prefetched is None
                                   or newest.id != self.prefetched.id):
            read = self._read_since(newest)
        self._said_took_over(events, taken, newest, read)
