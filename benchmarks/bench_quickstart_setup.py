"""The quickstart's cold set-up: what `scripts/quickstart.sh` installs now, against what
it installed before (the whole development toolchain), side by side in one run.

Run by hand: ``python benchmarks/bench_quickstart_setup.py [ROUNDS]`` (default 3). Each
round copies the repository's tracked files into two fresh directories and, in turn:

* A (now): ``bash scripts/setup.sh quickstart``: a new ``.venv``, then spotnb with the
  extras the quickstart notebook uses (torch, widgets, examples);
* B (before, the baseline): what ``scripts/setup.sh`` ran for the quickstart until
  then: a new ``.venv``, ``pip install --upgrade pip``, then
  ``pip install -c constraints.txt -e '.[dev,torch,widgets]'`` (the system package it
  also asked for, Chromium, is left out: where it is missing that step alone took
  minutes, and a dpkg lock held elsewhere could fail it).

Both use this machine's pip cache and the same package index, as a user's second
machine would; "cold" is a new virtual environment. It prints each round's wall and
CPU seconds (children's user + system) and the medians, and the ratio A/B pair by pair.
"""

from __future__ import annotations

import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE = ("python3 -m venv .venv && .venv/bin/python -m pip install -q --upgrade pip && "
          ".venv/bin/python -m pip install -q -c constraints.txt -e '.[dev,torch,widgets]'")
NOW = "bash scripts/setup.sh quickstart"


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)


def _timed(command: str, cwd: Path) -> tuple[float, float]:
    """Wall and CPU seconds of one cold set-up."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    subprocess.run(["bash", "-c", command], cwd=cwd, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(rounds: int = 3) -> None:
    rows: list[tuple[float, float, float, float]] = []
    for i in range(rounds):
        with tempfile.TemporaryDirectory(prefix="spotnb-qs-") as tmp:
            now, before = Path(tmp, "now"), Path(tmp, "before")
            _copy_tree(now)
            _copy_tree(before)
            a = _timed(NOW, now)
            b = _timed(BEFORE, before)
        rows.append((*a, *b))
        print(f"round {i + 1}: now {a[0]:6.1f} s wall {a[1]:6.1f} s cpu | "
              f"before {b[0]:6.1f} s wall {b[1]:6.1f} s cpu | wall ratio {a[0] / b[0]:.2f}",
              flush=True)
    med = [statistics.median(col) for col in zip(*rows, strict=True)]
    ratios = [r[0] / r[2] for r in rows]
    print(f"\nmedian: now {med[0]:.1f} s wall ({med[1]:.1f} s cpu), before {med[2]:.1f} s "
          f"wall ({med[3]:.1f} s cpu); now/before wall {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
