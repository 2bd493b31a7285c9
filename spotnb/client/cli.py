"""The ``spotnb`` command: list, follow, interrupt, stop and clean up jobs; list the
instance catalog; run and record notebooks.

A notebook-layer module: with the magics, the only code that prints. What the user
reads is :data:`DESCRIPTION` (``spotnb --help``), not this docstring.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence

import spotnb
from spotnb.client.listing import JOB_COLUMNS, format_events, jobs_table
from spotnb.protocol.spec import SpecError
from spotnb.providers.aws.cli import add_aws_commands
from spotnb.records.cli import add_record_commands

DESCRIPTION = ("spotnb: train in Jupyter on spot GPU instances. Follow, interrupt and "
               "stop the jobs that %%spot_train cells started and the sweeps of "
               "%%spot_sweep, browse the instance catalog, and run or record notebooks "
               "head-less.")
EPILOG = """\
JOB is a job's id, its name, or the end of its id, as `spotnb jobs` lists them;
without it, the latest job. Examples:
  spotnb jobs
  spotnb sweeps
  spotnb stop digits-sweep         (a sweep: every trial, and no more start)
  spotnb logs quickstart -f
  spotnb interrupt 9d7ca1
  spotnb kill 9d7ca1 --node 1      (local cloud: a machine lost without notice)
  spotnb catalog --gpu A10G --region us-west-2,eu-west-1
  spotnb run notebooks/quickstart.ipynb --timeout 600
