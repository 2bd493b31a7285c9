"""The total of the loop around ``spot.log``, found in the cell's source on the instance.

``spot.log``'s first call looks at the code that called it (:func:`loop_total`): inside
``for step in range(..., stop)``, the run has ``stop`` steps, which the progress line
shows as "step 120 of 1,000" with a time left, without the user saying the total
(``spot.progress(total=...)`` says it where no such loop is found).
"""

from __future__ import annotations

import ast
import functools
import linecache
from types import FrameType

__all__ = ["loop_total"]

_SAFE_CALLS = frozenset({"len", "int", "min", "max", "round", "abs"})
_SAFE_NODES = (ast.Expression, ast.Name, ast.Load, ast.Attribute, ast.Constant, ast.BinOp,
               ast.UnaryOp, ast.operator, ast.unaryop, ast.Call)


def loop_total(frame: FrameType) -> int | None:
    """The number of steps of the loop in which ``frame`` calls ``spot.log``.

    Found when the call is ``spot.log(step, ...)`` (or ``log(step, ...)``) inside
    ``for step in range(..., stop[, stride])``: the total is ``stop``, since steps run
    ``0 .. stop - 1``. ``stop`` is evaluated again in the frame if it is a plain
    expression (names, attributes, numbers, arithmetic, ``len(...)``); else None, as
    for any other loop: then ``spot.progress(total=...)`` says it.
    """
    tree = _parsed(frame.f_code.co_filename)
    if tree is None:
        return None
    for loop in _loops_around(tree, frame.f_lineno):
        if not (isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Call)
                and isinstance(loop.iter.func, ast.Name) and loop.iter.func.id == "range"
                and 1 <= len(loop.iter.args) <= 3 and not loop.iter.keywords):
            continue
        if not _logs_step(loop, loop.target.id, frame.f_lineno):
            continue
        stop = loop.iter.args[0 if len(loop.iter.args) == 1 else 1]
        if not _plain(stop):
            return None
        value = eval(compile(ast.Expression(stop), "<range stop>", "eval"),
                     frame.f_globals, frame.f_locals)
        return int(value) if int(value) > 0 else None
    return None


@functools.lru_cache(maxsize=32)
def _parsed_text(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def _parsed(filename: str) -> ast.Module | None:
    # IPython keeps each cell's source in linecache under the file name it compiled it as.
    lines = linecache.getlines(filename)
    return _parsed_text("".join(lines)) if lines else None


def _loops_around(tree: ast.AST, lineno: int) -> list[ast.For]:
    """The ``for`` loops whose body holds ``lineno``, innermost first."""
    found = [node for node in ast.walk(tree) if isinstance(node, ast.For)
             and node.body and node.body[0].lineno <= lineno <= (node.end_lineno or 0)]
    return sorted(found, key=lambda n: n.lineno, reverse=True)


def _logs_step(loop: ast.For, name: str, lineno: int) -> bool:
    """Whether the ``log`` call on ``lineno`` logs the loop variable as its step."""
    for node in ast.walk(loop):
        if isinstance(node, ast.Call) and node.lineno <= lineno <= (node.end_lineno or 0):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else \
                func.id if isinstance(func, ast.Name) else None
            if called == "log" and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id == name:
                return True
    return False


def _plain(node: ast.expr) -> bool:
    for part in ast.walk(node):
        if not isinstance(part, _SAFE_NODES):
            return False
        if isinstance(part, ast.Call) and not (isinstance(part.func, ast.Name)
                                               and part.func.id in _SAFE_CALLS):
            return False
    return True
