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

The local implementation uses a directory: writes go to a temporary file in the same
directory followed by ``rename``; create-if-absent uses ``link`` (which fails if the
name exists); compare-and-swap holds an ``flock`` on a sidecar lock file. ETags are
the hex SHA-256 of the content, so they are stable across processes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = [
    "LocalStore",
    "NotFound",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "open_store",
    "retrying",
    "transient",
]

_log = logging.getLogger(__name__)

# The local cloud can simulate an instance's upload bandwidth (MB/s) for uploads of
# files (checkpoints), so that "an interruption during an upload" can be staged.
UPLOAD_MBPS_ENV = "SPOTNB_LOCAL_UPLOAD_MBPS"
# ... and a failing store: while the file this names exists, every write to a local
# store fails as on a full (its content "full") or read-only disk; reads still work.
STORE_FAULT_ENV = "SPOTNB_LOCAL_STORE_FAULT"

# Temporary files and lock files carry these markers; listings never show them.
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


def _check_fault() -> None:
    """Raise the OSError of a simulated store fault, if one is switched on."""
    switch = os.environ.get(STORE_FAULT_ENV)
    if not switch:
        return
    try:
        kind = Path(switch).read_text().strip()
    except OSError:
        return
    if kind == "full":
        raise OSError(errno.ENOSPC, "No space left on device (simulated)", switch)
    raise OSError(errno.EROFS, "Read-only file system (simulated)", switch)


def etag_of(data: bytes) -> str:
    """The ETag the local store gives ``data`` (hex SHA-256)."""
    return hashlib.sha256(data).hexdigest()


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
    def list_keys(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        """Keys under ``prefix`` in lexicographic order, strictly after ``start_after``."""

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


# A store that fails is retried with backoff from RETRY_SECONDS up to MAX_RETRY_SECONDS
# apart; after OUTAGE_SECONDS without a success the caller gives up (StoreUnavailable).
# SPOTNB_STORE_OUTAGE_SECONDS changes it (tests, or a job that should wait longer).
RETRY_SECONDS = 0.5
MAX_RETRY_SECONDS = 30.0
OUTAGE_SECONDS = 900.0
OUTAGE_ENV = "SPOTNB_STORE_OUTAGE_SECONDS"

T = TypeVar("T")


def transient(err: BaseException) -> bool:
    """Whether a store error may go away by itself (a full or read-only disk, S3 down):
    any OSError or StoreError but a missing key."""
    return isinstance(err, (OSError, StoreError)) and not isinstance(
        err, (NotFound, StoreUnavailable))


def outage_limit() -> float:
    """How long :func:`retrying` waits for a failing store, in seconds."""
    try:
        return float(os.environ.get(OUTAGE_ENV) or OUTAGE_SECONDS)
    except ValueError:
        return OUTAGE_SECONDS


def retrying(fn: Callable[[], T], what: str, check: Callable[[], None] | None = None) -> T:
    """``fn()``, retried with backoff while the store fails transiently (see
    :func:`transient`); :class:`StoreUnavailable` once it has failed for
    :func:`outage_limit` seconds. ``check`` runs before every try (it may raise to
    stop, e.g. when the caller lost the job's lease)."""
    started = time.monotonic()
    delay = RETRY_SECONDS
    limit = outage_limit()
    while True:
        if check is not None:
            check()
        try:
            return fn()
        except Exception as err:
            if not transient(err):
                raise
            if time.monotonic() - started > limit:
                raise StoreUnavailable(f"{what} failed for {limit:g} s: {err}") from err
            _log.warning("%s failed (%s); retrying in %.1f s", what, err, delay)
            time.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_SECONDS)


def _check_key(key: str) -> str:
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid store key {key!r}: use a relative path like 'a/b.json'")
    if key.endswith(_LOCK_SUFFIX) or any(_TMP_MARK in p for p in parts):
        raise ValueError(f"invalid store key {key!r}: the name is reserved")
    return key


