"""Resume latency on the local cloud, zero boot delay, against the cell's own imports.

Run by hand: ``python benchmarks/bench_resume.py [ROUNDS]`` (default 3). Each round
submits a torch training job, delivers an interruption notice mid-run and reads, from
the job's own event log:

* notice -> final checkpoint durable: from the group's notice (IMDS ``instance-action``
  set) to the forced checkpoint's ``durable`` event; its upload time is reported next to
  it (aim: under 1 s plus the upload);
* replacement start -> first training step: from the start of the replacement's agent
  process (the ``process_started`` its ``booting`` event carries) to the first metric
  it logs (aim: under 1 s more than the cell's imports take). For reference, the time
  from the group's ``launched`` event to that process start (the local cloud's own
  latency: it terminates the old instance, then spawns the new one).

The baselines, measured in the same run, from a fresh ``python`` process's start: the
same cell with a stand-in ``spot`` to its first training step (everything the cell
itself costs before it trains: its imports, including those torch defers to the first
optimizer, its data and model), and the cell's imports alone; plus a bare kernel start
through jupyter_client.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

CELL = """
import time
import torch
from sklearn.datasets import load_digits
torch.manual_seed(0)
X, y = load_digits(return_X_y=True)
X = torch.tensor(X / 16.0, dtype=torch.float32)
y = torch.tensor(y)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = torch.optim.Adam(model.parameters())
ckpt = spot.Checkpoint(model=model, optimizer=opt)
start = ckpt.restore()
for step in range(start, 400):
    idx = torch.randint(0, len(X), (64,))
    loss = torch.nn.functional.cross_entropy(model(X[idx]), y[idx])
    opt.zero_grad(); loss.backward(); opt.step()
    spot.log(step, loss=loss.item())
    time.sleep(0.02)
    ckpt.maybe_save(step)
"""

IMPORTS = "import torch; from sklearn.datasets import load_digits; load_digits()"

# The same cell without spotnb: ``spot`` is a stand-in whose first ``log`` call (the
# first training step) reports how long this process has existed and exits at once
# (interpreter teardown is no part of a start).
STANDIN = """
import os, time
class _Spot:
    class Checkpoint:
        def __init__(self, **state): pass
        def restore(self): return 0
        def maybe_save(self, step): pass
    def log(self, step, **metrics):
        now = time.time()
        from spotnb.kernel_remote.procs import process_started
        print(now - process_started(), flush=True)
        os._exit(0)
spot = _Spot()
"""


def since_process_start(code: str) -> float:
    """Seconds from a fresh ``python -c code`` process's start to its report."""
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    return float(out.strip().splitlines()[-1])


def cell_seconds() -> float:
    """The same cell in a fresh python: process start -> first training step."""
    return since_process_start(STANDIN + CELL)


def imports_seconds() -> float:
    """The cell's imports alone in a fresh python: process start -> imports done."""
    return since_process_start(IMPORTS + "\n" + STANDIN + "spot.log(0)\n")


def kernel_start_seconds() -> float:
    from jupyter_client.manager import start_new_kernel

    start = time.perf_counter()
    km, kc = start_new_kernel(kernel_name="python3")
    took = time.perf_counter() - start
    kc.stop_channels()
    km.shutdown_kernel(now=True)
    return took


def one_round() -> dict[str, float]:
    import spotnb

    handle = spotnb.submit(CELL, checkpoint_every="100 steps")
    interrupted = False
    for event in handle.events(timeout=300):
        if not interrupted and event.type == "metric" and event.data["step"] >= 60:
            handle.interrupt()
            interrupted = True
    events = list(handle.events(follow=False))
    notice = next(e.time for e in events if e.type == "instance"
                  and e.data.get("action") == "notice")
    forced = next(e for e in events if e.type == "checkpoint" and e.attempt == 1
                  and e.data.get("phase") == "durable" and e.data.get("forced"))
    launches = [e for e in events if e.type == "instance" and e.data.get("action") == "launched"]
    booting = next(e for e in events if e.type == "status" and e.attempt == 2
                   and e.data.get("state") == "booting")
    started = booting.data.get("process_started") or launches[1].time
    first_step = min(e.data["t"] for e in events if e.type == "metric" and e.attempt == 2)
    return {
        "notice_to_durable": forced.time - notice,
        "upload": float(forced.data.get("seconds") or 0.0),
        "start_to_first_step": first_step - started,
        "launch_to_start": started - launches[1].time,
    }


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    os.environ["SPOTNB_HOME"] = tempfile.mkdtemp(prefix="snb-bench-resume-")
    os.environ.setdefault("SPOTNB_LOCAL_HAZARD", "0")
    os.environ.setdefault("SPOTNB_LOCAL_BOOT_SECONDS", "0")
    results = [one_round() for _ in range(rounds)]
    baseline_cell = statistics.median(cell_seconds() for _ in range(rounds))
    baseline_imports = statistics.median(imports_seconds() for _ in range(rounds))
    baseline_kernel = statistics.median(kernel_start_seconds() for _ in range(rounds))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in results)

    first = med("start_to_first_step")
    print(f"rounds: {rounds} (medians)")
    print(f"{'measure':<44} {'spotnb':>8} {'baseline':>9} {'diff':>7}")
    print(f"{'notice -> final checkpoint durable (s)':<44} {med('notice_to_durable'):8.2f} "
          f"{med('upload'):9.2f} {med('notice_to_durable') - med('upload'):7.2f}"
          "   (baseline: the upload itself)")
    print(f"{'replacement start -> first step (s)':<44} {first:8.2f} "
          f"{baseline_cell:9.2f} {first - baseline_cell:7.2f}"
          "   (baseline: the same cell in a fresh python)")
    print(f"{'':<44} {'':8} {baseline_imports:9.2f} {first - baseline_imports:7.2f}"
          "   (baseline: the cell's imports alone)")
    print(f"{'  for reference: a bare kernel start (s)':<44} {'':8} {baseline_kernel:9.2f}")
    print(f"{'  for reference: launched -> process start (s)':<44} "
          f"{med('launch_to_start'):8.2f}")

if __name__ == "__main__":
    main()
