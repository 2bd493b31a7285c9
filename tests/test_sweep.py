"""Sweeps: ``spotnb.sweep`` and ``%%spot_sweep`` on the local cloud, with real jobs.

Each trial is a tiny cell (a few dozen steps of 0.1 s), so a sweep of four runs in
seconds. What is checked is what a user would notice: how many trials ran at once
(from the jobs' own events, not the driver's word), a pruned trial's instance gone at
once, the budget, one summary message, the refusals before anything starts, and a
sweep found again by ``%spot_attach``.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until

pytest.importorskip("optuna", reason="optuna is not installed: pip install -e '.[dev]'")

import optuna

import spotnb
from spotnb.client.jobs import attach
from spotnb.protocol import layout
from spotnb.protocol.events import EventReader
from spotnb.protocol.events.fold import fold
from spotnb.protocol.spec import SpecError
from spotnb.sweep import attach_sweep, runner

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
        spotnb_home: Path) -> None:
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
    # 6 s the cell takes, and it logged few rows.
    pruned = attach(made.trials[3].job_id)
    result = pruned.summary()
    assert result.status == "stopped" and "pruned" in result.reason
    assert made.trials[3].pruned_at is not None and made.trials[3].pruned_at < 40
    # One message for the sweep, none from its trials (they carry no webhook).
    assert len(hook.bodies) == 1, hook.bodies
    text = bodies[0]["text"]
    assert "sweep *swept* completed: 4 trials (3 completed, 1 pruned)" in text, text
    assert "best loss" in text and "*lr=0.02*" in text and "under on-demand" in text
    assert all(attach(j).spec.secrets == () for j in job_ids)
    # The sweep is in the store: found again, with every trial and its job.
    again = attach_sweep("swept", drive=False)
    assert [t.job_id for t in again.trials] == job_ids and again.ended
    assert [again.runs[n].facts.status for n in range(4)] == \
        ["completed", "completed", "completed", "pruned"]
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
    spent, _ondemand = made.cost()
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
    ]
    for options, words in cases:
        with pytest.raises(SpecError) as err:
            spotnb.sweep(cell(3), **options)
        assert words in str(err.value), (options, str(err.value))
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
    for line, words in [("--grid lr=0.1 -k 0", "-k/--parallel must be a whole number"),
                        ("--grid lrr=0.1,0.2", "does not read parameter 'lrr'"),
                        ("--grid lr=", "has no values"),
                        ("", "needs one of --grid"),
                        ("--params nothing", "no variable 'nothing'")]:
        with pytest.raises(UsageError, match=words):
            shell.run_cell_magic("spot_sweep", line, cell(3))
    assert _no_job_started(spotnb_home)


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


@pytest.mark.timeout(180)
def test_a_sweep_whose_driver_is_gone_is_taken_over_on_attach(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _DRIVER.format(code=cell(20), sets=SETS[:2])
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True,
                         capture_output=True, text=True, env=os.environ, timeout=120)
    sweep_id = out.stdout.split()[-1]
    monkeypatch.setattr(runner, "HEARTBEAT_STALE_SECONDS", 1.0)
    made = attach_sweep(sweep_id)
    wait_until(lambda: made.driving, 30, "this process to take the sweep over")
    assert made.wait(timeout=150), made
    assert [t.state for t in made.trials] == ["completed"] * 2, made.trials
    # The first trial was the old driver's, the second this process's: each ran once.
    assert len({t.job_id for t in made.trials}) == 2
    assert len([r for r in spotnb.jobs() if r.name.startswith("orphan-t")]) == 2
    state = json.loads(made.store.get(runner.STATE_KEY))
    assert state["status"] == "completed" and state["driver"].endswith(f":{os.getpid()}")


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
        assert "t0 lr=0.1" in view["text/plain"] and "t1 lr=0.05" in view["text/plain"]
        messages.clear()
        kc.execute_interactive("%spot_jobs", timeout=60, output_hook=messages.append)
        table = "".join(m["content"]["data"].get("text/plain", "") for m in messages
                        if m["msg_type"] == "display_data")
        assert "kernel-sweep-t0" in table and "kernel-sweep-t1" in table
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
