"""Run a notebook head-less: ``spotnb run NOTEBOOK`` and :func:`run_notebook`.

The notebook is executed with nbclient in a fresh kernel started in the notebook's
own directory (so its helper modules import, and its ``%%spot_train`` cells ship
them), then the executed copy is written, without the plotly.js bundle that each live
figure's widget state carries (about 5 MB a figure; the finished cells hold a PNG of
their figures, see :mod:`spotnb.records.document`). The outcome is a :class:`NotebookRun`; a
failed cell is described by a :class:`CellFailure`, never printed here.

The kernel talks to this process over IPC sockets in a private directory (no TCP port,
nothing to encrypt), and knows the notebook's path as Jupyter would tell it
(``JPY_SESSION_NAME``), so its jobs are named after the notebook. A cell that runs past
the timeout is not left running: the job it follows is stopped, since nobody would
watch or stop it after the run, and the executed copy says so in the cell. The kernel's
``%%spot_train`` writes each job it starts to the file named by
:data:`ENV_RUN_JOBS`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # Imported where it is used: nbformat's import takes seconds (its schema validation
    # loads jsonschema's format checkers), and `%load_ext spotnb` imports this module
    # (ENV_RUN_JOBS) without ever reading a notebook.
    import nbformat

__all__ = ["ENV_RUN_JOBS", "CellFailure", "NotebookRun", "default_output", "execute",
           "run_notebook"]

log = logging.getLogger(__name__)

# A training cell follows its job until it ends; an hour bounds a hung one.
DEFAULT_CELL_TIMEOUT = 3600.0
#: Set in the kernel's environment by :func:`execute`: ``%%spot_train`` appends
#: "<job id> followed" (or "detached") to this file for each job it starts.
ENV_RUN_JOBS = "SPOTNB_RUN_JOBS_FILE"
# After a timeout, how long the kernel may take to end the cell (its job stopped, or
# interrupted) before it is shut down anyway. Stopping a job waits up to
# spotnb.client.jobs.STOP_GRACE_SECONDS (30 s) for the agent.
SETTLE_SECONDS = 45.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclasses.dataclass(frozen=True)
class CellFailure:
    """The cell that failed: its index, first line and error.

    ``timed_out``: the cell ran past the timeout; ``stopped_jobs``: the ids of the jobs
    it had started, which were stopped for that reason.
    """

    index: int
    execution_count: int | None
    first_line: str
    ename: str
    evalue: str
    traceback: str
    timed_out: bool = False
    stopped_jobs: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class NotebookRun:
    """The outcome of :func:`run_notebook`."""

    source: Path
    output: Path
    seconds: float
    failure: CellFailure | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None


def default_output(path: Path) -> Path:
    """``<name>.executed.ipynb`` next to the notebook (``*.executed.ipynb`` is in
    the repository's ``.gitignore``)."""
    return path.with_name(path.stem + ".executed.ipynb")


def run_notebook(path: str | os.PathLike[str], output: str | os.PathLike[str] | None = None,
                 timeout: float | None = DEFAULT_CELL_TIMEOUT,
                 kernel_name: str = "python3") -> NotebookRun:
    """Execute the notebook at ``path`` and write the executed copy to ``output``.

    ``timeout`` bounds each cell (seconds; None for no bound); a cell past it fails the
    run, and the jobs it started are stopped. The kernel inherits this process's
    environment (``SPOTNB_HOME`` included). Raises ``FileNotFoundError`` if there is no
    notebook at ``path``.
    """
    source = Path(path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no notebook at {source}")
    out = Path(output).resolve() if output is not None else default_output(source)
    import nbformat

    nb = nbformat.read(source, as_version=4)
    started = time.monotonic()
    env = {**os.environ, "JPY_SESSION_NAME": str(source)}
    failure = execute(nb, source.parent, timeout=timeout, kernel_name=kernel_name, env=env)
    seconds = time.monotonic() - started
    from spotnb.records.document import drop_bundled_widgets

    for dropped in drop_bundled_widgets(nb):
        log.info("not kept in the executed copy: %s", dropped)
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    log.info("executed %s in %.1fs -> %s", source, seconds, out)
    return NotebookRun(source=source, output=out, seconds=seconds, failure=failure)


def execute(nb: nbformat.NotebookNode, directory: str | os.PathLike[str], *,
            timeout: float | None = DEFAULT_CELL_TIMEOUT, kernel_name: str = "python3",
            extra_arguments: Sequence[str] = (), env: Mapping[str, str] | None = None,
            before_shutdown: Callable[[Any], None] | None = None) -> CellFailure | None:
    """Execute ``nb`` in place in a fresh kernel started in ``directory``; the failed
    cell, or None.

    As ``NotebookClient.execute``, except that the widget state is saved in the
    notebook's metadata even when a cell fails, and that ``before_shutdown(client)``
    (an ``nbclient.NotebookClient``) is called while the kernel is still up, unless it
    died or is stuck in a cell that timed out. ``extra_arguments`` go to the kernel's
    command line (``--SpotMagics.provider=aws``); ``env`` replaces its environment.
    """
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from traitlets.config import Config

    # IPC sockets in a short private directory (Unix socket paths are limited to ~107
    # bytes): no TCP port, and no "running over TCP without encryption" warning.
    sockets = Path(tempfile.mkdtemp(prefix="spotnb-nb-"))
    config = Config({"KernelManager": {"transport": "ipc", "ip": str(sockets / "kernel")}})
    run_jobs = sockets / "jobs"
    env = {**(os.environ if env is None else env), ENV_RUN_JOBS: str(run_jobs)}
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            extra_arguments=list(extra_arguments), config=config,
                            resources={"metadata": {"path": str(directory)}})
    replies: dict[int, dict[str, Any]] = {}

    def on_cell_error(cell: Any, cell_index: int, execute_reply: dict[str, Any]) -> None:
        replies[cell_index] = dict(execute_reply.get("content") or {})

    client.on_cell_error = on_cell_error
    failure = None
    kernel_usable = True
    try:
        with client.setup_kernel(env=env):
            assert client.kc is not None  # setup_kernel started it
            info = client.wait_for_reply(client.kc.kernel_info())
            if info is not None and "language_info" in info["content"]:
                nb.metadata["language_info"] = info["content"]["language_info"]
            index = -1
            try:
                for index, cell in enumerate(nb.cells):
                    client.execute_cell(cell, index,
                                        execution_count=client.code_cells_executed + 1)
            except CellExecutionError as err:
                reply = replies.get(index, {})
                failure = _first_failure(nb) or _failure(
                    nb, index, reply.get("ename") or err.ename,
                    reply.get("evalue") or err.evalue,
                    "\n".join(reply.get("traceback") or []))
            except CellTimeoutError:
                kernel_usable = False
                failure = _timed_out(client, nb, index, timeout, run_jobs)
            except DeadKernelError as err:
                kernel_usable = False
                failure = _failure(nb, index, "DeadKernelError",
                                   f"the kernel died while the cell ran: {err}", "")
            finally:
                client.set_widgets_metadata()
            if before_shutdown is not None and kernel_usable:
                before_shutdown(client)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    if failure is not None and failure.timed_out:
        import nbformat

        # Last, once the kernel is gone and adds no more output: why the cell ended.
        nb.cells[failure.index].outputs.append(nbformat.v4.new_output(
            "error", ename=failure.ename, evalue=failure.evalue,
            traceback=[f"{failure.ename}: {failure.evalue}"]))
    return failure


def _failure(nb: nbformat.NotebookNode, index: int, ename: str, evalue: str,
             traceback: str, **extra: Any) -> CellFailure:
    cell = nb.cells[index] if 0 <= index < len(nb.cells) else None
    return CellFailure(
        index=index, execution_count=cell.get("execution_count") if cell else None,
        first_line=_first_line(cell) if cell else "", ename=ename, evalue=evalue,
        traceback=_ANSI.sub("", traceback), **extra)


def _timed_out(client: Any, nb: nbformat.NotebookNode, index: int,
               timeout: float | None, run_jobs: Path) -> CellFailure:
    """The cell at ``index`` ran past ``timeout`` and is still running: stop the job
    it follows, and let the kernel end the cell.

    Step 1: stop each job a ``%%spot_train`` cell of this run started and follows that
    has not ended: the timed-out cell's (a cell that follows a job ends only when the
    job does). Nobody would watch it after the run; it would keep costing. Its follow
    loop then sees the job end, and the cell ends. Jobs started with ``--detach`` run
    on, as asked.
    Step 2: a cell without a job (or one that still runs) is interrupted.
    Step 3: wait, a bounded time, for the kernel to finish the cell, so that it is shut
    down idle.
    """
    import spotnb

    stopped = []
    for job_id in _followed_jobs(run_jobs):
        try:
            handle = spotnb.attach(job_id)
            if handle.result_record() is None:
                handle.stop(reason="spotnb run --timeout")
                stopped.append(job_id)
        except (spotnb.JobNotFound, spotnb.SpecError, OSError) as err:
            log.warning("could not stop job %s after the timeout: %s", job_id, err)
    if not _kernel_settles(client, SETTLE_SECONDS if stopped else 0.0):
        with contextlib.suppress(Exception):
            client.km.interrupt_kernel()
        _kernel_settles(client, SETTLE_SECONDS)
    evalue = f"the cell ran longer than the timeout of {timeout:g} s"
    if stopped:
        evalue += f"; its job {', '.join(stopped)} was stopped"
    return _failure(nb, index, "CellTimeoutError", evalue, "", timed_out=True,
                    stopped_jobs=tuple(stopped))


def _followed_jobs(run_jobs: Path) -> list[str]:
    """The ids of the jobs this run's cells started and followed (``ENV_RUN_JOBS``)."""
    try:
        lines = run_jobs.read_text().splitlines()
    except OSError:
        return []
    return [parts[0] for line in lines if len(parts := line.split()) == 2
            and parts[1] == "followed"]


def _kernel_settles(client: Any, seconds: float) -> bool:
    """Whether the kernel answers within ``seconds``: it has finished the running cell
    (the shell channel answers requests in order)."""
    if seconds <= 0:
        return False
    client.timeout = seconds  # what wait_for_reply waits, at most
    try:
        return client.wait_for_reply(client.kc.kernel_info()) is not None
    except Exception:  # a timeout, a dead kernel: either way, not settled
        return False


def _first_line(cell: nbformat.NotebookNode) -> str:
    lines = cell.source.strip().splitlines()
    return lines[0] if lines else ""


def _first_failure(nb: nbformat.NotebookNode) -> CellFailure | None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return CellFailure(
                    index=index, execution_count=cell.get("execution_count"),
                    first_line=_first_line(cell),
                    ename=output.get("ename", ""), evalue=output.get("evalue", ""),
                    traceback=_ANSI.sub("", "\n".join(output.get("traceback", []))))
    return None
