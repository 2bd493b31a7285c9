"""Folds, log reads and the notebook's CPU of one followed ``%%spot_train`` cell, before
and after one fold per followed cell (issue 37), measured in the same run.

Run by hand: ``python benchmarks/bench_follow.py [--rows N] [--before COMMIT]``.

What is measured is what the magics do for a followed cell: :func:`spotnb.client.
display.follow` with a renderer, then the job's record (``records.job_ended``). The job
is played into a local store by a writer (no instances: its log is what an agent and
its capacity group would write): a launch, attempt 1 logging ``loss`` and ``acc`` every
step in batches of 1,000 rows, a notice, a replacement that resumes 500 steps back, the
result and the instances' ends. Two ways to follow it:

* ``replay``: the job has ended; the cell re-attaches to it (its whole history in the
  first read of the log);
* ``live``: the writer plays the job while the cell follows it (about 10 s: the follow
  loop reads the log every 2 s and redraws every second).

and two renderers: the text display's (:func:`~spotnb.client.display.status_lines` at
each redraw) and the widget dashboard (:class:`~spotnb.widgets.dashboard.Dashboard`, its
widgets talking to a comm that records, as ``bench_dashboard.py`` does: no kernel).

Each variant runs in its own interpreter: "before" imports spotnb from ``COMMIT``'s tree
(``git archive`` into a temporary directory; default: the commit this work branched
from), "after" from this checkout. Each scenario runs twice: once counting (every
:class:`~spotnb.protocol.events.fold.JobState` made and whether it folded any event: a
fold from scratch; every :class:`~spotnb.protocol.events.reader.EventReader` made: a
read of the whole log), once timed (the notebook thread's CPU, ``time.thread_time``, over
the follow and the record; the writer's thread is not counted), reported per 1,000
metric rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
#: The commit this change branched from: the code "before" one fold per followed cell.
BEFORE = "010389d"
BATCH = 1_000  # rows per metrics event (the agent's relay sends up to 5,000)
T0 = 1_800_000_000.0


# -- the child: one scenario, on one tree --------------------------------------------------

def _record_comms() -> None:
    """Widgets talk to a comm that swallows what it is sent (no kernel)."""
    import comm

    class Sink:
        kernel = "sink"

        def __init__(self, **_kw: Any) -> None:
            self.comm_id = f"c{id(self):x}"

        def send(self, *_a: Any, **_kw: Any) -> None: ...
        def on_msg(self, *_a: Any) -> None: ...
        def on_close(self, *_a: Any) -> None: ...
        def close(self, *_a: Any, **_kw: Any) -> None: ...

    comm.create_comm = lambda **kw: Sink(**kw)  # type: ignore[assignment]


class TextLike:
    """The text display without IPython: the status lines at each redraw."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def update(self, view: Any) -> None:
        from spotnb.client import display

        self.lines = display.status_lines(view)

    def stream(self, name: str, text: str) -> None: ...

    def rich(self, *_a: Any) -> None: ...

    def milestone(self, view: Any, event: Any, text: str) -> None:
        self.update(view)

    def finished(self, view: Any, result: Any) -> None:
        self.update(view)

    def detached(self, view: Any) -> None: ...


def _play(store: Any, rows: int, pace: float) -> None:
    """Write the job's log (module docstring); ``pace``: seconds between batches."""
    import json as _json

    from spotnb.protocol import layout
    from spotnb.protocol.events import EventWriter, metrics_data

    group = EventWriter(store, 0, flush_seconds=0.5)
    launched = {"action": "launched", "pool": "g4dn.xlarge@use1-az1", "price": 0.2,
                "ondemand": 0.526, "instance_type": "g4dn.xlarge", "az": "use1-az1"}
    group.emit("instance", instance_id="i-1", **launched)
    first = EventWriter(store, 1, "i-1", flush_seconds=0.5)
    first.emit("status", state="booting", detail="attempt 1", instance_type="g4dn.xlarge",
               az="use1-az1")
    first.emit("progress", total=rows, source="range")
    half = rows // 2
    step = 0

    def batch(writer: Any, count: int) -> None:
        nonlocal step
        t = time.time()
        writer.emit("metrics", **metrics_data(
            (step + i, t + i * 1e-4, {"loss": 1.0 / (1 + step + i), "acc": 0.5})
            for i in range(count)))
        step += count
        if pace:
            time.sleep(pace)

    while step < half:
        batch(first, min(BATCH, half - step))
    first.emit("checkpoint", phase="durable", step=step - 500, id="c1", bytes=1 << 20)
    first.emit("notice", kind="instance-action", action="terminate",
               notice_time="2027-01-15T08:00:00Z")
    first.emit("status", state="interrupted", detail="spot interruption notice")
    first.close()
    group.emit("instance", instance_id="i-1", action="notice", reason="hazard")
    group.emit("instance", instance_id="i-2", **launched)
    group.emit("instance", instance_id="i-1", action="terminated",
               reason="spot-interruption")
    second = EventWriter(store, 2, "i-2", flush_seconds=0.5)
    second.emit("status", state="booting", detail="attempt 2", instance_type="g4dn.xlarge",
                az="use1-az1")
    step -= 500  # resumed from the checkpoint: 500 steps redone
    while step < rows:
        batch(second, min(BATCH, rows - step))
    store.put(layout.RESULT, _json.dumps({"status": "completed", "reason": "done",
                                          "attempt": 2, "time": time.time()}).encode())
    second.emit("result", status="completed", reason="the cell finished")
    second.emit("status", state="completed", detail="the cell finished")
    second.close()
    group.emit("instance", instance_id="i-2", action="terminated", reason="job-finished")
    group.close()


