"""Will a cell resume exactly? What its training loop carries that no checkpoint holds.

An interrupted job re-runs its cell from the top and ``restore()`` brings back what the
``spot.Checkpoint`` holds (and the global RNG states). Anything else the loop carries
from one iteration to the next starts again from the cell's code, and the resumed run
silently differs from the uninterrupted one. :func:`check_resume` reads the cell (never
runs it), finds the loops around its saves (``ckpt.maybe_save(step)``, ``ckpt.save``) and
reports, before launch:

* **loop-carried variables the checkpoint does not hold**: a variable assigned (or
  changed in place: ``xs.append``, ``d[k] = v``, ``next(it)``, ``sched.step()``) in the
  loop and read in the next iteration before it is assigned again: a best loss, a
  running average, a prefetched batch, an iterator. Not reported: a loop's own target
  (``for step in range(...)``), a value assigned before it is read in each iteration
  (a per-step ``loss``), what the checkpoint holds (``spot.Checkpoint(..., best=best)``:
  it follows the variable, :mod:`spotnb.train.cellvars`), what derives from
  ``restore()``'s step, clock readings (``t0 = time.time()``) and progress bars.
* **a draw from the global RNG between the save point and the loop's next step**
  (``torch.randint``/``torch.rand*``/``random.*``/``np.random.*`` without a generator, or a
  call of a function of the cell or the notebook that makes one, as far as its source
  shows): the checkpoint holds the RNG before the draw, and the resumed run does not
  make it.
* **a loop that starts over**: one that iterates over something other than a
  ``range`` from ``restore()``'s step or an object the checkpoint holds (a data loader
  not registered) begins again at its first item after a resume.
* **a registration under another name** (``spot.Checkpoint(best=best_val_loss)``) of a
  variable the loop assigns: the checkpoint holds the object it was given.

Each :class:`Finding` names the variables, the lines and the fix.
:func:`resume_warning` puts them in one line that the notebook prints first.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from spotnb.client.loopflow import LoopFlow, dotted, import_names, last_name, target_names

__all__ = ["Finding", "check_resume", "resume_warning"]


@dataclasses.dataclass(frozen=True)
class Finding:
    """One reason the cell would not resume exactly: what, where, and the fix."""

    line: int
    text: str


def resume_warning(findings: Sequence[Finding]) -> str | None:
    """The findings as one warning, or None when there is none."""
    if not findings:
        return None
    return ("this cell will not resume exactly after an interruption: "
            + "; ".join(f.text for f in sorted(findings, key=lambda f: f.line))
            + ". Fix the cell, or run it as it is if these values need not survive "
            "an interruption")


def check_resume(code: str | ast.Module, namespace: Mapping[str, Any] | None = None
                 ) -> list[Finding]:
    """Why ``code`` (a cell: IPython source, or parsed) would not resume exactly.

    ``namespace`` holds what the cell reads from the notebook (its inputs): the
    notebook's modules and functions, whose source is read for RNG draws.
    """
    if isinstance(code, str):
        from IPython.core.inputtransformer2 import TransformerManager

        try:
            tree = ast.parse(TransformerManager().transform_cell(code))
        except SyntaxError:
            return []
    else:
        tree = code
    return _Check(tree, namespace or {}).run()


# -- what the global RNG is -------------------------------------------------------------

# The functions of `random` that use its hidden global instance.
_RANDOM = frozenset({
    "random", "uniform", "triangular", "randint", "choice", "randrange", "sample",
    "shuffle", "choices", "normalvariate", "lognormvariate", "expovariate",
    "vonmisesvariate", "gammavariate", "gauss", "betavariate", "paretovariate",
    "weibullvariate", "getrandbits", "randbytes", "binomialvariate", "seed", "setstate"})
# numpy.random's names that are not its legacy global state.
_NUMPY_OWN_STATE = frozenset({
    "default_rng", "Generator", "RandomState", "SeedSequence", "BitGenerator", "PCG64",
    "PCG64DXSM", "MT19937", "Philox", "SFC64", "get_state", "get_bit_generator"})
_TORCH = frozenset({
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "normal", "bernoulli", "multinomial", "poisson", "dropout", "manual_seed", "seed",
    "set_rng_state", "feature_dropout", "alpha_dropout"})
_TORCH_MODULES = ("torch.nn.functional.", "torch.nn.init.", "torch.cuda.", "torch.random.")
_TORCH_NOT_DRAWS = frozenset({"calculate_gain", "zeros_", "ones_", "constant_", "eye_",
                              "dirac_", "get_rng_state", "initial_seed", "is_available",
                              "device_count", "synchronize", "get_rng_state_all",
                              "current_device", "set_device", "empty_cache", "fork_rng"})
# In-place draws of a tensor: x.uniform_(), x.normal_(), ...
_TENSOR_DRAWS = frozenset({"random_", "uniform_", "normal_", "bernoulli_", "exponential_",
                           "geometric_", "cauchy_", "log_normal_"})


def _global_draw(dotted: str | None, call: ast.Call) -> str | None:
    """The name of the global-RNG function ``call`` calls (``torch.randint``), or None."""
    if any(k.arg == "generator" for k in call.keywords):
        return None
    if dotted is None:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in _TENSOR_DRAWS:
            return f".{func.attr}()"
        return None
    module, _, name = dotted.rpartition(".")
    if module == "random" and name in _RANDOM:
        return dotted
    if module == "numpy.random" and name not in _NUMPY_OWN_STATE:
        return dotted.replace("numpy.", "np.", 1)
    if module == "torch" and name in _TORCH:
        return dotted
    if any(dotted.startswith(prefix) for prefix in _TORCH_MODULES) and \
            name not in _TORCH_NOT_DRAWS and ("dropout" in name or name.endswith("_")
                                              or "seed" in name):
        return dotted
    return None


# Progress bars: their state is the display's.
_PROGRESS = frozenset({"tqdm", "trange"})


# -- the check ------------------------------------------------------------------------------

class _Check:
    def __init__(self, tree: ast.Module, namespace: Mapping[str, Any]) -> None:
        self.tree = tree
        self.namespace = namespace
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
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
        self.restored = self._from_restore()
        # A registration inside a function: the checkpoint cannot follow its variables.
        self.in_function = any(
            isinstance(a, (ast.FunctionDef, ast.AsyncFunctionDef))
            for call in self.registrations for a in self._ancestors(call))
        self._draws: dict[str, str | None] = {}
        self._bodies: dict[str, tuple[list[ast.stmt], Mapping[str, str]]] = {}

    def run(self) -> list[Finding]:
        saves = [n for n in ast.walk(self.tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and (
                     n.func.attr == "maybe_save" or (
                         n.func.attr == "save" and isinstance(n.func.value, ast.Name)
                         and n.func.value.id in self.checkpoints))]
        if not saves or not self.registrations:
            return []
        findings: dict[tuple[int, str], Finding] = {}
        for save in saves:
            loops = self._loops_around(save)
            if not loops:
                continue
            for finding in [*self._carried(loops), *self._draws_after(save, loops),
                            *self._starts_over(loops[0])]:
                findings.setdefault((finding.line, finding.text), finding)
        return sorted(findings.values(), key=lambda f: (f.line, f.text))

    # What the checkpoint holds.

    def _from_restore(self) -> set[str]:
        """Names assigned from ``restore()``'s step, or from such names."""
        derived: set[str] = set()
        assignments = [(t, n.value) for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                       for t in n.targets]
        assignments += [(n.target, n.iter) for n in ast.walk(self.tree)
                        if isinstance(n, (ast.For, ast.AsyncFor))]
        changed = True
        while changed:
            changed = False
            for target, value in assignments:
                if not self._restored_value(value, derived):
                    continue
                for name in target_names(target):
                    if name not in derived:
                        derived.add(name)
                        changed = True
        return derived

    def _restored_value(self, value: ast.AST, derived: set[str]) -> bool:
        for node in ast.walk(value):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "restore":
                return True
            if isinstance(node, ast.Name) and node.id in derived:
                return True
        return False

    def _held(self, name: str, assigned: set[str]) -> bool:
        """Whether the checkpoint holds ``name``'s value at each save (``assigned``: the
        names the loop rebinds)."""
        if name in self.restored or name in self.checkpoints or name in self.updated:
            return True
        if self.registered.get(name) == name:
            # k=k follows the variable, at the cell's top level (spotnb.train.cellvars)
            return not self.in_function or name not in assigned
        # opt=optimizer: the object given, changed in place (a rebinding is reported)
        return name in self.registered.values() and name not in assigned

    # Where a save is.

    def _loops_around(self, node: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
        """The loops around ``node`` in its own scope, innermost first."""
        loops: list[ast.For | ast.AsyncFor | ast.While] = []
        parent = self.parents.get(node)
        while parent is not None and not isinstance(
                parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            if isinstance(parent, (ast.For, ast.AsyncFor, ast.While)) and \
                    _in_body(node, parent, self.parents):
                loops.append(parent)
            node, parent = parent, self.parents.get(parent)
        return loops

    # Loop-carried variables.

    def _carried(self, loops: list[ast.For | ast.AsyncFor | ast.While]) -> Iterator[Finding]:
        reported: set[str] = set()
        for loop in loops:
            flow = LoopFlow(self.aliases, self._globals_assigned)
            start: set[str] = set()
            if isinstance(loop, (ast.For, ast.AsyncFor)):
                start = set(target_names(loop.target))
            else:
                flow.expr(loop.test, start)
            flow.block(loop.body, start)
            skipped = flow.clocks() | self._progress_bars() | set(self.functions) | reported
            renamed = sorted(
                (key, var) for key, var in self.registered.items()
                if var is not None and var != key and var in flow.assigned
                and var not in reported)
            if renamed:
                text = ", ".join(f"{key}={var}" for key, var in renamed)
                own = ", ".join(f"{var}={var}" for _, var in renamed)
                yield Finding(loop.lineno, (
                    f"spot.Checkpoint({text}) holds the object given at registration, and "
                    f"the loop at line {loop.lineno} assigns "
                    f"{_names([var for _, var in renamed])} again: a checkpoint follows a "
                    f"variable registered under its own name; register "
                    f"spot.Checkpoint(..., {own})"))
                skipped |= {var for _, var in renamed}
            carried = sorted(
                name for name in flow.exposed.keys() & flow.written.keys()
                if name not in skipped and not self._held(name, flow.assigned))
            if not carried:
                continue
            reported.update(carried, (var for _, var in renamed))
            iterators = [n for n in carried if flow.verbs[n] == "advances"]
            for name in iterators:
                yield Finding(flow.written[name], (
                    f"{name} is an iterator the loop at line {loop.lineno} advances "
                    f"(line {flow.written[name]}): a resumed run makes it again and starts "
                    f"at its first item: loop over the data loader itself and register the "
                    f"loader in the Checkpoint, or compute each batch from the step"))
            carried = [n for n in carried if n not in iterators]
            if not carried:
                continue
            example = carried[0]
            if flow.verbs[example] == "assigns":
                how = (f"line {flow.exposed[example]} reads it before the iteration assigns "
                       f"it at line {flow.written[example]}")
            else:
                through = f" through {flow.via[example]}" if example in flow.via else ""
                how = (f"line {flow.written[example]} {flow.verbs[example]} it{through} in "
                       "every iteration")
            them = "them" if len(carried) > 1 else "it"
            fix = (f"register {them} in the Checkpoint (spot.Checkpoint(..., "
                   + ", ".join(f"{n}={n}" for n in carried) + "))")
            if self.in_function:
                fix += (" at the cell's top level (a checkpoint cannot follow the variables "
                        "of a function)")
            yield Finding(loop.lineno, (
                f"{_names(carried)} {'are' if len(carried) > 1 else 'is'} carried from one "
                f"iteration of the loop at line {loop.lineno} to the next ({example}: {how}) "
                f"and the checkpoint does not hold {them}: {fix}"))

    def _globals_assigned(self, name: str) -> set[str]:
        """The global variables the cell's or the notebook's function ``name`` assigns
        (``global n``, then ``n = ...``/``n += ...``), as far as its source shows."""
        body, _ = self._function_body(name)
        declared = {n for stmt in body for node in _walk_scope(stmt)
                    if isinstance(node, ast.Global) for n in node.names}
        return {node.id for stmt in body for node in _walk_scope(stmt)
                if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del))
                and node.id in declared}

    def _progress_bars(self) -> set[str]:
        return {t.id for n in ast.walk(self.tree) if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Call) and last_name(n.value.func) in _PROGRESS
                for t in n.targets if isinstance(t, ast.Name)}

    def _ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        parent = self.parents.get(node)
        while parent is not None:
            yield parent
            parent = self.parents.get(parent)

    # Global RNG draws after the save.

    def _draws_after(self, save: ast.Call, loops: list[ast.For | ast.AsyncFor | ast.While]
                     ) -> Iterator[Finding]:
        """Draws from the global RNG between the save and the loop's next step: after
        the save in the innermost loop's body, and anywhere in the outer loops' bodies
        besides the inner loop (they run between one save and the next step)."""
        tail: list[ast.stmt] = []
        node: ast.AST = save
        parent = self.parents.get(node)
        while parent is not None and node is not loops[0]:
            for block in _blocks(parent):
                if node in block:
                    tail += block[block.index(node) + 1:]
            node, parent = parent, self.parents.get(parent)
        for inner, outer in itertools.pairwise(loops):
            holder = _child_holding(inner, outer.body, self.parents)
            tail += [s for s in outer.body if s is not holder]
        for stmt in tail:
            for call in _calls(stmt):
                what = self._draw(call, self.aliases)
                if what:
                    yield Finding(call.lineno, (
                        f"line {call.lineno} draws from the global RNG ({what}) after the "
                        f"checkpoint is saved (line {save.lineno}) and before the loop's next "
                        f"step, so a resumed run starts that step without the draw: move the "
                        f"draw before the save (to the top of the loop's body), or draw from "
                        f"a torch.Generator that the Checkpoint holds"))
                    break

    def _draw(self, call: ast.Call, aliases: Mapping[str, str],
              seen: frozenset[str] = frozenset()) -> str | None:
        """What global-RNG function ``call`` calls, itself or in a function of the cell
        or the notebook that it calls (as far as the source shows)."""
        direct = _global_draw(dotted(call.func, aliases), call)
        if direct:
            return direct
        if not isinstance(call.func, ast.Name) or call.func.id in seen:
            return None
        name = call.func.id
        if name not in self._draws:
            self._draws[name] = None
            body, inner_aliases = self._function_body(name)
            for inner in (c for stmt in body for c in _calls(stmt)):
                found = self._draw(inner, inner_aliases, seen | {name})
                if found:
                    self._draws[name] = f"{found.split(' in ')[0]} in {name}()"
                    break
        return self._draws[name]

    def _function_body(self, name: str) -> tuple[list[ast.stmt], Mapping[str, str]]:
        """The body of the cell's or the notebook's function ``name`` and the names of
        modules it sees; nothing for any other name."""
        if name not in self._bodies:
            self._bodies[name] = self._read_function(name)
        return self._bodies[name]

    def _read_function(self, name: str) -> tuple[list[ast.stmt], Mapping[str, str]]:
        if name in self.functions:
            return self.functions[name].body, self.aliases
        value = self.namespace.get(name)
        if not isinstance(value, types.FunctionType):
            return [], self.aliases
        func = inspect.unwrap(value)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
        except (OSError, TypeError, SyntaxError, ValueError):
            return [], self.aliases  # no source (a lambda's line, a function built in code)
        defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        if not defs:
            return [], self.aliases
        return defs[0].body, import_names(tree, getattr(func, "__globals__", {}))

    # A loop that starts over.

    def _starts_over(self, loop: ast.For | ast.AsyncFor | ast.While) -> Iterator[Finding]:
        if not isinstance(loop, (ast.For, ast.AsyncFor)):
            return
        names = {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}
        if self._restored_value(loop.iter, self.restored) or \
                names & (set(self.registered) | set(v for v in self.registered.values() if v)) \
                or self.opaque:
            return
        what = ast.unparse(loop.iter)
        fix = ("loop over range(ckpt.restore(), N)" if any(
            last_name(c.func) == "range" for c in _calls(loop.iter))
               else "register the data loader in the Checkpoint, or loop over "
                    "range(ckpt.restore(), N)")
        yield Finding(loop.lineno, (
            f"the loop at line {loop.lineno} goes over {what} from its first item every time "
            f"the cell runs, so after a resume it starts over instead of continuing after "
            f"the step saved: {fix}"))


