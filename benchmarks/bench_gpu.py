"""GPU device check: spotnb's NVML sampler, and its checkpoints of CUDA state, on one GPU.

No test of the suite can reach these paths on a machine without a GPU: this script is
the project's check of them on one. Results: ``benchmarks/RESULTS.md``, "GPU device
check". It prints ``[PASS]``/``[FAIL]`` lines (and ``[SKIP]`` for what cannot run
here, ``[INFO]`` for figures that are reported, not judged) and tables:

1. **Sampler** (``spotnb.kernel_remote.sampler.Sampler``, what the instance plots):
   sampled every 0.25 s for 1.5 s idle, 3 s while a bf16 matmul loop keeps the GPU
   busy with 4 GiB more allocated, then idle again. Checks: every sample is a ``gpu``
   one listing every NVML device; the GPU torch uses is found among them (by UUID,
   else PCI address); its utilisation is above 0 (median >= 50 %) while busy; its
   ``mem_used`` is at least ``torch.cuda.memory_reserved()`` and at most 2 GiB above
   it (CUDA context, driver), and rose by what torch reserved meanwhile (within
   256 MiB); ``mem_total`` is the device's.
2. **Pinned host memory** as spotnb allocates it for copies from a GPU
   (``spotnb.ckpt.memory.host_empty(pin=True)``), for sizes that are and are not
   powers of two. Checks: page-locked; the host memory it takes is its size (RSS, and
   torch's pinned-allocator statistics where RSS does not show them); an asynchronous
   copy from the GPU lands in it, also after the process forks (a DataLoader worker);
   freed, it goes back to the system. Reported: the time of each allocation, how fast
   the training thread (the GIL) runs meanwhile, the copy's bandwidth, and the same
   figures for torch's own pinned allocator (``pin_memory=True``) and pageable memory.
3. **Checkpoints of CUDA state**, one process per size (default 256 MB and 2 GB): a
   GPT-like model (embedding, MLP blocks of GPT-2 widths, LayerNorm) and its AdamW
   state on the GPU, a CUDA ``torch.Generator`` and a dict, saved with
   ``spot.Checkpoint`` in standalone mode (the local store, on the disk of the working
   directory). Side by side in the same rounds, on the same disk: ``torch.save`` of
   the model's and optimizer's state dicts (into the page cache; and with ``fsync``:
   durable), spotnb's ``Checkpoint()`` and first save right after it (cold), its
   steady state (the pinned buffers reused), its first save after its buffers were
   allocated in the background while training ran, and ``Checkpoint()`` + a save
   within a budget of a quarter of the state (``host_memory``: the rest streamed from
   the GPU while the loop waits) and within one just above the state. *Stall* is the
   time the training thread is blocked (the GPU synchronised before): ``save()``, and
   ``Checkpoint()`` where the case names it (its background allocation of the pinned
   buffers can block the training thread's CUDA calls); *durable* is until ``wait()``
   returns (the checkpoint is in the store, fsynced, ``LATEST`` moved). Two training
   steps run right after each ``save()`` returns, changing every parameter and
   optimizer tensor while the upload runs. Checks: every restore is byte-exact
   against the state at the save (not after those steps); restored tensors are the
   registered objects' own CUDA tensors (same device and address); into a fresh model
   and a fresh optimizer, the optimizer's state lands on its parameters' device (its
   ``step`` where torch keeps it); the CUDA RNG state and the CUDA generator's come
   back; later saves reuse the same pinned buffers and pin no new memory; the host
   memory of a save with a budget stays within it. Also ``restore()`` against
   ``torch.load(map_location=cuda)`` + ``load_state_dict`` of the same state from the
   page cache, and the training time lost while the buffers are pinned in the
   background (training steps timed until the allocation ends).

Run by hand from the repository root on a machine with an NVIDIA GPU, torch and
nvidia-ml-py::

    python3 benchmarks/bench_gpu.py [--sizes 256MB,2GB] [--rounds 3]
        [--deadline 330] [--json results.json] [--device cpu]

spotnb need not be installed (the script puts its checkout on ``sys.path`` then): what
these parts import of it needs only torch, psutil and cloudpickle (and the ``crc32c``
wheel for CRC-32C checksums; without it spotnb records zlib's CRC-32). ``--rounds``:
rounds per size at most; rounds after the first run only while the ``--deadline``
(seconds for the whole run; each size gets a share) leaves time for them.
The working directory (the store, ``torch.save``'s files) is ``$BENCH_DIR`` if set,
else a temporary folder in the current directory; its file system is printed.
``--device cpu`` runs the checkpoint part on CPU tensors and the sampler's CPU path,
to test this script on a machine without a GPU: every CUDA check is then SKIPPED.
Exit status: 0 when every check passed (skips aside), 1 when one failed, 2 when a
part crashed or ran out of time.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# Runnable from a checkout where spotnb is not installed (a GPU machine's own Python).
if importlib.util.find_spec("spotnb") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 2**20
GiB = 2**30
SAMPLE_INTERVAL = 0.25
# A sampled GPU's memory is at most this much above what torch reserved: the CUDA
# context and what the driver keeps (about 0.5 GiB on an H100).
CONTEXT_SLACK = 2 * GiB
# Host memory a save may take beyond its budget: Python objects, DCP's plan, pickles.
BUDGET_SLACK = 64 * MiB


# -- reporting -----------------------------------------------------------------------


class Report:
    """The checks and figures of one part, printed as they come and kept for JSON."""

    def __init__(self) -> None:
        self.checks: list[dict[str, str]] = []
        self.figures: dict[str, Any] = {}

    def _add(self, status: str, name: str, detail: str) -> None:
        print(f"  [{status}] {name}" + (f": {detail}" if detail else ""), flush=True)
        self.checks.append({"status": status, "name": name, "detail": detail})

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self._add("PASS" if ok else "FAIL", name, detail)
        return ok

    def skip(self, name: str, why: str) -> None:
        self._add("SKIP", name, why)

    def info(self, name: str, detail: str) -> None:
        self._add("INFO", name, detail)


def mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(MB|GB|MiB|GiB)\s*", text, flags=re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes as 256MB or 2GB")
    return int(float(m.group(1)) * (GiB if m.group(2).upper().startswith("G") else MiB))


# -- host memory ---------------------------------------------------------------------


def rss() -> tuple[int, int]:
    """(resident bytes now, highest resident bytes since the last reset)."""
    status = Path("/proc/self/status").read_text()
    now, peak = (int(re.search(key + r":\s+(\d+)", status).group(1))  # type: ignore[union-attr]
                 for key in ("VmRSS", "VmHWM"))
    return now * 1024, peak * 1024


def cuda_ready(torch: Any) -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_initialized())


def empty_host_cache(torch: Any) -> None:
    """Give torch's cached pinned blocks back to the system (nothing else frees them)."""
    if cuda_ready(torch):
        fn = getattr(torch._C, "_host_emptyCache", None)
        if fn is not None:
            fn()


