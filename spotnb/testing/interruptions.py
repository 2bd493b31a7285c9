"""EC2's spot interruptions and rebalance recommendations as the simulator delivers
them (a part of :class:`~spotnb.testing.AwsSimulator`): the notice in the instance's
metadata and its termination after the notice period (the simulator's clock ends it),
or earlier when a test says so (:meth:`InterruptionsPlay.take_back`); the rebalance
recommendation with the notice, some time before it, not at all, or alone (a false
alarm). FIS's experiments (:mod:`spotnb.testing.fis`) interrupt through here too.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from spotnb.protocol.signals import SignalModel
from spotnb.testing.instances import SimInstance

__all__ = ["InterruptionsPlay"]

log = logging.getLogger(__name__)


class InterruptionsPlay:
    """The simulator's interruptions and recommendations (a part of it)."""

    notice_seconds: float
    signals: SignalModel
    signals_sent: list[tuple[float, str, str]]
    instances: dict[str, SimInstance]
    _signal_rng: random.Random
    _lock: threading.RLock

    def interrupt(self, instance_id: str, notice_seconds: float | None = None, *,
                  lead: float | None = 0.0) -> None:
        """EC2's spot interruption: the instance-action notice in the instance's metadata,
        termination ``notice_seconds`` after it. ``lead``: how many real seconds the
        rebalance recommendation comes first: 0 (default) both at once, as FIS sends
        them; more: the recommendation now, the notice that much later (a lead drawn
        from EC2's signals: :meth:`drawn_lead`); None: a notice with no recommendation."""
        delay = self.notice_seconds if notice_seconds is None else notice_seconds
        with self._lock:
            inst = self.instances[instance_id]
            now = time.time()
            if lead is not None:
                self._recommend(inst, now)
            if lead:
                inst.pending_notice = (now + lead, delay)
            else:
                self._notice(inst, now, delay)
        log.info("simulated interruption of %s: notice in %.1fs, termination %.1fs later",
                 instance_id, lead or 0.0, delay)

    def take_back(self, instance_id: str) -> None:
        """EC2 ends a noticed instance now, before the time its notice said (EC2 may:
        the notice is a warning, not a promise). With a notice period no test outlasts
        (:meth:`interrupt`'s ``notice_seconds``), a test ends the period when what it
        waits for has happened instead of racing the period."""
        with self._lock:
            inst = self.instances[instance_id]
            if inst.notice_at is None:
                raise ValueError(f"{instance_id} has had no interruption notice")
            if inst.terminate_at is not None and inst.terminate_at > time.time():
                inst.terminate_at = time.time()  # the clock's next tick ends it

    def recommend_rebalance(self, instance_id: str) -> None:
        """A rebalance recommendation now, alone: a false alarm unless an interruption
        follows."""
        with self._lock:
            self._recommend(self.instances[instance_id], time.time())

    def drawn_lead(self) -> float | None:
        """A recommendation's lead before its notice, drawn from :attr:`signals` (real
        seconds: EC2's market seconds scaled as the notice period is), or None for a
        notice with no recommendation. For :meth:`interrupt`'s ``lead``."""
        lead = self.signals.draw(self._signal_rng)
        return None if lead is None else lead * self.notice_seconds / 120.0

    def _recommend(self, inst: SimInstance, now: float) -> None:
        inst.rebalance_at = now
        inst.imds.set_rebalance(now)
        self.signals_sent.append((now, inst.id, "rebalance"))

    def _notice(self, inst: SimInstance, now: float, delay: float) -> None:
        inst.pending_notice = None
        inst.notice_at = now
        inst.terminate_at = now + delay
        inst.imds.set_instance_action(inst.terminate_at)
        self.signals_sent.append((now, inst.id, "notice"))
