"""A magic's cell as a job, in the notebook: its inputs captured
(:func:`capture_cell`), the job followed by the display that renders here
(:func:`follow_cell`), its ``--out`` values set, its record kept (:func:`keep_record`),
and what ``spotnb run`` is told of it (:func:`tell_runner`). The magics that call these
are :mod:`spotnb.client.magics`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from IPython.core.error import UsageError

import spotnb
from spotnb.client import capture, display
from spotnb.client.magicargs import TrainRequest
from spotnb.client.notebook import ENV_RUN_JOBS

if TYPE_CHECKING:
    from spotnb.protocol.events.fold import JobState
    from spotnb.records.summary import Curves

__all__ = ["capture_cell", "follow_cell", "keep_record", "renderer", "simulation_shortfall",
           "tell_runner", "widgets_render"]

_MIB = 1 << 20


def capture_cell(ip: Any, body: str, request: TrainRequest, limit_mb: float,
                 files_limit_mb: float) -> capture.Capture:
    """What the cell ``body`` ships (:func:`spotnb.client.capture.capture`) from the
    shell ``ip``'s namespace: within ``limit_mb`` a variable pickled and
    ``files_limit_mb`` of module files; a cell that does not compile, or an input that
    cannot ship, is a ``UsageError`` that names the fix."""
    try:
        # Line 1 stands for the magic line, so errors name the cell's own lines.
        return capture.capture(
            "#\n" + body, ip.user_ns, Path.cwd(),
            names=request.inputs, variables=request.capture,
            limit_bytes=int(limit_mb * _MIB),
            files_limit_bytes=int(files_limit_mb * _MIB),
            hidden=ip.user_ns_hidden)
    except SyntaxError as err:
        text = (err.text or "").rstrip()
        raise UsageError(
            f"the cell does not compile: line {err.lineno}: {err.msg}"
            + (f"\n    {text}" if text else "")
            + "\nFix the line and run the cell again; nothing was started.") from None
    except capture.CaptureError as err:
        raise UsageError(str(err)) from None


def widgets_render(ip: Any) -> bool:
    """Whether widgets render here: a Jupyter kernel (not a terminal, not the
    in-process test shell) with ipywidgets and plotly installed."""
    from spotnb import widgets

    return getattr(ip, "kernel", None) is not None and widgets.available()


def renderer(renderer_class: type | None, ip: Any) -> display.Renderer:
    """The display that follows a job: ``renderer_class`` (``SpotMagics.renderer_class``),
    else the widget dashboard where widgets render, else the text display."""
    cls = renderer_class
    if cls is None:
        cls = display.TextRenderer
        if widgets_render(ip):
            from spotnb.widgets import Dashboard

            cls = Dashboard
    return cast(display.Renderer, cls())


def follow_cell(ip: Any, handle: spotnb.JobHandle, shown: display.Renderer,
                cell_number: int | None = None) -> Any:
    """Follow the cell's job with ``shown`` until it ends (None once the user detaches),
    keep its record, and set its ``--out`` values in the notebook; a job that did not
    complete raises :class:`~spotnb.client.display.SpotJobError`. The cell's last
    value, as the instance's kernel showed it, is returned."""
    from spotnb.records.summary import Curves

    curves = Curves()  # the record's, gathered as the events come
    outcome = display.follow(handle, shown, on_events=curves.add)
    if isinstance(outcome, display.Detached):
        return None
    result = outcome.result
    keep_record(handle, result, outcome.state, curves)
    shortfall = simulation_shortfall(handle.spec, result)
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
    ip.user_ns.update(result.outputs)
    if outcome.execute_result is not None:
        return display.RemoteValue(outcome.execute_result)
    return None


def keep_record(handle: spotnb.JobHandle, result: spotnb.JobResult,
                state: JobState | None = None, curves: Curves | None = None) -> None:
    """The job's record (spotnb.records), from what the follow loop holds: stored
    as summary.json in its store prefix and shown as one line whose output metadata
    carries it, so a notebook saved by hand is a record too."""
    from IPython.display import display as show

    from spotnb import records

    record = records.job_ended(handle, result, state, curves)
    if record is not None:
        show(records.record_bundle(record), metadata={"spotnb": {"job": record}}, raw=True)


def tell_runner(job_id: str, followed: bool) -> None:
    """Under `spotnb run`, note the job in the file it named (``spotnb.client.notebook``
    stops the followed job of a cell that runs past its timeout)."""
    path = os.environ.get(ENV_RUN_JOBS)
    if path:
        with contextlib.suppress(OSError), open(path, "a") as out:
            out.write(f"{job_id} {'followed' if followed else 'detached'}\n")


def simulation_shortfall(spec: Any, result: spotnb.JobResult) -> str | None:
    """A note when ``--simulate-interruptions N`` got fewer than N interruptions."""
    asked = (spec.simulate_interruptions or {}).get("count")
    if not asked or result.interruptions >= asked:
        return None
    return (f"[spotnb] --simulate-interruptions {asked}: the job ended after "
            f"{result.interruptions} of them. Each comes soon after an attempt's first "
            "checkpoint, or SPOTNB_LOCAL_INTERRUPT_AFTER seconds (default 20) after the "
            "first output of a cell that saves none; a job that ends sooner is not "
            "interrupted.")
