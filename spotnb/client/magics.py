"""The IPython magics: ``%%spot_train`` and the commands around it.

Thin by design: each magic parses its line, calls the Python API
(:func:`spotnb.submit`, :func:`spotnb.attach`, :func:`spotnb.jobs`) and renders what
comes back; following a job is :func:`spotnb.client.display.follow`, finding a cell's inputs
:func:`spotnb.client.capture.capture`. Bad input raises ``UsageError`` (shown without a
traceback) before anything starts.

Defaults come from traitlets configuration: ``%config SpotMagics.instance_types =
["g5.xlarge"]`` in the notebook, or ``c.SpotMagics.instance_types = [...]`` in
``ipython_config.py``; ``%spot_config`` shows the effective settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, List, TraitError, Type, Unicode, validate

import spotnb
from spotnb.client import capture, display
from spotnb.client.listing import JOB_COLUMNS, jobs_table
from spotnb.client.notebook import ENV_RUN_JOBS
from spotnb.protocol.events import is_terminal
from spotnb.protocol.spec import SpecError, parse_duration, parse_nodes, parse_peer_timeout

if TYPE_CHECKING:
    from spotnb.protocol.events.fold import JobState
    from spotnb.records.summary import Curves

__all__ = ["SpotMagics", "TrainRequest"]

F = TypeVar("F", bound=Callable[..., Any])
_MIB = 1 << 20
# The value of --notify on a %%spot_train line: a webhook URL, a secret.
_NOTIFY_VALUE = re.compile(r"(--notify[=\s]+)(\S+)")


class _NameList(List):
    """A list of names that also accepts one comma-separated string."""

    def set(self, obj: Any, value: Any) -> None:
        # List.set would wrap a string in a list before validation sees it.
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        super().set(obj, value)


# -- argument groups, shared between magics (as ipyparallel's exec_args) --------------

def _resource_args(func: F) -> F:
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


def _policy_args(func: F) -> F:
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


def _job_args(func: F) -> F:
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


def _run_args(func: F) -> F:
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


def _job_arg(func: F) -> F:
    """The job a command acts on."""
    return argument(
        "job", nargs="?", default=None, metavar="JOB",
        help="a job id, its name, or the end of its id, as %%spot_jobs lists them "
             "(default: the latest job)")(func)


_NODE_HELP = ("node K of a multi-node job (0 to MAX-1, as the display numbers them; "
              "default: the first running instance)")


# Each spotnb.submit argument: the magic's option for it, the option's argparse
# destination, and the SpotMagics setting that gives its default. A SpecError names
# what the user typed (--budget, not budget_usd), or the setting the value came from.
_OPTIONS: dict[str, tuple[str, str | None, str | None]] = {
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
_SWEEP_OPTIONS = {"grid": "--grid", "params": "--params", "study": "--study",
                  "space": "--space", "n_trials": "--trials", "parallel": "-k/--parallel",
                  "metric": "--metric", "pruner": "--pruner", "direction": "--metric",
                  "budget_usd": "--budget", "notify_url": "--notify",
                  "sampler": "--sampler"}

# A SpecError while the line is parsed (a bad --nodes) names the option as typed.
_TYPED = {field: option for field, (option, _dest, _setting) in _OPTIONS.items()}


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


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))


def _simulation(text: str | None) -> int | list[float] | None:
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


_MAGIC_JOB_LISTER = "%spot_jobs"


@contextlib.contextmanager
def _as_usage_errors(names: dict[str, str] | None = None) -> Iterator[None]:
    """The API's 'bad input' errors, shown as UsageError (no traceback), naming the
    options the user typed (``names``: submit argument -> option)."""
    try:
        yield
    except SpecError as err:
        raise UsageError(err.message(names)) from None
    except spotnb.JobNotFound as err:
        raise UsageError(err.message(_MAGIC_JOB_LISTER)) from None


@magics_class
class SpotMagics(Magics):
    """``%%spot_train`` and friends; ``%spot_config`` lists the settings below."""

    provider = Unicode("local", help="Where instances come from: 'local' (the embedded "
                                     "local cloud) or 'aws' (EC2 spot).").tag(config=True)
    instance_types = _NameList(
        Unicode(), default_value=["g4dn.xlarge"],
        help="Instance types in order of preference (a list, or one comma-separated "
             "string).").tag(config=True)
    region = Unicode("us-east-1", help="Where jobs may run: a region, several "
                                       "('us-east-1,us-west-2': the first is home, where a "
                                       "job's store is), or 'any' (allowed_regions)."
                     ).tag(config=True)
    allowed_regions = _NameList(
        Unicode(), default_value=[],
        help="The regions jobs may run in (data residency), e.g. ['eu-west-1', "
             "'eu-central-1']: --region any means these, and a region outside them is "
             "refused. Empty: $SPOTNB_ALLOWED_REGIONS, else no restriction (and no "
             "'any').").tag(config=True)
    gpu_reference = Unicode(
        "", help="The instance picker's reference GPU: a job is sized in hours on one "
                 "of it, e.g. 'A10G'. Empty: the GPU of the default instance type when "
                 "the first %spot_picker opens, then kept here, so that the costs shown "
                 "do not change when chosen types change the default.").tag(config=True)
    max_price = Float(None, allow_none=True,
                      help="USD per instance-hour at most (None: the on-demand price)."
                      ).tag(config=True)
    checkpoint_every = Unicode("5m", help="When Checkpoint.maybe_save saves: '5m' or "
                                           "'500 steps'.").tag(config=True)
    max_restarts_on_error = Int(0, help="Reruns of the cell after an error in it."
                                ).tag(config=True)
    budget = Float(None, allow_none=True, help="Stop a job once it has cost this many USD."
                   ).tag(config=True)
    max_duration = Unicode(None, allow_none=True, help="Stop a job after this long "
                                                       "('2h').").tag(config=True)
    keep_checkpoints = Int(3, help="Checkpoints kept per job.").tag(config=True)
    store = Unicode(None, allow_none=True, help="Where jobs are kept (None: "
                                                "$SPOTNB_HOME/store).").tag(config=True)
    capture_limit_mb = Float(100.0, help="The largest notebook variable shipped with a "
                                         "cell, pickled, in MiB.").tag(config=True)
    files_limit_mb = Float(50.0, help="The most local module files shipped with a cell, "
                                      "in MiB.").tag(config=True)
    secrets = _NameList(
        Unicode(), default_value=[],
        help="Environment variables of this machine that every job's cell gets as "
             "secrets (e.g. ['HF_TOKEN', 'WANDB_API_KEY']); --secret adds more. Their "
             "values go to the cloud's secret store, never into a job's spec."
    ).tag(config=True)
    notify_url = Unicode(None, allow_none=True,
                         help="A Slack-compatible webhook that the instance posts to when a "
                              "job is interrupted, ends or fails (a secret: set it in "
                              "ipython_config.py, not in a notebook).").tag(config=True)
    standby = Bool(True, help="On a rebalance recommendation, start a warm standby that "
                              "takes the job over at the interruption notice (it is billed "
                              "to the job: README, 'Warm standbys'); --no-standby turns it "
                              "off for one cell.").tag(config=True)
    standby_first_hour = Bool(False, help="Start a standby at once in an instance's first "
                                          "hour too (by default it is timed to be ready as "
                                          "the hour ends: an interruption before then is "
                                          "free); --standby-first-hour for one cell."
                              ).tag(config=True)
    renderer_class = Type(None, klass=object, allow_none=True,
                          help="The display that follows a job (a spotnb.client.display."
                               "Renderer). None: the widget dashboard where widgets "
                               "render (a Jupyter kernel with ipywidgets and plotly), "
                               "else the text display.").tag(config=True)

    def __init__(self, shell: Any = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.last_job: str | None = None

    @property
    def _ip(self) -> Any:
        if self.shell is None:
            raise TypeError("SpotMagics has no shell; this is a spotnb bug, please report it")
        return self.shell

    @validate("max_price", "budget")
    def _positive(self, proposal: Any) -> Any:
        value = proposal["value"]
        if value is not None and not value > 0:
            raise TraitError(f"{proposal['trait'].name} must be above 0, not {value!r}")
        return value

    @validate("allowed_regions")
    def _valid_regions(self, proposal: Any) -> Any:
        from spotnb.providers.regions import allowed_regions

        try:
            return list(allowed_regions(proposal["value"]) if proposal["value"] else ())
        except SpecError as err:
            raise TraitError(err.message({"allowed_regions": "allowed_regions"})) from None

    @validate("checkpoint_every")
    def _valid_every(self, proposal: Any) -> Any:
        from spotnb.protocol.spec import CheckpointEvery

        try:
            CheckpointEvery.parse(proposal["value"])
        except SpecError as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    # -- %%spot_train ---------------------------------------------------------------

    @magic_arguments(name="%spot_train")
    @_resource_args
    @_job_args
    @_policy_args
    @_run_args
    @cell_magic
    def spot_train(self, line: str, cell: str) -> Any:
        """Run this cell on a spot instance; survive interruptions by resuming.

        The cell runs in an IPython kernel on the instance, with ``spot`` (the runtime
        API) defined. The notebook variables it reads are shipped with it, as are the
        modules it imports from the notebook's directory. Its output, metrics and
        interruptions show here while it runs. Interrupting this cell detaches: the job
        keeps running; ``%spot_attach JOB`` follows it again, ``%spot_stop JOB`` stops it.

        Example::

            %%spot_train -t g5.xlarge,g4dn.xlarge --max-price 0.6 --out model
            ckpt = spot.Checkpoint(model=model, optimizer=opt)
            for step in range(ckpt.restore(), 1000):
                loss = train_step()
                spot.log(step, loss=loss)
                ckpt.maybe_save(step)

        Try it on the local cloud with ``--simulate-interruptions 2``.
        """
        with _as_usage_errors(_TYPED):
            request = self.train_request(line)
        if not cell.strip():
            raise UsageError("the cell is empty: put the training code below the "
                             "%%spot_train line")
        if cell.lstrip().startswith("%%"):
            raise UsageError("a cell magic cannot run inside %%spot_train; use a line "
                             "magic (%time) or plain Python in the cell")
        cap = self._capture(cell, request)
        # The remote cell's line 1 quotes this line: never with the webhook's URL in it.
        code = cap.first_line(_NOTIFY_VALUE.sub(r"\1[redacted]", line)) + "\n" + cell
        with _as_usage_errors(request.names):
            handle = spotnb.submit(code, inputs=cap.inputs, files=cap.files,
                                   **request.submit)
        self.last_job = handle.job_id
        _tell_runner(handle.job_id, followed=not request.detach)
        # Warnings first: a cell that will not resume exactly is told on its first line.
        for warning in handle.warnings:
            print(f"[spotnb] warning: {warning}")
        print(_shipping_line(cap), *cap.notes, sep="\n")
        if request.detach:
            print(f"[spotnb] submitted job {handle.job_id} ({handle.spec.name!r}); it runs "
                  f"on its own. Follow it with `%spot_attach {handle.job_id}`, stop it with "
                  f"`%spot_stop {handle.job_id}`.")
            return None
        return self._follow(handle, cell_number=self._cell_number())

    def train_request(self, line: str, magic: Any = None) -> TrainRequest:
        """Parse a ``%%spot_train`` line (or the line of ``magic``, which takes its
        options and more), filling in the configured defaults."""
        magic = magic or self.spot_train
        try:
            args = parse_argstring(magic, line)
        except UsageError as err:
            which = f"%%{magic.__name__}"
            raise UsageError(f"{which}: {err}. See {which}? for the options.") from None
        if args.inputs is not None and args.no_capture:
            raise UsageError("--in and --no-capture contradict each other: --in ships the "
                             "variables named, --no-capture ships none; choose one")

        def pick(value: Any, default: Any) -> Any:
            return default if value is None else value

        outputs = _names(args.outputs)
        submit = {
            "provider": pick(args.provider, self.provider),
            "instance_types": _names(args.instance_types) or tuple(self.instance_types),
            "region": pick(args.region, self.region),
            "allowed_regions": list(self.allowed_regions) or None,
            "max_price": pick(args.max_price, self.max_price),
            "name": args.name if args.name is not None else self._default_name(),
            "outputs": outputs,
            "checkpoint_every": pick(args.checkpoint_every, self.checkpoint_every),
            "max_restarts_on_error": pick(args.max_restarts_on_error,
                                          self.max_restarts_on_error),
            "budget_usd": pick(args.budget, self.budget),
            "max_duration": pick(args.max_duration, self.max_duration),
            "keep_checkpoints": pick(args.keep_checkpoints, self.keep_checkpoints),
            "simulate_interruptions": _simulation(args.simulate_interruptions),
            "env": list(args.env or ()) or None,
            "store": self.store,
            "notify_url": pick(args.notify, self.notify_url),
            "secrets": list(dict.fromkeys([*self.secrets, *(args.secrets or ())])) or None,
            "standby": False if args.no_standby else self.standby,
            "standby_first_hour": bool(args.standby_first_hour or self.standby_first_hour),
        }
        # Only a distributed job passes these (submit's defaults: one node, one process).
        if args.nodes is not None:
            submit["nodes"] = parse_nodes(args.nodes)
        if args.procs_per_node is not None:
            submit["procs_per_node"] = args.procs_per_node
        if args.peer_timeout is not None:
            submit["peer_timeout"] = parse_peer_timeout(args.peer_timeout)
        names = {}
        for field, (option, dest, setting) in _OPTIONS.items():
            typed = dest is not None and getattr(args, dest) is not None
            names[field] = option if typed or setting is None else f"SpotMagics.{setting}"
        return TrainRequest(submit=submit,
                            inputs=_names(args.inputs) if args.inputs is not None else None,
                            capture=not args.no_capture, detach=args.detach, names=names,
                            args=args)

    def _default_name(self) -> str:
        # Jupyter tells the kernel which notebook it serves.
        session = os.environ.get("JPY_SESSION_NAME", "")
        stem = Path(session).stem if session else "cell"
        count = self._cell_number()
        return f"{stem}-{count}" if count is not None else stem

    def _cell_number(self) -> int | None:
        """The running cell's ``In[n]``. IPython 8 increments ``execution_count`` after
        a cell, IPython 9 before it; the history has stored the cell at ``n`` in both."""
        raw = getattr(getattr(self._ip, "history_manager", None), "input_hist_raw", None)
        if raw:
            return len(raw) - 1
        count = getattr(self._ip, "execution_count", None)
        return int(count) if count is not None else None

    def _capture(self, body: str, request: TrainRequest) -> capture.Capture:
        try:
            # Line 1 stands for the magic line, so errors name the cell's own lines.
            return capture.capture(
                "#\n" + body, self._ip.user_ns, Path.cwd(),
                names=request.inputs, variables=request.capture,
                limit_bytes=int(self.capture_limit_mb * _MIB),
                files_limit_bytes=int(self.files_limit_mb * _MIB),
                hidden=self._ip.user_ns_hidden)
        except SyntaxError as err:
            text = (err.text or "").rstrip()
            raise UsageError(
                f"the cell does not compile: line {err.lineno}: {err.msg}"
                + (f"\n    {text}" if text else "")
                + "\nFix the line and run the cell again; nothing was started.") from None
        except capture.CaptureError as err:
            raise UsageError(str(err)) from None

    def _renderer(self) -> display.Renderer:
        cls = self.renderer_class
        if cls is None:
            cls = display.TextRenderer
            if _widgets_render(self._ip):
                from spotnb.widgets import Dashboard

                cls = Dashboard
        return cast(display.Renderer, cls())

    def _follow(self, handle: spotnb.JobHandle, cell_number: int | None = None) -> Any:
        from spotnb.records.summary import Curves

        renderer = self._renderer()
        curves = Curves()  # the record's, gathered as the events come
        outcome = display.follow(handle, renderer, on_events=curves.add)
        if isinstance(outcome, display.Detached):
            return None
        result = outcome.result
        self._keep_record(handle, result, outcome.state, curves)
        shortfall = _simulation_shortfall(handle.spec, result)
        if shortfall:
            print(shortfall)
        if result.status != "completed":
            raise display.SpotJobError(result, cell_number)
        if outcome.outputs_error is not None:
            raise UsageError(
                f"job {result.job_id} completed, but its outputs "
                f"({', '.join(handle.spec.outputs)}) cannot be loaded here: "
                f"{outcome.outputs_error}. Install what they need in this environment, "
                f"then run %spot_attach {result.job_id} to load them.")
        self._ip.user_ns.update(result.outputs)
        if outcome.execute_result is not None:
            return display.RemoteValue(outcome.execute_result)
        return None

    def _keep_record(self, handle: spotnb.JobHandle, result: spotnb.JobResult,
                     state: JobState | None = None, curves: Curves | None = None) -> None:
        """The job's record (spotnb.records), from what the follow loop holds: stored
        as summary.json in its store prefix and shown as one line whose output metadata
        carries it, so a notebook saved by hand is a record too."""
        from IPython.display import display as show

        from spotnb import records

        record = records.job_ended(handle, result, state, curves)
        if record is not None:
            show(records.record_bundle(record), metadata={"spotnb": {"job": record}}, raw=True)

    # -- %%spot_sweep ---------------------------------------------------------------

    @magic_arguments(name="%spot_sweep")
    @argument("--grid", action="append", metavar="NAME=V1,V2",
              help="a parameter and its values (repeat for several; every combination "
                   "runs): --grid lr=0.1,0.01 --grid batch=32,64")
    @argument("--params", metavar="VAR",
              help="a notebook variable: a list of parameter dicts, run in order "
                   "([{'lr': 0.1}, {'lr': 0.01}]), or a dict of value lists (a grid)")
    @argument("--study", metavar="VAR",
              help="a notebook variable holding an optuna.Study whose sampler picks the "
                   "trials (with --space and --trials)")
    @argument("--space", metavar="VAR",
              help="a notebook variable, a dict of Optuna distributions: searched by "
                   "--sampler (default tpe) for --trials N trials, or by --study's sampler")
    @argument("--sampler", choices=("tpe", "random", "cmaes", "qmc", "grid"),
              help="how trials are picked: grid (every --grid combination in order, the "
                   "default for --grid), tpe (the default for --space), random, cmaes or "
                   "qmc (numeric ranges: --space); with --grid, --trials N of its "
                   "combinations")
    @argument("--trials", type=int, metavar="N", dest="n_trials",
              help="how many trials at most (--space and --study: required)")
    @argument("-k", "--parallel", type=int, default=2, metavar="K",
              help="how many trials run at once (default 2)")
    @argument("--metric", default="loss",
              help="the metric (logged with spot.log) a trial is judged by, its last "
                   "value (default loss)")
    @argument("--prune", action="store_true",
              help="stop trials early on --metric: with Optuna's MedianPruner, or with "
                   "--study, the study's own pruner (a study's pruner prunes only with "
                   "--prune)")
    @argument("--pruner", metavar="VAR",
              help="a notebook variable holding an Optuna pruner to stop trials early with")
    @_resource_args
    @_job_args
    @_policy_args
    @_run_args
    @cell_magic
    def spot_sweep(self, line: str, cell: str) -> Any:
        """Run this cell once per parameter set, each trial a spot job with its own
        resume; at most K at once, under one --budget for the whole sweep; the
        sweep's view (its trials table, their analysis and curves) follows them live;
        the cell stays busy until the sweep ends (``--detach``: returns at once). Each
        parameter is a variable the cell reads. Early stopping: --prune (or --pruner
        VAR) stops a trial whose --metric the pruner finds behind, and its instance ends
        at once. One --notify message at the end, none per trial. Interrupting this cell
        detaches: the sweep goes on in this kernel; ``%spot_attach SWEEP`` shows it
        again, ``%spot_sweep_stop SWEEP`` ends it.

        Example::

            %%spot_sweep --grid lr=0.1,0.03,0.01 --grid batch=32,64 -k 2 --prune --budget 5
            for step in range(200):
                loss = train_step(lr, batch)
                spot.log(step, loss=loss)
        """
        from spotnb.sweep import api

        with _as_usage_errors(_TYPED):
            request = self.train_request(line, self.spot_sweep)
        args = request.args
        if not cell.strip():
            raise UsageError("the cell is empty: put the training code below the "
                             "%%spot_sweep line")
        space: dict[str, Any] = {}
        with _as_usage_errors(_SWEEP_OPTIONS):
            if args.grid:
                from spotnb.sweep.space import parse_assignments

                space["grid"] = parse_assignments(args.grid, "--grid")
            if args.params is not None:
                value = self._variable(args.params, "--params")
                space["grid" if isinstance(value, dict) else "params"] = value
            if args.study is not None:
                space["study"] = self._variable(args.study, "--study")
            if args.space is not None:
                space["space"] = self._variable(args.space, "--space")
            pruner, note = self._sweep_pruner(args, space.get("study"))
            if args.pruner:
                pruner = self._variable(args.pruner, "--pruner")
            if len([k for k in ("grid", "params", "study") if k in space]) > 1 or \
                    not space:
                raise UsageError("%%spot_sweep needs one of --grid NAME=V1,V2 (repeatable), "
                                 "--params VAR, --space VAR --trials N, or --study VAR "
                                 "--space VAR --trials N")
        cap = self._capture(cell, request)
        code = cap.first_line(_NOTIFY_VALUE.sub(r"\1[redacted]", line)) + "\n" + cell
        options = dict(request.submit)
        notify_url = options.pop("notify_url")
        budget = options.pop("budget_usd")
        name = options.pop("name")
        with _as_usage_errors({**request.names, **_SWEEP_OPTIONS}):
            made = api.sweep(code, **space, n_trials=args.n_trials, parallel=args.parallel,
                             metric=args.metric, pruner=pruner, budget_usd=budget,
                             sampler=args.sampler, notify_url=notify_url, name=name,
                             inputs=cap.inputs, files=cap.files, syntax="magic", **options)
        if note:
            print(note)
        # Under `spotnb run`, a timed-out cell's trials are stopped as its jobs would be.
        made.listen(lambda what, run: _tell_runner(run.job_id, not request.detach)
                    if what == "run" else None)
        print(_shipping_line(cap).replace("shipping", f"sweep {made.sweep_id}: shipping"),
              *cap.notes, sep="\n")
        if request.detach:
            print(f"[spotnb] sweep {made.sweep_id} ({made.name!r}) runs in this kernel "
                  f"(while it lives); `%spot_attach {made.sweep_id}` shows it, "
                  f"`%spot_sweep_stop {made.sweep_id}` ends it.")
            return None
        return self._follow_sweep(made)

    @staticmethod
    def _sweep_pruner(args: Any, study: Any) -> tuple[Any, str]:
        """The pruner the line asks for, and a note for the user: ``--pruner VAR``;
        ``--prune`` (a study's own pruner, else Optuna's MedianPruner); none without
        either, a study's own included (said so)."""
        from spotnb.sweep.space import import_optuna

        optuna = import_optuna()
        if args.pruner:
            return None, ""  # filled in by the caller: the notebook's variable
        own = getattr(study, "pruner", None)
        if args.prune:
            if own is not None and not isinstance(own, optuna.pruners.NopPruner):
                return own, ""
            return optuna.pruners.MedianPruner(n_startup_trials=2), ""
        if own is not None and not isinstance(own, optuna.pruners.NopPruner):
            return optuna.pruners.NopPruner(), (
                f"[spotnb] the study's {type(own).__name__} prunes nothing here: add "
                "--prune to stop trials early with it")
        return None, ""

    def _variable(self, name: str, option: str) -> Any:
        if name not in self._ip.user_ns:
            raise UsageError(f"{option} {name}: the notebook has no variable {name!r}; "
                             "define it in a cell above")
        return self._ip.user_ns[name]

    def _follow_sweep(self, made: Any) -> None:
        """Show the sweep (its view where widgets render, else its summary at the end),
        wait for its end with the cell busy, and keep every trial's record; the view's
        final form stays as a picture for readers without widgets."""
        from IPython.display import display as show

        from spotnb.records.summary import Curves
        from spotnb.sweep.view import summary_text

        view = None
        if _widgets_render(self._ip):
            from spotnb.widgets.sweep import SweepView

            view = SweepView(made)
            view.show()
        try:
            made.wait()
        except KeyboardInterrupt:
            if made.driving:
                print(f"[spotnb] detached; sweep {made.sweep_id} goes on in this kernel. "
                      f"`%spot_attach {made.sweep_id}` shows it again, "
                      f"`%spot_sweep_stop {made.sweep_id}` ends it.")
            else:
                made.detach()
                print(f"[spotnb] detached; sweep {made.sweep_id} is no longer followed "
                      "here.")
            return
        if view is not None:
            view.finish()
        for number in sorted(made.runs):
            run = made.runs[number]
            if not is_terminal(run.result.status):
                continue
            curves = Curves()  # the trial's curves as its series hold them: no log read
            for name, series in run.data.metrics.items():
                series.curve.full.sort_by_x()
                curves.put(name, series.curve.full.x, series.curve.full.y)
            self._keep_record(run.handle, run.result, run.state, curves)
        show({"text/plain": summary_text(made)},
             metadata={"spotnb": {"sweep": made.state_dict()}}, raw=True)

    # -- the other commands ----------------------------------------------------------

    @magic_arguments()
    @argument("--resume", action="store_true",
              help="a sweep whose driver is gone (abandoned: its kernel closed): drive it "
                   "on here, starting the trials it had not started")
    @_job_arg
    @line_magic
    def spot_attach(self, line: str) -> Any:
        """Show a job's whole history, then follow it until it ends; for a sweep (its id,
        ``sweep-...``, or its name), its view (trials, analysis, curves), followed until
        it ends. A sweep whose driver is gone starts no trial unless ``--resume``.

        Works after a kernel restart: everything is read back from the job's store.
        Its ``--out`` variables are set when it completes. Example: ``%spot_attach``
        (the latest job), ``%spot_attach 20250101-120000-ab12cd``,
        ``%spot_attach my-sweep --resume``.
        """
        args = parse_argstring(self.spot_attach, line)
        if args.job is not None and args.job.startswith("sweep-"):
            return self._attach_sweep(args.job, args.resume)
        try:
            handle = self._resolve(args.job)
        except UsageError:
            if args.job is not None and self._is_sweep(args.job):
                return self._attach_sweep(args.job, args.resume)
            raise
        if args.resume:
            raise UsageError(f"--resume is for a sweep; {handle.job_id} is a job (a job "
                             "resumes by itself)")
        self.last_job = handle.job_id
        return self._follow(handle)

    def _is_sweep(self, name: str) -> bool:
        from spotnb.sweep import find_sweep

        return find_sweep(name, store=self.store) is not None

    def _attach_sweep(self, name: str, resume: bool = False) -> None:
        """A sweep's view (replayed from the store), followed until the sweep ends; one
        whose driver is gone (a restarted kernel) is driven on here with ``resume``."""
        from spotnb.sweep import SweepNotFound, attach_sweep

        try:
            made = attach_sweep(name, store=self.store, resume=resume)
        except SweepNotFound as err:
            raise UsageError(str(err)) from None
        if made.abandoned and not resume:
            print(f"[spotnb] sweep {made.sweep_id} is abandoned (its driver is gone): its "
                  f"running trials are followed, no trial is started. "
                  f"`%spot_attach {made.sweep_id} --resume` drives it on; "
                  f"`%spot_sweep_stop {made.sweep_id}` ends it.")
        return self._follow_sweep(made)

    @magic_arguments()
    @argument("sweep", metavar="SWEEP",
              help="the sweep's id (sweep-...) or name, as `spotnb sweeps` lists them")
    @line_magic
    def spot_sweep_stop(self, line: str) -> None:
        """End a sweep for good: its driver (in this kernel or another) starts no more
        trials, every running trial's job is stopped (its instance deleted), and the
        store says it stopped, so a later ``%spot_attach`` starts nothing."""
        from spotnb.sweep import SweepNotFound, stop_sweep

        args = parse_argstring(self.spot_sweep_stop, line)
        try:
            done = stop_sweep(args.sweep, store=self.store, reason="%spot_sweep_stop")
        except SweepNotFound as err:
            raise UsageError(str(err)) from None
        print(_sweep_stopped_text(done, "%spot_attach"))

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_stop(self, line: str) -> None:
        """Stop a job: its cell is interrupted and its instance deleted."""
        args = parse_argstring(self.spot_stop, line)
        handle = self._resolve(args.job)
        if handle.result_record() is not None:
            print(f"job {handle.job_id} already ended ({handle.status}); "
                  "it has no instance to stop.")
            return
        with _as_usage_errors():
            handle.stop(reason="%spot_stop")
        print(f"job {handle.job_id} stopped; its instance is deleted. Its history stays: "
              f"`%spot_logs {handle.job_id}`.")

    @magic_arguments()
    @argument("--node", type=int, metavar="K", default=None, help=_NODE_HELP)
    @_job_arg
    @line_magic
    def spot_interrupt(self, line: str) -> None:
        """Deliver a spot interruption notice to a job's instance now (to try resume);
        ``--node K``: to node K of a multi-node job."""
        args = parse_argstring(self.spot_interrupt, line)
        handle = self._resolve(args.job)
        with _as_usage_errors():
            handle.interrupt(node=args.node)
        which = f"node {args.node} of job" if args.node is not None else "job"
        print(f"interruption notice delivered to {which} {handle.job_id}: it checkpoints "
              f"and resumes on a replacement; watch it with `%spot_attach {handle.job_id}`.")

    @magic_arguments()
    @argument("--node", type=int, metavar="K", default=None, help=_NODE_HELP)
    @_job_arg
    @line_magic
    def spot_kill(self, line: str) -> None:
        """Local cloud: end a job's instance (``--node K``: node K) at once, without a
        notice, as a machine lost outright: the way to test a cell against one. The job
        goes on from its last checkpoint on a replacement."""
        args = parse_argstring(self.spot_kill, line)
        handle = self._resolve(args.job)
        with _as_usage_errors():
            handle.kill(node=args.node)
        which = f"node {args.node} of job" if args.node is not None else "job"
        print(f"kill requested for {which} {handle.job_id}: its group ends the instance at "
              f"its next tick, without notice; the job goes on from its last checkpoint on "
              f"a replacement; watch it with `%spot_attach {handle.job_id}`.")

    @magic_arguments()
    @argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    @_job_arg
    @line_magic
    def spot_logs(self, line: str) -> None:
        """Print a job's output and events (``-f``: follow until it ends).

        Each read of the log is written at once, so the whole history so far is one
        output, and each later batch one more."""
        from spotnb.client.listing import format_events

        args = parse_argstring(self.spot_logs, line)
        handle = self._resolve(args.job)
        with contextlib.suppress(KeyboardInterrupt):
            for batch in handle.event_batches(follow=args.follow, batches=True):
                text = format_events(batch)
                if text:
                    print(text, flush=True)

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_result(self, line: str) -> spotnb.JobResult:
        """A job's :class:`spotnb.JobResult` (status, cost, on-demand cost, attempts,
        metrics, and the ``--out`` values of a completed job), for use in code:
        ``r = %spot_result`` then ``r.cost_usd``, ``r.outputs["model"]``."""
        args = parse_argstring(self.spot_result, line)
        handle = self._resolve(args.job)
        try:
            return handle.summary(with_outputs=True)
        except Exception as err:  # unpickling runs arbitrary code; report, don't crash
            print(f"[spotnb] the outputs of job {handle.job_id} ({', '.join(handle.spec.outputs)}) "
                  f"cannot be loaded here: {type(err).__name__}: {err}. Install what they "
                  "need in this environment, then run %spot_result again.")
            return handle.summary()

    @line_magic
    def spot_jobs(self, line: str) -> None:
        """A table of jobs, newest first: name, status, instance type, duration, cost,
        saving, last metric, attempts, interruptions, nodes, age."""
        from IPython.display import display as show

        with _as_usage_errors():
            rows = spotnb.jobs(store=self.store)
        if not rows:
            print("no jobs yet: put %%spot_train on a cell to start one")
            return
        table, notes = jobs_table(rows, time.time())
        bundle = _table_bundle(JOB_COLUMNS, table)
        for note in notes:
            bundle["text/plain"] += f"\n{note}"
            bundle["text/html"] += f"<p>{note}</p>"
        show(bundle, raw=True)

    @line_magic
    def spot_config(self, line: str) -> None:
        """The effective %%spot_train defaults, and how to change them."""
        from IPython.display import display as show

        rows = []
        for name, trait in sorted(self.class_traits(config=True).items()):
            value = getattr(self, name)
            if isinstance(value, type):
                value = f"{value.__module__}.{value.__qualname__}"
            shown = repr(value)
            if name == "notify_url" and value:
                shown = "(set; a secret, not shown)"
            rows.append((f"SpotMagics.{name}", shown, trait.help))
        bundle = _table_bundle(("setting", "value", "meaning"), rows)
        note = ("Change a setting with %config SpotMagics.NAME = VALUE, or for every "
                "notebook in ipython_config.py: c.SpotMagics.NAME = VALUE. A %%spot_train "
                "option overrides it for one cell.")
        bundle["text/plain"] += "\n\n" + note
        bundle["text/html"] += f"<p>{note}</p>"
        show(bundle, raw=True)

    @magic_arguments()
    @argument("--region", metavar="REGION",
              help="the regions shown first: one, several (us-east-1,eu-west-1) or any "
                   "(SpotMagics.allowed_regions); default: SpotMagics.region")
    @argument("--gpu-hours", type=float, default=100.0, metavar="N",
              help="size of the job to estimate: hours on one reference GPU (default 100)")
    @argument("--gpu", metavar="MODEL",
              help="the reference GPU of --gpu-hours, e.g. --gpu A10G, kept for the next "
                   "pickers (default: SpotMagics.gpu_reference, else the GPU of the first "
                   "default instance type)")
    @argument("--state-gb", type=float, default=None, metavar="GB",
              help="the job's checkpoint size in GB, which a job away from its home "
                   "region moves at each save and restore (default 1)")
    @argument("--count", type=int, default=1, metavar="N",
              help="instances the job needs at once (nodes), for the placement scores "
                   "(default 1)")
    @line_magic
    def spot_picker(self, line: str) -> Any:
        """Choose instance types and regions, ranked by what your job would cost there:
        GPU, speed, on-demand and spot prices, savings, interruption frequency, the
        checkpoint's transfer to the home region, the Spot placement score, and the
        expected hours, interruptions and cost of a job of N hours on one GPU.

        The rows you choose, in order of preference, become the defaults of the next
        ``%%spot_train`` (``SpotMagics.instance_types`` and ``region``), and the
        equivalent ``%%spot_train -t ... --region ...`` line is shown. Example:
        ``%spot_picker --gpu-hours 500 --region any``.
        """
        args = parse_argstring(self.spot_picker, line)
        from spotnb import widgets
        from spotnb.providers import catalog, regions

        if not widgets.available():
            raise UsageError(f"%spot_picker needs widgets: {widgets.INSTALL_HINT}")
        with _as_usage_errors({"region": "--region", "allowed_regions":
                               "SpotMagics.allowed_regions"}):
            if args.region is not None:
                regions.region_names(args.region, regions.allowed_regions(
                    list(self.allowed_regions) or None))
        if args.gpu is not None and args.gpu not in catalog.gpu_speeds():
            raise UsageError(f"no speed figure for GPU {args.gpu!r}; choose one of "
                             f"{', '.join(sorted(catalog.gpu_speeds()))}")
        if args.state_gb is not None and not (args.state_gb >= 0 and args.state_gb < 1e6):
            raise UsageError(f"--state-gb must be a size in GB of 0 or more, not "
                             f"{args.state_gb:g}")
        from spotnb.protocol.spec import MAX_NODES

        if not 1 <= args.count <= MAX_NODES:
            raise UsageError(f"--count must be 1 to {MAX_NODES} instances, not {args.count}")
        sizes = {"state_gb": args.state_gb} if args.state_gb is not None else {}
        return widgets.InstancePicker(args.region, magics=self, work_hours=args.gpu_hours,
                                      reference=args.gpu, count=args.count, **sizes)

    @magic_arguments()
    @argument("runs", nargs="+", metavar="JOB_OR_RECORD",
              help="jobs (an id, a name, the end of an id; running or ended) and records "
                   "(.ipynb paths)")
    @argument("--no-follow", action="store_true",
              help="show the runs as they are now; do not follow the live ones")
    @line_magic
    def spot_compare(self, line: str) -> Any:
        """Overlay runs: a panel per metric, a colour per run, each run's interruptions
        dashed in its colour, and a table of the runs (parameters, final and best
        metrics, duration, cost, saving, interruptions) that sorts by a click on a
        header; a click on a row hides or shows a run. Live runs keep updating.
        Example: ``%spot_compare lr-0.1 lr-0.05 results/base.record.ipynb``.
        """
        args = parse_argstring(self.spot_compare, line)
        from spotnb import widgets

        if not widgets.available():
            raise UsageError(f"%spot_compare needs widgets: {widgets.INSTALL_HINT}")
        try:
            with _as_usage_errors():
                comparison = spotnb.compare(*args.runs, store=self.store,
                                            follow=not args.no_follow)
            comparison.show()  # with its static copy, for readers without widgets
            return None
        except ValueError as err:
            # A path that is not a record (its module is loaded only for records).
            from spotnb.records.library import NotARecord

            if isinstance(err, NotARecord):
                raise UsageError(str(err)) from None
            raise

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_tensorboard(self, line: str) -> None:
        """Open a job's TensorBoard logs (written with ``spot.tensorboard()``) with the
        ``%tensorboard`` magic. Run it again to see newer logs of a running job."""
        from spotnb.widgets.kernel import open_tensorboard

        args = parse_argstring(self.spot_tensorboard, line)
        handle = self._resolve(args.job)
        print(open_tensorboard(handle))

    def _resolve(self, job: str | None) -> spotnb.JobHandle:
        """A handle on ``job`` (:func:`spotnb.client.jobs.find_job`: an id, a name, the end of
        an id); without one, the job this notebook started or attached to last, else the
        latest job."""
        with _as_usage_errors():
            if job is None and self.last_job is not None:
                return spotnb.attach(self.last_job, store=self.store)
            return spotnb.attach(job, store=self.store)


