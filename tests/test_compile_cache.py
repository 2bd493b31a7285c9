"""torch.compile costs once per job: its caches travel with the job, and compiled and
uncompiled models load each other's checkpoints."""

from __future__ import annotations

import io
import json
import signal
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from test_runtime import ENV_KEYS

import spotnb
from spotnb.ckpt import compile_cache
from spotnb.protocol.events import Event, metrics_data
from spotnb.protocol.store import LocalStore
from spotnb.train import runtime as spot

# Importing torch.compile's parts (torch.utils.mkldnn) uses a deprecated torch.jit API.
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _compiled(model: torch.nn.Module) -> Any:
    return torch.compile(model)  # an OptimizedModule: a Module named "_orig_mod." inside


def _dirs(root: Path) -> dict[str, Path]:
    return compile_cache.cache_dirs(root, {})


def test_the_caches_pack_and_unpack_into_another_instances_directories(
        tmp_path: Path) -> None:
    first = _dirs(tmp_path / "a")
    (first["inductor"] / "fxgraph" / "ab").mkdir(parents=True)
    (first["inductor"] / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (first["triton"] / "k").mkdir(parents=True)
    (first["triton"] / "k" / "kernel.so").write_bytes(b"\x7fELF")
    (first["triton"] / "k" / "x.lock").write_bytes(b"")
    data = compile_cache.pack(first)
    second = _dirs(tmp_path / "b")
    assert compile_cache.unpack(data, second) == 2
    assert (second["inductor"] / "fxgraph" / "ab" / "entry").read_bytes() == b"graph"
    assert (second["triton"] / "k" / "kernel.so").read_bytes() == b"\x7fELF"
    assert not (second["triton"] / "k" / "x.lock").exists()  # locks are not cache


def test_a_package_cannot_write_outside_the_caches(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("inductor/../../escaped", "elsewhere/file", "/etc/passwd-x"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"x"))
    dirs = _dirs(tmp_path / "c")
    assert compile_cache.unpack(buf.getvalue(), dirs) == 0
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "c" / "escaped").exists()


def test_the_jobs_own_cache_directories_win(tmp_path: Path) -> None:
    env = compile_cache.cache_env(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": "/mine"})
    assert env == {"TRITON_CACHE_DIR": str(tmp_path / "compile-cache" / "triton")}
    assert compile_cache.cache_dirs(tmp_path, {"TORCHINDUCTOR_CACHE_DIR": "/mine"})[
        "inductor"] == Path("/mine")


def test_an_upload_happens_once_per_change(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "store")
    dirs = _dirs(tmp_path / "i")
    uploader = compile_cache.Uploader(store, dirs)
    uploader.maybe_upload()
    uploader.wait()
    assert not store.exists(compile_cache.KEY)  # nothing compiled yet: nothing sent
    dirs["inductor"].mkdir(parents=True)
    (dirs["inductor"] / "a").write_bytes(b"1")
    uploader.maybe_upload()
    uploader.wait()
    first = store.get(compile_cache.KEY)
    store.delete(compile_cache.KEY)
    uploader.maybe_upload()
    uploader.wait()
    assert not store.exists(compile_cache.KEY)  # unchanged: not sent again
    (dirs["inductor"] / "b").write_bytes(b"2")
    uploader.maybe_upload()
    uploader.wait()
    assert store.get(compile_cache.KEY) != first
    assert compile_cache.fetch(store, _dirs(tmp_path / "j")) == 2


# -- compiled and uncompiled checkpoints -------------------------------------------------

@pytest.fixture
def standalone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    spot._finish()
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    spot._finish()


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.Linear(8, 2))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("saved_compiled", [True, False])
def test_compiled_and_uncompiled_models_load_each_others_checkpoints(
        standalone: Path, saved_compiled: bool) -> None:
    torch.manual_seed(0)
    net = _net()
    # torch.compile wraps lazily: nothing is compiled until the model is called.
    saved = spot.Checkpoint(model=_compiled(net) if saved_compiled else net)
    saved.save(3)
    saved.wait()
    spot._finish()
    torch.manual_seed(1)
    other = _net()
    target = other if saved_compiled else _compiled(other)
    assert spot.Checkpoint(model=target).restore() == 4
    for mine, theirs in zip(other.state_dict().values(), net.state_dict().values(),
                            strict=True):
        assert torch.equal(mine, theirs)
    # The README's recipe reads the downloaded checkpoint into either.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        set_model_state_dict,
    )

    from spotnb.ckpt.dcp import FileReader

    path = next((standalone / spot.LOCAL_DIR / "checkpoints").glob("*/MANIFEST.json")).parent
    for model in (_net(), _compiled(_net())):
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, storage_reader=FileReader(path))
        set_model_state_dict(model, sd["model"])
        loaded: Any = get_model_state_dict(model)["0.weight"]
        assert torch.equal(loaded, net.state_dict()["0.weight"])


