"""What the header says about a job's progress, and the jobs listing.

:mod:`spotnb.client.progress` and the fold from scripted events (pace, time left, the time
and money an interruption took, steps redone, the header after a lost instance or a late
row), the loop's total found by ``spot.log`` (and given by
``spot.progress``), and ``spotnb jobs`` / ``%spot_jobs``: newest first, with the
instance, duration, cost, saving and last metric, and a note where names repeat.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import FrameType

import pytest

from spotnb.client import listing
from spotnb.client.jobs import JobInfo
from spotnb.protocol.events import Event
from spotnb.train.looptotal import loop_total

T0 = 1_800_000_000.0


def metric(attempt: int, step: int, at: float) -> Event:
    return Event("metric", T0 + at, attempt, f"i-{attempt}",
                 {"step": step, "t": T0 + at, "values": {"loss": 1.0}})


def booting(attempt: int, at: float) -> Event:
    return Event("status", T0 + at, attempt, f"i-{attempt}", {"state": "booting"})


def notice(attempt: int, at: float) -> Event:
    return Event("notice", T0 + at, attempt, f"i-{attempt}", {"kind": "instance-action"})


def test_the_redone_rule_is_one_for_every_view() -> None:
    """The fold's rule, which every view reads: an ended attempt's steps from the next
    logging attempt's first step on are redone; an attempt in between that logged
    nothing is passed over; late rows of the ended attempt raise the count."""
    from spotnb.protocol.events.fold import fold, replaced_attempt

    events = [booting(1, 0), *(metric(1, s, 1 + s / 10) for s in range(41)), notice(1, 6),
              booting(2, 10), notice(2, 12), booting(3, 20), metric(3, 31, 30)]
    state = fold(events)
    assert [(b.attempt, b.step, b.resumed_at, b.redone) for b in state.breaks()] == [
        (1, 40, 31, 10), (2, None, None, None)]
    state.apply_all(metric(1, s, 5) for s in range(41, 45))  # late rows of attempt 1
    assert state.breaks()[0].redone == 14 and state.redone_steps() == 14
    state.apply_all([notice(3, 35), booting(4, 40), metric(4, 50, 45), metric(4, 60, 46)])
    assert [b.redone for b in state.breaks()] == [14, None, 0]  # resumed past 3's last
    assert state.redone_steps() == 14
    assert replaced_attempt(5, {1, 3, 4}, 1) == 4
    assert replaced_attempt(1, set(), 1) is None
    assert replaced_attempt(4, {1, 2, 3}, 3) == 1  # node slot 0's previous attempt
    assert replaced_attempt(3, {1, 2}, 3) is None  # a node joining replaces none


def launched(instance: str, at: float, price: float = 0.36) -> Event:
    return Event("instance", T0 + at, 0, instance,
                 {"action": "launched", "instance_id": instance, "pool": "p@a",
                  "price": price, "ondemand": 1.0})


def test_late_rows_of_an_ended_attempt_count_as_redone_and_leave_the_step() -> None:
    """An ended attempt's last rows, read after the next attempt's first ones (the
    follower reads them from the log), still count: 25-29 were logged again; and the
    header's step stays the newest attempt's, its pace beside it (before, the late row
    moved "step X of N" back to 30 while the pace said 59's)."""
    from spotnb.client.display import JobView, header

    view = JobView(job_id="j", name="n", created=T0)
    events = [booting(1, 0), Event("progress", T0 + 1, 1, "i-1", {"total": 100})]
    events += [metric(1, s, s) for s in range(25)]
    events += [notice(1, 30), booting(2, 45)]
    events += [metric(2, s, 50 + s) for s in range(25, 60)]
    for event in [*events, *(metric(1, s, s) for s in range(25, 30))]:
        view.apply(event)
    (gone,) = view.folded.breaks()
    assert (gone.step, gone.redone) == (29, 5)
    assert view.step == 59 and view.folded.steps.step == 59
    view.now = T0 + 110
    h = header(view)
    assert h.step == "step 60 of 100 (60%)", h
    assert h.pace == "1 steps/s, 0:00:40 left", h


def test_pace_time_left_and_what_an_interruption_took() -> None:
    from spotnb.client.progress import projection
    from spotnb.protocol.events.fold import fold

    events = [launched("i-1", 0), Event("progress", T0 + 1, 1, "i-1", {"total": 100})]
    events += [metric(1, s, 10 + s / 2) for s in range(30)]  # 2 steps a second
    events += [notice(1, 25), launched("i-2", 30),
               Event("instance", T0 + 40, 0, "i-1", {"action": "terminated",
                                                     "instance_id": "i-1"}),
               booting(2, 45)]
    # The replacement resumes at step 20 (the last checkpoint), 4 steps a second.
    events += [metric(2, s, 50 + (s - 20) / 4) for s in range(20, 60)]
    state = fold(sorted(events, key=lambda e: e.time))
    steps = state.steps
    assert (steps.step, steps.total) == (59, 100)
    assert steps.rate() == pytest.approx(4.0)
    assert steps.seconds_left() == pytest.approx(40 / 4.0)
    (gone,) = state.breaks()
    assert gone.step == 29 and gone.redone == 10
    # No new step from 24.5 s (step 29) until step 30 at 52.5 s.
    assert state.lost_seconds(T0 + 100) == pytest.approx(28.0)
    spot, ondemand = state.lost_usd(T0 + 100)
    # i-1 billed from 24.5 s to 40 s, i-2 from 30 s to 52.5 s: 38 instance-seconds.
    assert spot == pytest.approx(38 * 0.36 / 3600)
    assert ondemand == pytest.approx(38 * 1.0 / 3600)
    proj = projection(state, T0 + 100, cost_usd=0.01, ondemand_cost_usd=0.05,
                      spot_price=0.36, ondemand_price=1.0)
    assert proj is not None
    assert proj.cost_usd == pytest.approx(0.01 + 10 / 3600 * 0.36)
    assert proj.ondemand_usd == pytest.approx(0.05 - 38 / 3600 + 10 / 3600)


def test_an_attempt_that_logged_nothing_takes_time_until_progress_resumes() -> None:
    from spotnb.protocol.events.fold import fold

    state = fold([booting(1, 0), *[metric(1, s, s) for s in range(10)], notice(1, 12),
                  booting(2, 15), notice(2, 25), booting(3, 30),
                  *[metric(3, s, 40 + s) for s in range(5, 20)]])
    first, second = state.breaks()
    assert second.step is None and second.recovered == T0 + 45
    # From step 9 (at 9 s) until step 10 (at 50 s); the second lies within it.
    assert state.lost_seconds(T0 + 100) == pytest.approx(41.0)
    assert first.redone == 5


def test_an_instance_lost_without_a_notice_counts_too() -> None:
    from spotnb.client.progress import launching
    from spotnb.protocol.events.fold import EndReason, fold

    state = fold([booting(1, 0), *[metric(1, s, s) for s in range(10)], booting(2, 30),
                  *[metric(2, s, 40 + s) for s in range(10)]])
    (gone,) = state.breaks()
    assert gone.reason is EndReason.LOST and gone.redone == 10 and gone.recovered is None
    assert state.interruptions() == 1
    assert launching(state) is None


def test_the_header_after_a_lost_instance_counts_the_interruption_it_prices() -> None:
    """An instance lost without a notice: the header's count and the "took ..., N
    steps redone" beside it are the same break's (before: "interruptions 0 (took
    0:01:10 and $0.01; 40 steps redone)"), and the result and the record say 1."""
    from spotnb.client.display import JobView, header
    from spotnb.client.jobs import summarize_state
    from spotnb.protocol.spec import JobSpec

    view = JobView(job_id="j", name="n", created=T0)
    for event in [launched("i-1", 0), booting(1, 1), *[metric(1, s, 10 + s) for s in range(40)],
                  launched("i-2", 60), booting(2, 70), *[metric(2, s, 80 + s) for s in range(50)]]:
        view.apply(event)
    view.now = T0 + 140
    h = header(view)
    assert h.interruptions == "interruptions 1", h
    assert h.lost.startswith("took 0:01:11 and $") and h.lost.endswith("; 40 steps redone"), h
    spec = JobSpec.from_json(json.dumps({
        "job_id": "j", "name": "n", "code": "pass", "provider": "local",
        "store_uri": "/tmp/none", "created": T0,
        "resources": {"instance_types": ["g5.xlarge"]},
        "policy": {"checkpoint_every": {"seconds": 60.0, "steps": None}}}))
    assert summarize_state(spec, view.folded, None).interruptions == 1


def _total_seen_by_log(code: str, **names: object) -> int | None:
    """What :func:`loop_total` says inside ``log`` called from ``code`` (registered in
    linecache, as IPython does with a cell)."""
    import linecache

    filename = f"<cell-{abs(hash(code))}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    seen: list[int | None] = []

    def log(*_args: object, **_kw: object) -> None:
        caller: FrameType = sys._getframe(1)
        seen.append(loop_total(caller))

    exec(compile(code, filename, "exec"), {"log": log, **names})
    return seen[0]


@pytest.mark.parametrize(("code", "total"), [
    ("for step in range(start, STEPS):\n    log(step, loss=1)\n    break\n", 300),
    ("for i in range(2 * STEPS):\n    x = i\n    log(i)\n    break\n", 600),
    ("for i in range(0, len(data), 2):\n    log(i)\n    break\n", 4),
    ("for i in range(STEPS):\n    log(i + 1)\n    break\n", None),  # not the loop variable
    ("for i in range(fetch()):\n    log(i)\n    break\n", None),  # not re-evaluated
    ("for b in batches:\n    log(b)\n    break\n", None),
])
def test_spot_log_finds_the_total_of_its_loop(code: str, total: int | None) -> None:
    calls: list[int] = []

    def fetch() -> int:
        calls.append(1)
        return 5

    found = _total_seen_by_log(code, start=0, STEPS=300, data=[1, 2, 3, 4], batches=[7],
                               fetch=fetch)
    assert found == total
    assert len(calls) == (1 if "fetch" in code else 0)  # the loop's own call only


def test_spot_progress_sets_the_total(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                      ) -> None:
    monkeypatch.chdir(tmp_path)  # standalone mode keeps its files here
    from spotnb.train import runtime

    try:
        runtime.progress(total=1234)
        assert runtime._rt().total == 1234
    finally:
        runtime._finish()


# -- the jobs listing ----------------------------------------------------------------------

def test_the_listing_is_newest_first_with_the_facts_and_notes_shared_names() -> None:
    old = JobInfo(job_id="20250101-000000-aaaaaa", name="run", status="completed",
                  attempts=3, interruptions=2, cost_usd=0.02, created=T0,
                  instance_type="g5.xlarge", duration=3725.0, ondemand_cost_usd=0.05,
                  metric=("loss", 0.12345))
    new = JobInfo(job_id="20250102-000000-bbbbbb", name="run", status="waiting_for_capacity",
                  attempts=0, interruptions=0, cost_usd=0.0, created=T0 + 86400)
    table, notes = listing.jobs_table([old, new], T0 + 2 * 86400)
    assert [row[0] for row in table] == [new.job_id, old.job_id]
    row = dict(zip(listing.JOB_COLUMNS, table[1], strict=True))
    assert row == {"job": old.job_id, "name": "run", "status": "completed",
                   "instance": "g5.xlarge", "duration": "1:02:05", "cost $": "0.0200",
                   "saving": "60%", "last metric": "loss 0.1235", "attempts": "3",
                   "interruptions": "2", "nodes": "1", "age": "2d"}
    assert table[0][2] == "waiting for capacity" and table[0][6] == ""
    assert notes == ["1 name(s) are shared by several jobs (run): a name picks the newest "
                     "of its jobs; give the job id for another"]


def test_a_multi_node_job_counts_every_step_logged_again() -> None:
    """--nodes 2:3: the node of global rank 0 (attempt 3) is killed after step 33; the
    survivors re-form from the checkpoint of step 9 and global rank 0 is now on attempt
    2, which logged nothing before; later the node of attempt 2 stays rank 0 while a
    peer is lost and it redoes steps 40-44 within its own attempt. Every step that ran
    twice counts: 24 + 5, in one rule for every view (before, the header counted rows
    logged again and the fold only whole attempts: 22 and 0)."""
    from spotnb.protocol.events.fold import fold

    state = fold([*(metric(3, s, s) for s in range(34)),
                  *(metric(2, s, 40 + s) for s in range(10, 45)),
                  *(metric(2, s, 90 + s) for s in range(40, 60))], max_nodes=3)
    assert state.redone_steps() == 24 + 5
    assert [s.redone for s in state.steps.segments] == [None, 24, 5]


def test_a_multi_node_break_resumes_where_its_redone_count_was_taken() -> None:
    """A 2-node job: rank 0's rows came from node slot 0 (attempt 1); after a notice to
    that node the world re-formed with rank 0 on slot 1's node (attempt 2), and slot 0's
    replacement (attempt 3) logs nothing. The break's resume point and its redone count
    are both taken against attempt 2's first row."""
    from spotnb.protocol.events.fold import fold

    events = [Event("status", T0 + n, n, f"i-{n}", {"state": "booting"}) for n in (1, 2)]
    events += [metric(1, s, 10 + s) for s in range(41)]
    events += [Event("notice", T0 + 51, 1, "i-1", {"kind": "instance-action"}),
               Event("status", T0 + 80, 3, "i-3", {"state": "booting"})]
    events += [metric(2, s, 90 + s) for s in range(31, 60)]
    (gone,) = fold(events, max_nodes=2).breaks()
    assert (gone.attempt, gone.step, gone.resumed_at, gone.redone) == (1, 40, 31, 10)


def test_rank_0_back_on_an_earlier_node_slot_redoes_no_step() -> None:
    """A 2-node job whose nodes moved to their standbys one at a time (a recommendation
    for both): rank 0's rows came from slot 1's node (attempt 2) up to step 12, where it
    moved; the world re-formed with rank 0 on slot 0's node (attempt 1), which logged
    13-18 and moved in turn; slot 1's standby (attempt 4) went on from 19, slot 0's
    (attempt 3) logs nothing. Every step was logged once: none is redone, though a
    lower attempt number logged after a higher one (the fold counted 19)."""
    from spotnb.protocol.events.fold import fold

    events = [Event("status", T0 + n, n, f"i-{n}", {"state": "booting"}) for n in (1, 2)]
    events += [metric(2, s, 10 + s) for s in range(13)]
    events += [Event("status", T0 + 30, 4, "i-4", {"state": "booting"})]
    events += [metric(1, s, 40 + s) for s in range(13, 19)]
    events += [Event("status", T0 + 60, 3, "i-3", {"state": "booting"})]
    events += [metric(4, s, 70 + s) for s in range(19, 24)]
    state = fold(events, max_nodes=2)
    assert [(b.attempt, b.step, b.resumed_at, b.redone) for b in state.breaks()] == [
        (1, 18, 19, 0), (2, 12, 13, 0)]
    assert state.redone_steps() == 0
