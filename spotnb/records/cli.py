"""``spotnb record`` and ``spotnb records list|show|compare``: the command-line side of
records. Like :mod:`spotnb.client.cli`, this is a notebook-layer module: it prints."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_record_commands"]

# spotnb.client.notebook.DEFAULT_CELL_TIMEOUT, without importing nbformat for every command.
_CELL_TIMEOUT = 3600.0
# `records show` lists this many hyperparameters of a job; --json has them all.
_PARAMS_SHOWN = 12


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MB" if n >= 2**20 else f"{n / 1024:.0f} KB"


def cmd_record(args: argparse.Namespace) -> int:
    from spotnb.records.library import load_record
    from spotnb.records.run import parse_parameters, record_notebook

    try:
        params = parse_parameters(args.parameters or [])
        rec = record_notebook(args.notebook, args.output, parameters=params, html=args.html,
                              provider=args.provider, timeout=args.timeout)
    except (FileNotFoundError, ValueError) as err:
        print(f"spotnb record: {err}", file=sys.stderr)
        return 2
    for line in rec.warnings:
        print(f"spotnb record: warning: {line}", file=sys.stderr)
    where = f"the record is {rec.output} ({_size(rec.size_bytes)})"
    if rec.html is not None:
        where += f"; its HTML export is {rec.html}"
    if rec.failure is not None:
        f = rec.failure
        print(f.traceback.rstrip(), file=sys.stderr)
        cell = f"cell {f.index + 1}" if f.index >= 0 else "the run"
        count = f" [{f.execution_count}]" if f.execution_count is not None else ""
        print(f"\nspotnb record: {cell}{count} failed: {f.ename}: {f.evalue}"
              + (f"\n    {f.first_line}" if f.first_line else "")
              + f"\n{where}, marked failed", file=sys.stderr)
        return 1
    record = load_record(rec.output)
    tot = record.totals
    summary = f"{tot.get('jobs', 0)} job(s), {tot.get('interruptions', 0)} interruption(s)"
    if tot.get("jobs"):
        summary += f", ${tot.get('cost_usd', 0):.4f}"
        if tot.get("savings_pct") is not None:
            summary += f" ({tot['savings_pct']:.0f}% less than on-demand)"
    finals = ", ".join(f"{k} {v:.4g}" for k, v in record.final_metrics.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool))
    print(f"recorded {rec.source.name} in {rec.seconds:.0f}s: {summary}"
          + (f"; {finals}" if finals else ""))
    print(where)
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from spotnb.records.library import find_records, list_row

    directory = Path(args.directory)
    if not directory.is_dir():
        print(f"spotnb records list: {directory} is not a directory", file=sys.stderr)
        return 2
    records = find_records(directory)
    if not records:
        print(f"no records under {directory}; make one with `spotnb record NOTEBOOK`")
        return 0
    rows = []
    for record in records:
        row = list_row(record)
        row["record"] = str(record.path.relative_to(directory)) \
            if record.path.is_relative_to(directory) else str(record.path)
        rows.append(row)
    header = list(rows[0])
    print(_table(header, [[row[k] for k in header] for row in rows]))
    return 0


def _open(path: str) -> Any:
    from spotnb.records.library import NotARecord, load_record

    try:
        return load_record(path)
    except NotARecord as err:
        print(f"spotnb records: {err}", file=sys.stderr)
        return None


def cmd_show(args: argparse.Namespace) -> int:
    record = _open(args.record)
    if record is None:
        return 2
    if args.json:
        print(json.dumps(record.meta, indent=1, sort_keys=True))
        return 0
    run = record.run
    print(f"record {record.path}")
    fields = [("notebook", run.get("notebook")), ("status", run.get("status")),
              ("start", run.get("start")), ("end", run.get("end")),
              ("provider", run.get("provider") or "default"),
              ("parameters", json.dumps(record.parameters) if record.parameters else None)]
    git = run.get("git") or {}
    if git:
        fields.append(("git", f"{git.get('commit')}" + (" with uncommitted changes"
                                                          if git.get("dirty") else "")))
    versions = run.get("versions") or {}
    if versions:
        fields.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items() if v)))
    error = run.get("error")
    if error:
        fields.append(("error", f"{error.get('ename')}: {error.get('evalue')}"))
    for key, value in fields:
        if value is not None:
            print(f"  {key + ':':<12}{value}")
    for job in record.jobs:
        print(f"\njob {job.get('job_id')} {job.get('name')!r}: {job.get('status')} "
              f"({job.get('reason')})")
        options = job.get("options") or {}
        print(f"  types {','.join(options.get('instance_types') or [])}, "
              f"region {options.get('region')}, provider {options.get('provider')}, "
              f"checkpoint {options.get('checkpoint_every')}")
        nodes = job.get("nodes")
        if nodes:
            worlds = " -> ".join(str(w.get("nodes")) for w in nodes.get("worlds") or [])
            print(f"  nodes {nodes.get('label')}" + (f", world {worlds}" if worlds else ""))
            for inst in nodes.get("instances") or []:
                print(f"    node {inst.get('node')}: {inst.get('instance_type') or '?'}"
                      f" {inst.get('az') or ''} ({inst.get('instance_id')}, attempt "
                      f"{inst.get('attempt')}, {inst.get('end_reason')})")
        params = job.get("params") or {}
        if params:
            shown = ", ".join(f"{k}={v}" for k, v in list(params.items())[:_PARAMS_SHOWN])
            more = len(params) - _PARAMS_SHOWN
            print(f"  params ({', '.join(job.get('params_source') or []) or 'logged'}): "
                  f"{shown}" + (f" and {more} more (--json)" if more > 0 else ""))
        attempts = [[str(a.get("number")), str(a.get("instance_type")), str(a.get("pool")),
                     str(a.get("region") or "-"), str(a.get("start")),
                     str(a.get("end") or "-"), str(a.get("end_reason")),
                     f"{a.get('spot_price_usd_per_hour') or 0:.4f}"]
                    for a in job.get("attempts") or []]
        if attempts:
            print("  " + _table(["#", "type", "pool", "region", "start", "end", "ended",
                                 "spot $/h"], attempts).replace("\n", "\n  "))
        for a in job.get("attempts") or []:
            if a.get("moved"):
                print(f"  attempt {a.get('number')} moved to {a.get('region')}: "
                      f"{a.get('moved')}")
        saved = job.get("savings_pct")
        print(f"  {job.get('interruptions', 0)} interruption(s); cost ${job.get('cost_usd', 0):.4f}"
              f" vs ${job.get('ondemand_cost_usd', 0):.4f} on-demand"
              + (f" ({saved:.0f}% less)" if saved is not None else ""))
        finals = job.get("final_metrics") or {}
        if finals:
            print("  final: " + ", ".join(f"{k} {v}" for k, v in finals.items()))
        latest = (job.get("checkpoints") or {}).get("latest")
        if latest:
            print(f"  latest checkpoint: {latest}")
        if job.get("error"):
            print(f"  error: {job['error'].get('ename')}: {job['error'].get('evalue')}")
    return 0


def _letter(n: int) -> str:
    """A, B, ..., Z, AA, AB, ...: a record's column."""
    out = ""
    n += 1
    while n:
        n, r = divmod(n - 1, 26)
        out = chr(ord("A") + r) + out
    return out


