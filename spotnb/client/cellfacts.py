"""What a cell registers, restores and calls: the facts the resume check reads.

:class:`CellFacts` reads a ``%%spot_train`` cell (never runs it): the ``spot.Checkpoint``
registrations and what they hold (an object changed in place, a variable followed by
name: :mod:`spotnb.train.cellvars`), the names derived from ``restore()``'s step, the
data loaders, and the saves (``ckpt.maybe_save``, ``ckpt.save``), in the cell or in a
function of the cell or the notebook that the cell calls (its source read, its
parameters bound to the call's arguments: a :class:`Scope`). :mod:`spotnb.client.carried`
checks the loops around those saves.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import types
from collections.abc import Iterator, Mapping
from typing import Any

from spotnb.client.loopflow import dotted, import_names, last_name, target_names, views_of
from spotnb.client.rngdraws import global_draw

__all__ = ["CellFacts", "Loop", "Scope", "blocks", "calls", "child_holding", "walk_scope"]

Loop = ast.For | ast.AsyncFor | ast.While
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
# How deep the check follows saves into the functions the cell calls.
_CALL_DEPTH = 3
# Progress bars: their state is the display's.
_PROGRESS = frozenset({"tqdm", "trange"})


@dataclasses.dataclass(eq=False)
class Scope:
    """Code a save is in: the cell's top level, or a function the cell calls (defined
    in the cell, or in the notebook: its source's lines are its own cell's)."""

    body: ast.AST  # the cell's module, or the function's definition
    aliases: Mapping[str, str]
    name: str | None = None  # the function's name
    caller: Scope | None = None
    call: ast.Call | None = None  # the call of the function, in ``caller``
    bindings: dict[str, ast.expr] = dataclasses.field(default_factory=dict)
    local_names: frozenset[str] = frozenset()
    restored: set[str] = dataclasses.field(default_factory=set)
    views: dict[str, frozenset[str]] = dataclasses.field(default_factory=dict)

    def loop(self, loop: Loop) -> str:
        """How a finding names ``loop``."""
        return f"the loop at line {loop.lineno}" + (f" in {self.name}()" if self.name else "")


class CellFacts:
    """The facts of one cell (see the module docstring)."""

    def __init__(self, tree: ast.Module, namespace: Mapping[str, Any],
                 outputs: frozenset[str]) -> None:
        self.tree = tree
        self.namespace = namespace
        self.outputs = outputs
        self.parents: dict[ast.AST, ast.AST] = {}
        self._link(tree)
        self.aliases = import_names(tree, namespace)
        self.functions = {n.name: n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        self.registrations = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
                              and last_name(n.func) == "Checkpoint"]
        self.checkpoints = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                            and isinstance(n.value, ast.Call) and n.value in self.registrations
                            for t in n.targets if isinstance(t, ast.Name)}
        # keyword -> the variable registered under it (None: an expression)
        self.registered: dict[str, str | None] = {}
        self.opaque = False  # spot.Checkpoint(**state): what it holds is not known here
        for call in self.registrations:
            for kw in call.keywords:
                if kw.arg is None:
                    self.opaque = True
                elif kw.arg != "host_memory":
                    self.registered[kw.arg] = kw.value.id if isinstance(
                        kw.value, ast.Name) else None
        # ckpt["name"] = value: the cell updates the checkpoint itself.
        self.updated = {n.value.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
                        and isinstance(n.value, ast.Name) and any(
                            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name)
                            and t.value.id in self.checkpoints for t in n.targets)}
        # A registration inside a function: the checkpoint cannot follow its variables.
        self.in_function = any(
            isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))
            for call in self.registrations for a in self._ancestors(call))
        self.loaders = self._loaders()
        # Loaders that draw their epoch's seeds from a generator of their own.
        self.seeded = {name for name, value in self.namespace.items()
                       if name in self.loaders and getattr(value, "generator", None)
                       is not None} | {
            t.id for n in ast.walk(tree) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Call)
            and any(k.arg == "generator" for k in n.value.keywords)
            for t in n.targets if isinstance(t, ast.Name)}
        self.cell = Scope(tree, self.aliases)
        self.cell.restored = self.from_restore(tree, set())
        self.cell.views = views_of(tree, self.aliases)
        self._draws: dict[str, str | None] = {}
        self._bodies: dict[str, tuple[list[ast.stmt], Mapping[str, str]]] = {}
        self._parsed: dict[str, ast.FunctionDef | ast.AsyncFunctionDef | None] = {}

    def _link(self, tree: ast.AST) -> None:
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node

    # Where the saves are.

    def saves(self, scope: Scope, depth: int) -> Iterator[tuple[Scope, ast.Call]]:
        """(scope, save call) for every save in ``scope`` and in the functions it calls."""
        for node in walk_scope(scope.body):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            given = {p for p, a in scope.bindings.items()
                     if isinstance(a, ast.Name) and a.id in self.checkpoints}
            if isinstance(func, ast.Attribute) and (func.attr == "maybe_save" or (
                    func.attr == "save" and isinstance(func.value, ast.Name)
                    and func.value.id in self.checkpoints | given)):
                yield scope, node
            elif isinstance(func, ast.Name) and depth < _CALL_DEPTH and \
                    func.id not in scope.local_names:
                inner = self._callee(func.id, node, scope)
                if inner is not None:
                    yield from self.saves(inner, depth + 1)

    def _callee(self, name: str, call: ast.Call, caller: Scope) -> Scope | None:
        """The scope of the function ``name`` that ``call`` calls (of the cell, or of
        the notebook from its source), bound to the call's arguments."""
        definition = self.functions.get(name) if caller is self.cell or \
            caller.body in self.functions.values() else None
        aliases: Mapping[str, str] = self.aliases
        if definition is None:
            definition, aliases = self._notebook_function(name)
        if definition is None:
            return None
        return self._function_scope(definition, call, caller, aliases)

    def _notebook_function(self, name: str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef
                                                     | None, Mapping[str, str]]:
        value = self.namespace.get(name)
        if not isinstance(value, types.FunctionType):
            return None, self.aliases
        if name not in self._parsed:
            self._parsed[name] = _parse_function(value)
            if self._parsed[name] is not None:
                self._link(self._parsed[name])  # type: ignore[arg-type]
        return self._parsed[name], import_names(
            self._parsed[name] or ast.Module([], []), getattr(value, "__globals__", {}))

    def _function_scope(self, definition: ast.FunctionDef | ast.AsyncFunctionDef,
                        call: ast.Call | None, caller: Scope,
                        aliases: Mapping[str, str]) -> Scope:
        params = [a.arg for a in [*definition.args.posonlyargs, *definition.args.args,
                                  *definition.args.kwonlyargs]]
        bindings: dict[str, ast.expr] = {}
        if call is not None:
            bindings.update({p: a for p, a in zip(params, call.args, strict=False)
                             if not isinstance(a, ast.Starred)})
            bindings.update({k.arg: k.value for k in call.keywords
                             if k.arg in params})
        declared = {n for node in walk_scope(definition) if isinstance(node, ast.Global)
                    for n in node.names}
        assigned = {n.id for node in walk_scope(definition) for n in ast.walk(node)
                    if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        scope = Scope(definition, aliases, definition.name, caller, call, bindings,
                       frozenset(params) | (assigned - declared))
        seeds = {p for p, arg in bindings.items()
                 if self.restored_value(arg, caller.restored)}
        scope.restored = self.from_restore(definition, seeds)
        scope.views = views_of(definition, aliases)
        return scope

    # What the checkpoint holds.

    def from_restore(self, tree: ast.AST, seeds: set[str]) -> set[str]:
        """Names assigned from ``restore()``'s step (or ``ckpt["name"]``), or from such
        names (``seeds``: names known to be such already)."""
        derived = set(seeds)
        assignments = [(t, n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                       for t in n.targets]
        assignments += [(n.target, n.iter) for n in ast.walk(tree)
                        if isinstance(n, (ast.For, ast.AsyncFor))]
        changed = True
        while changed:
            changed = False
            for target, value in assignments:
                if not self.restored_value(value, derived):
                    continue
                for name in target_names(target):
                    if name not in derived:
                        derived.add(name)
                        changed = True
        return derived

    def restored_value(self, value: ast.AST, derived: set[str]) -> bool:
        for node in ast.walk(value):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "restore":
                return True
            if isinstance(node, ast.Name) and node.id in derived:
                return True
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and \
                    node.value.id in self.checkpoints:
                return True
        return False

    def held(self, name: str, assigned: set[str], scope: Scope) -> bool:
        """Whether the checkpoint holds ``name``'s value at each save (``assigned``: the
        names the loop rebinds), in ``scope``."""
        if name in scope.restored:
            return True
        if scope.views.get(name):
            return True  # a view: what it views is what matters (and is checked)
        if scope.name is not None and name in scope.local_names:
            if name in scope.bindings and name not in assigned:
                argument = scope.bindings[name]
                return isinstance(argument, ast.Name) and scope.caller is not None and \
                    self.held(argument.id, set(), scope.caller)
            # A checkpoint registered in this function holds the objects given to it.
            return self.in_function and name in self.registered.values() and \
                name not in assigned and scope.body in self.functions.values()
        if name in self.checkpoints or name in self.updated:
            return True
        if self.registered.get(name) == name:
            # k=k follows the variable, at the cell's top level (spotnb.train.cellvars)
            return not self.in_function or name not in assigned
        # opt=optimizer: the object given, changed in place (a rebinding is reported)
        return name in self.registered.values() and name not in assigned

    def registered_object(self, name: str, scope: Scope) -> bool:
        """Whether ``name`` (in ``scope``) is an object given to the Checkpoint."""
        if scope.name is not None and name in scope.local_names:
            argument = scope.bindings.get(name)
            return isinstance(argument, ast.Name) and scope.caller is not None and \
                self.registered_object(argument.id, scope.caller)
        return name in self.registered or name in self.registered.values()

    def _loaders(self) -> set[str]:
        """Names of data loaders: the notebook's, and those the cell makes."""
        found = {name for name, value in self.namespace.items()
                 if any(c.__name__.endswith("DataLoader") for c in type(value).__mro__)}
        found |= {t.id for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Call)
                  and (last_name(n.value.func) or "").lower().endswith("loader")
                  for t in n.targets if isinstance(t, ast.Name)}
        return found

    def registered_loader(self, node: ast.AST, scope: Scope) -> bool:
        """Whether ``node`` names a data loader the Checkpoint holds (it resumes
        mid-epoch: spotnb.train.loaders)."""
        if not isinstance(node, ast.Name) or not self.registered_object(node.id, scope):
            return False
        while scope.name is not None and node.id in scope.local_names:
            argument, caller = scope.bindings.get(node.id), scope.caller
            if not isinstance(argument, ast.Name) or caller is None:
                return False
            node, scope = argument, caller
        return node.id in self.loaders

    # Where a save is.

    def loops_around(self, node: ast.AST) -> list[Loop]:
        """The loops around ``node`` in its own scope, innermost first."""
        loops: list[Loop] = []
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, _FUNCTIONS):
            if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)) and \
                    _in_body(node, parent, self.parents):
                loops.append(parent)
            node, parent = parent, self.parents.get(parent)
        return loops

    def after(self, loop: ast.AST) -> list[ast.stmt]:
        """The statements that run after ``loop`` in its scope, in order."""
        following: list[ast.stmt] = []
        node: ast.AST = loop
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, _FUNCTIONS):
            for block in blocks(parent):
                if node in block:
                    following += block[block.index(node) + 1:]
            node, parent = parent, self.parents.get(parent)
        return following

    def globals_assigned(self, name: str) -> set[str]:
        """The global variables the cell's or the notebook's function ``name`` assigns
        (``global n``, then ``n = ...``/``n += ...``), as far as its source shows."""
        body, _ = self._function_body(name)
        declared = {n for stmt in body for node in walk_scope(stmt)
                    if isinstance(node, ast.Global) for n in node.names}
        return {node.id for stmt in body for node in walk_scope(stmt)
                if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del))
                and node.id in declared}

    def progress_bars(self) -> set[str]:
        """The cell's progress bars (their state is the display's), and the notebook's."""
        return {t.id for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Call) and last_name(n.value.func) in _PROGRESS
                for t in n.targets if isinstance(t, ast.Name)} | {
            name for name, value in self.namespace.items()
            if type(value).__module__.split(".")[0] == "tqdm"}

    def _ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        parent = self.parents.get(node)
        while parent is not None:
            yield parent
            parent = self.parents.get(parent)

    def iterates_registered_loader(self, loop: Loop, scope: Scope) -> bool:
        if not isinstance(loop, (ast.For, ast.AsyncFor)):
            return False
        source = loop.iter
        if isinstance(source, ast.Call) and isinstance(source.func, ast.Name) and \
                source.func.id == "enumerate" and source.args:
            source = source.args[0]
        return self.registered_loader(source, scope)

    def draw(self, call: ast.Call, aliases: Mapping[str, str],
              seen: frozenset[str] = frozenset()) -> str | None:
        """What global-RNG function ``call`` calls, itself or in a function of the cell
        or the notebook that it calls (as far as the source shows)."""
        direct = global_draw(dotted(call.func, aliases), call)
        if direct:
            return direct
        if not isinstance(call.func, ast.Name) or call.func.id in seen:
            return None
        name = call.func.id
        if name not in self._draws:
            self._draws[name] = None
            body, inner_aliases = self._function_body(name)
            for inner in (c for stmt in body for c in calls(stmt)):
                found = self.draw(inner, inner_aliases, seen | {name})
                if found:
                    self._draws[name] = f"{found.split(' in ')[0]} in {name}()"
                    break
        return self._draws[name] or self._iterates_loader(name, call)

    def iterated_loader(self, nodes: list[ast.stmt]) -> str | None:
        """A data loader ``nodes`` iterate (``for x, y in val_loader``) that draws its
        seeds from torch's global RNG as each epoch of it starts (every DataLoader
        without a generator of its own: its workers' base seed, its shuffle), and that
        the checkpoint does not hold (a registered loader puts the RNGs back itself)."""
        for node in (n for stmt in nodes for n in walk_scope(stmt)):
            source = _iterated(node)
            if isinstance(source, ast.Name) and self._draws_when_iterated(source.id):
                return f"iterating {source.id}"
        return None

    def _iterates_loader(self, name: str, call: ast.Call) -> str | None:
        """:meth:`iterated_loader` in the body of the function ``call`` calls, its
        parameters read as the call's arguments (``evaluate(model, val_loader)``)."""
        definition = self.functions.get(name) or self._notebook_function(name)[0]
        if definition is None:
            return None
        params = [a.arg for a in [*definition.args.posonlyargs, *definition.args.args,
                                  *definition.args.kwonlyargs]]
        bound: dict[str, ast.expr] = dict(zip(params, call.args, strict=False))
        bound.update({k.arg: k.value for k in call.keywords if k.arg in params})
        for node in walk_scope(definition):
            source = _iterated(node)
            if not isinstance(source, ast.Name):
                continue
            argument = bound.get(source.id, None if source.id in params else source)
            if isinstance(argument, ast.Name) and self._draws_when_iterated(argument.id):
                return f"iterating {argument.id} in {name}()"
        return None

    def _draws_when_iterated(self, name: str) -> bool:
        return name in self.loaders and name not in self.seeded and \
            not self.registered_object(name, self.cell)

    def _function_body(self, name: str) -> tuple[list[ast.stmt], Mapping[str, str]]:
        """The body of the cell's or the notebook's function ``name`` and the names of
        modules it sees; nothing for any other name."""
        if name not in self._bodies:
            if name in self.functions:
                self._bodies[name] = (self.functions[name].body, self.aliases)
            else:
                definition, aliases = self._notebook_function(name)
                self._bodies[name] = (definition.body if definition else [], aliases)
        return self._bodies[name]


