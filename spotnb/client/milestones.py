"""The lines a followed job's log shows between the cell's output: interruptions,
resumes, retries, capacity fallbacks, a move to another region, warnings, a standby's
handover, a multi-node job's nodes and worlds (:func:`milestones`).

Each line is told from the event it is about and the job's fold as it stands after it
(:attr:`~spotnb.client.view.JobView.folded`): which attempt had a notice, whether a
checkpoint exists, the world before and after, the steps redone where nodes joined.
No line reads the agent's prose.
"""

from __future__ import annotations

import datetime
from typing import Any

from spotnb.client.view import JobView
from spotnb.protocol import layout
from spotnb.protocol.events import GROUP_STREAM, Event, codec
from spotnb.protocol.events.fold import JobState

__all__ = ["milestone", "milestones"]


def milestones(event: Event, view: JobView) -> list[tuple[Event, str]]:
    """The lines ``event`` brings (the view has applied it), each with the event it
    tells of (its time is the line's): its own (:func:`milestone`), and each join of
    nodes whose steps redone the fold learned with it (the training went on after the
    world re-formed: told with the ``joined`` event)."""
    out = []
    text = milestone(event, view)
    if text is not None:
        out.append((event, text))
    if view.folded.joins:
        for join, redone in view.joins_told():
            who = ", ".join(map(str, join.nodes)) or "a new node"
            who = f"node {who}" if join.nodes else who
            out.append((join.event, f"{who} joined: world {join.world_size}, "
                                    f"{_plural(redone, 'step')} redone (saved at step "
                                    f"{join.saved_step} before re-forming)"))
    return out


def milestone(event: Event, view: JobView | None = None) -> str | None:
    """A line for the events a user wants to see in the log: interruptions, resumes,
    retries, capacity fallbacks, warnings. None for every other event.

    One line per event: an interruption is its notice's line, a resume its boot's line.
    What happens in between (the final checkpoint, the restore) is status, which the
    display's header shows; a rebalance recommendation that comes with the notice says
    nothing more. ``view``, the state so far, tells which attempt had a notice.
    """
    body = codec.peek(event)
    if view is not None and view.multinode:
        text = _node_milestone(event, view)
        if text is not None:
            return text
    if view is not None and (text := _standby_milestone(event, body, view.folded)):
        return text
    if isinstance(body, codec.Status) and event.attempt != GROUP_STREAM:
        state, detail = body.state, body.detail
        if state == "booting" and not body.retrying:
            where = " ".join(str(p) for p in (body.instance_type, body.az) if p)
            if body.region and view is not None and _away(view.folded):
                where += f" in {body.region}"
            verb = "starting" if event.attempt == 1 else (
                "resuming on a replacement instance" if _has_checkpoint(view) else
                "starting again from the beginning on a replacement instance (no "
                "checkpoint was saved)")
            return f"attempt {event.attempt}: {verb}, {where} ({event.instance})"
        if state == "interrupted":
            if _noticed(view, event.attempt):
                return None  # the notice's line said it (and what follows it)
            return f"attempt {event.attempt}: {detail}"
        if state == "stopped":
            return detail
        return None
    if isinstance(body, codec.Notice):
        if body.moved:
            return (f"attempt {event.attempt}: {_moving_to(event, view)}; saving a "
                    "checkpoint, then the standby trains on from it")
        if body.interruption:
            when = _clock_of(body.notice_time)
            then = ("saving a checkpoint, then resuming on a replacement"
                    if _has_checkpoint(view) else
                    "no checkpoint yet: unless the cell saves one before the instance "
                    "goes, the next attempt starts from the beginning")
            return (f"attempt {event.attempt}: spot interruption notice for {event.instance} "
                    f"({body.action} at {when}); {then}")
        if _noticed(view, event.attempt):
            return None
        return (f"attempt {event.attempt}: rebalance recommendation for {event.instance}: "
                "it is at elevated risk of interruption; saving a checkpoint")
    if isinstance(body, codec.Instance) and body.standby_deferred:
        due = datetime.datetime.fromtimestamp(body.standby_due or event.time)
        return (f"rebalance recommendation for {event.instance} in its first hour: its "
                f"standby starts at {due.strftime('%H:%M:%S')}, to be ready as the hour "
                "ends (EC2 interrupting it before then makes it free)")
    if isinstance(body, codec.Instance) and body.boot_failed:
        last = next((line for line in reversed(body.log)
                     if not line.startswith("spotnb-boot:")), "")
        then = ("the job fails" if body.failures and body.limit and
                body.failures >= body.limit else "Auto Scaling launches another instance")
        count = f" ({body.failures} of {body.limit} in a row)" if body.failures else ""
        return (f"{body.instance_id or event.instance} failed to boot{count}: {body.reason}"
                f"{': ' + last if last else ''}; {then}. `%spot_logs` shows its log's end")
    if isinstance(body, codec.Region) and (body.moved or body.region != body.home):
        return _region_line(body)
    if isinstance(body, codec.Instance) and body.capacity_error:
        return (f"no spot capacity for {body.instance_type} in {body.az}: "
                "trying the next pool")
    if isinstance(body, codec.Warning):
        return f"warning: {body.text}"
    if isinstance(body, codec.Error) and body.retrying:
        return (f"attempt {event.attempt} failed with {body.ename}: {body.evalue}; "
                "retrying (max_restarts_on_error)")
    return None


def _noticed(view: JobView | None, attempt: int) -> bool:
    """Whether the fold says ``attempt`` had an interruption notice (or was moved to
    its standby): its ending statuses are then the notice's story, told already."""
    a = None if view is None else view.folded.attempts.get(attempt)
    return a is not None and a.noticed


