"""The compiler's caches, kept with the job: ``torch.compile`` costs once per job.

``torch.compile`` compiles at a model's first call, after ``restore()``: minutes for a
real model, on every attempt, and after a warm standby's takeover too, since the
standby waits at ``restore()``. What makes a second compile fast is Inductor's cache
(FX graphs, AOTAutograd graphs, generated C++ and Triton kernels and their built
``.so`` files, autotuning results) and Triton's: directories on the instance's disk,
gone with it.

So on an instance the kernel compiles into directories of the job's own
(:func:`cache_env`: ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` under the
agent's scratch, unless the job sets them itself), the runtime uploads them packed
(``compile-cache.tar.gz`` in the job's store) after a durable save once they changed
(:class:`Uploader`: a compile adds files, training does not: a few PUTs per job), and
the next attempt's agent, or a standby during its warm-up, unpacks them before the
cell runs (:func:`fetch`): its compile finds every artifact and loads it.
Every entry of these caches is keyed by what it depends on (torch version, the graph,
the device), so a cache from another instance type is only missed, never wrong.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import threading
from collections.abc import Mapping
from pathlib import Path

from spotnb.protocol.store import NotFound, Store

__all__ = ["CACHE_ENV", "KEY", "Uploader", "cache_dirs", "cache_env", "fetch", "pack",
           "unpack"]

log = logging.getLogger(__name__)

#: The packed caches, in the job's store (replaced as they grow).
KEY = "compile-cache.tar.gz"
#: The variables that name the caches, and the name of each in the package.
CACHE_ENV = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}
# Under the agent's scratch directory.
_SUBDIR = "compile-cache"


def cache_env(scratch: Path, env: Mapping[str, str]) -> dict[str, str]:
    """The variables to give the kernel: each cache under ``scratch`` unless ``env``
    (the kernel's environment so far) names it already."""
    return {var: str(scratch / _SUBDIR / name) for var, name in CACHE_ENV.items()
            if not env.get(var)}


def cache_dirs(scratch: Path, env: Mapping[str, str]) -> dict[str, Path]:
    """The kernel's cache directories by name (``inductor``, ``triton``)."""
    given = {**env, **cache_env(scratch, env)}
    return {name: Path(given[var]) for var, name in CACHE_ENV.items()}


def _files(dirs: Mapping[str, Path]) -> list[tuple[str, Path, int, int]]:
    """(name in the package, path, size, mtime_ns) of every file, in order."""
    out = []
    for name, root in sorted(dirs.items()):
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            try:
                st = path.lstat()
            except OSError:
                continue  # a temporary file that went meanwhile
            if path.is_file() and not path.is_symlink() and not path.name.endswith(".lock"):
                out.append((f"{name}/{path.relative_to(root).as_posix()}", path,
                            st.st_size, st.st_mtime_ns))
    return out


def pack(dirs: Mapping[str, Path]) -> bytes:
    """The caches as one gzipped tar (lock files left out)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=3) as tar:
        for arcname, path, _size, _mtime in _files(dirs):
            try:
                tar.add(path, arcname=arcname, recursive=False)
            except OSError:
                continue
    return buf.getvalue()


def unpack(data: bytes, dirs: Mapping[str, Path]) -> int:
    """Unpack :func:`pack`'s output into ``dirs``; the number of files written.

    Only regular files and directories inside the named caches are written (the
    package is read from the job's store: a member that would land elsewhere is
    skipped); a file already there is kept.
    """
    written = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            name, _, rest = member.name.partition("/")
            root = dirs.get(name)
            if root is None or not rest or not (member.isfile() or member.isdir()):
                continue
            target = (root / rest).resolve()
            if not target.is_relative_to(root.resolve()):
                continue
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            if target.exists():
                continue
            source = tar.extractfile(member)
            if source is None:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.spotnb-tmp")
            tmp.write_bytes(source.read())
            os.chmod(tmp, member.mode & 0o755 | 0o600)
            os.replace(tmp, target)
            written += 1
    return written


def fetch(store: Store, dirs: Mapping[str, Path]) -> int:
    """Unpack the job's packed caches into ``dirs`` (before the cell compiles); the
    number of files written (0 when the job has none yet). Never raises: a cache
    that cannot be read only means compiling again."""
    try:
        data = store.get(KEY)
    except NotFound:
        return 0
    except Exception:
        log.warning("the job's compile cache could not be read; the cell compiles anew",
                    exc_info=True)
        return 0
    try:
        written = unpack(data, dirs)
    except Exception:
        log.warning("the job's compile cache could not be unpacked; the cell compiles "
                    "anew", exc_info=True)
        return 0
    log.info("compile cache: %d files (%.1f MB packed) ready before the cell compiles",
             written, len(data) / 1e6)
    return written


class Uploader:
    """Uploads the caches after a save, once they changed (one upload at a time, in
    its own thread: the training loop never waits for it)."""

    def __init__(self, store: Store, dirs: Mapping[str, Path]) -> None:
        self.store = store
        self.dirs = dict(dirs)
        self._uploaded: tuple[tuple[str, int, int], ...] = ()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def maybe_upload(self) -> None:
        """Start an upload if the caches changed since the last one (cheap if not:
        a listing of the cache directories)."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return  # the next save looks again
            self._thread = threading.Thread(target=self._upload, name="spotnb-compile-cache",
                                            daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for an upload in flight."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _upload(self) -> None:
        state = tuple((name, size, mtime) for name, _p, size, mtime in _files(self.dirs))
        if not state or state == self._uploaded:
            return
        try:
            data = pack(self.dirs)
            self.store.put(KEY, data)
        except Exception:
            log.warning("the compile cache could not be uploaded; the next attempt may "
                        "compile again", exc_info=True)
            return
        self._uploaded = state
        log.info("compile cache uploaded: %d files, %.1f MB packed", len(state),
                 len(data) / 1e6)
