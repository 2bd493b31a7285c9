"""The job agent's process as the instance agent sees it, and the instance's power-off.

The instance agent (:mod:`.instance`) starts the job agent (``python -m
spotnb.kernel_remote``) as its child and writes its pid to :data:`AGENT_PID_FILE` in the
instance's working directory. Should the instance agent die while its job agent runs
(the boot script then starts it again), the new instance agent adopts that job agent
(:class:`Adopted`, watched by its pid) rather than start a second one beside it: the
training goes on, nothing is redone.

:func:`power_off` ends the instance: its launch template makes a power-off a termination
(``InstanceInitiatedShutdownBehavior=terminate``). The instance agent's last resort when
nobody else would end it (invariant 6: no instance is billed with nothing to do).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)

AGENT_MODULE = "spotnb.kernel_remote"
# The job agent's pid, in the instance's working directory.
AGENT_PID_FILE = "agent.pid"

__all__ = ["AGENT_MODULE", "AGENT_PID_FILE", "Adopted", "AgentProcess", "power_off",
           "start_job_agent"]


class AgentProcess(Protocol):
    """What the instance agent uses of its job agent's process (a :class:`subprocess.Popen`,
    or :class:`Adopted`)."""

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def terminate(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


class Adopted:
    """A job agent started by an earlier instance agent of this instance (one that
    died), watched by its pid. Its exit code is not ours to read: an exit reads as 1
    (the result, the notice and the stop request say what happened)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not alive(self.pid):
            self.returncode = 1
        return self.returncode

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def send_signal(self, sig: int) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, sig)


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, left for the init process to reap, has ended)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_job_agent(job_uri: str) -> int | None:
    """The pid of this job's job agent still running on this instance (from
    :data:`AGENT_PID_FILE`, checked against the process's command line), or None."""
    try:
        pid = int(Path(AGENT_PID_FILE).read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    if AGENT_MODULE.encode() in argv and job_uri.encode() in argv and alive(pid):
        return pid
    return None


def start_job_agent(job_uri: str, env: dict[str, str]) -> AgentProcess:
    """The job agent of ``job_uri``: the one an earlier instance agent of this instance
    started if it still runs, else a new one (output to ``agent.log``, its pid to
    :data:`AGENT_PID_FILE`)."""
    pid = running_job_agent(job_uri)
    if pid is not None:
        log.info("the job agent %d started before this instance agent still runs: "
                 "watching it", pid)
        return Adopted(pid)
    with open("agent.log", "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", AGENT_MODULE, "--job", job_uri],
                                stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        Path(AGENT_PID_FILE).write_text(f"{proc.pid}\n")
    except OSError as err:
        log.warning("could not write %s (%s): an instance agent started again would not "
                    "find this job agent", AGENT_PID_FILE, err)
    return proc


def power_off(why: str) -> bool:
    """End this instance (``poweroff``, else ``shutdown -h now``). False if neither
    could be run."""
    log.warning("%s: powering this instance off", why)
    for command in (["poweroff"], ["shutdown", "-h", "now"]):
        try:
            if subprocess.run(command, check=False, timeout=60).returncode == 0:
                return True
        except (OSError, subprocess.SubprocessError) as err:
            log.warning("%s failed: %s", " ".join(command), err)
    log.error("could not power this instance off; `spotnb aws cleanup` ends it")
    return False
