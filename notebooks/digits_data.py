"""Data and model for the quickstart notebook.

This file sits next to the notebook. A ``%%spot_train`` cell that imports it gets it
shipped to the instance with the cell, so ``import digits_data`` works there too.
The data are scikit-learn's 8x8 handwritten digits, which ship inside the package:
nothing to download.
"""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split


def load(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train and test tensors: ``X_train, X_test, y_train, y_test`` (pixels in 0..1)."""
    X, y = load_digits(return_X_y=True)
    X_train, X_test, y_train, y_test = train_test_split(
        X / 16.0, y, test_size=0.25, random_state=seed, stratify=y)
    return (torch.tensor(X_train, dtype=torch.float32), torch.tensor(X_test, dtype=torch.float32),
            torch.tensor(y_train), torch.tensor(y_test))


def mlp(hidden: int = 64) -> torch.nn.Module:
    """A small multi-layer perceptron for 8x8 images and 10 classes."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))