def _sweep_stopped_text(done: Any, attach: str) -> str:
    """What ``%spot_sweep_stop`` and ``spotnb stop SWEEP`` say they did."""
    if done.already_ended:
        return (f"sweep {done.sweep_id} ({done.name!r}) had already ended ({done.status}); "
                "nothing to stop.")
    jobs = (f"its running trials' jobs stopped ({', '.join(done.jobs_stopped)}), their "
            "instances deleted" if done.jobs_stopped else "no trial was running")
    return (f"sweep {done.sweep_id} ({done.name!r}) stopped for good: {jobs}; no trial "
            f"starts any more. Its trials stay in the store: `{attach} {done.sweep_id}`.")


def _widgets_render(ip: Any) -> bool:
    """Whether widgets render here: a Jupyter kernel (not a terminal, not the
    in-process test shell) with ipywidgets and plotly installed."""
    from spotnb import widgets

    return getattr(ip, "kernel", None) is not None and widgets.available()


def _tell_runner(job_id: str, followed: bool) -> None:
    """Under `spotnb run`, note the job in the file it named (``spotnb.client.notebook``
    stops the followed job of a cell that runs past its timeout)."""
    path = os.environ.get(ENV_RUN_JOBS)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as out:
            out.write(f"{job_id} {'followed' if followed else 'detached'}\n")


def _simulation_shortfall(spec: Any, result: spotnb.JobResult) -> str | None:
    """A note when ``--simulate-interruptions N`` got fewer than N interruptions."""
    asked = (spec.simulate_interruptions or {}).get("count")
    if not asked or result.interruptions >= asked:
        return None
    return (f"[spotnb] --simulate-interruptions {asked}: the job ended after "
            f"{result.interruptions} of them. Each comes soon after an attempt's first "
            "checkpoint, or SPOTNB_LOCAL_INTERRUPT_AFTER seconds (default 20) after the "
            "first output of a cell that saves none; a job that ends sooner is not "
            "interrupted.")


def _shipping_line(cap: capture.Capture) -> str:
    return cap.shipping_line()


def _table_bundle(header: Sequence[str], rows: Sequence[Sequence[str]]) -> dict[str, str]:
    import html

    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [header, *rows])
    cells = "".join(f"<th style='text-align:left'>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(c))}</td>"
                                    for c in row) + "</tr>" for row in rows)
    return {"text/plain": text,
            "text/html": f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"}
