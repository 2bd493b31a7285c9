"""What following running jobs' live queues (SQS) costs, before and after sub-second waits
stopped being short polls, measured in the same run.

Run by hand: ``python benchmarks/bench_live_queue.py [--seconds S] [--before COMMIT]``.

A sweep's runner (``spotnb.sweep.runner``) and a comparison (``spotnb.client.comparison``)
follow their live jobs in rounds of one second, shared between them: each job's follower
waits ``1 / N`` s of the N live jobs' round. SQS waits in whole seconds, and before this
change a wait under one second was sent as ``WaitTimeSeconds=0`` (``round(0.5) == 0``):
answered at once, so the follower asked again at once. Played here on the simulator's
moto server (real HTTP, real boto3): N job queues (N = 1, 2, 4), each sent one live
message a second (a followed job's agents send about that), followed as the sweep runner
follows them for S seconds. Counted: ReceiveMessage requests (per hour, and their price
at SQS's list price), and how long each message waited in its queue (median and the
longest; the live channel's aim is under 1.5 s).

Each variant runs in its own interpreter: "before" imports spotnb from ``COMMIT``'s tree
(``git archive``; default: the commit this change branched from), "after" from this
checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The commit this change branched from: sub-second waits sent as short polls.
BEFORE = "1f16320"
ROUND_SECONDS = 1.0  # the sweep runner's round (spotnb.sweep.runner.ROUND_SECONDS)


def _child(jobs: int, seconds: float) -> dict[str, Any]:
    from spotnb.protocol import usage
    from spotnb.providers.aws.queue import SqsQueue
    from spotnb.testing import DEFAULT_ACCOUNT, MotoServer, aws_environment

    server = MotoServer().start()
    try:
        with aws_environment(server.endpoint):
            queues = [SqsQueue("us-east-1", DEFAULT_ACCOUNT, f"spotnb-bench-{i}")
                      for i in range(jobs)]
            senders = [SqsQueue("us-east-1", DEFAULT_ACCOUNT, q.name) for q in queues]
            for q in queues:
                q.create()
            stop = threading.Event()

            def send() -> None:  # one live message a second into every job's queue
                while not stop.wait(1.0):
                    for s in senders:
                        s.send(json.dumps(time.time()))

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            usage.reset()
            waited: list[float] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end:  # the sweep runner's rounds
                for q in queues:
                    waited += [time.time() - float(json.loads(body))
                               for body in q.receive(ROUND_SECONDS / jobs)]
            receives = usage.snapshot().get("sqs:ReceiveMessage", 0)
            stop.set()
            sender.join()
    finally:
        server.stop()
    return {"receives": receives, "waited": waited}


def _tree(commit: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="spotnb-before-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "spotnb"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _run(tree: Path, jobs: int, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spotnb-bench-home-") as home:
        env = {**os.environ, "PYTHONPATH": str(tree), "SPOTNB_HOME": home}
        out = subprocess.run([sys.executable, __file__, "--child", "--jobs", str(jobs),
                              "--seconds", str(seconds)],
                             env=env, check=True, capture_output=True, text=True, cwd=home)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.jobs, args.seconds)))
        return
    from spotnb.protocol.usage import PRICES

    trees = {"before": _tree(args.before), "after": REPO}
    print(f"{args.seconds:g} s of following per case; before = {args.before}, "
          f"after = this checkout\n")
    print("| live jobs | variant | ReceiveMessage / h | $ / h | waited median s | "
          "waited max s | requests before / after |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for jobs in (1, 2, 4):
        got = {name: _run(tree, jobs, args.seconds) for name, tree in trees.items()}
        for name, r in got.items():
            per_hour = r["receives"] * 3600 / args.seconds
            waited = r["waited"] or [float("nan")]
            ratio = got["before"]["receives"] / max(1, got["after"]["receives"])
            print(f"| {jobs} | {name} | {per_hour:,.0f} | {per_hour * PRICES['sqs']:.4f} | "
                  f"{statistics.median(waited):.2f} | {max(waited):.2f} | "
                  f"{ratio:.1f}x |")


if __name__ == "__main__":
    main()
