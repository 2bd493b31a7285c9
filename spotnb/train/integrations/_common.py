"""What the integrations share: turning a framework's logs and hyperparameters into
``spot.log`` rows and ``spot.log_params`` values."""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from spotnb.train import process

#: Nested hyperparameters (a model config inside the hparams) are flattened this deep.
_FLATTEN_DEPTH = 3


def numeric(values: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a framework's log dict that ``spot.log`` keeps: numbers and
    one-element tensors (converted later, off the training thread)."""
    kept: dict[str, Any] = {}
    for name, value in values.items():
        if isinstance(value, bool):
            continue
        if isinstance(value, numbers.Number) or (hasattr(value, "numel")
                                                 and value.numel() == 1):
            kept[str(name)] = value
    return kept


def flatten(params: Mapping[str, Any], prefix: str = "", depth: int = 0) -> dict[str, Any]:
    """``{"model": {"lr": 1}}`` -> ``{"model.lr": 1}`` (a few levels deep)."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and depth < _FLATTEN_DEPTH:
            flat.update(flatten(value, f"{name}.", depth + 1))
        else:
            flat[name] = value
    return flat


def log_params(params: Mapping[str, Any], source: str) -> None:
    """Hyperparameters to the job's record (flattened)."""
    process.log_params(flatten(params), source=source)
