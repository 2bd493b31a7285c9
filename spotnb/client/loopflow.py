"""What one iteration of a loop reads before it assigns, and what it assigns or changes.

:class:`LoopFlow` walks a loop's body once, in Python's evaluation order, with
branches merged (a name assigned in one branch only is not assigned after it), an inner
loop taken to run at least once (as the notebook's author reads it), comprehensions and
lambdas as scopes of their own. ``exposed``: the names read before the iteration assigns
them (their value comes from the previous iteration, or from before the loop);
``written``: the names assigned, or changed in place (``xs.append``, ``d[k] = v``,
``next(it)``, ``sched.step()``, ``x.mul_(d)``, ``random.shuffle(xs)``, a ``global`` a
called function assigns). A name in both is carried from one iteration to the next:
:mod:`spotnb.client.carried` reports those the checkpoint does not hold.

A change made through a view changes the object it views: ``ema_p.mul_(d)`` in ``for
ema_p, p in zip(ema.parameters(), model.parameters())`` changes ``ema``; so do
``params = list(ema.parameters())`` and ``torch._foreach_lerp_(params, ...)``, and
``w = model.fc.weight; w.add_(...)``. :func:`view_roots` says what a value is a view of.
"""

from __future__ import annotations

import ast
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

__all__ = ["LoopFlow", "base_name", "dotted", "import_names", "last_name", "target_names",
           "view_roots", "views_of"]

# Reading a clock: a variable assigned only from these measures time, not state.
_CLOCKS = frozenset({"time.time", "time.perf_counter", "time.monotonic", "time.time_ns",
                     "time.perf_counter_ns", "time.monotonic_ns", "time.process_time",
                     "datetime.datetime.now", "datetime.now"})
# Methods that change their object: containers, and what a training loop steps.
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popleft", "appendleft", "add",
                       "update", "setdefault", "clear", "remove", "discard", "step",
                       "update_parameters", "load_state_dict"})
# Methods whose result holds the object's own tensors (not copies): changing it in place
# changes the object (parameters(), state_dict(), a dict's values()).
_VIEWS = frozenset({"parameters", "named_parameters", "buffers", "named_buffers",
                    "state_dict", "values", "items", "children", "modules",
                    "named_modules", "named_children", "detach", "view", "view_as"})
# Builtins whose result holds their arguments' items: list(ema.parameters()).
_HOLDING = frozenset({"list", "tuple", "iter", "zip", "enumerate", "reversed", "dict",
                      "sorted"})


def _in_place(method: str) -> bool:
    """torch's convention: ``x.mul_(d)`` changes ``x``; ``_foreach_mul_`` its argument."""
    return method.endswith("_") and not method.endswith("__") and (
        not method.startswith("_") or method.startswith("_foreach_"))


