"""Which metrics a sweep's cell logs: its ``--metric`` checked before anything starts,
and again on the trials' rows.

Before launch (:func:`cell_metrics`): the names of the metrics the cell can log, read
from its ``spot.log(step, name=value, ...)`` calls. The list is *closed* only when
nothing else can log: every call names its metrics as keywords (no ``**values``), the
runtime is used only through such calls and plain attributes (not handed to other
code, not ``spot.callbacks``, whose framework loggers name their own metrics), no
input is code (a function or class from another cell may log), and no shipped file
imports spotnb. A closed list that lacks the sweep's metric is bad input: the sweep is
refused, naming the metrics the cell logs (:func:`missing_metric`).

While trials run, the driver reads each trial's metrics from its fold: a trial that
ended having logged rows but never the metric stops the sweep (its other trials would
run to the end for nothing), naming the metrics logged; one still running that has
logged rows without it yet is a warning on the sweep's line. A metric logged only now
and then (a validation loss every epoch) is absent from the first rows of a trial that
logs it, so the first rows alone never stop a sweep whose list is open.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CellMetrics", "cell_metrics", "missing_metric", "not_logged_text",
           "trials_without"]

#: The name a cell's runtime goes by (``spot.log``); others come from imports of it.
RUNTIME_NAME = "spot"
_RUNTIME_MODULES = ("spotnb.runtime", "spotnb.train.runtime", "spotnb.train.process")
# Runtime attributes that hand the logging to code the cell does not show.
_OPENING_ATTRIBUTES = frozenset({"callbacks"})


@dataclasses.dataclass(frozen=True)
class CellMetrics:
    """The metrics the cell's ``spot.log`` calls name; ``closed``: nothing else can log
    (module docstring), else ``why_open`` says what may."""

    names: tuple[str, ...]
    closed: bool
    why_open: str = ""


class _Calls(ast.NodeVisitor):
    def __init__(self) -> None:
        self.runtime = {RUNTIME_NAME}  # names bound to the runtime module
        self.log_functions: set[str] = set()  # names bound to its log function
        self.names: dict[str, None] = {}
        self.open = ""
        self._bases: set[int] = set()  # id() of nodes used as spot.X or called as log

    def _note_open(self, why: str) -> None:
        self.open = self.open or why

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name in _RUNTIME_MODULES and alias.asname:
                self.runtime.add(alias.asname)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        for alias in node.names:
            full = f"{module}.{alias.name}"
            if full in _RUNTIME_MODULES:
                self.runtime.add(alias.asname or alias.name)
            elif module in _RUNTIME_MODULES and alias.name == "log":
                self.log_functions.add(alias.asname or alias.name)
            elif module in _RUNTIME_MODULES and alias.name in _OPENING_ATTRIBUTES:
                self._note_open(f"it uses spot.{alias.name}")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        is_log = (isinstance(func, ast.Attribute) and func.attr == "log"
                  and isinstance(func.value, ast.Name) and func.value.id in self.runtime) \
            or (isinstance(func, ast.Name) and func.id in self.log_functions)
        if is_log:
            self._bases.add(id(func))
            if isinstance(func, ast.Attribute):
                self._bases.add(id(func.value))
            for kw in node.keywords:
                if kw.arg is None:
                    self._note_open("a spot.log call names its metrics with **")
                else:
                    self.names[kw.arg] = None
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id in self.runtime:
            self._bases.add(id(node.value))
            if node.attr in _OPENING_ATTRIBUTES:
                self._note_open(f"it uses spot.{node.attr}")
            elif node.attr == "log" and id(node) not in self._bases:
                self._note_open("it hands spot.log to other code")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and id(node) not in self._bases:
            if node.id in self.runtime:
                self._note_open("it hands the runtime (spot) to other code")
            elif node.id in self.log_functions:
                self._note_open("it hands spot.log to other code")


def _parse(code: str) -> ast.Module | None:
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        return ast.parse(TransformerManager().transform_cell(code))
    except SyntaxError:
        return None


def cell_metrics(code: str, inputs: Mapping[str, Any] | None = None,
                 files: Mapping[str, Any] | None = None) -> CellMetrics:
    """The metrics ``code`` logs (see :class:`CellMetrics`), given the cell's
    ``inputs`` (values) and shipped ``files`` (remote path -> local path)."""
    tree = _parse(code)
    if tree is None:
        return CellMetrics((), False, "the cell does not parse")
    calls = _Calls()
    # Visit in source order: imports before the calls that use their names.
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            calls.visit(node)
    calls.visit(tree)
    names = tuple(calls.names)
    why = calls.open
    code_inputs = sorted(k for k, v in (inputs or {}).items() if _is_code(v))
    if not why and code_inputs:
        why = f"it calls code from other cells ({', '.join(code_inputs[:3])})"
    if not why:
        for remote, local in (files or {}).items():
            if str(remote).endswith(".py") and _mentions_spotnb(local):
                why = f"its module {remote} uses spotnb"
                break
    if not why and not names:
        why = "it has no spot.log call"
    return CellMetrics(names, not why, why)


def _is_code(value: Any) -> bool:
    """Whether an input can run code that logs: a function, a class, a module, or an
    object of a class the notebook defined."""
    return (inspect.isfunction(value) or inspect.isclass(value) or inspect.ismodule(value)
            or inspect.ismethod(value) or type(value).__module__ == "__main__")


def _mentions_spotnb(path: Any) -> bool:
    try:
        return "spotnb" in Path(path).read_text(errors="replace")
    except OSError:
        return True  # unreadable: it may


def not_logged_text(metric: str, logged: Iterable[str]) -> str:
    """``it logs loss, val_acc, not val_accuracy (did you mean val_acc?)``."""
    names = list(dict.fromkeys(logged))
    shown = ", ".join(names) if names else "no metric"
    return f"it logs {shown}, not {metric}" + _guess(metric, names)


def missing_metric(metric: str, found: CellMetrics) -> str | None:
    """Why ``metric`` can never be logged (None: it may be)."""
    if not found.closed or metric in found.names:
        return None
    return (f"the cell never logs {metric!r}: its spot.log calls name "
            f"{', '.join(found.names)}" + _guess(metric, found.names))


def _guess(metric: str, names: Iterable[str]) -> str:
    close = difflib.get_close_matches(metric, list(names), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def trials_without(metric: str, logged: Sequence[tuple[int, list[str], bool]]
                   ) -> tuple[str, str]:
    """What the trials' rows say of ``metric`` (module docstring): ``(stop, warning)``,
    either empty. ``logged``: each started trial's number, the metrics it has logged,
    and whether it is over (ended by itself)."""
    warning = ""
    for number, names, over in logged:
        if not names or metric in names:
            continue
        shown = list(dict.fromkeys(names))
        if over:
            return (f"trial {number} ended without logging the sweep's metric: "
                    f"{not_logged_text(metric, shown)}. Run the sweep again with --metric "
                    "set to one it logs"), ""
        warning = warning or f"trial {number} has logged {', '.join(shown)} and no {metric} yet"
    return "", warning
