"""Metric latency: from ``spot.log`` on the instance to the event in ``JobHandle.events()``.

Run by hand: ``python benchmarks/bench_metric_latency.py [SECONDS] [--aws]`` (default
20). A job on the local cloud (``--aws``: on the AWS simulator, through S3 and SQS)
logs a metric every 10 ms; the notebook side follows the job and records when each
metric event arrives. Latency = arrival - the time of the ``log`` call (the event's
``t``), for the metrics logged after the first WARMUP_SECONDS (while the follower
registers, it catches up from the log). Aim: p95 under 1.5 s.

The baseline, in the same run: the floor of any file-based pipeline with the same
reader poll interval: a writer process appends one JSON line per metric to a file
and flushes it; a reader polls the file every ``POLL_SECONDS`` like ``events()`` does.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from spotnb.client.jobs import POLL_SECONDS

CELL = """
import time
end = time.time() + DURATION
step = 0
while time.time() < end:
    spot.log(step, x=float(step))
    step += 1
    time.sleep(0.01)
"""

WRITER = """
import json, sys, time
end = time.time() + float(sys.argv[2])
with open(sys.argv[1], "a") as f:
    step = 0
    while time.time() < end:
        f.write(json.dumps({"step": step, "t": time.time()}) + "\\n")
        f.flush()
        step += 1
        time.sleep(0.01)
"""


def percentiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=100)
    return statistics.median(values), q[94], max(values)


WARMUP_SECONDS = 5.0


def spotnb_latencies(duration: float, aws: bool) -> list[float]:
    import spotnb

    extra = {"provider": "aws", "instance_types": ["g4dn.xlarge"]} if aws else {}
    handle = spotnb.submit(CELL, inputs={"DURATION": duration}, **extra)
    out = []
    first: float | None = None
    for event in handle.events(timeout=duration + 120):
        if event.type == "metric":
            t = event.data["t"]
            first = t if first is None else first
            if t - first >= WARMUP_SECONDS:
                out.append(time.time() - t)
    return out


def file_latencies(duration: float) -> list[float]:
    path = Path(tempfile.mkdtemp()) / "metrics.jsonl"
    path.touch()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(duration)])
    out = []
    offset = 0
    while writer.poll() is None or offset < path.stat().st_size:
        with open(path) as f:
            f.seek(offset)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        offset += len(complete.encode())
        now = time.time()
        out += [now - json.loads(line)["t"] for line in complete.splitlines()]
        time.sleep(POLL_SECONDS)
    return out


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    aws = "--aws" in sys.argv
    duration = float(args[0]) if args else 20.0
    os.environ["SPOTNB_HOME"] = tempfile.mkdtemp(prefix="snb-bench-latency-")
    os.environ.setdefault("SPOTNB_LOCAL_HAZARD", "0")
    if aws:
        from spotnb.testing import AwsSimulator

        with AwsSimulator(Path(os.environ["SPOTNB_HOME"]) / "sim"):
            ours = spotnb_latencies(duration, aws=True)
    else:
        ours = spotnb_latencies(duration, aws=False)
    base = file_latencies(duration)
    (m1, p1, x1), (m2, p2, x2) = percentiles(ours), percentiles(base)
    print(f"metrics: spotnb {len(ours)} ({'AWS simulator' if aws else 'local cloud'}), "
          f"file baseline {len(base)}")
    print(f"{'latency (s)':<14} {'spotnb':>8} {'file tail':>10} {'ratio':>7}")
    for label, a, b in (("median", m1, m2), ("p95", p1, p2), ("max", x1, x2)):
        print(f"{label:<14} {a:8.3f} {b:10.3f} {a / b:7.1f}")


if __name__ == "__main__":
    main()
