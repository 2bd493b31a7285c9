"""The agent: runs one job's cell on an instance, in a real IPython kernel.

Started on every instance (local cloud process or EC2 spot instance) as
``python -m spotnb.kernel_remote --job <store-uri>``. It needs only the store and the
instance-metadata endpoint: no inbound network, no SSH.

An attempt, narrated::

    Step 1  read spec.json; if the job already has a result, exit.
    Step 2  spawn the kernel now: it boots while the rest of the start-up happens.
    Step 3  take the lease (wait while a live agent holds it); attempt = lease epoch.
    Step 4  prefetch the latest checkpoint while the kernel finishes booting and the
            cell's imports run; bootstrap the runtime in the kernel (attempt, inputs,
            `spot`), run the cell, relay stream/display/error outputs as events.
    Step 5  completed -> save outputs, wait for uploads, write result.json.
            user error -> retry in place under a new epoch if the policy allows,
            else write a failed result.
    Step 6  release the lease, stop the kernel, exit. The capacity group sees the
            result and deletes itself (DESIGN invariant 6).

Alongside, threads renew the lease (losing it fences the agent off: it stops without
writing), poll IMDS for ``spot/instance-action`` and the rebalance recommendation
(the runtime is told and saves at once; once that save is durable the agent releases
the lease so the replacement can start), sample GPU or CPU utilisation every second,
and watch the store for a stop request.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from spotnb import layout, lease
from spotnb.events import EventWriter
from spotnb.kernel_remote import channel
from spotnb.kernel_remote.imds import ImdsClient
from spotnb.kernel_remote.kernel import KernelNotReady, KernelProcess
from spotnb.kernel_remote.sampler import Sampler
from spotnb.spec import JobSpec
from spotnb.store import NotFound, Store, open_store

log = logging.getLogger(__name__)

# How often the agent looks at IMDS and at the store's stop request. EC2 gives two
# minutes of notice; half a second costs nothing and leaves the runtime the most time.
IMDS_POLL_SECONDS = 0.5
STOP_POLL_SECONDS = 1.0
KERNEL_READY_TIMEOUT = 120.0
# EC2 gives processes a moment between SIGTERM and power-off; use well under it.
TERMINATION_GRACE_SECONDS = 0.8
# Exit codes: the capacity group only cares whether a result exists.
EXIT_OK = 0
EXIT_FENCED = 3

_BOOTSTRAP = "import spotnb.runtime as _spotnb_runtime; _spotnb_runtime._bootstrap(env={env!r})"


class Fenced(Exception):
    """This agent lost the lease, or its instance is being terminated: stop without
    writing anything more (the job is another agent's now)."""


class Agent:
    """Runs one attempt (or several, when user-code errors are retried in place)."""

    def __init__(self, job_uri: str, imds: ImdsClient | None = None) -> None:
        self.job_uri = job_uri
        self.store: Store = open_store(job_uri)
        self.imds = imds or ImdsClient()
        self.spec: JobSpec = JobSpec.from_json(self.store.get(layout.SPEC))
        self.identity: dict[str, Any] = {}
        self.held: lease.HeldLease | None = None
        self.events: EventWriter | None = None
        self.notice: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None
        self.parked = threading.Event()
        self.stop_requested: dict[str, Any] | None = None
        self.fenced = threading.Event()
        self.terminating = threading.Event()
        self._done = threading.Event()
        self._conn: socket.socket | None = None
        self._conn_lock = threading.Lock()
        self._kernel: KernelProcess | None = None
        self._kernels_started = 0
        self._scratch = Path(tempfile.mkdtemp(prefix="spotnb-agent-", dir=os.getcwd()))
        # The runtime's channel and the kernel's sockets. Unix socket paths are
        # limited to ~107 bytes: keep it short, in /tmp.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="spotnb-"))
        self._socket_path = self._socket_dir / "agent.sock"
        self._listener: socket.socket | None = None

    # -- the attempt -----------------------------------------------------------------

    def run(self) -> int:
        """Run the job until it ends or this instance goes away; the exit code."""
        if self.store.exists(layout.RESULT):
            log.info("job %s already has a result; nothing to do", self.spec.job_id)
            return EXIT_OK
        try:
            # Step 2: the kernel boots (~0.5 s) while the identity and lease are read.
            self._listener = self._open_listener()
            self._spawn_kernel()
            self.identity = self._identity()
            # Step 3: the lease. A live holder means another agent works on the job.
            self.held = self._take_lease(self.identity["instance_id"])
            if self.held is None:
                return EXIT_OK
            signal.signal(signal.SIGTERM, self._on_sigterm)
            return self._run_attempts()
        except Fenced:
            log.warning("stopping without writing: %s", "the instance is being terminated"
                        if self.terminating.is_set() else "lost the lease")
            return EXIT_FENCED
        finally:
            self._done.set()
            self._shutdown_kernel()
            if self._listener is not None:
                self._listener.close()
            shutil.rmtree(self._scratch, ignore_errors=True)
            shutil.rmtree(self._socket_dir, ignore_errors=True)

    def _run_attempts(self) -> int:
        assert self.held is not None and self._listener is not None
        threads = [
            threading.Thread(target=self._heartbeat, name="lease", daemon=True),
            threading.Thread(target=self._watch_imds, name="imds", daemon=True),
            threading.Thread(target=self._watch_stop, name="stop", daemon=True),
            threading.Thread(target=self._serve_channel, args=(self._listener,),
                             name="channel", daemon=True),
        ]
        for t in threads:
            t.start()
        while True:
            outcome = self._one_attempt()
            if outcome != "retry":
                break
            # A user-code error the policy allows to retry: new kernel, new epoch.
            self._close_events()
            self.held.bump()
        return EXIT_OK

    def _one_attempt(self) -> str:
        assert self.held is not None
        attempt = self.held.epoch
        self.events = EventWriter(self.store, attempt, self.identity["instance_id"])
        ev = self.events
        ev.emit("status", state="booting", detail=f"attempt {attempt} on {self._where()}",
                instance_type=self.identity.get("instance_type"),
                az=self.identity.get("az_id") or self.identity.get("az"),
                region=self.identity.get("region"), pid=os.getpid(),
                process_started=_process_started())
        sampler = Sampler(lambda data: self._emit("sys", **data))
        sampler.start()
        try:
            # Step 4: the checkpoint downloads while the kernel finishes booting and
            # the cell's imports run; restore() waits for the download to finish.
            restore_dir = self._scratch / f"restore-{attempt}"
            restore_dir.mkdir(parents=True, exist_ok=True)
            prefetch = threading.Thread(target=self._prefetch, args=(restore_dir,), daemon=True)
            prefetch.start()
            self._unpack_workdir()
            try:
                kc = self._connect_kernel()
            except KernelNotReady as e:
                return self._finish("failed", "the kernel could not start", error={
                    "ename": "KernelDied", "evalue": str(e), "traceback": [str(e)]})
            self._check_fence()
            # The attempt's own settings reach the kernel with the bootstrap: the
            # kernel was spawned before the lease said which attempt this is.
            boot_error = self._execute(kc, _BOOTSTRAP.format(env={
                channel.ENV_ATTEMPT: str(attempt),
                channel.ENV_INSTANCE_ID: self.identity["instance_id"],
                channel.ENV_RESTORE_DIR: str(restore_dir),
            }), silent=True)
            if self.stop_requested:
                return self._finish("stopped", self._stop_reason())
            if boot_error:
                return self._finish("failed", "the runtime could not start in the kernel",
                                    error=boot_error)
            ev.emit("status", state="running", detail="running the cell")
            error = self._execute(kc, self.spec.code, silent=False)
            self._check_fence()
            if self.stop_requested:
                return self._finish("stopped", self._stop_reason())
            if error:
                return self._on_user_error(error)
            # Step 5: outputs, then wait for uploads (the runtime's _finish).
            if self.spec.outputs:
                out_error = self._execute(
                    kc, f"_spotnb_runtime._save_outputs({list(self.spec.outputs)!r})",
                    silent=True)
                if out_error:
                    return self._finish("failed", "could not save the outputs",
                                        error=out_error)
            fin_error = self._execute(kc, "_spotnb_runtime._finish()", silent=True)
            if fin_error:
                return self._finish("failed", "uploading the last checkpoint failed",
                                    error=fin_error)
            return self._finish("completed", "the cell finished")
        finally:
            sampler.stop()

    def _on_user_error(self, error: dict[str, Any]) -> str:
        self._check_fence()
        errors_so_far = len(self.store.list_keys("errors/"))
        retrying = errors_so_far < self.spec.policy.max_restarts_on_error
        assert self.held is not None
        self.store.put(f"errors/{self.held.epoch:06d}.json", json.dumps(error).encode())
        assert self.events is not None
        if retrying:
            self.events.emit("error", retrying=True, **error)
            self.events.emit("status", state="booting",
                             detail=f"retrying after {error['ename']} "
                                    f"({errors_so_far + 1} of "
                                    f"{self.spec.policy.max_restarts_on_error})")
            self._shutdown_kernel()
            return "retry"
        return self._finish("failed", f"{error['ename']}: {error['evalue']}", error=error)

    def _finish(self, status: str, reason: str, error: dict[str, Any] | None = None) -> str:
        """Step 5-6: write the result (once, only while holding the lease)."""
        assert self.held is not None and self.events is not None
        self._check_fence()
        try:
            self.held.renew()
        except lease.LeaseLost:
            self.fenced.set()
            raise Fenced() from None
        result = {"status": status, "reason": reason, "attempt": self.held.epoch,
                  "instance_id": self.identity["instance_id"], "time": time.time(),
                  "error": error, "outputs": list(self.spec.outputs)}
        written = self.store.put_if_absent(layout.RESULT, json.dumps(result).encode())
        if written is None:
            log.warning("a result already exists; leaving it as it is")
        if error is not None:
            self.events.emit("error", retrying=False, **error)
        self.events.emit("result", status=status, reason=reason)
        self.events.emit("status", state=status, detail=reason)
        self._close_events()
        self.held.release()
        return status

    # -- kernel ----------------------------------------------------------------------

    @property
    def _workdir(self) -> Path:
        return Path(os.getcwd()) / "work"

    def _spawn_kernel(self) -> None:
        """Start a kernel process if none is running; it boots while the agent goes on.

        Its environment holds what is the same for every attempt of the job; the
        attempt's own settings come with the bootstrap (:data:`_BOOTSTRAP`).
        """
        if self._kernel is not None:
            return
        self._workdir.mkdir(exist_ok=True)
        every = self.spec.policy.checkpoint_every
        env = dict(os.environ)
        env.update({
            channel.ENV_JOB_URI: self.job_uri,
            channel.ENV_JOB_ID: self.spec.job_id,
            channel.ENV_SOCKET: str(self._socket_path),
            channel.ENV_CHECKPOINT_EVERY: json.dumps(
                {"seconds": every.seconds, "steps": every.steps}),
            channel.ENV_KEEP_CHECKPOINTS: str(self.spec.policy.keep_checkpoints),
            channel.ENV_SCRATCH: str(self._scratch),
            "PYTHONUNBUFFERED": "1",
        })
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(self._workdir), env.get("PYTHONPATH", "")) if p)
        self._kernels_started += 1
        self._kernel = KernelProcess.start(socket_dir=self._socket_dir,
                                           name=f"k{self._kernels_started}",
                                           cwd=self._workdir, env=env)

    def _connect_kernel(self) -> Any:
        """The client of this attempt's kernel, once it answers. Raises KernelNotReady."""
        self._spawn_kernel()  # a retry in place needs a fresh kernel
        assert self._kernel is not None
        return self._kernel.connect(timeout=KERNEL_READY_TIMEOUT)

    def _unpack_workdir(self) -> None:
        """The files shipped with the job (helper modules), into the kernel's cwd.

        The kernel may already be running: the bootstrap refreshes its import caches.
        """
        try:
            archive = self.store.get(layout.WORKDIR)
        except NotFound:
            return
        self._workdir.mkdir(exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            tar.extractall(self._workdir, filter="data")

    def _shutdown_kernel(self) -> None:
        kernel, self._kernel = self._kernel, None
        if kernel is not None:
            kernel.kill()

    def _interrupt_kernel(self) -> None:
        kernel = self._kernel
        if kernel is not None:
            kernel.interrupt()

    def _execute(self, kc: Any, code: str, silent: bool) -> dict[str, Any] | None:
        """Run ``code`` in the kernel, relaying its outputs; the error or None."""
        assert self.events is not None
        ev = self.events
        msg_id = kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False)
        while True:
            if not self.parked.is_set():
                self._check_fence()
            try:
                msg = kc.get_iopub_msg(timeout=0.5)
            except queue.Empty:
                kernel = self._kernel
                if kernel is not None and not kernel.alive:
                    reason = kernel.exit_reason()
                    return {"ename": "KernelDied", "evalue": reason, "traceback": [reason]}
                if self.stop_requested:
                    self._interrupt_kernel()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind = msg["header"]["msg_type"]
            content = msg["content"]
            if kind == "status" and content.get("execution_state") == "idle":
                return self._reply_error(kc, msg_id)
            if kind == "stream":
                ev.emit("stream", name=content["name"], text=content["text"])
            elif kind in ("display_data", "execute_result", "update_display_data"):
                ev.emit("display", kind=kind, data=content.get("data", {}),
                        metadata=content.get("metadata", {}),
                        display_id=(content.get("transient") or {}).get("display_id"))
            elif kind == "clear_output":
                ev.emit("display", kind="clear_output", data={}, metadata={},
                        display_id=None, wait=content.get("wait", False))

    def _reply_error(self, kc: Any, msg_id: str) -> dict[str, Any] | None:
        """The error of an execution from its ``execute_reply`` (silent runs included)."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                reply = kc.get_shell_msg(timeout=1)
            except queue.Empty:
                continue
            if reply.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            content = reply["content"]
            if content.get("status") == "ok":
                return None
            return {"ename": content.get("ename", "Error"),
                    "evalue": content.get("evalue", ""),
                    "traceback": content.get("traceback", [])}
        return {"ename": "KernelTimeout", "evalue": "the kernel did not reply",
                "traceback": []}

    # -- lease, notices, stop ----------------------------------------------------------

    def _take_lease(self, instance: str) -> lease.HeldLease | None:
        """Wait for the lease; None if the job ended or was stopped meanwhile."""
        while True:
            if self.store.exists(layout.RESULT) or self.store.exists(layout.STOP):
                log.info("job ended while waiting for the lease; exiting without writing")
                return None
            held = lease.acquire(self.store, holder=instance)
            if held is not None and self.store.exists(layout.RESULT):
                # The previous holder finished the job and released the lease.
                held.release()
                return None
            if held is not None:
                return held
            time.sleep(0.5)

    def _heartbeat(self) -> None:
        while not self._done.wait(lease.HEARTBEAT_SECONDS):
            held = self.held
            if held is None or held.lease.released:
                continue
            try:
                held.renew()
            except lease.LeaseLost:
                self._fence_off()
                return
            except Exception:
                log.exception("renewing the lease failed; retrying")

    def _fence_off(self) -> None:
        self.fenced.set()
        if self.events is not None:
            self.events.stop_writing()
        self._interrupt_kernel()

    def _check_fence(self) -> None:
        # Terminating: the kernel is killed under the cell, and what fails then is no
        # result of the job's; the replacement runs the attempt again.
        if self.fenced.is_set() or self.terminating.is_set():
            raise Fenced()

    def _watch_imds(self) -> None:
        while not self._done.wait(IMDS_POLL_SECONDS):
            try:
                action = self.imds.instance_action()
                rebalance = None if self.rebalance else self.imds.rebalance()
            except Exception:
                log.debug("IMDS poll failed", exc_info=True)
                continue
            # The termination first: when both arrive in one poll, the runtime's next
            # save must already know it is the last one (a rebalance save alone
            # would wait for the upload in flight and keep training).
            if action and not self.notice:
                self.notice = action
                self._emit("notice", kind="instance-action", action=action.get("action"),
                           notice_time=action.get("time"))
                self._emit("status", state="interrupted",
                           detail=f"spot interruption notice: {action.get('action')} at "
                                  f"{action.get('time')}; saving a checkpoint")
                self._send({"op": "notice", "kind": "instance-action",
                            "action": action.get("action"), "time": action.get("time")})
            if rebalance and not self.rebalance:
                self.rebalance = rebalance
                self._emit("notice", kind="rebalance", action="rebalance",
                           notice_time=rebalance.get("noticeTime"))
                self._send({"op": "notice", "kind": "rebalance", "action": "rebalance",
                            "time": rebalance.get("noticeTime")})

    def _watch_stop(self) -> None:
        while not self._done.wait(STOP_POLL_SECONDS):
            try:
                raw = self.store.get(layout.STOP)
            except NotFound:
                continue
            except Exception:
                log.debug("reading the stop request failed", exc_info=True)
                continue
            self.stop_requested = json.loads(raw or b"{}")
            self._emit("status", state="stopped", detail=f"stopping: {self._stop_reason()}")
            self._interrupt_kernel()
            return

    def _stop_reason(self) -> str:
        req = self.stop_requested or {}
        reason = req.get("reason", "requested")
        detail = req.get("detail")
        return f"stop requested ({reason}{': ' + detail if detail else ''})"

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The instance is being terminated: flush what we have and go.

        The handler runs between two bytecodes of the main thread, which may hold a
        lock: do the work on a thread, with a hard deadline.
        """
        if self.terminating.is_set():
            return
        self.terminating.set()

        def shut() -> None:
            self._emit("status", state="interrupted", detail="the instance was terminated")
            if self.events is not None:
                with contextlib.suppress(Exception):
                    self.events.flush()
            self._shutdown_kernel()
            os._exit(EXIT_OK)

        threading.Timer(TERMINATION_GRACE_SECONDS, os._exit, args=(EXIT_OK,)).start()
        threading.Thread(target=shut, daemon=True).start()

    # -- the runtime channel ---------------------------------------------------------

    def _open_listener(self) -> socket.socket:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self._socket_path))
        listener.listen(4)
        return listener

    def _serve_channel(self, listener: socket.socket) -> None:
        while not self._done.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with self._conn_lock:
                self._conn = conn
            if self.notice:
                self._send({"op": "notice", "kind": "instance-action",
                            "action": self.notice.get("action"),
                            "time": self.notice.get("time")})
            threading.Thread(target=self._read_channel, args=(conn,), daemon=True).start()

    def _read_channel(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                try:
                    self._on_message(channel.decode(line))
                except Exception:
                    log.exception("bad message from the runtime: %r", line[:200])

    def _on_message(self, msg: dict[str, Any]) -> None:
        ev = self.events
        if ev is None:
            return
        op = msg["op"]
        if op == "metrics":
            for step, t, values in msg["rows"]:
                ev.emit("metric", step=step, t=t, values=values)
        elif op == "checkpoint":
            data = {k: v for k, v in msg.items() if k != "op"}
            ev.emit("checkpoint", **data)
            if data.get("phase") == "begin":
                ev.emit("status", state="checkpointing",
                        detail=f"saving a checkpoint at step {data.get('step')}")
            elif not self.notice:
                ev.emit("status", state="running", detail="running the cell")
        elif op == "restored":
            ev.emit("status", state="running",
                    detail=f"restored checkpoint of step {msg.get('step')} "
                           f"in {msg.get('seconds', 0):.1f}s")
        elif op == "sync":
            ev.emit("checkpoint", kind="sync", **{k: v for k, v in msg.items() if k != "op"})
        elif op == "parked":
            # The save forced by the notice is durable: steps after it would only be
            # redone. Let the replacement start now rather than after the lease's TTL.
            self.parked.set()
            ev.emit("status", state="interrupted",
                    detail=f"final checkpoint at step {msg.get('step')} is durable; "
                           "waiting for the instance to be terminated")
            ev.flush()
            if self.held is not None:
                self._done_with_lease()
        elif op == "hello":
            pass
        else:
            log.warning("unknown message from the runtime: %s", op)

    def _done_with_lease(self) -> None:
        assert self.held is not None and self.events is not None
        self.events.flush()
        self.held.release()
        # From here on this agent writes nothing: the replacement owns the job. The
        # kernel stays parked until the instance is terminated.
        self.events.stop_writing()

    def _send(self, msg: dict[str, Any]) -> None:
        with self._conn_lock:
            conn = self._conn
            if conn is None:
                return
            try:
                conn.sendall(channel.encode(msg))
            except OSError:
                self._conn = None

    # -- helpers ---------------------------------------------------------------------

    def _emit(self, type: str, **data: Any) -> None:
        if self.events is not None and not self.fenced.is_set():
            self.events.emit(type, **data)

    def _close_events(self) -> None:
        if self.events is not None:
            self.events.close()

    def _prefetch(self, dest: Path) -> None:
        """Download the latest checkpoint while the kernel starts (runtime verifies it)."""
        try:
            from spotnb.checkpoints import CheckpointStore

            ckpts = CheckpointStore(self.store, prefix=layout.CHECKPOINTS,
                                    keep=self.spec.policy.keep_checkpoints)
            manifest = ckpts.latest()
            if manifest is None:
                return
            assert self.events is not None
            self.events.emit("status", state="restoring",
                             detail=f"downloading the checkpoint of step {manifest.step}")
            ckpts.download(manifest, dest)
        except Exception:
            log.exception("prefetching the checkpoint failed; the runtime will download it")
        finally:
            (dest / channel.PREFETCH_DONE).touch()

    def _identity(self) -> dict[str, Any]:
        try:
            ident = dict(self.imds.identity())
        except Exception:
            log.warning("no instance metadata endpoint; using the host name as identity")
            ident = {}
        ident.setdefault("instance_id", f"host-{socket.gethostname()}-{os.getpid()}")
        return ident

    def _where(self) -> str:
        ident = self.identity
        parts = [ident.get("instance_type"), ident.get("az_id") or ident.get("az"),
                 ident.get("instance_id")]
        return " ".join(str(p) for p in parts if p)


def _process_started() -> float | None:
    """When this process started (epoch seconds, to 10 ms), for the resume benchmark.

    From ``/proc/self/stat`` against the boot clock: psutil's ``create_time`` counts
    from the boot time in whole seconds, up to a second off.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of proc(5), in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


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
    return Agent(args.job).run()