class LoopFlow:
    """What one iteration of a loop body reads before it assigns (``exposed``) and what
    it assigns or changes (``written``), with line numbers; Python's evaluation order,
    branches merged (a name assigned in one branch only is not assigned after it)."""

    def __init__(self, aliases: Mapping[str, str],
                 globals_of: Callable[[str], set[str]] = lambda name: set(),
                 views: Mapping[str, frozenset[str]] | None = None) -> None:
        self.aliases = aliases
        # The global variables a function of the cell or the notebook assigns, by name.
        self.globals_of = globals_of
        self.exposed: dict[str, int] = {}
        self.written: dict[str, int] = {}
        self.verbs: dict[str, str] = {}
        self.via: dict[str, str] = {}  # name -> the function that changes it
        self.assigned: set[str] = set()  # rebound, not only changed in place
        self.sources: dict[str, list[ast.AST]] = {}  # name -> the values assigned
        # name -> the variables whose objects it is a view of (view_roots); starts with
        # the views assigned before the loop, follows the loop's own.
        self.views: dict[str, frozenset[str]] = dict(views or {})

    def clocks(self) -> set[str]:
        """Names every assignment of which reads a clock (or another such name)."""
        clocks: set[str] = set()
        changed = True
        while changed:
            changed = False
            for name, values in self.sources.items():
                if name not in clocks and values and all(
                        self._clock(v, clocks) for v in values):
                    clocks.add(name)
                    changed = True
        return clocks

    def _clock(self, value: ast.AST, clocks: set[str]) -> bool:
        if isinstance(value, ast.Name):
            return value.id in clocks
        return isinstance(value, ast.Call) and dotted(value.func, self.aliases) in _CLOCKS

    def _read(self, name: str, line: int, defined: set[str]) -> None:
        if name not in defined:
            self.exposed.setdefault(name, line)

    def _change(self, name: str, line: int, defined: set[str], verb: str = "changes",
                how: str | None = None) -> None:
        """``name``'s object is changed in place (``how``: the call that does it), and
        with it the objects it is a view of."""
        self._read(name, line, defined)
        self._write(name, line, None, verb=verb)
        for root in sorted(self.views.get(name, ())):
            if root != name:
                self._read(root, line, defined)
                self._write(root, line, None, verb="changes")
                if how:
                    self.via.setdefault(root, how)

    def _write(self, name: str, line: int, defined: set[str] | None, verb: str = "assigns",
               value: ast.AST | None = None) -> None:
        self.written.setdefault(name, line)
        self.verbs.setdefault(name, verb)
        if verb == "assigns":
            self.assigned.add(name)
            self.sources.setdefault(name, []).append(value if value is not None else
                                                     ast.Constant(None))
            if defined is not None:
                defined.add(name)

    def block(self, stmts: Iterable[ast.stmt], defined: set[str] | None) -> set[str] | None:
        """Walk ``stmts``; the names assigned for sure after them (None: not reached)."""
        for stmt in stmts:
            if defined is None:
                return None  # after a break, continue, return or raise
            defined = self.stmt(stmt, defined)
        return defined

    def _branches(self, blocks: Iterable[Iterable[ast.stmt]], defined: set[str]
                  ) -> set[str] | None:
        outcomes = [self.block(b, set(defined)) for b in blocks]
        reached = [o for o in outcomes if o is not None]
        return set.intersection(*reached) if reached else None

    def stmt(self, node: ast.stmt, defined: set[str]) -> set[str] | None:
        line = node.lineno
        if isinstance(node, ast.Assign):
            self.expr(node.value, defined)
            for target in node.targets:
                self.target(target, defined, node.value)
        elif isinstance(node, ast.AugAssign):
            self.expr(node.value, defined)
            if isinstance(node.target, ast.Name):
                self._read(node.target.id, line, defined)
                self._write(node.target.id, line, defined, value=node)
            else:
                self.target(node.target, defined, node)
        elif isinstance(node, ast.AnnAssign):
            if node.value is not None:
                self.expr(node.value, defined)
                self.target(node.target, defined, node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            self.expr(node.iter, defined)
            inner = set(defined)
            self.target(node.target, inner, node.iter)
            for name, roots in _item_views(node.target, node.iter, self.aliases,
                                           self.views).items():
                self.views[name] = roots
            # As a notebook's author reads it: an inner loop runs at least once.
            after = self.block(node.body, inner)
            self.block(node.orelse, set(defined))
            return after if after is not None else defined
        elif isinstance(node, ast.While):
            self.expr(node.test, defined)
            after = self.block(node.body, set(defined))
            self.block(node.orelse, set(defined))
            return after if after is not None else defined
        elif isinstance(node, ast.If):
            self.expr(node.test, defined)
            return self._branches([node.body, node.orelse], defined)
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                self.expr(item.context_expr, defined)
                if item.optional_vars is not None:
                    self.target(item.optional_vars, defined, item.context_expr)
            return self.block(node.body, defined)
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            tried = cast(ast.Try, node)  # try/except*: the same fields
            body = self.block([*tried.body, *tried.orelse], set(defined))
            handlers = [self.block(h.body, set(defined) | ({h.name} if h.name else set()))
                        for h in tried.handlers]
            reached = [o for o in [body, *handlers] if o is not None]
            after = set.intersection(*reached) if reached else None
            return self.block(tried.finalbody, after if after is not None else set(defined))
        elif isinstance(node, ast.Match):
            self.expr(node.subject, defined)
            return self._branches([c.body for c in node.cases] + [[]], defined)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for expr in node.decorator_list:
                self.expr(expr, defined)
            self._write(node.name, line, defined, value=node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                self._write((alias.asname or alias.name).split(".")[0], line, defined,
                            value=node)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self._write(target.id, line, None, verb="deletes")
                    defined.discard(target.id)
                else:
                    self.target(target, defined, None)
        elif isinstance(node, (ast.Return, ast.Raise, ast.Break, ast.Continue)):
            for child in ast.iter_child_nodes(node):
                self.expr(child, defined)
            return None
        else:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child, defined)
        return defined

    def target(self, node: ast.AST, defined: set[str], value: ast.AST | None) -> None:
        if isinstance(node, ast.Name):
            self._write(node.id, node.lineno, defined, value=value)
            roots = view_roots(value, self.aliases, self.views) if isinstance(
                value, ast.expr) and not isinstance(value, ast.Name) else frozenset()
            if roots:
                self.views[node.id] = roots
            else:
                self.views.pop(node.id, None)
        elif isinstance(node, (ast.Tuple, ast.List)):
            # a, b = x, y: each name gets its own value
            pairs = isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(
                node.elts) and not any(isinstance(e, ast.Starred) for e in node.elts)
            for i, element in enumerate(node.elts):
                self.target(element, defined, value.elts[i] if pairs else value)  # type: ignore[union-attr]
        elif isinstance(node, ast.Starred):
            self.target(node.value, defined, value)
        elif isinstance(node, (ast.Subscript, ast.Attribute)):
            # xs[i] = v, obj.attr = v: changes the object xs names
            base = base_name(node)
            self.expr(node, defined, store=True)
            if base is not None:
                self._change(base, node.lineno, defined, how=f"{ast.unparse(node)} = ...")

    def expr(self, node: ast.AST, defined: set[str], store: bool = False,
             local: frozenset[str] = frozenset()) -> None:
        """Reads in ``node``, in evaluation order; ``local``: names of a comprehension
        or lambda around it."""
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in local:
                self._read(node.id, node.lineno, defined)
            return
        if isinstance(node, ast.NamedExpr):
            self.expr(node.value, defined, local=local)
            self._write(node.target.id, node.lineno, defined, value=node.value)
            return
        if isinstance(node, ast.Lambda):
            params = {a.arg for a in [*node.args.posonlyargs, *node.args.args,
                                      *node.args.kwonlyargs, *filter(None, [
                                          node.args.vararg, node.args.kwarg])]}
            self.expr(node.body, defined, local=local | params)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            targets = frozenset(n.id for g in node.generators for n in ast.walk(g.target)
                                if isinstance(n, ast.Name))
            self.expr(node.generators[0].iter, defined, local=local)
            inner = local | targets
            for i, gen in enumerate(node.generators):
                if i:
                    self.expr(gen.iter, defined, local=inner)
                for cond in gen.ifs:
                    self.expr(cond, defined, local=inner)
            for part in ([node.key, node.value] if isinstance(node, ast.DictComp)
                         else [node.elt]):
                self.expr(part, defined, local=inner)
            return
        if isinstance(node, ast.Call):
            self._call(node, defined, local)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.expr, ast.keyword, ast.comprehension, ast.arguments)):
                self.expr(child, defined, local=local)

    def _call(self, node: ast.Call, defined: set[str], local: frozenset[str]) -> None:
        func = node.func
        changed: list[str] = []
        verb = "changes"
        full = dotted(func, self.aliases)
        if full is not None:
            # A module's function: torch._foreach_lerp_(xs, ...) and
            # nn.utils.clip_grad_norm_(model.parameters(), ...) change their first
            # argument, random.shuffle(xs) shuffles it.
            if node.args and (_in_place(full.rpartition(".")[2]) or full in (
                    "random.shuffle", "numpy.random.shuffle")):
                changed = _changed_by(node.args[0], self.aliases, self.views)
        elif isinstance(func, ast.Attribute) and (func.attr in _MUTATORS
                                                  or _in_place(func.attr)):
            # xs.append(v), sched.step(), ema_p.mul_(d), state[k].add_(v)
            base = base_name(func.value)
            if base is not None and base not in self.aliases:
                changed = [base]
            verb = "steps" if func.attr == "step" else "changes"
        elif isinstance(func, ast.Attribute) and func.attr == "shuffle" and node.args:
            changed = _changed_by(node.args[0], self.aliases, self.views)  # rng.shuffle(xs)
        elif isinstance(func, ast.Name) and func.id == "next" and node.args and \
                isinstance(node.args[0], ast.Name):
            changed = [node.args[0].id]
            verb = "advances"
        elif isinstance(func, ast.Name) and func.id not in local:
            # train_step() that says `global step_count; step_count += 1`
            for name in sorted(self.globals_of(func.id)):
                self._read(name, node.lineno, defined)
                self._write(name, node.lineno, None, verb="changes")
                self.via.setdefault(name, f"{func.id}()")
        how = f"{ast.unparse(func)}()"
        for name in changed:
            if name not in local:
                self._change(name, node.lineno, defined, verb=verb, how=how)