def _away(state: JobState) -> bool:
    """Whether the job has run outside its home region (its region choices say)."""
    return any(r.region != r.home for _t, r in state.regions)


def _region_line(body: codec.Region) -> str:
    """The group's move to another region (or its start away from home), and what
    running there costs: the checkpoint sent to the home store and back."""
    home = body.home or "its home region"
    if body.moved:
        return (f"moving to {body.region}: {body.reason}; resuming there from the "
                f"checkpoint in the store in {home} (each save is sent home, at "
                "AWS's transfer price between regions)")
    return (f"starting in {body.region}, away from {home}: {body.reason} (each "
            "checkpoint is sent to the store in the home region, at AWS's transfer "
            "price between regions)")


def _has_checkpoint(view: JobView | None) -> bool:
    """Whether the job has a durable checkpoint (the fold's); without a view, assumed."""
    return view is None or bool(view.folded.checkpoints)


def _standby_milestone(event: Event, body: codec.Body | None, state: JobState
                       ) -> str | None:
    """A warm standby's news as the fold tells it (:meth:`StandbyState.story`): booting,
    ready, handed over in so many seconds, or given back at its cost."""
    if isinstance(body, codec.Instance) and (body.standby_for or body.standby_ready):
        instance = body.instance_id or event.instance
    elif isinstance(body, codec.Standby) and body.phase == "restored":
        instance = event.instance
    else:
        return None
    sb = state.standbys.get(str(instance))
    if sb is None:
        return None
    return next((text for t, text in sb.story(state) if t == event.time), None)


def _moving_to(event: Event, view: JobView | None) -> str:
    """An attempt's instance ended because its warm standby is ready (capacity
    rebalancing), in words: naming the standby where the fold knows it."""
    standby = None if view is None else next(
        (sb.instance_id for sb in view.folded.standbys.values()
         if sb.standby_for == event.instance), None)
    return f"its warm standby{f' {standby}' if standby else ''} is ready: moving to it"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _node_milestone(event: Event, view: JobView) -> str | None:
    """A multi-node job's milestones in its own terms: nodes join, are noticed or lost,
    and the world re-forms (None: the single-node wording applies, or nothing to say).

    A node is a node slot (``layout.node_slot``): attempts 1..MAX are the slots' first
    instances joining, later attempts replacements joining in a lost node's place.
    """
    body = codec.peek(event)
    if isinstance(body, codec.World):
        if view.world_changed is not event:
            return None
        nodes, size = view.world_nodes, view.world_size
        now = f"{_plural(nodes, 'node')}, world size {size}"
        if len(view.worlds) < 2:
            return f"world formed: {now} (--nodes {view.min_nodes}:{view.max_nodes})"
        before = view.worlds[-2][1]
        if nodes > before:
            return f"world re-formed at {now}: {_plural(nodes - before, 'node')} joined"
        if nodes < before:
            waiting = (" while a replacement boots" if nodes < view.max_nodes else "")
            return (f"world re-formed at {now}: going on without "
                    f"{_plural(before - nodes, 'lost node')}{waiting}")
        return f"world re-formed at {now}"
    if event.attempt == GROUP_STREAM:
        return None
    slot = layout.node_slot(event.attempt, view.max_nodes)
    who = f"node {slot} (attempt {event.attempt})"
    if isinstance(body, codec.Status) and body.state == "booting" and not body.retrying:
        where = " ".join(str(p) for p in (body.instance_type, body.az) if p)
        standby = view.folded.standbys.get(str(event.instance))
        how = ("joining" if event.attempt <= view.max_nodes
               else "its warm standby joining in its place"
               if standby is not None and standby.standby_for
               else "a replacement instance joining in the lost node's place")
        return f"{who}: {how}, {where} ({event.instance})"
    if isinstance(body, codec.Notice) and body.moved:
        return (f"{who}: {_moving_to(event, view)}; every rank saves a checkpoint, then "
                "the standby joins the world in its place")
    if isinstance(body, codec.Notice) and not body.interruption and \
            not _noticed(view, event.attempt):
        return (f"{who}: rebalance recommendation for {event.instance}: it is at elevated "
                "risk of interruption; every rank saves a checkpoint")
    if isinstance(body, codec.Notice) and body.interruption:
        when = _clock_of(body.notice_time)
        return (f"{who}: spot interruption notice for {event.instance} ({body.action} "
                f"at {when}); every rank saves a checkpoint, then "
                + _without_one(view))
    if isinstance(body, codec.Status) and body.state == "interrupted":
        if _noticed(view, event.attempt):
            return None  # the notice's line said it (and what follows it)
        return f"{who} lost: {body.detail}; " + _without_one(view)
    return None


def _without_one(view: JobView) -> str:
    """What the job does once one node of the current world is gone."""
    left = (view.world_nodes or view.max_nodes) - 1
    if left >= view.min_nodes:
        return f"the job goes on with {_plural(left, 'node')} while a replacement boots"
    return (f"the job waits for a replacement ({_plural(left, 'node')} left, at least "
            f"{view.min_nodes} needed)")


def _clock_of(iso_time: Any) -> str:
    """``2026-11-23T06:43:20Z`` as local clock time (``06:43:20``); else as given."""
    try:
        when = datetime.datetime.fromisoformat(str(iso_time).replace("Z", "+00:00"))
    except ValueError:
        return str(iso_time)
    return when.astimezone().strftime("%H:%M:%S")
