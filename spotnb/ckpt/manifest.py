"""What a complete checkpoint is: its id, its files and its manifest, and ``LATEST``.

A checkpoint ``<prefix>/<id>/`` is complete once its ``MANIFEST.json`` is written (the
protocol around it is :mod:`spotnb.ckpt.checkpoints`'). An id is
``f"{step:012d}-a{attempt:04d}-{random hex}"``: ids sort by step, then attempt, and two
writers never pick the same one. The manifest lists every file of the checkpoint with
its size and checksum (:mod:`spotnb.ckpt.checksum`); ``LATEST`` is ``{"id", "step"}``
of the newest complete one.

Both are untrusted input when read back (a disk that filled, a hand edit, another
program writing to the bucket): :meth:`Manifest.from_json` and :func:`parse_latest`
are their one readers, and raise :class:`Damaged` for anything this module does not
write.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from spotnb.ckpt.checksum import algorithm_of
from spotnb.ckpt.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FORMATS",
    "LATEST",
    "MANIFEST",
    "MANIFEST_SCHEMA",
    "SYNC_FORMATS",
    "Damaged",
    "FileEntry",
    "Manifest",
    "check_name",
    "new_id",
    "parse_id",
    "parse_latest",
]

MANIFEST = "MANIFEST.json"
LATEST = "LATEST"
# 2: files carry "checksum" ("crc32c:<hex>").
MANIFEST_SCHEMA = 2

_ID_RE = re.compile(r"^(\d{12})-a(\d{4})-[0-9a-f]+$")


def new_id(step: int, attempt: int) -> str:
    """A fresh checkpoint id that sorts by step, then attempt."""
    if step < 0:
        raise ValueError(f"a checkpoint step must be >= 0, not {step}")
    return f"{step:012d}-a{attempt:04d}-{secrets.token_hex(4)}"


def parse_id(name: str) -> tuple[int, int] | None:
    """The step and attempt of checkpoint id ``name``; None if it is not an id."""
    m = _ID_RE.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_name(name: str) -> str:
    """A file name inside a checkpoint: a relative path without ``..`` (may have ``/``)."""
    parts = name.split("/")
    if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid checkpoint file name {name!r}: use a relative path")
    if name == MANIFEST:
        raise ValueError(f"{MANIFEST} is reserved in a checkpoint")
    return name


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size and ``checksum`` (``"crc32c:<hex>"``; see
    :mod:`spotnb.ckpt.checksum`)."""

    name: str
    size: int
    checksum: str


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a complete checkpoint holds. Written as ``<id>/MANIFEST.json``."""

    id: str
    step: int
    attempt: int
    created: float
    files: tuple[FileEntry, ...]
    format: str = "files"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema: int = MANIFEST_SCHEMA

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def entry(self, name: str) -> FileEntry | None:
        """The file ``name`` of the checkpoint, or None if it has none of that name."""
        return next((f for f in self.files if f.name == name), None)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes, checkpoint_id: str | None = None) -> Manifest:
        """The manifest in ``text``; :class:`CheckpointError` for anything that is not
        one this module wrote (see :func:`_parse_manifest`). ``checkpoint_id``: the
        directory it was read from, which its ``id`` must name."""
        return _parse_manifest(text, checkpoint_id)

    @classmethod
    def read_local(cls, directory: str | os.PathLike[str]) -> Manifest:
        """The manifest in a local copy of a checkpoint (``<dir>/MANIFEST.json``)."""
        return cls.from_json(Path(directory, MANIFEST).read_bytes())


# The formats of spotnb's readers (their CheckpointStore's ``formats``): what
# spot.Checkpoint reads ("dcp"; "pickle": a state saved where torch was not imported),
# what sync_dir reads.
CHECKPOINT_FORMATS = frozenset({"dcp", "pickle"})
SYNC_FORMATS = frozenset({"dir"})


class Damaged(CheckpointError):
    """A manifest or ``LATEST`` that is not what this module writes."""


def _load_json(text: str | bytes, what: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nested a million deep
        raise Damaged(f"{what} is not JSON ({str(e)[:80]})") from None


def _whole(raw: Mapping[str, Any], key: str, what: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise Damaged(f"{what}: {key} must be a whole number >= 0, not {value!r}"[:200])
    return value


def _parse_manifest(text: str | bytes, checkpoint_id: str | None) -> Manifest:
    """The one reader of a manifest's shape. A manifest is untrusted input (a disk that
    filled, a hand edit, another program writing to the bucket): every field is checked
    here, once, so that code reading a :class:`Manifest` meets only what this module
    writes. In particular no file name leaves the checkpoint's directory and the id
    is the directory's own."""
    what = f"the manifest of checkpoint {checkpoint_id or '?'}"
    raw = _load_json(text, what)
    if not isinstance(raw, dict):
        raise Damaged(f"{what} is not a JSON object but {type(raw).__name__}")
    schema = raw.get("schema", MANIFEST_SCHEMA)
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise Damaged(f"{what}: schema must be a whole number, not {schema!r}"[:200])
    if schema > MANIFEST_SCHEMA:
        raise CheckpointError(
            f"checkpoint {raw.get('id')} was written by a newer spotnb (manifest schema "
            f"{schema}); upgrade spotnb: pip install -U spotnb"
        )
    cid = raw.get("id")
    if not isinstance(cid, str) or parse_id(cid) is None:
        raise Damaged(f"{what}: its id {cid!r} is not a checkpoint id"[:200])
    if checkpoint_id is not None and cid != checkpoint_id:
        raise Damaged(f"{what} names another checkpoint ({cid})")
    created = raw.get("created")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or \
            not math.isfinite(created):
        raise Damaged(f"{what}: created must be a time, not {created!r}"[:200])
    files = raw.get("files")
    if not isinstance(files, list):
        raise Damaged(f"{what}: files must be a list, not {type(files).__name__}")
    entries = tuple(_file_entry(f, what) for f in files)
    if len({e.name for e in entries}) != len(entries):
        raise Damaged(f"{what} lists a file twice")
    fmt = raw.get("format", "files")
    if not isinstance(fmt, str) or not fmt.isprintable() or len(fmt) > 64:
        raise Damaged(f"{what}: format must be a name, not {fmt!r}"[:200])
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise Damaged(f"{what}: metadata must be a JSON object, not "
                       f"{type(metadata).__name__}")
    ranks = metadata.get("ranks")
    if ranks is not None and (isinstance(ranks, bool) or not isinstance(ranks, int)
                              or ranks < 1):
        raise Damaged(f"{what}: metadata.ranks must be a world size, not {ranks!r}"[:200])
    return Manifest(id=cid, step=_whole(raw, "step", what),
                    attempt=_whole(raw, "attempt", what), created=float(created),
                    files=entries, format=fmt, metadata=metadata, schema=schema)


