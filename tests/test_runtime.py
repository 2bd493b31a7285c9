"""The runtime API inside a cell, against a fake agent on a real Unix socket."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest
import torch

from spotnb.ckpt.checkpoints import CheckpointError, CheckpointStore, CorruptCheckpoint, FencedOff
from spotnb.kernel_remote import channel
from spotnb.protocol import layout, lease
from spotnb.protocol.store import LocalStore
from spotnb.train import process, saving
from spotnb.train import runtime as spot
from spotnb.train.syncdir import sync_name

# The data file of a small checkpoint (one rank, one file: spotnb.ckpt.dcp).
DATA = "__0_0.distcp"

ENV_KEYS = (
    channel.ENV_JOB_URI, channel.ENV_JOB_ID, channel.ENV_ATTEMPT, channel.ENV_INSTANCE_ID,
    channel.ENV_SOCKET, channel.ENV_CHECKPOINT_EVERY, channel.ENV_KEEP_CHECKPOINTS,
    channel.ENV_SCRATCH, channel.ENV_RESTORE_DIR,
)


class FakeAgent:
    """The agent's end of the channel: a real Unix-socket server recording messages."""

    def __init__(self) -> None:
        # Unix socket paths are limited to ~107 bytes: keep it short, in /tmp.
        self.dir = tempfile.mkdtemp(prefix="snt-")
        self.path = os.path.join(self.dir, "agent.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(4)
        self.messages: list[dict[str, Any]] = []
        # Scripted answers to the runtime's "fence" questions, in order; while there is
        # none, the question goes unanswered (the runtime then reads the lease itself).
        self.fence_replies: list[dict[str, Any]] = []
        # The events this agent holds unwritten, answered to an "unlogged" question
        # (None: unanswered, as an agent of an older spotnb).
        self.unlogged: list[str] | None = None
        self.cond = threading.Condition()
        self.conns: list[socket.socket] = []
        self.readers: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            reader = threading.Thread(target=self._read, args=(conn,), daemon=True)
            with self.cond:
                reader.start()
                self.conns.append(conn)
                self.readers.append(reader)

    def _read(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as lines:
            for line in lines:
                message = channel.decode(line)
                with self.cond:
                    self.messages.append(message)
                    self.cond.notify_all()
                    reply = (self.fence_replies.pop(0) if message["op"] == "fence"
                             and self.fence_replies else None)
                    unlogged = self.unlogged if message["op"] == "unlogged" else None
                if unlogged is not None:
                    conn.sendall(channel.encode({"op": "unlogged", "id": message["id"],
                                                 "events": unlogged, "next": 9}))
                if reply is not None:
                    conn.sendall(channel.encode({"op": "fence", "id": message["id"], **reply}))

    def notice(self, kind: str, hellos: int = 1) -> None:
        """Send a notice once ``hellos`` runtimes have connected (and said hello)."""
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.ops("hello")) >= hellos, 20)
        self.send({"op": "notice", "kind": kind, "action": "terminate",
                   "time": "2026-11-22T10:00:00Z"})

    def send(self, message: dict[str, Any]) -> None:
        with self.cond:
            conns = list(self.conns)
        for conn in conns:
            with contextlib.suppress(OSError):  # that runtime is gone
                conn.sendall(channel.encode(message))

    def ops(self, op: str, **match: Any) -> list[dict[str, Any]]:
        with self.cond:
            return [m for m in self.messages if m["op"] == op
                    and all(m.get(k) == v for k, v in match.items())]

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float = 120
    ) -> dict[str, Any]:
        with self.cond:
            found: list[dict[str, Any]] = []

            def done() -> bool:
                found[:] = [m for m in self.messages if pred(m)]
                return bool(found)

            assert self.cond.wait_for(done, timeout), f"no such message in {self.messages}"
            return found[0]

    def rows(self) -> list[list[Any]]:
        return [row for m in self.ops("metrics") for row in m["rows"]]

    def close(self) -> None:
        # shutdown() wakes the thread blocked in accept(); close() alone would not.
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.cond:
            conns, readers = list(self.conns), list(self.readers)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for reader in readers:
            reader.join(timeout=5)
        self._acceptor.join(timeout=5)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclasses.dataclass
class Job:
    agent: FakeAgent
    store: LocalStore
    env: dict[str, str]
    tmp: Path

    def checkpoints(self) -> CheckpointStore:
        return CheckpointStore(self.store, layout.CHECKPOINTS)