class LocalStore(Store):
    """A store in a local directory (the embedded default)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.uri = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def _write_tmp(self, path: Path, data: bytes) -> Path:
        _check_fault()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TMP_MARK)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            os.unlink(tmp)
            raise
        return Path(tmp)

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(str(path) + _LOCK_SUFFIX, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        # Under the key's lock so a concurrent compare-and-swap sees a consistent ETag.
        with self._locked(path):
            os.replace(tmp, path)
        return etag_of(data)

    def get(self, key: str) -> bytes:
        return self.get_with_etag(key)[0]

    def get_with_etag(self, key: str) -> tuple[bytes, str]:
        try:
            data = self._path(key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None
        return data, etag_of(data)

    def put_if_absent(self, key: str, data: bytes) -> str | None:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return etag_of(data)

    def put_if_match(self, key: str, data: bytes, etag: str) -> str | None:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        try:
            with self._locked(path):
                try:
                    current = etag_of(path.read_bytes())
                except FileNotFoundError:
                    return None
                if current != etag:
                    return None
                os.replace(tmp, path)
                return etag_of(data)
        finally:
            if tmp.exists():
                os.unlink(tmp)

    def list_keys(self, prefix: str = "", start_after: str | None = None) -> list[str]:
        base = self.root / prefix if prefix else self.root
        # A prefix may end inside a name ("events/0001/00"): walk its directory.
        walk_root = base if base.is_dir() else base.parent
        if not walk_root.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(walk_root):
            dirnames[:] = [d for d in dirnames if _TMP_MARK not in d]
            for name in filenames:
                if name.startswith(_TMP_MARK) or name.endswith(_LOCK_SUFFIX):
                    continue
                key = os.path.relpath(os.path.join(dirpath, name), self.root)
                key = key.replace(os.sep, "/")
                if key.startswith(prefix) and (start_after is None or key > start_after):
                    keys.append(key)
        keys.sort()
        return keys

    def list_children(self, prefix: str = "") -> list[str]:
        base = self.root / prefix if prefix else self.root
        try:
            names = os.listdir(base)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if _TMP_MARK not in n and not n.endswith(_LOCK_SUFFIX))

    def delete(self, key: str) -> None:
        _check_fault()
        path = self._path(key)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(str(path) + _LOCK_SUFFIX)

    def delete_prefix(self, prefix: str) -> None:
        _check_fault()
        target = self.root / prefix if prefix else self.root
        if prefix.endswith("/") or target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            super().delete_prefix(prefix)

    def upload_file(self, key: str, path: str | os.PathLike[str]) -> None:
        _check_fault()
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_TMP_MARK)
        os.close(fd)
        try:
            mbps = float(os.environ.get(UPLOAD_MBPS_ENV) or 0)
            if mbps > 0:
                _throttled_copy(path, tmp, mbps)
            else:
                shutil.copyfile(path, tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def download_file(self, key: str, path: str | os.PathLike[str]) -> None:
        src = self._path(key)
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_TMP_MARK)
        os.close(fd)
        try:
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
        except FileNotFoundError:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise NotFound(key) from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def child(self, prefix: str) -> LocalStore:
        return LocalStore(self.root / _check_key(prefix.strip("/")))


def _throttled_copy(src: str | os.PathLike[str], dest: str, mbps: float) -> None:
    """Copy at ``mbps`` megabytes per second: the local cloud's simulated network."""
    chunk = 1 << 18
    start = time.monotonic()
    done = 0
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while block := fin.read(chunk):
            fout.write(block)
            done += len(block)
            ahead = done / (mbps * 1e6) - (time.monotonic() - start)
            if ahead > 0:
                time.sleep(ahead)


def open_store(uri: str | os.PathLike[str]) -> Store:
    """Open a store from its URI: ``file:///abs/path``, a plain local path, or
    ``s3://bucket/prefix`` (:class:`spotnb.providers.aws.store.S3Store`, needs boto3).
    """
    text = os.fspath(uri)
    parsed = urllib.parse.urlparse(text)
    if parsed.scheme == "file":
        return LocalStore(urllib.parse.unquote(parsed.path))
    if parsed.scheme == "":
        return LocalStore(text)
    if parsed.scheme == "s3":
        from spotnb.providers.aws.store import S3Store

        return S3Store.from_uri(text)
    raise StoreError(f"unknown store URI scheme {parsed.scheme!r} in {text!r}: use a local path")
