"""The stall of a sharded (FSDP2) checkpoint: spotnb's asynchronous save against DCP's.

Run by hand: ``python benchmarks/bench_sharded_save.py [SIZE] [REPEAT]`` (default
``256MB`` of state per rank and 3 rounds). Two ranks (processes, gloo on loopback,
CPU) shard a model of ``nn.Linear(2048, 2048)`` layers with FSDP2 (``fully_shard``) and
train it with SGD with momentum, so the state is the weights plus as much again of
momentum. Side by side, same processes, same disk, turn by turn each round:

* ``dcp.save`` to a ``FileSystemWriter`` (the baseline: PyTorch's synchronous
  distributed checkpoint; training waits for the writes, durable when it returns);
* ``dcp.async_save`` with its default stager (the anchor: PyTorch's own asynchronous
  save; a fresh host copy each time, written in a thread), on a gloo group;
* ``spot.Checkpoint.save`` in standalone mode (the local store on the same disk): the
  copy of each rank's shards into reused host buffers, then ``dcp.async_save`` in the
  background; durable once the manifest and ``LATEST`` are written (``wait()``).

Each figure is the slower rank's (a collective save is as slow as its slowest rank),
the median over rounds; ratios against ``dcp.save`` of the same round. spotnb's first
save allocates its buffers (cold, reported apart); the rounds after reuse them.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZE = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else "256MB"
REPEAT = int(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[1].startswith("--") else 3
WORLD = 2


def parse(size: str) -> int:
    units = {"MB": 2**20, "GB": 2**30}
    return int(float(size[:-2]) * units[size[-2:].upper()])


def rank_main(rank: int, rendezvous: str, per_rank: int, repeat: int) -> None:
    """One rank: every case, ``repeat`` rounds; prints its timings as JSON."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from spotnb.train import runtime as spot

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                           world_size=WORLD)
    layer_bytes = 2048 * 2048 * 4
    # Weights + momentum = 2 x the parameters; the whole state is per_rank x WORLD.
    layers = max(1, per_rank * WORLD // (2 * layer_bytes))
    model = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048, bias=False)
                                  for _ in range(layers)))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step() -> None:
        model(torch.randn(8, 2048)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()  # the momentum exists
    group = dist.new_group(backend="gloo")
    out = Path(tempfile.mkdtemp(prefix=f"bench-sharded-{rank}-"))
    ckpt = spot.Checkpoint(model=model, optimizer=opt)
    times: dict[str, list[list[float]]] = {}

    def record(case: str, stall: float, durable: float) -> None:
        times.setdefault(case, []).append([stall, durable])

    def state() -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        m, o = get_state_dict(model, opt)
        return {"model": m, "optim": o}

    for i in range(repeat + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save(state(), checkpoint_id=str(out / f"sync-{i}"))
        t = time.perf_counter() - t0
        record("dcp.save", t, t)
        step()

        dist.barrier()
        t0 = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=str(out / f"async-{i}"),
                                process_group=group)
        stall = time.perf_counter() - t0
        future.result()
        record("dcp.async_save", stall, time.perf_counter() - t0)
        step()

        dist.barrier()
        t0 = time.perf_counter()
        ckpt.save(i)
        stall = time.perf_counter() - t0
        ckpt.wait()
        dist.barrier()  # rank 0's manifest and LATEST: durable for every rank
        record("spotnb, cold" if i == 0 else "spotnb", stall, time.perf_counter() - t0)
        step()
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
    shutil.rmtree(out, ignore_errors=True)
    print(json.dumps({"layers": layers, "times": times}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    per_rank = parse(SIZE)
    work = Path(tempfile.mkdtemp(prefix="bench-sharded-"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(rank),
                               str(work / "rendezvous"), str(per_rank), str(REPEAT)],
                              cwd=work, env=env, stdout=subprocess.PIPE, text=True)
             for rank in range(WORLD)]
    results = [json.loads(proc.communicate()[0].strip().splitlines()[-1]) for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit("a rank failed (its error is above)")
    shutil.rmtree(work, ignore_errors=True)
    layers = results[0]["layers"]
    total = layers * 2048 * 2048 * 4 * 2
    print(f"FSDP2 on {WORLD} ranks (gloo, CPU): {layers} x Linear(2048, 2048) + SGD "
          f"momentum = {total / 2**20:.0f} MiB of state, {total / WORLD / 2**20:.0f} MiB "
          f"per rank; {REPEAT} rounds, the slower rank's time, medians (ratio range)")
    # Per case and round: the slower rank's [stall, durable]. Rounds 1..REPEAT count;
    # round 0 warms every case up, and is spotnb's cold save (its buffers allocated).
    slow = {case: [[max(r["times"][case][k][j] for r in results) for j in range(2)]
                   for k in range(len(rows))]
            for case, rows in results[0]["times"].items()}
    base = [stall for stall, _ in slow["dcp.save"]]
    print(f"{'case':<16} {'stall s':>8} {'x dcp.save':>18} {'durable s':>10} "
          f"{'x dcp.save':>18}")
    for case, rows in slow.items():
        if case == "spotnb, cold":
            picked = [(rows[0], base[0])]
        elif case == "spotnb":
            picked = list(zip(rows, base[1:], strict=True))
        else:
            picked = list(zip(rows[1:], base[1:], strict=True))
        stall = [row[0] for row, _ in picked]
        durable = [row[1] for row, _ in picked]
        rs = [row[0] / b for row, b in picked]
        rd = [row[1] / b for row, b in picked]
        print(f"{case:<16} {statistics.median(stall):>8.3f} "
              f"{statistics.median(rs):>6.2f} ({min(rs):.2f}-{max(rs):.2f}) "
              f"{statistics.median(durable):>10.3f} "
              f"{statistics.median(rd):>6.2f} ({min(rd):.2f}-{max(rd):.2f})")

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