def _job_env(agent: FakeAgent, store: LocalStore, tmp: Path, **overrides: str) -> dict[str, str]:
    env = {
        channel.ENV_JOB_URI: store.root.as_uri(),
        channel.ENV_JOB_ID: "job-1",
        channel.ENV_ATTEMPT: "1",
        channel.ENV_INSTANCE_ID: "i-test",
        channel.ENV_SOCKET: agent.path,
        channel.ENV_CHECKPOINT_EVERY: json.dumps({"seconds": 3600, "steps": None}),
        channel.ENV_KEEP_CHECKPOINTS: "3",
        channel.ENV_SCRATCH: str(tmp / "scratch"),
    }
    env.update(overrides)
    return env


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    spot._finish()
    agent = FakeAgent()
    store = LocalStore(tmp_path / "store")
    assert lease.acquire(store, "i-test") is not None  # epoch 1 == SPOTNB_ATTEMPT
    env = _job_env(agent, store, tmp_path)
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        yield Job(agent, store, env, tmp_path)
    finally:
        try:
            spot._finish()
        finally:
            agent.close()


def _subprocess_env(env: dict[str, str]) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    base.update(env)
    return base


# -- metrics -------------------------------------------------------------------------


def test_metrics_arrive_batched(job: Job, caplog: pytest.LogCaptureFixture) -> None:
    weight = torch.tensor(2.0, requires_grad=True)
    for step in range(1000):
        spot.log(step, loss=step * 0.5, grad=weight * 3, np=np.float32(0.25), bad="x",
                 nan=float("nan"), inf=math.inf)
    job.agent.wait_for(lambda m: m["op"] == "metrics" and m["rows"][-1][0] == 999)
    rows = job.agent.rows()
    assert [r[0] for r in rows] == list(range(1000))
    assert len(job.agent.ops("metrics")) < 20  # batched, not one message per call
    step, t, values = rows[10]
    assert abs(t - time.time()) < 60
    assert values["loss"] == 5.0 and values["grad"] == 6.0 and values["np"] == 0.25
    assert math.isnan(values["nan"]) and values["inf"] == math.inf
    assert "bad" not in values
    assert "bad='str' is not a number" in caplog.text
    hello = job.agent.ops("hello")
    assert hello == [{"op": "hello", "pid": os.getpid()}]
    assert job.agent.messages[0] == hello[0]


# -- checkpoints in process ----------------------------------------------------------


class Thing:
    """An arbitrary picklable object (read back as ckpt["thing"])."""

    def __init__(self, label: str, values: list[float]) -> None:
        self.label = label
        self.values = values

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Thing) and (self.label, self.values) == (
            other.label, other.values)

    __hash__ = None  # type: ignore[assignment]


def _mlp() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_save_restore_round_trip(job: Job) -> None:
    torch.manual_seed(0)
    model, opt, sched = _mlp()
    _train(model, opt, sched, 3)
    stats: dict[str, Any] = {"best": 0.5, "hist": [1, 2]}
    seen = [1, 2, 3]
    ema = torch.ones(4)
    ckpt = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched, stats=stats,
                           seen=seen, ema=ema, thing=Thing("a", [1.0]), best_step=17)
    assert ckpt.restore() == 0
    ckpt.save(41)
    manifest = ckpt.wait()
    assert manifest is not None and manifest.step == 41 and manifest.format == "dcp"

    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = opt.state_dict()["state"][0]["momentum_buffer"].clone()
    saved_epoch = sched.last_epoch
    expected_draws = _draws()

    # Training goes on and everything changes...
    _train(model, opt, sched, 3)
    stats["best"] = 0.1
    stats["hist"].append(3)
    seen.append(4)
    ema.mul_(3)
    _draws()
    # ...then the cell re-runs on a new instance with fresh objects bound to old names.
    ckpt2 = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched, stats=stats,
                            seen=seen, ema=ema, thing=Thing("fresh", []), best_step=0)
    assert ckpt2.restore() == 42
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved_model[k]), k
    assert torch.equal(opt.state_dict()["state"][0]["momentum_buffer"], saved_opt)
    assert sched.last_epoch == saved_epoch
    assert ckpt2["stats"] is stats and stats == {"best": 0.5, "hist": [1, 2]}
    assert ckpt2["seen"] is seen and seen == [1, 2, 3]
    assert ckpt2["ema"] is ema and torch.equal(ema, torch.ones(4))
    assert ckpt2["thing"] == Thing("a", [1.0])
    assert ckpt2["best_step"] == 17
    assert _draws() == expected_draws

    job.agent.wait_for(lambda m: m["op"] == "restored")
    begin, durable = job.agent.ops("checkpoint")
    assert begin["phase"] == "begin" and begin["id"] == manifest.id
    assert durable["phase"] == "durable" and durable["step"] == 41
    assert durable["forced"] is False and durable["bytes"] == manifest.total_bytes > 0
    (restored,) = job.agent.ops("restored")
    assert restored["id"] == manifest.id and restored["step"] == 41


