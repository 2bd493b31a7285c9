"""The ``spotnb`` command: list, follow, interrupt, stop and clean up jobs; run and
record notebooks.

This is a notebook-layer module: it is the only place (with the magics) that prints.
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
from collections.abc import Sequence

import spotnb
from spotnb.events import Event
from spotnb.providers.aws.cli import add_aws_commands
from spotnb.records.cli import add_record_commands
from spotnb.spec import SpecError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def format_age(created: float, now: float) -> str:
    """How long ago ``created`` was, in one unit: ``42s``, ``5m``, ``3h``, ``2d``."""
    seconds = max(0, int(now - created))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def format_event(event: Event) -> str | None:
    """A human line (or block) for an event, or None for events not worth a line."""
    when = datetime.datetime.fromtimestamp(event.time).strftime("%H:%M:%S")
    d = event.data
    where = f"[{when} a{event.attempt}]" if event.attempt else f"[{when} group]"
    if event.type == "stream":
        return str(d.get("text", "")).rstrip("\n")
    if event.type == "status":
        return f"{where} {d.get('state')}: {d.get('detail', '')}".rstrip(": ")
    if event.type == "error":
        tb = "\n".join(_ANSI.sub("", line) for line in d.get("traceback", []))
        return f"{where} error: {d.get('ename')}: {d.get('evalue')}\n{tb}".rstrip()
    if event.type == "notice":
        return f"{where} notice: {d.get('kind')} {d.get('action')} at {d.get('notice_time')}"
    if event.type == "instance":
        detail = " ".join(str(d[k]) for k in ("instance_id", "instance_type", "az", "reason")
                          if d.get(k))
        return f"{where} instance {d.get('action')}: {detail}"
    if event.type == "checkpoint" and d.get("phase") == "durable":
        return f"{where} checkpoint at step {d.get('step')} durable ({d.get('bytes', 0):,} bytes)"
    if event.type == "warning":
        return f"{where} warning: {d.get('text', '')}"
    if event.type == "display":
        text = (d.get("data") or {}).get("text/plain")
        return str(text) if text else None
    return None


def cmd_jobs(args: argparse.Namespace) -> int:
    import time

    rows = spotnb.jobs(store=args.store)
    if not rows:
        print("no jobs yet; submit one with %%spot_train in a notebook or spotnb.submit()")
        return 0
    now = time.time()
    print(f"{'JOB':<24} {'NAME':<16} {'STATUS':<22} {'NODES':>5} {'ATT':>3} {'INT':>3} "
          f"{'COST $':>9} AGE")
    for r in rows:
        print(f"{r.job_id:<24} {r.name[:16]:<16} {r.status:<22} {r.nodes:>5} {r.attempts:>3} "
              f"{r.interruptions:>3} {r.cost_usd:>9.4f} {format_age(r.created, now)}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    handle = spotnb.attach(args.job, store=args.store)
    # Metric batches stay batches: no line shows them, and a long job has millions.
    for event in handle.events(follow=args.follow, batches=True):
        line = format_event(event)
        if line is not None:
            print(line, flush=True)
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    handle = spotnb.attach(args.job, store=args.store)
    handle.stop()
    print(f"job {args.job} stopped; its capacity group is deleted")
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    handle = spotnb.attach(args.job, store=args.store)
    handle.interrupt()
    print(f"interruption notice delivered to job {args.job}; follow it with "
          f"`spotnb logs {args.job} -f`")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from spotnb.providers import get_provider

    found = get_provider("local").cleanup(dry_run=args.dry_run)
    for item in found:
        print(item)
    if not found:
        print("nothing left over")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from spotnb.notebook import run_notebook

    if args.store:
        print("spotnb run: --store is not used by run; set SPOTNB_HOME or "
              "%config SpotMagics.store in the notebook", file=sys.stderr)
        return 2
    try:
        run = run_notebook(args.notebook, args.output, timeout=args.timeout)
    except FileNotFoundError as err:
        print(f"spotnb run: {err}", file=sys.stderr)
        return 2
    if run.failure is not None:
        f = run.failure
        print(f.traceback.rstrip(), file=sys.stderr)
        where = f"cell {f.index + 1}" if f.index >= 0 else "a cell"
        count = f" [{f.execution_count}]" if f.execution_count is not None else ""
        print(f"\nspotnb run: {where}{count} failed: {f.ename}: {f.evalue}\n"
              f"    {f.first_line}\nthe executed copy, with the error, is {run.output}",
              file=sys.stderr)
        return 1
    print(f"executed {run.source.name} in {run.seconds:.0f}s; the executed copy is {run.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spotnb", description=__doc__)
    parser.add_argument("--version", action="version", version=spotnb.__version__)
    parser.add_argument("--store", default=None,
                        help="the store holding the jobs (default: $SPOTNB_HOME/store)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("jobs", help="list jobs")
    p.set_defaults(func=cmd_jobs)
    p = sub.add_parser("logs", help="print a job's output and events")
    p.add_argument("job")
    p.add_argument("-f", "--follow", action="store_true", help="keep following until it ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("stop", help="stop a job and delete its instance")
    p.add_argument("job")
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("interrupt", help="deliver a spot interruption notice now")
    p.add_argument("job")
    p.set_defaults(func=cmd_interrupt)
    p = sub.add_parser("run", help="execute a notebook head-less and save the executed copy")
    p.add_argument("notebook", help="the .ipynb file; it runs in its own directory")
    p.add_argument("-o", "--output", default=None,
                   help="where to write the executed copy (default: NAME.executed.ipynb "
                        "next to the notebook)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds each cell may run (default 3600)")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("cleanup", help="remove the local cloud's leftovers")
    p.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    p.set_defaults(func=cmd_cleanup)
    add_record_commands(sub)
    add_aws_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spotnb`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (SpecError, spotnb.JobNotFound) as err:
        print(f"spotnb: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
