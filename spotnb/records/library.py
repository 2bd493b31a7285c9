"""Reading records back: find them, list them, compare any number.

A record is any notebook with ``metadata.spotnb`` (written by ``spotnb record``). A
notebook saved by hand from Jupyter counts too when its cells carry job records in
their output metadata (left by the notebook layer when a job ends): its run fields are
then unknown, its jobs are complete.

Everything here reads the record alone: a record received from a colleague lists and
compares without access to the store its jobs ran from.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from spotnb.records.run import totals

__all__ = ["Record", "compare_rows", "find_records", "list_row", "load_record"]

_SKIP_DIRS = frozenset({".git", ".ipynb_checkpoints", ".venv", "venv", "node_modules",
                        "__pycache__", ".tox", ".mypy_cache", ".pytest_cache"})


class NotARecord(ValueError):
    """The file is not a notebook, or a notebook without any spotnb record."""


@dataclasses.dataclass(frozen=True)
class Record:
    """A record: its file and its ``metadata.spotnb``."""

    path: Path
    meta: dict[str, Any]

    @property
    def run(self) -> dict[str, Any]:
        return dict(self.meta.get("run") or {})

    @property
    def jobs(self) -> list[dict[str, Any]]:
        return list(self.meta.get("jobs") or [])

    @property
    def totals(self) -> dict[str, Any]:
        return dict(self.meta.get("totals") or totals(self.jobs))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def parameters(self) -> dict[str, Any]:
        """The run's effective parameters: the notebook's, overridden by the given ones."""
        run = self.run
        return {**(run.get("default_parameters") or {}), **(run.get("parameters") or {})}

    @property
    def final_metrics(self) -> dict[str, Any]:
        """The jobs' final metrics (prefixed with the job's name when there are several)."""
        jobs = self.jobs
        merged: dict[str, Any] = {}
        for job in jobs:
            for key, value in (job.get("final_metrics") or {}).items():
                merged[key if len(jobs) == 1 else f"{job.get('name')}.{key}"] = value
        return merged

    @property
    def start(self) -> str:
        return str(self.run.get("start") or min((j.get("created") or "" for j in self.jobs),
                                                default=""))


def load_record(path: str | os.PathLike[str]) -> Record:
    """The record in the notebook at ``path``; :class:`NotARecord` if it has none."""
    p = Path(path)
    try:
        nb = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise NotARecord(f"{p} is not a notebook: {err}") from None
    if not isinstance(nb, dict):
        raise NotARecord(f"{p} is not a notebook")
    meta = (nb.get("metadata") or {}).get("spotnb")
    if isinstance(meta, dict) and "run" in meta:
        return Record(p, meta)
    jobs = []
    for cell in nb.get("cells") or []:
        for output in cell.get("outputs") or []:
            job = ((output.get("metadata") or {}).get("spotnb") or {}).get("job")
            if isinstance(job, dict) and job.get("job_id"):
                jobs.append(job)
    if not jobs:
        raise NotARecord(f"{p} has no spotnb record: make one with `spotnb record {p}`")
    return Record(p, {"run": {"notebook": p.name, "status": "saved by hand"}, "jobs": jobs,
                      "totals": totals(jobs)})


def _notebooks(directory: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".ipynb"):
                yield Path(root, name)


def find_records(directory: str | os.PathLike[str] = ".") -> list[Record]:
    """Every record under ``directory`` (recursively), oldest run first."""
    found = []
    for path in _notebooks(Path(directory)):
        try:
            found.append(load_record(path))
        except NotARecord:
            continue
    return sorted(found, key=lambda r: (r.start, str(r.path)))


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and \
        not isinstance(value, bool) else "-"


def _metrics_text(metrics: Mapping[str, Any], limit: int = 4) -> str:
    parts = [f"{k} {v:.4g}" for k, v in metrics.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return ", ".join(parts[:limit]) + (", …" if len(parts) > limit else "")


def list_row(record: Record) -> dict[str, str]:
    """A row of ``spotnb records list``."""
    run, tot = record.run, record.totals
    duration = run.get("duration_s")
    if duration is None:
        duration = sum(float(j.get("duration_s") or 0) for j in record.jobs) or None
    return {
        "record": str(record.path),
        "date": record.start.replace("T", " ").rstrip("Z")[:16] or "-",
        "status": str(run.get("status") or "-"),
        "duration": _duration(duration),
        "cost $": _number(tot.get("cost_usd"), ".4f"),
        "saved": (_number(tot.get("savings_pct"), ".0f") + "%"
                  if tot.get("savings_pct") is not None else "-"),
        "interruptions": str(tot.get("interruptions", 0)),
        "final metrics": _metrics_text(record.final_metrics) or "-",
    }


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _groups(jobs: Sequence[Sequence[dict[str, Any]]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The jobs of several records side by side, one group per job: those of the same
    name together (a record without one: ``{}``). Records of one job each compare
    that job, whatever its name."""
    if all(len(js) == 1 for js in jobs):
        return [(str(jobs[0][0].get("name")), [js[0] for js in jobs])] if jobs else []
    groups: list[tuple[str, list[dict[str, Any]]]] = []
    for r, js in enumerate(jobs):
        for job in js:
            name = str(job.get("name"))
            group = next((g for n, g in groups if n == name and not g[r]), None)
            if group is None:
                group = [{} for _ in jobs]
                groups.append((name, group))
            group[r] = job
    return groups


