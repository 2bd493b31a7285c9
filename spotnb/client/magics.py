"""The IPython magics: ``%%spot_train`` and the commands around it.

Thin by design: each magic parses its line (its options: :mod:`spotnb.client.magicargs`),
calls the Python API (:func:`spotnb.submit`, :func:`spotnb.attach`, :func:`spotnb.jobs`,
:func:`spotnb.sweep`) and renders what comes back; running a cell's job in the notebook
(capturing its inputs, following it, keeping its record) is :mod:`spotnb.client.cells`,
a sweep's :mod:`spotnb.client.sweepmagic`. Bad input raises ``UsageError`` (shown
without a traceback) before anything starts.

Defaults come from traitlets configuration: ``%config SpotMagics.instance_types =
["g5.xlarge"]`` in the notebook, or ``c.SpotMagics.instance_types = [...]`` in
``ipython_config.py``; ``%spot_config`` shows the effective settings.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Bool, Float, Int, List, TraitError, Type, Unicode, validate

import spotnb
from spotnb.client import capture, cells, sweepmagic
from spotnb.client.listing import JOB_COLUMNS, jobs_table, table_bundle
from spotnb.client.magicargs import (
    NODE_HELP,
    SWEEP_OPTIONS,
    TYPED,
    TrainRequest,
    as_usage_errors,
    job_arg,
    job_args,
    policy_args,
    redact_notify,
    resource_args,
    run_args,
    sweep_args,
    train_request,
)
from spotnb.protocol.spec import SpecError

__all__ = ["SpotMagics", "TrainRequest"]


class _NameList(List):
    """A list of names that also accepts one comma-separated string."""

    def set(self, obj: Any, value: Any) -> None:
        # List.set would wrap a string in a list before validation sees it.
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        super().set(obj, value)



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
    @resource_args
    @job_args
    @policy_args
    @run_args
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
        with as_usage_errors(TYPED):
            request = self.train_request(line)
        if not cell.strip():
            raise UsageError("the cell is empty: put the training code below the "
                             "%%spot_train line")
        if cell.lstrip().startswith("%%"):
            raise UsageError("a cell magic cannot run inside %%spot_train; use a line "
                             "magic (%time) or plain Python in the cell")
        cap = self._capture(cell, request)
        # The remote cell's line 1 quotes this line: never with the webhook's URL in it.
        code = cap.first_line(redact_notify(line)) + "\n" + cell
        with as_usage_errors(request.names):
            handle = spotnb.submit(code, inputs=cap.inputs, files=cap.files,
                                   **request.submit)
        self.last_job = handle.job_id
        cells.tell_runner(handle.job_id, followed=not request.detach)
        # Warnings first: a cell that will not resume exactly is told on its first line.
        for warning in handle.warnings:
            print(f"[spotnb] warning: {warning}")
        print(cap.shipping_line(), *cap.notes, sep="\n")
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
        return train_request(self, args, self._default_name)

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
        return cells.capture_cell(self._ip, body, request, self.capture_limit_mb,
                                  self.files_limit_mb)

    def _follow(self, handle: spotnb.JobHandle, cell_number: int | None = None) -> Any:
        return cells.follow_cell(self._ip, handle,
                                 cells.renderer(self.renderer_class, self._ip), cell_number)

    # -- %%spot_sweep ---------------------------------------------------------------

    @magic_arguments(name="%spot_sweep")
    @sweep_args
    @resource_args
    @job_args
    @policy_args
    @run_args
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
        with as_usage_errors(TYPED):
            request = self.train_request(line, self.spot_sweep)
        if not cell.strip():
            raise UsageError("the cell is empty: put the training code below the "
                             "%%spot_sweep line")
        with as_usage_errors(SWEEP_OPTIONS):
            space, pruner, note = sweepmagic.sweep_space(request.args, self._variable)
        cap = self._capture(cell, request)
        made = sweepmagic.start_sweep(line, cell, request, cap, space, pruner, note)
        if request.detach:
            print(f"[spotnb] sweep {made.sweep_id} ({made.name!r}) runs in this kernel "
                  f"(while it lives); `%spot_attach {made.sweep_id}` shows it, "
                  f"`%spot_sweep_stop {made.sweep_id}` ends it.")
            return None
        return sweepmagic.follow_sweep(self._ip, made)

    def _variable(self, name: str, option: str) -> Any:
        if name not in self._ip.user_ns:
            raise UsageError(f"{option} {name}: the notebook has no variable {name!r}; "
                             "define it in a cell above")
        return self._ip.user_ns[name]


    # -- the other commands ----------------------------------------------------------

    @magic_arguments()
    @argument("--resume", action="store_true",
              help="a sweep whose driver is gone (abandoned: its kernel closed): drive it "
                   "on here, starting the trials it had not started")
    @job_arg
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
        return sweepmagic.follow_sweep(self._ip, made)

    @magic_arguments()
    @argument("sweep", metavar="SWEEP",
              help="the sweep's id (sweep-...) or name, as `spotnb sweeps` lists them")
    @line_magic
    def spot_sweep_stop(self, line: str) -> None:
        """End a sweep for good: its driver (in this kernel or another) starts no more
        trials, every running trial's job is stopped (its instance deleted), and the
        store says it stopped, so a later ``%spot_attach`` starts nothing."""
        from spotnb.sweep import SweepNotFound, stop_sweep
        from spotnb.sweep.view import stopped_text

        args = parse_argstring(self.spot_sweep_stop, line)
        try:
            done = stop_sweep(args.sweep, store=self.store, reason="%spot_sweep_stop")
        except SweepNotFound as err:
            raise UsageError(str(err)) from None
        print(stopped_text(done, "%spot_attach"))

    @magic_arguments()
    @job_arg
    @line_magic
    def spot_stop(self, line: str) -> None:
        """Stop a job: its cell is interrupted and its instance deleted."""
        args = parse_argstring(self.spot_stop, line)
        handle = self._resolve(args.job)
        if handle.result_record() is not None:
            print(f"job {handle.job_id} already ended ({handle.status}); "
                  "it has no instance to stop.")
            return
        with as_usage_errors():
            handle.stop(reason="%spot_stop")
        print(f"job {handle.job_id} stopped; its instance is deleted. Its history stays: "
              f"`%spot_logs {handle.job_id}`.")

    @magic_arguments()
    @argument("--node", type=int, metavar="K", default=None, help=NODE_HELP)
    @job_arg
    @line_magic
    def spot_interrupt(self, line: str) -> None:
        """Deliver a spot interruption notice to a job's instance now (to try resume);
        ``--node K``: to node K of a multi-node job."""
        args = parse_argstring(self.spot_interrupt, line)
        handle = self._resolve(args.job)
        with as_usage_errors():
            handle.interrupt(node=args.node)
        which = f"node {args.node} of job" if args.node is not None else "job"
        print(f"interruption notice delivered to {which} {handle.job_id}: it checkpoints "
              f"and resumes on a replacement; watch it with `%spot_attach {handle.job_id}`.")

    @magic_arguments()
    @argument("--node", type=int, metavar="K", default=None, help=NODE_HELP)
    @job_arg
    @line_magic
    def spot_kill(self, line: str) -> None:
        """Local cloud: end a job's instance (``--node K``: node K) at once, without a
        notice, as a machine lost outright: the way to test a cell against one. The job
        goes on from its last checkpoint on a replacement."""
        args = parse_argstring(self.spot_kill, line)
        handle = self._resolve(args.job)
        with as_usage_errors():
            handle.kill(node=args.node)
        which = f"node {args.node} of job" if args.node is not None else "job"
        print(f"kill requested for {which} {handle.job_id}: its group ends the instance at "
              f"its next tick, without notice; the job goes on from its last checkpoint on "
              f"a replacement; watch it with `%spot_attach {handle.job_id}`.")

    @magic_arguments()
    @argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    @job_arg
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
    @job_arg
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

        with as_usage_errors():
            rows = spotnb.jobs(store=self.store)
        if not rows:
            print("no jobs yet: put %%spot_train on a cell to start one")
            return
        table, notes = jobs_table(rows, time.time())
        bundle = table_bundle(JOB_COLUMNS, table)
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
        bundle = table_bundle(("setting", "value", "meaning"), rows)
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
        with as_usage_errors({"region": "--region", "allowed_regions":
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
            with as_usage_errors():
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
    @job_arg
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
        with as_usage_errors():
            if job is None and self.last_job is not None:
                return spotnb.attach(self.last_job, store=self.store)
            return spotnb.attach(job, store=self.store)

