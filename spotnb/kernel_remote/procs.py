"""The agent's process family: everything a cell starts ends with the attempt."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time

import psutil

log = logging.getLogger(__name__)


def become_subreaper() -> None:
    """Make orphans of the kernel's descendants (a double fork, a daemon) this
    process's children rather than init's, so the end of the agent can end them."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        log.debug("cannot become a child subreaper", exc_info=True)


def sweep_descendants() -> None:
    """SIGKILL every process this agent started, however it detached (new session,
    double fork: as a subreaper they stay below us), so none outlives the attempt."""
    try:
        family = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for proc in family:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(family, timeout=5)


def process_started() -> float | None:
    """When this process started (epoch seconds, to 10 ms), for the resume benchmark.

    From ``/proc/self/stat`` against the boot clock: psutil's ``create_time`` counts
    from the boot time in whole seconds, up to a second off.
    """
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks = int(fields[19])  # starttime, field 22 of proc(5), in clock ticks
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None
