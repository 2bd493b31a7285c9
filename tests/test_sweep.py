"""Sweeps: ``spotnb.sweep`` and ``%%spot_sweep`` on the local cloud, with real jobs.

Each trial is a tiny cell (a few dozen steps of 0.1 s), so a sweep of four runs in
seconds. What is checked is what a user would notice: how many trials ran at once
(from the jobs' own events, not the driver's word), a pruned trial's instance gone at
once and the trial called pruned everywhere (its job, records, the jobs listing), the
budget, the cost that never decreases with refunds apart, one summary message, the
samplers, the refusals before anything starts (a metric the cell never logs among
them) and a metric no trial logs stopping the sweep at its first trial's end, a sweep
found again by ``%spot_attach``, listed, abandoned, stopped for good and resumed.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

pytest.importorskip("optuna", reason="optuna is not installed: pip install -e '.[dev]'")

import optuna

import spotnb
from spotnb.client import cli
from spotnb.client.jobs import attach
from spotnb.protocol import layout
from spotnb.protocol.events import EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.spec import SpecError
from spotnb.protocol.store import open_store
from spotnb.sweep import attach_sweep, state, stop_sweep, sweeps

# Every trial logs loss = lr * (1 + 1/(step+1)): a trial at lr 5 is above 1.0 from its
# first row, the others never; a ThresholdPruner at 1.0 prunes exactly that one.
CELL = """
import time
for step in range(STEPS):
    spot.log(step, loss=lr * (1 + 1 / (step + 1)))
    time.sleep(0.1)
