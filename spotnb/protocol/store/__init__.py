"""The durable store: one prefix per job, shared by the notebook, the provider and agents.

Contract (every implementation keeps it; the S3 store later follows the same one):

* Keys are ``/``-separated relative paths. A :class:`Store` is a view rooted at a
  prefix; :meth:`Store.child` narrows it.
* Every write is atomic from a reader's point of view: a reader sees the old object,
  the new object, or no object, never a partial one (DESIGN invariant 2).
* ``put_if_absent`` is an atomic create-if-absent (S3 ``IfNoneMatch="*"``) and
  ``put_if_match`` an atomic compare-and-swap on the ETag (S3 ``IfMatch``). They are
  the only primitives the lease and the ``LATEST`` pointers are built on.
* ``list_keys`` returns keys in lexicographic order, optionally strictly after a key
  (S3 ``StartAfter``): the event log is tailed with it.
* ``open_writer`` streams a large object (a checkpoint file) into the store without a
  local copy first; the object appears whole when the writer is closed, or not at all
  if it is aborted or the writer dies (S3: a multipart upload, completed at close).

This module states the contract (:class:`Store`, :class:`ObjectWriter`, the errors) and
opens a store by its URI (:func:`open_store`). The implementations: a local directory
(:mod:`spotnb.protocol.store.local`, :class:`LocalStore`, the embedded default) and S3
(:mod:`spotnb.providers.aws.store`, by :data:`STORE_SCHEMES`); what to do while a store
fails: :mod:`spotnb.protocol.store.retry` (:func:`retrying`). Their names are
importable from here.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import tempfile
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = [
    "LocalStore",
    "NotFound",
    "ObjectWriter",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "file_lock",
    "open_store",
    "outage_limit",
    "retrying",
    "transient",
    "upload_mbps",
]

# Temporary files and lock files carry these markers (spotnb.protocol.store.local);
# listings never show them, and no key may use them.
_TMP_MARK = ".tmp-"
_LOCK_SUFFIX = ".lock~"


class StoreError(Exception):
    """A store operation failed."""


class StoreUnavailable(StoreError):
    """The store kept failing for longer than :func:`retrying` would wait."""


class NotFound(StoreError, KeyError):
    """The key does not exist."""

    def __str__(self) -> str:
        return f"no such object in the store: {self.args[0]}"



class ObjectWriter(ABC):
    """A large object being streamed into a store: ``write`` then ``close``.

    Until :meth:`close` returns nothing is visible at the key (a reader sees the old
    object or none); :meth:`abort` (or an exception inside a ``with`` block) drops
    what was written. ``write`` accepts any bytes-like object and may keep no
    reference to it once it returns.
    """

    key: str

    @abstractmethod
    def write(self, data: Any) -> int:
        """Append ``data``; returns its length."""

    @abstractmethod
    def close(self) -> None:
        """Make the object durable and visible at its key, atomically."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the object; nothing appears at the key. Safe to call twice."""

    def writable(self) -> bool:
        return True

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class _SpooledWriter(ObjectWriter):
    """For stores without streaming: spool to a local temporary file, then upload it."""

    def __init__(self, store: Store, key: str) -> None:
        self.key = key
        self._store = store
        # Closed by close() or abort(): the writer outlives any one block.
        self._file = tempfile.NamedTemporaryFile(prefix="spotnb-spool-", delete=False)  # noqa: SIM115

    def write(self, data: Any) -> int:
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()
        try:
            self._store.upload_file(self.key, self._file.name)
        finally:
            os.unlink(self._file.name)

    def abort(self) -> None:
        self._file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file.name)



