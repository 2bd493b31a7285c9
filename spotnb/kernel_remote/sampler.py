"""Utilisation samples, once a second: GPUs through NVML, otherwise CPU and RAM.

Each sample is a dict for a ``sys`` event: ``kind`` says which ("gpu" or "cpu") so a
plot can label its axis honestly on instances without a GPU.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

SAMPLE_SECONDS = 1.0


def _nvml() -> Any | None:
    """The initialised ``pynvml`` module when a GPU is present, else None."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:  # no driver, no device: a CPU instance
        return None
    return pynvml


class Sampler:
    """Calls ``emit(sample)`` every ``interval`` seconds on a daemon thread."""

    def __init__(self, emit: Callable[[dict[str, Any]], None],
                 interval: float = SAMPLE_SECONDS) -> None:
        self.emit = emit
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        nvml = _nvml()
        import psutil

        psutil.cpu_percent(None)  # the first call only sets the baseline
        while not self._stop.wait(self.interval):
            try:
                self.emit(self._gpu(nvml) if nvml is not None else self._cpu(psutil))
            except Exception:
                log.debug("sampling failed", exc_info=True)

    @staticmethod
    def _cpu(psutil: Any) -> dict[str, Any]:
        mem = psutil.virtual_memory()
        return {"kind": "cpu", "util": psutil.cpu_percent(None),
                "mem_used": mem.total - mem.available, "mem_total": mem.total}

    @staticmethod
    def _gpu(nvml: Any) -> dict[str, Any]:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append({"index": i, "util": util.gpu, "mem_used": mem.used,
                         "mem_total": mem.total})
        return {"kind": "gpu",
                "util": sum(g["util"] for g in gpus) / len(gpus),
                "mem_used": sum(g["mem_used"] for g in gpus),
                "mem_total": sum(g["mem_total"] for g in gpus),
                "gpus": gpus}
