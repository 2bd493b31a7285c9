"""What a checkpoint carries of what the event log had not confirmed when it was saved
(DESIGN invariant 8): the runtime's unconfirmed metric rows and the events its agent
holds unwritten (the cell's output lines among them). A resume sends both back to its
agent (``replay``), which records what the saving attempt's log lacks.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path
from typing import Any, Protocol

from spotnb.kernel_remote import channel

_logger = logging.getLogger(__name__)

# The files of a checkpoint (or synced directory's snapshot) that carry what the event
# log had not confirmed when it was saved: a resume records what the log lacks.
METRICS_FILE = "metrics.json"  # the metric rows, as the runtime sent them
EVENTS_FILE = "events.jsonl"  # the agent's unwritten events (output lines...), as JSON lines


class Link(Protocol):
    """What a carry's replay uses of the session (:class:`spotnb.train.session.Session`)."""

    attempt: int

    def send(self, message: channel.Message) -> None: ...


@dataclasses.dataclass(frozen=True)
class Carry:
    """What a checkpoint carries of what the event log had not confirmed when it was
    saved (:meth:`Session.carry`): metric rows ``[step, t, {name: value}]`` and the
    agent's unwritten events (JSON lines). A resume sends both to its agent
    (``replay``), which records what the saving attempt's log lacks."""

    rows: list[list[Any]] = dataclasses.field(default_factory=list)
    events: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rows or self.events)

    def files(self) -> dict[str, bytes]:
        """The checkpoint files that hold it (none when there is nothing to carry)."""
        files = {}
        if self.rows:
            files[METRICS_FILE] = json.dumps(self.rows, separators=(",", ":")).encode()
        if self.events:
            files[EVENTS_FILE] = "".join(line + "\n" for line in self.events).encode()
        return files

    @classmethod
    def read(cls, directory: Path, names: Any, what: str) -> Carry:
        """The carry of a verified local copy whose files are ``names``; what cannot be
        read is logged and left out (it is not the training state)."""
        rows: list[list[Any]] = []
        events: list[str] = []
        try:
            if METRICS_FILE in names:
                loaded = json.loads((directory / METRICS_FILE).read_bytes())
                rows = loaded if isinstance(loaded, list) else []
            if EVENTS_FILE in names:
                text = (directory / EVENTS_FILE).read_text()
                events = [line for line in text.splitlines() if line.strip()]
        except (OSError, ValueError) as e:
            _logger.warning("what %s carries of the log cannot be read (%s); the history "
                            "may miss the steps just before it", what, e)
        return cls(rows, events)

    def replay(self, rt: Link, attempt: int, durable: dict[str, Any],
               saved: float) -> None:
        """Have the agent record what the log of ``attempt`` lacks of this carry, and
        the ``checkpoint`` event ``durable`` of the restored save (saved at time
        ``saved``) if that log lacks it (its agent died before writing it)."""
        if attempt != rt.attempt:
            rt.send(channel.Replay(attempt=attempt, rows=self.rows, events=self.events,
                                   checkpoint=durable, saved=saved))


def mark_output(token: str) -> bool:
    """Flush the kernel's ``sys.stdout``/``sys.stderr`` and publish a mark after what
    they sent on its output channel (the agent relays in order); False outside an
    IPython kernel."""
    out: Any = sys.stdout
    session = getattr(out, "session", None)
    pub = getattr(out, "pub_thread", None)
    if session is None or pub is None:
        return False
    try:
        out.flush()
        sys.stderr.flush()
        msg = session.msg(channel.OUTPUT_MARK, {"token": token}, parent=out.parent_header)
        session.send(pub, msg, ident=b"spotnb")
    except Exception:
        _logger.debug("cannot mark the kernel's output", exc_info=True)
        return False
    return True