class Store(ABC):
    """A durable key/value store rooted at a prefix. See the module docstring."""

    uri: str

    @abstractmethod
    def put(self, key: str, data: bytes) -> str:
        """Write ``data`` at ``key`` atomically, replacing any object; return its ETag."""

    @abstractmethod
    def get(self, key: str) -> bytes:
        """Return the object at ``key``; raise :class:`NotFound` if there is none."""

    @abstractmethod
    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        """Return the object at ``key`` and its ETag; raise :class:`NotFound`."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> str | None:
        """Create ``key`` only if it does not exist; return the ETag, or None if it did."""

    @abstractmethod
    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        """Replace ``key`` only if its ETag is ``etag``; return the new ETag or None."""

    @abstractmethod
    def list_keys(self, prefix: str = "") -> list[str]:
        """Keys under ``prefix`` in lexicographic order."""

    @abstractmethod
    def list_children(self, prefix: str = "") -> list[str]:
        """Names directly below ``prefix`` (S3 ``Delimiter="/"``), sorted, no slashes."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Delete ``key``; deleting a missing key is not an error."""

    @abstractmethod
    def upload_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy a local file to ``key`` atomically (large objects: checkpoints)."""

    @abstractmethod
    def download_file(self, key: str, path: str | os.PathLike[str]) -> None:
        """Copy ``key`` to a local file (written atomically); raise :class:`NotFound`."""

    @abstractmethod
    def child(self, prefix: str) -> Store:
        """A view of this store rooted at ``prefix`` below this one."""

    #: Stores that upload a streamed object in parts hold each part in memory until
    #: it is sent: its size in bytes (0: no buffers, the data goes straight out). A
    #: writer holds at most ``parts_in_flight + 1`` parts.
    part_bytes: int = 0

    def open_writer(self, key: str, *, parts_in_flight: int | None = None) -> ObjectWriter:
        """Stream a large object to ``key`` (see :class:`ObjectWriter`).

        ``parts_in_flight``: at most this many parts uploading at once (stores with
        :attr:`part_bytes`; None: the store's default). The default implementation
        spools to a local temporary file and uploads it at close; both of spotnb's
        stores write straight to their destination.
        """
        return _SpooledWriter(self, _check_key(key))

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object at ``key`` from ``offset`` (S3: one ranged
        GET); :class:`NotFound` if there is none. Fewer bytes if the object ends first.
        The default implementation reads the whole object."""
        return self.get(key)[offset:offset + length]

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        try:
            self.get_with_etag(key)
        except NotFound:
            return False
        return True

    def delete_prefix(self, prefix: str) -> None:
        """Delete every key under ``prefix``."""
        for key in self.list_keys(prefix):
            self.delete(key)

    def delete_many(self, keys: list[str]) -> None:
        """Delete these keys (S3: one request per 1,000); missing ones are no error."""
        for key in keys:
            self.delete(key)



def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}: use a relative path like 'a/b.json'")
    if key.endswith(_LOCK_SUFFIX) or any(_TMP_MARK in p for p in parts):
        raise ValueError(f"invalid store key {key!r}: the name is reserved")
    return key



#: Where the store of each URI scheme is implemented: (module, class), imported when a
#: URI of the scheme is first opened (as fsspec's ``known_implementations``), so this
#: module needs no cloud SDK and knows no provider. ``file`` and plain paths are
#: :class:`LocalStore`.
STORE_SCHEMES: dict[str, tuple[str, str]] = {
    "s3": ("spotnb.providers.aws.store", "S3Store"),
}
# Each scheme's opener once imported.
_openers: dict[str, Callable[[str], Store]] = {}


def open_store(uri: str | os.PathLike[str]) -> Store:
    """Open a store from its URI: ``file:///abs/path``, a plain local path, or
    ``s3://bucket/prefix`` (:class:`spotnb.providers.aws.store.S3Store`, needs boto3):
    :data:`STORE_SCHEMES`.
    """
    text = os.fspath(uri)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        return LocalStore(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "":
        return LocalStore(text)
    opener = _openers.get(parsed.scheme)
    if opener is None and parsed.scheme in STORE_SCHEMES:
        module, name = STORE_SCHEMES[parsed.scheme]
        opener = getattr(importlib.import_module(module), name).from_uri
        _openers[parsed.scheme] = opener
    if opener is None:
        raise StoreError(f"unknown store URI scheme {parsed.scheme!r} in {text!r}: "
                         "use a local path")
    return opener(text)


# The parts, below the contract they implement (each imports it from here).
from spotnb.protocol.store.local import LocalStore, file_lock, upload_mbps  # noqa: E402
from spotnb.protocol.store.retry import outage_limit, retrying, transient  # noqa: E402