# -- a job: the second attempt's compile loads the first's -------------------------------

COMPILED = textwrap.dedent("""
    import json, os, time
    import torch
    from torch._dynamo.utils import counters

    found = sum(len(files) for _, _, files in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    ckpt = spot.Checkpoint(model=compiled, opt=opt)
    start = ckpt.restore()
    for step in range(start, 6):
        loss = compiled(torch.randn(4, 16)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if step == start:
            print("attempt", spot.attempt, json.dumps({
                "files_before": found,
                "hits": counters["inductor"]["fxgraph_cache_hit"],
                "misses": counters["inductor"]["fxgraph_cache_miss"]}), flush=True)
        ckpt.save(step)
        ckpt.wait()
        if step == 2:
            while spot.attempt == 1:  # killed here, once the cache is uploaded
                time.sleep(0.5)
""")


@pytest.mark.slow  # two attempts, and a compile on CPU
@pytest.mark.timeout(900)
def test_the_next_attempt_compiles_from_the_jobs_cache(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import wait_until
    from test_reliability import booted, kernel_of

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    handle = spotnb.submit(COMPILED)
    boot = wait_until(lambda: booted(handle, 1), 120, "attempt 1")
    checkpoints = handle.store.child("checkpoints")
    wait_until(lambda: checkpoints.exists("LATEST") and
               json.loads(checkpoints.get("LATEST"))["step"] == 2, 600, "the save at 2")
    wait_until(lambda: handle.store.exists(compile_cache.KEY), 120, "the compile cache")
    agent = psutil.Process(boot.data["pid"])
    kernel = kernel_of(agent.pid)
    agent.send_signal(signal.SIGKILL)
    psutil.wait_procs([kernel], timeout=30)
    result = handle.wait(timeout=600)
    assert result.status == "completed", (result.reason, result.error)
    lines = [e.data["text"] for e in handle.events(follow=False) if e.type == "stream"]
    said = {int(line.split()[1]): json.loads(line.split(" ", 2)[2])
            for text in lines for line in text.splitlines() if line.startswith("attempt ")}
    assert said[1]["files_before"] == 0 and said[1]["misses"] > 0  # compiled cold
    # The replacement found the first attempt's cache before the cell ran, and its
    # compile loaded every graph from it.
    assert said[2]["files_before"] > 0
    assert said[2]["hits"] > 0 and said[2]["misses"] == 0


# -- a notice before the first checkpoint -------------------------------------------------

def test_a_notice_before_any_checkpoint_says_the_next_attempt_starts_over() -> None:
    from spotnb.client import display
    from spotnb.client.display import JobView

    t0 = 1_800_000_000.0
    view = JobView(job_id="j", name="n", created=t0)
    events = [
        Event("status", t0, 1, "i-1", {"state": "booting", "instance_type": "g5.xlarge",
                                       "az": "a"}),
        Event("status", t0 + 1, 1, "i-1", {"state": "running", "detail": "running the cell"}),
        # Compiling: no step logged, no checkpoint, when the notice comes.
        Event("notice", t0 + 300, 1, "i-1", {"kind": "instance-action", "action": "terminate",
                                             "notice_time": "2027-01-01T00:00:00Z"}),
        Event("status", t0 + 420, 2, "i-2", {"state": "booting", "instance_type": "g5.xlarge",
                                             "az": "b"}),
        Event("metrics", t0 + 700, 2, "i-2", metrics_data([(0, t0 + 700, {"loss": 1.0})])),
    ]
    lines = []
    for event in events:
        view.apply(event)
        text = display.milestone(event, view)
        if text is not None:
            lines.append(text)
    assert "no checkpoint yet: unless the cell saves one before the instance goes, the " \
           "next attempt starts from the beginning" in lines[1]
    assert "saving a checkpoint, then resuming" not in lines[1]
    assert lines[2].startswith("attempt 2: starting again from the beginning on a "
                               "replacement instance (no checkpoint was saved)")
    # What the interruption cost counts the first attempt's whole run (its compile
    # was lost), up to the second attempt's first step.
    assert view.folded.lost_seconds(t0 + 800) == pytest.approx(700.0 - 0.0)


# -- a warm standby: its compile after the takeover loads the first attempt's ------------

GATED_COMPILED = textwrap.dedent("""
    import json, os, time
    import torch
    from torch._dynamo.utils import counters

    found = sum(len(files) for _, _, files in os.walk(os.environ["TORCHINDUCTOR_CACHE_DIR"]))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model)
    ckpt = spot.Checkpoint(model=compiled, opt=opt)
    start = ckpt.restore()
    for step in range(start, STEPS):
        loss = compiled(torch.randn(4, 16)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        if step == start:
            print("attempt", spot.attempt, json.dumps({
                "files_before": found,
                "hits": counters["inductor"]["fxgraph_cache_hit"],
                "misses": counters["inductor"]["fxgraph_cache_miss"]}), flush=True)
        ckpt.maybe_save(step)
        while step == GATE_STEP and not os.path.exists(GATE):
            time.sleep(0.05)
""")


@pytest.mark.slow  # a compile on CPU, a standby
@pytest.mark.timeout(900)
def test_a_warm_standby_compiles_from_the_jobs_cache_after_its_takeover(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from helpers import wait_until

    from spotnb.protocol.events import codec
    from spotnb.protocol.events.fold import fold
    from spotnb.providers.local import LocalProvider

    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "30")
    # Market time at the wall clock's pace: the standby's warm-up (torch's imports on
    # a loaded 2-core machine) gets its whole hold (STANDBY_HOLD_SECONDS) to be ready.
    monkeypatch.setenv("SPOTNB_LOCAL_TIME_SCALE", "1")
    gate = tmp_path / "gate"
    handle = spotnb.submit(GATED_COMPILED, checkpoint_every="1 steps",
                           standby_first_hour=True,
                           inputs={"STEPS": 8, "GATE": str(gate), "GATE_STEP": 3})
    try:
        # Attempt 1 compiled, saved, uploaded its cache, and waits at its gate.
        wait_until(lambda: handle.store.exists(compile_cache.KEY), 600, "the compile cache")
        LocalProvider().recommend(handle.job_id)

        def standby_ready() -> bool:
            return any(e.attempt == 0 and e.type == "instance"
                       and e.data.get("action") == "standby-ready"
                       for e in handle.events(follow=False))

        wait_until(standby_ready, 300, "the standby ready")

        def moving() -> bool:
            return any(e.attempt == 1 and isinstance(e.body, codec.Notice)
                       and e.body.interruption for e in handle.events(follow=False))

        # The old attempt's agent saw the move's notice: its cell, let go, saves at its
        # next step and the standby takes over (let go earlier, the cell may end all
        # its steps first on a fast or loaded machine: no takeover to test).
        wait_until(moving, 300, "the old instance's notice of the move")
        gate.touch()
        result = handle.wait(timeout=600)
    finally:
        gate.touch()
        handle.stop()
    assert result.status == "completed", (result.reason, result.error)
    events = list(handle.events(follow=False))
    (sb,) = fold(events).standbys.values()
    lines = [e.data["text"] for e in events if e.type == "stream"]
    said = {int(line.split()[1]): json.loads(line.split(" ", 2)[2])
            for text in lines for line in text.splitlines() if line.startswith("attempt ")}
    assert said[1]["misses"] > 0  # the first attempt compiled cold
    # The standby unpacked the cache while it warmed up, before the takeover; its
    # compile after the restore loaded every graph.
    assert sb.attempt is not None
    standby = said[sb.attempt]
    assert standby["files_before"] > 0 and standby["hits"] > 0 and standby["misses"] == 0
