"""The warm-standby policy (spotnb.protocol.standby), which the local cloud's group and
the AWS instance agent both follow: its decisions at their edges, and the events it
builds as the fold reads them. The clouds' own tests (test_local_cloud, test_notify,
test_aws_provider) run it end to end."""

from __future__ import annotations

import pytest

from spotnb.protocol.billing import FREE_HOUR_SECONDS
from spotnb.protocol.events import Event
from spotnb.protocol.events.fold import fold
from spotnb.protocol.spec import Policy
from spotnb.protocol.standby import (
    GIVEN_BACK,
    STANDBY_HOLD_SECONDS,
    STANDBY_WARMUP_SECONDS,
    Do,
    ReadyMark,
    Standby,
    at_notice,
    deferred_event,
    given_back_event,
    on_recommendation,
    ready_event,
    standby_wait,
    while_booting,
)

BOOT = 90.0  # market seconds, as the AWS instance agent counts EC2's boot
DEFAULT = Policy()  # standby on, the first hour waits
# The last age at which a standby launched now is ready before the first hour ends.
LAST_WAIT = FREE_HOUR_SECONDS - BOOT - STANDBY_WARMUP_SECONDS


def recommend(policy: Policy = DEFAULT, *, ending: bool = False, runs_job: bool = True,
              standby: Standby = Standby.NONE, age: float = 4000.0) -> tuple[Do, float]:
    d = on_recommendation(policy, ending=ending, runs_job=runs_job, standby=standby,
                          age=age, boot_seconds=BOOT)
    return d.do, d.wait


def test_in_the_first_hour_the_standby_is_timed_to_be_ready_as_the_hour_ends() -> None:
    assert recommend(age=0) == (Do.DEFER, LAST_WAIT)
    assert recommend(age=1000) == (Do.DEFER, LAST_WAIT - 1000)
    # Its boot and warm-up fill what is left of the hour, or more: now.
    assert recommend(age=LAST_WAIT) == (Do.LAUNCH, 0.0)
    assert recommend(age=FREE_HOUR_SECONDS - 1) == (Do.LAUNCH, 0.0)
    assert recommend(age=2 * FREE_HOUR_SECONDS) == (Do.LAUNCH, 0.0)
    assert standby_wait(0, BOOT) == LAST_WAIT and standby_wait(LAST_WAIT + 1, BOOT) == 0
    # policy.standby_first_hour: at once, refund or not.
    assert recommend(Policy(standby_first_hour=True), age=0) == (Do.LAUNCH, 0.0)
    # Its time come, it launches, whatever a clock's rounding leaves of the wait.
    assert recommend(standby=Standby.DUE, age=LAST_WAIT - 1e-9) == (Do.LAUNCH, 0.0)


def test_a_recommendation_with_its_notice_starts_no_standby_the_notice_decides() -> None:
    assert recommend(ending=True)[0] is Do.NOTHING
    assert recommend(ending=True, standby=Standby.DUE)[0] is Do.NOTHING
    # A single-node job's instance: its replacement now, to boot in the notice period.
    assert at_notice(DEFAULT, nodes=1, booting=False, runs_job=True).do is Do.REPLACE
    # A node's comes after its loss; a standby (not the job's yet) gets none.
    assert at_notice(DEFAULT, nodes=2, booting=False, runs_job=True).do is Do.NOTHING
    assert at_notice(DEFAULT, nodes=1, booting=False, runs_job=False).do is Do.NOTHING
    # A standby booting for it is its replacement, on any number of nodes.
    for nodes in (1, 3):
        assert at_notice(DEFAULT, nodes=nodes, booting=True, runs_job=True).do \
            is Do.TAKEOVER


