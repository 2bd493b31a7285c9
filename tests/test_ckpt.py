"""Checkpoints at model scale: bounded host memory, streamed saves, the DCP format.

States here are small (tens of MB) with budgets smaller still, so that a save must
stream most of its state; the 1-4 GB figures are ``benchmarks/bench_checkpoint.py``'s.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from spotnb.ckpt import METADATA_FILE, node_share
from spotnb.ckpt.checkpoints import MANIFEST, CheckpointStore, FileEntry, Manifest
from spotnb.ckpt.dcp import FileReader, ItemLocation, StoreWriter, load_state, save_state, state_key
from spotnb.ckpt.memory import MemoryBudget, parse_size
from spotnb.ckpt.notice import NoticeFit, input_state_bytes
from spotnb.protocol.store import LocalStore
from spotnb.train import runtime as spot

# Environment variables of a job (set by other tests' fixtures): a subprocess here
# runs standalone, against ./.spotnb-local.
_JOB_ENV = ("SPOTNB_JOB_URI", "SPOTNB_AGENT_SOCKET", "SPOTNB_ATTEMPT", "SPOTNB_RESTORE_DIR",
            "SPOTNB_CHECKPOINT_MEMORY", "SPOTNB_LOCAL_UPLOAD_MBPS")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_ENV}
    env.update(extra)
    return env


@pytest.fixture
def standalone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    spot._finish()
    for key in _JOB_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        spot._finish()


# -- the memory budget -----------------------------------------------------------------


def test_budget_accepts_sizes_and_shares_and_names_the_forms() -> None:
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size(1_000_000) == 1_000_000
    assert parse_size("25%") == 0.25
    for bad in ("lots", "0MB", "150%", -3, "8 parsecs"):
        with pytest.raises(ValueError, match=r"as bytes, a size such as '8GB'|share must"):
            parse_size(bad)  # type: ignore[arg-type]
    assert MemoryBudget("64MB").bytes() == 64 * 10**6
    # A share is of the free RAM, counting what the checkpoint itself already holds.
    share = MemoryBudget("50%")
    assert share.bytes(held=10**9) > share.bytes() > 0


# -- bounded memory (subprocesses: peak RSS is per process) ------------------------------

_PEAK = textwrap.dedent(
    """
    import json, re, sys
    import torch
    import spotnb.ckpt.dcp  # imported first: imports are not the save's memory
    from spotnb.train import runtime as spot

    def rss():
        status = open("/proc/self/status").read()
        return [int(re.search(key + r":\\s+(\\d+)", status).group(1)) * 1024
                for key in ("VmRSS", "VmHWM")]

    budget = sys.argv[1]
    torch.manual_seed(0)
    # 128 MB of state: 64 MB of weights and 64 MB of SGD momentum.
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    small = spot.Checkpoint(x=torch.zeros(4))  # first-use costs, outside the measure
    small.save(0)
    small.wait()
    open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
    before, _ = rss()
    # Checkpoint() starts allocating the save's buffers (in the background): its memory
    # counts from here.
    ckpt = spot.Checkpoint(model=model, optimizer=opt, host_memory=budget)
    ckpt.save(1)
    manifest = ckpt.wait()
    _, peak = rss()
    print(json.dumps({"extra": peak - before, "bytes": manifest.total_bytes}))
    spot._finish()
    """
)


def _peak_extra(tmp_path: Path, budget: str) -> tuple[int, int]:
    work = tmp_path / budget
    work.mkdir()
    run = subprocess.run([sys.executable, "-c", _PEAK, budget], env=_env(), cwd=work,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    return int(out["extra"]), int(out["bytes"])


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_peak_host_memory_of_a_save_stays_within_the_budget(tmp_path: Path) -> None:
    budget = 16 * 10**6
    extra, state = _peak_extra(tmp_path, "16MB")
    assert state > 7 * budget  # the state is far larger than the budget
    # The budget, and a little for the save's own Python objects (plans, threads).
    assert extra < budget + 4 * 10**6, f"a save used {extra / 1e6:.1f} MB over its RSS"
    # The measure sees a whole copy when the budget allows one.
    whole, _ = _peak_extra(tmp_path, "1GB")
    assert whole > 0.9 * state


def test_warming_and_a_capture_share_the_buffers_and_allocate_each_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from spotnb.ckpt import buffers, snapshot

    allocated: list[tuple[int, ...]] = []
    real_empty = buffers._empty

    def counting_empty(torch_: Any, shape: Any, dtype: Any, on_gpu: bool) -> Any:
        allocated.append(tuple(shape))
        return real_empty(torch_, shape, dtype, on_gpu)

    monkeypatch.setattr(buffers, "_empty", counting_empty)
    objects = {"m": torch.nn.Sequential(*[torch.nn.Linear(256, 256 + i) for i in range(6)])}
    specs = snapshot.tensor_specs(objects)
    total = sum(t.numel() * t.element_size() for _, _, t in specs)
    pool = snapshot.BufferPool()
    pool.warm_async(specs, total)  # the save below comes at once: they share the work
    captured = snapshot.capture(objects, pool, step=1)
    pool.wait_warm()
    assert sorted(allocated) == sorted(tuple(t.shape) for _, _, t in specs)  # once each
    for name, t in snapshot.live_tensors(objects).items():
        assert torch.equal(captured.tensors[name], t)
    assert pool.held == total
    # Warming for a larger budget than the next capture's keeps only what it copied.
    pool = snapshot.BufferPool()
    pool.warm_async(specs, total)
    captured = snapshot.capture(objects, pool, step=2, budget=total // 2)
    pool.wait_warm()
    assert pool.held == captured.copied <= total // 2


def test_one_large_buffer_is_filled_in_pieces_by_the_warming_thread_and_the_capture(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One large tensor's pages are filled by both threads, as many tensors' are."""
    import threading

    from spotnb.ckpt import buffers, memory, snapshot

    if not memory.can_populate():
        pytest.skip("filling part of a mapping needs MADV_POPULATE_WRITE (Linux 5.14+)")
    piece = 1 << 20
    monkeypatch.setattr(buffers, "FILL_PIECE_BYTES", piece)
    calls: list[tuple[str, int, int]] = []
    warming, capturing = threading.Event(), threading.Event()
    real_populate = buffers.populate

    def recording(address: int, nbytes: int) -> None:
        name = threading.current_thread().name
        calls.append((name, address, nbytes))
        if name == "spotnb-warm":
            warming.set()
            # Held after its first piece until the capture fills one too.
            assert capturing.wait(60), "the capture filled no piece of the buffer"
        else:
            capturing.set()
        real_populate(address, nbytes)

    monkeypatch.setattr(buffers, "populate", recording)
    table = torch.randn(2048, 1024)  # 8 MiB: 8 pieces
    objects = {"table": table}
    pool = snapshot.BufferPool()
    pool.warm_async(snapshot.tensor_specs(objects), 1 << 30)
    assert warming.wait(60), "the warming thread filled no piece"
    captured = snapshot.capture(objects, pool, step=1)
    pool.wait_warm()
    buf = captured.tensors["table"]
    assert torch.equal(buf, table) and buf.data_ptr() != table.data_ptr()
    # Every piece filled exactly once, by one thread or the other.
    assert sorted((address, n) for _, address, n in calls) == \
        [(buf.data_ptr() + i * piece, piece) for i in range(8)]
    assert {name for name, *_ in calls} == {"spotnb-warm", threading.current_thread().name}
    assert pool.held == 8 * piece


