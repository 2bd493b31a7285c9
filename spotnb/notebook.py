"""Run a notebook head-less: ``spotnb run NOTEBOOK`` and :func:`run_notebook`.

The notebook is executed with nbclient in a fresh kernel started in the notebook's
own directory (so its helper modules import, and its ``%%spot_train`` cells ship
them), then the executed copy is written, without the plotly.js bundle that each live
figure's widget state carries (about 5 MB a figure; the finished cells hold a PNG of
their figures, see :mod:`spotnb.records.document`). The outcome is a :class:`NotebookRun`; a
failed cell is described by a :class:`CellFailure`, never printed here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import nbformat

__all__ = ["CellFailure", "NotebookRun", "default_output", "execute", "run_notebook"]

log = logging.getLogger(__name__)

# A training cell follows its job until it ends; an hour bounds a hung one.
DEFAULT_CELL_TIMEOUT = 3600.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclasses.dataclass(frozen=True)
class CellFailure:
    """The cell that failed: its index, first line and error."""

    index: int
    execution_count: int | None
    first_line: str
    ename: str
    evalue: str
    traceback: str


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

    ``timeout`` bounds each cell (seconds; None for no bound). The kernel inherits this
    process's environment (``SPOTNB_HOME`` included). Raises ``FileNotFoundError`` if
    there is no notebook at ``path``.
    """
    source = Path(path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no notebook at {source}")
    out = Path(output).resolve() if output is not None else default_output(source)
    nb = nbformat.read(source, as_version=4)
    started = time.monotonic()
    failure = execute(nb, source.parent, timeout=timeout, kernel_name=kernel_name)
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

    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            extra_arguments=list(extra_arguments),
                            resources={"metadata": {"path": str(directory)}})
    failure = None
    kernel_usable = True
    with client.setup_kernel(**({"env": dict(env)} if env is not None else {})):
        assert client.kc is not None  # setup_kernel started it
        info = client.wait_for_reply(client.kc.kernel_info())
        if info is not None and "language_info" in info["content"]:
            nb.metadata["language_info"] = info["content"]["language_info"]
        index = -1
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index,
                                    execution_count=client.code_cells_executed + 1)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as err:
            kernel_usable = isinstance(err, CellExecutionError)
            text = str(err).strip()
            failure = _first_failure(nb) or CellFailure(
                index=index, execution_count=None,
                first_line=_first_line(nb.cells[index]) if 0 <= index < len(nb.cells) else "",
                ename=type(err).__name__, evalue=text.splitlines()[-1] if text else "",
                traceback=_ANSI.sub("", text))
        finally:
            client.set_widgets_metadata()
        if before_shutdown is not None and kernel_usable:
            before_shutdown(client)
    return failure


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
