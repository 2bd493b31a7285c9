"""A stand-in for the agent (spotnb.kernel_remote), run by the local cloud in its tests.

It behaves towards the capacity group as the real agent must: it learns who it is from
the instance-metadata service (IMDSv2), takes the job's lease, writes its attempt's
events with its instance id, polls ``spot/instance-action`` (and logs the rebalance
recommendation once, when it first sees it), and on a notice releases the lease and
waits to be terminated. Instead of running user code it logs a metric
every 0.1 s.

Environment: ``STANDIN_MODE`` ``run`` (default), ``crash`` (exit 3 at once) or
``ignore-stop`` (never stops by itself); ``STANDIN_STEPS`` (finish with a ``completed``
result after that many steps; 0 = never); ``STANDIN_CHECKPOINT_AT`` (the step that
writes a durable checkpoint event); ``STANDIN_ESCAPEES=1`` starts two processes that
try to outlive the instance (one with ``env={}``, one double-forked into a new session
that ignores SIGTERM) and writes their pids to ``escapees.json``. It writes
``identity.json`` and, after a notice, ``notice.json`` in its working directory (the
instance directory).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from spotnb.protocol import lease
from spotnb.protocol.events import EventWriter
from spotnb.protocol.layout import RESULT, STOP
from spotnb.protocol.store import Store, open_store
from spotnb.providers.imds import ImdsClient, ImdsError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True)
    args = parser.parse_args()
    mode = os.environ.get("STANDIN_MODE", "run")
    steps = int(os.environ.get("STANDIN_STEPS", "0"))
    checkpoint_at = int(os.environ.get("STANDIN_CHECKPOINT_AT", "0"))

    imds = ImdsClient()
    me = imds.identity()
    Path("identity.json").write_text(json.dumps({**me, "pid": os.getpid()}))
    if mode == "crash":
        print("stand-in agent: crashing on purpose", file=sys.stderr)
        return 3

    if os.environ.get("STANDIN_ESCAPEES") == "1":
        escape()
    store = open_store(args.job)
    held = None
    while held is None:
        held = lease.acquire(store, me["instance_id"])
        if held is None:
            time.sleep(0.1)
    events = EventWriter(store, attempt=held.epoch, instance=me["instance_id"],
                         flush_seconds=0.1)
    events.emit("status", state="running", instance_type=me["instance_type"], az=me["az_id"])
    step = 0
    rebalance_seen = False
    while True:
        step += 1
        events.emit("metric", step=step, t=time.time(), values={"loss": 1.0 / step})
        if step == checkpoint_at:
            events.emit("checkpoint", phase="durable", id=f"ckpt-{step}", step=step, bytes=1,
                        seconds=0.0, forced=False)
        try:
            action = imds.instance_action()
            rebalance = None if rebalance_seen else imds.rebalance()
        except ImdsError:  # the metadata service is gone (its supervisor died): go on
            action = rebalance = None
        if rebalance is not None:  # as the agent does: logged once, when first seen
            rebalance_seen = True
            events.emit("notice", kind="rebalance", action="rebalance",
                        notice_time=rebalance["noticeTime"])
            events.flush()
        if action is not None:
            events.emit("notice", kind="instance-action", action=action["action"],
                        notice_time=action["time"])
            events.close()
            held.release()
            Path("notice.json").write_text(json.dumps({**action, "step": step,
                                                       "rebalance": imds.rebalance()}))
            while True:  # parked: the instance is about to be terminated
                time.sleep(1)
        if mode != "ignore-stop" and store.exists(STOP):
            return finish(store, events, "stopped", "stop requested")
        if steps and step >= steps:
            return finish(store, events, "completed", "")
        if step % 10 == 0:
            held.renew()
        time.sleep(0.1)


# A daemon: double fork, new session, SIGTERM ignored; it says its pid in a file.
_DAEMON = """
import os, signal, sys, time
if os.fork():
    os._exit(0)
os.setsid()
if os.fork():
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(1)
"""


def escape() -> None:
    bare = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(1)"],
                            env={})
    subprocess.run([sys.executable, "-c", _DAEMON, "daemon.pid"], check=True)
    while not Path("daemon.pid").exists():
        time.sleep(0.05)
    pids = {"bare": bare.pid, "daemon": int(Path("daemon.pid").read_text())}
    Path("escapees.json.tmp").write_text(json.dumps(pids))
    os.replace("escapees.json.tmp", "escapees.json")


def finish(store: Store, events: EventWriter, status: str, reason: str) -> int:
    events.emit("result", status=status, reason=reason)
    events.close()
    store.put_if_absent(RESULT, json.dumps({"status": status, "reason": reason}).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
