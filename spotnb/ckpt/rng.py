"""The global random number generators, captured with every checkpoint and restored
with it: Python's ``random``, NumPy's legacy global RNG (if NumPy can be imported),
torch's CPU and CUDA generators (if the user's code imported torch).
"""

from __future__ import annotations

import logging
import random
import sys
from typing import Any

from spotnb.ckpt.tensors import user_torch

log = logging.getLogger(__name__)

__all__ = ["capture_rng", "restore_rng"]


def _numpy() -> Any:
    """NumPy if it can be imported (its global RNG is part of the state)."""
    np = sys.modules.get("numpy")
    if np is None:
        try:
            import numpy as np
        except ImportError:
            return None
    return np


def capture_rng() -> dict[str, Any]:
    """The global RNG states: Python, NumPy (if importable), torch CPU and CUDA."""
    states: dict[str, Any] = {"python": random.getstate()}
    np = _numpy()
    if np is not None:
        states["numpy"] = np.random.get_state()
    torch = user_torch()
    if torch is not None:
        states["torch"] = torch.get_rng_state()
        # Only if CUDA is in use: asking for its state would initialise it.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng(states: dict[str, Any]) -> None:
    """Set the global RNGs from :func:`capture_rng`'s result."""
    if "python" in states:
        random.setstate(states["python"])
    if "numpy" in states:
        np = _numpy()
        if np is not None:
            np.random.set_state(states["numpy"])
    if "torch" in states or "cuda" in states:
        import torch

        if "torch" in states:
            torch.set_rng_state(states["torch"])
        if "cuda" in states:
            if torch.cuda.is_available() and torch.cuda.device_count() == len(states["cuda"]):
                torch.cuda.set_rng_state_all(states["cuda"])
            else:
                log.warning("the checkpoint has CUDA RNG states for %d GPU(s) but %d are "
                            "visible; CUDA random numbers will differ from an "
                            "uninterrupted run", len(states["cuda"]),
                            torch.cuda.device_count() if torch.cuda.is_available() else 0)
