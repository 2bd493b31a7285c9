"""Will a cell resume exactly? What its training loop carries that no checkpoint holds.

An interrupted job re-runs its cell from the top and ``restore()`` brings back what the
``spot.Checkpoint`` holds (and the global RNG states). Anything else the loop carries
from one iteration to the next starts again from the cell's code, and the resumed run
silently differs from the uninterrupted one. :func:`check_resume` reads the cell (never
runs it), finds the loops around its saves (``ckpt.maybe_save(step)``, ``ckpt.save``, in
the cell or in a function of the cell or the notebook that the cell calls) and reports,
before launch:

* **loop-carried state the checkpoint does not hold**: a variable assigned (or changed
  in place: ``xs.append``, ``d[k] = v``, ``next(it)``, ``sched.step()``, ``p.mul_(d)``,
  also through a view such as ``zip(ema.parameters(), ...)``) in the loop and read in the
  next iteration before it is assigned again: a best loss, a running average, a
  prefetched batch, an EMA of the weights, an iterator (unless it is ``iter()`` of a
  registered loader, made after ``restore()``). Not reported: a loop's own target, a
  value assigned before it is read in each iteration (a per-step ``loss``), what the
  checkpoint holds (``spot.Checkpoint(..., best=best)``: it follows the variable,
  :mod:`spotnb.train.cellvars`), what derives from ``restore()``'s step, clock readings
  (``t0 = time.time()``) and progress bars. A local variable of a function is never held.
* **a value the loop sets now and then and the code after it reads** (``best_state``
  saved when the accuracy improves, read after the loop or as an ``--out``): a run
  resumed after the last time it was set has the value from before the loop; and **a
  file the loop writes and the cell reads** (``torch.save(..., "best.pt")``), which a
  replacement instance does not have (unless under a ``spot.sync_dir``).
* **work between the save and the loop's next step**: a draw from the global RNG
  (``torch.randint``/``random.*``/``np.random.*`` without a generator, a call of a
  function of the cell or the notebook that makes one) and a change of state the
  checkpoint holds (``sched.step()``) after the save, which a resumed run does not make;
  in an outer loop (over epochs), the draws and changes at the start of each iteration,
  which a run resumed in the middle of it makes again, and those after the inner loop
  that saves, which a save at its last step skips (not for an inner loop over a loader
  registered in the Checkpoint: a save due there waits for the epoch's end).
* **a loop that starts over**: one over something other than a ``range`` from
  ``restore()``'s step or an object the checkpoint holds; and ``enumerate(loader)`` over
  a registered loader, whose count starts at 0 when the loader resumes mid-epoch.
* **a registration under another name** (``spot.Checkpoint(best=best_val_loss)``) of a
  variable the loop assigns: the checkpoint holds the object it was given.

Each :class:`Finding` names the variables, the lines and the fix.
:func:`resume_warning` puts them in one line that the notebook prints first.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

from spotnb.client.cellfacts import CellFacts, Loop, Scope, blocks, calls, child_holding, walk_scope
from spotnb.client.loopflow import LoopFlow, dotted, last_name, target_names

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


def check_resume(code: str | ast.Module, namespace: Mapping[str, Any] | None = None,
                 outputs: Collection[str] = ()) -> list[Finding]:
    """Why ``code`` (a cell: IPython source, or parsed) would not resume exactly.

    ``namespace`` holds what the cell reads from the notebook (its inputs): the
    notebook's modules and functions, whose source is read for saves and RNG draws.
    ``outputs``: the names the cell hands back to the notebook (``--out``).
    """
    if isinstance(code, str):
        from IPython.core.inputtransformer2 import TransformerManager

        try:
            tree = ast.parse(TransformerManager().transform_cell(code))
        except SyntaxError:
            return []
    else:
        tree = code
    return _Check(tree, namespace or {}, frozenset(outputs)).run()


class _Check(CellFacts):
    """The checks of the module docstring, over the facts of one cell."""

    def run(self) -> list[Finding]:
        if not self.registrations:
            return []
        findings: dict[tuple[int, str], Finding] = {}
        for found, saved in self.saves(self.cell, 0):
            scope: Scope | None = found
            save: ast.AST | None = saved
            inner: tuple[Loop, Scope] | None = None  # the loop that saves, in a callee
            while scope is not None and save is not None:
                loops = self.loops_around(save)
                if loops:
                    for finding in [*self._carried(loops, scope),
                                    *self._set_now_and_then(loops, scope),
                                    *self._files(loops[-1], scope),
                                    *self._between(save, loops, scope, inner),
                                    *self._starts_over(loops, scope),
                                    *self._enumerated(loops, scope)]:
                        findings.setdefault((finding.line, finding.text), finding)
                    inner = (loops[-1], scope)
                # The call of the function that saves is the save of its caller's loops.
                save = scope.call
                scope = scope.caller
        return sorted(findings.values(), key=lambda f: (f.line, f.text))

    def _flow(self, loop: Loop, scope: Scope) -> tuple[LoopFlow, set[str]]:
        """One iteration of ``loop``, and the names it assigns in every iteration."""
        flow = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
        start: set[str] = set()
        if isinstance(loop, (ast.For, ast.AsyncFor)):
            start = set(target_names(loop.target))
        else:
            flow.expr(loop.test, start)
        return flow, flow.block(loop.body, start) or set()

    def _skipped(self, flow: LoopFlow, scope: Scope) -> set[str]:
        return flow.clocks() | self.progress_bars() | set(self.functions) | {
            n for n in flow.written if n in scope.aliases}

    # Loop-carried variables.

    def _carried(self, loops: list[Loop], scope: Scope) -> Iterator[Finding]:
        reported: set[str] = set()
        for depth, loop in enumerate(loops):
            flow, _ = self._flow(loop, scope)
            skipped = self._skipped(flow, scope) | reported
            if depth:
                # Changed only at the start of an outer loop's iteration (before the loop
                # that saves): a resumed run does it again, registered or not.
                started = self._changed_at_start(loop, loops[depth - 1], flow, scope)
                for name, line in sorted(started.items()):
                    if name not in skipped:
                        reported.add(name)
                        yield Finding(line, (
                            f"{name} is changed at the start of each iteration of "
                            f"{scope.loop(loop)} (line {line}), from its value in the "
                            f"iteration before, and {scope.loop(loops[depth - 1])} saves "
                            f"inside: a run resumed in the middle of that loop starts from "
                            f"the value {name} had before the loop (or, registered in the "
                            f"Checkpoint, changes it twice): make it anew at the start of "
                            f"each iteration from the loop's variable ({_target(loop)}), "
                            f"not from its previous value"))
                skipped |= reported
            renamed = sorted(
                (key, var) for key, var in self.registered.items()
                if var is not None and var != key and var in flow.assigned
                and var not in reported and scope.name is None)
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
                if name not in skipped and not self.held(name, flow.assigned, scope))
            if not carried:
                continue
            reported.update(carried, (var for _, var in renamed))
            iterators = [n for n in carried if flow.verbs[n] == "advances"]
            for name in iterators:
                finding = self._iterator(name, loop, flow, scope)
                if finding is not None:
                    yield finding
            carried = [n for n in carried if n not in iterators]
            if carried:
                yield self._carried_finding(carried, loop, flow, scope,
                                            self._reset_at_start(loops, depth, scope))

    def _changed_at_start(self, outer: Loop, inner: Loop, flow: LoopFlow, scope: Scope
                          ) -> dict[str, int]:
        """Names carried across ``outer``'s iterations that only its statements before
        ``inner`` change (name -> line)."""
        holder = child_holding(inner, outer.body, self.parents)
        index = outer.body.index(holder)  # type: ignore[arg-type]
        before = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
        before.block(outer.body[:index], set())
        rest = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
        rest.block(outer.body[index:], set())
        carried = flow.exposed.keys() & flow.written.keys()
        return {n: line for n, line in before.written.items()
                if n in carried and n not in rest.written and not scope.views.get(n)
                and n not in scope.restored and not self.held(n, flow.assigned, scope)}

    def _reset_at_start(self, loops: list[Loop], depth: int, scope: Scope
                        ) -> dict[str, tuple[Loop, int]]:
        """Names an outer loop assigns at the start of its iterations, before the loop
        ``loops[depth]`` (a sum reset for each epoch): name -> (that loop, line)."""
        found: dict[str, tuple[Loop, int]] = {}
        for inner, outer in zip(loops[depth:], loops[depth + 1:], strict=False):
            holder = child_holding(inner, outer.body, self.parents)
            before = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
            before.block(outer.body[:outer.body.index(holder)], set())  # type: ignore[arg-type]
            for name in before.assigned:
                found.setdefault(name, (outer, before.written[name]))
        return found

    def _carried_finding(self, carried: list[str], loop: Loop, flow: LoopFlow,
                         scope: Scope, resets: Mapping[str, tuple[Loop, int]]) -> Finding:
        example = carried[0]
        if flow.verbs[example] == "assigns":
            how = (f"line {flow.exposed[example]} reads it before the iteration assigns "
                   f"it at line {flow.written[example]}")
        else:
            through = f" through {flow.via[example]}" if example in flow.via else ""
            how = (f"line {flow.written[example]} {flow.verbs[example]} it{through} in "
                   "every iteration")
        them = "them" if len(carried) > 1 else "it"
        registers = scope.name is not None and any(
            isinstance(n, ast.Call) and n in self.registrations for n in ast.walk(scope.body))
        locals_ = [n for n in carried if scope.name is not None and n in scope.local_names
                   and not registers]
        if locals_:
            several = len(locals_) > 1
            kind = "are local variables" if several else "is a local variable"
            fix = (f"{_names(locals_)} {kind} of {scope.name}(), which a checkpoint "
                   f"cannot follow: keep {'them' if several else 'it'} in a dict that the "
                   f"Checkpoint holds and pass it to {scope.name}() ("
                   + ", ".join(f"state['{n}']" for n in locals_) + ")")
            rest = [n for n in carried if n not in locals_]
            if rest:
                fix += (", and register " + ", ".join(f"{n}={n}" for n in rest)
                        + " in the Checkpoint")
        else:
            fix = (f"register {them} in the Checkpoint (spot.Checkpoint(..., "
                   + ", ".join(f"{n}={n}" for n in carried) + "))")
            if self.in_function:
                fix += (" at the cell's top level (a checkpoint cannot follow the variables "
                        "of a function)")
            reset = [n for n in carried if n in resets]
            if reset:
                outer, line = resets[reset[0]]
                fix += (f", and reset {_names(reset)} at the end of each iteration of "
                        f"{scope.loop(outer)} (and once before it), not at its start (line "
                        f"{line}), where a resumed run would reset the restored value")
        return Finding(loop.lineno, (
            f"{_names(carried)} {'are' if len(carried) > 1 else 'is'} carried from one "
            f"iteration of {scope.loop(loop)} to the next ({example}: {how}) "
            f"and the checkpoint does not hold {them}: {fix}"))

    def _iterator(self, name: str, loop: Loop, flow: LoopFlow, scope: Scope
                  ) -> Finding | None:
        """An iterator the loop advances: fine if every assignment of it is ``iter()``
        of a registered loader, the one before the loop after ``restore()`` (its first
        iter() after the restore resumes the epoch where it was)."""
        values = [(n, n.value) for n in walk_scope(scope.body)
                  if isinstance(n, ast.Assign) and any(
                      name in target_names(t) for t in n.targets)]
        loader_iters = values and all(
            isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "iter"
            and len(v.args) == 1 and self.registered_loader(v.args[0], scope)
            for _, v in values)
        restore = min((n.lineno for n in walk_scope(scope.body) if isinstance(n, ast.Call)
                       and isinstance(n.func, ast.Attribute) and n.func.attr == "restore"),
                      default=None)
        first = min(n.lineno for n, _ in values) if values else None
        line = flow.written[name]
        if loader_iters:
            if restore is None or first is None or first > restore or scope.name:
                return None
            return Finding(first, (
                f"{name} = iter(...) at line {first} is made before ckpt.restore() (line "
                f"{restore}): the loader resumes its epoch at the first iter() after the "
                f"restore, so this iterator starts the epoch again: make it after "
                f"ckpt.restore()"))
        cycle = any(isinstance(v, ast.Call) and (dotted(v.func, scope.aliases) or "")
                    .endswith("itertools.cycle") for _, v in values)
        what = (f"{name} is an itertools.cycle() (it repeats the items of its first pass)"
                if cycle else f"{name} is an iterator")
        return Finding(line, (
            f"{what} the loop at line {loop.lineno} advances (line {line}): a resumed run "
            f"makes it again and starts at its first item: loop over the data loader "
            f"itself, or use iter(loader) made after ckpt.restore() (and again when it "
            f"ends), with the loader registered in the Checkpoint; or compute each batch "
            f"from the step"))

    def _set_now_and_then(self, loops: list[Loop], scope: Scope) -> Iterator[Finding]:
        """Variables the outermost loop sets in some iterations only (``best_state``
        when the accuracy improves) and the code after it reads: a run resumed after the
        last time the loop set one has the value from before the loop."""
        loop = loops[-1]
        flow, sure = self._flow(loop, scope)
        after = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
        after.block(self.after(loop), set())
        read_after = dict(after.exposed)
        if scope.name is None:
            read_after.update({n: 0 for n in self.outputs if n not in read_after})
        names = sorted(
            n for n in flow.assigned & read_after.keys()
            if n not in sure and n not in flow.exposed and n not in self._skipped(flow, scope)
            and not self.held(n, flow.assigned, scope))
        for name in names:
            where = (f"line {read_after[name]} reads it after the loop" if read_after[name]
                     else "it is an output of the cell (--out)")
            fix = ("keep it in a dict that the Checkpoint holds" if scope.name else
                   f"register it in the Checkpoint (spot.Checkpoint(..., {name}={name}))")
            yield Finding(loop.lineno, (
                f"{name} is set in some iterations of {scope.loop(loop)} only (line "
                f"{flow.written[name]}) and {where}: a run resumed after the last "
                f"iteration that set it has the value from before the loop: {fix}"))

    # Files on the instance's disk.

    def _files(self, loop: Loop, scope: Scope) -> Iterator[Finding]:
        """A file the loop writes (``torch.save(model.state_dict(), "best.pt")``) and the
        cell reads (in the loop or after it): a replacement instance starts without the
        files the interrupted one wrote, unless a synced directory holds them."""
        synced = [ast.unparse(c.args[0]) for c in calls(self.tree)
                  if last_name(c.func) == "sync_dir" and c.args]
        written: dict[str, tuple[int, str]] = {}
        for call in calls(loop):
            path, how = _file_use(call, scope.aliases, writes=True)
            if path is not None and not any(d.strip("'\"") and d.strip("'\"") in path
                                            for d in synced):
                written.setdefault(path, (call.lineno, how))
        if not written:
            return
        after = [c for stmt in self.after(loop) for c in calls(stmt)]
        for call in [*calls(loop), *after]:
            path, how = _file_use(call, scope.aliases, writes=False)
            if path in written:
                line, wrote = written.pop(path)
                yield Finding(line, (
                    f"{path} is written at line {line} ({wrote}) and read at line "
                    f"{call.lineno} ({how}): the files a cell writes stay on the disk of "
                    f"its instance, and a replacement starts without them (a resumed run "
                    f"that does not write it again reads nothing, or an older file): keep "
                    f"its directory with spot.sync_dir(...), which every attempt gets back, "
                    f"or keep the value in a variable registered in the Checkpoint"))

    # Between the save and the loop's next step.

    def _between(self, save: ast.AST, loops: list[Loop], scope: Scope,
                 inner: tuple[Loop, Scope] | None) -> Iterator[Finding]:
        """What runs between the save and the loop's next step that a resumed run does
        not do (or does again): see the module docstring. ``inner``: the loop of a
        function that ``save`` (its call) calls, which saves."""
        if inner is not None:
            yield from self._around(save, inner, loops[0], scope)
        else:
            tail: list[ast.stmt] = []
            node: ast.AST = save
            parent = self.parents.get(node)
            while parent is not None and node is not loops[0]:
                for block in blocks(parent):
                    if node in block:
                        tail += block[block.index(node) + 1:]
                node, parent = parent, self.parents.get(parent)
            flow, _ = self._flow(loops[0], scope)
            when = (f"after the checkpoint is saved (line {_line(save)}) and before the "
                    f"loop's next step, so a resumed run starts that step without")
            for line, what, draw in self._effects(tail, scope, flow):
                own = ("give the loader a generator of its own (DataLoader(..., "
                       "generator=torch.Generator().manual_seed(0)))" if "iterating" in what
                       else "draw from a torch.Generator that the Checkpoint holds")
                yield Finding(line, (
                    f"line {line} {what} {when} the draw: move the draw before the save "
                    f"(to the top of the loop's body), or {own}" if draw else
                    f"line {line} {what} {when} it: move it before the save"))
        for loop, outer in itertools.pairwise(loops):
            yield from self._around(loop, (loop, scope), outer, scope)

    def _around(self, node: ast.AST, inner: tuple[Loop, Scope], outer: Loop,
                scope: Scope) -> Iterator[Finding]:
        """The statements of ``outer`` (in ``scope``) before and after the one that holds
        ``node``, where the inner loop that saves is (``inner``: it, and its scope)."""
        loop, loop_scope = inner
        holder = child_holding(node, outer.body, self.parents)
        index = outer.body.index(holder)  # type: ignore[arg-type]
        flow, _ = self._flow(outer, scope)
        saving = loop_scope.loop(loop) + ("" if loop_scope is scope else
                                          f" (line {_line(holder)})")
        variable = _target(outer)
        for line, what, draw in self._effects(outer.body[:index], scope, flow,
                                              held_only=True):
            if draw and "seed" in what:
                # Seeding per epoch: a resumed run seeds again, and its steps draw what
                # the epoch's first steps drew, not what the saved state holds.
                fix = ("seed per step instead, at the top of the loop that saves "
                       "(torch.manual_seed(seed + step)), or once before the loops")
            elif draw:
                fix = (f"derive the draw from the loop's variable (random.Random(seed + "
                       f"{variable}), torch.Generator().manual_seed(seed + {variable})), or "
                       f"iterate a data loader registered in the Checkpoint")
            else:
                fix = (f"do it at the end of each iteration instead (after line "
                       f"{_last_line(holder)}), and once before {scope.loop(outer)}")
            yield Finding(line, (
                f"line {line} {what} at the start of each iteration of {scope.loop(outer)}, "
                f"before {saving}, which saves: a run resumed in the middle of that loop "
                f"does it again, on the state the checkpoint saved after it: {fix}"))
        if self.iterates_registered_loader(loop, loop_scope):
            return  # a save due at the loader's last batch waits for the epoch's end
        for line, what, _ in self._effects(outer.body[index + 1:], scope, flow):
            yield Finding(line, (
                f"line {line} {what} after {saving} ends, and a save at its last step "
                f"comes before it: a run resumed from that save skips it: iterate a data "
                f"loader registered in the Checkpoint there (a save due at an epoch's last "
                f"batch then waits for the epoch's end), or save after line "
                f"{_last_line(outer.body[-1])} instead"))

    def _effects(self, stmts: list[ast.stmt], scope: Scope, flow: LoopFlow,
                 held_only: bool = False) -> Iterator[tuple[int, str, bool]]:
        """(line, what, whether a draw) for the first global-RNG draw in ``stmts`` and the
        first change there of state that the checkpoint holds (or, unless ``held_only``,
        that ``flow``'s loop carries)."""
        drawn = None
        for call in (c for stmt in stmts for c in calls(stmt)):
            what = self.draw(call, scope.aliases)
            if what:
                drawn = call.lineno
                yield call.lineno, f"draws from the global RNG ({what})", True
                break
        else:
            for stmt in stmts:
                what = self.iterated_loader([stmt])
                if what:
                    yield stmt.lineno, f"draws from the global RNG ({what})", True
                    break
        changes = LoopFlow(scope.aliases, self.globals_assigned, scope.views)
        changes.block(stmts, set())
        skipped = self._skipped(flow, scope) | self.checkpoints
        carried = flow.exposed.keys() & flow.written.keys()
        state = sorted((line, name) for name, line in changes.written.items()
                       if name not in skipped and name not in scope.restored
                       and not scope.views.get(name)
                       and (self.held(name, set(), scope)
                            or (name in carried and not held_only))
                       and line != drawn)  # random.shuffle(xs): one finding says it
        if state:
            line, name = state[0]
            how = f" ({changes.via[name]})" if name in changes.via else ""
            yield line, f"{changes.verbs[name]} {name}{how}", False

    # A loop that starts over.

    def _starts_over(self, loops: list[Loop], scope: Scope) -> Iterator[Finding]:
        for depth, loop in enumerate(loops):
            if not isinstance(loop, (ast.For, ast.AsyncFor)) or self.opaque:
                continue
            names = {n.id for n in ast.walk(loop.iter) if isinstance(n, ast.Name)}
            if self.restored_value(loop.iter, scope.restored) or any(
                    self.registered_object(n, scope) for n in names) or \
                    self._skips_done(loop, scope):
                continue
            what = ast.unparse(loop.iter)
            ranged = any(last_name(c.func) == "range" for c in calls(loop.iter))
            if depth + 1 < len(loops):  # inside a loop that resumes: start where it was
                fix = ("in the iteration a run resumes in, start it at the step saved "
                       "(range(start % n, n) there, the whole range after), or iterate a "
                       "data loader registered in the Checkpoint" if ranged else
                       "register the data loader in the Checkpoint")
            else:
                fix = ("loop over range(ckpt.restore(), N)" if ranged else
                       "register the data loader in the Checkpoint, or loop over "
                       "range(ckpt.restore(), N)")
            yield Finding(loop.lineno, (
                f"{scope.loop(loop)} goes over {what} from its first item every time "
                f"the cell runs, so after a resume it starts over instead of continuing "
                f"after the step saved: {fix}"))
            return  # the loops inside it start over with it: one finding says it

    def _skips_done(self, loop: Loop, scope: Scope) -> bool:
        """``if epoch < start_epoch: continue`` (a test on the restored step) first in
        the body: the loop skips what was done."""
        first = loop.body[0] if loop.body else None
        return isinstance(first, ast.If) and self.restored_value(first.test, scope.restored) \
            and any(isinstance(s, ast.Continue) for s in first.body)

    def _enumerated(self, loops: list[Loop], scope: Scope) -> Iterator[Finding]:
        """``for i, batch in enumerate(loader)`` over a registered loader: a resumed
        epoch continues at its saved batch, but enumerate() counts from 0 again."""
        for loop in loops:
            if not isinstance(loop, (ast.For, ast.AsyncFor)):
                continue
            source = loop.iter
            if not (isinstance(source, ast.Call) and isinstance(source.func, ast.Name)
                    and source.func.id == "enumerate" and len(source.args) == 1
                    and not source.keywords and self.registered_loader(source.args[0], scope)
                    and isinstance(loop.target, ast.Tuple) and loop.target.elts
                    and isinstance(loop.target.elts[0], ast.Name)):
                continue
            index = loop.target.elts[0].id
            uses = sorted(n.lineno for stmt in loop.body for n in ast.walk(stmt)
                          if isinstance(n, ast.Name) and n.id == index
                          and isinstance(n.ctx, ast.Load))
            if not uses:
                continue
            loader = ast.unparse(source.args[0])
            yield Finding(loop.lineno, (
                f"{scope.loop(loop)} numbers the batches of {loader} with enumerate(), "
                f"which counts from 0 again when a run resumes in the middle of an epoch "
                f"(the loader continues at the batch it was at), so {index} (read at line "
                f"{uses[0]}) is off by the batches done before the save: start the count "
                f"at the batch the epoch resumes at, enumerate({loader}, start=<the batches "
                f"done in that epoch>) in the epoch a run resumes in (start % len({loader}) "
                f"when the step restore() returns counts batches) and 0 after it, or count "
                f"steps in a variable set from ckpt.restore()"))


# -- helpers ----------------------------------------------------------------------------------

# Functions that write a file at a path (the argument's position) and that read one.
_WRITERS = {"torch.save": 1, "numpy.save": 0, "numpy.savez": 0, "numpy.savez_compressed": 0,
            "joblib.dump": 1, "numpy.savetxt": 0}
_READERS = {"torch.load": 0, "numpy.load": 0, "joblib.load": 0, "pandas.read_csv": 0,
            "numpy.loadtxt": 0, "safetensors.torch.load_file": 0}
_WRITE_METHODS = {"save_pretrained": 0, "to_csv": 0, "savefig": 0, "save_model": 0}
_READ_METHODS = {"from_pretrained": 0, "load_model": 0}


def _file_use(call: ast.Call, aliases: Mapping[str, str], writes: bool
              ) -> tuple[str | None, str]:
    """The path ``call`` writes (``writes``) or reads, as code (``'best.pt'``), and the
    call's name; (None, "") for any other call."""
    full = dotted(call.func, aliases)
    name = last_name(call.func) or ""
    if full is not None:
        table = _WRITERS if writes else _READERS
        index = table.get(full.replace("np.", "numpy.", 1))
    elif name == "open" or (isinstance(call.func, ast.Name) and call.func.id == "open"):
        mode = call.args[1] if len(call.args) > 1 else next(
            (k.value for k in call.keywords if k.arg == "mode"), None)
        text = mode.value if isinstance(mode, ast.Constant) and isinstance(
            mode.value, str) else "r"
        index = 0 if (any(c in text for c in "wax")) == writes else None
    else:
        index = (_WRITE_METHODS if writes else _READ_METHODS).get(name) \
            if isinstance(call.func, ast.Attribute) else None
    if index is None or len(call.args) <= index:
        return None, ""
    path = call.args[index]
    if not isinstance(path, (ast.Constant, ast.JoinedStr, ast.Name, ast.BinOp, ast.Call)):
        return None, ""
    return ast.unparse(path), f"{ast.unparse(call.func)}()"


def _names(names: Sequence[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def _target(loop: Loop) -> str:
    if isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.target, ast.Name):
        return loop.target.id
    return "epoch"


def _line(node: ast.AST) -> int:
    return int(getattr(node, "lineno", 0))


def _last_line(node: ast.AST) -> int:
    lines = [getattr(n, "end_lineno", None) or getattr(n, "lineno", 0) for n in ast.walk(node)]
    return max((int(line) for line in lines if line), default=0)


