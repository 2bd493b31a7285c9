"""What ``spotnb cleanup`` does on the local cloud, planned before it acts
(:func:`cleanup_plan`): the dry run prints the plan, the real run carries it out, action
for action. What is left of jobs that ended or lost their supervisor (processes, then
directories, then secrets), and the socket directories killed agents left in the
temporary directory (:func:`abandoned_socket_dirs`). A running job is left alone.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from spotnb.protocol import secretstore
from spotnb.providers.local.groupfile import (
    SUPERVISOR_KILL_GRACE_SECONDS,
    has_result,
    supervisor_alive,
)
from spotnb.providers.local.state import (
    GROUP_FILE,
    ProcessRecord,
    groups_dir,
    instances_dir,
    kill_processes,
    kill_tree,
    marked_processes,
    read_json,
)

__all__ = ["AGENT_SOCKET_DIR_PREFIX", "CleanupAction", "abandoned_socket_dirs", "cleanup_plan"]


@dataclasses.dataclass(frozen=True)
class CleanupAction:
    """One step of a cleanup: ``what`` it does, in words, and ``apply`` to do it."""

    what: str
    apply: Callable[[], None]


def cleanup_plan() -> list[CleanupAction]:
    """Everything a cleanup does now, in order: kill what is left of jobs that ended
    or lost their supervisor, then remove their directories, then the socket
    directories that killed agents left in the temporary directory. A running job
    (its supervisor alive, no result) is left alone.
    """
    kills: list[CleanupAction] = []
    removals: list[CleanupAction] = []
    live_jobs = set()
    covered: set[int] = set()  # pids some action already kills
    instances_of: dict[str, list[Path]] = {}
    for home in _subdirs(instances_dir()):
        job = (read_json(home / "meta.json") or {}).get("job_id")
        instances_of.setdefault(str(job), []).append(home)
    groups = {home.name: home for home in _subdirs(groups_dir())}
    for job_id in sorted(set(groups) | set(instances_of) - {"None"}):
        info = (read_json(groups[job_id] / GROUP_FILE) if job_id in groups else None) or {}
        alive = supervisor_alive(info)
        finished = has_result(info.get("store_uri") or _instance_store(instances_of,
                                                                             job_id))
        if alive and not finished:
            live_jobs.add(job_id)
            continue
        # Step 1: processes. A supervisor still up after its job's result, then the
        # instance processes that outlived their group.
        supervisor = ProcessRecord.from_dict(info.get("supervisor")) if alive else None
        if supervisor is not None:
            covered |= _family(supervisor)
            kills.append(CleanupAction(
                f"stop the capacity group of job {job_id} (pid {supervisor.pid}): its "
                "job has a result", _kill_action(supervisor, SUPERVISOR_KILL_GRACE_SECONDS)))
        for home in instances_of.get(job_id, []):
            record = ProcessRecord.from_dict(read_json(home / "pid.json"))
            if record is not None and record.alive() and record.pid not in covered:
                covered |= _family(record)
                kills.append(CleanupAction(
                    f"kill orphan instance {home.name} of job {job_id} (pid {record.pid})",
                    _kill_action(record, 1.0)))
        # Step 2: its directories in the local cloud (the job's history stays in
        # its store: `spotnb logs` still shows it).
        dirs = ([groups[job_id]] if job_id in groups else []) + instances_of.get(job_id, [])
        if secretstore.local_path(job_id).exists():
            dirs.append(secretstore.local_path(job_id))
        count = len(instances_of.get(job_id, []))
        instances = f"{count} instance director{'y' if count == 1 else 'ies'}"
        if job_id not in groups:
            what = f"the {instances} of job {job_id} (its capacity group is gone)"
        elif finished and not alive:
            what = (f"the logs of finished job {job_id} (its capacity group and "
                    f"{instances}; its history stays in its store)")
        else:
            why = "its job has a result" if finished else "its supervisor is gone"
            what = f"capacity group {job_id} ({why}) and its {instances}"
        removals.append(CleanupAction(f"remove {what}", _remove_action(dirs)))
    for path in _subfiles(secretstore.local_dir()):
        job_id = path.name.removesuffix(".json")
        if job_id not in groups and job_id not in instances_of:
            removals.append(CleanupAction(
                f"remove the secrets of job {job_id} (it has no capacity group)",
                _remove_action([path])))
    for home in instances_of.get("None", []):
        removals.append(CleanupAction(f"remove the unreadable instance directory {home}",
                                      _remove_action([home])))
    for proc, instance_id, job_id in marked_processes():
        if job_id in live_jobs or proc.pid in covered:
            continue
        kills.append(CleanupAction(
            f"kill orphan process {proc.pid} of instance {instance_id} (job {job_id})",
            _kill_processes_action(proc)))
    for path in abandoned_socket_dirs():
        removals.append(CleanupAction(
            f"remove {path}, left by a killed agent (it holds its kernel's connection "
            "file, with the kernel's key)", _remove_action([path])))
    return kills + removals


def _family(record: ProcessRecord) -> set[int]:
    """The pids of a recorded process and its descendants (killing it kills them)."""
    proc = record.process()
    if proc is None:
        return set()
    try:
        return {proc.pid, *(child.pid for child in proc.children(recursive=True))}
    except psutil.Error:
        return {proc.pid}


def _subdirs(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_dir()) if path.is_dir() else []


def _instance_store(instances_of: dict[str, list[Path]], job_id: str) -> str | None:
    """The job's store URI from one of its instances' records (its group may be gone)."""
    for home in instances_of.get(job_id, []):
        uri = (read_json(home / "meta.json") or {}).get("store_uri")
        if uri:
            return str(uri)
    return None


def _subfiles(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("*.json") if p.is_file()) if path.is_dir() else []


def _kill_action(record: ProcessRecord, grace: float) -> Callable[[], None]:
    def apply() -> None:
        kill_tree(record, grace=grace)  # verifies the pid is still that process first
    return apply


def _kill_processes_action(proc: Any) -> Callable[[], None]:
    def apply() -> None:
        kill_processes([proc], grace=1.0)
    return apply


def _remove_action(paths: list[Path]) -> Callable[[], None]:
    def apply() -> None:
        for path in paths:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
    return apply


# The agent keeps the runtime's socket and its kernel's sockets and connection file
# (which holds the kernel's key) in a directory made with tempfile.mkdtemp(prefix=...).
AGENT_SOCKET_DIR_PREFIX = "spotnb-"


def abandoned_socket_dirs() -> list[Path]:
    """This user's agent socket directories in the temporary directory that no live
    process uses: left by agents that were killed (a clean exit removes its own).

    A directory counts once it holds the agent's socket or a kernel connection file
    (an agent binds its socket as it starts), and is abandoned when none of its sockets
    is bound any more (``/proc/net/unix``). Where that cannot be read, nothing is
    reported: a live agent's directory must never be removed.
    """
    bound = _bound_unix_sockets()
    if bound is None:
        return []
    found = []
    me = os.getuid()
    for path in sorted(Path(tempfile.gettempdir()).glob(AGENT_SOCKET_DIR_PREFIX + "*")):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != me:
                continue
            names = [p.name for p in path.iterdir()]
        except OSError:
            continue
        if "agent.sock" not in names and not any(re.fullmatch(r"k\d+\.json", n) for n in names):
            continue
        if any(str(path / name) in bound for name in names):
            continue
        found.append(path)
    return found


def _bound_unix_sockets() -> set[str] | None:
    """The paths of every bound Unix socket on this machine, or None if unknown."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return None
    # Num RefCount Protocol Flags Type St Inode [Path]
    return {parts[7] for line in lines if len(parts := line.split(None, 7)) == 8}
