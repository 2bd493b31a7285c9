"""Will the final checkpoint be durable within the interruption notice?

After a spot interruption notice (two minutes on EC2) the job saves once more and
parks; a checkpoint that is not durable by termination is lost, and the replacement
redoes every step since the one before. :class:`NoticeFit` compares the time a save
of the state takes to become durable with :data:`NOTICE_SHARE` of the notice period.

Two moments, two sources of figures (neither is certain before the job runs):

* at submit time, :func:`input_state_bytes` sums the tensors of the cell's captured
  inputs (model weights and buffers, optimizer state if it exists yet): a lower bound
  of the state, since the cell may create more (an optimizer, a bigger model). The
  bandwidth is the provider's figure (:meth:`spotnb.providers.Provider.upload_mbps`);
* after the first save of a job, the runtime knows the real size and the measured
  time to durable, and warns once (an event the notebook shows) if it does not fit.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["EC2_NOTICE_SECONDS", "NOTICE_SHARE", "NoticeFit", "input_state_bytes"]

#: EC2's spot interruption notice: two minutes before termination.
EC2_NOTICE_SECONDS = 120.0
#: The final save must be durable within this share of the notice. The notice lands
#: during a training step (which must end before the save starts), and a periodic
#: save may still be uploading and share the link with the final one.
NOTICE_SHARE = 0.5
# How deep input_state_bytes looks into containers (dicts of models, lists of them).
_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class NoticeFit:
    """How long a final save of ``state_bytes`` takes against the notice period.

    ``seconds``: the time to durable (measured, or ``state_bytes`` over ``mbps``).
    """

    state_bytes: int
    seconds: float
    notice_seconds: float
    measured: bool = False

    @classmethod
    def at_rate(cls, state_bytes: int, mbps: float, notice_seconds: float) -> NoticeFit:
        """An estimate: the bytes over a bandwidth of ``mbps`` MB/s."""
        return cls(state_bytes, state_bytes / (mbps * 1e6), notice_seconds)

    @property
    def mbps(self) -> float:
        return self.state_bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def fits(self) -> bool:
        return self.seconds <= NOTICE_SHARE * self.notice_seconds

    def advice(self) -> str:
        """What happens and what to do, in one paragraph (for a warning)."""
        what = ("took" if self.measured else "would take about")
        size = (f"{self.state_bytes / 1e9:.1f} GB" if self.state_bytes >= 1e8
                else f"{self.state_bytes / 1e6:.0f} MB")
        return (
            f"a checkpoint of {size} {what} {self.seconds:.0f} s to become durable "
            f"({self.mbps:.0f} MB/s), more than {NOTICE_SHARE:.0%} of the "
            f"{self.notice_seconds:.0f} s interruption notice: after a notice the final "
            "checkpoint may not be durable before the instance is terminated, and the "
            "steps since the checkpoint before it would be redone. Save more often "
            "(--checkpoint-every) so that less is redone, shard the state across nodes, "
            "or checkpoint a smaller state (bf16 weights, a lighter optimizer, adapters "
            "instead of a full fine-tune)."
        )


def input_state_bytes(values: Iterable[Any]) -> int:
    """Bytes of the tensors (and arrays) the captured inputs hold; a lower bound.

    Counts modules' parameters and buffers, optimizers' state, tensors and NumPy
    arrays, inside dicts, lists and tuples too; each tensor once.
    """
    seen: set[int] = set()
    total = 0
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")

    def add(t: Any) -> None:
        nonlocal total
        if id(t) not in seen:
            seen.add(id(t))
            total += int(t.numel()) * int(t.element_size())

    def walk(x: Any, depth: int) -> None:
        nonlocal total
        if depth > _MAX_DEPTH:
            return
        if torch is not None:
            if isinstance(x, torch.Tensor):
                add(x)
                return
            if isinstance(x, torch.nn.Module):
                for t in (*x.parameters(), *x.buffers()):
                    add(t)
                return
            if isinstance(x, torch.optim.Optimizer):
                for per_param in x.state.values():
                    walk(per_param, depth + 1)
                return
        if np is not None and isinstance(x, np.ndarray):
            if id(x) not in seen:
                seen.add(id(x))
                total += int(x.nbytes)
            return
        if isinstance(x, dict):
            for v in x.values():
                walk(v, depth + 1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v, depth + 1)

    for value in values:
        walk(value, 0)
    return total
