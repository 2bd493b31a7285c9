"""Run a notebook head-less: ``spotnb run NOTEBOOK`` and :func:`run_notebook`.

The notebook is executed with nbclient in a fresh kernel started in the notebook's
own directory (so its helper modules import, and its ``%%spot_train`` cells ship
them), then the executed copy is written. The outcome is a :class:`NotebookRun`; a
failed cell is described by a :class:`CellFailure`, never printed here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from pathlib import Path

import nbformat

__all__ = ["CellFailure", "NotebookRun", "default_output", "run_notebook"]

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
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError

    source = Path(path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no notebook at {source}")
    out = Path(output).resolve() if output is not None else default_output(source)
    nb = nbformat.read(source, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name=kernel_name,
                            resources={"metadata": {"path": str(source.parent)}})
    started = time.monotonic()
    failure = None
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as err:
        failure = _first_failure(nb) or CellFailure(
            index=-1, execution_count=None, first_line="", ename=type(err).__name__,
            evalue=str(err).strip().splitlines()[-1] if str(err).strip() else "",
            traceback=_ANSI.sub("", str(err)))
    seconds = time.monotonic() - started
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    log.info("executed %s in %.1fs -> %s", source, seconds, out)
    return NotebookRun(source=source, output=out, seconds=seconds, failure=failure)


def _first_failure(nb: nbformat.NotebookNode) -> CellFailure | None:
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                lines = cell.source.strip().splitlines()
                return CellFailure(
                    index=index, execution_count=cell.get("execution_count"),
                    first_line=lines[0] if lines else "",
                    ename=output.get("ename", ""), evalue=output.get("evalue", ""),
                    traceback=_ANSI.sub("", "\n".join(output.get("traceback", []))))
    return None
