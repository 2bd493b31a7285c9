"""What a magic's line says: the options of ``%%spot_train`` and ``%%spot_sweep`` (argument
groups shared between magics, as ipyparallel's ``exec_args``), what each option is
called where its value came from, and the :class:`TrainRequest` a line makes with the
``SpotMagics`` settings filled in (:func:`train_request`). The magics themselves are
:mod:`spotnb.client.magics`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

import spotnb
from spotnb.protocol.spec import SpecError, parse_duration, parse_nodes, parse_peer_timeout

__all__ = ["MAGIC_JOB_LISTER", "NODE_HELP", "OPTIONS", "SWEEP_OPTIONS", "TYPED",
           "TrainRequest", "as_usage_errors", "job_arg", "job_args", "parse_names",
           "parse_simulation", "policy_args", "redact_notify", "resource_args", "run_args",
           "sweep_args", "train_request"]

F = TypeVar("F", bound=Callable[..., Any])
# The value of --notify on a %%spot_train line: a webhook URL, a secret.
_NOTIFY_VALUE = re.compile(r"(--notify[=\s]+)(\S+)")


def redact_notify(line: str) -> str:
    """``line`` with its ``--notify`` URL (a secret) replaced, as the remote cell quotes it."""
    return _NOTIFY_VALUE.sub(r"\1[redacted]", line)


# -- argument groups, shared between magics (as ipyparallel's exec_args) --------------

def resource_args(func: F) -> F:
    """Where a job runs: provider, instance types, region, price cap."""
    for deco in reversed((
        argument("-t", "--instance-type", dest="instance_types", metavar="TYPES",
                 help="instance types in order of preference, comma-separated, e.g. "
                      "-t g5.xlarge,g4dn.xlarge (default: SpotMagics.instance_types)"),
        argument("--max-price", type=float, metavar="USD",
                 help="the most to pay per instance-hour, e.g. --max-price 0.5 (default: "
                      "the on-demand price)"),
        argument("--provider", metavar="NAME",
                 help="where instances come from: local (the embedded local cloud, the "
                      "default) or aws (EC2 spot through your AWS account; see `spotnb "
                      "aws setup`)"),
        argument("--region", metavar="REGION",
                 help="where the job may run: a region (--region us-east-1), several "
                      "(--region us-east-1,us-west-2: the first is home, where the job's "
                      "store is), or any: the regions of SpotMagics.allowed_regions"),
    )):
        func = deco(func)
    return func


def policy_args(func: F) -> F:
    """How a job is run and when it is given up."""
    for deco in reversed((
        argument("--checkpoint-every", metavar="WHEN",
                 help="how often Checkpoint.maybe_save saves: a time (--checkpoint-every "
                      "5m) or a step count (--checkpoint-every 500steps)"),
        argument("--max-restarts-on-error", type=int, metavar="N",
                 help="rerun the cell up to N times after an error in it (default 0: an "
                      "error fails the job)"),
        argument("--budget", type=float, metavar="USD",
                 help="stop the job once it has cost this much, e.g. --budget 2.50"),
        argument("--max-duration", metavar="TIME",
                 help="stop the job after this long, e.g. --max-duration 2h"),
        argument("--keep-checkpoints", type=int, metavar="K",
                 help="how many checkpoints to keep (default 3)"),
        argument("--notify", metavar="URL",
                 help="a Slack-compatible webhook that the instance posts to when the job "
                      "is interrupted, ends or fails, e.g. --notify $webhook (a notebook "
                      "variable; default: SpotMagics.notify_url); it travels as a secret"),
        argument("--secret", action="append", dest="secrets", metavar="NAME",
                 help="an environment variable of this machine whose value the cell needs "
                      "and nobody else may read (repeat for several): --secret HF_TOKEN "
                      "--secret WANDB_API_KEY. The value goes to the cloud's secret store "
                      "(AWS: SSM Parameter Store), never into the job's spec, and is "
                      "deleted with the job (added to SpotMagics.secrets)"),
    )):
        func = deco(func)
    return func


def job_args(func: F) -> F:
    """What travels with the cell, and the shape of its job."""
    for deco in reversed((
        argument("--out", dest="outputs", metavar="NAMES",
                 help="variables to bring back into the notebook when the job completes, "
                      "e.g. --out model,accuracy"),
        argument("--in", dest="inputs", metavar="NAMES",
                 help="ship exactly these notebook variables, e.g. --in data,config "
                      "(default: every variable the cell reads before assigning it)"),
        argument("--no-capture", action="store_true",
                 help="ship no notebook variable: the cell must create everything it uses"),
        argument("--no-standby", action="store_true", default=None,
                 help="start no warm standby on a rebalance recommendation: replace the "
                      "instance only once it is gone (cheaper; each interruption then costs "
                      "a boot and a restore)"),
        argument("--standby-first-hour", action="store_true", default=None,
                 help="in an instance's first hour too, start a standby at once on a "
                      "recommendation (by default it is timed to be ready as the hour "
                      "ends: EC2 interrupting the instance before then makes it free)"),
        argument("--name", help="a name for the job, shown by %%spot_jobs"),
        argument("--nodes", metavar="N|MIN:MAX",
                 help="train on N instances as torchrun's workers (RANK, WORLD_SIZE, ... set "
                      "in the cell), e.g. --nodes 4; --nodes 3:4 goes on with 3 while a lost "
                      "node's replacement boots (default 1)"),
        argument("--procs-per-node", type=int, metavar="P",
                 help="worker processes per instance, e.g. one per GPU (default 1)"),
        argument("--peer-timeout", metavar="SECONDS",
                 help="the longest a rank waits on a silent peer before the world re-forms "
                      "without it, e.g. --peer-timeout 90 or 5m (10s to 60m; default 2m)"),
    )):
        func = deco(func)
    return func


def run_args(func: F) -> F:
    """How the job is run: simulated interruptions, environment, detaching."""
    for deco in reversed((
        argument("--simulate-interruptions", metavar="N|TIMES",
                 help="local cloud: interrupt the job N times, each soon after an attempt's "
                      "first checkpoint (or SPOTNB_LOCAL_INTERRUPT_AFTER seconds after the "
                      "first output of a cell that saves none) (--simulate-interruptions 2), "
                      "or at these times "
                      "after launch (--simulate-interruptions 20s,45s)"),
        argument("--env", action="append", metavar="NAME[=VALUE]",
                 help="an environment variable for the cell (repeat for several): "
                      "--env WANDB_MODE=offline. Values are written into the job's spec, so "
                      "no secrets (give those with --secret); on the local cloud a NAME alone "
                      "passes this machine's variable through"),
        argument("--detach", action="store_true",
                 help="return at once; the job runs on its own (follow it with %%spot_attach)"),
    )):
        func = deco(func)
    return func


def job_arg(func: F) -> F:
    """The job a command acts on."""
    return argument(
        "job", nargs="?", default=None, metavar="JOB",
        help="a job id, its name, or the end of its id, as %%spot_jobs lists them "
             "(default: the latest job)")(func)


NODE_HELP = ("node K of a multi-node job (0 to MAX-1, as the display numbers them; "
              "default: the first running instance)")


# Each spotnb.submit argument: the magic's option for it, the option's argparse
# destination, and the SpotMagics setting that gives its default. A SpecError names
# what the user typed (--budget, not budget_usd), or the setting the value came from.
OPTIONS: dict[str, tuple[str, str | None, str | None]] = {
    "provider": ("--provider", "provider", "provider"),
    "instance_types": ("--instance-type", "instance_types", "instance_types"),
    "region": ("--region", "region", "region"),
    "allowed_regions": ("SpotMagics.allowed_regions", None, "allowed_regions"),
    "max_price": ("--max-price", "max_price", "max_price"),
    "name": ("--name", "name", None),
    "outputs": ("--out", "outputs", None),
    "inputs": ("--in", "inputs", None),
    "checkpoint_every": ("--checkpoint-every", "checkpoint_every", "checkpoint_every"),
    "max_restarts_on_error": ("--max-restarts-on-error", "max_restarts_on_error",
                              "max_restarts_on_error"),
    "budget_usd": ("--budget", "budget", "budget"),
    "max_duration": ("--max-duration", "max_duration", "max_duration"),
    "keep_checkpoints": ("--keep-checkpoints", "keep_checkpoints", "keep_checkpoints"),
    "simulate_interruptions": ("--simulate-interruptions", "simulate_interruptions", None),
    "env": ("--env", "env", None),
    "secrets": ("--secret", "secrets", "secrets"),
    "store": ("SpotMagics.store", None, "store"),
    "nodes": ("--nodes", "nodes", None),
    "procs_per_node": ("--procs-per-node", "procs_per_node", None),
    "peer_timeout": ("--peer-timeout", "peer_timeout", None),
    "standby": ("--no-standby", "no_standby", "standby"),
    "standby_first_hour": ("--standby-first-hour", "standby_first_hour",
                           "standby_first_hour"),
}


# The options %%spot_sweep adds, by the spotnb.sweep argument they set.
SWEEP_OPTIONS = {"grid": "--grid", "params": "--params", "study": "--study",
                  "space": "--space", "n_trials": "--trials", "parallel": "-k/--parallel",
                  "metric": "--metric", "pruner": "--pruner", "direction": "--metric",
                  "budget_usd": "--budget", "notify_url": "--notify",
                  "sampler": "--sampler"}

# A SpecError while the line is parsed (a bad --nodes) names the option as typed.
TYPED = {field: option for field, (option, _dest, _setting) in OPTIONS.items()}


def sweep_args(func: F) -> F:
    """What ``%%spot_sweep`` adds to ``%%spot_train``'s options: the parameter sets,
    how many trials at once, the metric, and early stopping."""
    for deco in reversed((
        argument("--grid", action="append", metavar="NAME=V1,V2",
                 help="a parameter and its values (repeat for several; every combination "
                      "runs): --grid lr=0.1,0.01 --grid batch=32,64"),
        argument("--params", metavar="VAR",
                 help="a notebook variable: a list of parameter dicts, run in order "
                      "([{'lr': 0.1}, {'lr': 0.01}]), or a dict of value lists (a grid)"),
        argument("--study", metavar="VAR",
                 help="a notebook variable holding an optuna.Study whose sampler picks the "
                      "trials (with --space and --trials)"),
        argument("--space", metavar="VAR",
                 help="a notebook variable, a dict of Optuna distributions: searched by "
                      "--sampler (default tpe) for --trials N trials, or by --study's sampler"),
        argument("--sampler", choices=("tpe", "random", "cmaes", "qmc", "grid"),
                 help="how trials are picked: grid (every --grid combination in order, the "
                      "default for --grid), tpe (the default for --space), random, cmaes or "
                      "qmc (numeric ranges: --space); with --grid, --trials N of its "
                      "combinations"),
        argument("--trials", type=int, metavar="N", dest="n_trials",
                 help="how many trials at most (--space and --study: required)"),
        argument("-k", "--parallel", type=int, default=2, metavar="K",
                 help="how many trials run at once (default 2)"),
        argument("--metric", default="loss",
                 help="the metric (logged with spot.log) a trial is judged by, its last "
                      "value (default loss)"),
        argument("--prune", action="store_true",
                 help="stop trials early on --metric: with Optuna's MedianPruner, or with "
                      "--study, the study's own pruner (a study's pruner prunes only with "
                      "--prune)"),
        argument("--pruner", metavar="VAR",
                 help="a notebook variable holding an Optuna pruner to stop trials early with"),
    )):
        func = deco(func)
    return func


# -- the request %%spot_train builds ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """A parsed ``%%spot_train`` line with the configuration filled in.

    ``submit`` holds the keyword arguments of :func:`spotnb.submit` (all but the
    code, inputs and files); ``inputs`` the ``--in`` names (None: analyse the cell);
    ``names`` what each ``submit`` argument is called where its value came from (the
    option on the line, else the ``SpotMagics`` setting).
    """

    submit: dict[str, Any]
    inputs: tuple[str, ...] | None
    capture: bool
    detach: bool
    names: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The parsed line, for what a magic adds to ``%%spot_train``'s options.
    args: Any = None


def parse_names(text: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))


def parse_simulation(text: str | None) -> int | list[float] | None:
    """``--simulate-interruptions``: a count (``2``) or times with a unit (``20s,45s``);
    a bare number with a fraction or a list of bare numbers is neither, so it is refused
    rather than guessed."""
    if text is None:
        return None
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    parts = [part.strip() for part in text.split(",")]
    if parts and all(re.fullmatch(r"[\d.]+\s*[a-z]+", part) for part in parts):
        try:
            return [parse_duration(part, "--simulate-interruptions") for part in parts]
        except SpecError:
            pass
    raise UsageError(
        f"--simulate-interruptions takes a count (--simulate-interruptions 2) or times "
        f"after launch, with units (--simulate-interruptions 20s,1m), not {text!r}")


MAGIC_JOB_LISTER = "%spot_jobs"


@contextlib.contextmanager
def as_usage_errors(names: dict[str, str] | None = None) -> Iterator[None]:
    """The API's 'bad input' errors, shown as UsageError (no traceback), naming the
    options the user typed (``names``: submit argument -> option)."""
    try:
        yield
    except SpecError as err:
        raise UsageError(err.message(names)) from None
    except spotnb.JobNotFound as err:
        raise UsageError(err.message(MAGIC_JOB_LISTER)) from None



def train_request(settings: Any, args: Any, default_name: Callable[[], str]) -> TrainRequest:
    """The request of a parsed ``%%spot_train`` (or ``%%spot_sweep``) line ``args``: each
    option the line leaves out from ``settings`` (the ``SpotMagics``), the job's name
    from ``default_name`` when the line gives none."""
    if args.inputs is not None and args.no_capture:
        raise UsageError("--in and --no-capture contradict each other: --in ships the "
                         "variables named, --no-capture ships none; choose one")

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    outputs = parse_names(args.outputs)
    submit = {
        "provider": pick(args.provider, settings.provider),
        "instance_types": parse_names(args.instance_types) or tuple(settings.instance_types),
        "region": pick(args.region, settings.region),
        "allowed_regions": list(settings.allowed_regions) or None,
        "max_price": pick(args.max_price, settings.max_price),
        "name": args.name if args.name is not None else default_name(),
        "outputs": outputs,
        "checkpoint_every": pick(args.checkpoint_every, settings.checkpoint_every),
        "max_restarts_on_error": pick(args.max_restarts_on_error,
                                      settings.max_restarts_on_error),
        "budget_usd": pick(args.budget, settings.budget),
        "max_duration": pick(args.max_duration, settings.max_duration),
        "keep_checkpoints": pick(args.keep_checkpoints, settings.keep_checkpoints),
        "simulate_interruptions": parse_simulation(args.simulate_interruptions),
        "env": list(args.env or ()) or None,
        "store": settings.store,
        "notify_url": pick(args.notify, settings.notify_url),
        "secrets": list(dict.fromkeys([*settings.secrets, *(args.secrets or ())])) or None,
        "standby": False if args.no_standby else settings.standby,
        "standby_first_hour": bool(args.standby_first_hour or settings.standby_first_hour),
    }
    # Only a distributed job passes these (submit's defaults: one node, one process).
    if args.nodes is not None:
        submit["nodes"] = parse_nodes(args.nodes)
    if args.procs_per_node is not None:
        submit["procs_per_node"] = args.procs_per_node
    if args.peer_timeout is not None:
        submit["peer_timeout"] = parse_peer_timeout(args.peer_timeout)
    names = {}
    for field, (option, dest, setting) in OPTIONS.items():
        typed = dest is not None and getattr(args, dest) is not None
        names[field] = option if typed or setting is None else f"SpotMagics.{setting}"
    return TrainRequest(submit=submit,
                        inputs=parse_names(args.inputs) if args.inputs is not None else None,
                        capture=not args.no_capture, detach=args.detach, names=names,
                        args=args)
