"""Free-variable analysis of a notebook cell: the names it reads before it binds them.

:func:`free_names` follows Python's scoping rules on the cell after IPython's own
transformations (``%magic``, ``!cmd``): module and class bodies are read in order,
with branches merged (a name bound in only one branch of an ``if`` is still free
after it); functions, lambdas and comprehensions are scopes of their own; ``global``,
``nonlocal``, ``del``, augmented assignment, ``:=``, ``match`` and ``except ... as``
are understood; ``{expr}``/``$name`` in magic lines and shell commands, and the code
of ``%time``/``%timeit``/``%prun``, are read too.

Two assumptions a notebook author would make: a loop body runs at least once, and a
function defined in the cell runs after the cell's own top-level assignments (so a
name it reads is free only if the cell never assigns it at top level).
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Iterable, Sequence

__all__ = ["bound_names_in", "free_names", "free_names_in"]


def free_names(code: str) -> list[str]:
    """The names ``code`` reads before it binds them, sorted (builtins included).

    ``code`` is IPython cell source; it is transformed first. Raises ``SyntaxError``
    if it does not compile.
    """
    from IPython.core.inputtransformer2 import TransformerManager

    return sorted(free_names_in(ast.parse(TransformerManager().transform_cell(code))))


def free_names_in(tree: ast.Module) -> set[str]:
    """The free names of a parsed cell (see :func:`free_names`)."""
    analysis = _FreeNames()
    analysis.run(tree)
    return analysis.free


def bound_names_in(tree: ast.Module) -> set[str]:
    """The names a parsed cell binds at its top level, anywhere in it (an assignment,
    an import, a ``def``, a loop's target; ``global`` ones in its functions too): the
    variables a function of the notebook reads from the cell once the cell runs."""
    analysis = _FreeNames()
    analysis.run(tree)
    declared = {name for node in ast.walk(tree) if isinstance(node, ast.Global)
                for name in node.names}
    return analysis.module_any | declared


@dataclasses.dataclass
class _Scope:
    """A scope while analysing: module and class bodies are read in order, so
    ``names`` are the names bound so far; for functions and comprehensions they are
    all the scope's local names, known before reading the body."""

    kind: str  # "module", "class", "function" or "comprehension"
    names: set[str]


class _FreeNames:
    def __init__(self) -> None:
        self.free: set[str] = set()
        self.module = _Scope("module", set())
        # Every top-level binding anywhere in the cell, and the global names read by
        # function bodies: those are settled once the whole cell has been read.
        self.module_any: set[str] = set()
        self.late_reads: set[str] = set()

    def run(self, tree: ast.Module) -> None:
        self._block(tree.body, (self.module,))
        self.free |= self.late_reads - self.module_any

    # Sequential scopes (the module, class bodies): statements in order, branches merged.

    def _block(self, stmts: Sequence[ast.stmt], chain: tuple[_Scope, ...]) -> None:
        for stmt in stmts:
            self._stmt(stmt, chain)

    def _branches(self, branches: Iterable[Sequence[ast.stmt]],
                  chain: tuple[_Scope, ...]) -> None:
        """Run alternative blocks from the same state; keep what all of them bind.

        A block ending in ``raise``/``return``/``break``/``continue`` does not reach
        the code after it, so it does not constrain what is bound there.
        """
        scope = chain[-1]
        before = set(scope.names)
        outcomes = []
        for body in branches:
            scope.names = set(before)
            self._block(body, chain)
            if not _ends(body):
                outcomes.append(scope.names)
        scope.names = set.intersection(*outcomes) if outcomes else before

    def _stmt(self, node: ast.stmt, chain: tuple[_Scope, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._walk(node, chain)
            self._bind(node.name, chain)
        elif isinstance(node, ast.Assign):
            self._walk(node.value, chain)
            for target in node.targets:
                self._walk(target, chain)
        elif isinstance(node, ast.AugAssign):
            self._walk(node.value, chain)
            if isinstance(node.target, ast.Name):
                self._read(node.target.id, chain)
            self._walk(node.target, chain)
        elif isinstance(node, ast.AnnAssign):
            self._walk(node.annotation, chain)
            if node.value is not None:
                self._walk(node.value, chain)
                self._walk(node.target, chain)
            elif not isinstance(node.target, ast.Name):
                self._walk(node.target, chain)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self._walk(node.iter, chain)
            self._walk(node.target, chain)
            self._block(node.body, chain)  # assumed to run at least once
            self._block(node.orelse, chain)
        elif isinstance(node, ast.While):
            self._walk(node.test, chain)
            self._block(node.body, chain)
            self._block(node.orelse, chain)
        elif isinstance(node, ast.If):
            self._walk(node.test, chain)
            self._branches([node.body, node.orelse], chain)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self._walk(item.context_expr, chain)
                if item.optional_vars is not None:
                    self._walk(item.optional_vars, chain)
            self._block(node.body, chain)
        elif isinstance(node, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            self._try(node, chain)  # type: ignore[arg-type]
        elif isinstance(node, ast.Match):
            self._walk(node.subject, chain)
            scope = chain[-1]
            before = set(scope.names)
            outcomes = []
            for case in node.cases:
                scope.names = set(before)
                self._pattern(case.pattern, chain)
                if case.guard is not None:
                    self._walk(case.guard, chain)
                self._block(case.body, chain)
                outcomes.append(scope.names)
            exhaustive = bool(node.cases) and _irrefutable(node.cases[-1].pattern)
            if not exhaustive:
                outcomes.append(before)
            scope.names = set.intersection(*outcomes)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name != "*":
                    self._bind(alias.asname or alias.name.split(".")[0], chain)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self._read(target.id, chain)  # deleting needs the variable
                    chain[-1].names.discard(target.id)
                else:
                    self._walk(target, chain)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            pass
        elif isinstance(node, ast.Expr) and _ipython_call(node.value):
            self._ipython(node.value, chain)  # type: ignore[arg-type]
        else:
            self._walk(node, chain)

    def _try(self, node: ast.Try, chain: tuple[_Scope, ...]) -> None:
        scope = chain[-1]
        before = set(scope.names)
        self._block(node.body, chain)
        self._block(node.orelse, chain)
        outcomes = [] if _ends(node.orelse or node.body) else [scope.names]
        for handler in node.handlers:
            scope.names = set(before)
            if handler.type is not None:
                self._walk(handler.type, chain)
            if handler.name:
                self._bind(handler.name, chain)
            self._block(handler.body, chain)
            if handler.name:
                scope.names.discard(handler.name)  # Python deletes it after the handler
            if not _ends(handler.body):
                outcomes.append(scope.names)
        scope.names = set.intersection(*outcomes) if outcomes else before
        self._block(node.finalbody, chain)

    def _pattern(self, pattern: ast.pattern, chain: tuple[_Scope, ...]) -> None:
        for sub in ast.walk(pattern):
            if isinstance(sub, (ast.MatchAs, ast.MatchStar)) and sub.name:
                self._bind(sub.name, chain)
            elif isinstance(sub, ast.MatchMapping) and sub.rest:
                self._bind(sub.rest, chain)
            elif isinstance(sub, ast.MatchValue):
                self._walk(sub.value, chain)
            elif isinstance(sub, ast.MatchClass):
                self._walk(sub.cls, chain)

    # Any node: scopes and names, in evaluation order where it matters.

    def _walk(self, node: ast.AST, chain: tuple[_Scope, ...]) -> None:
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                self._read(node.id, chain)
            elif isinstance(node.ctx, ast.Store):
                self._bind(node.id, chain)
            else:
                self._read(node.id, chain)
                if chain[-1].kind in ("module", "class"):
                    chain[-1].names.discard(node.id)
        elif isinstance(node, ast.AugAssign):
            self._walk(node.value, chain)
            if isinstance(node.target, ast.Name):
                self._read(node.target.id, chain)
            self._walk(node.target, chain)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self._function(node, chain)
        elif isinstance(node, ast.ClassDef):
            for expr in [*node.decorator_list, *node.bases, *node.keywords]:
                self._walk(expr, chain)
            body = _Scope("class", set())
            if chain[-1].kind in ("module", "class"):
                self._block(node.body, (*chain, body))
            else:
                body.names = _local_names(node.body)
                for stmt in node.body:
                    self._walk(stmt, (*chain, body))
        elif isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            self._comprehension(node, chain)
        elif isinstance(node, ast.NamedExpr):
            self._walk(node.value, chain)
            self._bind(node.target.id, chain)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self._bind(node.name, chain)
            for child in ast.iter_child_nodes(node):
                self._walk(child, chain)
        elif isinstance(node, ast.Call) and _ipython_call(node):
            self._ipython(node, chain)
        elif isinstance(node, (ast.Global, ast.Nonlocal, ast.Import, ast.ImportFrom)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name != "*":
                        self._bind(alias.asname or alias.name.split(".")[0], chain)
        else:
            for child in ast.iter_child_nodes(node):
                self._walk(child, chain)

    def _ipython(self, call: ast.Call, chain: tuple[_Scope, ...]) -> None:
        """``get_ipython().run_line_magic(...)``/``.system(...)``: what the strings read.

        IPython expands ``{expression}`` and ``$name`` in magic lines and shell
        commands from the namespace, and ``%time``/``%timeit``/``%prun`` run their
        line as code.
        """
        assert isinstance(call.func, ast.Attribute)
        texts = [a.value for a in call.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str)]
        if call.func.attr in ("run_line_magic", "run_cell_magic") and texts:
            magic, lines = texts[0], texts[1:]
        else:
            magic, lines = "", texts
        for line in lines:
            for expr in _expansions(line):
                self._walk(expr, chain)
        if magic in _CODE_MAGICS and lines:
            body = _parse_magic_code(lines[-1])
            if chain[-1].kind in ("module", "class"):
                self._block(body, chain)
            else:
                for stmt in body:
                    self._walk(stmt, chain)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda,
                  chain: tuple[_Scope, ...]) -> None:
        # Evaluated where the function is defined: decorators, defaults, annotations.
        args = node.args
        defined_now: list[ast.AST] = [*args.defaults, *[d for d in args.kw_defaults if d]]
        if not isinstance(node, ast.Lambda):
            defined_now += node.decorator_list
            defined_now += [a.annotation for a in _all_args(args) if a.annotation]
            if node.returns is not None:
                defined_now.append(node.returns)
        for expr in defined_now:
            self._walk(expr, chain)
        params = {a.arg for a in _all_args(args)}
        if isinstance(node, ast.Lambda):
            scope = _Scope("function", params | _local_names([node.body]))
            self._walk(node.body, (*chain, scope))
            return
        scope = _Scope("function", params | _local_names(node.body))
        for stmt in node.body:
            self._walk(stmt, (*chain, scope))

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp
                       | ast.DictComp, chain: tuple[_Scope, ...]) -> None:
        gens = node.generators
        # The first iterable is evaluated in the enclosing scope.
        self._walk(gens[0].iter, chain)
        targets = {n.id for g in gens for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        inner = (*chain, _Scope("comprehension", targets))
        for i, gen in enumerate(gens):
            if i:
                self._walk(gen.iter, inner)
            for cond in gen.ifs:
                self._walk(cond, inner)
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for part in parts:
            self._walk(part, inner)

    def _bind(self, name: str, chain: tuple[_Scope, ...]) -> None:
        # A comprehension's own targets stay in it; anything else it binds (a walrus)
        # lands in the nearest enclosing scope that is not a comprehension.
        if chain[-1].kind == "comprehension" and name in chain[-1].names:
            return
        for scope in reversed(chain):
            if scope.kind == "comprehension":
                continue
            if scope.kind in ("module", "class"):
                scope.names.add(name)
                if scope is self.module:
                    self.module_any.add(name)
            return

    def _read(self, name: str, chain: tuple[_Scope, ...]) -> None:
        deferred = False
        for depth, scope in enumerate(reversed(chain)):
            if scope.kind in ("function", "comprehension"):
                if name in scope.names:
                    return
                deferred = deferred or scope.kind == "function"
            elif scope.kind == "class":
                # A class body's names are visible in the body itself only.
                if depth == 0 and name in scope.names:
                    return
            elif deferred:
                self.late_reads.add(name)
            elif name not in scope.names:
                self.free.add(name)


# Magics whose line (or cell) is Python code run in the notebook's namespace.
_CODE_MAGICS = frozenset({"time", "timeit", "prun"})
_IPYTHON_METHODS = frozenset({"run_line_magic", "run_cell_magic", "system", "getoutput"})
_EXPANSION = re.compile(r"\{([^{}]+)\}|(?<!\$)\$([A-Za-z_][A-Za-z0-9_]*)")


def _ipython_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in _IPYTHON_METHODS
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "get_ipython")


def _expansions(text: str) -> list[ast.expr]:
    found = []
    for match in _EXPANSION.finditer(text):
        try:
            found.append(ast.parse(match.group(1) or match.group(2), mode="eval").body)
        except SyntaxError:
            continue  # IPython leaves what it cannot evaluate as it is
    return found


def _parse_magic_code(text: str) -> list[ast.stmt]:
    """The statements of a ``%time``-like line, after its ``-options``."""
    words = text.split()
    for start in range(len(words) + 1):
        try:
            return ast.parse(" ".join(words[start:])).body
        except SyntaxError:
            continue
    return []


def _all_args(args: ast.arguments) -> list[ast.arg]:
    found = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    found += [a for a in (args.vararg, args.kwarg) if a is not None]
    return found


def _ends(body: Sequence[ast.stmt]) -> bool:
    return bool(body) and isinstance(body[-1], (ast.Raise, ast.Return, ast.Break,
                                                ast.Continue))


def _irrefutable(pattern: ast.pattern) -> bool:
    return isinstance(pattern, ast.MatchAs) and pattern.pattern is None


def _local_names(body: Sequence[ast.AST]) -> set[str]:
    """The names a function body binds (its locals), minus ``global``/``nonlocal``."""
    bound: set[str] = set()
    declared: set[str] = set()
    todo = list(body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
            continue  # its body is another scope
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            # Only a walrus inside binds here.
            bound.update(n.target.id for n in ast.walk(node) if isinstance(n, ast.NamedExpr))
            todo.append(node.generators[0].iter)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update(a.asname or a.name.split(".")[0] for a in node.names if a.name != "*")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            declared.update(node.names)
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            bound.add(node.name)
        elif isinstance(node, ast.MatchMapping) and node.rest:
            bound.add(node.rest)
        todo.extend(ast.iter_child_nodes(node))
    return bound - declared