def test_generators_and_arrays_restore_in_place(job: Job) -> None:
    py_rng, torch_rng = random.Random(1), torch.Generator().manual_seed(2)
    np_rng, arr = np.random.default_rng(3), np.arange(6.0)
    ckpt = spot.Checkpoint(py_rng=py_rng, torch_rng=torch_rng, np_rng=np_rng, arr=arr)
    ckpt.save(0)
    ckpt.wait()
    expected = (py_rng.random(), torch.rand(2, generator=torch_rng).tolist(),
                np_rng.random(), arr.sum())
    arr *= 7
    spot._finish()
    ckpt = spot.Checkpoint(py_rng=py_rng, torch_rng=torch_rng, np_rng=np_rng, arr=arr)
    assert ckpt.restore() == 1
    assert ckpt["arr"] is arr
    assert (py_rng.random(), torch.rand(2, generator=torch_rng).tolist(), np_rng.random(),
            arr.sum()) == expected


_NO_TORCH = textwrap.dedent(
    """
    import random, sys
    from spotnb.train import runtime as spot

    random.seed(5)
    state = {"history": []}
    ckpt = spot.Checkpoint(state=state)
    start = ckpt.restore()
    for step in range(start, start + 3):
        state["history"].append(random.random())
    ckpt.save(start + 2)
    spot._finish()
    assert "torch" not in sys.modules
    print(start, len(state["history"]), state["history"][-1])
    """
)


def test_pickle_format_without_torch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    runs = [subprocess.run([sys.executable, "-c", _NO_TORCH], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=60) for _ in range(2)]
    assert [r.returncode for r in runs] == [0, 0], runs[-1].stderr
    first, second = (r.stdout.split() for r in runs)
    assert first[:2] == ["0", "3"] and second[:2] == ["3", "6"]
    random.seed(5)
    draws = [random.random() for _ in range(6)]
    assert float(second[2]) == draws[-1]  # the RNG continued where it stopped
    manifest = CheckpointStore(LocalStore(tmp_path / spot.LOCAL_DIR)).latest()
    assert manifest is not None and manifest.format == "pickle" and manifest.step == 5


def test_unpicklable_state_fails_the_save_by_name(job: Job) -> None:
    ckpt = spot.Checkpoint(handle=threading.Lock())
    with pytest.raises(TypeError, match="cannot checkpoint 'handle'"):
        ckpt.save(0)
    assert job.checkpoints().latest() is None


