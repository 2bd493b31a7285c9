"""A test's pause at the first instruction of a local-cloud instance's first process.

Python imports ``sitecustomize`` at start-up from its search path. A test that puts
this directory first on ``PYTHONPATH`` (instances inherit it) and names a gate in
``SPOTNB_TEST_HOLD`` (instances inherit ``SPOTNB_*``) can hold the next instance that a
job starts: the test writes the job's id to ``<gate>.armed``; the first instance reaper
of that job to start claims it (a rename: only one can), writes its pid to
``<gate>.pid`` and stops itself (SIGSTOP) before any of its own code has run; the test
does what it must meanwhile (kill the supervisor) and resumes it (SIGCONT). A process
that is not such a reaper, or starts with no gate armed for its job, goes on at once.
See ``helpers.StartupHold``.
"""

import os
import signal


def _hold() -> None:
    gate = os.environ.get("SPOTNB_TEST_HOLD")
    job = os.environ.get("SPOTNB_LOCAL_JOB_ID")
    if not gate or not job or not os.path.exists(gate + ".armed"):
        return
    try:
        with open("/proc/self/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(gate + ".armed") as f:
            wanted = f.read().strip()
    except OSError:
        return
    if b"spotnb.providers.local.reaper" not in argv or wanted != job:
        return
    try:
        os.rename(gate + ".armed", gate + ".claimed")
    except OSError:
        return  # another process of the job claimed it first
    with open(gate + ".pid.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(gate + ".pid.tmp", gate + ".pid")
    os.kill(os.getpid(), signal.SIGSTOP)


_hold()