def test_a_copy_batch_splits_the_bytes_over_threads_and_copies_each_exactly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from spotnb.ckpt import memory, snapshot

    monkeypatch.setattr(memory, "_COPY_SHARE_MIN_BYTES", 1 << 10)
    shares: list[int] = []  # the bytes of each share, as the threads copy them
    real_copy = memory._copy

    def recording_copy(ranges: list[tuple[int, int, int]]) -> None:
        shares.append(sum(size for *_, size in ranges))
        real_copy(ranges)

    monkeypatch.setattr(memory, "_copy", recording_copy)
    torch.manual_seed(0)
    plain = [torch.randn(100_003), torch.randint(0, 255, (7, 13), dtype=torch.uint8),
             torch.randn(4099, dtype=torch.float64), torch.zeros(0),
             torch.randn(33, 3).to(torch.bfloat16)]
    others = [torch.randn(30, 40).t(), torch.randn(5, dtype=torch.complex64).conj()]
    batch = memory.CopyBatch()
    dsts = [torch.empty(t.shape, dtype=t.dtype) for t in plain + others]
    assert [batch.add(d, t) for d, t in zip(dsts, plain + others, strict=True)] == \
        [True] * len(plain) + [False] * len(others)  # not a run of bytes: the caller's
    total = batch.nbytes
    batch.run(threads=3)
    assert len(shares) == 3 and sum(shares) == total
    assert max(shares) - min(shares) <= 2  # equal shares (the last one takes the rest)
    for d, t in zip(dsts[:len(plain)], plain, strict=True):
        assert torch.equal(d, t)
    # Every byte in exactly one share, in order, for any number of shares.
    ranges = [(0, 1000, 10), (50, 2000, 7), (100, 3000, 20)]
    for n in (1, 2, 3, 5, 37):
        shares = memory._split(ranges, n)
        assert len(shares) <= n
        flat = [(d + i, s + i) for share in shares for d, s, size in share for i in range(size)]
        assert flat == [(d + i, s + i) for d, s, size in ranges for i in range(size)]
    # A capture copies plain and other tensors alike.
    objects = {"m": torch.nn.Linear(64, 48), "t": torch.randn(64, 64).t(),
               "z": torch.randn(3, dtype=torch.complex64).conj()}
    captured = snapshot.capture(objects, snapshot.BufferPool(), step=1)
    for name, t in snapshot.live_tensors(objects).items():
        assert torch.equal(captured.tensors[name], t)
        assert captured.tensors[name].data_ptr() != t.data_ptr()


# -- a streamed save restores byte-exactly -------------------------------------------------