# -- names ----------------------------------------------------------------------------------

def import_names(tree: ast.AST, namespace: Mapping[str, Any]) -> dict[str, str]:
    """name -> the module or function it is (``np`` -> ``numpy``, ``F`` ->
    ``torch.nn.functional``, ``randint`` -> ``torch.randint``): the notebook's modules,
    then the code's own imports."""
    aliases = {name: value.__name__ for name, value in namespace.items()
               if isinstance(value, types.ModuleType)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if alias.name != "*":
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def dotted(node: ast.AST, aliases: Mapping[str, str]) -> str | None:
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def base_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Subscript, ast.Attribute)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def view_roots(node: ast.AST | None, aliases: Mapping[str, str],
               views: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """The variables whose objects ``node`` holds part of, so that changing what it
    gives in place changes them: ``model.fc.weight``, ``ema.parameters()``,
    ``list(ema.parameters())``, ``sd["w"]`` for a view ``sd``; empty for anything else
    (a bare variable, an index into data: a copy, or an expression's result)."""
    if isinstance(node, ast.Name):
        return views.get(node.id, frozenset())
    if isinstance(node, ast.Attribute):
        return _owner(node.value, aliases, views)
    if isinstance(node, ast.Subscript):
        return view_roots(node.value, aliases, views)
    if isinstance(node, ast.Starred):
        return view_roots(node.value, aliases, views)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in _VIEWS:
            return _owner(func.value, aliases, views)
        if isinstance(func, ast.Name) and func.id in _HOLDING:
            return frozenset().union(*(view_roots(a, aliases, views) for a in node.args))
        return frozenset()
    if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
        targets = {n.id for g in node.generators for n in ast.walk(g.target)
                   if isinstance(n, ast.Name)}
        if isinstance(node.elt, ast.Name) and node.elt.id in targets:
            return frozenset().union(*(view_roots(g.iter, aliases, views)
                                       for g in node.generators))
    return frozenset()


def _owner(node: ast.AST, aliases: Mapping[str, str],
           views: Mapping[str, frozenset[str]]) -> frozenset[str]:
    """The variable an attribute or a view method is taken of (``model`` in
    ``model.fc``), with what it views itself."""
    if isinstance(node, ast.Name):
        if node.id in aliases:
            return frozenset()  # a module: torch.nn, not an object of the cell
        return frozenset({node.id}) | views.get(node.id, frozenset())
    return view_roots(node, aliases, views)


def _changed_by(node: ast.AST, aliases: Mapping[str, str],
                views: Mapping[str, frozenset[str]]) -> list[str]:
    """The variables an in-place function changes when given ``node``."""
    if isinstance(node, ast.Name):
        return [] if node.id in aliases else [node.id]
    return sorted(view_roots(node, aliases, views))


def _item_views(target: ast.AST, iterable: ast.AST, aliases: Mapping[str, str],
                views: Mapping[str, frozenset[str]]) -> dict[str, frozenset[str]]:
    """For ``for target in iterable``: each target name's view roots (``for ema_p, p in
    zip(ema.parameters(), model.parameters())``: ema_p is a view of ema, p of model)."""
    if isinstance(target, ast.Name):
        return {target.id: view_roots(iterable, aliases, views)}
    if not isinstance(target, (ast.Tuple, ast.List)):
        return {}
    if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and \
            len(target.elts) == len(iterable.args) and not iterable.keywords and (
                iterable.func.id == "zip" or (iterable.func.id == "enumerate"
                                              and len(target.elts) == 2)):
        pairs = list(zip(target.elts, iterable.args, strict=True))
        if iterable.func.id == "enumerate":
            pairs = [(target.elts[1], iterable.args[0])]
        found: dict[str, frozenset[str]] = {}
        for element, arg in pairs:
            found.update(_item_views(element, arg, aliases, views))
        return found
    roots = view_roots(iterable, aliases, views)
    return {name: roots for name in target_names(target)}


def views_of(tree: ast.AST, aliases: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """The views the code assigns anywhere (``params = list(ema.parameters())``), as
    :func:`view_roots` sees them, followed through views of views."""
    pairs = [(t.id, n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and not isinstance(n.value, ast.Name) for t in n.targets
             if isinstance(t, ast.Name)]
    views: dict[str, frozenset[str]] = {}
    for _ in range(3):  # a view of a view of a view is as far as code goes
        for name, value in pairs:
            roots = view_roots(value, aliases, views) - {name}
            if roots:
                views[name] = views.get(name, frozenset()) | roots
    return views


def target_names(node: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(node) if isinstance(n, ast.Name)
            and isinstance(n.ctx, ast.Store)]
