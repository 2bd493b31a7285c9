"""Checkpoint upload throughput to S3: spotnb's store versus a plain boto3 ``upload_file``.

Run by hand: ``python benchmarks/bench_s3_upload.py [MB] [ROUNDS]`` (default 256 MB,
5 rounds). moto runs in server mode in its own process on loopback (so its request
handling does not share this process's interpreter lock), and the uploads send the
same bytes to it, in turn, ROUNDS times each:

* ``plain``: ``boto3.client("s3").upload_file(path, bucket, key)`` with boto3's default
  ``TransferConfig`` (8 MiB parts, 10 threads): the parallel multipart upload that is
  the baseline;
* ``spotnb file``: ``S3Store.upload_file(key, path)``, as ``sync_dir`` uploads a file
  (16 MiB parts, 10 threads, ``ExpectedBucketOwner`` on every request);
* ``spotnb stream``: ``S3Store.open_writer(key)`` fed the bytes from memory in 8 MiB
  pieces, as a checkpoint file is written (16 MiB parts, 10 in flight, CRC32 per part);
* ``spotnb checkpoint``: a whole checkpoint of a tensor of MB bytes, from the start of
  the write to ``LATEST`` (``StoreWriter`` into a ``PendingCheckpoint``: the file
  hashed with SHA-256 as it streams, ``.metadata``, the manifest, the commit).

Meanwhile a stand-in training loop (float32 matrix products with numpy, which releases
the interpreter lock like torch does) runs on a thread; its steps per second during
each upload are reported against the loop alone, since uploads happen in the
background while training goes on. The result line is the ratio of the median
throughputs (spotnb / plain); the goal is at least 0.9.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np

MB = int(sys.argv[1]) if len(sys.argv) > 1 else 256
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
BUCKET = "spotnb-bench"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_moto() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1",
                             "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            with urllib.request.urlopen(endpoint + "/moto-api/", timeout=1):
                break
        except OSError:
            time.sleep(0.1)
    return proc, endpoint


class Loop:
    """A stand-in training loop on a thread: counts matrix products per second."""

    def __init__(self) -> None:
        self.steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        a = np.random.default_rng(0).standard_normal((384, 384), dtype=np.float32)
        self._a = a

    def _run(self) -> None:
        while not self._stop.is_set():
            self._a @ self._a
            self.steps += 1

    def __enter__(self) -> Loop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def rate_during(self, fn: object) -> tuple[float, float]:
        """(seconds fn took, loop steps per second meanwhile)."""
        start_steps, start = self.steps, time.perf_counter()
        fn()  # type: ignore[operator]
        took = time.perf_counter() - start
        return took, (self.steps - start_steps) / took


def main() -> None:
    proc, endpoint = start_moto()
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_EC2_METADATA_DISABLED="true")
    try:
        import boto3

        from spotnb.providers.aws.store import S3Store

        plain = boto3.client("s3")
        plain.create_bucket(Bucket=BUCKET)
        store = S3Store(BUCKET, "jobs/bench")
        work = tempfile.mkdtemp(prefix="snb-s3-")
        path = os.path.join(work, "checkpoint.bin")
        with open(path, "wb") as f:
            f.write(os.urandom(MB * 2**20))
        store.upload_file("warm-up", path)  # connections, account lookup
        plain.upload_file(path, BUCKET, "warm-up")

        import torch

        from spotnb.ckpt.checkpoints import CheckpointStore
        from spotnb.ckpt.dcp import StoreWriter, save_state, state_key

        with open(path, "rb") as f:
            tensor = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)
        view = memoryview(tensor.numpy())
        checkpoints = CheckpointStore(store, "checkpoints")

        def stream(i: int) -> None:
            with store.open_writer(f"stream/{i}") as writer:
                for start in range(0, len(view), 8 * 2**20):
                    writer.write(view[start:start + 8 * 2**20])

        def checkpoint(i: int) -> None:
            pending = checkpoints.begin(i)
            save_state({"w": tensor, state_key(): {}}, StoreWriter(pending))
            checkpoints.commit(pending.finish("dcp"))

        results: dict[str, list[tuple[float, float]]] = {
            "plain": [], "spotnb file": [], "spotnb stream": [], "spotnb checkpoint": []}
        with Loop() as loop:
            time.sleep(0.5)
            idle = loop.rate_during(lambda: time.sleep(2.0))[1]
            for i in range(ROUNDS):
                results["plain"].append(loop.rate_during(
                    lambda i=i: plain.upload_file(path, BUCKET, f"plain/{i}")))
                results["spotnb file"].append(loop.rate_during(
                    lambda i=i: store.upload_file(f"spotnb/{i}", path)))
                results["spotnb stream"].append(loop.rate_during(lambda i=i: stream(i)))
                results["spotnb checkpoint"].append(loop.rate_during(
                    lambda i=i: checkpoint(i)))
        print(f"{MB} MiB to moto (server mode, own process) on loopback, {ROUNDS} rounds; "
              f"training loop alone: {idle:,.0f} steps/s")
        medians = {}
        for name, rows in results.items():
            seconds = statistics.median(t for t, _ in rows)
            medians[name] = MB / seconds
            loop_rate = statistics.median(r for _, r in rows)
            print(f"  {name:<17} {MB / seconds:8.1f} MiB/s  (median of {len(rows)}: "
                  f"{seconds:.2f} s)  training loop meanwhile {loop_rate:,.0f} steps/s "
                  f"({100 * loop_rate / idle:.0f}% of its speed alone)")
        for name in ("spotnb file", "spotnb stream", "spotnb checkpoint"):
            print(f"{name} / plain throughput: {medians[name] / medians['plain']:.2f}x "
                  f"(time: {medians['plain'] / medians[name]:.2f}x; goal: at most 1.2x)")
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
