"""Helpers shared by the framework notebooks (``transformers.ipynb``, ``lightning.ipynb``,
``accelerate.ipynb``). Shipped with the ``%%spot_train`` cells that import it.

Two kinds of help:

* data and checks: random token sequences for a tiny GPT-2 (nothing to download),
  and a digest of a model's weights, to compare an interrupted run with an
  uninterrupted one bit for bit;
* :func:`interrupt_at`, for these demos only: it asks the local cloud to interrupt the
  instance at a given step of a given attempt (as ``%spot_interrupt`` would) and
  waits for the notice, so that the interruptions land at the same steps on a fast
  machine and on a busy one. Real notices come when the cloud wants its capacity back.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Mapping
from typing import Any

from spotnb import runtime as spot

# How long a step waits for the notice it asked for; the local cloud sends it within
# a second or so (its supervisor's tick, then the agent's IMDS poll).
NOTICE_WAIT_SECONDS = 300.0
_POLL_SECONDS = 0.05


def interrupt_at(step: int, at: Mapping[int, int]) -> None:
    """On attempt ``a``, once step ``at[a]`` is done: interrupt this instance (local
    cloud) and wait for the notice, which makes the step's save the last one."""
    if at.get(spot.attempt) != step or spot.interrupt_pending:
        return
    import spotnb

    print(f"[demo] attempt {spot.attempt}: interrupting the instance after step {step}")
    spotnb.attach(spot.job_id).interrupt()
    deadline = time.monotonic() + NOTICE_WAIT_SECONDS
    while not spot.interrupt_pending:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no interruption notice within {NOTICE_WAIT_SECONDS:.0f} s; "
                               "interrupt_at works on the local cloud only")
        time.sleep(_POLL_SECONDS)


def transformers_interrupt(at: Mapping[int, int]) -> Any:
    """:func:`interrupt_at` as a ``TrainerCallback`` (put it before spotnb's)."""
    from transformers import TrainerCallback

    class InterruptAt(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            interrupt_at(state.global_step, at)

    return InterruptAt()


def lightning_interrupt(at: Mapping[int, int]) -> Any:
    """:func:`interrupt_at` as a Lightning ``Callback``."""
    import lightning.pytorch as pl

    class InterruptAt(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            interrupt_at(trainer.global_step, at)

    return InterruptAt()


def random_tokens(count: int, length: int, vocab: int, seed: int) -> list[dict[str, Any]]:
    """``count`` random token sequences as a causal-LM dataset (labels = inputs)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (count, length), generator=gen)
    return [{"input_ids": row, "labels": row} for row in ids]


def digest(model: Any) -> str:
    """SHA-256 of a model's weights, in order (equal digests: bitwise equal weights)."""
    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_steps(optimizer: Any) -> int:
    """How many times the optimizer stepped, by its own count (Adam's ``step`` state)."""
    for state in getattr(optimizer, "state", {}).values():
        if "step" in state:
            return int(state["step"])
    raise ValueError(f"{type(optimizer).__name__} keeps no step count")


def same(result: Mapping[str, Any], reference: Mapping[str, Any]) -> None:
    """Print the interrupted run against the uninterrupted one, field by field."""
    for key in result:
        verdict = "same" if result[key] == reference.get(key) else "DIFFERENT"
        print(f"{key:16} spot {result[key]!s:18} uninterrupted {reference.get(key)!s:18} "
              f"{verdict}")