"""
SETS = [{"lr": 0.1}, {"lr": 0.05}, {"lr": 0.02}, {"lr": 5.0}]


@pytest.fixture(autouse=True)
def _no_random_interruptions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")


@pytest.fixture(autouse=True)
def _quiet_optuna() -> Iterator[None]:
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    yield
    optuna.logging.set_verbosity(verbosity)


def cell(steps: int) -> str:
    return CELL.replace("STEPS", str(steps))


def instance_spans(job_ids: list[str]) -> list[tuple[float, float]]:
    """Each trial's instances, launch to end, from its job's events."""
    spans = []
    for job_id in job_ids:
        handle = attach(job_id)
        state = fold(EventReader(handle.store, batches=True).poll())
        for inst in state.instances.values():
            assert inst.end is not None, f"job {job_id}: instance {inst.instance_id} never ended"
            spans.append((inst.start, inst.end))
    return spans


def most_at_once(spans: list[tuple[float, float]]) -> int:
    points = sorted([(a, 1) for a, _b in spans] + [(b, -1) for _a, b in spans],
                    key=lambda p: (p[0], p[1]))
    return max(itertools.accumulate(d for _t, d in points))


def test_a_sweep_runs_k_at_once_prunes_at_once_and_sends_one_summary(
        spotnb_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from test_notify import Hook

    hook = Hook()
    try:
        made = spotnb.sweep(cell(60), params=SETS, parallel=2, name="swept",
                            pruner=optuna.pruners.ThresholdPruner(upper=1.0),
                            notify_url=hook.url)
        assert made.wait(timeout=240), made
        bodies = hook.wait_for(1)
    finally:
        hook.close()
    states = {t.params["lr"]: t.state for t in made.trials}
    assert states == {0.1: "completed", 0.05: "completed", 0.02: "completed",
                      5.0: "pruned"}, made.trials
    assert made.status == "completed" and made.best().params == {"lr": 0.02}
    # Never more than 2 instances at once, judged from the jobs' own events.
    job_ids = [t.job_id for t in made.trials]
    assert all(job_ids)
    assert most_at_once(instance_spans(job_ids)) == 2
    # The pruned trial's job was stopped at once: its instance ran a fraction of the
    # 6 s the cell takes, and it logged few rows. Its job says pruned, with the step
    # and the metric's value, wherever it is read: its summary, its record, the jobs
    # listing and the command line.
    pruned = attach(made.trials[3].job_id)
    result = pruned.summary()
    step = made.trials[3].pruned_at
    assert step is not None and step < 40
    assert result.status == "pruned" and result.reason.startswith(f"pruned at step {step} "
                                                                  "(loss "), result.reason
    from spotnb.records import job_record

    assert job_record(pruned)["status"] == "pruned" and pruned.status == "pruned"
    assert {r.name: r.status for r in spotnb.jobs()}["swept-t3"] == "pruned"
    cli.main(["jobs"])
    assert re.search(rf"swept-t3\s+pruned at step {step}\s", capsys.readouterr().out)
    cli.main(["logs", pruned.job_id])
    assert re.search(rf"pruned at step {step} \(loss [\d.]+\) by sweep sweep-\S+, trial 3",
                     capsys.readouterr().out)
    # One message for the sweep, none from its trials (they carry no webhook).
    assert len(hook.bodies) == 1, hook.bodies
    text = bodies[0]["text"]
    assert "sweep *swept* completed: 4 trials (3 completed, 1 pruned)" in text, text
    assert "best trial t2: loss 0.020" in text and "*lr=0.02*" in text, text
    assert "under on-demand" in text
    assert all(attach(j).spec.secrets == () for j in job_ids)
    # The sweep is in the store: found again, with every trial and its job, each
    # trial's parameters in its job's own facts (a comparison of them shows them).
    again = attach_sweep("swept")
    assert [t.job_id for t in again.trials] == job_ids and again.ended
    assert [again.runs[n].facts.status for n in range(4)] == \
        ["completed", "completed", "completed", "pruned"]
    assert [again.runs[n].facts.params for n in range(4)] == SETS
    # The jobs listing still reads: each trial a job named after the sweep.
    names = {row.name for row in spotnb.jobs()}
    assert {f"swept-t{n}" for n in range(4)} <= names


def test_the_budget_covers_the_whole_sweep(spotnb_home: Path) -> None:
    # One trial at a time, each far longer than the budget allows: the first is
    # stopped at the budget, the others never start.
    made = spotnb.sweep(cell(600), grid={"lr": [0.1, 0.2, 0.3]}, parallel=1,
                        budget_usd=0.0003, name="budgeted")
    assert made.wait(timeout=180), made
    assert [t.state for t in made.trials] == ["stopped", "skipped", "skipped"], made.trials
    assert made.status == "stopped" and "budget" in made.reason
    assert made.trials[1].job_id is None and made.trials[2].job_id is None
    spent = made.cost().billed_usd
    # Stopped at the budget: past it by what a stop takes at most, not by the cell's
    # minute.
    assert 0.0003 <= spent < 0.0003 * 3, spent


def test_a_study_s_sampler_picks_the_trials_and_is_told_their_values(
        spotnb_home: Path) -> None:
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0))
    space = {"lr": optuna.distributions.FloatDistribution(0.01, 0.1)}
    made = spotnb.sweep(cell(5), study=study, space=space, n_trials=3, parallel=3)
    assert made.wait(timeout=120), made
    assert [t.state for t in made.trials] == ["completed"] * 3, made.trials
    # The user's own study holds the trials, with the values the cells logged.
    done = study.get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert sorted(t.params["lr"] for t in done) == sorted(t.params["lr"] for t in made.trials)
    assert study.best_value == pytest.approx(min(t.value for t in made.trials))
    assert all(0.01 <= t.params["lr"] <= 0.1 for t in made.trials)


def test_a_named_sampler_picks_the_trials(spotnb_home: Path) -> None:
    # Random over a space of distributions, 3 trials; TPE over a grid's values, 2 of
    # its 4 combinations.
    space = {"lr": optuna.distributions.FloatDistribution(0.01, 0.1, log=True)}
    ranged = spotnb.sweep(cell(5), space=space, n_trials=3, sampler="random", parallel=3)
    gridded = spotnb.sweep(cell(5), grid={"lr": [0.01, 0.02, 0.03, 0.04]}, n_trials=2,
                           sampler="tpe", parallel=2)
    assert ranged.wait(timeout=120) and gridded.wait(timeout=120)
    assert [t.state for t in ranged.trials] == ["completed"] * 3, ranged.trials
    assert all(0.01 <= t.params["lr"] <= 0.1 for t in ranged.trials)
    assert len({t.params["lr"] for t in ranged.trials}) == 3
    assert ranged.definition["space"]["sampler"] == "RandomSampler"
    assert [t.state for t in gridded.trials] == ["completed"] * 2, gridded.trials
    assert {t.params["lr"] for t in gridded.trials} <= {0.01, 0.02, 0.03, 0.04}
    assert gridded.definition["space"]["sampler"] == "TPESampler"


# A cell whose metrics cannot be read off it (named with **): the check before launch
# cannot tell, the trials' rows do.
OPEN_CELL = """
import time
for step in range(STEPS):
    spot.log(step, **{"loss": lr, "acc": 1 - lr})
    time.sleep(0.1)
