"""What the provider asks of a running capacity group: a file each in the group's
control directory (``control/``: a local directory, so the supervisor reads it every
tick without a store request), written by :func:`send` (``terminate``, ``interrupt``,
``kill``, ``freeze``, ``recommend``, each for an instance or the first one) and taken
by the supervisor (:mod:`.group`) with :func:`take`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any

from spotnb.providers.local.state import CONTROL_DIR, read_json, write_json

__all__ = ["KINDS", "Request", "send", "take"]

log = logging.getLogger(__name__)

#: What the provider may ask of a group.
KINDS = ("terminate", "interrupt", "kill", "freeze", "recommend")


@dataclasses.dataclass(frozen=True)
class Request:
    """One request: its ``kind`` (:data:`KINDS`) and the ``instance`` it names (None:
    the group picks, or the request is for the whole group)."""

    kind: str
    instance: str | None = None


def send(home: Path, kind: str, **fields: Any) -> None:
    """Ask the group whose directory is ``home`` for ``kind`` (``instance=``: which)."""
    write_json(home / CONTROL_DIR / f"{kind}-{time.time_ns()}.json",
               {"kind": kind, "time": time.time(), "pid": os.getpid(), **fields})


def take(home: Path) -> list[Request]:
    """The requests waiting in ``home``'s control directory, oldest first; each is
    removed as it is taken. One of a kind this version does not know is logged and
    dropped."""
    control = home / CONTROL_DIR
    try:
        names = sorted(os.listdir(control))
    except FileNotFoundError:
        return []
    taken = []
    for name in names:
        if name.startswith("."):
            continue
        path = control / name
        kind = name.split("-", 1)[0]
        if kind in KINDS:
            instance = (read_json(path) or {}).get("instance")
            taken.append(Request(kind, str(instance) if instance else None))
        else:
            log.warning("ignoring unknown control request %s", name)
        path.unlink(missing_ok=True)
    return taken