# -- helpers ------------------------------------------------------------------------------

def _parse_function(func: types.FunctionType) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """A notebook function's definition, its lines numbered as in its own cell."""
    try:
        lines, first = inspect.getsourcelines(inspect.unwrap(func))
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError, ValueError):
        return None  # no source (a lambda's line, a function built in code)
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if not defs:
        return None
    ast.increment_lineno(tree, max(first, 1) - 1)
    return defs[0]


def _in_body(node: ast.AST, loop: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` (a descendant of ``loop``) is in its body, not its header."""
    while parents.get(node) is not loop:
        node = parents[node]
    return node in getattr(loop, "body", ())


def child_holding(node: ast.AST, body: list[ast.stmt], parents: Mapping[ast.AST, ast.AST]
                   ) -> ast.AST:
    """The statement of ``body`` that ``node`` is in."""
    current = node
    while current not in body:
        current = parents[current]
    return current


def blocks(node: ast.AST) -> list[list[ast.stmt]]:
    blocks = []
    for field in ("body", "orelse", "finalbody"):
        value = getattr(node, field, None)
        if isinstance(value, list):
            blocks.append(value)
    for handler in getattr(node, "handlers", ()):
        blocks.append(handler.body)
    for case in getattr(node, "cases", ()):
        blocks.append(case.body)
    return blocks


def _iterated(node: ast.AST) -> ast.AST | None:
    """What ``node`` iterates: a for loop's or a comprehension's iterable, the argument
    of ``iter()``/``enumerate()``/``list()``/``tqdm()`` (itself, if one of these)."""
    source: ast.AST | None = None
    if isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
        source = node.iter
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("iter", "list", "next") and node.args:
        source = node.args[0]
    while isinstance(source, ast.Call) and last_name(source.func) in (
            "enumerate", "iter", "tqdm", "zip") and source.args:
        source = source.args[0]
    return source


def walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and what is below it, not inside the functions and classes defined in it."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        if current is node or not isinstance(current, _FUNCTIONS):
            todo.extend(ast.iter_child_nodes(current))


def calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node`` in source order, not those in functions defined in it."""
    found = [n for n in walk_scope(node) if isinstance(n, ast.Call)]
    yield from sorted(found, key=lambda c: (c.lineno, c.col_offset))

