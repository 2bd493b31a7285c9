"""The errors of writing and reading checkpoints (:mod:`spotnb.ckpt.checkpoints`)."""

from __future__ import annotations

__all__ = ["CheckpointError", "CorruptCheckpoint", "FencedOff"]


class CheckpointError(Exception):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint file is missing, or its size or checksum differs from the manifest."""


class FencedOff(CheckpointError):
    """This writer lost the lease: ``LATEST`` was not moved."""

