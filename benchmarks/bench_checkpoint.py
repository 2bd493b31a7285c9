"""The training-loop stall of ``ckpt.save`` versus a synchronous ``torch.save``.

Run by hand: ``python benchmarks/bench_checkpoint.py [MB]`` (default 256). The state
is a model and its SGD momentum buffers, half the size each. Measured in one run, on
the same disk:

* ``torch.save`` of model + optimizer state dicts to a local file (the usual
  synchronous checkpoint: the loop waits for all of it);
* ``ckpt.save(step)`` of the same state in standalone mode: the stall is the copy
  into host memory; serialising, hashing and writing to the store (with fsync)
  happen in the background, reported as "durable after". Four cases: the very
  first save with nothing prepared; the first save after ``maybe_save`` has
  warmed the host buffers in the background; the steady state (later saves,
  reusing the buffers); and the first save after ``restore()`` (a resumed attempt:
  restore warms the buffers).
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

MB = int(sys.argv[1]) if len(sys.argv) > 1 else 256
REPEAT = 5


def build(total_mb: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of total_mb / 2 of float32 weights, with momentum buffers of the same size."""
    width = 4096
    layers = max(1, round(total_mb / 2 * 2**20 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # creates the momentum buffers
    return model, opt


def state_mb(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    tensors = [*model.state_dict().values(),
               *(s["momentum_buffer"] for s in opt.state_dict()["state"].values())]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def main() -> None:
    work = tempfile.mkdtemp(prefix="snb-ckpt-")
    os.chdir(work)
    for key in [k for k in os.environ if k.startswith("SPOTNB_")]:
        del os.environ[key]
    from spotnb import runtime as spot

    model, opt = build(MB)
    size = state_mb(model, opt)

    sync = []
    for i in range(REPEAT):
        t0 = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                   os.path.join(work, f"sync-{i}.pt"))
        sync.append(time.perf_counter() - t0)
        os.unlink(os.path.join(work, f"sync-{i}.pt"))
    baseline = statistics.median(sync)

    def timed_save(ckpt: spot.Checkpoint, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        ckpt.save(step)
        stall = time.perf_counter() - t0
        ckpt.wait()
        return stall, time.perf_counter() - t0

    cold = timed_save(spot.Checkpoint(model=model, optimizer=opt), 0)
    spot._finish()

    ckpt = spot.Checkpoint(model=model, optimizer=opt)
    ckpt.maybe_save(0)  # not due (every 60 s): warms the host buffers in the background
    time.sleep(3)  # the training loop would be running meanwhile
    warm = timed_save(ckpt, 1)
    steady = [timed_save(ckpt, 2 + i) for i in range(REPEAT)]
    spot._finish()

    ckpt = spot.Checkpoint(model=model, optimizer=opt)
    ckpt.restore()
    time.sleep(3)
    resumed = timed_save(ckpt, 100)
    spot._finish()
    shutil.rmtree(work, ignore_errors=True)

    steady_stall = statistics.median(s for s, _ in steady)
    steady_durable = statistics.median(d for _, d in steady)
    print(f"state {size:.0f} MB (model + SGD momentum), {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}; medians of {REPEAT}")
    print(f"{'':44} {'stall s':>8} {'x torch.save':>13} {'durable after s':>16}")
    print(f"{'torch.save to local disk (synchronous)':44} {baseline:8.3f} {1.0:13.2f} "
          f"{baseline:16.3f}")
    for name, (stall, durable) in (
        ("ckpt.save, first save, cold", cold),
        ("ckpt.save, first save after maybe_save warm", warm),
        ("ckpt.save, steady state", (steady_stall, steady_durable)),
        ("ckpt.save, first save after restore()", resumed),
    ):
        print(f"{name:44} {stall:8.3f} {stall / baseline:13.2f} {durable:16.3f}")
    print(f"\nsteady-state stall / torch.save = {steady_stall / baseline:.2f} (target < 0.3): "
          f"{'OK' if steady_stall / baseline < 0.3 else 'MISSED'}")


if __name__ == "__main__":
    main()