"""


@pytest.mark.timeout(180)
def test_a_metric_no_trial_logs_stops_the_sweep_at_the_first_trial_s_end(
        spotnb_home: Path) -> None:
    made = spotnb.sweep(OPEN_CELL.replace("STEPS", "20"), params=SETS[:3], parallel=1,
                        metric="val_accuracy")
    warned: list[str] = []
    made.listen(lambda what, _obj: warned.append(made.warning) if made.warning else None)
    assert made.wait(timeout=150), made
    # The first trial ran to its end; the others never started: the sweep stopped,
    # naming the metrics the trials log.
    assert [t.state for t in made.trials] == ["completed", "skipped", "skipped"]
    assert made.status == "stopped"
    assert "trial 0 ended without logging the sweep's metric: it logs loss, acc, not " \
           "val_accuracy" in made.reason, made.reason
    # While it ran, the sweep's line said so.
    assert any("trial 0 has logged loss, acc and no val_accuracy yet" in w for w in warned)


@pytest.mark.timeout(240)
def test_the_cost_never_decreases_and_refunds_are_shown_as_such(spotnb_home: Path) -> None:
    # One trial, interrupted once by the local cloud's EC2 in its first hour: that
    # instance is refunded. Running, the trial shows what it has cost so far.
    # The trial trains on until its interruption was seen (a gate the test opens):
    # however busy the machine, the interruption comes before the end.
    gate = spotnb_home / "gate"
    code = GATED.replace("STEPS", "40").replace("GATE", repr(str(gate)))
    made = spotnb.sweep(code, params=SETS[:1], parallel=1, simulate_interruptions=1,
                        checkpoint_every="10 steps")

    def open_once_interrupted() -> None:
        job_id = wait_until(lambda: made.trials and made.trials[0].job_id, 120,
                            "the trial's job")
        wait_until(lambda: attach(job_id).summary().interruptions >= 1, 180,
                   "the trial's interruption", interval=1.0)
        gate.touch()

    threading.Thread(target=open_once_interrupted, daemon=True).start()
    seen: list[tuple[float, float, bool]] = []

    def note(_what: str, _obj: Any) -> None:
        cost = made.cost()
        running = any(t.state == "running" for t in made.trials)
        seen.append((cost.cost_usd, cost.refunded_usd, running))

    made.listen(note)
    assert made.wait(timeout=200), made
    note("end", None)
    assert made.trials[0].state == "completed", made.trials
    costs = [c for c, _r, _running in seen]
    assert costs == sorted(costs), costs  # the cost never went down
    assert any(c > 0 for c, _r, running in seen if running)  # while running, not 0
    cost = made.cost()
    assert cost.refunded_instances == 1 and cost.refunded_usd > 0
    assert cost.billed_usd == pytest.approx(cost.cost_usd - cost.refunded_usd)
    from spotnb.sweep.view import summary_text

    assert f"${cost.refunded_usd:.4f} refunded: EC2 interrupted 1 instance in its first " \
           "hour" in summary_text(made)


GATED = """
import os, time
ck = spot.Checkpoint(progress={"n": 0})
step = ck.restore()
while step < STEPS or not os.path.exists(GATE):
    spot.log(step, loss=lr * (1 + 1 / (step + 1)))
    ck.maybe_save(step)
    time.sleep(0.1)
    step += 1
"""

CHECKPOINTED = """
import time
ck = spot.Checkpoint(progress={"n": 0})
for step in range(ck.restore(), STEPS):
    spot.log(step, loss=lr * (1 + 1 / (step + 1)))
    ck.maybe_save(step)
    time.sleep(0.1)
