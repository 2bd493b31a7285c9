"""``spotnb aws setup|cleanup|doctor|selftest``: the AWS command group of the ``spotnb``
CLI.

A notebook-layer module (it prints); the work is in :mod:`.admin` and the provider.
``spotnb.client.cli.build_parser`` calls :func:`add_aws_commands`.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_aws_commands"]


def add_aws_commands(subparsers: Any) -> None:
    """Add ``spotnb aws ...`` to the ``spotnb`` parser's subcommands."""
    aws = subparsers.add_parser("aws", help="set up, check and clean up spotnb on AWS")
    aws.add_argument("--region", default=None,
                     help="AWS region (default: AWS_DEFAULT_REGION or the profile's)")
    commands = aws.add_subparsers(dest="aws_command", required=True)
    p = commands.add_parser("setup", help="create or check the bucket, security group and "
                                          "FIS role; print the IAM policies spotnb uses")
    p.add_argument("--dry-run", action="store_true", help="change nothing; say what would be")
    p.set_defaults(func=cmd_setup)
    p = commands.add_parser("cleanup", help="find and delete every leftover of ended jobs")
    p.add_argument("--dry-run", action="store_true", help="only list what would be deleted")
    p.set_defaults(func=cmd_cleanup)
    p = commands.add_parser("doctor", help="check credentials, permissions, quotas, network")
    p.set_defaults(func=cmd_doctor)
    p = commands.add_parser(
        "selftest", help="run spotnb end to end on this account: setup, doctor, a job "
                         "across an FIS interruption, a standby move, a 2-node job that "
                         "loses a node, cleanup (billed: refuses without --budget)")
    p.add_argument("--budget", type=float, default=None, metavar="USD",
                   help="what the run may cost at most (required; about 1 is enough)")
    p.add_argument("--types", default=None,
                   help="comma-separated instance types (default g4dn.xlarge)")
    p.add_argument("--steps", default=None,
                   help="comma-separated steps to run (setup and cleanup always run)")
    p.add_argument("--dry-run", action="store_true",
                   help="show the plan and its cost bound; start nothing")
    p.set_defaults(func=cmd_selftest)


def _reported(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Print AWS failures as one line with the next step, not as a traceback."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        from spotnb.providers import ProviderError

        try:
            return fn(args)
        except ProviderError as err:
            print(f"spotnb aws: {err}", file=sys.stderr)
            return 1

    return run


@_reported
def cmd_setup(args: argparse.Namespace) -> int:
    from spotnb.providers.aws.admin import policies_json, setup

    report = setup(args.region, dry_run=args.dry_run)
    print(f"account {report.account}, region {report.region}, bucket s3://{report.bucket}")
    for line in report.actions:
        print(f"  {line}")
    print()
    print(policies_json(report))
    if args.dry_run:
        print("\n(dry run: nothing was changed)")
    return 0


@_reported
def cmd_cleanup(args: argparse.Namespace) -> int:
    from spotnb.providers.aws import AwsProvider, CleanupIncomplete

    failed: list[str] = []
    try:
        found = AwsProvider(region=args.region).cleanup(dry_run=args.dry_run)
    except CleanupIncomplete as err:
        found, failed = err.done, err.failed
    for line in found:
        print(line)
    if not found and not failed:
        print("nothing left over")
    elif args.dry_run and found:
        print(f"{len(found)} leftovers; delete them with `spotnb aws cleanup`")
    for line in failed:
        print(f"spotnb aws cleanup: {line}", file=sys.stderr)
    if failed:
        print(f"{len(failed)} step(s) of the cleanup failed; the others were done",
              file=sys.stderr)
    return 1 if failed else 0


@_reported
def cmd_doctor(args: argparse.Namespace) -> int:
    from spotnb.providers.aws.admin import doctor

    checks = doctor(args.region)
    marks = {True: "ok", False: "PROBLEM", None: "unknown"}
    for check in checks:
        print(f"{marks[check.ok]:>7}  {check.name}: {check.detail}")
    problems = sum(1 for c in checks if c.ok is False)
    print(f"\n{problems} problem(s)" if problems else "\neverything spotnb needs is in place")
    return 1 if problems else 0


@_reported
def cmd_selftest(args: argparse.Namespace) -> int:
    from spotnb.client import aws_selftest
    from spotnb.protocol.spec import SpecError

    def listed(value: str | None) -> list[str] | None:
        return [v.strip() for v in value.split(",") if v.strip()] if value else None

    types = listed(args.types) or list(aws_selftest.DEFAULT_TYPES)
    try:
        outcomes = aws_selftest.run(args.budget, region=args.region, instance_types=types,
                                    steps=listed(args.steps), dry_run=args.dry_run,
                                    say=print)
    except SpecError as err:
        print(f"spotnb aws selftest: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print("(dry run: nothing was started)")
        return 0
    spent = sum(o.cost_usd for o in outcomes)
    failed = [o.step for o in outcomes if o.ok is False]
    print(f"\nspent ${spent:.4f}; " + (f"FAILED: {', '.join(failed)}" if failed
                                       else "every step passed"))
    return 1 if failed else 0