The local cloud keeps its state in $SPOTNB_HOME (default ~/.spotnb)."""
JOB_HELP = ("a job id, its name, or the end of its id, as `spotnb jobs` lists them "
            "(default: the latest job)")
NODE_HELP = ("node K of a multi-node job (0 to MAX-1, as `spotnb logs` numbers them; "
             "default: the first running instance)")

def _job(args: argparse.Namespace) -> spotnb.JobHandle:
    return spotnb.attach(args.job, store=args.store)


def cmd_jobs(args: argparse.Namespace) -> int:
    import time

    rows = spotnb.jobs(store=args.store)
    if not rows:
        print("no jobs yet; submit one with %%spot_train in a notebook or spotnb.submit()")
        return 0
    table, notes = jobs_table(rows, time.time())
    header = tuple(c.upper() for c in JOB_COLUMNS)
    widths = [min(28, max(len(str(c)) for c in col)) for col in zip(header, *table,
                                                                   strict=True)]
    for row in (header, *table):
        print("  ".join(str(c)[:w].ljust(w) for c, w in zip(row, widths, strict=True))
              .rstrip())
    for note in notes:
        print(f"note: {note}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    handle = _job(args)
    # Metric batches stay batches: no line shows them, and a long job has millions.
    for batch in handle.event_batches(follow=args.follow, batches=True):
        text = format_events(batch)
        if text:
            print(text, flush=True)
    return 0


def cmd_sweeps(args: argparse.Namespace) -> int:
    import time

    from spotnb.client.listing import SWEEP_COLUMNS, sweeps_table
    from spotnb.sweep import sweeps

    rows = sweeps(store=args.store)
    if not rows:
        print("no sweeps yet; start one with %%spot_sweep in a notebook or spotnb.sweep()")
        return 0
    table = sweeps_table(rows, time.time())
    header = tuple(c.upper() for c in SWEEP_COLUMNS)
    widths = [min(40, max(len(str(c)) for c in col))
              for col in zip(header, *table, strict=True)]
    for row in (header, *table):
        print("  ".join(str(c)[:w].ljust(w) for c, w in zip(row, widths, strict=True))
              .rstrip())
    if any(r.status == "abandoned" for r in rows):
        print("note: an abandoned sweep's driver is gone (its kernel closed); its trials "
              "not started wait: `%spot_attach SWEEP --resume` in a notebook drives it on, "
              "`spotnb stop SWEEP` ends it")
    return 0


def _stop_sweep(args: argparse.Namespace) -> int | None:
    """``spotnb stop SWEEP``: None when ``args.job`` names no sweep."""
    from spotnb.sweep import find_sweep, stop_sweep
    from spotnb.sweep.view import stopped_text

    if not args.job or find_sweep(args.job, store=args.store) is None:
        return None
    print(f"stopping sweep {args.job}: its driver and every running trial...", flush=True)
    done = stop_sweep(args.job, store=args.store, reason="spotnb stop")
    print(stopped_text(done, "%spot_attach"))
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    if args.job and args.job.startswith("sweep-"):
        code = _stop_sweep(args)
        if code is not None:
            return code
    try:
        handle = _job(args)
    except spotnb.JobNotFound:
        code = _stop_sweep(args)
        if code is not None:
            return code
        raise
    if handle.result_record() is not None:
        print(f"job {handle.job_id} already ended ({handle.status}); it has no "
              f"instance to stop. Its history: `spotnb logs {handle.job_id}`")
        return 0
    handle.stop(reason="spotnb stop")
    status = handle.status
    print(f"job {handle.job_id} {status}; its capacity group and instance are deleted. "
          f"Its history: `spotnb logs {handle.job_id}`")
    return 0


def cmd_interrupt(args: argparse.Namespace) -> int:
    handle = _job(args)
    handle.interrupt(node=args.node)
    which = f"node {args.node} of job" if args.node is not None else "job"
    print(f"interruption notice delivered to {which} {handle.job_id}; follow it with "
          f"`spotnb logs {handle.job_id} -f`")
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    handle = _job(args)
    handle.kill(node=args.node)
    which = f"node {args.node} of job" if args.node is not None else "job"
    # A request: the job's local group ends the instance at its next tick (0.1 s).
    print(f"kill requested for {which} {handle.job_id}: its group ends the instance at its "
          f"next tick, without notice (a lost machine); the job goes on from its last "
          f"checkpoint. Follow it with `spotnb logs {handle.job_id} -f`")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from spotnb.providers import get_provider

    done = get_provider("local").cleanup(dry_run=args.dry_run)
    for item in done:
        print(item)
    if not done:
        print("nothing left over")
    elif args.dry_run:
        print(f"{len(done)} item(s); remove them with `spotnb cleanup`")
    return 0


def cmd_catalog(args: argparse.Namespace) -> int:
    import difflib

    from spotnb.providers import catalog, regions
    from spotnb.widgets.picker import picker_rows

    known = catalog.all_regions()
    for name in (p.strip() for p in args.region.split(",")):
        if name and name != regions.ANY and name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {' or '.join(close)}? " if close else ""
            raise SpecError(f"--region: no prices for {name!r}; {hint}regions: "
                            f"{', '.join(known)} (or any: $SPOTNB_ALLOWED_REGIONS)")
    try:
        where = regions.region_names(args.region, regions.allowed_regions())
    except SpecError as err:
        raise SpecError(err.message({"region": "--region"})) from None
    rows = picker_rows(where, gpus_only=not args.all)
    if args.gpu:
        wanted = args.gpu.lower()
        rows = [r for r in rows if wanted in r.gpu_model.lower()]
    if args.min_gpus:
        rows = [r for r in rows if r.gpu_count >= args.min_gpus]
    place = ", ".join(where)
    if not rows:
        models = sorted({r.gpu_model for r in picker_rows(where, gpus_only=not args.all)})
        print(f"no instance type in {place} matches; GPU models there: {', '.join(models)}")
        return 1
    rows.sort(key={"spot": lambda r: (r.spot, r.instance_type, r.region),
                   "gpu-hour": lambda r: (r.spot_per_gpu_hour, r.instance_type, r.region),
                   "type": lambda r: (r.instance_type, r.spot, r.region)}[args.sort])
    several = len(where) > 1
    header = ("TYPE", *(("REGION",) if several else ()), "GPUS", "GPU MEM", "VCPU", "RAM",
              "ON-DEMAND $/H", "SPOT $/H", "SAVING", "INTERRUPTIONS")
    table = [(r.instance_type, *((r.region,) if several else ()),
              f"{r.gpu_count} x {r.gpu_model}",
              f"{r.gpu_memory_gib:.1f} GiB" if r.gpu_memory_gib else "-", str(r.vcpus),
              f"{r.memory_gib:g} GiB", f"{r.ondemand:.4f}" if r.ondemand else "-",
              f"{r.spot:.4f}", f"{r.savings_pct:.0f}%" if r.savings_pct is not None else "-",
              r.interruption or "-") for r in rows]
    widths = [max(len(c) for c in col) for col in zip(header, *table, strict=True)]
    for row in [header, *table]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    best = rows[0]
    line = f"%%spot_train -t {best.instance_type}"
    if best.region != "us-east-1":
        line += f" --region {best.region}"
    kinds = len({r.instance_type for r in rows})
    print(f"\n{len(rows)} row(s) of {kinds} type(s) in {place}; spot is the cheapest "
          f"availability zone's price, from spotnb's bundled catalog "
          f"({catalog.DATA_DATE['catalog']}). Use one with {line}"
          + ("; %spot_picker ranks them by your job's expected cost, the checkpoint's "
             "transfer between regions included" if several else ""))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from spotnb.client.notebook import run_notebook

    if args.store:
        print("spotnb run: --store is not used by run; set SPOTNB_HOME or "
              "%config SpotMagics.store in the notebook", file=sys.stderr)
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(f"spotnb run: --timeout must be a number of seconds above 0, not "
              f"{args.timeout:g}", file=sys.stderr)
        return 2
    try:
        run = run_notebook(args.notebook, args.output, timeout=args.timeout)
    except FileNotFoundError as err:
        print(f"spotnb run: {err}", file=sys.stderr)
        return 2
    if run.failure is not None:
        f = run.failure
        if f.traceback.strip():
            print(f.traceback.rstrip() + "\n", file=sys.stderr)
        where = f"cell {f.index + 1}" if f.index >= 0 else "a cell"
        count = f" [{f.execution_count}]" if f.execution_count is not None else ""
        if f.timed_out:
            what = f"ran longer than --timeout {args.timeout:g} s and was stopped"
            if f.stopped_jobs:
                jobs = ", ".join(f.stopped_jobs)
                what += (f"; its job {jobs} was stopped too (its history: "
                         f"`spotnb logs {f.stopped_jobs[0]}`)")
        else:
            what = f"failed: {f.ename}: {f.evalue}"
        print(f"spotnb run: {where}{count} {what}\n    {f.first_line}\n"
              f"the executed copy, with the error, is {run.output}", file=sys.stderr)
        return 1
    print(f"executed {run.source.name} in {run.seconds:.0f}s; the executed copy is {run.output}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spotnb", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=spotnb.__version__)
    parser.add_argument("--store", default=None,
                        help="the store holding the jobs (default: $SPOTNB_HOME/store, "
                             "and every job submitted from this machine)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("jobs", help="list jobs: name, status, attempts, cost, age")
    p.set_defaults(func=cmd_jobs)
    p = sub.add_parser("logs", help="print a job's output and events")
    p.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
    p.add_argument("-f", "--follow", action="store_true", help="keep following until it ends")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("sweeps", help="list sweeps: status (abandoned: the driver gone), "
                                      "trials, best objective, cost")
    p.set_defaults(func=cmd_sweeps)
    p = sub.add_parser("stop", help="stop a job and delete its instance; or a sweep for "
                                    "good: every running trial, and no trial starts")
    p.add_argument("job", nargs="?", metavar="JOB",
                   help=JOB_HELP + "; or a sweep, its id or name as `spotnb sweeps` lists "
                                   "them: every running trial stopped, no trial started")
    p.set_defaults(func=cmd_stop)
    p = sub.add_parser("interrupt", help="deliver a spot interruption notice to a job now")
    p.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
    p.add_argument("--node", type=int, metavar="K", help=NODE_HELP)
    p.set_defaults(func=cmd_interrupt)
    p = sub.add_parser("kill", help="local cloud: end a job's instance at once, without "
                                    "notice (test a cell against a lost machine)")
    p.add_argument("job", nargs="?", metavar="JOB", help=JOB_HELP)
    p.add_argument("--node", type=int, metavar="K", help=NODE_HELP)
    p.set_defaults(func=cmd_kill)
    p = sub.add_parser("catalog", help="the GPU instance types with prices and "
                                       "interruption rates")
    p.add_argument("--gpu", metavar="MODEL",
                   help="only types with this GPU model (a part of it: a10g, t4, h100)")
    p.add_argument("--region", default="us-east-1", metavar="REGION",
                   help="the region (default us-east-1), several (us-east-1,eu-west-1), "
                        "or any: the regions $SPOTNB_ALLOWED_REGIONS allows")
    p.add_argument("--min-gpus", type=int, default=0, metavar="N",
                   help="only types with at least N GPUs")
    p.add_argument("--sort", choices=("spot", "gpu-hour", "type"), default="spot",
                   help="order: spot price (default), spot price per GPU-hour, or name")
    p.add_argument("--all", action="store_true",
                   help="include AWS's own accelerators (Inferentia, Trainium)")
    p.set_defaults(func=cmd_catalog)
    p = sub.add_parser("run", help="execute a notebook head-less and save the executed copy")
    p.add_argument("notebook", help="the .ipynb file; it runs in its own directory")
    p.add_argument("-o", "--output", default=None,
                   help="where to write the executed copy (default: NAME.executed.ipynb "
                        "next to the notebook)")
    p.add_argument("--timeout", type=float, default=3600.0, metavar="SECONDS",
                   help="seconds each cell may run (default 3600); a cell past it fails "
                        "the run, and the job it follows is stopped")
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("cleanup", help="remove the local cloud's leftovers")
    p.add_argument("--dry-run", action="store_true",
                   help="list exactly what a cleanup would do, and do nothing")
    p.set_defaults(func=cmd_cleanup)
    add_record_commands(sub)
    add_aws_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``spotnb`` console script."""
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except SpecError as err:
        print(f"spotnb: {err}", file=sys.stderr)
        return 2
    except spotnb.JobNotFound as err:
        print(f"spotnb: {err.message('`spotnb jobs`')}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`spotnb jobs | head`): stop quietly, as `ls` does.
        # Python would print another error flushing stdout at exit: point it at nothing.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


if __name__ == "__main__":
    sys.exit(main())
