"""Checkpoint stall, time to durable and peak extra host memory, at 256 MB to 4 GB.

Run by hand: ``python benchmarks/bench_checkpoint.py [SIZES] [REPEAT]`` (default
``256MB,1GB,4GB`` and 3). Each size runs in its own process (so that its peak memory
is its own): the state is a model of ``nn.Linear(4096, 4096)`` layers and its SGD
momentum buffers, half the size each, in float32 on the CPU. Side by side, same
process, same disk:

* ``torch.save`` of the model and optimizer state dicts: the usual synchronous
  checkpoint; the loop waits for all of it. Into the page cache (what a training loop
  that calls it waits for), and with an ``fsync`` (on disk: durable);
* ``torch.distributed.checkpoint.async_save`` (the anchor: PyTorch's own asynchronous
  checkpoint; one-rank gloo group, its default stager and ``FileSystemWriter``, which
  fsyncs): the stall is until it returns, durable when its future is done;
* ``spot.Checkpoint.save`` in standalone mode (the local store on the same disk): the
  stall is the copy into host memory, then the state is written into the store with
  an fsync in the background ("durable"). Cases: the first save right after
  ``Checkpoint()`` (cold: the buffers ``Checkpoint()`` starts allocating in the
  background are not ready; the save shares that work); the first save after
  ``maybe_save`` warmed the buffers; the steady state
  (later saves, buffers reused); the first save after ``restore()``; and a budget of a
  quarter of the state (``host_memory``), where three quarters are written straight
  from the training tensors while the loop waits (streamed);
* the same bytes held in ONE tensor (``table``: an embedding table, say): ``torch.save``
  of it with and without ``fsync``, spotnb's first save right after ``Checkpoint()``
  and its steady state; and ``restore()`` of each state right after its steady save,
  read back into the registered tensors (the two shapes take turns going first). A
  state's shape must not decide its speed: the one-tensor cases are shown
  against the many-tensor ones of the same round (target: within 1.2x; the one
  tensor's cold stall at most 0.3x its ``torch.save``). Each ``restore()`` is also
  shown against ``torch.load`` of the same state from a file on the same disk, copied
  into the same tensors (target: within 1.2x): standalone (it copies the checkpoint
  out of the store and verifies it first) and from a copy downloaded ahead (what a
  job's restore reads: its agent downloads the checkpoint while the kernel starts).

The cases take turns, REPEAT rounds, and each reports its median (and range). "Peak
extra RSS" is the highest resident memory of the process during the case (``VmHWM``,
reset before it) less its resident memory just before, the highest over the rounds:
what the case costs in host memory beyond the state itself (page cache not included;
the steady state's buffers were allocated by the cold save before it). Each case
starts after an ``os.sync()``, so that the previous case's writeback does not weigh
on it. Durable ratios
are against ``torch.save`` with an fsync (the same bytes made durable on the same
disk); stall ratios against ``torch.save`` into the page cache.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SIZES = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else \
    "256MB,1GB,4GB"
REPEAT = int(sys.argv[2]) if len(sys.argv) > 2 and not sys.argv[1].startswith("--") else 3


def parse(size: str) -> int:
    units = {"MB": 2**20, "GB": 2**30}
    return int(float(size[:-2]) * units[size[-2:].upper()])


def rss() -> tuple[int, int]:
    """(resident bytes now, highest resident bytes since the last reset)."""
    status = Path("/proc/self/status").read_text()
    now, peak = (int(re.search(key + r":\s+(\d+)", status).group(1))  # type: ignore[union-attr]
                 for key in ("VmRSS", "VmHWM"))
    return now * 1024, peak * 1024


def reset_peak() -> int:
    # The previous case's writes leave the page cache first: its writeback must not
    # weigh on the next case.
    os.sync()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return rss()[0]


def one(nbytes: int, repeat: int) -> dict[str, Any]:
    """Every case for one state size, in this process."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from spotnb.train import runtime as spot

    work = tempfile.mkdtemp(prefix="snb-bench-ckpt-", dir=os.environ.get("BENCH_DIR"))
    os.chdir(work)
    for key in [k for k in os.environ if k.startswith("SPOTNB_")]:
        del os.environ[key]
    width = 4096
    layers = max(1, round(nbytes / 2 / 4 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    state = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 2
    table = torch.randn(state // 4 // width, width)  # the same bytes in one tensor
    out: dict[str, Any] = {"bytes": state, "cpus": os.cpu_count(),
                           "torch": torch.__version__, "stream_budget": state // 4}
    runs: dict[str, list[tuple[float, float, int]]] = {}

    def record(name: str, before: int, stall: float, durable: float) -> None:
        runs.setdefault(name, []).append((stall, durable, rss()[1] - before))
        print(f"  {name}: stall {stall:.3f} durable {durable:.3f}", file=sys.stderr,
              flush=True)

    restores: dict[str, list[float]] = {}
    loads: dict[str, list[float]] = {}

    def restore(name: str, ckpt: Any) -> None:
        os.sync()
        t0 = time.perf_counter()
        ckpt.restore()
        took = time.perf_counter() - t0
        restores.setdefault(name, []).append(took)
        loads.setdefault(name, []).append(torch_load(name == "one tensor"))
        print(f"  {name}: restore {took:.3f}, torch.load {loads[name][-1]:.3f}",
              file=sys.stderr, flush=True)

    def restore_prefetched(name: str, make: Any) -> None:
        """``restore()`` of the newest checkpoint from a copy downloaded ahead, as the
        agent's prefetch does while the kernel starts and the cell's imports run
        (untimed), against ``torch.load`` of the same state."""
        from spotnb.ckpt.checkpoints import CheckpointStore
        from spotnb.kernel_remote import channel
        from spotnb.protocol.store import LocalStore

        store = CheckpointStore(LocalStore(Path(work) / spot.LOCAL_DIR), "checkpoints")
        manifest = store.latest()
        assert manifest is not None
        pre = Path(work) / "prefetched"
        store.download(manifest, pre)
        (pre / channel.PREFETCH_DONE).touch()
        ckpt = make()
        spot._rt().restore_dir = pre  # a standalone session has none of its own
        os.sync()
        t0 = time.perf_counter()
        ckpt.restore()
        took = time.perf_counter() - t0
        key = f"{name}, prefetched"
        restores.setdefault(key, []).append(took)
        loads.setdefault(key, []).append(torch_load(name == "one tensor"))
        print(f"  {key}: restore {took:.3f}, torch.load {loads[key][-1]:.3f}",
              file=sys.stderr, flush=True)
        del ckpt
        spot._finish()
        shutil.rmtree(pre, ignore_errors=True)

    def torch_load(one_tensor: bool) -> float:
        """The baseline of a restore: the same state read back with ``torch.load``
        from a file on the same disk (written and synced first, untimed) and copied
        into the training tensors."""
        path = os.path.join(work, "load.pt")
        with open(path, "wb") as f:
            torch.save({"table": table} if one_tensor else
                       {"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location="cpu")
        if one_tensor:
            with torch.no_grad():
                table.copy_(loaded["table"])
        else:
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])
        took = time.perf_counter() - t0
        del loaded
        os.unlink(path)
        return took

    def torch_save(sync: bool, one_tensor: bool = False) -> tuple[float, float]:
        path = os.path.join(work, "sync.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"table": table} if one_tensor else
                       {"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        took = time.perf_counter() - t0
        os.unlink(path)
        return took, took

    def dcp_async() -> tuple[float, float]:
        path = os.path.join(work, "dcp")
        t0 = time.perf_counter()
        future: Any = dcp.async_save({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                checkpoint_id=path)
        stall = time.perf_counter() - t0
        future.result()
        durable = time.perf_counter() - t0
        shutil.rmtree(path)
        return stall, durable

    def save(ckpt: Any, step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        ckpt.save(step)
        stall = time.perf_counter() - t0
        ckpt.wait()
        return stall, time.perf_counter() - t0

    whole = state * 2  # a budget the state fits in
    spot.Checkpoint(x=torch.zeros(1)).save(0)  # first-use costs (imports) outside
    spot._finish()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # The cases take turns, round after round: on a shared machine, whatever else runs
    # meanwhile weighs on all of them alike.
    for rnd in range(repeat):
        step = 1000 * rnd
        for name, fn in (("torch.save", lambda: torch_save(False)),
                         ("torch.save + fsync", lambda: torch_save(True)),
                         ("torch.save, one tensor", lambda: torch_save(False, True)),
                         ("torch.save + fsync, one tensor", lambda: torch_save(True, True)),
                         ("dcp.async_save", dcp_async)):
            before = reset_peak()
            record(name, before, *fn())

        def many_block(step: int) -> None:
            before = reset_peak()
            ckpt = spot.Checkpoint(model=model, optimizer=opt, host_memory=whole)
            record("spotnb, first save, cold", before, *save(ckpt, step))
            before = reset_peak()
            record("spotnb, steady state", before, *save(ckpt, step + 1))
            del ckpt
            spot._finish()
            restore("many tensors", spot.Checkpoint(model=model, optimizer=opt,
                                                    host_memory=whole))
            spot._finish()
            restore_prefetched("many tensors", lambda: spot.Checkpoint(
                model=model, optimizer=opt, host_memory=whole))

        def one_block(step: int) -> None:
            before = reset_peak()
            ckpt = spot.Checkpoint(table=table, host_memory=whole)
            record("one tensor: first save, cold", before, *save(ckpt, step))
            before = reset_peak()
            record("one tensor: steady state", before, *save(ckpt, step + 1))
            del ckpt
            spot._finish()
            restore("one tensor", spot.Checkpoint(table=table, host_memory=whole))
            spot._finish()
            restore_prefetched("one tensor", lambda: spot.Checkpoint(
                table=table, host_memory=whole))

        # The two shapes take turns going first, so that neither always follows the
        # same case.
        # (Steps grow case after case: a restore reads the newest checkpoint.)
        first, second = ((many_block, one_block) if rnd % 2 == 0 else
                         (one_block, many_block))
        first(step)
        second(step + 10)
        step += 20

        before = reset_peak()
        ckpt = spot.Checkpoint(model=model, optimizer=opt, host_memory=whole)
        ckpt.maybe_save(step)  # not due (every 60 s): warms the buffers in the background
        ckpt._saves.pool.wait_warm()  # the training loop would be running meanwhile
        record("spotnb, first save after maybe_save warmed", before, *save(ckpt, step + 2))
        del ckpt
        spot._finish()

        before = reset_peak()
        ckpt = spot.Checkpoint(model=model, optimizer=opt, host_memory=whole)
        ckpt.restore()
        ckpt._saves.pool.wait_warm()
        record("spotnb, first save after restore()", before, *save(ckpt, step + 3))
        del ckpt
        spot._finish()

        before = reset_peak()
        ckpt = spot.Checkpoint(model=model, optimizer=opt, host_memory=state // 4)
        record("spotnb, streamed (budget = state / 4)", before, *save(ckpt, step + 4))
        del ckpt
        spot._finish()
    dist.destroy_process_group()
    for name, rows in runs.items():
        # Ratios round by round (same moment, same load), then their median and range;
        # a one-tensor case against torch.save of the one tensor.
        one_tensor = "one tensor" in name
        save_rows = runs["torch.save, one tensor" if one_tensor else "torch.save"]
        fsync_rows = runs["torch.save + fsync, one tensor" if one_tensor
                          else "torch.save + fsync"]
        stall_x = [r[0] / b[0] for r, b in zip(rows, save_rows, strict=True)]
        durable_x = [r[1] / b[1] for r, b in zip(rows, fsync_rows, strict=True)]
        out[name] = {"stall": statistics.median(r[0] for r in rows),
                     "durable": statistics.median(r[1] for r in rows),
                     "stall_x": statistics.median(stall_x),
                     "stall_x_range": [min(stall_x), max(stall_x)],
                     "durable_x": statistics.median(durable_x),
                     "durable_x_range": [min(durable_x), max(durable_x)],
                     "peak_extra": max(r[2] for r in rows)}
    # One tensor against many tensors of the same bytes, round by round.
    shape: dict[str, Any] = {}
    for what, one_name, many_name, col in (
            ("stall, cold", "one tensor: first save, cold", "spotnb, first save, cold", 0),
            ("durable, cold", "one tensor: first save, cold", "spotnb, first save, cold", 1),
            ("stall, steady", "one tensor: steady state", "spotnb, steady state", 0),
            ("durable, steady", "one tensor: steady state", "spotnb, steady state", 1)):
        pairs = list(zip(runs[one_name], runs[many_name], strict=True))
        shape[what] = _summary([o[col] for o, _ in pairs], [m[col] for _, m in pairs])
    shape["restore"] = _summary(restores["one tensor"], restores["many tensors"])
    shape["restore, prefetched"] = _summary(restores["one tensor, prefetched"],
                                            restores["many tensors, prefetched"])
    out["one_vs_many"] = shape
    # restore() against torch.load of the same state, round by round.
    out["restore_vs_load"] = {name: _summary(restores[name], loads[name])
                              for name in restores}
    shutil.rmtree(work, ignore_errors=True)
    return out


def _summary(one: list[float], many: list[float]) -> dict[str, Any]:
    ratios = [o / m for o, m in zip(one, many, strict=True)]
    return {"one": statistics.median(one), "many": statistics.median(many),
            "x": statistics.median(ratios), "x_range": [min(ratios), max(ratios)]}


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(int(sys.argv[2]), int(sys.argv[3]))))
        return
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    for size in SIZES.split(","):
        run = subprocess.run([sys.executable, __file__, "--one", str(parse(size)),
                              str(REPEAT)], capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{size}: failed\n{run.stderr[-3000:]}")
            continue
        res = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"\nstate {res['bytes'] / 2**30:.2f} GiB (model + SGD momentum), "
              f"{res['cpus']} CPUs, torch {res['torch']}; medians of {REPEAT} rounds, ratios "
              "taken round by round (median, range)")
        print(f"{'':44} {'stall s':>8} {'x torch.save':>18} {'durable s':>10} "
              f"{'x save+fsync':>18} {'peak extra RSS':>15}")
        for name, r in res.items():
            if not isinstance(r, dict) or name in ("one_vs_many", "restore_vs_load"):
                continue
            sx, dx = r["stall_x_range"], r["durable_x_range"]
            print(f"{name:44} {r['stall']:8.3f} {r['stall_x']:6.2f} ({sx[0]:.2f}-{sx[1]:.2f}) "
                  f"{r['durable']:10.3f} {r['durable_x']:6.2f} ({dx[0]:.2f}-{dx[1]:.2f}) "
                  f"{r['peak_extra'] / 2**20:11.0f} MiB")
        steady = res["spotnb, steady state"]
        worst = max(r["stall_x"] for n, r in res.items() if isinstance(r, dict)
                    and n.startswith("spotnb") and "streamed" not in n)
        print(f"stall / torch.save: worst unstreamed case {worst:.2f} (target <= 0.3), "
              f"steady {steady['stall_x']:.2f} (target <= 0.1); durable / (torch.save + "
              f"fsync): steady {steady['durable_x']:.2f} (target <= 1.2)")
        print("one tensor / many tensors of the same bytes (target <= 1.2), seconds "
              "and ratio (median, range over rounds):")
        for what, r in res["one_vs_many"].items():
            lo, hi = r["x_range"]
            print(f"  {what:16} one {r['one']:7.3f} many {r['many']:7.3f}  "
                  f"x {r['x']:.2f} ({lo:.2f}-{hi:.2f})")
        for name, r in res["restore_vs_load"].items():
            lo, hi = r["x_range"]
            print(f"restore(), {name}: {r['one']:.3f} s, torch.load + copy {r['many']:.3f} s"
                  f": x {r['x']:.2f} ({lo:.2f}-{hi:.2f}; target <= 1.2)")
        cold = res["one tensor: first save, cold"]
        print(f"one tensor, cold stall / torch.save of it: {cold['stall_x']:.2f} "
              f"({cold['stall_x_range'][0]:.2f}-{cold['stall_x_range'][1]:.2f}; target <= 0.3)")
        print(f"load average after {size}: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")

if __name__ == "__main__":
    main()
