"""Cost of ``spot.log`` on the training thread, against TensorBoard and a bare deque.

Run by hand: ``python benchmarks/bench_log.py [calls]``. Every method is measured in
the same run, in the same way: each call is timed on its own with
``time.perf_counter_ns`` and the cost of an empty timing (measured here too) is
subtracted; the medians and means are per call. ``spot.log`` runs against a fake
agent on a real Unix socket, so its background thread really converts and sends
the rows while the loop runs (as in a job).
"""

from __future__ import annotations

import collections
import contextlib
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

CALLS = int(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1].isdigit() else 200_000


class SinkAgent:
    """Accepts the runtime's connection and counts the metric rows it receives."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="snb-")
        self.path = os.path.join(self.dir, "agent.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.bytes = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            while data := conn.recv(1 << 20):
                self.bytes += len(data)

    def close(self) -> None:
        self.thread.join(timeout=10)
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def measure(call: Callable[[int], object], calls: int, overhead: float) -> tuple[float, ...]:
    """ns per call: median, mean and p99 with each call timed alone (timer overhead
    removed), then the amortised cost: one untimed loop of ``calls`` calls / calls."""
    clock = time.perf_counter_ns
    samples = [0] * calls
    for i in range(calls):
        t0 = clock()
        call(i)
        samples[i] = clock() - t0
    t0 = clock()
    for i in range(calls):
        call(i)
    loop = (clock() - t0) / calls
    samples.sort()
    return (statistics.median(samples) - overhead, statistics.fmean(samples) - overhead,
            samples[int(len(samples) * 0.99)] - overhead, loop)


def timer_overhead(calls: int) -> float:
    clock = time.perf_counter_ns
    samples = [0] * calls
    for i in range(calls):
        t0 = clock()
        samples[i] = clock() - t0
    return statistics.median(samples)


@contextlib.contextmanager
def session() -> Iterator[None]:
    """``spot.log`` connected to a fake agent on a real Unix socket, as in a job."""
    work = tempfile.mkdtemp(prefix="snb-log-")
    agent = SinkAgent()
    os.environ.update({
        "SPOTNB_JOB_URI": os.path.join(work, "store"),
        "SPOTNB_JOB_ID": "bench",
        "SPOTNB_ATTEMPT": "1",
        "SPOTNB_INSTANCE_ID": "i-bench",
        "SPOTNB_AGENT_SOCKET": agent.path,
        "SPOTNB_SCRATCH": os.path.join(work, "scratch"),
    })
    # A training process has torch imported: its objects are what the GC walks.
    import torch  # noqa: F401

    from spotnb.train import runtime as spot

    spot.log(-1, warmup=0.0)  # connect first: the connection is not the hot path
    try:
        yield
    finally:
        spot._finish()
        agent.close()
        shutil.rmtree(work, ignore_errors=True)


class BareDeque:
    """The baseline: a row appended to a deque that a thread drains every 0.2 s, like
    ``spot.log``'s background thread minus the conversion and the sending."""

    def __init__(self) -> None:
        self.rows: collections.deque[object] = collections.deque()
        self._stop = threading.Event()
        self._drainer = threading.Thread(target=self._drain, daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        while not self._stop.wait(0.2):
            for _ in range(len(self.rows)):
                self.rows.popleft()

    def __call__(self, i: int) -> None:
        self.rows.append((i, time.time(), {"loss": 0.25}))

    def close(self) -> None:
        self._stop.set()
        self._drainer.join()


def rounds(calls: int, count: int) -> list[tuple[float, float]]:
    """``count`` rounds of ``calls`` calls each, the bare deque then ``spot.log(step,
    loss=float)`` in every round: ``[(deque median, spot.log median)]`` in ns. Rounds
    that alternate the two see the same load; a single long run of each does not."""
    from spotnb.train import runtime as spot

    bare = BareDeque()
    try:
        overhead = timer_overhead(calls)
        out = []
        for _ in range(count):
            deque = measure(bare, calls, overhead)[0]
            log = measure(lambda i: spot.log(i, loss=0.25), calls, overhead)[0]
            out.append((deque, log))
        return out
    finally:
        bare.close()


def run(calls: int, tensorboard: bool = True) -> tuple[dict[str, tuple[float, ...]], float]:
    """Every method measured in this process (``tensorboard``: the ``add_scalar``
    cases too): ``({method: (median, mean, p99, loop)}, timer overhead)``, in ns."""
    import torch

    from spotnb.train import runtime as spot

    with session():
        writer: Any = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=tempfile.mkdtemp(prefix="snb-tb-"))
        loss_t = torch.tensor(0.25)
        bare = BareDeque()
        overhead = timer_overhead(calls)
        results = {
            "deque.append (bare, drained)": measure(bare, calls, overhead),
            "spot.log(step, loss=float)": measure(lambda i: spot.log(i, loss=0.25), calls,
                                                  overhead),
            "spot.log(step, loss=tensor)": measure(lambda i: spot.log(i, loss=loss_t), calls,
                                                   overhead),
        }
        if writer is not None:
            results["SummaryWriter.add_scalar(float)"] = measure(
                lambda i: writer.add_scalar("loss", 0.25, i), calls // 4, overhead)
            results["SummaryWriter.add_scalar(tensor)"] = measure(
                lambda i: writer.add_scalar("loss", loss_t, i), calls // 4, overhead)
        # The means above are dominated by the interpreter's cyclic GC (full passes over
        # the ~500k objects torch creates), common to every method: measure without it.
        gc.disable()
        try:
            results["deque.append (bare, drained), GC off"] = measure(bare, calls, overhead)
            results["spot.log(step, loss=float), GC off"] = measure(
                lambda i: spot.log(i, loss=0.25), calls, overhead)
        finally:
            gc.enable()
        bare.close()
        if writer is not None:
            writer.close()
            shutil.rmtree(writer.log_dir, ignore_errors=True)
    return results, overhead


def main() -> None:
    import torch

    results, overhead = run(CALLS)

    base = results["deque.append (bare, drained)"]
    tb = results["SummaryWriter.add_scalar(float)"]
    print(f"{CALLS} calls per method ({CALLS // 4} for add_scalar); timer overhead "
          f"{overhead:.0f} ns subtracted; {os.cpu_count()} CPUs, torch {torch.__version__}")
    print("ns per call; 'loop' = untimed loop / calls; ratios on medians")
    print(f"{'method':40} {'median':>7} {'mean':>7} {'p99':>7} {'loop':>7} "
          f"{'x deque':>8} {'add_scalar/it':>14}")
    for name, (median, mean, p99, loop) in results.items():
        print(f"{name:40} {median:7.0f} {mean:7.0f} {p99:7.0f} {loop:7.0f} "
              f"{median / base[0]:8.1f} {tb[0] / median:14.1f}")
    log = results["spot.log(step, loss=float)"]
    print(f"\nspot.log median {log[0]:.0f} ns (target < 1000 ns): "
          f"{'OK' if log[0] < 1000 else 'MISSED'}; add_scalar / spot.log: "
          f"{tb[0] / log[0]:.1f}x on medians, {tb[1] / log[1]:.1f}x on means, "
          f"{tb[3] / log[3]:.1f}x on loops (target >= 20x)")


if __name__ == "__main__":
    main()
