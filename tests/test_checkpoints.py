"""The checkpoint protocol on a real local store (DESIGN invariant 2)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spotnb.ckpt.checkpoints import (
    LATEST,
    MANIFEST,
    CheckpointError,
    CheckpointStore,
    CorruptCheckpoint,
    FencedOff,
    HashingWriter,
    Manifest,
    hash_file,
)
from spotnb.ckpt.checksum import DEFAULT_ALGORITHM, Checksum, _crc32c_py
from spotnb.protocol.store import LocalStore


@pytest.fixture
def store(tmp_path: Path) -> LocalStore:
    return LocalStore(tmp_path / "store")


def _files(tmp_path: Path, **contents: bytes) -> dict[str, Path]:
    src = tmp_path / f"src-{time.monotonic_ns()}"
    src.mkdir()
    paths = {}
    for name, data in contents.items():
        path = src / name
        path.write_bytes(data)
        paths[name] = path
    return paths


def _crc(data: bytes) -> str:
    """The checksum a new manifest records, computed apart from spotnb.ckpt.checksum's path
    for it (the pure-Python CRC-32C, or zlib's CRC-32 without the wheel)."""
    if DEFAULT_ALGORITHM == "crc32c":
        return f"crc32c:{_crc32c_py(memoryview(data), 0):08x}"
    import zlib

    return f"crc32:{zlib.crc32(data):08x}"


def test_checksums_known_values_running_and_fallback() -> None:
    data = os.urandom(300_001)
    for algorithm, check in (("crc32c", "e3069283"), ("crc32", "cbf43926")):
        c = Checksum(algorithm)
        c.update(b"1234")
        c.update(memoryview(bytearray(b"56789")))  # writable views, as from a tensor
        assert c.value == f"{algorithm}:{check}"
        whole, pieces = Checksum(algorithm), Checksum(algorithm)
        whole.update(data)
        for start in range(0, len(data), 65_536):
            pieces.update(memoryview(data)[start:start + 65_536])
        assert whole.value == pieces.value
    whole = Checksum("crc32c")
    whole.update(data)
    assert whole.value == f"crc32c:{_crc32c_py(memoryview(data), 0):08x}"
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        Checksum("md5")


def test_round_trip(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store)
    assert cs.latest() is None
    files = _files(tmp_path, weights=os.urandom(100_000), extra=b"hello")
    written = cs.write(7, files, attempt=2, fmt="raw", metadata={"note": "x"})

    latest = cs.latest()
    assert latest == written
    assert latest.step == 7 and latest.attempt == 2 and latest.format == "raw"
    assert latest.id.startswith("000000000007-a0002-")
    assert latest.metadata == {"note": "x"}
    assert {f.name: f.size for f in latest.files} == {"weights": 100_000, "extra": 5}
    assert json.loads(store.get(f"checkpoints/{LATEST}")) == {"id": latest.id, "step": 7}

    paths = cs.download(latest, tmp_path / "out")
    for name, path in paths.items():
        assert path.read_bytes() == files[name].read_bytes()
    assert Manifest.read_local(tmp_path / "out") == latest
    assert cs.verify_local(latest, tmp_path / "out") == paths


def test_a_checkpoint_is_downloaded_several_files_at_once(store: LocalStore,
                                                          tmp_path: Path) -> None:
    cs = CheckpointStore(store)
    contents = {f"part{i}": os.urandom(10_000) for i in range(4)}
    written = cs.write(3, _files(tmp_path, **contents))
    both = threading.Barrier(2)
    real = store.download_file

    def download_file(key: str, dest: Any) -> Any:
        if not key.endswith(MANIFEST):
            both.wait(60)  # raises BrokenBarrierError unless another file is on its way
        return real(key, dest)

    store.download_file = download_file  # type: ignore[method-assign]
    paths = cs.download(written, tmp_path / "out")
    assert {name: path.read_bytes() for name, path in paths.items()} == contents
    # The first damaged file in the manifest's order is the one named.
    for name in ("part1", "part3"):
        (tmp_path / "out" / name).write_bytes(b"x")
    with pytest.raises(CorruptCheckpoint, match="part1"):
        cs.verify_local(written, tmp_path / "out")


def test_a_refresh_reads_only_what_changed_and_a_failed_one_leaves_no_verified_mark(
        store: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy ``download`` made whole is not checksummed again (its MANIFEST.json says it
    was verified), nor are the files a newer manifest lists the same; a refresh that
    fails half-way leaves no MANIFEST.json, so the copy is checksummed in full again."""
    import spotnb.ckpt.verify as verify

    cs = CheckpointStore(store)
    same, old, new = os.urandom(50_000), os.urandom(20_000), os.urandom(20_000)
    first = cs.write(1, _files(tmp_path, same=same, changed=old))
    out = tmp_path / "out"
    cs.download(first, out)
    hashed: list[str] = []
    real = verify.hash_file

    def hash_file(path: Any, *args: Any) -> Any:
        hashed.append(Path(path).name)
        return real(path, *args)

    monkeypatch.setattr(verify, "hash_file", hash_file)
    assert set(cs.verify_local(first, out, downloaded=True)) == {"same", "changed"}
    assert hashed == [], "a verified download is not read again"
    second = cs.write(2, _files(tmp_path, same=same, changed=new))
    cs.download(second, out)
    assert "same" not in hashed and any("changed" in n for n in hashed), hashed
    assert (out / "changed").read_bytes() == new
    # A refresh whose new file is damaged in the store fails: no mark is left, so the
    # copy is verified in full, and a file damaged in place (same size) is found.
    third = cs.write(3, _files(tmp_path, same=same, changed=os.urandom(20_000)))
    (store.root / "checkpoints" / third.id / "changed").write_bytes(os.urandom(20_000))
    with pytest.raises(CorruptCheckpoint, match="changed"):
        cs.download(third, out)
    assert not (out / MANIFEST).exists()
    (out / "same").write_bytes(os.urandom(50_000))
    with pytest.raises(CorruptCheckpoint, match="same"):
        cs.verify_local(second, out, downloaded=True)


def test_nested_names_and_prefix(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, prefix="sync/runs-1234")
    src = tmp_path / "a.bin"
    src.write_bytes(b"abc")
    m = cs.write(0, {"files/sub/dir/a.bin": src}, fmt="dir")
    assert store.exists(f"sync/runs-1234/{m.id}/files/sub/dir/a.bin")
    paths = cs.download(cs.latest() or m, tmp_path / "d")
    assert paths["files/sub/dir/a.bin"].read_bytes() == b"abc"
    with pytest.raises(ValueError, match="invalid checkpoint file name"):
        cs.write(1, {"../escape": src})
    with pytest.raises(ValueError, match="reserved"):
        cs.write(1, {MANIFEST: src})


def test_hashing_writer_matches_file_and_torch_save(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "state.pt"
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        torch.save({"w": torch.arange(100_000, dtype=torch.float32), "k": [1, 2]}, writer)
    assert (writer.size, writer.checksum) == hash_file(path)
    back = torch.load(path, weights_only=False)
    assert torch.equal(back["w"], torch.arange(100_000, dtype=torch.float32))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_download_catches_corruption(store: LocalStore, tmp_path: Path, damage: str) -> None:
    cs = CheckpointStore(store)
    m = cs.write(1, _files(tmp_path, good=b"g" * 1000, bad=os.urandom(4096)))
    stored = store.root / "checkpoints" / m.id / "bad"
    if damage == "flip":
        data = bytearray(stored.read_bytes())
        data[100] ^= 0xFF
        stored.write_bytes(bytes(data))
        match = "'bad' does not match its checksum in the manifest \\(crc32c?:"
    elif damage == "truncate":
        stored.write_bytes(stored.read_bytes()[:-1])
        match = "'bad' has 4095 bytes, the manifest says 4096"
    else:
        stored.unlink()
        match = "'bad' is missing"
    with pytest.raises(CorruptCheckpoint, match=match):
        cs.download(m, tmp_path / "out")
    # The damaged download does not stay around to be loaded by mistake, not even
    # under its temporary name.
    left = [p.name for p in (tmp_path / "out").iterdir()]
    assert "bad" not in left and not any(name.startswith(".") for name in left), left


def test_fetch_gets_a_file_once_replaces_a_stale_copy_and_races_safely(
        store: LocalStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One file of a checkpoint (a rank's share of a sharded one): a verified copy is
    not downloaded again, a stale one is replaced, and two processes sharing the
    directory may fetch the same file at once."""
    cs = CheckpointStore(store)
    m = cs.write(1, _files(tmp_path, a=b"a" * 1000, b=os.urandom(4096)))
    got: list[str] = []
    download = store.download_file
    both = threading.Barrier(1)

    def counted(key: str, path: str | os.PathLike[str]) -> None:
        got.append(key.rsplit("/", 1)[-1])
        download(key, path)
        both.wait(timeout=60)  # the racing fetches have both downloaded before renaming

    monkeypatch.setattr(store, "download_file", counted)
    out = tmp_path / "out"
    assert cs.fetch(m, "a", out).read_bytes() == b"a" * 1000
    assert cs.fetch(m, "a", out) == out / "a" and got == ["a"]  # verified: no request
    (out / "b").write_bytes(b"stale")  # another checkpoint's file of that name
    assert cs.fetch(m, "b", out).read_bytes() == (store.root / "checkpoints" / m.id /
                                                   "b").read_bytes()
    assert got == ["a", "b"]
    with pytest.raises(CorruptCheckpoint, match="does not list 'c'"):
        cs.fetch(m, "c", out)

    both = threading.Barrier(2)
    shared = tmp_path / "shared"
    threads = [threading.Thread(target=cs.fetch, args=(m, "b", shared)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Both downloaded, both renamed into place: one whole copy, no temporary left.
    assert got == ["a", "b", "b", "b"] and [p.name for p in shared.iterdir()] == ["b"]
    assert cs.fetch(m, "b", shared) and got == ["a", "b", "b", "b"]  # and it verifies

    both = threading.Barrier(1)
    assert set(cs.download(m, tmp_path / "part", names=["b"])) == {"b"}
    assert sorted(p.name for p in (tmp_path / "part").iterdir()) == [MANIFEST, "b"]


def test_a_file_entry_without_a_checksum_of_ours_is_damage(
        store: LocalStore, tmp_path: Path) -> None:
    # A file the manifest gives no CRC for cannot be verified: the checkpoint is not
    # trusted and the reader falls back to the one before.
    cs = CheckpointStore(store)
    older = cs.write(2, _files(tmp_path, state=b"old"))
    data = os.urandom(5000)
    m = cs.write(3, _files(tmp_path, state=data))
    key = f"checkpoints/{m.id}/{MANIFEST}"
    raw = json.loads(store.get(key))
    raw["files"] = [{"name": "state", "size": 5000, "sha256": hashlib.sha256(data).hexdigest()}]
    store.put(key, json.dumps(raw).encode())
    latest = cs.latest()
    assert latest is not None and latest.id == older.id


def test_keep_k_prunes_old_and_dead_attempt_leftovers(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, keep=2)
    # A dead attempt 1 left a partial checkpoint at a high step (no manifest).
    (store.root / "checkpoints" / "000000000099-a0001-deadbeef").mkdir(parents=True)
    (store.root / "checkpoints" / "000000000099-a0001-deadbeef" / "state").write_bytes(b"x")
    ids = [cs.write(step, _files(tmp_path, s=bytes([step])), attempt=2).id
           for step in range(5)]
    assert cs.ids() == ids[-2:]
    assert cs.latest() is not None and cs.latest().id == ids[-1]  # type: ignore[union-attr]
    # The survivor below LATEST is complete and readable.
    assert cs.download(cs.manifest(ids[-2]), tmp_path / "prev")["s"].read_bytes() == b"\x03"


def test_keep_one(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, keep=1)
    for step in range(3):
        last = cs.write(step, _files(tmp_path, s=b"x"))
    assert cs.ids() == [last.id]
    with pytest.raises(ValueError, match="keep must be at least 1"):
        CheckpointStore(store, keep=0)


def test_fenced_writer_does_not_move_latest(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store)
    first = cs.write(1, _files(tmp_path, s=b"one"))
    with pytest.raises(FencedOff, match="lost the job's lease"):
        cs.write(2, _files(tmp_path, s=b"two"), fence=lambda: False)
    assert cs.latest() == first
    assert json.loads(store.get("checkpoints/LATEST"))["id"] == first.id


def test_latest_moved_by_another_writer_is_fenced(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store)
    cs.write(1, _files(tmp_path, s=b"one"))
    other = CheckpointStore(store)
    theirs = []

    def fence() -> bool:
        # Another agent moves LATEST while this writer is between its reads and its CAS.
        theirs.append(other.write(5, _files(tmp_path, s=b"theirs"), attempt=3))
        return True

    with pytest.raises(FencedOff, match="changed by another writer"):
        cs.write(2, _files(tmp_path, s=b"two"), attempt=2, fence=fence)
    assert cs.latest() == theirs[0]


_KILLED_WRITER = textwrap.dedent(
    """
    import os, sys
    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.protocol.store import LocalStore

    root, work = sys.argv[1], sys.argv[2]
    cs = CheckpointStore(LocalStore(root))
    small = os.path.join(work, "small")
    with open(small, "wb") as f:
        f.write(b"complete checkpoint")
    cs.write(1, {"state": small})
    # A large checkpoint: 64 parts of 4 MB, each uploaded (and fsynced) in turn.
    parts = {}
    for i in range(64):
        parts[f"part{i:02d}"] = path = os.path.join(work, f"part{i:02d}")
        with open(path, "wb") as f:
            f.write(os.urandom(4 * 1024 * 1024))
    print("writing", flush=True)
    cs.write(2, parts)
    print("finished", flush=True)
    """
)


def test_sigkill_mid_write_leaves_previous_checkpoint(store: LocalStore, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(store.root), str(work)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "writing"
        cs = CheckpointStore(store)
        deadline = time.monotonic() + 30
        # Kill once the large checkpoint has some parts in the store, but not all.
        while time.monotonic() < deadline:
            partial = [i for i in cs.ids() if i.startswith("000000000002-")]
            if partial and len(store.list_keys(f"checkpoints/{partial[0]}/")) >= 2:
                break
            time.sleep(0.002)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    (partial_id,) = [i for i in cs.ids() if i.startswith("000000000002-")]
    uploaded = store.list_keys(f"checkpoints/{partial_id}/")
    assert 2 <= len(uploaded) < 64, "the kill was meant to land mid-write"
    assert f"checkpoints/{partial_id}/{MANIFEST}" not in uploaded

    latest = cs.latest()
    assert latest is not None and latest.step == 1
    assert cs.download(latest, tmp_path / "out")["state"].read_bytes() == b"complete checkpoint"

    # The next attempt writes on; the dead partial checkpoint is pruned.
    src = tmp_path / "next"
    src.write_bytes(b"next")
    cs.write(3, {"state": src}, attempt=1)
    assert partial_id not in cs.ids()


@pytest.mark.parametrize("damaged", ["LATEST", "newest manifest", "both"])
def test_a_damaged_latest_or_manifest_falls_back_to_an_intact_checkpoint(
        store: LocalStore, tmp_path: Path, damaged: str) -> None:
    cs = CheckpointStore(store, keep=3)
    written = [cs.write(step, _files(tmp_path, state=f"step {step}".encode()))
               for step in (10, 20, 30)]
    pointer = store.root / "checkpoints" / LATEST
    newest = store.root / "checkpoints" / written[-1].id / MANIFEST
    if damaged in ("LATEST", "both"):
        pointer.write_bytes(pointer.read_bytes()[:7])  # truncated, as by a full disk
    if damaged in ("newest manifest", "both"):
        newest.write_bytes(newest.read_bytes()[:40])
    expect = [30, 20, 10] if damaged == "LATEST" else [20, 10]
    assert [m.step for m in cs.manifests()] == expect
    latest = cs.latest()
    assert latest is not None and latest.step == expect[0]
    # The next write repairs LATEST.
    cs.write(40, _files(tmp_path, state=b"step 40"))
    assert cs.latest() is not None and cs.latest().step == 40  # type: ignore[union-attr]


@pytest.mark.parametrize("damage", ["truncated", "deleted", "id .."])
def test_restore_falls_back_past_a_damaged_latest(tmp_path: Path, damage: str) -> None:
    # The runtime's restore() (standalone: checkpoints under ./.spotnb-local) survives a
    # truncated, deleted or lying LATEST and restores the newest intact checkpoint, not
    # a JSONDecodeError and not step 0.
    script = textwrap.dedent("""
        import sys
        from spotnb.train import runtime as spot
        state = {"n": 0}
        ckpt = spot.Checkpoint(state=state)
        if sys.argv[1] == "save":
            for step in range(3):
                state["n"] = step
                ckpt.save(step)
            ckpt.wait()
        else:
            print(ckpt.restore(), state["n"])
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPOTNB_")}
    run = [sys.executable, "-c", script]
    subprocess.run([*run, "save"], cwd=tmp_path, env=env, check=True, timeout=120)
    latest = tmp_path / ".spotnb-local" / "checkpoints" / LATEST
    if damage == "truncated":
        latest.write_bytes(latest.read_bytes()[:5])
    elif damage == "deleted":
        latest.unlink()
    else:
        latest.write_text(json.dumps({"id": "..", "step": 2}))
    out = subprocess.run([*run, "restore"], cwd=tmp_path, env=env, check=True,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["3", "2"]
    assert ("missing" if damage == "deleted" else "damaged") in out.stderr
    assert "Traceback" not in out.stderr


def test_a_pending_checkpoint_lists_the_files_streamed_into_it(
        store: LocalStore, tmp_path: Path) -> None:
    import threading

    cs = CheckpointStore(store)
    pending = cs.begin(4, attempt=2)
    blobs = {f"part{i}": os.urandom(300_000 + i) for i in range(3)}

    def stream(name: str) -> None:
        with pending.open(name) as f:
            for start in range(0, len(blobs[name]), 65_536):
                f.write(blobs[name][start:start + 65_536])

    threads = [threading.Thread(target=stream, args=(name,)) for name in blobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pending.put_bytes("meta/small", b"tiny")
    with pytest.raises(RuntimeError), pending.open("dropped") as f:
        f.write(b"half of it")
        raise RuntimeError("the writer died")
    assert cs.latest() is None  # nothing is current before the manifest and LATEST
    manifest = cs.commit(pending.finish("raw", {"note": 1}))
    assert {e.name: (e.size, e.checksum) for e in manifest.files} == {
        **{n: (len(b), _crc(b)) for n, b in blobs.items()}, "meta/small": (4, _crc(b"tiny"))}
    assert not store.exists(f"checkpoints/{manifest.id}/dropped")
    paths = cs.download(cs.latest() or manifest, tmp_path / "out")  # verifies every hash
    assert paths["part1"].read_bytes() == blobs["part1"]


def _manifest_edit(path: str, value: object) -> Callable[[dict[str, Any]], Any]:
    def edit(raw: dict[str, Any]) -> Any:
        node: Any = raw
        *parents, key = path.split(".")
        for parent in parents:
            node = node[int(parent)] if isinstance(node, list) else node[parent]
        node[key] = value
        return raw
    return edit


# Manifests of every shape found damaged (by attack, by a full disk, by hand): each one
# is skipped for the intact checkpoint before it, never an AttributeError, ValueError or
# RecursionError out of a restore.
DAMAGED_MANIFESTS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "a list": lambda raw: [1, 2],
    "null": lambda raw: None,
    "files: [1]": _manifest_edit("files", [1]),
    "files: {}": _manifest_edit("files", {}),
    "metadata: [1]": _manifest_edit("metadata", [1]),
    "metadata.ranks: 'x'": _manifest_edit("metadata", {"ranks": "x"}),
    "id ..": _manifest_edit("id", ".."),
    "id empty": _manifest_edit("id", ""),
    "id of another checkpoint": _manifest_edit("id", "000000000010-a0000-00000000"),
    "file name ../../x": _manifest_edit("files.0.name", "../../x"),
    "file name /etc/passwd": _manifest_edit("files.0.name", "/etc/passwd"),
    "file name MANIFEST.json": _manifest_edit("files.0.name", MANIFEST),
    "file size -1": _manifest_edit("files.0.size", -1),
    "file size '5'": _manifest_edit("files.0.size", "5"),
    "file checksum md5": _manifest_edit("files.0.checksum", "md5:00"),
    "file listed twice": lambda raw: {**raw, "files": raw["files"] * 2},
    "unknown format": _manifest_edit("format", "safetensors-v9"),
    "format 7": _manifest_edit("format", 7),
    "step 'x'": _manifest_edit("step", "x"),
    "step true": _manifest_edit("step", True),
    "created NaN": _manifest_edit("created", float("nan")),
    "schema '2'": _manifest_edit("schema", "2"),
}


@pytest.mark.parametrize("shape", sorted(DAMAGED_MANIFESTS))
def test_a_manifest_of_any_damaged_shape_falls_back(store: LocalStore, tmp_path: Path,
                                                    shape: str) -> None:
    # The reader of spot.Checkpoint's store: it reads these formats, no other.
    cs = CheckpointStore(store, keep=3, formats={"files"})
    first, second = (cs.write(step, _files(tmp_path, state=f"step {step}".encode()))
                     for step in (10, 20))
    path = store.root / "checkpoints" / second.id / MANIFEST
    path.write_text(json.dumps(DAMAGED_MANIFESTS[shape](json.loads(path.read_text()))))
    assert [m.id for m in cs.manifests()] == [first.id]
    with pytest.raises(CheckpointError, match="manifest is damaged"):
        cs.manifest(second.id)
    restored = cs.download(first, tmp_path / "restore")
    assert restored["state"].read_bytes() == b"step 10"


def test_a_deeply_nested_manifest_falls_back(store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, keep=3)
    first, second = (cs.write(step, _files(tmp_path, state=b"x")) for step in (10, 20))
    (store.root / "checkpoints" / second.id / MANIFEST).write_text("[" * 200_000)
    assert [m.id for m in cs.manifests()] == [first.id]


@pytest.mark.parametrize("pointer", [
    '{"id": "..", "step": 20}', '{"id": "", "step": 20}', "[1, 2]", '"LATEST"',
    '{"id": "../../x", "step": 1}', '{"id": 5, "step": 1}', "[" * 200_000,
    '{"step": 20}',
], ids=lambda text: text[:24])
def test_a_latest_of_any_damaged_shape_falls_back(store: LocalStore, tmp_path: Path,
                                                  pointer: str) -> None:
    cs = CheckpointStore(store, keep=3)
    written = [cs.write(step, _files(tmp_path, state=b"x")) for step in (10, 20, 30)]
    (store.root / "checkpoints" / LATEST).write_text(pointer)
    assert [m.id for m in cs.manifests()] == [m.id for m in reversed(written)]


def test_without_latest_the_newest_intact_checkpoint_is_found_by_listing(
        store: LocalStore, tmp_path: Path) -> None:
    cs = CheckpointStore(store, keep=3)
    written = [cs.write(step, _files(tmp_path, state=b"x")) for step in (10, 20, 30)]
    (store.root / "checkpoints" / LATEST).unlink()
    latest = cs.latest()
    assert latest is not None and latest.id == written[-1].id
    assert [m.step for m in cs.manifests()] == [30, 20, 10]
