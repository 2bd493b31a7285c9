"""``spotnb aws setup|cleanup|doctor``: the AWS command group of the ``spotnb`` CLI.

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
