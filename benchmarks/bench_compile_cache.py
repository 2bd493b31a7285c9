"""torch.compile from restore to the first step: cold against the job's compile cache.

Each attempt of a job is a fresh process on a fresh instance: without the job's cache
its first step compiles from nothing; with it (``spotnb.ckpt.compile_cache``: the
caches packed after a save, unpacked by the next attempt's agent or a standby before
the cell runs) the compile loads what the first attempt built. Measured here as an
attempt is: a fresh interpreter whose Inductor and Triton caches are empty (cold) or
were unpacked from the package a previous attempt uploaded (cached), timing from the
end of the restore (the model compiled lazily, its state loaded) to the end of its
first optimizer step. Cold and cached runs alternate, in the same run, side by side.

    python benchmarks/bench_compile_cache.py [--rounds 2] [--width 512] [--layers 4]
        [--device cpu|cuda]

On a GPU (``--device cuda``) the compile builds Triton kernels; on CPU, C++ ones.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spotnb.ckpt import compile_cache

ATTEMPT = textwrap.dedent("""
    import json, sys, time
    import torch

    width, layers, device, state_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.attn = torch.nn.MultiheadAttention(width, 8, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                           torch.nn.Linear(4 * width, width))

        def forward(self, x):
            h = self.norm(x)
            x = x + self.attn(h, h, h, need_weights=False)[0]
            return x + self.mlp(self.norm(x))

    model = torch.nn.Sequential(*[Block() for _ in range(layers)]).to(device)
    if len(sys.argv) > 5:  # the state every attempt restores
        torch.save(model.state_dict(), state_path)
        print(json.dumps({"parameters": sum(p.numel() for p in model.parameters())}))
        sys.exit(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = torch.compile(model)
    model.load_state_dict(torch.load(state_path))  # the restore
    restored = time.perf_counter()
    x = torch.randn(8, 64, width, device=device)
    loss = compiled(x).square().mean()
    loss.backward()
    opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"first_step_seconds": time.perf_counter() - restored}))
""")


def attempt(args: argparse.Namespace, cache: Path, state: Path, *extra: str) -> dict[str, float]:
    """A fresh interpreter with its caches under ``cache`` (empty, or unpacked)."""
    env = {k: v for k, v in os.environ.items() if k not in compile_cache.CACHE_ENV}
    env.update(compile_cache.cache_env(cache, env))
    out = subprocess.run([sys.executable, "-c", ATTEMPT, str(args.width), str(args.layers),
                          args.device, str(state), *extra],
                         env=env, capture_output=True, text=True, check=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench-compile-"))
    try:
        state = work / "state.pt"
        parameters = attempt(args, work / "unused", state, "save")["parameters"]
        # The first attempt compiles cold and its cache is packed, as after its save.
        first = work / "first"
        cold_first = attempt(args, first, state)["first_step_seconds"]
        package = compile_cache.pack(compile_cache.cache_dirs(first, {}))
        cold, cached = [cold_first], []
        for n in range(args.rounds):
            fresh = work / f"cold-{n}"
            cold.append(attempt(args, fresh, state)["first_step_seconds"])
            warm = work / f"cached-{n}"
            compile_cache.unpack(package, compile_cache.cache_dirs(warm, {}))
            cached.append(attempt(args, warm, state)["first_step_seconds"])
        c, h = statistics.median(cold), statistics.median(cached)
        print(f"model: {args.layers} transformer blocks of width {args.width} "
              f"({parameters / 1e6:.1f}M parameters), device {args.device}, "
              f"torch {torch.__version__}")
        print(f"compile cache package: {len(package) / 1e6:.1f} MB")
        print(f"{'':28}{'cold':>10}{'cached':>10}")
        print(f"{'restore -> first step (s)':28}{c:>10.2f}{h:>10.2f}   "
              f"(runs: cold {', '.join(f'{v:.1f}' for v in cold)}; "
              f"cached {', '.join(f'{v:.1f}' for v in cached)})")
        print(f"ratio cold / cached: {c / h:.1f}x")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
