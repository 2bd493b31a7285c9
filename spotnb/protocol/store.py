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

The local implementation uses a directory: writes go to a temporary file in the same
directory followed by ``rename``; create-if-absent uses ``link`` (which fails if the
name exists); compare-and-swap holds an ``flock`` on a sidecar lock file. ETags are
the hex SHA-256 of the content, so they are stable across processes. A streamed
object is written straight into its temporary file, asks the kernel to start writing
it back to disk as it goes (so the closing ``fsync`` has little left to do), and is
renamed into place at close.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import logging
import os
import shutil
import tempfile
import threading
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from spotnb.protocol.backoff import Backoff

__all__ = [
    "LocalStore",
    "NotFound",
    "ObjectWriter",
    "Store",
    "StoreError",
    "StoreUnavailable",
    "file_lock",
    "open_store",
    "retrying",
    "transient",
    "upload_mbps",
]

_log = logging.getLogger(__name__)

# The local cloud can simulate an instance's upload bandwidth (MB/s) for uploads of
# files (checkpoints), so that "an interruption during an upload" can be staged. The
# bandwidth is the instance's: every upload of a process shares it.
UPLOAD_MBPS_ENV = "SPOTNB_LOCAL_UPLOAD_MBPS"
# ... and a failing store: while the file this names exists, every write to a local
# store fails as on a full (its content "full") or read-only disk; reads still work.
STORE_FAULT_ENV = "SPOTNB_LOCAL_STORE_FAULT"
# A streamed local object asks the kernel to write back what it has written every
# this many bytes (posix_fadvise DONTNEED starts the writeback of dirty pages and
# drops clean ones): the disk works while the writer goes on, instead of all at the
# closing fsync, and a checkpoint does not fill the page cache.
_WRITEBACK_BYTES = 32 * 1024 * 1024
# Throttled writes go out in pieces of this size so that the simulated network
# delivers bytes steadily (a kill mid-upload leaves part of an object, as on S3).
_THROTTLE_PIECE = 1 << 18

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
def upload_mbps() -> float | None:
    """The simulated upload bandwidth in MB/s (``SPOTNB_LOCAL_UPLOAD_MBPS``), or None."""
    try:
        mbps = float(os.environ.get(UPLOAD_MBPS_ENV) or 0)
    except ValueError:
        return None
    return mbps if mbps > 0 else None


class _Throttle:
    """The simulated network of an instance: bytes pass at ``mbps`` MB/s in total.

    Shared by every upload of the process, so two uploads side by side each get half
    the bandwidth, as on a real network link.
    """

    _shared: dict[float, _Throttle] = {}
    _shared_lock = threading.Lock()

    def __init__(self, mbps: float) -> None:
        self.rate = mbps * 1e6  # bytes per second
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link is next idle (monotonic)

    @classmethod
    def current(cls) -> _Throttle | None:
        mbps = upload_mbps()
        if mbps is None:
            return None
        with cls._shared_lock:
            return cls._shared.setdefault(mbps, cls(mbps))

    def wait(self, nbytes: int) -> None:
        """Block until ``nbytes`` more may go out."""
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + nbytes / self.rate
            delay = self._free_at - now
        if delay > 0:
            time.sleep(delay)


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
    delays = Backoff(RETRY_SECONDS, MAX_RETRY_SECONDS)
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
            delay = delays.next()
            _log.warning("%s failed (%s); retrying in %.1f s", what, err, delay)
            time.sleep(delay)


@contextlib.contextmanager
def file_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive lock between the processes of this machine, held while the
    ``with`` block runs: ``flock`` on the file at ``path`` (made, with its directory,
    if missing; never deleted, as another process may be waiting on it)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


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

    def _locked(self, path: Path) -> contextlib.AbstractContextManager[None]:
        return file_lock(str(path) + _LOCK_SUFFIX)

    def put(self, key: str, data: bytes) -> str:
        path = self._path(key)
        tmp = self._write_tmp(path, data)
        # Under the key's lock so a concurrent compare-and-swap sees a consistent ETag.
        with self._locked(path):
            os.replace(tmp, path)
        return etag_of(data)

    def get(self, key: str) -> bytes:
        return self.get_with_etag(key)[0]

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            with open(self._path(key), "rb", buffering=0) as f:
                return os.pread(f.fileno(), length, offset)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise NotFound(key) from None

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

    def list_keys(self, prefix: str = "") -> list[str]:
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
                if key.startswith(prefix):
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

    def open_writer(self, key: str, *, parts_in_flight: int | None = None) -> ObjectWriter:
        return _LocalWriter(key, self._path(key))

    def upload_file(self, key: str, path: str | os.PathLike[str]) -> None:
        _check_fault()
        dest = self._path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=_TMP_MARK)
        os.close(fd)
        try:
            throttle = _Throttle.current()
            if throttle is not None:
                _throttled_copy(path, tmp, throttle)
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


class _LocalWriter(ObjectWriter):
    """A streamed object of a :class:`LocalStore`: a temporary file renamed at close."""

    def __init__(self, key: str, dest: Path) -> None:
        _check_fault()
        self.key = key
        self._dest = dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._fd, self._tmp = tempfile.mkstemp(dir=dest.parent, prefix=_TMP_MARK)
        self._throttle = _Throttle.current()
        self._size = 0
        self._written_back = 0  # bytes handed to the kernel's writeback so far
        self._open = True

    def write(self, data: Any) -> int:
        _check_fault()  # a disk that fills up mid-write
        view = memoryview(data).cast("B")
        total = len(view)
        step = _THROTTLE_PIECE if self._throttle is not None else total or 1
        for start in range(0, total, step):
            piece = view[start:start + step]
            if self._throttle is not None:
                self._throttle.wait(len(piece))
            while piece:
                n = os.write(self._fd, piece)
                piece = piece[n:]
        self._size += total
        if self._size - self._written_back >= _WRITEBACK_BYTES and _FADVISE:
            os.posix_fadvise(self._fd, self._written_back, self._size - self._written_back,
                             os.POSIX_FADV_DONTNEED)
            self._written_back = self._size
        return total

    def close(self) -> None:
        if not self._open:
            return
        try:
            os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._open = False
        try:
            os.replace(self._tmp, self._dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._tmp)
            raise

    def abort(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._tmp)


_FADVISE = hasattr(os, "posix_fadvise")


def _throttled_copy(src: str | os.PathLike[str], dest: str, throttle: _Throttle) -> None:
    """Copy through the local cloud's simulated network (:class:`_Throttle`)."""
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        while block := fin.read(_THROTTLE_PIECE):
            throttle.wait(len(block))
            fout.write(block)


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