# -- helpers ----------------------------------------------------------------------------------

def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _in_body(node: ast.AST, loop: ast.AST, parents: Mapping[ast.AST, ast.AST]) -> bool:
    """Whether ``node`` (a descendant of ``loop``) is in its body, not its header."""
    while parents.get(node) is not loop:
        node = parents[node]
    return node in getattr(loop, "body", ())


def _child_holding(node: ast.AST, body: list[ast.stmt], parents: Mapping[ast.AST, ast.AST]
                   ) -> ast.AST | None:
    """The statement of ``body`` that ``node`` is in."""
    current: ast.AST | None = node
    while current is not None and current not in body:
        current = parents.get(current)
    return current


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
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


def _walk_scope(node: ast.AST) -> Iterator[ast.AST]:
    """``node`` and what is below it, not inside the functions and classes defined in it."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        if current is node or not isinstance(
                current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            todo.extend(ast.iter_child_nodes(current))


def _calls(node: ast.AST) -> Iterator[ast.Call]:
    """The calls in ``node`` in source order, not those in functions defined in it."""
    todo = [node]
    found = []
    while todo:
        current = todo.pop()
        if isinstance(current, ast.Call):
            found.append(current)
        if isinstance(current, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                ast.ClassDef)) and current is not node:
            continue
        todo.extend(ast.iter_child_nodes(current))
    yield from sorted(found, key=lambda c: (c.lineno, c.col_offset))
