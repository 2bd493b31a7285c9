"""``%%spot_sweep`` in the notebook: the parameter sets and the pruner its line names
(:func:`sweep_space`, :func:`sweep_pruner`), the sweep started (:func:`start_sweep`)
and followed with the cell busy, each trial's record kept (:func:`follow_sweep`). The
magic itself, and ``%spot_attach``/``%spot_sweep_stop`` of a sweep, are
:mod:`spotnb.client.magics`; the sweep is :mod:`spotnb.sweep`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import UsageError

from spotnb.client import capture
from spotnb.client.cells import keep_record, tell_runner, widgets_render
from spotnb.client.magicargs import SWEEP_OPTIONS, TrainRequest, as_usage_errors, redact_notify
from spotnb.protocol.events import is_terminal

__all__ = ["follow_sweep", "start_sweep", "sweep_pruner", "sweep_space"]


def sweep_space(args: Any, variable: Callable[[str, str], Any]
                ) -> tuple[dict[str, Any], Any, str]:
    """The sweep's parameter sets as :func:`spotnb.sweep` takes them (``grid``,
    ``params``, ``study``, ``space``), the pruner and a note for the user, from the
    parsed line ``args``; ``variable(name, option)`` is the notebook's variable an
    option names."""
    space: dict[str, Any] = {}
    if args.grid:
        from spotnb.sweep.space import parse_assignments

        space["grid"] = parse_assignments(args.grid, "--grid")
    if args.params is not None:
        value = variable(args.params, "--params")
        space["grid" if isinstance(value, dict) else "params"] = value
    if args.study is not None:
        space["study"] = variable(args.study, "--study")
    if args.space is not None:
        space["space"] = variable(args.space, "--space")
    pruner, note = sweep_pruner(args, space.get("study"))
    if args.pruner:
        pruner = variable(args.pruner, "--pruner")
    if len([k for k in ("grid", "params", "study") if k in space]) > 1 or not space:
        raise UsageError("%%spot_sweep needs one of --grid NAME=V1,V2 (repeatable), "
                         "--params VAR, --space VAR --trials N, or --study VAR "
                         "--space VAR --trials N")
    return space, pruner, note


def sweep_pruner(args: Any, study: Any) -> tuple[Any, str]:
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


def start_sweep(line: str, cell: str, request: TrainRequest, cap: capture.Capture,
                space: dict[str, Any], pruner: Any, note: str) -> Any:
    """Start the sweep of ``cell`` (its ``%%spot_sweep`` ``line``, parsed as
    ``request``; its inputs ``cap``) and say so; the sweep
    (:class:`spotnb.sweep.api.Sweep`)."""
    from spotnb.sweep import api

    args = request.args
    # The remote cell's line 1 quotes this line: never with the webhook's URL in it.
    code = cap.first_line(redact_notify(line)) + "\n" + cell
    options = dict(request.submit)
    notify_url = options.pop("notify_url")
    budget = options.pop("budget_usd")
    name = options.pop("name")
    with as_usage_errors({**request.names, **SWEEP_OPTIONS}):
        made = api.sweep(code, **space, n_trials=args.n_trials, parallel=args.parallel,
                         metric=args.metric, pruner=pruner, budget_usd=budget,
                         sampler=args.sampler, notify_url=notify_url, name=name,
                         inputs=cap.inputs, files=cap.files, syntax="magic", **options)
    if note:
        print(note)
    # Under `spotnb run`, a timed-out cell's trials are stopped as its jobs would be.
    made.listen(lambda what, run: tell_runner(run.job_id, not request.detach)
                if what == "run" else None)
    print(cap.shipping_line().replace("shipping", f"sweep {made.sweep_id}: shipping"),
          *cap.notes, sep="\n")
    return made


def follow_sweep(ip: Any, made: Any) -> None:
    """Show the sweep (its view where widgets render, else its summary at the end),
    wait for its end with the cell busy, and keep every trial's record; the view's
    final form stays as a picture for readers without widgets."""
    from IPython.display import display as show

    from spotnb.records.summary import Curves
    from spotnb.sweep.view import summary_text

    view = None
    if widgets_render(ip):
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
        keep_record(run.handle, run.result, run.state, curves)
    show({"text/plain": summary_text(made)},
         metadata={"spotnb": {"sweep": made.state_dict()}}, raw=True)
