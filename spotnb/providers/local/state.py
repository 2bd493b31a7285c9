"""The local cloud's state on disk, its settings, and the processes it owns.

Everything lives under ``spotnb.protocol.layout.cloud_dir()`` (``$SPOTNB_HOME/cloud``)::

    config.json                      optional settings (see Settings; env vars win)
    groups/<job_id>/group.json       the capacity group: supervisor pid, state, store URI
    groups/<job_id>/control/         requests to the supervisor (interrupt, terminate)
    groups/<job_id>/supervisor.log   the supervisor's log
    instances/<instance_id>/         one instance: meta.json, pid.json, agent.log, and
                                     the agent's working directory

Processes are identified by :class:`ProcessRecord` (pid, start time, command line)
and verified with psutil before any signal is sent: pids get reused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
import shlex
import signal
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import psutil

from spotnb.protocol.layout import cloud_dir
from spotnb.protocol.spec import SpecError

log = logging.getLogger(__name__)

# Environment variables every instance process (and its children) carries, so leftovers
# can be found even when their records are gone. The cloud directory keeps two local
# clouds (two SPOTNB_HOMEs, such as parallel test runs) from touching each other.
ENV_INSTANCE_MARK = "SPOTNB_LOCAL_INSTANCE_ID"
ENV_JOB_MARK = "SPOTNB_LOCAL_JOB_ID"
ENV_CLOUD_MARK = "SPOTNB_LOCAL_CLOUD_DIR"

# The agent's socket directory (its channel to the runtime, its kernels' connection
# files): made by the instance's reaper (spotnb.providers.local.reaper), short (Unix
# socket paths are limited to ~107 bytes, so not under the instance's own directory),
# and removed by it when the instance ends, however the agent ended. The agent makes
# its own where this is not set (EC2).
ENV_SOCKET_DIR = "SPOTNB_AGENT_SOCKET_DIR"

GROUP_FILE = "group.json"
CONTROL_DIR = "control"

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# ------------------------------------------------------------------------- settings


@dataclasses.dataclass(frozen=True)
class Settings:
    """Simulation settings: ``cloud/config.json`` keys of the same names, then env vars
    (which win). See the package docstring of :mod:`spotnb.providers.local` for each.
    """

    time_scale: float = 60.0
    notice_seconds: float = 2.0
    boot_seconds: float = 0.0
    no_capacity: frozenset[str] = frozenset()
    hazard: bool = True
    seed: str | None = None
    interrupt_after: float = 20.0
    stop_grace: float = 15.0
    agent_cmd: tuple[str, ...] | None = None
    instance_env: tuple[str, ...] = ()

    @classmethod
    def load(cls) -> Settings:
        """Read ``config.json`` (if any) and the environment; raise SpecError if invalid."""
        raw: dict[str, Any] = {}
        path = cloud_dir() / "config.json"
        if path.exists():
            try:
                raw = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise SpecError(f"cannot read the local cloud settings {path}: {e}") from None
            if not isinstance(raw, dict):
                raise SpecError(f"{path} must hold a JSON object of settings")
        for key, env in _ENV.items():
            if env in os.environ:
                raw[key] = os.environ[env]
        unknown = set(raw) - set(_ENV)
        if unknown:  # a typo, or a setting of another part of spotnb: say so, go on
            log.warning("ignoring unknown local cloud setting(s) %s in %s; known: %s",
                        ", ".join(sorted(unknown)), path, ", ".join(_ENV))
        scale = _number(raw, "time_scale", 60.0)
        return cls(
            time_scale=scale,
            notice_seconds=_number(raw, "notice_seconds", 120.0 / scale, allow_zero=True),
            boot_seconds=_number(raw, "boot_seconds", 0.0, allow_zero=True),
            no_capacity=frozenset(_names(raw.get("no_capacity", ()))),
            hazard=_flag(raw, "hazard", True),
            seed=str(raw["seed"]) if raw.get("seed") not in (None, "") else None,
            interrupt_after=_number(raw, "interrupt_after", 20.0),
            stop_grace=_number(raw, "stop_grace", 15.0, allow_zero=True),
            agent_cmd=_command(raw.get("agent_cmd")),
            instance_env=tuple(_names(raw.get("instance_env", ()))),
        )

    def has_capacity(self, instance_type: str, az: str) -> bool:
        """Whether the simulated pool ``instance_type@az`` can launch an instance now."""
        return instance_type not in self.no_capacity and (
            f"{instance_type}@{az}" not in self.no_capacity)


_ENV = {
    "time_scale": "SPOTNB_LOCAL_TIME_SCALE",
    "notice_seconds": "SPOTNB_LOCAL_NOTICE_SECONDS",
    "boot_seconds": "SPOTNB_LOCAL_BOOT_SECONDS",
    "no_capacity": "SPOTNB_LOCAL_NO_CAPACITY",
    "hazard": "SPOTNB_LOCAL_HAZARD",
    "seed": "SPOTNB_LOCAL_SEED",
    "interrupt_after": "SPOTNB_LOCAL_INTERRUPT_AFTER",
    "stop_grace": "SPOTNB_LOCAL_STOP_GRACE",
    "agent_cmd": "SPOTNB_LOCAL_AGENT_CMD",
    "instance_env": "SPOTNB_LOCAL_INSTANCE_ENV",
}


def _number(raw: dict[str, Any], key: str, default: float, allow_zero: bool = False) -> float:
    value = raw.get(key)
    if value in (None, ""):
        return default
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = float("nan")
    if not (number >= 0 if allow_zero else number > 0):
        raise SpecError(
            f"local cloud setting {key} ({_ENV[key]}) must be a "
            f"{'non-negative' if allow_zero else 'positive'} number of seconds or a factor, "
            f"not {value!r}"
        )
    return number


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = raw.get(key)
    if value in (None, ""):
        return default
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "on", "yes"):
        return True
    if text in ("0", "false", "off", "no"):
        return False
    raise SpecError(f"local cloud setting {key} ({_ENV[key]}) must be 1 or 0, not {value!r}")


def _names(value: Any) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(item).strip() for item in items if str(item).strip()]


def _command(value: Any) -> tuple[str, ...] | None:
    if value in (None, "", []):
        return None
    argv = shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return tuple(argv)


# ---------------------------------------------------------------------------- paths


def check_job_id(job_id: str) -> str:
    """``job_id`` if it is safe as a directory name; else raise SpecError."""
    if not _JOB_ID.match(job_id):
        raise SpecError(
            f"job id {job_id!r} cannot name a local capacity group: use letters, digits, "
            "'.', '_' and '-' (at most 128 characters)"
        )
    return job_id


def groups_dir() -> Path:
    return cloud_dir() / "groups"


def group_dir(job_id: str) -> Path:
    return groups_dir() / check_job_id(job_id)


def instances_dir() -> Path:
    return cloud_dir() / "instances"


def instance_dir(instance_id: str) -> Path:
    return instances_dir() / instance_id


def az_name(region: str, az_id: str) -> str:
    """The local account's AZ name for an AZ id: ``use1-az4`` in us-east-1 is us-east-1d.

    (On AWS each account maps names to ids differently; the local cloud's account maps
    ``azN`` to the N-th letter.)
    """
    number = int(az_id.rsplit("az", 1)[1])
    return f"{region}{chr(ord('a') + number - 1)}"


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write a JSON file atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object from ``path``, or None if it is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ------------------------------------------------------------------------ processes


@dataclasses.dataclass(frozen=True)
class ProcessRecord:
    """Enough to recognise a process again: pid, start time and command line."""

    pid: int
    create_time: float
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int, argv: Sequence[str] | None = None) -> ProcessRecord:
        """The record of process ``pid``. ``argv``: what it was started with, when the
        caller has just started it: its command line reads empty while the kernel
        finishes the exec (past the point where ``subprocess.Popen`` returns), and a
        record of that would never recognise the process again."""
        proc = psutil.Process(pid)
        cmdline = tuple(argv) if argv is not None else tuple(proc.cmdline())
        return cls(pid=pid, create_time=proc.create_time(), cmdline=cmdline)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> ProcessRecord | None:
        if not raw or "pid" not in raw:
            return None
        return cls(pid=int(raw["pid"]), create_time=float(raw["create_time"]),
                   cmdline=tuple(raw["cmdline"]))

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "create_time": self.create_time, "cmdline": list(self.cmdline)}

    def process(self) -> psutil.Process | None:
        """The live process this record describes, or None (gone, reused pid, zombie)."""
        try:
            proc = psutil.Process(self.pid)
            if (abs(proc.create_time() - self.create_time) > 0.01
                    or tuple(proc.cmdline()) != self.cmdline):
                return None
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        return proc

    def alive(self) -> bool:
        return self.process() is not None


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess,
                                 psutil.AccessDenied):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def kill_processes(procs: list[psutil.Process], grace: float) -> None:
    """SIGTERM each process (its whole group if it leads one), wait ``grace``, SIGKILL.

    Only call this with processes verified to be ours; the calling process itself is
    never signalled (a supervisor ending an instance whose tree it was once part of).
    """
    procs = _running([p for p in procs if p.pid != os.getpid()])
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError, psutil.Error):
                if os.getpgid(p.pid) == p.pid:
                    os.killpg(p.pid, sig)
                else:
                    os.kill(p.pid, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 5.0)
        while procs and time.monotonic() < deadline:
            for p in procs:
                # Reap our own children; others are reaped by their parent or init.
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(p.pid, os.WNOHANG)
            procs = _running(procs)
            if procs:
                time.sleep(0.05)
        if not procs:
            return
    log.warning("processes %s survived SIGKILL", [p.pid for p in procs])


def kill_tree(record: ProcessRecord, grace: float = 1.0) -> bool:
    """Kill a recorded process (after verifying it) and its descendants. False if gone."""
    proc = record.process()
    if proc is None:
        return False
    try:
        family = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        family = [proc]
    kill_processes(family, grace)
    return True


# What an instance's processes inherit of this machine's environment. An EC2 instance's
# agent sees its own system's variables and the job's role, never the user's
# credentials, tokens or other settings; a local instance sees the same, so that a cell
# that works here works there. Kept: what runs the same Python and spotnb (the search
# path, the library path, PYTHONPATH so the instance imports the notebook's spotnb), the
# user's home and locale, and spotnb's own settings (SPOTNB_*: the local cloud's).
_INSTANCE_ENV_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TERM",
    "PYTHONPATH", "PYTHONHOME", "PYTHONNOUSERSITE", "LD_LIBRARY_PATH", "DYLD_LIBRARY_PATH",
})
_INSTANCE_ENV_PREFIXES = ("LC_", "SPOTNB_")


def instance_base_environment(environ: Mapping[str, str],
                              passed: Iterable[str] = ()) -> dict[str, str]:
    """The variables of ``environ`` a local instance starts with: the basics above,
    plus ``passed``: names, or prefixes ending in ``*`` (the job's ``env`` names without
    a value, and the ``instance_env`` setting)."""
    names = set(_INSTANCE_ENV_NAMES)
    prefixes = list(_INSTANCE_ENV_PREFIXES)
    for item in passed:
        if item.endswith("*"):
            prefixes.append(item[:-1])
        else:
            names.add(item)
    return {k: v for k, v in environ.items() if k in names or k.startswith(tuple(prefixes))}


def instance_environment(instance_id: str, job_id: str) -> dict[str, str]:
    """The marker variables of an instance's processes (see :func:`marked_processes`)."""
    return {ENV_INSTANCE_MARK: instance_id, ENV_JOB_MARK: job_id,
            ENV_CLOUD_MARK: str(cloud_dir())}


def marked_processes(job_id: str | None = None) -> list[tuple[psutil.Process, str, str]]:
    """Live processes started by an instance of this local cloud: (process, instance id,
    job id); only this user's. Found by the marker variables in their environment, or,
    for those started without them (``env={}``), by their working directory: inside an
    instance's directory (its job read from the instance's ``meta.json``; ``""`` if
    unknown)."""
    found = []
    me = os.getpid()
    cloud = str(cloud_dir())
    instances = str(instances_dir()) + os.sep
    jobs: dict[str, str] = {}
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        instance = env.get(ENV_INSTANCE_MARK)
        job = env.get(ENV_JOB_MARK, "")
        if not (instance and env.get(ENV_CLOUD_MARK) == cloud):
            try:
                cwd = proc.cwd()
            except (psutil.Error, OSError):
                continue
            if not cwd.startswith(instances):
                continue
            instance = cwd[len(instances):].split(os.sep, 1)[0]
            if instance not in jobs:
                meta = read_json(instance_dir(instance) / "meta.json") or {}
                jobs[instance] = str(meta.get("job_id") or "")
            job = jobs[instance]
        if job_id in (None, job):
            found.append((proc, instance, job))
    return [(p, i, j) for p, i, j in found if _running([p])]
