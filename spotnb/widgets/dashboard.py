"""The live dashboard of a job: a :class:`~spotnb.client.display.Renderer` made of widgets.

Layout, top to bottom:

* the header (:mod:`spotnb.widgets.header`): state, attempt, instance; step of the
  total, pace and time left; cost against on-demand and the projection; interruptions
  with what they took; the spot price of each pool with a sparkline;
* the plot controls: x as step, time since the start or wall time, smoothing, a log
  scale per panel (a checkbox per panel, added as panels appear), how metrics are
  grouped;
* the figure (:mod:`spotnb.widgets.plots`): a panel per metric with its own y axis,
  GPU or CPU use, interruptions and resumes marked; it fills the cell's width and
  keeps the user's zoom across updates;
* the output panel (:class:`~spotnb.widgets.elements.LogPanel`): the first and last lines of
  remote output, following the newest, with a filter;
* the last checkpoint and the buttons: Detach, Interrupt now (local cloud),
  TensorBoard, and apart from them Stop, which asks for a second click to confirm.
  Their messages go after :data:`MESSAGE_SECONDS`.

Cost is bounded however long the run (measured in ``benchmarks/bench_dashboard.py``):
events only update :class:`~spotnb.widgets.series.DashboardData` (numpy, O(1) per
point); the widgets are redrawn at most every :data:`FLUSH_SECONDS`, the figure in one
``batch_update`` of at most ``2 * DEFAULT_BUCKETS`` points per trace (binary buffers),
the panel as its first :data:`~spotnb.widgets.series.HEAD_LINES` and last
:data:`~spotnb.widgets.series.LOG_LINES` lines, with a line in place of those it
leaves out that says how many and how to print them all (``%spot_logs JOB``): the
saved notebook and its record keep the same.

The figure's data and layout are its widget's state, so a notebook saved with its
widgets shows the final figure again. When the job ends a PNG of it is displayed below,
hidden wherever the live figure draws (see :mod:`spotnb.widgets.static`): a finished
cell shows its plots once.
"""

from __future__ import annotations

import html
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spotnb.client import display
from spotnb.client.view import JobView
from spotnb.protocol.events import Event
from spotnb.widgets import static
from spotnb.widgets.elements import LogPanel, plotly_loader
from spotnb.widgets.header import header_html
from spotnb.widgets.plots import GROUPINGS, X_AXES, Plots
from spotnb.widgets.series import DEFAULT_BUCKETS, DashboardData

if TYPE_CHECKING:
    from spotnb.client.jobs import JobHandle
    from spotnb.client.results import JobResult
    from spotnb.protocol.events.fold import JobState

__all__ = ["FLUSH_SECONDS", "MESSAGE_SECONDS", "STOP_CONFIRM_SECONDS", "Dashboard",
           "DetachRequested", "header_html"]

log = logging.getLogger(__name__)

#: The widgets are redrawn at most this often: a few times a second is live enough,
#: and every redraw is a few messages to the browser (and to a saved notebook).
FLUSH_SECONDS = 0.5
#: A button's message ("interruption notice delivered") stays this long.
MESSAGE_SECONDS = 12.0
#: After a first click on Stop, a second one within this long stops the job.
STOP_CONFIRM_SECONDS = 10.0


class DetachRequested(KeyboardInterrupt):
    """Raised inside :func:`spotnb.client.display.follow` when the Detach button was pressed:
    the follow loop treats it like the notebook's interrupt (the job keeps running)."""