class Tied(torch.nn.Module):
    """Tied weights, odd dtypes and shapes: what a state_dict can hold."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(300, 64)
        self.head = torch.nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(64)
        self.register_buffer("bf16", torch.randn(31, 17).to(torch.bfloat16))
        self.register_buffer("counts", torch.arange(1000, dtype=torch.int64))
        self.register_buffer("mask", torch.rand(333) > 0.5)
        self.register_buffer("scalar", torch.tensor(3.25))
        self.register_buffer("nothing", torch.empty(0, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(x)))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for i, per_param in opt.state_dict()["state"].items():
        for k, v in per_param.items():
            out[f"opt.{i}.{k}"] = v.clone() if isinstance(v, torch.Tensor) else v
    return out


def test_a_streamed_save_restores_byte_exactly_in_place(
        standalone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        loss = model(torch.randint(0, 300, (8,))).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    transposed = torch.randn(40, 30).t()  # not contiguous
    array = np.random.default_rng(0).standard_normal((20, 7)).astype(np.float32)
    swapped = np.arange(12, dtype=">i4")  # not native byte order: kept in the state
    ckpt = spot.Checkpoint(model=model, optimizer=opt, transposed=transposed, array=array,
                           swapped=swapped, host_memory=4096)
    expected = _state(model, opt)
    expected_t, expected_a = transposed.clone(), array.copy()
    # A slow link: the save is still writing when training goes on.
    monkeypatch.setenv("SPOTNB_LOCAL_UPLOAD_MBPS", "1")
    ckpt.save(9)
    # save() returned: the live tensors are written, so training may change them all.
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers(), transposed):
            t.add_(7) if t.dtype != torch.bool else t.logical_not_()
        for per_param in opt.state.values():
            per_param["exp_avg"].add_(7)
    array += 7
    manifest = ckpt.wait()
    assert manifest is not None and manifest.format == "dcp"
    spot._finish()
    monkeypatch.delenv("SPOTNB_LOCAL_UPLOAD_MBPS")

    # A resumed attempt: fresh objects (other values), a fresh optimizer (no state yet).
    torch.manual_seed(2)
    fresh = Tied()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    weight_at = fresh.embed.weight.data_ptr()
    t2, a2 = torch.zeros(40, 30).t(), np.zeros((20, 7), np.float32)
    again = spot.Checkpoint(model=fresh, optimizer=fresh_opt, transposed=t2, array=a2,
                            swapped=np.zeros(12, ">i4"))
    assert again.restore() == 10
    got = _state(fresh, fresh_opt)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key
    assert fresh_opt.param_groups[0]["lr"] == 0.01
    # Read into the registered tensors themselves; tied weights stay tied.
    assert fresh.embed.weight.data_ptr() == weight_at
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(t2, expected_t) and np.array_equal(a2, expected_a)
    assert again["swapped"].tolist() == list(range(12))


# -- a state of one large tensor -------------------------------------------------------------


def _one_large_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 1 MiB and a file per 2 MiB: a few-MB tensor is split like a 1 GB one."""
    from spotnb.ckpt.dcp import one_process, writer

    monkeypatch.setattr(one_process, "CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(writer, "FILE_MIN_BYTES", 2 << 20)


def _holding(directory: Path, fqn: str) -> set[str]:
    """The data files holding a part of tensor ``fqn``."""
    metadata = FileReader(directory).read_metadata()
    return {loc.file for index, loc in metadata.storage_data.items() if index.fqn == fqn}


def test_one_large_tensor_is_written_in_chunks_by_every_file_and_restores_bitwise(
        standalone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(5)
    table = torch.randn(1000, 1500)  # 6 MB: rows split into chunks
    wide = torch.randn(2, 700_000)  # 5.6 MB in 2 rows: each row split too
    ckpt = spot.Checkpoint(table=table, wide=wide)
    ckpt.save(1)
    old = ckpt.wait()  # chunking off (as spotnb wrote it before): one chunk per tensor
    assert old is not None
    at_first = {"table": table.clone(), "wide": wide.clone()}
    _one_large_tensor(monkeypatch)
    local = standalone / spot.LOCAL_DIR / "checkpoints"
    saved_before = FileReader(local / old.id).read_metadata().state_dict_metadata
    assert len(saved_before["table"].chunks) == len(saved_before["wide"].chunks) == 1
    with torch.no_grad():
        table.add_(1)
        wide.add_(1)
    ckpt.save(2)
    manifest = ckpt.wait()
    assert manifest is not None
    metadata = FileReader(local / manifest.id).read_metadata()
    names = {fqn for fqn in metadata.state_dict_metadata if not fqn.startswith("spotnb/")}
    assert names == {"table", "wide"}
    assert len(metadata.state_dict_metadata["table"].chunks) == 6
    assert len(metadata.state_dict_metadata["wide"].chunks) == 6
    data_files = {f.name for f in manifest.files if f.name.endswith(".distcp")}
    assert len(data_files) == 4 and _holding(local / manifest.id, "table") == data_files
    # A streamed save (the budget holds none of it): the chunks of the live tensors are
    # written from the training tensors by every live file.
    streamed = spot.Checkpoint(table=table, wide=wide, host_memory=4096)
    streamed.save(3)
    third = streamed.wait()
    assert third is not None
    assert len(_holding(local / third.id, "table")) > 1
    spot._finish()

    fresh_table, fresh_wide = torch.zeros(1000, 1500), torch.zeros(2, 700_000)
    at = fresh_table.data_ptr()
    assert spot.Checkpoint(table=fresh_table, wide=fresh_wide).restore() == 4
    assert torch.equal(fresh_table, table) and torch.equal(fresh_wide, wide)
    assert fresh_table.data_ptr() == at  # read in place, chunk by chunk
    # The checkpoint of one chunk per tensor still restores, the chunked one as well
    # when nothing is registered to read into (a fresh optimizer's state, say).
    for cid, expect in ((old.id, at_first), (manifest.id, {"table": table, "wide": wide})):
        reader = FileReader(local / cid)
        targets: dict[str, Any] = {"table": torch.empty(1000, 1500),
                                   "wide": torch.empty(2, 700_000)}
        load_state(targets, reader)
        assert torch.equal(targets["table"], expect["table"]), cid
        assert torch.equal(targets["wide"], expect["wide"]), cid
    # DCP itself reads the chunks back into one tensor.
    import torch.distributed.checkpoint as dcp

    target = {"table": torch.zeros(1000, 1500)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming one process"
        dcp.load(target, storage_reader=FileReader(local / manifest.id))
    assert torch.equal(target["table"], table)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_a_damaged_chunk_of_a_large_tensor_falls_back_to_the_checkpoint_before(
        standalone: Path, monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    _one_large_tensor(monkeypatch)
    table = torch.randn(1000, 1500)
    ckpt = spot.Checkpoint(table=table)
    ckpt.save(1)
    first = ckpt.wait()
    at_first = table.clone()
    with torch.no_grad():
        table.add_(1)
    ckpt.save(2)
    second = ckpt.wait()
    assert first is not None and second is not None
    spot._finish()
    directory = standalone / spot.LOCAL_DIR / "checkpoints" / second.id
    holding = sorted(_holding(directory, "table"))
    assert len(holding) > 1  # the tensor is in several files: damage one of them
    victim = directory / holding[-1]
    if damage == "flip":
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(victim.read_bytes()[:-4096])
    else:
        victim.unlink()
    fresh = torch.zeros(1000, 1500)
    assert spot.Checkpoint(table=fresh).restore() == 2
    assert torch.equal(fresh, at_first)


# -- invariant 2 when a streamed save is killed ---------------------------------------------

_KILLED = textwrap.dedent(
    """
    import os
    import torch
    from spotnb.train import runtime as spot

    small = spot.Checkpoint(tag={"step": 1})
    small.save(1)
    small.wait()
    # A slow network from here on, and a state that does not fit the budget: the save
    # streams it straight from the tensor while the loop waits.
    os.environ["SPOTNB_LOCAL_UPLOAD_MBPS"] = "4"
    big = spot.Checkpoint(weights=torch.randn(16 * 2**20 // 4), host_memory=1 << 20)
    print("saving", flush=True)
    big.save(2)
    print("saved", flush=True)
    """
)


def _size(path: Path) -> int:
    """A file's size; 0 once it is gone (a finished part is renamed into place)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def test_a_streamed_save_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / spot.LOCAL_DIR)
    cs = CheckpointStore(store, "checkpoints")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED], env=_env(), cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "saving"
        deadline = time.monotonic() + 60
        partial: list[Path] = []
        # Kill once part of the 16 MB state is in the store (it takes 4 s at 4 MB/s).
        while time.monotonic() < deadline and not partial:
            partial = [p for p in (store.root / "checkpoints").glob("000000000002-*/.tmp-*")
                       if _size(p) > 2**20]
            time.sleep(0.01)  # a poll, not a wait on time: leave the CPU to the save
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert partial, "the save never got going"
    assert proc.returncode == -signal.SIGKILL
    (cut,) = [i for i in cs.ids() if i.startswith("000000000002-")]
    assert not store.exists(f"checkpoints/{cut}/{MANIFEST}")
    latest = cs.latest()
    assert latest is not None and latest.step == 1
    # A new attempt resumes from the complete checkpoint; the partial one is invisible.
    spot._finish()
    tag: dict[str, int] = {}
    os.chdir(tmp_path)
    try:
        assert spot.Checkpoint(tag=tag).restore() == 2
    finally:
        spot._finish()
    assert tag == {"step": 1}


# -- the format is DCP's -----------------------------------------------------------------


def test_torch_distributed_checkpoint_reads_a_spotnb_checkpoint(standalone: Path) -> None:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ckpt = spot.Checkpoint(model=model)
    ckpt.save(4)
    manifest = ckpt.wait()
    assert manifest is not None
    names = {f.name for f in manifest.files}
    assert names == {METADATA_FILE, "__0_0.distcp"}
    directory = standalone / spot.LOCAL_DIR / "checkpoints" / manifest.id
    other = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    target = {"model": other.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming one process"
        dcp.load(target, storage_reader=FileReader(directory))
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    # DCP's metadata: one chunk per tensor, each item at an aligned offset of the file.
    metadata = FileReader(directory).read_metadata()
    assert metadata.state_dict_metadata["model.0.weight"].size == torch.Size([16, 8])
    assert all(isinstance(loc, ItemLocation) and loc.offset % 64 == 0
               for loc in metadata.storage_data.values())


def test_dcp_save_with_a_process_group_writes_through_the_store_writer(tmp_path: Path) -> None:
    """The multi-node path: ``dcp.save`` runs the collectives and calls the writer."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(32, 32)
        cs = CheckpointStore(LocalStore(tmp_path / "store"), "checkpoints")
        pending = cs.begin(7, attempt=1)
        writer = StoreWriter(pending)
        dcp.save({"model": model.state_dict(), "extra": {"epoch": 3}},
                 storage_writer=writer)
        cs.commit(pending.finish("dcp"))
        latest = cs.latest()
        assert latest is not None and latest.step == 7
        local = cs.download(latest, tmp_path / "copy")
        assert set(local) == {METADATA_FILE, "__0_0.distcp"}
        other = torch.nn.Linear(32, 32)
        target: dict[str, Any] = {"model": other.state_dict(), "extra": {"epoch": 0}}
        dcp.load(target, storage_reader=FileReader(tmp_path / "copy"))
        assert torch.equal(other.weight, model.weight) and target["extra"] == {"epoch": 3}
    finally:
        dist.destroy_process_group()


def test_store_writer_spreads_a_large_state_over_parallel_files(tmp_path: Path) -> None:
    cs = CheckpointStore(LocalStore(tmp_path / "store"), "checkpoints")
    pending = cs.begin(1)
    # 80 MB in 40 tensors: 2 files of at least FILE_MIN_BYTES... made smaller here.
    tensors = {f"w.{i}": torch.full((2**19,), float(i)) for i in range(40)}
    writer = StoreWriter(pending, live=["w.0", "w.1"])
    import spotnb.ckpt.dcp.writer as writer_mod

    old = writer_mod.FILE_MIN_BYTES
    writer_mod.FILE_MIN_BYTES = 20 * 2**20
    try:
        save_state({**tensors, state_key(): {"n": 40}}, writer)
    finally:
        writer_mod.FILE_MIN_BYTES = old
    assert writer.live_written.is_set()
    manifest = pending.finish("dcp")
    data = sorted(f.name for f in manifest.files if f.name != METADATA_FILE)
    # The two live tensors in a file of their own, the other 76 MB in four.
    assert data == [f"__0_{i}.distcp" for i in range(5)]
    live_file = next(f for f in manifest.files if f.name == "__0_0.distcp")
    assert 2 * 2**21 <= live_file.size < 2 * 2**21 + 4096
    cs.commit(manifest)
    copy = tmp_path / "copy"
    cs.download(manifest, copy)  # checks every size and SHA-256
    reader = FileReader(copy)
    targets: dict[str, Any] = {name: torch.empty(2**19) for name in tensors}
    targets[state_key()] = None
    load_state(targets, reader)
    assert targets[state_key()] == {"n": 40}
    for name, value in tensors.items():
        assert torch.equal(targets[name], value), name
    # The metadata is DCP's, pickled.
    with open(copy / METADATA_FILE, "rb") as f:
        assert type(pickle.load(f)).__name__ == "Metadata"


# -- the notice ------------------------------------------------------------------------------


def test_notice_fit_says_what_to_do() -> None:
    slow = NoticeFit.at_rate(24 * 10**9, 100.0, 120.0)  # 24 GB at 100 MB/s: 240 s
    assert not slow.fits and round(slow.seconds) == 240
    text = slow.advice()
    assert "24.0 GB" in text and "would take about 240 s" in text
    assert "Save more often" in text and "across nodes" in text and "smaller state" in text
    assert NoticeFit.at_rate(2 * 10**9, 100.0, 120.0).fits  # 20 s
    model = torch.nn.Linear(1000, 1000)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert input_state_bytes([model]) == 4 * (1000 * 1000 + 1000)
    model(torch.randn(2, 1000)).sum().backward()
    opt.step()
    # The optimizer's momentum counts once it exists; shared tensors count once.
    assert input_state_bytes([{"m": model, "o": opt}, model.weight]) == 8 * (1000 * 1000 + 1000)


def test_submit_warns_when_the_inputs_alone_would_miss_the_notice(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spotnb.client.jobs import _notice_warnings
    from spotnb.protocol.spec import JobSpec, Policy, Resources
    from spotnb.providers.local import LocalProvider

    spec = JobSpec(job_id="20250101-000000-ffffff", name="big", code="x", provider="local",
                   resources=Resources(instance_types=("g5.xlarge",)), policy=Policy(),
                   store_uri=str(spotnb_home / "store"), created=time.time())
    inputs = {"model": torch.nn.Linear(1000, 1000), "lr": 0.1}  # 4 MB of weights
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "2")
    monkeypatch.setenv("SPOTNB_LOCAL_UPLOAD_MBPS", "1")  # 4 s: more than half the notice
    (text,) = _notice_warnings(LocalProvider(), spec, inputs)
    assert "the cell's inputs alone" in text and "would take about 4 s" in text
    assert "Save more often" in text
    monkeypatch.setenv("SPOTNB_LOCAL_UPLOAD_MBPS", "100")  # 0.04 s
    assert _notice_warnings(LocalProvider(), spec, inputs) == ()
    monkeypatch.delenv("SPOTNB_LOCAL_UPLOAD_MBPS")  # no figure to judge by
    assert _notice_warnings(LocalProvider(), spec, inputs) == ()


_RANK = textwrap.dedent(
    """
    import sys
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.ckpt.dcp import StoreReader, StoreWriter
    from spotnb.protocol.store import LocalStore

    rank, world, rendezvous, root, what = sys.argv[1:6]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6)
    if what == "save":  # each rank saves its rows into one checkpoint id
        cs = CheckpointStore(LocalStore(root), "checkpoints")
        pending = cs.begin(5, checkpoint_id="000000000005-a0001-0000beef")
        dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])},
                 storage_writer=StoreWriter(pending))
        if rank == 0:  # the coordinator lists every rank's files, then commits
            cs.commit(pending.finish("dcp"))
    else:  # each rank loads its columns of a checkpoint saved whole, from the store
        import spotnb.ckpt.dcp.store_reader
        spotnb.ckpt.dcp.store_reader.RANGE_PIECE_BYTES = 128  # ranged reads in pieces
        cs = CheckpointStore(LocalStore(root), "checkpoints")
        reader = StoreReader(cs, cs.latest(), f"{rendezvous}-{rank}")
        target = {"w": distribute_tensor(torch.zeros(24, 6), mesh, [Shard(1)])}
        dcp.load(target, storage_reader=reader)
        expected = full[:, rank * 6 // world:(rank + 1) * 6 // world]
        assert torch.equal(target["w"].to_local(), expected), rank
        # The one file is read by both: rank 0 fetches and verifies it whole, rank 1
        # reads the saved chunk (576 bytes) in ranged pieces of 128.
        if rank == 0:
            assert reader.fetched == {".metadata", "__0_0.distcp"} and not reader.ranges
        else:
            assert reader.fetched == {".metadata"}, reader.fetched
            assert reader.ranges == {"__0_0.distcp": 5}, reader.ranges
    # Every rank past its collectives before any tears the group down; then no
    # interpreter teardown (gloo's threads there can abort the process: "terminate
    # called without an active exception", seen beside two busy loops).
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, flush=True)
    import os
    os._exit(0)
    """
)


def _ranks(tmp_path: Path, world: int, root: Path, what: str) -> None:
    rendezvous = tmp_path / f"rendezvous-{what}"
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(world),
                               str(rendezvous), str(root), what], env=_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outs = [proc.communicate(timeout=240) for proc in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and out.startswith("ok"), err[-3000:]


def test_a_checkpoint_of_n_ranks_loads_on_m(tmp_path: Path) -> None:
    """The format is DCP's: sharded saves, and resharding on load (N -> M)."""
    full = torch.arange(24 * 6, dtype=torch.float32).reshape(24, 6)
    store = LocalStore(tmp_path / "store")
    _ranks(tmp_path, 2, tmp_path / "store", "save")
    cs = CheckpointStore(store, "checkpoints")
    latest = cs.latest()
    assert latest is not None and latest.step == 5
    assert {f.name for f in latest.files} == {METADATA_FILE, "__0_0.distcp", "__1_0.distcp"}
    cs.download(latest, tmp_path / "two")
    # Two ranks' rows -> one process, whole: a read per saved chunk.
    targets: dict[str, Any] = {"w": torch.zeros(24, 6)}
    load_state(targets, FileReader(tmp_path / "two"))
    assert torch.equal(targets["w"], full)

    # One whole tensor -> two ranks' columns: each reads part of a saved chunk.
    one = CheckpointStore(LocalStore(tmp_path / "one"), "checkpoints")
    pending = one.begin(1)
    save_state({"w": full, state_key(): {}}, StoreWriter(pending))
    one.commit(pending.finish("dcp"))
    _ranks(tmp_path, 2, tmp_path / "one", "load")


# -- sharded state (FSDP2) in a distributed job: every rank writes ---------------------------

_SHARDED = textwrap.dedent(
    """
    import pickle
    import sys
    import threading
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from pathlib import Path
    from spotnb.train import runtime as spot
    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.ckpt import node_share
    from spotnb.ckpt.dcp import StoreWriter
    from spotnb.kernel_remote.channel import PREFETCH_DONE
    from spotnb.protocol.store import LocalStore

    rank, world, rendezvous = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    def latest_id():
        return CheckpointStore(LocalStore(spot.LOCAL_DIR), "checkpoints").latest().id
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    def sharded_model(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        return model

    model = sharded_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ckpt = spot.Checkpoint(model=model, optimizer=opt, sched=sched, extra={"epoch": 3})

    def train_step():
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    def full_state():
        names = dict(model.named_parameters())
        return {"model": {k: v.full_tensor() for k, v in model.state_dict().items()},
                "exp_avg": {k: opt.state[p]["exp_avg"].full_tensor()
                            for k, p in names.items()}}

    train_step()
    ckpt.save(0)
    expected_0 = full_state()
    ckpt.wait()

    # Asynchronous: save() returns once the shards are copied; the writes (held here
    # until training has changed the model) must still hold the state of the save.
    gate, opened = threading.Event(), []
    write_file = StoreWriter._write_file
    def gated(self, *args, **kwargs):
        opened.append(gate.wait(120))
        return write_file(self, *args, **kwargs)
    StoreWriter._write_file = gated

    train_step()
    ckpt.save(1)  # every rank writes its shards
    expected = full_state()
    if rank == 0:
        torch.save(expected, "expected.pt")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1000.0)  # training goes on before a byte is written
    gate.set()
    ckpt.wait()
    assert opened and all(opened), "the save wrote before it returned"
    StoreWriter._write_file = write_file

    train_step()
    if rank == 1:  # its writer fails: the gather fails, nothing is made complete
        def broken(*args, **kwargs):
            raise RuntimeError("rank 1's disk failed")
        StoreWriter._write_file = broken
    ckpt.save(2)
    ckpt.wait()  # its writes are over: rank 1 may mend its disk

    class Held(Exception):
        pass

    def held():
        raise Held

    if rank == 1:  # its state cannot be captured: it fails its plan, nobody waits for it
        StoreWriter._write_file = write_file
        ckpt["extra"] = {"lock": threading.Lock()}
    ckpt.save(3)

    if rank == 1:  # its files are written, then its agent says it lost the lease
        ckpt["extra"] = {"epoch": 3}
        spot._rt().fence = lambda: False
        spot._rt().hold_fenced = held
    ckpt.save(4)
    ckpt.wait()
    if rank == 1:  # its next save holds the cell before it takes part in anything
        assert spot._rt().fenced
        try:
            ckpt.save(5)
        except Held:
            print("held", flush=True)

    fetched = []  # the checkpoint files this rank downloads whole (a GET each)
    ranged = []  # the files it reads a range of (a ranged GET each)
    download, get_range = LocalStore.download_file, LocalStore.get_range
    def counted(store, key, path):
        fetched.append(key.rsplit("/", 1)[-1])
        download(store, key, path)
    def counted_range(store, key, offset, length):
        ranged.append(key.rsplit("/", 1)[-1])
        return get_range(store, key, offset, length)
    LocalStore.download_file, LocalStore.get_range = counted, counted_range

    def restored(expected):
        fresh = sharded_model(1)
        fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.1)
        step = spot.Checkpoint(model=fresh, optimizer=fresh_opt).restore()
        for k, v in fresh.state_dict().items():
            assert torch.equal(v.full_tensor(), expected["model"][k]), k
        for k, p in fresh.named_parameters():
            assert torch.equal(fresh_opt.state[p]["exp_avg"].full_tensor(),
                               expected["exp_avg"][k])
        return step

    # Restored at the same world size: every rank loads its shards (collectively),
    # downloading the metadata and its own file, and reading in one ranged request
    # the items every rank holds that DCP saved in another rank's file (once, on the
    # rank with the least of them: Adam's step counts, the param groups).
    assert restored(expected) == 2
    saved = Path(spot.LOCAL_DIR, "checkpoints", latest_id())
    metadata = pickle.loads((saved / ".metadata").read_bytes())
    replicated = {loc.file for index, loc in metadata.storage_data.items()
                  if not index.fqn.startswith("spotnb/state/")
                  and len(getattr(metadata.state_dict_metadata[index.fqn], "chunks", [0])) == 1}
    assert sorted(fetched) == [".metadata", f"__{rank}_0.distcp"], fetched
    assert sorted(ranged) == sorted(replicated - {f"__{rank}_0.distcp"}), ranged
    assert rank == 1 or ranged  # the replicated items are not all in rank 0's file

    # A file damaged in the store (its first bytes): rank 1 fetches it whole and
    # finds the damage; rank 0 reads only a range of it, intact, yet both ranks fall
    # back to the checkpoint before it, together.
    shard = saved / "__1_0.distcp"
    if rank == 1:
        good = shard.read_bytes()
        shard.write_bytes(bytes(b ^ 0xFF for b in good[:64]) + good[64:])
    dist.barrier()
    assert restored(expected_0) == 1
    dist.barrier()
    if rank == 1:
        shard.write_bytes(good)
    print("fell back", flush=True)

    # Each rank on a node of its own: the agent prefetched the node's share (what
    # _prefetch downloads), so the reader downloads nothing more.
    cs = CheckpointStore(LocalStore(spot.LOCAL_DIR), "checkpoints")
    node_dir = Path(f"restore-node{rank}")
    cs.download(cs.latest(), node_dir, names=node_share(cs.latest(), [rank], world))
    (node_dir / PREFETCH_DONE).touch()
    spot._rt().restore_dir = node_dir
    fetched.clear()
    ranged.clear()
    assert restored(expected) == 2
    assert fetched == [] and sorted(ranged) == sorted(replicated - {f"__{rank}_0.distcp"})
    assert not [p for p in node_dir.iterdir() if p.name.startswith(".ranges")]
    # Every rank past its collectives before any tears the group down; then no
    # interpreter teardown (gloo's threads there can abort the process: "terminate
    # called without an active exception", seen beside two busy loops).
    dist.barrier()
    dist.destroy_process_group()
    print("ok", rank, flush=True)
    import os
    os._exit(0)
    """
)


def test_sharded_state_is_written_by_every_rank_and_restores_on_fewer(
        standalone: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """FSDP2 on 2 ranks (gloo): each rank's shards in its own files, one manifest listing
    them; a rank whose write fails or whose agent lost its lease leaves no manifest and
    LATEST where it was; the checkpoint restores on both ranks, each downloading only its
    own file and a range of the other's, and in one process (2 -> 1, resharded: both
    ranks' files); a damaged file makes both ranks fall back to the checkpoint before it,
    the rank that read only a range of it too."""
    rendezvous = standalone / "rendezvous-sharded"
    procs = [subprocess.Popen([sys.executable, "-c", _SHARDED, str(rank), "2", str(rendezvous)],
                              env=_env(), cwd=standalone, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [proc.communicate(timeout=240) for proc in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0 and "ok" in out, err[-3000:]
    assert "held" in outs[1][0] and "held" not in outs[0][0], outs  # the fenced rank holds
    assert all("fell back" in out for out, _ in outs), outs
    # The damaged file is named on both ranks (rank 0 learns of it from rank 1).
    assert all("'__1_0.distcp' does not match its checksum" in err for _, err in outs), outs
    assert "(read by rank 1); trying the checkpoint before it" in outs[0][1], outs[0][1]
    assert "rank 1's disk failed" in outs[0][1]  # rank 0 learns of rank 1's failure

    cs = CheckpointStore(LocalStore(standalone / spot.LOCAL_DIR), "checkpoints")
    latest = cs.latest()
    assert latest is not None and latest.step == 1 and latest.metadata["ranks"] == 2
    files = {f.name for f in latest.files}
    assert {METADATA_FILE, "__0_0.distcp", "__1_0.distcp"} <= files
    # The failed saves: no .metadata, no manifest (the fenced one's data is all there;
    # the one whose plan failed wrote nothing at all).
    by_step = {int(cid[:12]): cid for cid in cs.ids()}
    assert sorted(by_step) == [0, 1, 2, 4]
    assert "cannot checkpoint 'extra'" in outs[0][1]
    store = cs.store
    for step in (2, 4):
        assert not store.exists(f"checkpoints/{by_step[step]}/{MANIFEST}")
        assert not store.exists(f"checkpoints/{by_step[step]}/{METADATA_FILE}")
    assert store.exists(f"checkpoints/{by_step[4]}/__1_0.distcp")

    # 2 -> 1: a plain model in one process; DCP reshards the two ranks' shards.
    expected = torch.load(standalone / "expected.pt")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    ckpt = spot.Checkpoint(model=model, optimizer=opt, sched=sched, extra={})
    fetched: list[str] = []
    download = LocalStore.download_file

    def counted(store: LocalStore, key: str, path: str | os.PathLike[str]) -> None:
        fetched.append(key.rsplit("/", 1)[-1])
        download(store, key, path)

    monkeypatch.setattr(LocalStore, "download_file", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: assuming one process"
        assert ckpt.restore() == 2
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected["model"][name]), name
    for name, param in model.named_parameters():
        assert torch.equal(opt.state[param]["exp_avg"], expected["exp_avg"][name]), name
    assert sched.last_epoch == 2 and ckpt["extra"] == {"epoch": 3}
    # Resharded, the one process's plan names both ranks' files: those are fetched.
    assert sorted(fetched) == [METADATA_FILE, "__0_0.distcp", "__1_0.distcp"]


def test_a_node_prefetches_its_ranks_share_of_a_sharded_checkpoint() -> None:
    """The agent's prefetch (multi-node): the metadata and its ranks' files when the
    world has the size that saved it; only the metadata at another size; a checkpoint
    one rank wrote, whole."""
    def manifest(ranks: int | None) -> Manifest:
        names = [METADATA_FILE, "__0_0.distcp", "__0_1.distcp", "__1_0.distcp",
                 "__2_0.distcp", "__12_0.distcp", "metrics.json"]
        return Manifest("000000000003-a0001-00", 3, 1, 0.0,
                        tuple(FileEntry(n, 1, "crc32c:00000000") for n in names),
                        format="dcp", metadata={"ranks": ranks} if ranks else {})

    assert node_share(manifest(13), [0], 13) == [METADATA_FILE, "__0_0.distcp",
                                                  "__0_1.distcp"]
    assert node_share(manifest(13), [1, 2], 13) == [METADATA_FILE, "__1_0.distcp",
                                                     "__2_0.distcp"]
    assert node_share(manifest(13), [0, 1], 12) == [METADATA_FILE]  # resharded: plans tell
    assert node_share(manifest(None), [1], 2) is None  # DDP's rank 0 wrote it: whole


def test_sharded_state_in_a_world_of_one_saves_and_restores(standalone: Path) -> None:
    """A job shrunk to one node keeps FSDP's DTensors (a mesh of one rank): saved and
    restored through DCP's state-dict API, not the single-node capture."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    def sharded_model() -> torch.nn.Module:
        model = torch.nn.Linear(6, 3)
        fully_shard(model)
        return model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(5)
        model = sharded_model()
        ckpt = spot.Checkpoint(model=model)
        ckpt.save(7)
        torch.manual_seed(6)
        fresh = sharded_model()
        assert spot.Checkpoint(model=fresh).restore() == 8
        for name, value in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[name].full_tensor(), value.full_tensor())
    finally:
        dist.destroy_process_group()
    latest = CheckpointStore(LocalStore(standalone / spot.LOCAL_DIR), "checkpoints").latest()
    assert latest is not None and latest.metadata["ranks"] == 1