def _show(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def _instances(job: Mapping[str, Any]) -> str:
    counts: dict[str, int] = {}
    for attempt in job.get("attempts") or []:
        key = str(attempt.get("pool") or attempt.get("instance_type") or "?")
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{k} x{n}" if n > 1 else k for k, n in counts.items()) or "-"


def compare_rows(*records: Record) -> list[tuple[str, list[tuple[str, ...]]]]:
    """``spotnb records compare``: sections of ``(what, value in each record...)``
    rows."""
    sections: list[tuple[str, list[tuple[str, ...]]]] = []
    runs = [r.run for r in records]

    def row(what: str, values: Sequence[str]) -> tuple[str, ...]:
        return (what, *values)

    sections.append(("run", [
        row("status", [_show(r.get("status")) for r in runs]),
        row("date", [rec.start or "-" for rec in records]),
        row("duration", [_duration(r.get("duration_s")) for r in runs]),
        row("git commit", [_commit(r.get("git") or {}) for r in runs]),
        row("spotnb", [_show((r.get("versions") or {}).get("spotnb")) for r in runs]),
    ]))
    params = [rec.parameters for rec in records]
    sections.append(("parameters", [row(k, [_show(p.get(k)) for p in params])
                                    for k in dict.fromkeys(k for p in params for k in p)]))
    for name, jobs in _groups([rec.jobs for rec in records]):
        options = [j.get("options") or {} for j in jobs]
        rows = [row(k, [_show(o.get(k)) for o in options])
                for k in dict.fromkeys(k for o in options for k in o)]
        # Hyperparameters (a TrainingArguments has ~100): only those that differ.
        hyper = [j.get("params") or {} for j in jobs]
        rows += [row(f"param {k}", [_show(h.get(k)) for h in hyper])
                 for k in dict.fromkeys(k for h in hyper for k in h)
                 if len({json.dumps(h.get(k), sort_keys=True, default=str)
                         for h in hyper}) > 1]
        rows += [
            row("instances", [_instances(j) for j in jobs]),
            row("status", [_show(j.get("status")) for j in jobs]),
            row("attempts", [str(len(j.get("attempts") or [])) for j in jobs]),
            row("interruptions", [_show(j.get("interruptions")) for j in jobs]),
            row("redone steps", [_show(j.get("redone_steps")) for j in jobs]),
            row("duration", [_duration(j.get("duration_s")) for j in jobs]),
            row("cost $", [_number(j.get("cost_usd"), ".4f") for j in jobs]),
            row("on-demand $", [_number(j.get("ondemand_cost_usd"), ".4f") for j in jobs]),
            row("saved %", [_number(j.get("savings_pct"), ".0f") for j in jobs]),
        ]
        sections.append((f"job {name}", rows))
    totals_ = [rec.totals for rec in records]
    sections.append(("cost", [
        row("spot $", [_number(t.get("cost_usd"), ".4f") for t in totals_]),
        row("on-demand $", [_number(t.get("ondemand_cost_usd"), ".4f") for t in totals_]),
        row("saved %", [_number(t.get("savings_pct"), ".0f") for t in totals_]),
        row("interruptions", [_show(t.get("interruptions")) for t in totals_]),
    ]))
    finals = [rec.final_metrics for rec in records]
    sections.append(("final metrics", [row(k, [_show(f.get(k)) for f in finals])
                                       for k in dict.fromkeys(k for f in finals for k in f)]))
    return sections


def _commit(git: Mapping[str, Any]) -> str:
    if not git.get("commit"):
        return "-"
    return str(git["commit"])[:10] + (" (changed)" if git.get("dirty") else "")