def test_a_standby_already_asked_or_one_not_running_the_job_gets_no_second() -> None:
    for age in (0.0, 4000.0):
        assert recommend(standby=Standby.ASKED, age=age)[0] is Do.NOTHING
    # Booting (its agent yet to take the lease) or a standby on hold: asked again later.
    assert recommend(runs_job=False, age=0)[0] is Do.LATER
    assert recommend(runs_job=False, standby=Standby.DUE)[0] is Do.LATER


def test_a_job_without_standbys_never_gets_one() -> None:
    off = Policy(standby=False)
    assert recommend(off)[0] is Do.NOTHING
    assert recommend(off, standby=Standby.DUE)[0] is Do.NOTHING
    assert at_notice(off, nodes=1, booting=False, runs_job=True).do is Do.NOTHING


def test_a_booting_standby_moves_the_job_once_ready_else_is_given_back_at_its_hold() -> None:
    def booting(*, ending: bool = False, ready: bool = False, waited: float = 10.0) -> Do:
        return while_booting(instance_ending=ending, ready=ready, waited=waited,
                             boot_seconds=BOOT).do

    hold = BOOT + STANDBY_HOLD_SECONDS
    assert booting() is Do.WAIT
    assert booting(ready=True) is Do.MOVE
    assert booting(waited=hold - 1) is Do.WAIT
    assert booting(waited=hold) is Do.GIVE_BACK
    # Ready at the last moment: moved, not given back.
    assert booting(ready=True, waited=hold) is Do.MOVE
    # Its instance noticed, ending or gone: it is the job's next, ready or not.
    assert booting(ending=True, ready=True) is Do.TAKEOVER
    assert booting(ending=True, waited=hold) is Do.TAKEOVER


def test_the_events_it_builds_tell_the_standby_s_story_in_the_fold() -> None:
    t0 = 1_800_000_000.0
    where = {"instance_type": "g4dn.xlarge", "az": "use1-az1", "pool": "g4dn.xlarge@use1-az1"}

    def launched(at: float, instance: str, **data: object) -> Event:
        return Event("instance", t0 + at, 0, instance, {
            "action": "launched", "instance_id": instance, "price": 0.36, "ondemand": 0.526,
            **where, **data})

    mark = ReadyMark.parse(f'{{"ready": {t0 + 130}, "kernel_started": {t0 + 120}, '
                           '"standby_for": "i-1", "step": 40}'.encode())
    events = [
        launched(0, "i-1"),
        # The local group says the standby's type and zone; the AWS agent its own id.
        deferred_event("i-1", t0 + 10, t0 + 3390, instance_id="i-1", **where),
        launched(3390, "i-2", standby_for="i-1"),
        ready_event("i-2", "i-1", mark, t0 + 9999, reported_by="i-1"),
        launched(4000, "i-3", standby_for="i-2"),
        given_back_event("i-3", "i-2", t0 + 4690, reported_by="i-2"),
    ]
    assert events[1].body.standby_deferred and events[1].data["standby_due"] == t0 + 3390
    assert [e.data["instance_id"] for e in events[1:]] == ["i-1", "i-2", "i-2", "i-3", "i-3"]
    state = fold(events)
    ready, given = state.standbys["i-2"], state.standbys["i-3"]
    assert (ready.standby_for, ready.ready, ready.kernel_started) == ("i-1", t0 + 130, t0 + 120)
    assert (given.standby_for, given.given_back) == ("i-2", t0 + 4690)
    assert state.instances["i-3"].end_reason == GIVEN_BACK
    assert state.instance_cost("i-3") == pytest.approx(0.36 * 690 / 3600)


@pytest.mark.parametrize("raw", [b"", b"[1]", b"not json", b'{"ready": "soon"}',
                                 b'{"ready": true, "standby_for": ""}'])
def test_a_ready_mark_that_says_nothing_usable_reads_as_empty(raw: bytes) -> None:
    mark = ReadyMark.parse(raw)
    assert mark == ReadyMark()
    # The event falls back to the time it was read at.
    assert ready_event("i-2", "i-1", mark, 5.0).time == 5.0
