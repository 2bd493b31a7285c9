"""The IPython magics: ``%%spot_train`` and the commands around it.

Thin by design: each magic parses its line, calls the Python API
(:func:`spotnb.submit`, :func:`spotnb.attach`, :func:`spotnb.jobs`) and renders what
comes back; following a job is :func:`spotnb.display.follow`, finding a cell's inputs
:func:`spotnb.capture.capture`. Bad input raises ``UsageError`` (shown without a
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
from typing import Any, TypeVar, cast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float, Int, List, TraitError, Type, Unicode, validate

import spotnb
from spotnb import capture, display
from spotnb.cli import format_age
from spotnb.spec import SpecError, parse_duration, parse_nodes

__all__ = ["SpotMagics", "TrainRequest"]

F = TypeVar("F", bound=Callable[..., Any])
_MIB = 1 << 20


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
        argument("--provider", help="where instances come from: local (the embedded "
                                    "local cloud, the default)"),
        argument("--region", help="the cloud region, e.g. --region us-east-1"),
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
    )):
        func = deco(func)
    return func


def _job_arg(func: F) -> F:
    """The job a command acts on."""
    return argument(
        "job", nargs="?", default=None,
        help="a job id (or its name, or the end of its id; default: the latest job) "
             "as listed by %%spot_jobs")(func)


# -- the request %%spot_train builds ------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TrainRequest:
    """A parsed ``%%spot_train`` line with the configuration filled in.

    ``submit`` holds the keyword arguments of :func:`spotnb.submit` (all but the
    code, inputs and files); ``inputs`` the ``--in`` names (None: analyse the cell).
    """

    submit: dict[str, Any]
    inputs: tuple[str, ...] | None
    capture: bool
    detach: bool


def _names(text: str | None) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))


def _simulation(text: str | None) -> int | list[float] | None:
    """``--simulate-interruptions``: a count (``2``) or a schedule (``20s,45s``)."""
    if text is None:
        return None
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    try:
        return [parse_duration(part, "--simulate-interruptions")
                for part in text.split(",") if part.strip()]
    except SpecError:
        raise UsageError(
            f"--simulate-interruptions takes a count (--simulate-interruptions 2) or "
            f"times after launch (--simulate-interruptions 20s,45s), not {text!r}") from None


@contextlib.contextmanager
def _as_usage_errors() -> Iterator[None]:
    """The API's 'bad input' errors, shown as UsageError (no traceback)."""
    try:
        yield
    except (SpecError, spotnb.JobNotFound) as err:
        raise UsageError(str(err)) from None


