"""Experiment records: executed notebooks that say what ran, on what, at what cost.

``spotnb record NOTEBOOK`` (:func:`record_notebook`) executes a notebook head-less and
writes ``NAME.record.ipynb``: the notebook with its outputs, widget state and static
figures, and ``metadata.spotnb``::

    schema      1
    run         notebook, status ("completed" or "failed"), error (cell, ename,
                evalue, traceback), parameters (the overrides), default_parameters
                (the cell tagged "parameters"), provider, kernel, start, end,
                duration_s, versions (python, kernel_python, spotnb, torch, ...),
                platform, git (commit, dirty, changes, branch, directory, remote),
                widgets_dropped, redactions, other_jobs (jobs submitted meanwhile
                that no cell shows: named, not counted)
    jobs        one job record per job the run submitted (below), with its "cell"
    totals      jobs, cost_usd, ondemand_cost_usd, savings_pct, interruptions, attempts

A job record (:func:`job_record`; also the job's ``summary.json`` in its store prefix,
and, in a notebook run by hand, the output metadata ``spotnb.job`` of its cell)::

    job_id, name, status (completed, failed, stopped; pruned: a sweep's trial its
                  pruner stopped, reason "pruned at step N (METRIC VALUE)"), reason,
                  store_uri, spotnb_version, code_sha256,
    options       provider, instance_types, region, max_price, checkpoint_every,
                  max_restarts_on_error, budget_usd, max_duration, keep_checkpoints,
                  inputs, outputs, simulate_interruptions, notify (whether a
                  webhook was told; never its URL)
    params        the hyperparameters the job logged (spot.log_params; the framework
                  integrations log TrainingArguments, a LightningModule's hparams, an
                  Accelerate tracker's config), params_source (which framework)
    created, end, duration_s
    attempts      number, instance_id, instance_type, pool, start, end, end_reason,
                  spot_price_usd_per_hour
    interruptions, cost_usd, ondemand_cost_usd, savings_pct
    refunded_usd, refunded_instances
                  what the instances EC2 interrupted in their first hour ran (AWS
                  charges none of it; not in cost_usd), and how many they were
    breaks        each attempt that ended early: attempt, reason, time, step (its last),
                  resumed_at (the next attempt's first step), redone; redone_steps
    metrics       the last logged value of each metric
    outputs       the --out values: numbers, booleans, short strings; else {"type": ...}
    final_metrics metrics and numeric outputs together (what lists and comparisons show)
    checkpoints   written, forced_by_notice, last_step, latest (URI), kept (URI, step,
                  bytes, created), sync_dirs
    curves        {metric: {"step": [...], "value": [...]}}, at most 500 points each
    error         ename, evalue, traceback (without colour codes)

Times are ISO 8601 UTC. Money is USD. A record never holds a credential
(:mod:`spotnb.records.scrub`). What a record keeps of the widgets and how it stays small
is explained in :mod:`spotnb.records.document`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spotnb.records.summary import (
    SCHEMA_VERSION,
    describe_value,
    job_ended,
    job_record,
    record_bundle,
    store_summary,
)

__all__ = [
    "SCHEMA_VERSION",
    "Recording",
    "describe_value",
    "job_ended",
    "job_record",
    "record_bundle",
    "record_notebook",
    "store_summary",
]

if TYPE_CHECKING:
    from spotnb.records.run import Recording, record_notebook


def __getattr__(name: str) -> Any:
    # Recording needs nbformat (a second to import): loaded when asked for, so the
    # notebook's hook at the end of a job does not pay for it.
    if name in ("Recording", "record_notebook"):
        from spotnb.records import run

        return getattr(run, name)
    raise AttributeError(f"module 'spotnb.records' has no attribute {name!r}")