def cmd_compare(args: argparse.Namespace) -> int:
    from spotnb.records import figures
    from spotnb.records.library import compare_rows

    records = [_open(path) for path in args.records]
    if any(r is None for r in records):
        return 2
    if len(records) < 2:
        print("spotnb records compare: name two records or more", file=sys.stderr)
        return 2
    letters = [_letter(n) for n in range(len(records))]
    for letter, record in zip(letters, records, strict=True):
        print(f"{letter}: {record.path}")
    for title, rows in compare_rows(*records):
        if not rows:
            continue
        marked = [[("* " if len(set(values)) > 1 else "  ") + what, *values]
                  for what, *values in rows]
        print(f"\n{title}")
        print(_table(["", *letters], marked))
    if not figures.available():
        print(f"\nno figure of the curves: {figures.INSTALL_HINT}")
        return 0
    first = records[0].path
    out = Path(args.output) if args.output else first.with_name(
        "-vs-".join(r.path.stem for r in records) + ".png")
    out.write_bytes(figures.compare_png([(f"{letter}: {r.path.stem}", r.jobs)
                                         for letter, r in zip(letters, records, strict=True)]))
    print(f"\n(* differs) the metric curves, overlaid: {out} (dashed lines: "
          "interruptions, in the record's colour)")
    return 0


def add_record_commands(sub: Any) -> None:
    """Add ``record`` and ``records`` to the ``spotnb`` command's subparsers."""
    p = sub.add_parser("record", help="execute a notebook head-less and save it as an "
                                      "experiment record")
    p.add_argument("notebook", help="the .ipynb file; it runs in its own directory")
    p.add_argument("-p", "--parameter", dest="parameters", action="append", metavar="NAME=VALUE",
                   help="override a parameter of the cell tagged 'parameters' (a Python "
                        "literal, else a string); repeat for several: -p STEPS=600 -p LR=0.05")
    p.add_argument("-o", "--output", default=None,
                   help="where to write the record (default: NAME.record.ipynb next to "
                        "the notebook)")
    p.add_argument("--html", action="store_true",
                   help="also write an HTML export (the record's name with .html), whose "
                        "figures show without JavaScript")
    p.add_argument("--provider", default=None,
                   help="the default provider of the notebook's %%%%spot_train cells: local "
                        "or aws (a cell's --provider still wins)")
    p.add_argument("--timeout", type=float, default=_CELL_TIMEOUT,
                   help=f"seconds each cell may run (default {_CELL_TIMEOUT:.0f})")
    p.set_defaults(func=cmd_record)

    records = sub.add_parser("records", help="list, show and compare experiment records")
    rsub = records.add_subparsers(dest="records_command", required=True)
    p = rsub.add_parser("list", help="a table of the records under a directory")
    p.add_argument("directory", nargs="?", default=".", help="where to look (default: here)")
    p.set_defaults(func=cmd_list)
    p = rsub.add_parser("show", help="what a record says: run, jobs, attempts, cost, results")
    p.add_argument("record", help="a record (.ipynb)")
    p.add_argument("--json", action="store_true", help="print its metadata.spotnb as JSON")
    p.set_defaults(func=cmd_show)
    p = rsub.add_parser("compare", help="records side by side, with their metric curves "
                                        "overlaid in one figure, interruptions marked")
    p.add_argument("records", nargs="+", metavar="RECORD",
                   help="two records (.ipynb) or more")
    p.add_argument("-o", "--output", default=None,
                   help="where to write the figure (default: A-vs-B[-vs-C...].png next "
                        "to the first)")
    p.set_defaults(func=cmd_compare)
