"""Reading records back: find them, list them, compare two.

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


def _pairs(a: Sequence[dict[str, Any]], b: Sequence[dict[str, Any]]
           ) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Jobs of two records side by side: those with the same name, then the others in
    order."""
    matched: dict[int, int] = {}
    for i, ja in enumerate(a):
        k = next((k for k, jb in enumerate(b) if k not in matched.values()
                  and jb.get("name") == ja.get("name")), None)
        if k is not None:
            matched[i] = k
    free = [k for k in range(len(b)) if k not in matched.values()]
    for i in range(len(a)):
        if i not in matched and free:
            matched[i] = free.pop(0)
    pairs = [(str(ja.get("name")), ja, b[matched[i]] if i in matched else {})
             for i, ja in enumerate(a)]
    return pairs + [(str(b[k].get("name")), {}, b[k]) for k in free]


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


def compare_rows(a: Record, b: Record) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``spotnb records compare``: sections of (what, A, B) rows."""
    sections: list[tuple[str, list[tuple[str, str, str]]]] = []
    ra, rb = a.run, b.run
    git_a, git_b = ra.get("git") or {}, rb.get("git") or {}
    sections.append(("run", [
        ("status", _show(ra.get("status")), _show(rb.get("status"))),
        ("date", a.start or "-", b.start or "-"),
        ("duration", _duration(ra.get("duration_s")), _duration(rb.get("duration_s"))),
        ("git commit", _commit(git_a), _commit(git_b)),
        ("spotnb", _show((ra.get("versions") or {}).get("spotnb")),
         _show((rb.get("versions") or {}).get("spotnb"))),
    ]))
    pa, pb = a.parameters, b.parameters
    sections.append(("parameters", [(k, _show(pa.get(k)), _show(pb.get(k)))
                                    for k in dict.fromkeys([*pa, *pb])]))
    for name, ja, jb in _pairs(a.jobs, b.jobs):
        oa, ob = ja.get("options") or {}, jb.get("options") or {}
        rows = [(k, _show(oa.get(k)), _show(ob.get(k))) for k in dict.fromkeys([*oa, *ob])]
        # Hyperparameters (a TrainingArguments has ~100): only those that differ.
        pa_job, pb_job = ja.get("params") or {}, jb.get("params") or {}
        rows += [(f"param {k}", _show(pa_job.get(k)), _show(pb_job.get(k)))
                 for k in dict.fromkeys([*pa_job, *pb_job]) if pa_job.get(k) != pb_job.get(k)]
        rows += [
            ("instances", _instances(ja), _instances(jb)),
            ("status", _show(ja.get("status")), _show(jb.get("status"))),
            ("attempts", str(len(ja.get("attempts") or [])), str(len(jb.get("attempts") or []))),
            ("interruptions", _show(ja.get("interruptions")), _show(jb.get("interruptions"))),
            ("duration", _duration(ja.get("duration_s")), _duration(jb.get("duration_s"))),
            ("cost $", _number(ja.get("cost_usd"), ".4f"), _number(jb.get("cost_usd"), ".4f")),
            ("on-demand $", _number(ja.get("ondemand_cost_usd"), ".4f"),
             _number(jb.get("ondemand_cost_usd"), ".4f")),
            ("saved %", _number(ja.get("savings_pct"), ".0f"),
             _number(jb.get("savings_pct"), ".0f")),
        ]
        sections.append((f"job {name}", rows))
    ta, tb = a.totals, b.totals
    sections.append(("cost", [
        ("spot $", _number(ta.get("cost_usd"), ".4f"), _number(tb.get("cost_usd"), ".4f")),
        ("on-demand $", _number(ta.get("ondemand_cost_usd"), ".4f"),
         _number(tb.get("ondemand_cost_usd"), ".4f")),
        ("saved %", _number(ta.get("savings_pct"), ".0f"), _number(tb.get("savings_pct"), ".0f")),
        ("interruptions", _show(ta.get("interruptions")), _show(tb.get("interruptions"))),
    ]))
    fa, fb = a.final_metrics, b.final_metrics
    sections.append(("final metrics", [(k, _show(fa.get(k)), _show(fb.get(k)))
                                       for k in dict.fromkeys([*fa, *fb])]))
    return sections


def _commit(git: Mapping[str, Any]) -> str:
    if not git.get("commit"):
        return "-"
    return str(git["commit"])[:10] + (" (changed)" if git.get("dirty") else "")