def child(rows: int, mode: str, renderer_name: str, count: bool) -> dict[str, Any]:
    """One followed cell (module docstring); what it cost."""
    import inspect

    from spotnb import records
    from spotnb.client import display
    from spotnb.client.jobs import JobHandle
    from spotnb.protocol import layout
    from spotnb.protocol.events import fold as fold_module
    from spotnb.protocol.events import reader
    from spotnb.protocol.spec import JobSpec, Policy, Resources
    from spotnb.protocol.store import open_store

    made: list[Any] = []
    readers = [0]
    if count:
        init = fold_module.JobState.__init__

        def counted(self: Any, *a: Any, **kw: Any) -> None:
            made.append(self)
            init(self, *a, **kw)

        fold_module.JobState.__init__ = counted  # type: ignore[method-assign]
        reader_init = reader.EventReader.__init__

        def counted_reader(self: Any, *a: Any, **kw: Any) -> None:
            readers[0] += 1
            reader_init(self, *a, **kw)

        reader.EventReader.__init__ = counted_reader  # type: ignore[method-assign]

    store = open_store(Path(os.environ["SPOTNB_HOME"]) / "store").child("jobs/bench")
    spec = JobSpec(job_id="bench", name="bench", code="x", provider="local",
                   resources=Resources(instance_types=("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time())
    store.put(layout.SPEC, spec.to_json().encode())
    writer = None
    if mode == "replay":
        _play(store, rows, pace=0.0)
    else:
        pace = 10.0 / (rows / BATCH)  # about 10 s of logging
        writer = threading.Thread(target=_play, args=(store, rows, pace), daemon=True)
    made.clear()  # the renderer is the cell's too: a dashboard's own fold counts
    if renderer_name == "dashboard":
        _record_comms()
        from spotnb.widgets.dashboard import Dashboard

        renderer: Any = Dashboard(show=False)
    else:
        renderer = TextLike()
    handle = JobHandle(store, spec)
    readers[0] = 0
    new_api = "on_events" in inspect.signature(display.follow).parameters
    # The old tree has no Curves: its record reads the log again.
    make_curves: Any = getattr(records.summary, "Curves", None)
    curves = make_curves() if make_curves is not None else None
    if writer is not None:
        writer.start()
    cpu = time.thread_time()
    wall = time.monotonic()
    if new_api:
        outcome = display.follow(handle, renderer, on_events=curves.add)  # type: ignore[union-attr]
    else:
        outcome = display.follow(handle, renderer)
    assert isinstance(outcome, display.Finished), outcome
    if new_api:
        record = records.job_ended(handle, outcome.result, outcome.state, curves)
    else:
        record = records.job_ended(handle, outcome.result)
    cpu = time.thread_time() - cpu
    wall = time.monotonic() - wall
    if writer is not None:
        writer.join()
    assert record is not None and record["status"] == "completed", record
    folds = sum(1 for s in made if s.first_time is not None)
    return {"rows": rows + 500, "cpu_s": cpu, "wall_s": wall, "folds": folds,
            "states": len(made), "log_reads": readers[0],
            "redone": record["redone_steps"], "interruptions": record["interruptions"],
            "cost_usd": record["cost_usd"]}


# -- the parent: both trees, side by side ---------------------------------------------------

def _tree(commit: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="spotnb-before-"))
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "spotnb"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out


def _run(tree: Path, rows: int, mode: str, renderer: str, count: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="spotnb-bench-home-") as home:
        env = {**os.environ, "PYTHONPATH": str(tree), "SPOTNB_HOME": home}
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--rows", str(rows), "--mode", mode,
             "--renderer", renderer, *(["--count"] if count else [])],
            env=env, check=True, capture_output=True, text=True, cwd=home)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--before", default=BEFORE)
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--mode", default="replay")
    parser.add_argument("--renderer", default="text")
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rows, args.mode, args.renderer, args.count)))
        return
    before = _tree(args.before)
    print(f"rows {args.rows:,} (+500 redone); before: {args.before}, after: this checkout")
    print("| follow | renderer | folds before | folds after | log reads before | "
          "log reads after | CPU ms / 1k rows before | after | after / before |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode in ("replay", "live"):
        for renderer in ("text", "dashboard"):
            got = {}
            for name, tree in (("before", before), ("after", REPO)):
                counted = _run(tree, args.rows, mode, renderer, count=True)
                timed = _run(tree, args.rows, mode, renderer, count=False)
                got[name] = {"folds": counted["folds"], "states": counted["states"],
                             "log_reads": counted["log_reads"], "cpu_s": timed["cpu_s"],
                             "wall_s": timed["wall_s"], "redone": timed["redone"],
                             "interruptions": timed["interruptions"],
                             "ms_per_1k": 1000 * timed["cpu_s"] / (timed["rows"] / 1000)}
            b, a = got["before"], got["after"]
            print(f"| {mode} | {renderer} | {b['folds']} | {a['folds']} | "
                  f"{b['log_reads']} | {a['log_reads']} | {b['ms_per_1k']:.2f} | "
                  f"{a['ms_per_1k']:.2f} | {a['ms_per_1k'] / b['ms_per_1k']:.2f} |",
                  flush=True)
            print(f"<!-- {mode} {renderer}: before {json.dumps(b)}; after {json.dumps(a)} -->",
                  flush=True)


if __name__ == "__main__":
    main()
