"""Multi-node training on the local cloud: throughput, reaction to a notice, cost.

Run by hand: ``python benchmarks/bench_multinode.py [STEPS]`` (default 60). Four parts
(``--faults-only``: part 3 alone):

1. **Samples/s**, side by side in the same run: the same seeded DDP code (an MLP on
   generated data, gloo on CPU, one global batch of 256) as ``--nodes 4`` (4 local
   instances x 1 process) and as ``--nodes 1 --procs-per-node 4`` (1 instance x 4
   processes). Both run on this one machine, so the ratio is what spotnb's multi-node
   path costs over one multi-process node (rendezvous over loopback, one agent per
   node), not a network measurement. Timed inside the cell from step 5 (after the
   first collectives) to the end.
2. **Notice to N-1 and to N**: ``--nodes 3:4``; one node (not rank 0's) gets a notice
   once training runs; the cell holds at step 10 until the notice is seen. From the
   group's notice event to the first ``world`` event of 3 nodes (training goes on at
   N-1) and to the next one of 4 (re-formed at N, the replacement joined).
3. **A loss and a join, in steps redone and seconds lost**: ``--nodes 2:3``, a cell that
   sleeps STEP_SLEEP per step and saves every 20 steps; a node (not rank 0's) is killed
   without notice mid-training (``JobHandle.kill(node=K)``) while the pool has no
   capacity: the survivors redo the steps since the last checkpoint. Capacity returns
   once they train again (15 steps past the step reached at the kill), so the
   replacement joins a world that is training: every rank saves first, so the join
   redoes none. Seconds lost: from the last row logged before the fault to the first
   row past it (for the loss: past the step reached at the kill; for the join: from
   the row of the join's save to the first row after it).
4. **Cost per sample**, from the bundled catalog: 4 x g5.2xlarge spot (the cheapest
   pool in us-east-1) against 1 x g5.12xlarge on-demand (4 GPUs), at the same samples
   per second per GPU times the ratio of part 1 (a same-machine stand-in for the
   network's cost; see RESULTS.md for what it does not capture).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

CELL = """
import os, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
X = torch.randn(4096, 64, generator=torch.Generator().manual_seed(1))
y = (X @ torch.randn(64, 1, generator=torch.Generator().manual_seed(2))).squeeze(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ckpt = spot.Checkpoint(model=model, optimizer=opt)
start = ckpt.restore()
GLOBAL_BATCH = 256
t0 = None
for step in range(start, STEPS):
    if step == 5:
        t0 = time.perf_counter()
    idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(step))[:GLOBAL_BATCH]
    mine = idx.chunk(world)[rank]
    loss = ((ddp(X[mine]).squeeze(1) - y[mine]) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    spot.log(step, loss=loss.item())
    while step == PAUSE_AT and GO and not os.path.exists(GO):
        time.sleep(0.05)
    time.sleep(STEP_SLEEP)
    ckpt.maybe_save(step)
samples_per_s = (STEPS - 5) * GLOBAL_BATCH / (time.perf_counter() - t0) if t0 else None
dist.destroy_process_group()
"""


def _throughput(steps: int, nodes: int, procs: int) -> float:
    import spotnb

    job = spotnb.submit(CELL, nodes=nodes, procs_per_node=procs, outputs=["samples_per_s"],
                        inputs={"STEPS": steps, "PAUSE_AT": -1, "GO": "", "STEP_SLEEP": 0.0},
                        instance_types="g4dn.xlarge")
    result = job.wait(timeout=1800)
    if result.status != "completed":
        raise SystemExit(f"{nodes}x{procs}: {result.status}: {result.reason}")
    return float(result.outputs["samples_per_s"])


def _notice_reaction(steps: int) -> tuple[float, float]:
    import spotnb
    from spotnb.protocol.events import EventReader
    from spotnb.protocol.store import LocalStore

    go = Path(tempfile.mkdtemp()) / "go"
    job = spotnb.submit(CELL, nodes="3:4", outputs=["samples_per_s"],
                        inputs={"STEPS": steps, "PAUSE_AT": 10, "GO": str(go),
                                "STEP_SLEEP": 0.0},
                        instance_types="g4dn.xlarge", checkpoint_every="5 steps")
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def events() -> list:
        return EventReader(store).replay()

    # Training runs (a step is logged), so the notice finds every rank at its loop and
    # the coordinated save is the path measured, not a notice period run out at import.
    while not job.metrics().get("loss"):
        time.sleep(0.2)
    worlds = [e for e in events() if e.type == "world"]
    rank0 = next(e.instance for e in worlds if 0 in e.data.get("ranks", []))
    victim = next(e.instance for e in worlds if e.instance != rank0)
    job.provider.interrupt(job.job_id, instance=victim)  # type: ignore[call-arg]
    while not any(e.type == "notice" and e.instance == victim for e in events()):
        time.sleep(0.1)
    go.write_text("go")
    result = job.wait(timeout=1800)
    if result.status != "completed":
        raise SystemExit(f"notice run: {result.status}: {result.reason}")
    history = events()
    notice = next(e.time for e in history if e.type == "instance"
                  and e.data.get("action") == "notice")
    after = [e for e in history if e.type == "world" and e.time > notice]
    shrunk = next((e.time for e in after if e.data.get("nodes") == 3), None)
    back = next((e.time for e in after if e.data.get("nodes") == 4
                 and (shrunk is None or e.time > shrunk)), None)
    return (shrunk - notice if shrunk else float("nan"),
            back - notice if back else float("nan"))


def _loss_and_join(steps: int) -> dict[str, float]:
    """Part 3: steps redone and seconds lost for a node killed, then for its
    replacement joining."""
    import spotnb
    from spotnb.protocol.events import EventReader, metric_rows
    from spotnb.protocol.store import LocalStore

    job = spotnb.submit(CELL, nodes="2:3", outputs=["samples_per_s"],
                        inputs={"STEPS": steps, "PAUSE_AT": -1, "GO": "", "STEP_SLEEP": 0.1},
                        instance_types="g4dn.xlarge", checkpoint_every="20 steps")
    store = LocalStore(job.spec.store_uri.removeprefix("file://"))

    def rows() -> list[tuple[int, float]]:
        return [(step, t) for e in EventReader(store, batches=True).poll()
                for step, t, values in metric_rows(e) if "loss" in values]

    # Followed live (an unwatched job writes its log once a minute): past the first
    # checkpoint (step 19), mid-interval.
    live = job.events(timeout=600)
    for event in live:
        if any(step >= 30 for step, _, _ in metric_rows(event)):
            break
    live.close()
    worlds = [e for e in EventReader(store).replay() if e.type == "world"]
    rank0 = next(e.instance for e in worlds if 0 in e.data.get("ranks", []))
    victim = next(e for e in worlds if e.instance != rank0)
    # No capacity until the survivors train again: the replacement then joins a world
    # that has a checkpoint to save (a join while the survivors' cells still import
    # has nothing to save and redoes nothing either way).
    config = Path(os.environ["SPOTNB_HOME"], "cloud", "config.json")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"no_capacity": ["g4dn.xlarge"]}))
    killed_at = time.time()
    try:
        job.kill(node=(victim.attempt - 1) % 3)
        # Followed live again (rows reach the log within a second only while watched).
        reached_then, training_again = 0, False
        live = job.events(timeout=900)
        for event in live:
            for step, t, _ in metric_rows(event):
                if t <= killed_at:
                    reached_then = max(reached_then, step)
                elif step > reached_then + 15:
                    training_again = True
            if training_again:
                break
        live.close()
        if not training_again:
            raise SystemExit("loss and join run: the survivors did not train again")
    finally:
        config.write_text(json.dumps({"no_capacity": []}))
    result = job.wait(timeout=1800)
    if result.status != "completed":
        raise SystemExit(f"loss and join run: {result.status}: {result.reason}")
    history = EventReader(store).replay()
    logged = sorted(rows(), key=lambda r: r[1])
    before = [r for r in logged if r[1] <= killed_at]
    reached, last_t = max(r[0] for r in before), max(r[1] for r in before)
    after = [r for r in logged if r[1] > killed_at]
    loss_redone = sum(1 for step, _ in after if step <= reached)
    past = next(t for step, t in after if step > reached)
    joined = next((e for e in history if e.type == "joined"), None)
    out = {"loss_redone_steps": float(loss_redone), "loss_seconds_lost": past - last_t}
    if joined is not None:
        saved = int(joined.data["saved_step"])
        saved_t = max(t for step, t in logged if step == saved and t <= joined.time)
        resumed = min(t for step, t in logged if step > saved and t > saved_t)
        out.update(join_redone_steps=float(joined.data["redone"]),
                   join_seconds_lost=resumed - saved_t)
    else:
        out.update(join_redone_steps=float("nan"), join_seconds_lost=float("nan"))
    return out


def _cost_per_sample(ratio: float) -> tuple[float, float]:
    from spotnb.providers import catalog

    spot = min(p.spot for p in catalog.pools("g5.2xlarge", "us-east-1") if p.spot)
    ondemand = catalog.ondemand_price("g5.12xlarge", "us-east-1") or float("nan")
    # USD per GPU-hour of throughput: 4 single-GPU spot nodes run at `ratio` of one
    # 4-GPU node's samples/s.
    return 4 * spot / ratio, ondemand


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--faults-only"]
    steps = int(args[0]) if args else 60
    os.environ.setdefault("SPOTNB_HOME", tempfile.mkdtemp(prefix="spotnb-bench-mn-"))
    os.environ.setdefault("SPOTNB_LOCAL_HAZARD", "0")
    os.environ.setdefault("SPOTNB_LOCAL_NOTICE_SECONDS", "20")
    if "--faults-only" in sys.argv:
        print(json.dumps(_loss_and_join(max(steps, 400))))
        return
    one_node = _throughput(steps, 1, 4)
    four_nodes = _throughput(steps, 4, 1)
    ratio = four_nodes / one_node
    print(f"samples/s  1 node x 4 procs: {one_node:9.1f}   4 nodes x 1 proc: "
          f"{four_nodes:9.1f}   ratio 4x1 / 1x4: {ratio:.2f}")
    to_n1, to_n = _notice_reaction(max(steps, 40))
    print(f"notice -> training at N-1 (3 nodes): {to_n1:6.1f} s   notice -> re-formed at "
          f"N (4 nodes): {to_n:6.1f} s")
    faults = _loss_and_join(max(steps, 400))
    print(f"node killed: {faults['loss_redone_steps']:.0f} steps redone, "
          f"{faults['loss_seconds_lost']:.1f} s lost   node joined: "
          f"{faults['join_redone_steps']:.0f} steps redone, "
          f"{faults['join_seconds_lost']:.1f} s lost")
    spot4, ondemand = _cost_per_sample(ratio)
    print(f"USD per hour of 4-GPU throughput: 4 x g5.2xlarge spot {spot4:.3f}   "
          f"g5.12xlarge on-demand {ondemand:.3f}   ratio spot/on-demand "
          f"{spot4 / ondemand:.2f}")
    print(json.dumps({"one_node_x4": one_node, "four_nodes_x1": four_nodes, "ratio": ratio,
                      "notice_to_n_minus_1_s": to_n1, "notice_to_n_s": to_n, **faults,
                      "usd_per_hour_4x_spot": spot4, "usd_per_hour_ondemand": ondemand}))


if __name__ == "__main__":
    main()