def test_restore_uses_the_prefetched_copy(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = spot.Checkpoint(stats={"x": 1})
    ckpt.save(5)
    manifest = ckpt.wait()
    assert manifest is not None
    spot._finish()
    # The agent prefetched it; then the store's copy got damaged: the prefetch is used.
    prefetched = job.tmp / "prefetched"
    job.checkpoints().download(manifest, prefetched)
    (prefetched / channel.PREFETCH_DONE).touch()
    (job.store.root / "checkpoints" / manifest.id / DATA).write_bytes(b"damaged")
    monkeypatch.setenv(channel.ENV_RESTORE_DIR, str(prefetched))
    stats: dict[str, int] = {}
    assert spot.Checkpoint(stats=stats).restore() == 6
    assert stats == {"x": 1}


def test_restore_waits_for_a_prefetch_still_downloading(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = spot.Checkpoint(stats={"x": 1})
    ckpt.save(5)
    manifest = ckpt.wait()
    assert manifest is not None
    spot._finish()
    # The agent is still downloading when the cell reaches restore(); the store's copy
    # is damaged, so only the prefetched copy can give the right answer.
    prefetched = job.tmp / "prefetched"
    prefetched.mkdir()
    source = job.tmp / "source"
    job.checkpoints().download(manifest, source)
    (job.store.root / "checkpoints" / manifest.id / DATA).write_bytes(b"damaged")

    def agent_download() -> None:
        time.sleep(0.5)
        for item in source.iterdir():
            shutil.copy(item, prefetched / item.name)
        (prefetched / channel.PREFETCH_DONE).touch()

    threading.Thread(target=agent_download).start()
    monkeypatch.setenv(channel.ENV_RESTORE_DIR, str(prefetched))
    stats: dict[str, int] = {}
    assert spot.Checkpoint(stats=stats).restore() == 6
    assert stats == {"x": 1}


def test_restore_downloads_when_the_prefetch_is_bad(
    job: Job, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = spot.Checkpoint(stats={"x": 1})
    ckpt.save(5)
    manifest = ckpt.wait()
    assert manifest is not None
    spot._finish()
    prefetched = job.tmp / "prefetched"
    job.checkpoints().download(manifest, prefetched)
    (prefetched / DATA).write_bytes(b"truncated")
    (prefetched / channel.PREFETCH_DONE).touch()
    monkeypatch.setenv(channel.ENV_RESTORE_DIR, str(prefetched))
    stats: dict[str, int] = {}
    assert spot.Checkpoint(stats=stats).restore() == 6
    assert stats == {"x": 1}
    assert "is unusable" in caplog.text


def test_restore_falls_back_past_a_damaged_checkpoint(
    job: Job, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = spot.Checkpoint(stats={"x": 0})
    ids = []
    for step in (1, 2):
        ckpt["stats"]["x"] = step
        ckpt.save(step)
        ids.append(ckpt.wait().id)  # type: ignore[union-attr]
    spot._finish()
    (job.store.root / "checkpoints" / ids[1] / DATA).write_bytes(b"bit rot")
    stats: dict[str, int] = {}
    assert spot.Checkpoint(stats=stats).restore() == 2  # step 1's, one step redone
    assert stats == {"x": 1}
    assert f"checkpoint {ids[1]}: file '{DATA}'" in caplog.text
    spot._finish()
    (job.store.root / "checkpoints" / ids[0] / DATA).write_bytes(b"bit rot")
    with pytest.raises(CorruptCheckpoint, match="every checkpoint of this job is damaged"):
        spot.Checkpoint(stats=stats).restore()


def test_a_save_too_slow_for_the_notice_warns_once(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = spot.Checkpoint(stats={"x": 1})
    ckpt.save(1)
    ckpt.wait()
    spot._finish()  # EC2's two minutes: a tiny state fits easily
    # A notice period no save can meet: the first durable save says so, once.
    monkeypatch.setenv(channel.ENV_NOTICE_SECONDS, "0.000001")
    ckpt = spot.Checkpoint(stats={"x": 1})
    for step in (2, 3):
        ckpt.save(step)
        ckpt.wait()
    spot._finish()
    for reader in job.agent.readers:
        reader.join(timeout=20)  # every message of both sessions is in
    (warning,) = job.agent.ops("warning")
    assert warning["kind"] == "notice-fit"
    assert "more than 50% of the 0 s interruption notice" in warning["text"]
    assert "Save more often" in warning["text"]
    durable = job.agent.ops("checkpoint", phase="durable")
    assert [m["step"] for m in durable] == [1, 2, 3]
    assert job.agent.messages.index(durable[1]) < job.agent.messages.index(warning)


# -- policy ----------------------------------------------------------------------------


def test_maybe_save_every_n_steps(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(channel.ENV_CHECKPOINT_EVERY, json.dumps({"seconds": None, "steps": 3}))
    ckpt = spot.Checkpoint(stats={"n": 0})
    saved = [step for step in range(10) if ckpt.maybe_save(step)]
    assert saved == [2, 5, 8]  # "3 steps done since the last save"
    ckpt.wait()
    spot._finish()
    ckpt = spot.Checkpoint(stats={"n": 0})
    start = ckpt.restore()
    assert start == 9
    assert [s for s in range(start, 15) if ckpt.maybe_save(s)] == [11, 14]


class _SkewedTime:
    """The ``time`` module with a monotonic clock that a test moves forward."""

    def __init__(self) -> None:
        self.skew = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.skew

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def test_maybe_save_every_n_seconds(job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    # A period far longer than any stall of a loaded machine, and the runtime's clock
    # moved past it: the test orders the saves, not the scheduler.
    monkeypatch.setenv(channel.ENV_CHECKPOINT_EVERY, json.dumps({"seconds": 60, "steps": None}))
    clock = _SkewedTime()
    monkeypatch.setattr(saving, "time", clock)
    ckpt = spot.Checkpoint(stats={"n": 0})
    assert not ckpt.maybe_save(0)
    clock.skew += 60
    assert ckpt.maybe_save(1)
    assert not ckpt.maybe_save(2)
    clock.skew += 60
    assert ckpt.maybe_save(3)
    ckpt.wait()
    job.agent.wait_for(lambda m: m.get("phase") == "durable" and m["step"] == 3)
    assert [m["step"] for m in job.agent.ops("checkpoint", phase="durable")] == [1, 3]


def test_rebalance_notice_forces_one_save_without_parking(job: Job) -> None:
    ckpt = spot.Checkpoint(stats={"n": 0})
    assert not ckpt.maybe_save(0)
    assert not spot.interrupt_pending
    job.agent.notice("rebalance")
    deadline = time.monotonic() + 10
    while not ckpt.maybe_save(1):
        assert time.monotonic() < deadline, "the notice never forced a save"
        time.sleep(0.01)
    assert not ckpt.maybe_save(2)
    ckpt.wait()
    durable = job.agent.wait_for(lambda m: m.get("phase") == "durable")
    assert durable["forced"] is True and durable["step"] == 1
    assert not spot.interrupt_pending  # a recommendation, not an interruption
    assert job.agent.ops("parked") == []


def test_fenced_save_does_not_move_latest(job: Job) -> None:
    ckpt = spot.Checkpoint(stats={"n": 0})
    ckpt.save(1)
    first = ckpt.wait()
    # Another agent takes the job over (this one's lease expired).
    assert lease.acquire(job.store, "i-other", now=time.time() + 3600) is not None
    ckpt.save(2)
    assert ckpt.wait() is None
    assert job.checkpoints().latest() == first
    failed = job.agent.wait_for(lambda m: m.get("phase") == "failed")
    assert failed["step"] == 2 and "lost the job's lease" in failed["error"]
    ns = {"out": 1}
    with pytest.raises(FencedOff):
        spot._save_outputs(["out"], ns)
    assert not job.store.exists(layout.OUTPUTS)
    # The end of the job reports that its newest checkpoint is not durable.
    with pytest.raises(CheckpointError, match="checkpoint of step 2 could not be made durable"):
        spot._finish()


def test_a_lease_the_agent_cannot_confirm_is_not_a_lost_one(job: Job) -> None:
    # A store outage: the agent's last renewals failed, so it can say neither "held"
    # nor "lost". The commit waits for an answer; it does not give the job up (which
    # held the cell forever while the agent kept the lease: found by the fault soak).
    ckpt = spot.Checkpoint(stats={"n": 0})
    ckpt.save(0)
    assert ckpt.wait() is not None
    job.agent.fence_replies = [{"ok": False, "unknown": True},
                               {"ok": False, "unknown": True}, {"ok": True}]
    job.agent.send({"op": "ping"})  # the runtime now asks the agent, not the store
    deadline = time.monotonic() + 20
    while not ((rt := process.existing()) is not None and rt.watchdog.pinged):
        assert time.monotonic() < deadline, "the runtime never read the ping"
        time.sleep(0.01)
    ckpt.save(1)
    assert ckpt.wait() is not None
    assert job.checkpoints().latest() is not None
    assert job.checkpoints().latest().step == 1
    assert len(job.agent.ops("fence")) == 3
    # A lost lease still fences the save off.
    job.agent.fence_replies = [{"ok": False, "unknown": False}]
    ckpt.save(2)
    assert ckpt.wait() is None
    assert job.checkpoints().latest().step == 1
    with pytest.raises(CheckpointError, match="checkpoint of step 2 could not be made durable"):
        spot._finish()


# -- across processes ------------------------------------------------------------------

_TRAIN = textwrap.dedent(
    """
    import hashlib, os, random, signal, sys
    import numpy as np, torch
    from spotnb.train import runtime as spot

    total, kill_after = int(sys.argv[1]), int(sys.argv[2])
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    stats = {"seen": 0}
    ckpt = spot.Checkpoint(model=model, optimizer=opt, scheduler=sched, stats=stats)
    start = ckpt.restore()
    print("start", start, flush=True)
    for step in range(start, total):
        x = torch.randn(32, 8) + float(np.random.rand()) + random.random()
        loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad(); loss.backward(); opt.step(); sched.step()
        stats["seen"] += 32
        spot.log(step, loss=loss)
        ckpt.maybe_save(step)
        if step == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)  # the instance vanishes
    spot._finish()
    digest = hashlib.sha256()
    for t in model.state_dict().values():
        digest.update(t.numpy().tobytes())
    digest.update(opt.state_dict()["state"][0]["momentum_buffer"].numpy().tobytes())
    print("result", digest.hexdigest(), stats["seen"], sched.last_epoch, flush=True)
    """
)


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _TRAIN, *args], env=_subprocess_env(env),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # over 30 s: two training runs in subprocesses
def test_interrupted_run_is_bitwise_identical(job: Job) -> None:
    env = dict(job.env)
    env[channel.ENV_CHECKPOINT_EVERY] = json.dumps({"seconds": None, "steps": 4})
    alone = job.tmp / "alone"
    alone.mkdir()
    # The reference runs standalone (no job, no saves); attempt 1 runs at the same time.
    reference = _run(["20", "-1"], {}, alone)
    first = _run(["20", "9"], env, job.tmp)
    ref_out, ref_err = reference.communicate(timeout=120)
    first.communicate(timeout=120)
    assert reference.returncode == 0, ref_err
    assert first.returncode == -signal.SIGKILL

    env[channel.ENV_ATTEMPT] = "2"
    lease.acquire(job.store, "i-test", now=time.time() + 3600)  # attempt 2 takes over
    second = _run(["20", "-1"], env, job.tmp)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err

    start = int(out.split("start ")[1].split()[0])
    assert start in (4, 8)  # saved after step 3 (and 7 if that upload beat the kill)
    assert out.split("result ")[1] == ref_out.split("result ")[1]
    restored = job.agent.wait_for(lambda m: m["op"] == "restored")
    assert restored["step"] == start - 1
    # (The first attempt's last rows may die with it: SIGKILL leaves no time to send.)
    steps = [r[0] for r in job.agent.rows()]
    assert steps[-1] == 19 and set(range(start, 20)) <= set(steps)


_PARK = textwrap.dedent(
    """
    import time
    import torch
    from spotnb.train import runtime as spot

    model = torch.nn.Linear(4, 4)
    ckpt = spot.Checkpoint(model=model)
    for step in range(ckpt.restore(), 100000):
        with torch.no_grad():
            model.weight.add_(1.0)
        spot.log(step, w=model.weight[0, 0])
        ckpt.maybe_save(step)
        time.sleep(0.01)
    """
)


@pytest.mark.slow  # over 30 s
def test_notice_forces_a_save_then_parks(job: Job) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _PARK], env=_subprocess_env(job.env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        job.agent.wait_for(lambda m: m["op"] == "metrics" and m["rows"][-1][0] >= 5)
        job.agent.notice("instance-action")
        parked = job.agent.wait_for(lambda m: m["op"] == "parked")
        durable = job.agent.ops("checkpoint", phase="durable")
        assert durable[-1]["step"] == parked["step"] and durable[-1]["forced"] is True
        assert job.agent.messages.index(durable[-1]) < job.agent.messages.index(parked)
        latest = job.checkpoints().latest()
        assert latest is not None and latest.step == parked["step"]
        # The cell is held: no step after the parked one runs.
        time.sleep(0.5)
        assert proc.poll() is None
        assert max(r[0] for r in job.agent.rows()) == parked["step"]
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    # Under an agent the notice and the parking are its events, which the notebook shows
    # as one line each: the kernel's stderr does not say them a second time.
    assert "holding the cell until the instance is terminated" not in err
    assert "saving at the next opportunity" not in err


_SLOW_PARK = textwrap.dedent(
    """
    import os, time
    from spotnb.train import runtime as spot

    state = {"blob": os.urandom(50_000), "step": -1}
    ckpt = spot.Checkpoint(state=state)
    for step in range(ckpt.restore(), 100000):
        state["step"] = step
        spot.log(step, x=step)
        ckpt.maybe_save(step)
        time.sleep(0.01)
    """
)


@pytest.mark.parametrize("rebalance_first", [False, True],
                         ids=["termination", "rebalance-then-termination"])
def test_notice_during_an_upload_does_not_queue_behind_it(
        job: Job, rebalance_first: bool) -> None:
    # A slow network (the local store's throttle): one upload takes about 2.5 s.
    env = dict(job.env, SPOTNB_LOCAL_UPLOAD_MBPS="0.02")
    env[channel.ENV_CHECKPOINT_EVERY] = json.dumps({"seconds": None, "steps": 50})
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_PARK], env=_subprocess_env(env),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        begin = job.agent.wait_for(lambda m: m.get("phase") == "begin")
        # The loop has gone past that save (a notice during the save itself would make
        # it the last one: nothing would upload beside it).
        job.agent.wait_for(lambda m: m["op"] == "metrics" and m["rows"][-1][0] > begin["step"])
        if rebalance_first:
            # The rebalance's save waits for the upload in flight; the termination
            # notice that follows must end that wait, not queue behind it.
            job.agent.notice("rebalance")
            time.sleep(0.2)
        job.agent.notice("instance-action")
        parked = job.agent.wait_for(lambda m: m["op"] == "parked")
        durable = job.agent.ops("checkpoint", phase="durable")
        # Both are durable, in step order.
        assert [m["step"] for m in durable] == [begin["step"], parked["step"]]
        # The forced one did not queue behind the first: it began writing (beside it,
        # sharing the link) before the first was durable, and committed after it.
        with job.agent.cond:
            seen = [(m.get("phase"), m["step"]) for m in job.agent.messages
                    if m["op"] == "checkpoint"]
        assert seen.index(("begin", parked["step"])) < seen.index(("durable", begin["step"]))
        assert seen.index(("durable", begin["step"])) < seen.index(("durable", parked["step"]))
        latest = job.checkpoints().latest()
        assert latest is not None and latest.step == parked["step"]
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# -- sync_dir ----------------------------------------------------------------------------


def test_sync_dir_restores_and_uploads_on_notice(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = job.tmp / "work"
    (work / "runs" / "exp" / "sub").mkdir(parents=True)
    monkeypatch.chdir(work)
    (work / "runs/exp/model.bin").write_bytes(os.urandom(300_000))
    (work / "runs/exp/sub/notes.txt").write_text("epoch 3")
    sd = spot.sync_dir("runs/exp", every="1h")
    assert spot.sync_dir("./runs/exp/") is sd  # the same directory, the same snapshot
    spot._finish()  # a final upload
    job.agent.wait_for(lambda m: m["op"] == "sync")
    (durable,) = job.agent.ops("sync", phase="durable")
    assert durable["files"] == 2 and durable["bytes"] == 300_007

    # A new instance: the directory is gone and comes back from the store.
    original = (work / "runs/exp/model.bin").read_bytes()
    shutil.rmtree(work / "runs")
    spot.sync_dir("runs/exp", every="1h")
    assert (work / "runs/exp/model.bin").read_bytes() == original
    assert (work / "runs/exp/sub/notes.txt").read_text() == "epoch 3"
    assert job.agent.wait_for(lambda m: m.get("phase") == "restored")["files"] == 2

    # A notice uploads at once, not an hour later.
    (work / "runs/exp/more.txt").write_text("new")
    job.agent.notice("rebalance", hellos=2)  # the second session's connection
    job.agent.wait_for(lambda m: m["op"] == "sync" and m.get("files") == 3)


def test_a_frameworks_save_carries_what_the_log_has_not_confirmed(
    job: Job, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accelerate's integration (Transformers' and Lightning's save the same way: a
    # synced directory's snapshot at the framework's save point): the snapshot carries
    # the rows the agent has not confirmed and the events it holds unwritten, and the
    # next attempt's restore hands both to its agent, which records what the log lacks.
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    monkeypatch.chdir(job.tmp)
    printed = json.dumps({"type": "stream", "time": 1.0, "attempt": 1, "instance": "i-test",
                          "data": {"name": "stdout", "text": "step 3\n"}, "v": 1, "n": 7})
    job.agent.unlogged = [printed]
    job.agent.fence_replies = [{"ok": True}] * 4  # it holds the lease
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(torch.nn.Linear(2, 1))
    saves = spot.callbacks.accelerate(accelerator, "ck")
    job.agent.send({"op": "ping"})  # a live agent: it answers what its log lacks
    deadline = time.monotonic() + 30
    while not spot._rt().watchdog.pinged and time.monotonic() < deadline:
        time.sleep(0.01)
    spot.log(3, loss=0.5)
    saves.save(3)
    manifest = saves._dir.wait()
    assert manifest is not None
    assert {"metrics.json", "events.jsonl"} <= {f.name for f in manifest.files}
    spot._finish()

    # The next attempt: the directory comes back, its carry goes to the agent.
    shutil.rmtree(job.tmp / "ck")
    monkeypatch.setenv(channel.ENV_ATTEMPT, "2")
    assert spot.callbacks.accelerate(accelerator, "ck").restore() == 4
    replay = job.agent.wait_for(lambda m: m["op"] == "replay")
    assert replay["attempt"] == 1 and replay["events"] == [printed]
    assert [(step, values) for step, _t, values in replay["rows"]] == [(3, {"loss": 0.5})]
    assert not (job.tmp / "ck" / "metrics.json").exists()  # not put among the user's files


# -- hooks the agent calls ---------------------------------------------------------------


def test_bootstrap_and_outputs(job: Job) -> None:
    job.store.put(layout.INPUTS, cloudpickle.dumps(
        {"x": cloudpickle.dumps(41), "inc": cloudpickle.dumps(lambda v: v + 1)}))
    ns: dict[str, Any] = {}
    spot._bootstrap(ns)
    assert ns["x"] == 41 and ns["inc"](1) == 2 and ns["spot"] is spot
    job.agent.wait_for(lambda m: m["op"] == "hello")

    ns["result"] = {"acc": 0.9}
    ns["lock"] = threading.Lock()
    with pytest.raises(spot.OutputError, match="'nope' is not defined"):
        spot._save_outputs(["result", "nope"], ns)
    with pytest.raises(spot.OutputError, match="'lock' \\(a lock\\) cannot be pickled"):
        spot._save_outputs(["result", "lock"], ns)
    spot._save_outputs(["result"], ns)
    assert cloudpickle.loads(job.store.get(layout.OUTPUTS)) == {"result": {"acc": 0.9}}


# -- standalone --------------------------------------------------------------------------


def test_standalone_without_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spot._finish()
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        assert (spot.job_id, spot.attempt, spot.interrupt_pending) == ("local", 0, False)
        spot.log(0, loss=1.5)
        spot.log(1, loss=torch.tensor(0.5))
        assert [(s, v) for s, _t, v in spot.history()] == [(0, {"loss": 1.5}),
                                                           (1, {"loss": 0.5})]
        stats = {"n": 1}
        ckpt = spot.Checkpoint(stats=stats)
        assert ckpt.restore() == 0
        ckpt.save(7)
        spot._finish()
        assert (tmp_path / spot.LOCAL_DIR / "checkpoints" / "LATEST").exists()
        stats["n"] = 99
        assert spot.Checkpoint(stats=stats).restore() == 8
        assert stats == {"n": 1}
    finally:
        spot._finish()
    logging.getLogger("spotnb").debug("standalone done")


# -- directories a framework saves to (spot.callbacks) ----------------------------------

_FRAMEWORK_LOOP = textwrap.dedent(
    """
    import os, shutil
    from spotnb.train import runtime as spot
    from spotnb.train.syncdir import find_checkpoints, newest_checkpoint_only

    # A framework's way: checkpoint-<step>/ folders written in place (not atomically),
    # the newest two kept on disk; saved every 5 steps and when a notice asks.
    sd = spot.sync_dir("out", every=None, select=newest_checkpoint_only())
    last = spot.last_checkpoint("out")
    start = int(open(os.path.join(last, "step")).read()) + 1 if last else 0
    for step in range(start, 100000):
        spot.log(step, x=step)
        if step % 5 == 4 or spot.save_requested:
            folder = os.path.join("out", f"checkpoint-{step}")
            os.makedirs(folder)
            with open(os.path.join(folder, "weights.bin"), "wb") as f:
                f.write(os.urandom(20_000))
            with open(os.path.join(folder, "step"), "w") as f:
                f.write(str(step))
            for old in find_checkpoints("out")[:-2]:
                shutil.rmtree(old)
            sd.save(step)
    """
)


def test_framework_dir_saved_at_save_points_then_parked_on_notice(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    work = job.tmp / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _FRAMEWORK_LOOP], cwd=work,
                            env=_subprocess_env(job.env), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        job.agent.wait_for(lambda m: m["op"] == "sync" and m.get("step") == 9)
        job.agent.notice("instance-action")
        parked = job.agent.wait_for(lambda m: m["op"] == "parked")
        saves = job.agent.ops("sync", phase="durable")
        # Periodic saves at 4 and 9, then the one the notice forced, made durable before
        # the cell was parked; nothing logged after it.
        assert [m["step"] for m in saves][:2] == [4, 9]
        assert saves[-1]["step"] == parked["step"] and saves[-1]["forced"] is True
        assert all(m["forced"] is False for m in saves[:-1])
        assert max(r[0] for r in job.agent.rows()) == parked["step"]
    finally:
        proc.kill()
        proc.communicate(timeout=30)
    # The snapshot holds one checkpoint, the newest, whole (and the rows the fake
    # agent never confirmed).
    snapshots = CheckpointStore(job.store, f"{layout.SYNC}/{sync_name('out')}")
    latest = snapshots.latest()
    assert latest is not None
    assert sorted(f.name for f in latest.files) == [
        f"files/checkpoint-{parked['step']}/step", f"files/checkpoint-{parked['step']}/weights.bin",
        "metrics.json"]

    # The replacement: restored, and last_checkpoint names it.
    fresh = job.tmp / "fresh"
    fresh.mkdir()
    monkeypatch.chdir(fresh)
    found = spot.last_checkpoint("out")
    assert found == os.path.join("out", f"checkpoint-{parked['step']}")
    assert (fresh / found / "step").read_text() == str(parked["step"])


def test_newest_checkpoint_only_keeps_the_newest_the_best_and_other_files() -> None:
    from spotnb.train.syncdir import newest_checkpoint_only

    rels = ["checkpoint-5/a.bin", "checkpoint-10/a.bin", "checkpoint-10/sub/b.json",
            "checkpoint-9/a.bin", "runs/events.out", "config.json",
            "checkpoints/checkpoint_2/x", "checkpoints/checkpoint_3/x", "step_7.pt"]
    kept = newest_checkpoint_only(keep=lambda: ["checkpoint-5"])(rels)
    assert sorted(kept) == ["checkpoint-10/a.bin", "checkpoint-10/sub/b.json",
                            "checkpoint-5/a.bin", "config.json", "runs/events.out"]
    assert newest_checkpoint_only()(["a/b", "c"]) == ["a/b", "c"]


def test_a_framework_dir_stays_saved_at_save_points(
        job: Job, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(job.tmp)
    sd = spot.sync_dir("out", every=None)
    # Asking for it again (a demo's sync_dir(path).wait(), last_checkpoint) does not
    # put it back on a timer that could catch a checkpoint half-written.
    assert spot.sync_dir("out") is sd and sd.every is None
    assert spot.last_checkpoint("out") is None
    (job.tmp / "out" / "checkpoint-3").mkdir()
    assert spot.last_checkpoint("out") == os.path.join("out", "checkpoint-3")


def test_log_params_sends_bounded_json(job: Job) -> None:
    import enum

    class Kind(enum.Enum):
        LINEAR = "linear"

    spot.log_params({"lr": 0.1, "layers": [64, 32], "kind": Kind.LINEAR, "path": Path("/x"),
                     "blob": "x" * 1000, "obj": object(), "nan": math.nan},
                    source="test", extra=True)
    message = job.agent.wait_for(lambda m: m["op"] == "params")
    params = message["params"]
    assert message["source"] == "test"
    assert params["lr"] == 0.1 and params["layers"] == [64, 32] and params["extra"] is True
    assert params["kind"] == "linear" and params["path"] == "/x" and params["nan"] == "nan"
    assert len(params["blob"]) <= process.MAX_PARAM_CHARS + 1
    assert params["obj"].startswith("<object object")


def test_a_saves_states_all_lead_from_start_to_done() -> None:
    # Checkpoint's save is a state machine: every state is reachable from START, every
    # one but DONE leads on, and DONE (only) ends it.
    table = saving.SAVE_TRANSITIONS
    assert set(table) == set(saving.SaveState)
    reached, todo = {saving.SaveState.START}, [saving.SaveState.START]
    while todo:
        for following in table[todo.pop()]:
            if following not in reached:
                reached.add(following)
                todo.append(following)
    assert reached == set(saving.SaveState)
    assert [s for s in saving.SaveState if not table[s]] == [saving.SaveState.DONE]
    # ... and each state but DONE has the step that does its work.
    assert set(saving.SaveRun.STEPS) == set(saving.SaveState) - {saving.SaveState.DONE}
