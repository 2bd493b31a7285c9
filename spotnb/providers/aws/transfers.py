"""The checkpoint's crossings between regions, billed by the instance that makes them.

A job's store stays in its home region (:mod:`.failover`); an instance in another
region restores the newest checkpoint from there when its attempt boots, and sends
every durable save there. AWS bills each crossing to the sending region, per GB
(``spotnb.providers.regions.transfer_price``). On the local cloud the group supervisor
says them; on AWS, which has no supervisor, the instance agent of an instance outside
home does (:class:`AwayMeter`): it reads the job's log (the events it read at boot, then
every :data:`POLL_SECONDS` and once more when its job agent exits) and writes a
``transfer`` event for each crossing of its own instance, with the measured bytes of the
checkpoint events, as :class:`spotnb.providers.failover.TransferMeter` bills them;
each crossing's key is written once (those already in the log, by an agent started
again, are not). An instance at home makes no crossing and reads nothing more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from spotnb.protocol.events import Event, EventReader, codec

__all__ = ["POLL_SECONDS", "AwayMeter"]

log = logging.getLogger(__name__)

#: How often an instance outside home reads the job's log for its crossings (one S3
#: LIST, as a follower's poll): a transfer is said within this long of its save.
POLL_SECONDS = 30.0


class AwayMeter:
    """The crossings of one instance (``instance_id`` in ``region``) of a job whose
    home is ``home`` (module docstring). ``emit`` writes an event to the job's group
    stream."""

    def __init__(self, reader: EventReader, history: Iterable[Event], *, home: str,
                 region: str, instance_id: str, emit: Callable[[str, dict[str, object]], None]
                 ) -> None:
        from spotnb.providers.failover import TransferMeter

        self.reader = reader
        self.region_of = {instance_id: region}
        self.emit = emit
        self.meter = TransferMeter(home)
        self._see(history)

    def poll(self) -> None:
        """Read the job's new events and bill this instance's crossings in them."""
        self._see(self.reader.poll())

    def _see(self, events: Iterable[Event]) -> None:
        import dataclasses

        for event in events:
            body = codec.peek(event)
            if isinstance(body, codec.Transfer):  # said already (by an agent before)
                self.meter.counted.add(body.key)
                continue
            for crossing in self.meter.see(event, self.region_of):
                log.info("the checkpoint's %s crossed from %s to %s: %d bytes, $%.6f",
                         crossing.kind, crossing.source, crossing.destination,
                         crossing.bytes, crossing.usd)
                self.emit("transfer", dataclasses.asdict(crossing))