"""


def _no_job_started(home: Path) -> bool:
    return not list((home / "store").rglob(layout.SPEC)) and \
        not (home / "store" / "sweeps").exists()


def test_bad_input_is_refused_before_anything_starts(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"grid": {}}, "the grid is empty"),
        ({"grid": {"lr": []}}, "has no values"),
        ({"grid": {"lrr": [0.1]}}, "the cell does not read parameter 'lrr'"),
        ({"params": []}, "the list of parameter sets is empty"),
        ({"params": {"lr": [0.1]}}, "a dict of value lists is a grid"),
        ({"grid": {"lr": [0.1]}, "parallel": 0}, "parallel must be a whole number >= 1"),
        ({"grid": {"lr": [0.1]}, "budget_usd": -1}, "budget_usd must be above 0"),
        ({"study": optuna.create_study(), "space": {"lr": [0.1]}, "n_trials": 2},
         "each value must be an optuna distribution"),
        ({"grid": {"lr": [0.1]}, "instance_types": ["no.such"]}, "no.such"),
        # A metric the cell never logs (nothing else in it can log): refused, naming
        # those it logs.
        ({"grid": {"lr": [0.1]}, "metric": "val_loss"},
         "metric val_loss: the cell never logs 'val_loss': its spot.log calls name loss"),
        ({"grid": {"lr": [0.1]}, "sampler": "cmaes"}, "cmaes"),
        ({"grid": {"lr": [0.1, 0.2]}, "sampler": "qmc"},
         "sampler= qmc searches numeric ranges, and a grid's values are categories"),
        ({"params": [{"lr": 0.1}], "sampler": "tpe"}, "params= runs its sets in their order"),
        ({"study": optuna.create_study(), "sampler": "random", "n_trials": 2,
          "space": {"lr": optuna.distributions.FloatDistribution(0.01, 0.1)}},
         "the study picks its trials with its own sampler"),
        ({"space": {"lr": optuna.distributions.FloatDistribution(0.01, 0.1)}},
         "a space needs n_trials="),
        ({"grid": {"lr": [0.1]}, "sampler": "anneal"}, "sampler= takes one of tpe, random"),
    ]
    for options, words in cases:
        with pytest.raises(SpecError) as err:
            spotnb.sweep(cell(3), **options)
        assert words in str(err.value), (options, str(err.value))
    # The hints are in Python's syntax here; a parameter the cell does not read is
    # offered the names it does, not builtins (range) nor the runtime (spot).
    with pytest.raises(SpecError) as err:
        spotnb.sweep(cell(3), grid={"lr": []})
    assert "grid={'lr': [0.1, 0.01]}" in str(err.value)
    with pytest.raises(SpecError) as err:
        spotnb.sweep(cell(3), grid={"lrr": [0.1]})
    assert "first: lr)" in str(err.value), str(err.value)
    monkeypatch.setitem(sys.modules, "optuna", None)  # as if it were not installed
    with pytest.raises(SpecError, match=r"pip install 'spotnb\[sweep\]'"):
        spotnb.sweep(cell(3), grid={"lr": [0.1]})
    assert _no_job_started(spotnb_home)


def test_the_magic_refuses_bad_input_and_names_the_option(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from IPython.core.error import UsageError
    from IPython.core.getipython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "spotnb")
    monkeypatch.chdir(tmp_path)
    shell.user_ns["sets"] = []
    for line, words in [("--grid lr=0.1 -k 0", "-k/--parallel must be a whole number"),
                        ("--grid lrr=0.1,0.2", "does not read parameter 'lrr'"),
                        # The hints in the syntax typed.
                        ("--grid lr=", "has no values: give at least one, e.g. "
                                       "--grid lr=0.1,0.01"),
                        ("--params sets", r"then --params sets"),
                        ("", "needs one of --grid"),
                        ("--params nothing", "no variable 'nothing'"),
                        ("--grid lr=0.1 --metric val_loss",
                         "--metric val_loss: the cell never logs 'val_loss'"),
                        ("--grid lr=0.1,0.2 --sampler cmaes", "--sampler cmaes"),
                        ("--grid lr=0.1,0.2 --sampler qmc",
                         "--space VAR --trials N, VAR a dict of optuna.distributions")]:
        with pytest.raises(UsageError, match=re.escape(words) if "[" in words else words):
            shell.run_cell_magic("spot_sweep", line, cell(3))
    with pytest.raises(UsageError) as err:
        shell.run_cell_magic("spot_sweep", "--grid lrr=0.1", cell(3))
    assert "first: lr)" in str(err.value)  # not range, nor spot
    assert _no_job_started(spotnb_home)


def test_prune_with_a_study_prunes_with_the_study_s_pruner() -> None:
    from spotnb.client.sweepmagic import sweep_pruner

    args = type("Args", (), {"pruner": None, "prune": True})()
    study = optuna.create_study(pruner=optuna.pruners.PercentilePruner(25.0))
    assert sweep_pruner(args, study) == (study.pruner, "")
    # A study without a pruner of its own: Optuna's median pruner.
    nop = optuna.create_study(pruner=optuna.pruners.NopPruner())
    pruner, _note = sweep_pruner(args, nop)
    assert isinstance(pruner, optuna.pruners.MedianPruner)
    # Without --prune a study's pruner (Optuna's default is the median) prunes
    # nothing, and the user is told how to have it.
    args.prune = False
    pruner, note = sweep_pruner(args, study)
    assert isinstance(pruner, optuna.pruners.NopPruner)
    assert "PercentilePruner prunes nothing here: add --prune" in note


_DRIVER = """
import json, os, time
import spotnb
made = spotnb.sweep({code!r}, params={sets!r}, parallel=1, name="orphan")
# Until the store says trial 0 runs (its job id saved), as a kernel closed mid-sweep.
while not json.loads(made.store.get("state.json"))["trials"][0]["job_id"]:
    time.sleep(0.05)
