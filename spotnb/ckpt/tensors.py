"""What a checkpoint asks of the training state's tensors, torch never imported here.

A state without tensors needs no torch (it is pickled whole), so the capture takes
torch from the user's code (:func:`user_torch`) and passes it on.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["nbytes", "streamable", "synchronize", "user_torch"]


def user_torch() -> Any:
    """The torch module if the user's code imported it (never imported here)."""
    return sys.modules.get("torch")


def nbytes(t: Any) -> int:
    """Bytes of a tensor's elements."""
    return int(t.numel()) * int(t.element_size())


def streamable(torch: Any, t: Any) -> bool:
    """Whether a tensor is written as raw bytes (dense); others stay in the state."""
    return bool(t.layout == torch.strided and not t.is_quantized and not t.is_nested
                and t.device.type != "meta")


def synchronize(torch: Any, tensors: Iterable[Any]) -> None:
    """Wait for the asynchronous copies out of ``tensors``: on every GPU one is on
    (``torch.cuda.synchronize()`` alone waits for the current GPU's, and a model split
    over several GPUs copies from each)."""
    devices = {t.device for t in tensors if getattr(t, "is_cuda", False)}
    for device in devices or (None,):
        torch.cuda.synchronize(device)