class Dashboard:
    """The widget display of a job (see the module docstring).

    Where widgets do not render, its output reads as text: the status lines and the
    last lines of output (with the interruptions and resumes among them).

    Created without arguments by the magics (``SpotMagics.renderer_class``); the
    follow loop calls :meth:`start` with the job's handle, :meth:`events` with every
    batch of events, and the :class:`~spotnb.client.display.Renderer` methods. ``clock`` and
    ``flush_seconds`` are there for tests and the benchmark; ``static_copy`` draws the
    PNG of the final figure (off in the benchmark).
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 flush_seconds: float = FLUSH_SECONDS,
                 max_buckets: int = DEFAULT_BUCKETS, show: bool = True,
                 static_copy: bool = True) -> None:
        import ipywidgets as w

        self._clock = clock
        self.flush_seconds = flush_seconds
        self._show = show
        self.static_copy = static_copy
        self.data = DashboardData(max_buckets=max_buckets)
        self.handle: JobHandle | None = None
        self.view: JobView | None = None
        self.flushes = 0
        self._lock = threading.RLock()  # the follow loop and button/control threads
        self._flushed_at = -float("inf")
        self._flushed = (-1, -1, -1)  # data version, log version, header version
        self._header_version = 0
        self._plots_version = 0
        self._detach = threading.Event()
        self._message_until: float | None = None
        self._stop_armed_until: float | None = None
        self._output: Any = None  # the display handle of the dashboard's output
        self.plots = Plots()
        self.figure = self.plots.figure
        self.header = w.HTML(layout=w.Layout(width="100%"))
        self.panel = LogPanel(layout=w.Layout(width="100%"))
        self.checkpoint = w.HTML()
        self.controls = {
            "x": w.ToggleButtons(options=[(label, key) for key, label, _tip in X_AXES],
                                 value="step", tooltips=[tip for _k, _l, tip in X_AXES],
                                 style={"button_width": "6.5em"}),
            "smoothing": w.FloatSlider(value=0.0, min=0.0, max=0.99, step=0.01,
                                       description="smoothing", readout_format=".2f",
                                       continuous_update=False),
            "grouping": w.Dropdown(options=[(label, key) for key, label in GROUPINGS],
                                   value="metric", description="panels"),
        }
        for control in self.controls.values():
            control.style.description_width = "initial"
            control.observe(self._on_control, names="value")
        self.controls["smoothing"].layout.width = "19em"
        self.controls["grouping"].layout.width = "auto"
        self.buttons = {
            "detach": w.Button(description="Detach", icon="eject",
                               tooltip="stop following here; the job keeps running"),
            "interrupt": w.Button(description="Interrupt now", icon="bolt",
                                  tooltip="local cloud: send the instance a spot "
                                          "interruption notice now (try a resume)"),
            "tensorboard": w.Button(description="TensorBoard", icon="line-chart",
                                    disabled=True,
                                    tooltip="open the job's TensorBoard logs "
                                            "(written with spot.tensorboard())"),
            "stop": w.Button(description="Stop job…", icon="stop",
                             tooltip="stop the job and delete its instance (asks first)"),
            "cancel": w.Button(description="Keep running", icon="undo",
                               tooltip="do not stop the job"),
        }
        for button in self.buttons.values():
            button.layout.width = "auto"
        self.buttons["interrupt"].layout.display = "none"
        self.buttons["cancel"].layout.display = "none"
        self.buttons["stop"].on_click(lambda _b: self._on_stop())
        self.buttons["cancel"].on_click(lambda _b: self._disarm_stop())
        self.buttons["detach"].on_click(lambda _b: self._detach.set())
        self.buttons["interrupt"].on_click(lambda _b: self._act("interrupt"))
        self.buttons["tensorboard"].on_click(lambda _b: self._act("tensorboard"))
        self.message = w.HTML()
        # Where the TensorBoard button's %tensorboard shows (the click is no cell's).
        self.extra = w.Output()
        # A log scale per metric panel: a checkbox each, by the panel's title, added as
        # panels appear (:meth:`_sync_log_boxes`).
        self.log_boxes: dict[str, Any] = {}
        self.log_bar = w.HBox([w.Label("log scale:")],
                              layout=w.Layout(flex_flow="row wrap", align_items="center",
                                              grid_gap="0 8px", display="none"))
        toolbar = w.HBox([w.Label("x axis"), self.controls["x"], self.controls["smoothing"],
                          self.log_bar, self.controls["grouping"]],
                         layout=w.Layout(flex_flow="row wrap", align_items="center",
                                         grid_gap="4px 18px"))
        footer = w.HBox(
            [self.checkpoint, self.buttons["detach"], self.buttons["interrupt"],
             self.buttons["tensorboard"],
             w.HTML(layout=w.Layout(flex="1 1 auto", min_width="0", width="auto")),
             self.message, self.buttons["cancel"], self.buttons["stop"]],
            layout=w.Layout(align_items="center", flex_flow="row wrap", width="100%"))
        self.figure.layout = w.Layout(width="100%")
        self.widget = w.VBox([self.header, toolbar, self.figure, plotly_loader(), self.panel,
                              footer, self.extra], layout=w.Layout(width="100%"))
        self.widget.add_class("spotnb-dashboard")
        self._draw_panel()

    def __repr__(self) -> str:
        job = self.handle.job_id if self.handle is not None else "?"
        return f"<spotnb Dashboard of job {job}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self._bundle()

    def _bundle(self) -> dict[str, Any]:
        """The widget's view, and for readers without widgets the header and the
        output panel's lines, as HTML and as text (updated when the job ends, for
        saved notebooks and their HTML export)."""
        data = dict(self.widget._repr_mimebundle_())
        lines = display.status_lines(self.view) if self.view is not None else ["spotnb"]
        with self._lock:
            panel = self.data.log_lines(self._gap_text())
            header = header_html(self.view, self.data)
        log_lines = [text for _kind, text in panel]
        data["text/plain"] = "\n".join([*lines, *(["", *log_lines] if log_lines else [])])
        data["text/html"] = (f"<div class='spotnb-static-dashboard'>"
                             f"{header}"
                             f"{static.log_html(panel, self._caption())}</div>")
        return data

    # -- the follow loop's calls -------------------------------------------------

    def start(self, handle: JobHandle, state: JobState | None = None) -> None:
        """The job this dashboard follows, and the follow loop's fold of its events,
        which the dashboard reads (called once, before any event)."""
        from spotnb.widgets import kernel

        self.handle = handle
        with self._lock:
            if state is not None:
                self.data.use(state)
            self.data.max_nodes = handle.spec.resources.max_nodes
        self.widget.add_class(static.live_class(handle.job_id))
        if handle.spec.provider == "local":
            self.buttons["interrupt"].layout.display = None
        for widget in (*self.buttons.values(), *self.controls.values()):
            kernel.serve_while_busy(widget)
        if self._show and self._output is None:
            from IPython.display import display as show

            self._output = show(self._bundle(), raw=True, display_id=True)

    def events(self, batch: list[Event]) -> None:
        """A batch of events, as read (maybe empty); redraws if it is time."""
        if self._detach.is_set():
            self._detach.clear()
            raise DetachRequested
        with self._lock:
            self.data.add(batch)
            self._expire()
        self._maybe_flush()

    def update(self, view: JobView) -> None:
        self.view = view
        self._header_version += 1
        self._maybe_flush()

    def stream(self, name: str, text: str) -> None:
        self.data.write(text, stderr=name == "stderr")

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        # Rich outputs of the remote cell go below the dashboard, as they would locally;
        # a remote clear_output must not clear the dashboard, so it is not passed on.
        if kind != "clear_output":
            display.TextRenderer().rich(kind, data, metadata, display_id)

    def milestone(self, view: JobView, event: Event, text: str) -> None:
        self.view = view
        self.data.milestone(event.time, text)
        self._header_version += 1
        self._maybe_flush()

    def finished(self, view: JobView, result: JobResult) -> None:
        self.view = view
        self._header_version += 1
        with self._lock:
            self._disarm_stop()
            self._say("")
            self.flush()
            for name in ("stop", "detach", "interrupt"):
                self.buttons[name].disabled = True
        if self._output is not None:
            from IPython.display import display as show

            self._output.update(self._bundle(), raw=True)
            copy_ = self.static_bundle() if self.static_copy else None
            if copy_ is not None:
                show(copy_[0], metadata=copy_[1], raw=True)

    def detached(self, view: JobView) -> None:
        self.view = view
        self._header_version += 1
        with self._lock:
            self.flush()
            self.buttons["detach"].disabled = True  # Stop still works: it needs no loop
        if self._output is not None:
            self._output.update(self._bundle(), raw=True)
        sys.stderr.write(display.detach_text(view))
        sys.stderr.flush()

    def static_bundle(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The PNG copy of the final dashboard as an output ``(data, metadata)``, for
        readers where widgets do not render (None without matplotlib)."""
        if self.view is None:
            return None
        view = self.view
        title = f"spotnb job {view.job_id} ({view.name}): {view.state}"
        from spotnb.records.figures import price_lines

        lines = display.status_lines(view)[1:3] + price_lines(self.data)
        image = static.png(self.data, title, lines)
        if image is None:
            return None
        caption = (f"Final dashboard of spotnb job {view.job_id} ({view.name}): metrics, "
                   "interruptions and utilisation")
        return static.bundle(image, view.job_id, caption)

    # -- drawing -------------------------------------------------------------------

    def _maybe_flush(self) -> None:
        if self._clock() - self._flushed_at >= self.flush_seconds:
            with self._lock:
                self.flush()

    def flush(self) -> None:
        """Redraw what changed since the last redraw (now, whatever the throttle says)."""
        with self._lock:
            self._flushed_at = self._clock()
            data_v, log_v, head_v = self._flushed
            now = (self.data.version + self._plots_version, self.data.log_version,
                   self._header_version)
            if now[0] != data_v:
                self.plots.draw(self.data)
                self._sync_log_boxes()
            if now[1] != log_v:
                self._draw_panel()
            if now[2] != head_v or now[0] != data_v:
                self._draw_header()
            if now != self._flushed:
                self.flushes += 1
            self._flushed = now

    def _on_control(self, _change: Any = None) -> None:
        """A plot control changed (on the kernel's subshell while the cell is busy)."""
        with self._lock:
            options = self.plots.options
            options.x = str(self.controls["x"].value)
            options.smoothing = float(self.controls["smoothing"].value)
            options.log_panels = frozenset(title for title, box in self.log_boxes.items()
                                           if box.value)
            options.grouping = str(self.controls["grouping"].value)
            self._plots_version += 1
            self.flush()

    def _sync_log_boxes(self) -> None:
        """A log-scale checkbox for each metric panel shown, in the panels' order (a
        panel's box keeps its value while it is hidden by another grouping)."""
        import ipywidgets as w

        titles = self.plots.panel_titles()
        shown = tuple(box.description for box in self.log_bar.children[1:])
        if titles == shown:
            return
        for title in titles:
            if title not in self.log_boxes:
                box = w.Checkbox(value=False, description=title, indent=False,
                                 tooltip=f"a log y axis for {title}",
                                 layout=w.Layout(width="auto"))
                box.style.description_width = "initial"
                box.observe(self._on_control, names="value")
                if self.handle is not None:
                    from spotnb.widgets import kernel

                    kernel.serve_while_busy(box)
                self.log_boxes[title] = box
        self.log_bar.children = (self.log_bar.children[0],
                                 *(self.log_boxes[t] for t in titles))
        self.log_bar.layout.display = None if titles else "none"

    def _draw_panel(self) -> None:
        lines = self.data.log_lines(self._gap_text())
        self.panel.lines = [[kind, text] for kind, text in lines]
        self.panel.caption = self._caption()

    def _gap_text(self) -> str:
        """The line that stands where the panel left lines out (``{n}``: how many)."""
        job = self.view.job_id if self.view is not None else "JOB"
        return (f"[spotnb] ... {{n}} lines left out here; `%spot_logs {job}` (or "
                f"`spotnb logs {job}`) prints them all")

    def _caption(self) -> str:
        left_out = self.data.left_out
        if not left_out:
            return ""
        job = self.view.job_id if self.view is not None else "JOB"
        return (f"{self.data.line_count:,} lines: the first {len(self.data.head)} and "
                f"the last {len(self.data.lines)} shown, {left_out:,} left out between "
                f"them; `%spot_logs {job}` prints them all")

    def _draw_header(self) -> None:
        self.header.value = header_html(self.view, self.data)
        ck = self.data.checkpoint
        if ck is None:
            self.checkpoint.value = "<span style='margin-right:1em'>no checkpoint yet</span>"
        else:
            age = max(0.0, time.time() - ck.time)
            forced = " (on the notice)" if ck.forced else ""
            self.checkpoint.value = (
                f"<span style='margin-right:1em'>last checkpoint: step {ck.step}, "
                f"{_size(ck.bytes)}, {_age(age)} ago{forced}</span>")
        if self.data.tensorboard_synced:
            self.buttons["tensorboard"].disabled = False

    # -- buttons -------------------------------------------------------------------

    def _on_stop(self) -> None:
        """Stop, in two clicks: the first asks, the second (within
        :data:`STOP_CONFIRM_SECONDS`) stops the job."""
        handle = self.handle
        if handle is None:
            return
        with self._lock:
            armed = self._stop_armed_until is not None and \
                self._clock() < self._stop_armed_until
            if not armed:
                self._stop_armed_until = self._clock() + STOP_CONFIRM_SECONDS
                self.buttons["stop"].description = "Confirm stop"
                self.buttons["stop"].button_style = "danger"
                self.buttons["cancel"].layout.display = None
                self._say(f"Stop job {handle.job_id}? Its instance is deleted and it will "
                          "not resume. Click “Confirm stop”.")
                return
            self._disarm_stop()
            self.buttons["stop"].disabled = True
            self._say(f"stopping job {handle.job_id}…", expires=False)
        threading.Thread(target=self._run, args=(handle.stop, "%spot_stop button",
                                                 "stopped; its instance is deleted"),
                         daemon=True).start()

    def _disarm_stop(self) -> None:
        with self._lock:
            if self._stop_armed_until is None:
                return
            self._stop_armed_until = None
            self.buttons["stop"].description = "Stop job…"
            self.buttons["stop"].button_style = ""
            self.buttons["cancel"].layout.display = "none"
            self._say("")

    def _act(self, action: str) -> None:
        """A button's action; runs wherever the kernel handles the click (see
        :mod:`spotnb.widgets.kernel`), so the slow ones get a thread of their own."""
        handle = self.handle
        if handle is None:
            return
        if action == "interrupt":
            self._say("sending a spot interruption notice…", expires=False)
            threading.Thread(target=self._run, args=(handle.interrupt, None,
                                                     "interruption notice delivered"),
                             daemon=True).start()
        elif action == "tensorboard":
            from spotnb.widgets.kernel import open_tensorboard

            self._say("fetching the TensorBoard logs…", expires=False)
            with self.extra:
                self._say(open_tensorboard(handle))

    def _run(self, func: Callable[..., Any], arg: str | None, done: str) -> None:
        try:
            func(arg) if arg is not None else func()
        except Exception as err:  # shown to the user; the dashboard carries on
            log.exception("dashboard action failed")
            self._say(f"failed: {err}")
        else:
            self._say(done)

    def _say(self, text: str, expires: bool = True) -> None:
        """Show a button's message; it goes after :data:`MESSAGE_SECONDS`."""
        with self._lock:
            self._message_until = self._clock() + MESSAGE_SECONDS if expires and text \
                else None
            self.message.value = (f"<span class='spotnb-message' style='margin:0 1em'>"
                                  f"{html.escape(text)}</span>" if text else "")

    def _expire(self) -> None:
        """Clear a message that has been shown long enough, and a Stop not confirmed."""
        now = self._clock()
        if self._stop_armed_until is not None and now >= self._stop_armed_until:
            self._disarm_stop()
        if self._message_until is not None and now >= self._message_until:
            self._say("")


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