print(made.sweep_id, flush=True)
os._exit(0)  # the kernel is gone: its driver with it
"""


def _orphan(sets: list[dict[str, Any]], steps: int = 20) -> str:
    """A sweep whose driver's process died once trial 0 started: its id."""
    script = _DRIVER.format(code=cell(steps), sets=sets)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True,
                         capture_output=True, text=True, env=os.environ, timeout=120)
    return out.stdout.split()[-1]


@pytest.mark.timeout(180)
def test_an_abandoned_sweep_is_listed_as_such_starts_nothing_and_is_stopped_for_good(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    sweep_id = _orphan(SETS[:3], steps=600)  # trial 0 runs a minute, if let be
    monkeypatch.setattr(state, "HEARTBEAT_STALE_SECONDS", 1.0)
    wait_until(lambda: [i.status for i in sweeps()] == ["abandoned"], 30,
               "the sweep to read abandoned once its driver's heartbeat is stale")
    cli.main(["sweeps"])
    listed = capsys.readouterr().out
    assert re.search(rf"{sweep_id}\s+orphan\s+abandoned\s+2 waiting, 1 running", listed), \
        listed
    # Attached without --resume: followed as it stands, no trial started here.
    made = attach_sweep(sweep_id)
    assert made.abandoned and not made.driving
    made.detach()
    assert made.wait(timeout=30)
    # spotnb stop ends it for good: its running trial's job stopped, the others never
    # started, the store says stopped, and a later attach starts nothing.
    assert cli.main(["stop", "orphan"]) == 0
    said = capsys.readouterr().out
    assert f"sweep {sweep_id} ('orphan') stopped for good" in said, said
    job = attach(made.trials[0].job_id)
    summary = job.summary()
    assert summary.status == "stopped", summary
    assert wait_until(lambda: not fold(EventReader(job.store, batches=True).poll())
                      .running_instances(), 60, "the trial's instance to end")
    again = attach_sweep(sweep_id, resume=True)
    assert again.ended and not again.driving and again.status == "stopped"
    assert [t.state for t in again.trials] == ["stopped", "skipped", "skipped"]
    assert again.trials[1].job_id is None and again.trials[2].job_id is None
    assert [r.name for r in spotnb.jobs()] == ["orphan-t0"]
    assert [i.status for i in sweeps()] == ["stopped"]
    assert stop_sweep(sweep_id).already_ended


_ALIVE = """
import spotnb
made = spotnb.sweep({code!r}, params={sets!r}, parallel=1, name="alive")
print(made.sweep_id, flush=True)
made.wait()
print("ended", made.status, made.reason, flush=True)
"""


@pytest.mark.timeout(180)
def test_stopping_a_sweep_driven_elsewhere_ends_its_driver(spotnb_home: Path) -> None:
    # The driver lives in another process (another kernel): the stop request in the
    # store reaches it; its trial is stopped and it starts no other.
    script = _ALIVE.format(code=cell(600), sets=SETS[:2])
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                            stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert proc.stdout is not None
        sweep_id = proc.stdout.readline().split()[-1]
        prefix = state.sweep_prefix(open_store(spotnb_home / "store"), sweep_id)
        wait_until(lambda: (state.read_state(prefix) or ({}, ""))[0].get("trials", [{}])[0]
                   .get("state") == "running", 60, "trial 0 to start")
        done = stop_sweep("alive", reason="test")
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert out.startswith("ended stopped stop requested (test)"), out
    assert done.status == "stopped" and not done.already_ended
    found = state.read_state(prefix)
    assert found is not None
    assert [t["state"] for t in found[0]["trials"]] == ["stopped", "skipped"]


@pytest.mark.timeout(180)
def test_a_sweep_whose_driver_is_gone_is_taken_over_on_attach_with_resume(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sweep_id = _orphan(SETS[:2])
    monkeypatch.setattr(state, "HEARTBEAT_STALE_SECONDS", 1.0)
    made = attach_sweep(sweep_id, resume=True)
    wait_until(lambda: made.driving, 30, "this process to take the sweep over")
    assert made.wait(timeout=150), made
    assert [t.state for t in made.trials] == ["completed"] * 2, made.trials
    # The first trial was the old driver's, the second this process's: each ran once.
    assert len({t.job_id for t in made.trials}) == 2
    assert len([r for r in spotnb.jobs() if r.name.startswith("orphan-t")]) == 2
    kept = json.loads(made.store.get(state.STATE_KEY))
    assert kept["status"] == "completed" and kept["driver"].endswith(f":{os.getpid()}")


# -- the magic in a real kernel, and %spot_attach -------------------------------------------

@pytest.mark.timeout(180)
def test_spot_sweep_in_a_kernel_keeps_each_trial_s_record_and_reattaches(
        spotnb_home: Path, tmp_path: Path) -> None:
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(tmp_path))
    try:
        kc.execute_interactive("%load_ext spotnb", timeout=60)
        messages: list[dict[str, Any]] = []
        reply = kc.execute_interactive(
            f"%%spot_sweep --grid lr=0.1,0.05 -k 2 --name kernel-sweep\n{cell(10)}",
            timeout=150, output_hook=messages.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        shown = [m["content"] for m in messages if m["msg_type"] == "display_data"]
        jobs = [c["metadata"]["spotnb"]["job"] for c in shown
                if "job" in c.get("metadata", {}).get("spotnb", {})]
        assert sorted(j["name"] for j in jobs) == ["kernel-sweep-t0", "kernel-sweep-t1"]
        (summary,) = [c for c in shown if "sweep" in c.get("metadata", {}).get("spotnb", {})]
        assert "2 trials (2 completed)" in summary["data"]["text/plain"]
        # The view's final form, for readers without widgets: its output updated to
        # the end, and the picture of the analysis and the curves with the table.
        updated = [m["content"]["data"] for m in messages
                   if m["msg_type"] == "update_display_data"]
        assert any("kernel-sweep completed: 2 trials" in d.get("text/plain", "")
                   for d in updated), updated
        (static,) = [c for c in shown
                     if c.get("metadata", {}).get("spotnb", {}).get("figure") == "sweep"]
        page = static["data"]["text/html"]
        assert "data:image/png;base64," in page and "<script" not in page
        assert sorted(static["metadata"]["spotnb"]["job_ids"]) == sorted(
            j["job_id"] for j in jobs)
        # Optuna's own "A new study created in memory" is not the user's output.
        streams = "".join(m["content"].get("text", "") for m in messages
                          if m["msg_type"] == "stream")
        assert "study created" not in streams, streams
        sweep_id = next(p.name for p in (spotnb_home / "store" / "sweeps").iterdir())
        # After a kernel restart: the comparison of its two trials, from the store.
        km.restart_kernel(now=True)
        kc.wait_for_ready(timeout=60)
        kc.execute_interactive("%load_ext spotnb", timeout=60)
        messages.clear()
        reply = kc.execute_interactive(f"%spot_attach {sweep_id}", timeout=60,
                                       output_hook=messages.append)
        assert reply["content"]["status"] == "ok", reply["content"]
        texts = [m["content"]["data"].get("text/plain", "") for m in messages
                 if m["msg_type"] == "display_data"]
        assert any("kernel-sweep completed: 2 trials" in t for t in texts), texts
        # The comparison of its trials, a row each.
        (view,) = [m["content"]["data"] for m in messages if m["msg_type"] == "display_data"
                   and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
        assert re.search(r"\nt0\s+0\.1\s+completed", view["text/plain"]), view["text/plain"]
        assert re.search(r"\nt1\s+0\.05\s+completed", view["text/plain"])
        messages.clear()
        kc.execute_interactive("%spot_jobs", timeout=60, output_hook=messages.append)
        table = "".join(m["content"]["data"].get("text/plain", "") for m in messages
                        if m["msg_type"] == "display_data")
        assert "kernel-sweep-t0" in table and "kernel-sweep-t1" in table
        # A sweep that has ended: nothing to stop.
        messages.clear()
        kc.execute_interactive(f"%spot_sweep_stop {sweep_id}", timeout=60,
                               output_hook=messages.append)
        said = "".join(m["content"].get("text", "") for m in messages
                       if m["msg_type"] == "stream")
        assert "had already ended (completed); nothing to stop" in said, said
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
