"""How soon a multi-node job's round trains once its world formed, and a job from its
launch to its first step: this checkout's code against a baseline commit's, side by
side in one run.

Run by hand: ``python benchmarks/bench_node_start.py [--baseline REF] [--rounds N]``
(default: the commit before the nodes' kernels imported torch ahead, 2 rounds; about
a minute per job on a busy 2-core machine).

Each round runs one job per variant, one after the other in alternating order (the
baseline's tracked files exported with ``git archive`` into a temporary directory and
imported through ``PYTHONPATH``, which the local cloud's instances inherit; each job in
a fresh ``SPOTNB_HOME``): two nodes (``--nodes 1:2``) of a small DDP cell (30 steps,
a checkpoint every 5th), held at step 10 until one node, not rank 0's, saw its
interruption notice. The world re-forms at one node from the coordinated save, then at
two once the replacement joins. From the job's events:

* **start**: the group's first launch -> the job's first metric row;
* **world -> step**: a round formed (its last node's ``world`` event) -> the first
  metric row after it, the median over the job's rounds (two to four, as the
  replacement joins before the last step or not): what a node's kernels still do once
  the rendezvous is done (start, import torch, bootstrap, the cell's set-up up to its
  first step); **first world**: the same for the job's first round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The commit before a distributed job's kernels started beside the agent's own imports
# and imported torch ahead (spotnb.kernel_remote.kernels.import_ahead).
DEFAULT_BASELINE = "834073f"
STEPS, PAUSE_AT = 30, 10

CELL = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
X = torch.randn(512, 16, generator=torch.Generator().manual_seed(1))
y = X @ torch.randn(16, 1, generator=torch.Generator().manual_seed(2))
model = torch.nn.Linear(16, 1)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ckpt = spot.Checkpoint(model=model, optimizer=opt)
for step in range(ckpt.restore(), STEPS):
    idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(step))[:48]
    mine = idx.chunk(world)[rank]
    loss = ((ddp(X[mine]) - y[mine]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    spot.log(step, loss=loss.item())
    while step == PAUSE_AT and not os.path.exists(GO):
        time.sleep(0.05)
    time.sleep(0.05)
    ckpt.maybe_save(step)
dist.destroy_process_group()
"""


def _one_job() -> dict[str, float]:
    """One job of the variant this process imports (its PYTHONPATH): the figures."""
    import spotnb
    from spotnb.protocol.events import GROUP_STREAM, EventReader, metric_rows
    from spotnb.protocol.store import LocalStore

    go = Path(tempfile.mkdtemp()) / "go"
    job = spotnb.submit(CELL, nodes="1:2", instance_types="g4dn.xlarge",
                        checkpoint_every="5 steps",
                        inputs={"STEPS": STEPS, "PAUSE_AT": PAUSE_AT, "GO": str(go)})
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))
    # Followed live (an unwatched job writes its log about once a minute) to the gate.
    live = job.events(timeout=600)
    for event in live:
        if any(step >= PAUSE_AT for step, _, _ in metric_rows(event)):
            break
    live.close()
    worlds = [e for e in EventReader(store).replay() if e.type == "world"]
    rank0 = next(e.instance for e in worlds if 0 in e.data.get("ranks", []))
    victim = next(e.instance for e in worlds if e.instance != rank0)
    job.provider.interrupt(job.job_id, instance=victim)  # type: ignore[call-arg]
    while not any(e.type == "notice" and e.instance == victim
                  for e in EventReader(store).replay()):
        time.sleep(0.1)
    go.write_text("go")
    result = job.wait(timeout=900)
    if result.status != "completed":
        raise SystemExit(f"{result.status}: {result.reason}")
    events = EventReader(store, batches=True).poll()
    rows = sorted(t for e in events for _, t, values in metric_rows(e) if "loss" in values)
    launched = min(e.time for e in events if e.attempt == GROUP_STREAM
                   and e.type == "instance" and e.data.get("action") == "launched")
    formed: dict[tuple[Any, Any], float] = {}
    for e in events:
        if e.type == "world":
            key = (e.data.get("generation"), e.data.get("round"))
            formed[key] = max(formed.get(key, 0.0), e.time)
    gaps = [next(t for t in rows if t > at) - at for at in formed.values()
            if any(t > at for t in rows)]
    return {"start": rows[0] - launched, "world_to_step": statistics.median(gaps),
            "first_world": gaps[0], "rounds": float(len(gaps))}


def _variant_job(root: Path) -> dict[str, float]:
    """:func:`_one_job` in a process that imports spotnb from ``root``."""
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "PYTHONPATH": str(root), "SPOTNB_HOME": home,
               "SPOTNB_LOCAL_HAZARD": "0", "SPOTNB_LOCAL_NOTICE_SECONDS": "10",
               "OMP_NUM_THREADS": "1", "SPOTNB_LOCAL_INSTANCE_ENV": "OMP_NUM_THREADS"}
        done = subprocess.run([sys.executable, __file__, "--one"], env=env, cwd=home,
                              capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the job of {root} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE, help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(_one_job()))
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        archive = subprocess.run(["git", "archive", args.baseline], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
        variants = {"baseline": base, "now": REPO}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for i in range(args.rounds):
            order = list(variants) if i % 2 == 0 else list(reversed(variants))
            for name in order:
                figures = _variant_job(variants[name])
                runs[name].append(figures)
                print(f"round {i + 1} {name:8}: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    print(f"\n{os.getloadavg()[0]:.1f} load average at the end; medians of "
          f"{args.rounds} jobs each (seconds)")
    print(f"{'measure':16} {'baseline':>9} {'now':>9} {'now/baseline':>13}")
    for key in ("start", "first_world", "world_to_step"):
        before = statistics.median(r[key] for r in runs["baseline"])
        now = statistics.median(r[key] for r in runs["now"])
        print(f"{key:16} {before:9.1f} {now:9.1f} {now / before:13.2f}")


if __name__ == "__main__":
    main()