def pinned_bytes(torch: Any) -> tuple[int, int]:
    """(bytes torch's pinned allocator holds now, its peak): blocks in use and cached,
    each rounded as the allocator asked CUDA for it."""
    if not cuda_ready(torch) or not hasattr(torch.cuda, "host_memory_stats"):
        return 0, 0
    stats = torch.cuda.host_memory_stats()
    return (int(stats.get("allocated_bytes.current", 0)),
            int(stats.get("allocated_bytes.peak", 0)))


def reset_peak(torch: Any) -> tuple[int, int]:
    """Start a case: the page cache written back, the peaks reset; (RSS, pinned) now."""
    os.sync()
    gc.collect()
    empty_host_cache(torch)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if cuda_ready(torch) and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
        torch.cuda.reset_peak_host_memory_stats()
    return rss()[0], pinned_bytes(torch)[0]


def pinned_in_rss(torch: Any) -> bool:
    """Whether torch's pinned memory shows in this process's RSS (then RSS covers it)."""
    empty_host_cache(torch)
    before = rss()[0]
    probe = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    grew = rss()[0] - before
    del probe
    empty_host_cache(torch)
    return grew >= 48 * MiB


def extra_host(torch: Any, start: tuple[int, int], counted: bool) -> int:
    """The peak host memory of a case beyond its start: RSS, plus torch's pinned memory
    where RSS does not show it (``counted``: :func:`pinned_in_rss`)."""
    extra = max(0, rss()[1] - start[0])
    if not counted:
        extra += max(0, pinned_bytes(torch)[1] - start[1])
    return extra


# -- part 1: the sampler -------------------------------------------------------------


def run_sampler(seconds: float, during: Callable[[], None] | None = None
                ) -> list[tuple[float, dict[str, Any]]]:
    from spotnb.kernel_remote.sampler import Sampler

    samples: list[tuple[float, dict[str, Any]]] = []
    s = Sampler(lambda x: samples.append((time.monotonic(), x)), interval=SAMPLE_INTERVAL)
    s.start()
    if during is not None:
        during()
    else:
        time.sleep(seconds)
    s.stop()
    s._thread.join(timeout=5)
    return samples


