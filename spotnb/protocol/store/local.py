"""The local store: a directory (the embedded default; the contract is
:mod:`spotnb.protocol.store`'s).

Writes go to a temporary file in the same directory followed by ``rename``;
create-if-absent uses ``link`` (which fails if the name exists); compare-and-swap holds
an ``flock`` on a sidecar lock file (:func:`file_lock`, the one ``flock`` helper). ETags
are the hex SHA-256 of the content, so they are stable across processes. A streamed
object is written straight into its temporary file, asks the kernel to start writing
it back to disk as it goes (so the closing ``fsync`` has little left to do), and is
renamed into place at close.

The local cloud stages an instance's network and disk here: a simulated upload
bandwidth shared by every upload of the process (:func:`upload_mbps`), and a failing
disk (:data:`STORE_FAULT_ENV`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from spotnb.protocol.store import (
    _LOCK_SUFFIX,
    _TMP_MARK,
    NotFound,
    ObjectWriter,
    Store,
    _check_key,
)

__all__ = ["LocalStore", "etag_of", "file_lock", "upload_mbps"]

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




def etag_of(data: bytes) -> str:
    """The ETag the local store gives ``data`` (hex SHA-256)."""
    return hashlib.sha256(data).hexdigest()



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