@magics_class
class SpotMagics(Magics):
    """``%%spot_train`` and friends; ``%spot_config`` lists the settings below."""

    provider = Unicode("local", help="Where instances come from: 'local' (the embedded "
                                     "local cloud).").tag(config=True)
    instance_types = _NameList(
        Unicode(), default_value=["g4dn.xlarge"],
        help="Instance types in order of preference (a list, or one comma-separated "
             "string).").tag(config=True)
    region = Unicode("us-east-1", help="The cloud region.").tag(config=True)
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
    renderer_class = Type(None, klass=object, allow_none=True,
                          help="The display that follows a job (a spotnb.display."
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

    @validate("checkpoint_every")
    def _valid_every(self, proposal: Any) -> Any:
        from spotnb.spec import CheckpointEvery

        try:
            CheckpointEvery.parse(proposal["value"])
        except SpecError as err:
            raise TraitError(str(err)) from None
        return proposal["value"]

    # -- %%spot_train ---------------------------------------------------------------

    @magic_arguments(name="%spot_train")
    @_resource_args
    @argument("--out", dest="outputs", metavar="NAMES",
              help="variables to bring back into the notebook when the job completes, "
                   "e.g. --out model,accuracy")
    @argument("--in", dest="inputs", metavar="NAMES",
              help="ship exactly these notebook variables, e.g. --in data,config "
                   "(default: every variable the cell reads before assigning it)")
    @argument("--no-capture", action="store_true",
              help="ship no notebook variable: the cell must create everything it uses")
    @argument("--name", help="a name for the job, shown by %%spot_jobs")
    @argument("--nodes", metavar="N|MIN:MAX",
              help="train on N instances as torchrun's workers (RANK, WORLD_SIZE, ... set "
                   "in the cell), e.g. --nodes 4; --nodes 3:4 goes on with 3 while a lost "
                   "node's replacement boots (local cloud; default 1)")
    @argument("--procs-per-node", type=int, metavar="P",
              help="worker processes per instance, e.g. one per GPU (default 1)")
    @_policy_args
    @argument("--simulate-interruptions", metavar="N|TIMES",
              help="local cloud: interrupt the job N times (--simulate-interruptions 2), "
                   "or at these times after launch (--simulate-interruptions 20s,45s)")
    @argument("--detach", action="store_true",
              help="return at once; the job runs on its own (follow it with %%spot_attach)")
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
        request = self.train_request(line)
        if not cell.strip():
            raise UsageError("the cell is empty: put the training code below the "
                             "%%spot_train line")
        if cell.lstrip().startswith("%%"):
            raise UsageError("a cell magic cannot run inside %%spot_train; use a line "
                             "magic (%time) or plain Python in the cell")
        cap = self._capture(cell, request)
        code = cap.first_line(line) + "\n" + cell
        with _as_usage_errors():
            handle = spotnb.submit(code, inputs=cap.inputs, files=cap.files,
                                   **request.submit)
        self.last_job = handle.job_id
        print(_shipping_line(cap), *cap.notes, sep="\n")
        for warning in handle.warnings:
            print(f"[spotnb] warning: {warning}")
        if request.detach:
            print(f"[spotnb] submitted job {handle.job_id} ({handle.spec.name!r}); it runs "
                  f"on its own. Follow it with `%spot_attach {handle.job_id}`, stop it with "
                  f"`%spot_stop {handle.job_id}`.")
            return None
        return self._follow(handle, cell_number=self._cell_number())

    def train_request(self, line: str) -> TrainRequest:
        """Parse a ``%%spot_train`` line, filling in the configured defaults."""
        try:
            args = parse_argstring(self.spot_train, line)
        except UsageError as err:
            raise UsageError(f"%%spot_train: {err}. See %%spot_train? for the options."
                             ) from None
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
            "max_price": pick(args.max_price, self.max_price),
            "name": args.name or self._default_name(),
            "outputs": outputs,
            "checkpoint_every": pick(args.checkpoint_every, self.checkpoint_every),
            "max_restarts_on_error": pick(args.max_restarts_on_error,
                                          self.max_restarts_on_error),
            "budget_usd": pick(args.budget, self.budget),
            "max_duration": pick(args.max_duration, self.max_duration),
            "keep_checkpoints": pick(args.keep_checkpoints, self.keep_checkpoints),
            "simulate_interruptions": _simulation(args.simulate_interruptions),
            "store": self.store,
        }
        # Only a distributed job passes these (submit's defaults: one node, one process).
        if args.nodes is not None:
            submit["nodes"] = parse_nodes(args.nodes)
        if args.procs_per_node is not None:
            submit["procs_per_node"] = args.procs_per_node
        return TrainRequest(submit=submit,
                            inputs=_names(args.inputs) if args.inputs is not None else None,
                            capture=not args.no_capture, detach=args.detach)

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
        renderer = self._renderer()
        outcome = display.follow(handle, renderer)
        if isinstance(outcome, display.Detached):
            return None
        result = outcome.result
        self._keep_record(handle, result)
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

    def _keep_record(self, handle: spotnb.JobHandle, result: spotnb.JobResult) -> None:
        """The job's record (spotnb.records): stored as summary.json in its store prefix
        and shown as one line whose output metadata carries it, so a notebook saved by
        hand is a record too."""
        from IPython.display import display as show

        from spotnb import records

        record = records.job_ended(handle, result)
        if record is not None:
            show(records.record_bundle(record), metadata={"spotnb": {"job": record}}, raw=True)

    # -- the other commands ----------------------------------------------------------

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_attach(self, line: str) -> Any:
        """Show a job's whole history, then follow it until it ends.

        Works after a kernel restart: everything is read back from the job's store.
        Its ``--out`` variables are set when it completes. Example: ``%spot_attach``
        (the latest job), ``%spot_attach 20250101-120000-ab12cd``.
        """
        args = parse_argstring(self.spot_attach, line)
        handle = self._resolve(args.job)
        self.last_job = handle.job_id
        return self._follow(handle)

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_stop(self, line: str) -> None:
        """Stop a job: its cell is interrupted and its instance deleted."""
        args = parse_argstring(self.spot_stop, line)
        handle = self._resolve(args.job)
        ended = handle.result_record()
        if ended is not None:
            print(f"job {handle.job_id} already ended ({ended.get('status')}); "
                  "it has no instance to stop.")
            return
        with _as_usage_errors():
            handle.stop(reason="%spot_stop")
        print(f"job {handle.job_id} stopped; its instance is deleted. Its history stays: "
              f"`%spot_logs {handle.job_id}`.")

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_interrupt(self, line: str) -> None:
        """Deliver a spot interruption notice to a job's instance now (to try resume)."""
        args = parse_argstring(self.spot_interrupt, line)
        handle = self._resolve(args.job)
        with _as_usage_errors():
            handle.interrupt()
        print(f"interruption notice delivered to job {handle.job_id}: it checkpoints and "
              f"resumes on a replacement; watch it with `%spot_attach {handle.job_id}`.")

    @magic_arguments()
    @argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    @_job_arg
    @line_magic
    def spot_logs(self, line: str) -> None:
        """Print a job's output and events (``-f``: follow until it ends)."""
        from spotnb.cli import format_event

        args = parse_argstring(self.spot_logs, line)
        handle = self._resolve(args.job)
        with contextlib.suppress(KeyboardInterrupt):
            for event in handle.events(follow=args.follow):
                text = format_event(event)
                if text is not None:
                    print(text, flush=True)

    @magic_arguments()
    @_job_arg
    @line_magic
    def spot_result(self, line: str) -> spotnb.JobResult:
        """A job's :class:`spotnb.JobResult` (status, cost, on-demand cost, attempts,
        metrics), for use in code: ``r = %spot_result`` then ``r.cost_usd``."""
        args = parse_argstring(self.spot_result, line)
        return self._resolve(args.job).summary()

    @line_magic
    def spot_jobs(self, line: str) -> None:
        """A table of jobs: name, status, nodes, attempts, interruptions, cost, age."""
        from IPython.display import display as show

        with _as_usage_errors():
            rows = spotnb.jobs(store=self.store)
        if not rows:
            print("no jobs yet: put %%spot_train on a cell to start one")
            return
        now = time.time()
        header = ("job", "name", "status", "nodes", "attempts", "interruptions", "cost $",
                  "age")
        table = [(r.job_id, r.name, r.status, r.nodes, str(r.attempts), str(r.interruptions),
                  f"{r.cost_usd:.4f}", format_age(r.created, now)) for r in rows]
        show(_table_bundle(header, table), raw=True)

    @line_magic
    def spot_config(self, line: str) -> None:
        """The effective %%spot_train defaults, and how to change them."""
        from IPython.display import display as show

        rows = []
        for name, trait in sorted(self.class_traits(config=True).items()):
            value = getattr(self, name)
            if isinstance(value, type):
                value = f"{value.__module__}.{value.__qualname__}"
            rows.append((f"SpotMagics.{name}", repr(value), trait.help))
        bundle = _table_bundle(("setting", "value", "meaning"), rows)
        note = ("Change a setting with %config SpotMagics.NAME = VALUE, or for every "
                "notebook in ipython_config.py: c.SpotMagics.NAME = VALUE. A %%spot_train "
                "option overrides it for one cell.")
        bundle["text/plain"] += "\n\n" + note
        bundle["text/html"] += f"<p>{note}</p>"
        show(bundle, raw=True)

    @magic_arguments()
    @argument("--region", help="the region whose prices to show first (default: "
                               "SpotMagics.region)")
    @argument("--gpu-hours", type=float, default=100.0, metavar="N",
              help="size of the job to estimate, in GPU-hours (default 100)")
    @line_magic
    def spot_picker(self, line: str) -> Any:
        """Choose instance types: GPU, memory, on-demand and spot prices, savings,
        interruption frequency, $ per GPU-hour, the cost of a job of N GPU-hours.

        The types you choose, in order of preference, become the defaults of the next
        ``%%spot_train`` (``SpotMagics.instance_types``), and the equivalent
        ``%%spot_train -t ...`` line is shown. Example: ``%spot_picker --gpu-hours 500``.
        """
        args = parse_argstring(self.spot_picker, line)
        from spotnb import widgets

        if not widgets.available():
            raise UsageError(f"%spot_picker needs widgets: {widgets.INSTALL_HINT}")
        if args.region is not None:
            from spotnb import catalog

            if args.region not in catalog.all_regions():
                raise UsageError(f"no prices for region {args.region!r}; regions: "
                                 f"{', '.join(catalog.all_regions())}")
        return widgets.InstancePicker(args.region, magics=self, gpu_hours=args.gpu_hours)

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
        """A handle on ``job``: an id, a name, the end of an id, or the latest job."""
        with _as_usage_errors():
            if job is None and self.last_job is not None:
                return spotnb.attach(self.last_job, store=self.store)
            rows = spotnb.jobs(store=self.store)
            if job is None:
                if not rows:
                    raise UsageError("no jobs yet: put %%spot_train on a cell to start one")
                return spotnb.attach(rows[-1].job_id, store=self.store)
            matches = [r for r in rows if r.job_id == job] or \
                [r for r in rows if r.name == job] or \
                [r for r in rows if r.job_id.endswith(job)]
            if not matches:
                raise UsageError(f"no job {job!r}; %spot_jobs lists the jobs")
            if len({r.job_id for r in matches}) > 1 and matches[0].name != job:
                raise UsageError(f"{job!r} matches several jobs "
                                 f"({', '.join(r.job_id for r in matches)}); give the whole id")
            return spotnb.attach(matches[-1].job_id, store=self.store)


def _widgets_render(ip: Any) -> bool:
    """Whether widgets render here: a Jupyter kernel (not a terminal, not the
    in-process test shell) with ipywidgets and plotly installed."""
    from spotnb import widgets

    return getattr(ip, "kernel", None) is not None and widgets.available()


def _shipping_line(cap: capture.Capture) -> str:
    parts = []
    if cap.inputs:
        size = capture.human_size(cap.input_bytes)
        parts.append(f"inputs {', '.join(sorted(cap.inputs))} ({size})")
    if cap.imports:
        parts.append("imports " + ", ".join(s.split()[-1] for s in cap.imports))
    if cap.files:
        parts.append("files " + ", ".join(sorted(cap.files)))
    return "[spotnb] shipping " + ("; ".join(parts) if parts else "the cell alone")


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