def part_sampler(rep: Report, device: str) -> None:
    from spotnb.kernel_remote import sampler as smp

    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    cuda = torch is not None and device == "cuda" and torch.cuda.is_available()
    nvml = smp._nvml()
    if nvml is None or not cuda:
        if device == "cuda":
            rep.check("NVML and CUDA are both here", False,
                      f"NVML {'found' if nvml else 'not found (nvidia-ml-py?)'}, CUDA "
                      f"{'available' if cuda else 'not available'}")
        else:
            rep.skip("NVML samples", "--device cpu")
        samples = run_sampler(1.3)
        kinds = {x.get("kind") for _, x in samples}
        want = "gpu" if nvml is not None else "cpu"
        rep.check(f"{want} samples from Sampler", len(samples) >= 3 and kinds == {want},
                  f"{len(samples)} samples, kinds {sorted(map(str, kinds))}, "
                  f"util {[round(x['util'], 1) for _, x in samples]}")
        return

    assert torch is not None
    dev = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(dev)
    torch.empty(1, device="cuda")  # the context, before the idle phase
    count = nvml.nvmlDeviceGetCount()
    mine, how = _nvml_index(nvml, props, count)
    name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(mine))
    driver = nvml.nvmlSystemGetDriverVersion()
    rep.figures.update(gpu=str(props.name), nvml_name=str(name), driver=str(driver),
                       nvml_count=count)
    rep.info("device", f"torch cuda:{dev} {props.name} ({props.total_memory / GiB:.1f} GiB) "
             f"= NVML index {mine} {name} (matched by {how}); driver {driver}; "
             f"{count} NVML device(s); CUDA_VISIBLE_DEVICES="
             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    rep.check("torch's GPU found among NVML's", how in ("UUID", "PCI address"),
              f"by {how}")
    phases: dict[str, float] = {}
    reserved: dict[str, int] = {}

    def load() -> None:
        time.sleep(1.5)
        reserved["idle"] = torch.cuda.memory_reserved(dev)
        phases["busy"] = time.monotonic()
        blob = torch.ones(4 * GiB, dtype=torch.uint8, device="cuda")
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        n = 0
        while time.monotonic() - phases["busy"] < 3.0:
            for _ in range(10):
                c = a @ b
            torch.cuda.synchronize()
            n += 10
        reserved["busy"] = torch.cuda.memory_reserved(dev)
        reserved["allocated"] = torch.cuda.memory_allocated(dev)
        phases["idle2"] = time.monotonic()
        rep.figures["matmuls"] = n
        del blob, a, b, c
        time.sleep(1.0)

    samples = run_sampler(0, load)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(samples)]
    rep.check("every sample is a gpu sample listing every NVML device",
              len(samples) >= 10 and all(x["kind"] == "gpu" and
                                         [g["index"] for g in x["gpus"]] == list(range(count))
                                         for _, x in samples),
              f"{len(samples)} samples, median interval "
              f"{statistics.median(gaps) if gaps else float('nan'):.3f} s")
    idle = [x for t, x in samples if t < phases["busy"]]
    busy = [x for t, x in samples if phases["busy"] + 0.5 <= t <= phases["idle2"]]
    if not idle or not busy:
        rep.check("samples in the idle and busy phases", False,
                  f"{len(idle)} idle, {len(busy)} busy")
        return
    util = [x["gpus"][mine]["util"] for x in busy]
    rep.figures.update(util_busy=util, util_idle=[x["gpus"][mine]["util"] for x in idle])
    rep.check("utilisation while busy", min(util) >= 0 and max(util) > 0
              and statistics.median(util) >= 50,
              f"busy {util} %, idle {rep.figures['util_idle']} %")
    rep.check("the sample's util is the mean over the GPUs",
              all(abs(x["util"] - sum(g["util"] for g in x["gpus"]) / count) < 1e-9
                  for _, x in samples))
    used_busy = statistics.median(x["gpus"][mine]["mem_used"] for x in busy)
    used_idle = statistics.median(x["gpus"][mine]["mem_used"] for x in idle)
    above = used_busy - reserved["busy"]
    rep.figures.update(mem_used_busy=used_busy, mem_used_idle=used_idle,
                       torch_reserved_busy=reserved["busy"],
                       torch_allocated_busy=reserved["allocated"],
                       torch_reserved_idle=reserved["idle"])
    rep.check("mem_used while busy covers what torch reserved",
              0 <= above <= CONTEXT_SLACK,
              f"NVML {mib(used_busy)}, torch reserved {mib(reserved['busy'])} "
              f"(allocated {mib(reserved['allocated'])}): {mib(above)} above")
    grew, rose = used_busy - used_idle, reserved["busy"] - reserved["idle"]
    rep.check("mem_used rose by what torch reserved", abs(grew - rose) <= 256 * MiB,
              f"NVML +{mib(grew)}, torch reserved +{mib(rose)}")
    total = samples[-1][1]["gpus"][mine]["mem_total"]
    rep.check("mem_total is the device's", abs(total - props.total_memory) <= 0.02 * total,
              f"NVML {total / GiB:.2f} GiB, torch {props.total_memory / GiB:.2f} GiB")
    with contextlib.suppress(Exception):
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(
            nvml.nvmlDeviceGetHandleByIndex(mine))
        own = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
        rep.info("NVML's per-process memory", f"this process: "
                 f"{mib(own[0]) if own and own[0] is not None else 'not reported'}; "
                 f"{len(procs)} process(es) on the GPU")


def _nvml_index(nvml: Any, props: Any, count: int) -> tuple[int, str]:
    """The NVML index of torch's GPU, and how it was matched."""
    uuid = str(getattr(props, "uuid", "") or "").lower().removeprefix("gpu-")
    pci = tuple(getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id",
                                                  "pci_device_id"))
    for i in range(count):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        theirs = nvml.nvmlDeviceGetUUID(handle)
        theirs = theirs.decode() if isinstance(theirs, bytes) else str(theirs)
        if uuid and theirs.lower().removeprefix("gpu-") == uuid:
            return i, "UUID"
        info = nvml.nvmlDeviceGetPciInfo(handle)
        if None not in pci and (info.domain, info.bus, info.device) == pci:
            return i, "PCI address"
    return 0, "nothing (assumed index 0)"


# -- part 2: pinned host memory ------------------------------------------------------

# Buffer sizes: powers of two, just above one, GPT-2-like weights (Linear(768, 3072),
# Linear(1536, 6144), an embedding of 38837 x 1536), all float32; a little over 1 GiB.
PINNED_SIZES = (64 * MiB, 64 * MiB + 4096, 768 * 3072 * 4, 1536 * 6144 * 4,
                38837 * 1536 * 4, GiB + MiB)