def _file_entry(raw: Any, what: str) -> FileEntry:
    """A file of a manifest: its name, size and ``checksum``."""
    if not isinstance(raw, dict):
        raise Damaged(f"{what}: a file entry is {type(raw).__name__}, not an object")
    name = raw.get("name")
    try:
        check_name(name if isinstance(name, str) else "")
    except ValueError:
        raise Damaged(f"{what}: file name {name!r} is not a path inside the "
                       "checkpoint"[:200]) from None
    checksum = raw.get("checksum")
    try:
        algorithm_of(checksum if isinstance(checksum, str) else "")
    except ValueError as e:  # a checksum this spotnb does not know
        raise Damaged(f"{what}: file {name!r}: {e}"[:300]) from None
    assert isinstance(name, str) and isinstance(checksum, str)
    return FileEntry(name, _whole(raw, "size", f"{what}: file {name!r}"), checksum)


def parse_latest(data: bytes) -> tuple[str, int]:
    """``LATEST``'s checkpoint id and step. Raises :class:`Damaged` if it is not the JSON
    :class:`~spotnb.ckpt.checkpoints.CheckpointStore` writes, or names an id that is not a
    checkpoint's (``..`` would leave the prefix)."""
    raw = _load_json(data, "it")
    if not isinstance(raw, dict):
        raise Damaged("not a JSON object")
    cid = raw.get("id")
    if not isinstance(cid, str) or parse_id(cid) is None:
        raise Damaged(f"its id {cid!r} is not a checkpoint id"[:200])
    return cid, _whole(raw, "step", "its")
