"""The first process of a local-cloud instance: what the instance's OS is to its agent.

On EC2 the end of an instance ends every process on it, however it detached. A local
instance is a process tree on this machine, so its first process plays that part::

    supervisor ─ reaper (this module; a child subreaper) ─ agent ─ kernel ─ ...
                   ▲ orphans of the agent's tree (a double fork, a setsid'd daemon,
                   └ a child started with env={}) are re-parented here, not to pid 1

Run as ``python -m spotnb.providers.local.reaper GRACE SUPERVISOR -- AGENT_CMD...``
(``SUPERVISOR``: the pid of the group's supervisor that started it). It becomes a
child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux), starts the agent with its
own environment, working directory and output, reaps every child, and when the agent
exits (its own end, a crash, SIGKILL) ends all the processes still below it: SIGTERM,
``GRACE`` seconds, SIGKILL, until none is left. Then it removes the agent's socket
directory (:data:`ENV_SOCKET_DIR`, which it made) and exits with the agent's exit code
(128 + N for an agent killed by signal N). SIGTERM to the reaper is passed on to the
agent, SIGKILL of the reaper kills the agent too (``PR_SET_PDEATHSIG``): the instance
ends as soon as the agent does.

An instance whose supervisor is gone asks for one (``LocalProvider.ensure_supervised``,
which starts one that adopts what is left), at two moments::

    boot       the supervisor died while this process started (between its launch and
               here: the group's replacement was booting): asked for before the agent
               starts, so that the agent finds its metadata service (served by the
               supervisor) and the instance a supervisor to end it
    the end    the agent ended by itself while the supervisor was gone (killed alone):
               its end is logged, and the instances the job left (one parked after
               its notice) are ended

The supervisor is named on the command line, not taken from ``getppid()`` here: a
supervisor killed before this process ran its first line would otherwise read as
this process's parent (init, or a subreaper), and its death would go unseen.

Where the reaper itself is killed outright, its tree's processes still carry the
instance's marker variable or its directory as their working directory:
:func:`spotnb.providers.local.state.marked_processes` finds them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from spotnb.providers.local.state import ENV_JOB_MARK, ENV_SOCKET_DIR

__all__ = ["ENV_SOCKET_DIR", "become_subreaper", "main"]

SOCKET_DIR_PREFIX = "spotnb-"
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1
# Processes may fork while they are being ended: try this many rounds at most.
_END_ROUNDS = 5
_POLL_SECONDS = 0.05


def become_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants this process's children rather than init's (Linux;
    ``on=False``: init's again); False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return int(ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER,
                                                           int(on))) == 0
    except (OSError, AttributeError):
        return False


def _reap() -> None:
    """Collect every child that has exited (orphans included), without waiting."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_descendants(grace: float) -> None:
    """SIGTERM every process below this one, ``grace`` seconds, SIGKILL; until none."""
    for _ in range(_END_ROUNDS):
        try:
            family = psutil.Process().children(recursive=True)
        except psutil.Error:
            return
        if not family:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            for proc in family:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                _reap()
                family = [p for p in family if _alive(p)]
                if not family:
                    break
                time.sleep(_POLL_SECONDS)
            if not family:
                break
    _reap()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """For the agent: SIGKILL when the reaper dies (``PR_SET_PDEATHSIG``), so that a
    kill of the instance's recorded process ends the instance outright, as before."""
    if not sys.platform.startswith("linux"):
        return None

    def arm() -> None:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the reaper died before that took effect
            os._exit(1)

    return arm


USAGE = "usage: python -m spotnb.providers.local.reaper GRACE SUPERVISOR -- AGENT_CMD..."


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 4 or args[2] != "--" or not args[1].isdigit():
        print(USAGE, file=sys.stderr)
        return 2
    grace, supervisor, cmd = float(args[0]), int(args[1]), args[3:]
    # Boot: a supervisor that died while this process started (see the module docstring).
    if os.getppid() != supervisor:
        _ask_for_supervisor("its supervisor died while it booted")
    become_subreaper()
    socket_dir = Path(tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX))
    agent: subprocess.Popen[bytes] | None = None
    signalled: list[int] = []

    def forward(signum: int, frame: object) -> None:
        signalled.append(signum)
        if agent is not None and agent.returncode is None:
            with contextlib.suppress(OSError):
                os.kill(agent.pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    code = 127
    try:
        agent = subprocess.Popen(cmd, env={**os.environ, ENV_SOCKET_DIR: str(socket_dir)},
                                 preexec_fn=_die_with_parent(os.getpid()))
        while True:
            try:
                pid, status = os.waitpid(-1, 0)  # the agent, or an orphan given to us
            except ChildProcessError:
                break
            if pid == agent.pid:
                code = os.waitstatus_to_exitcode(status)
                agent.returncode = code
                break
    except OSError as e:
        print(f"spotnb local cloud: cannot start the agent {cmd}: {e}", file=sys.stderr)
    finally:
        end_descendants(grace)
        shutil.rmtree(socket_dir, ignore_errors=True)
    # The end: an agent that ended by itself while the supervisor was gone.
    if not signalled and os.getppid() != supervisor:
        _ask_for_supervisor("its agent ended while its supervisor was gone")
    return code if code >= 0 else 128 - code


def _ask_for_supervisor(why: str) -> None:
    """Have the job supervised (``LocalProvider.ensure_supervised``): a supervisor that
    adopts this instance, or closes the books of a job that ended. Best effort: the
    instance goes on (or ends) either way.

    This process stops being a subreaper first: the supervisor it starts (detached,
    its starter exits) must not become its child, or the supervisor's end of this
    instance (its tree) would include the supervisor itself."""
    job_id = os.environ.get(ENV_JOB_MARK)
    if not job_id:
        return
    become_subreaper(False)
    try:
        from spotnb.providers.local import LocalProvider

        LocalProvider().ensure_supervised(job_id)
    except Exception as e:
        print(f"spotnb local cloud: could not ask for a supervisor ({why}): {e}",
              file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