def _gil_free(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """Run ``fn`` in a thread while this one counts: (its result, its seconds, how
    fast this thread ran meanwhile, as a share of its speed beside a sleeping one)."""
    def count(th: threading.Thread, out: list[Any]) -> tuple[Any, float, float]:
        t0 = time.perf_counter()
        th.start()
        n = 0
        while th.is_alive():
            n += 1
        took = time.perf_counter() - t0
        th.join()
        return out[0] if out else None, took, n / took if took > 0 else 0.0

    _, _, alone = count(threading.Thread(target=time.sleep, args=(0.2,)), [])
    out: list[Any] = []
    result, took, rate = count(threading.Thread(target=lambda: out.append(fn())), out)
    return result, took, rate / alone if alone else 1.0


def _allocations(torch: Any, label: str, make: Callable[[int], Any], counted: bool
                 ) -> tuple[list[Any], list[dict[str, Any]], int]:
    """Allocate every PINNED_SIZES buffer with ``make``; print a row each. Returns
    (the buffers, the rows, host bytes they took): RSS, plus torch's pinned memory
    where RSS does not show it."""
    print(f"  {'bytes':>14} {'host memory':>14} {'x':>6} {'seconds':>8} {'pinned?':>8} "
          f"{'GIL free':>9}   ({label})")
    bufs, rows = [], []
    total = 0
    for size in PINNED_SIZES:
        r0, a0 = rss()[0], pinned_bytes(torch)[0]
        buf, took, ran = _gil_free(functools.partial(make, size))
        took_bytes = rss()[0] - r0 + (0 if counted else pinned_bytes(torch)[0] - a0)
        total += took_bytes
        bufs.append(buf)
        rows.append({"bytes": size, "host": took_bytes, "seconds": took, "ran": ran,
                     "is_pinned": bool(buf.is_pinned())})
        print(f"  {size:14,d} {took_bytes:14,d} {took_bytes / size:6.2f} {took:8.3f} "
              f"{buf.is_pinned()!s:>8} {ran:9.2f}", flush=True)
    return bufs, rows, total


def part_pinned(rep: Report, device: str) -> None:
    import torch

    from spotnb.ckpt.memory import host_empty

    if device != "cuda" or not torch.cuda.is_available():
        rep.skip("pinned host memory", "no CUDA" if device == "cuda" else "--device cpu")
        return
    torch.empty(1, device="cuda")
    counted = pinned_in_rss(torch)
    rep.info("torch's pinned memory shows in RSS", "yes" if counted else "no")
    asked = sum(PINNED_SIZES)

    # What a checkpoint's buffers for GPU tensors are.
    empty_host_cache(torch)
    bufs, rows, took = _allocations(
        torch, "spotnb.ckpt.memory.host_empty(pin=True)",
        lambda size: host_empty(torch, (size,), torch.uint8, pin=True), counted)
    rep.figures["spotnb_pinned"] = rows
    rep.check("spotnb's pinned buffers are page-locked", all(r["is_pinned"] for r in rows))
    rep.check("spotnb's pinned buffers take their own size of host memory",
              took <= asked * 1.05 + 16 * MiB,
              f"{mib(took)} for {mib(asked)} of buffers ({took / asked:.2f}x)")

    # Copies from the GPU into them, before and after a fork (a DataLoader worker):
    # the bytes must land in the parent's buffer, and the fork must not copy them.
    src = torch.randint(0, 255, (GiB + MiB,), dtype=torch.uint8, device="cuda")
    speeds = {}

    def d2h(what: str, dst: Any) -> bool:
        for _ in range(2):  # the second one counts
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            took = time.perf_counter() - t0
        speeds[what] = src.numel() / took / 1e9
        return bool(torch.equal(dst[:MiB].to("cuda"), src[:MiB])) and \
            bool(torch.equal(dst[-MiB:].to("cuda"), src[-MiB:]))

    ok = d2h("spotnb pinned", bufs[-1])
    r0 = rss()[0]
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # "multi-threaded, fork() may deadlock": it exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    forked = time.perf_counter() - t0
    src.add_(1)
    after = d2h("spotnb pinned, after a fork", bufs[-1])
    rep.check("copies from the GPU land in spotnb's pinned buffer, also after a fork",
              ok and after, f"{speeds['spotnb pinned']:.1f} GB/s; fork + child's exit "
              f"{forked * 1e3:.0f} ms, parent RSS {mib(rss()[0] - r0)}")

    # Freed: given back to the system (RSS), or kept by a cache.
    r0, a0 = rss()[0], pinned_bytes(torch)[0]
    del bufs
    gc.collect()
    kept = took - (r0 - rss()[0]) - (0 if counted else a0 - pinned_bytes(torch)[0])
    rep.figures["spotnb_pinned_kept_after_free"] = kept
    rep.check("host memory of freed spotnb pinned buffers goes back to the system",
              kept <= 0.05 * asked, f"{mib(max(0, kept))} still held")

    # For comparison: torch's own pinned allocator (torch.empty(pin_memory=True)).
    empty_host_cache(torch)
    tbufs, rows, ttook = _allocations(
        torch, "torch.empty(pin_memory=True)",
        lambda size: torch.empty(size, dtype=torch.uint8, pin_memory=True), counted)
    rep.figures["torch_pinned"] = rows
    ok = d2h("torch pinned", tbufs[-1])
    pageable = host_empty(torch, (src.numel(),), torch.uint8)
    ok = d2h("pageable", pageable) and ok
    del pageable
    r0 = rss()[0]
    del tbufs
    gc.collect()
    tkept = ttook - (r0 - rss()[0])
    rep.figures["torch_pinned_kept_after_free"] = tkept
    rep.figures["d2h_GBps"] = speeds
    rep.info("torch's pinned allocator, for comparison",
             f"{mib(ttook)} for {mib(asked)} ({ttook / asked:.2f}x: each block rounded up "
             f"to a power of two), {mib(tkept)} kept after free (its cache); GPU -> "
             + ", ".join(f"{k} {v:.1f} GB/s" for k, v in speeds.items())
             + f"; bytes equal: {ok}")
    empty_host_cache(torch)


# -- part 3: checkpoints of CUDA state -----------------------------------------------


def build(torch: Any, nbytes: int, dev: Any, seed: int) -> tuple[Any, Any]:
    """A GPT-like model whose parameters and AdamW state take about ``nbytes``."""
    from torch import nn

    params = nbytes // 12  # float32 parameters, exp_avg, exp_avg_sq
    width = 768 if nbytes < GiB else 1536
    vocab = max(1001, params // 3 // width) | 1  # odd: no power of two
    blocks = max(1, round((params - vocab * width) / (8 * width * width)))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vocab = vocab
            self.emb = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList(
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                              nn.Linear(4 * width, width)) for _ in range(blocks))
            self.norm = nn.LayerNorm(width)

        def forward(self, ids: Any) -> Any:
            x = self.emb(ids)
            for block in self.blocks:
                x = x + block(x)
            return self.norm(x)

    torch.manual_seed(seed)
    model = Net().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def train(torch: Any, model: Any, opt: Any, steps: int, dev: Any) -> None:
    for _ in range(steps):
        ids = torch.randint(0, model.vocab, (8, 128), device=dev)
        model(ids).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # kept: later steps allocate no host memory


def flat(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in nested dicts and lists."""
    import torch

    if isinstance(tree, torch.Tensor):
        yield prefix, tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            yield from flat(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from flat(v, f"{prefix}.{i}")


def state_of(model: Any, opt: Any, gen: Any, extra: dict[str, Any]) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "gen": gen.get_state(), "extra": extra}


def sync(torch: Any, dev: Any) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def compare(torch: Any, ref: dict[str, Any], now: dict[str, Any],
            same_storage: bool) -> tuple[bool, str]:
    """Whether every tensor of ``now`` has ``ref``'s bytes, dtype, shape and device
    (``same_storage``: and is the very tensor ``ref`` was cloned from)."""
    want, got = dict(flat(ref["tensors"])), dict(flat(now))
    if want.keys() != got.keys():
        return False, f"names differ: {sorted(want.keys() ^ got.keys())[:4]}"
    bad = []
    for name, w in want.items():
        g = got[name]
        if g.dtype != w.dtype or g.shape != w.shape or g.device != w.device:
            bad.append(f"{name}: {g.dtype} {tuple(g.shape)} {g.device}, saved "
                       f"{w.dtype} {tuple(w.shape)} {w.device}")
        elif not torch.equal(g.detach().reshape(-1).view(torch.uint8),
                             w.reshape(-1).view(torch.uint8)):
            bad.append(f"{name}: bytes differ")
        elif same_storage and name != "gen" and g.data_ptr() != ref["ptrs"][name]:
            bad.append(f"{name}: not restored in place")
    return not bad, "; ".join(bad[:3]) + (f" (+{len(bad) - 3})" if len(bad) > 3 else "")


def reference(torch: Any, model: Any, opt: Any, gen: Any, extra: dict[str, Any],
              dev: Any) -> dict[str, Any]:
    """Clones of the state at a save, and where its tensors live."""
    sync(torch, dev)
    state = state_of(model, opt, gen, extra)
    return {"tensors": {k: v.detach().clone() for k, v in flat(state)},
            "ptrs": {k: v.data_ptr() for k, v in flat(state)},
            "cuda_rng": torch.cuda.get_rng_state_all() if dev.type == "cuda" else None}


def part_checkpoint(rep: Report, device: str, nbytes: int, rounds: int,
                    deadline: float) -> None:
    import torch

    from spotnb.train import runtime as spot

    if device == "cuda" and not torch.cuda.is_available():
        rep.skip("checkpoints of CUDA state", "no CUDA")
        return
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else \
        torch.device("cpu")
    cuda = dev.type == "cuda"
    base = os.environ.get("BENCH_DIR") or os.getcwd()
    work = tempfile.mkdtemp(prefix="spotnb-bench-gpu-", dir=base)
    os.chdir(work)
    for key in [k for k in os.environ if k.startswith("SPOTNB_")]:
        del os.environ[key]
    try:
        _checkpoint_cases(rep, torch, spot, dev, cuda, nbytes, rounds, deadline, work)
    finally:
        spot._finish()
        os.chdir(base)
        shutil.rmtree(work, ignore_errors=True)


def _checkpoint_cases(rep: Report, torch: Any, spot: Any, dev: Any, cuda: bool,
                      nbytes: int, rounds: int, deadline: float, work: str) -> None:
    from spotnb.ckpt import checksum

    model, opt = build(torch, nbytes, dev, seed=0)
    train(torch, model, opt, 2, dev)  # AdamW's state exists
    gen = torch.Generator(device=dev)
    gen.manual_seed(7)
    extra: dict[str, Any] = {"epoch": 3, "ema": torch.randn(1000, device=dev)}
    state = sum(t.numel() * t.element_size() for _, t in flat(state_of(model, opt, gen,
                                                                        extra)))
    counted = pinned_in_rss(torch) if cuda else True
    rep.figures.update(bytes=state, device=str(dev), checksum=checksum.DEFAULT_ALGORITHM,
                       tensors=len(list(flat(state_of(model, opt, gen, extra)))))
    print(f"  state {state / GiB:.2f} GiB on {dev}: {rep.figures['tensors']} tensors "
          f"(embedding {model.emb.weight.shape[0]} x {model.emb.weight.shape[1]}, "
          f"{len(model.blocks)} MLP blocks, AdamW); checksums "
          f"{checksum.DEFAULT_ALGORITHM}; work dir {work} ({_fs(work)})", flush=True)
    whole = state * 2  # a budget the state fits in
    made: list[Any] = []  # the Checkpoint spot_save() made

    def new(budget: int) -> Callable[[], Any]:
        return functools.partial(spot.Checkpoint, model=model, optimizer=opt, gen=gen,
                                 extra=extra, host_memory=budget)
    runs: dict[str, list[tuple[float, float, int]]] = {}
    restores: dict[str, list[float]] = {}
    step = [0]

    def record(name: str, stall: float, durable: float, host: int) -> None:
        runs.setdefault(name, []).append((stall, durable, host))
        print(f"    {name}: stall {stall:.3f} s, durable {durable:.3f} s, "
              f"host +{mib(host)}", flush=True)

    def torch_save(fsync: bool) -> tuple[float, float]:
        path = os.path.join(work, "torch.pt")
        sync(torch, dev)
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        took = time.perf_counter() - t0
        os.unlink(path)
        return took, took

    def torch_load() -> float:
        """The baseline of a restore: torch.load to the GPU from the page cache (the
        file written and synced first, untimed), loaded into the same objects."""
        path = os.path.join(work, "load.pt")
        step_device = next((st["step"].device for st in opt.state.values() if "step" in st),
                           dev)
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
        sync(torch, dev)
        t0 = time.perf_counter()
        loaded = torch.load(path, map_location=dev)
        for st in loaded["optimizer"]["state"].values():
            if "step" in st:  # where the optimizer keeps it (map_location moved it)
                st["step"] = st["step"].to(step_device)
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        sync(torch, dev)
        took = time.perf_counter() - t0
        del loaded
        os.unlink(path)
        return took

    def spot_save(ckpt: Any, allocs: list[int] | None = None
                  ) -> tuple[float, float, dict[str, Any]]:
        """save(); two training steps while it uploads; wait(). The reference is the
        state at the save. ``allocs``: gets the pinned blocks torch allocated during
        save() (the training steps after it allocate their own). ``ckpt``: a
        Checkpoint, or a function that makes one: then the stall counts from it
        (``Checkpoint()`` starts allocating the buffers in the background, and a CUDA
        call of the training thread can wait for that: the loop's time either way)."""
        step[0] += 1
        ref = reference(torch, model, opt, gen, extra, dev)
        before = _host_allocs(torch)
        t0 = time.perf_counter()
        if callable(ckpt):
            ckpt = ckpt()
            made[:] = [ckpt]
        ckpt.save(step[0])
        stall = time.perf_counter() - t0
        if allocs is not None:
            allocs[:] = [_host_allocs(torch) - before]
        train(torch, model, opt, 2, dev)  # training goes on, changing every tensor
        sync(torch, dev)
        manifest = ckpt.wait()
        durable = time.perf_counter() - t0
        if manifest is None:
            raise RuntimeError(f"the save of step {step[0]} failed (see the log above)")
        return stall, durable, ref

    def restore_check(name: str, ref: dict[str, Any], timed: bool) -> None:
        """restore() into the same objects (changed since the save): byte-exact, in
        place, the RNG states back."""
        spot._finish()
        ckpt = spot.Checkpoint(model=model, optimizer=opt, gen=gen, extra=extra,
                               host_memory=whole)
        ckpt._saves.pool.wait_warm()  # its background allocation is not the restore's
        if cuda:
            torch.cuda.set_rng_state_all([torch.zeros_like(s) for s in ref["cuda_rng"]])
        os.sync()
        sync(torch, dev)
        t0 = time.perf_counter()
        got = ckpt.restore()
        sync(torch, dev)
        took = time.perf_counter() - t0
        ok, why = compare(torch, ref, state_of(model, opt, gen, extra), same_storage=True)
        rep.check(f"{name}: restore() byte-exact, in place, on {dev}",
                  ok and got == step[0] + 1, why or f"continues at step {got}")
        if cuda:
            rng = torch.cuda.get_rng_state_all()
            rep.check(f"{name}: CUDA RNG state restored",
                      all(torch.equal(a, b) for a, b in zip(rng, ref["cuda_rng"],
                                                            strict=True)))
        ckpt._saves.pool.wait_warm()
        del ckpt
        spot._finish()
        if timed:
            base = torch_load()
            restores.setdefault("restore()", []).append(took)
            restores.setdefault("torch.load + load_state_dict", []).append(base)
            print(f"    restore() {took:.3f} s, torch.load(map_location={dev}) + "
                  f"load_state_dict {base:.3f} s", flush=True)

    def buffers(ckpt: Any) -> dict[Any, tuple[int, bool, bool]]:
        """{key: (address, page-locked, its tensor is on a GPU)} of the pool's buffers."""
        from spotnb.ckpt import snapshot

        on_gpu = {key: bool(t.is_cuda) for key, _, t in snapshot.tensor_specs(ckpt._objects)}
        return {k: (b.data_ptr(), bool(b.is_pinned()) if cuda else False, on_gpu.get(k, False))
                for k, b in ckpt._saves.pool._bufs.items()}

    # First-use costs (imports, the writer's threads) outside every case.
    spot.Checkpoint(x=torch.zeros(1, device=dev)).save(0)
    spot._finish()
    baseline = step_times(torch, model, opt, dev, 10)
    started = time.monotonic()
    for rnd in range(rounds):
        if rnd and time.time() + (time.monotonic() - started) / rnd > deadline:
            print(f"  (round {rnd + 1} left out: it would end after the deadline)")
            break
        print(f"  round {rnd + 1}", flush=True)
        for name, fsync in (("torch.save", False), ("torch.save + fsync", True)):
            start = reset_peak(torch)
            stall, durable = torch_save(fsync)
            record(name, stall, durable, extra_host(torch, start, counted))

        # Cold: the first save right after Checkpoint(), which starts allocating its
        # buffers in the background; then the steady state (the buffers reused).
        start = reset_peak(torch)
        stall, durable, ref = spot_save(new(whole))
        ckpt = made.pop()
        record("spotnb, Checkpoint() + first save", stall, durable,
               extra_host(torch, start, counted))
        held = ckpt._saves.pool.held
        bufs = buffers(ckpt)
        allocs: list[int] = []
        start = reset_peak(torch)
        stall, durable, ref = spot_save(ckpt, allocs)
        record("spotnb, steady state", stall, durable, extra_host(torch, start, counted))
        again = buffers(ckpt)
        of_gpu = [p for _, p, g in again.values() if g]
        rep.check("steady save reuses the same buffers, page-locked for GPU tensors",
                  bufs == again and all(of_gpu) and ckpt._saves.pool.held == held
                  and allocs[0] == 0,
                  f"{len(again)} buffers ({len(of_gpu)} of GPU tensors, page-locked: "
                  f"{sum(of_gpu)}), {mib(held)} held, same addresses: {bufs == again}, "
                  f"pinned blocks torch allocated during save(): {allocs[0]}")
        if cuda and rnd == 0:
            rep.figures["held"] = held
            rep.figures["pinned_allocated"] = pinned_bytes(torch)[0]
            rep.info("pinned memory of a whole-state copy",
                     f"pool holds {mib(held)} of buffers for {mib(state)} of state; "
                     f"torch's pinned allocator holds {mib(pinned_bytes(torch)[0])}")
        del ckpt
        spot._finish()
        restore_check("whole copy", ref, timed=True)

        # The buffers allocated in the background while training runs (what
        # Checkpoint() and a maybe_save that does not save do), then a save.
        start = reset_peak(torch)
        ckpt = spot.Checkpoint(model=model, optimizer=opt, gen=gen, extra=extra,
                               host_memory=whole)
        during = step_times(torch, model, opt, dev, 0,
                            until=functools.partial(_warmed, ckpt._saves.pool))
        ckpt._saves.pool.wait_warm()
        stall, durable, ref = spot_save(ckpt)
        record("spotnb, first save after warming", stall, durable,
               extra_host(torch, start, counted))
        if during:
            lost = sum(during) - len(during) * statistics.median(baseline)
            rep.figures.setdefault("steps_while_warming", []).append(
                {"steps": len(during), "seconds": sum(during), "lost_s": lost,
                 "baseline_s": statistics.median(baseline)})
            print(f"    {len(during)} training step(s) ran while the buffers were allocated "
                  f"in the background: {sum(during):.3f} s, {lost:.3f} s more than at "
                  f"{statistics.median(baseline) * 1e3:.1f} ms a step", flush=True)
        del ckpt
        spot._finish()

        # Within a budget: a quarter of the state (the rest streamed from the GPU while
        # the loop waits), and just above the state.
        for label, budget in (("budget = state / 4", state // 4),
                              ("budget = state x 1.05 + 32 MiB", int(state * 1.05) + 32 * MiB)):
            start = reset_peak(torch)
            stall, durable, ref = spot_save(new(budget))
            ckpt = made.pop()
            host = extra_host(torch, start, counted)
            record(f"spotnb, Checkpoint() + save, {label}", stall, durable, host)
            copied = ckpt._saves.pool.held
            rep.check(f"{label}: host memory within the budget", host <= budget + BUDGET_SLACK,
                      f"peak +{mib(host)} for a budget of {mib(budget)} (pool holds "
                      f"{mib(copied)} of copies; torch's pinned allocator peaked at "
                      f"+{mib(max(0, pinned_bytes(torch)[1] - start[1]))})")
            ckpt._saves.pool.wait_warm()
            del ckpt
            spot._finish()
            if rnd == 0:
                restore_check(label, ref, timed=False)

        if rnd == 0:
            fresh_restore(rep, torch, spot, nbytes, dev, ref, step[0])
    _summary(rep, runs, restores)


def fresh_restore(rep: Report, torch: Any, spot: Any, nbytes: int, dev: Any,
                  ref: dict[str, Any], step: int) -> None:
    """restore() into a fresh model (other initial values) and a fresh optimizer (no
    state yet), as a new process does: the tensors land on the objects' devices."""
    spot._finish()
    model2, opt2 = build(torch, nbytes, dev, seed=1)
    gen2 = torch.Generator(device=dev)
    extra2: dict[str, Any] = {}
    ckpt = spot.Checkpoint(model=model2, optimizer=opt2, gen=gen2, extra=extra2)
    got = ckpt.restore()
    ckpt._saves.pool.wait_warm()
    saved = {k: v for k, v in ref["tensors"].items() if k.startswith("model.")}
    ok, why = compare(torch, {"tensors": saved, "ptrs": {}}, {"model": model2.state_dict()},
                      same_storage=False)
    rep.check(f"fresh model: restore() byte-exact on {dev}", ok and got == step + 1, why)
    saved = {k: v for k, v in ref["tensors"].items() if k.startswith("optimizer.")}
    ok, why = compare(torch, {"tensors": saved, "ptrs": {}},
                      {"optimizer": opt2.state_dict()}, same_storage=False)
    devices = sorted({str(t.device) for _, t in flat(opt2.state_dict()["state"])})
    rep.check("fresh optimizer: its state byte-exact, on the devices it was saved on",
              ok, why or f"state tensors on {devices}")
    try:
        train(torch, model2, opt2, 1, dev)
        sync(torch, dev)
        trained = "a training step ran"
    except Exception as e:
        trained = f"a training step failed: {type(e).__name__}: {e}"
    rep.check("fresh model and optimizer train after the restore",
              trained == "a training step ran", trained)
    rep.check("fresh generator: its state restored",
              bool(torch.equal(gen2.get_state(), ref["tensors"]["gen"])))
    ema = extra2.get("ema")
    rep.info("a registered dict's tensor with no tensor to read into",
             f"saved on {ref['tensors']['extra.ema'].device}, restored on "
             f"{getattr(ema, 'device', None)} (no device is recorded: such tensors come "
             "back on the CPU)")
    del ckpt, model2, opt2
    spot._finish()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _warmed(pool: Any) -> bool:
    """Whether a BufferPool's background allocation is over."""
    return not any(th.is_alive() for th in pool._warming)


def _host_allocs(torch: Any) -> int:
    """Pinned blocks torch has asked CUDA for so far."""
    if not cuda_ready(torch) or not hasattr(torch.cuda, "host_memory_stats"):
        return 0
    return int(torch.cuda.host_memory_stats().get("num_host_alloc", 0))


def step_times(torch: Any, model: Any, opt: Any, dev: Any, steps: int,
               until: Callable[[], bool] | None = None) -> list[float]:
    """Seconds of each training step (synchronised): ``steps`` of them, or while
    ``until()`` is false (at most 30 s)."""
    times: list[float] = []
    end = time.monotonic() + 30
    while time.monotonic() < end:
        if (len(times) >= steps) if until is None else until():
            break
        t0 = time.perf_counter()
        train(torch, model, opt, 1, dev)
        sync(torch, dev)
        times.append(time.perf_counter() - t0)
    return times


def _fs(path: str) -> str:
    """The file system ``path`` is on (type, device), from /proc/mounts."""
    best = ("?", "?", "")
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 2 and (path + "/").startswith(fields[1].rstrip("/") + "/") \
                    and len(fields[1]) >= len(best[2]):
                best = (fields[2], fields[0], fields[1])
    free = shutil.disk_usage(path).free
    return f"{best[0]} on {best[1]}, {free / GiB:.0f} GiB free"


def _summary(rep: Report, runs: dict[str, list[tuple[float, float, int]]],
             restores: dict[str, list[float]]) -> None:
    """The table: medians, and ratios taken round by round against torch.save."""
    print(f"\n  {'case':58} {'stall s':>8} {'x torch.save':>13} {'durable s':>10} "
          f"{'x save+fsync':>13} {'host +MiB':>10}")
    table: dict[str, dict[str, Any]] = {}
    for name, rows in runs.items():
        stall_x = [r[0] / b[0] for r, b in zip(rows, runs["torch.save"], strict=False)]
        durable_x = [r[1] / b[1] for r, b in zip(rows, runs["torch.save + fsync"],
                                                 strict=False)]
        table[name] = {"stall": statistics.median(r[0] for r in rows),
                       "durable": statistics.median(r[1] for r in rows),
                       "stall_x": statistics.median(stall_x),
                       "stall_x_range": [min(stall_x), max(stall_x)],
                       "durable_x": statistics.median(durable_x),
                       "durable_x_range": [min(durable_x), max(durable_x)],
                       "host": max(r[2] for r in rows), "rounds": len(rows)}
        t = table[name]
        print(f"  {name:58} {t['stall']:8.3f} {t['stall_x']:6.2f} ({t['stall_x_range'][0]:.2f}-"
              f"{t['stall_x_range'][1]:.2f}) {t['durable']:10.3f} {t['durable_x']:6.2f} "
              f"({t['durable_x_range'][0]:.2f}-{t['durable_x_range'][1]:.2f}) "
              f"{t['host'] / MiB:10.0f}", flush=True)
    rep.figures["cases"] = table
    if restores:
        mine, theirs = restores["restore()"], restores["torch.load + load_state_dict"]
        x = [a / b for a, b in zip(mine, theirs, strict=True)]
        rep.figures["restore"] = {"restore": statistics.median(mine),
                                  "torch_load": statistics.median(theirs),
                                  "x": statistics.median(x), "x_range": [min(x), max(x)]}
        print(f"  restore() {statistics.median(mine):.3f} s, torch.load + load_state_dict "
              f"{statistics.median(theirs):.3f} s: x {statistics.median(x):.2f} "
              f"({min(x):.2f}-{max(x):.2f})", flush=True)


# -- the driver ----------------------------------------------------------------------


def environment(device: str) -> dict[str, Any]:
    """What the run is on (imports torch, never initialises CUDA: the sampler part
    must see this GPU with no other process's context on it)."""
    import platform

    import psutil

    env: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count(),
                           "ram_GiB": round(psutil.virtual_memory().total / GiB, 1)}
    try:
        import torch

        env.update(torch=torch.__version__, cuda=torch.version.cuda,
                   cuda_available=torch.cuda.is_available())
    except ImportError:
        env["torch"] = None
    with contextlib.suppress(ImportError):
        import pynvml

        env["nvidia_ml_py"] = getattr(pynvml, "__version__", "present")
    with contextlib.suppress(ImportError):
        import crc32c  # noqa: F401

        env["crc32c"] = True
    from spotnb._version import __version__

    env["spotnb"] = __version__
    env["uptime_load"] = os.getloadavg()
    return env


def child(args: argparse.Namespace) -> int:
    rep = Report()
    part = args.part
    try:
        if part == "sampler":
            part_sampler(rep, args.device)
        elif part == "pinned":
            part_pinned(rep, args.device)
        else:
            part_checkpoint(rep, args.device, int(part.split(":")[1]), args.rounds,
                            args.deadline_at)
    finally:
        Path(args.result).write_text(json.dumps({"checks": rep.checks,
                                                 "figures": rep.figures}, default=str))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256MB,2GB",
                    help="checkpointed state sizes, comma-separated (default 256MB,2GB)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per size, at most")
    ap.add_argument("--deadline", type=float, default=330,
                    help="seconds for the whole run: later rounds left out past it")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--json", help="write every check and figure here")
    ap.add_argument("--part", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.part:
        return child(args)
    deadline_at = time.time() + args.deadline
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    env = environment(args.device)
    print("environment: " + ", ".join(f"{k} {v}" for k, v in env.items()), flush=True)
    if args.device == "cuda" and not env.get("cuda_available"):
        print("no CUDA device here: every GPU check fails (run with --device cpu to test "
              "this script's CPU paths)", flush=True)
    results: dict[str, Any] = {"environment": env, "parts": {}}
    status = 0
    parts = ["sampler", "pinned", *(f"checkpoint:{n}" for n in sizes)]
    for i, part in enumerate(parts):
        title = part if ":" not in part else f"checkpoint of {int(part[11:]) / GiB:.2f} GiB"
        print(f"\n== {title}", flush=True)
        # A size's later rounds run within its share of the time left (by bytes, at
        # least a quarter): a smaller state must not take a larger one's time.
        later = [int(p.split(":")[1]) for p in parts[i:] if ":" in p]
        share = 1.0 if len(later) <= 1 else max(0.25, later[0] / sum(later))
        part_deadline = time.time() + share * max(0.0, deadline_at - time.time())
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result = f.name
        # A part's own process: its peak memory and its GPU context are its own.
        left = max(30.0, deadline_at - time.time() + 60)
        cmd = [sys.executable, __file__, "--part", part, "--result", result,
               "--device", args.device, "--rounds", str(args.rounds),
               "--deadline-at", str(part_deadline)]
        try:
            rc = subprocess.run(cmd, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = -1
            print(f"  [FAIL] {title}: still running after {left:.0f} s; stopped")
        try:
            out = json.loads(Path(result).read_text() or "{}")
        except (OSError, ValueError):
            out = {}
        finally:
            with contextlib.suppress(OSError):
                os.unlink(result)
        out["returncode"] = rc
        results["parts"][part] = out
        if rc != 0:
            print(f"  [FAIL] {title}: its process ended with status {rc}", flush=True)
            status = 2
        elif any(c["status"] == "FAIL" for c in out.get("checks", [])):
            status = max(status, 1)
    counts: dict[str, int] = {}
    for out in results["parts"].values():
        for c in out.get("checks", []):
            counts[c["status"]] = counts.get(c["status"], 0) + 1
    print("\nchecks: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    for part, out in results["parts"].items():
        for c in out.get("checks", []):
            if c["status"] == "FAIL":
                print(f"  FAIL [{part}] {c['name']}: {c['detail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
