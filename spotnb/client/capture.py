"""What a ``%%spot_train`` cell needs from the notebook: its inputs and local modules.

Contract: :func:`capture` analyses the cell's code (never runs it) and returns a
:class:`Capture`: the notebook variables the cell reads before it assigns them
(pickled with cloudpickle, unpickled on the instance), the modules it uses through such
a variable (re-imported on the instance), and the files of the modules that live in the
notebook's working directory (shipped next to the cell, so ``import helper`` works
there too). Anything that cannot travel raises :class:`CaptureError` before a job
exists, naming the variable, its size and the way out.

Functions defined in the notebook (lambdas, and the methods of its classes too) travel
linked to the instance's namespace (:mod:`spotnb.protocol.inputs`): called in the cell,
they read the cell's live variables. What they read from the notebook that the cell
does not assign travels as inputs of their own (:func:`notebook_reads`), named on the
shipping line (:meth:`Capture.shipping_line`).

The names are found by :mod:`spotnb.client.freevars`; ``.gitignore`` files are respected
(:class:`GitIgnore`, on pathspec's gitignore rules).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import fnmatch
import logging
import os
import sys
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pathspec

from spotnb.client.freevars import bound_names_in, free_names_in
from spotnb.protocol import inputs as shipped
from spotnb.protocol.spec import INJECTED_NAMES, IPYTHON_CACHE_NAME, SpecError

__all__ = [
    "Capture",
    "CaptureError",
    "GitIgnore",
    "capture",
    "human_size",
    "local_module_files",
    "notebook_reads",
]

log = logging.getLogger(__name__)

# The runtime defines `spot` on the instance; IPython defines these in every kernel.
PROVIDED_ON_INSTANCE = INJECTED_NAMES
_IPYTHON_CACHE = IPYTHON_CACHE_NAME
# Never shipped with a module: byte code, VCS metadata, notebooks' own checkpoints.
_ALWAYS_SKIPPED = ("__pycache__", ".git", ".ipynb_checkpoints", "*.pyc", "*.pyo")
_MIB = 1 << 20


class CaptureError(SpecError):
    """An input cannot be shipped; the message names it and the way out."""


@dataclasses.dataclass(frozen=True)
class Capture:
    """What travels with a cell.

    ``inputs`` are defined in the remote namespace before the cell runs; ``imports``
    are statements for the notebook's module variables (``import numpy as np``);
    ``files`` maps paths relative to the remote working directory to local files;
    ``notes`` are things the user should know (a module left out by ``.gitignore``);
    ``reads``: for each input that holds functions of the notebook, the variables
    they read on the instance (shipped ones, or the cell's own).
    """

    inputs: dict[str, Any]
    imports: tuple[str, ...] = ()
    files: dict[str, Path] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    input_bytes: int = 0
    reads: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def shipping_line(self) -> str:
        """``[spotnb] shipping ...``: every input by name (with what a notebook
        function among them reads), the imports and the files."""
        parts = []
        if self.inputs:
            names = [f"{name} (reads {', '.join(self.reads[name])})" if self.reads.get(name)
                     else name for name in sorted(self.inputs)]
            parts.append(f"inputs {', '.join(names)} ({human_size(self.input_bytes)})")
        if self.imports:
            parts.append("imports " + ", ".join(s.split()[-1] for s in self.imports))
        if self.files:
            parts.append("files " + ", ".join(sorted(self.files)))
        return "[spotnb] shipping " + ("; ".join(parts) if parts else "the cell alone")

    def first_line(self, magic_line: str) -> str:
        """The remote cell's line 1, standing for the ``%%spot_train`` line.

        The remote cell is this line, a newline, then the notebook cell's body, so the
        remote traceback's line numbers are the notebook cell's. It must not be blank:
        IPython drops a cell's leading blank lines before compiling it.
        """
        comment = f"# %%spot_train {magic_line}".rstrip()
        return "; ".join(self.imports) + "  " + comment if self.imports else comment


def _imported_modules(tree: ast.AST) -> set[str]:
    """Top-level names of the absolute imports in ``tree`` (``a`` for ``a.b``)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


# -- .gitignore ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Rules:
    """One ``.gitignore`` file's rules, for the paths below its directory: as git walks
    a tree, directories (checked as ``dir/``) by each rule that matches the directory
    itself, and a file by gitignore's precedence of file and directory rules."""

    directories: pathspec.PathSpec
    files: pathspec.GitIgnoreSpec

    @classmethod
    def parse(cls, lines: list[str]) -> _Rules | None:
        valid = []
        # re warns of "possible nested sets" in classes such as [[:digit:]].
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            for line in lines:
                try:
                    pathspec.GitIgnoreSpec.from_lines([line])
                except ValueError:
                    continue  # git skips a line it cannot read (a lone "!")
                valid.append(line)
            if not valid:
                return None
            return cls(pathspec.PathSpec.from_lines("gitignore", valid),
                       pathspec.GitIgnoreSpec.from_lines(valid))

    def verdict(self, rel: str, is_dir: bool) -> bool | None:
        """True: ignored, False: re-included (``!``), None: no rule matches."""
        if is_dir:
            return self.directories.check_file(rel + "/").include
        return self.files.check_file(rel).include


class GitIgnore:
    """The ``.gitignore`` files that apply below ``root``, in git's whole syntax
    (pathspec): deeper files' rules win over outer ones', and nothing below an ignored
    directory is re-included (git does not look inside it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._rules: dict[Path, _Rules | None] = {}

    def _rules_of(self, directory: Path) -> _Rules | None:
        if directory not in self._rules:
            try:
                text = (directory / ".gitignore").read_text(errors="replace")
            except OSError:
                text = ""
            self._rules[directory] = _Rules.parse(text.splitlines())
        return self._rules[directory]

    def ignored(self, path: Path) -> bool:
        """Whether ``path`` (below ``root``) or one of its directories is ignored."""
        rel = path.relative_to(self.root)
        current = self.root
        for i, part in enumerate(rel.parts):
            current = current / part
            is_dir = i < len(rel.parts) - 1 or path.is_dir()
            if any(fnmatch.fnmatch(part, pat) for pat in _ALWAYS_SKIPPED):
                return True
            if self._match(current, is_dir):
                return True
        return False

    def _match(self, path: Path, is_dir: bool) -> bool:
        verdict = False
        # Rules of the outer directories first; deeper .gitignore files win.
        rel_dirs = path.parent.relative_to(self.root).parts
        dirs = [self.root] + [self.root.joinpath(*rel_dirs[:i + 1]) for i in range(len(rel_dirs))]
        for directory in dirs:
            rules = self._rules_of(directory)
            if rules is not None:
                found = rules.verdict(path.relative_to(directory).as_posix(), is_dir)
                if found is not None:
                    verdict = found
        return verdict


# -- local modules -----------------------------------------------------------------------

def _module_path(name: str, workdir: Path) -> Path | None:
    """The file or package directory of top-level module ``name`` in ``workdir``."""
    if (workdir / f"{name}.py").is_file():
        return workdir / f"{name}.py"
    package = workdir / name
    if package.is_dir() and any(package.glob("*.py")):
        return package
    return None


def local_module_files(modules: Iterable[str], workdir: Path, max_bytes: int,
                       ) -> tuple[dict[str, Path], list[str]]:
    """The files of the top-level ``modules`` that live in ``workdir``, and of the local
    modules they import in turn; ``.gitignore`` files are respected.

    Returns ``({path relative to workdir: file}, notes)``. Raises :class:`CaptureError`
    when the files add up to more than ``max_bytes``.
    """
    workdir = workdir.resolve()
    ignore = GitIgnore(_ignore_root(workdir))
    files: dict[str, Path] = {}
    notes: list[str] = []
    seen: set[str] = set()
    todo = sorted(set(modules))
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        where = _module_path(name, workdir)
        if where is None:
            continue
        if ignore.ignored(where):
            notes.append(f"module {name!r} is in .gitignore, so it was not shipped; "
                         "it must be importable on the instance")
            continue
        candidates = [where] if where.is_file() else sorted(where.rglob("*"))
        for path in candidates:
            if not path.is_file() or ignore.ignored(path):
                continue
            files[path.relative_to(workdir).as_posix()] = path
            if path.suffix == ".py":
                try:
                    tree = ast.parse(path.read_bytes())
                except (SyntaxError, ValueError):
                    continue  # the import on the instance will say what is wrong
                todo.extend(sorted(_imported_modules(tree) - seen))
    total = sum(p.stat().st_size for p in files.values())
    if total > max_bytes:
        biggest = sorted(files.items(), key=lambda kv: -kv[1].stat().st_size)[:3]
        listing = ", ".join(f"{rel} ({p.stat().st_size / _MIB:,.1f} MiB)" for rel, p in biggest)
        raise CaptureError(
            f"the local modules the cell imports add up to {total / _MIB:,.1f} MiB, over "
            f"the {max_bytes / _MIB:,.0f} MiB limit (%config SpotMagics.files_limit_mb); "
            f"the biggest: {listing}. Add data files to .gitignore and load them inside "
            "the cell instead. Nothing was started.")
    return files, notes


def _ignore_root(workdir: Path) -> Path:
    """The repository root above ``workdir`` (``.gitignore`` files up to it apply)."""
    for parent in (workdir, *workdir.parents):
        if (parent / ".git").exists():
            return parent
    return workdir


def _local_top_module(module_name: str | None, workdir: Path) -> str | None:
    if not module_name:
        return None
    top = module_name.split(".")[0]
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None) or ""
    if file and _is_below(Path(file), workdir):
        return top
    return None


def _is_below(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


# -- capture -------------------------------------------------------------------------------

def capture(
    code: str,
    namespace: Mapping[str, Any],
    workdir: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    variables: bool = True,
    limit_bytes: int = 100 * _MIB,
    files_limit_bytes: int = 50 * _MIB,
    hidden: Iterable[str] = (),
) -> Capture:
    """Find what ``code`` needs from ``namespace`` and check that it can travel.

    ``names``: ship exactly these variables (``--in``) instead of the analysed ones;
    ``variables=False`` ships none (``--no-capture``). Local modules the cell imports
    are shipped either way. ``hidden``: names of the notebook's machinery
    (IPython's ``user_ns_hidden``) that are never shipped. Raises ``SyntaxError`` if
    the code does not compile and :class:`CaptureError` if an input cannot travel.
    """
    from IPython.core.inputtransformer2 import TransformerManager

    workdir = Path(workdir).resolve()
    tree = ast.parse(TransformerManager().transform_cell(code))
    skip = set(dir(builtins)) | PROVIDED_ON_INSTANCE | set(hidden)
    if names is not None:
        missing = [n for n in names if n not in namespace]
        if missing:
            raise CaptureError(
                f"--in names {', '.join(map(repr, missing))}, but the notebook has no "
                f"such variable; define it in a cell above or remove it from --in")
        wanted = list(names)
    elif variables:
        free = free_names_in(tree)
        wanted = [n for n in sorted(free)
                  if n in namespace and n not in skip and not _IPYTHON_CACHE.match(n)]
    else:
        wanted = []

    bound = bound_names_in(tree)
    inputs: dict[str, Any] = {}
    reads: dict[str, tuple[str, ...]] = {}
    imports: list[str] = []
    modules = _imported_modules(tree)
    total = 0
    # The variables the cell reads, then those its notebook functions read, in turn.
    todo: list[tuple[str, Any]] = [(name, namespace[name]) for name in wanted]
    seen = set(wanted)
    while todo:
        name, value = todo.pop(0)
        if isinstance(value, types.ModuleType):
            imports.append(_import_statement(name, value))
            local = _local_top_module(value.__name__, workdir)
            if local:
                modules.add(local)
            continue
        size, linked = _check_picklable(name, value, limit_bytes)
        total += size
        inputs[name] = value
        # An object of a class (or a function) from a local module is pickled by
        # reference: the module must be importable on the instance.
        owner = value if isinstance(value, (type, types.FunctionType)) else type(value)
        local = _local_top_module(getattr(owner, "__module__", None), workdir)
        if local:
            modules.add(local)
        found = notebook_reads(linked, bound, skip)
        reads[name] = tuple(sorted(n for n, v in found.items()
                                   if n != name and not isinstance(v, types.ModuleType)))
        for more, more_value in sorted(found.items()):
            if more not in seen and more not in bound:
                seen.add(more)
                todo.append((more, more_value))
    files, notes = local_module_files(modules, workdir, files_limit_bytes)
    log.debug("capture: inputs %s, imports %s, files %s", sorted(inputs), imports, sorted(files))
    return Capture(inputs=inputs, imports=tuple(imports), files=files, notes=tuple(notes),
                   input_bytes=total, reads={k: v for k, v in reads.items() if v})


_ABSENT = object()


def notebook_reads(functions: Iterable[types.FunctionType], bound: Iterable[str],
                   skip: Iterable[str] = ()) -> dict[str, Any]:
    """What notebook ``functions`` read as globals: ``{name: value}``, the value from
    the function's own globals (the notebook's namespace), or ``_ABSENT`` for a name
    only the cell defines (``bound``: it reads the cell's variable on the instance).

    Builtins, ``skip`` and IPython's output cache are left out, as are names neither
    the notebook nor the cell defines (the call fails there as it would here).
    """
    bound = set(bound)
    skip = set(skip) | set(dir(builtins)) | PROVIDED_ON_INSTANCE
    found: dict[str, Any] = {}
    for func in functions:
        for name in shipped.globals_read(func):
            if name in skip or _IPYTHON_CACHE.match(name) or name.startswith("__"):
                continue
            if name in bound:
                if not isinstance(func.__globals__.get(name), types.ModuleType):
                    found.setdefault(name, _ABSENT)  # the cell's own (not a module it imports)
            elif name in func.__globals__:
                found[name] = func.__globals__[name]
    return found


def _import_statement(name: str, module: types.ModuleType) -> str:
    real = module.__name__
    return f"import {real}" if real == name else f"import {real} as {name}"


def _way_out(name: str) -> str:
    return (f"Create or load {name!r} inside the cell, or choose what is shipped: "
            f"--in a,b ships only the variables named, --no-capture ships none. "
            "Nothing was started.")


def _check_picklable(name: str, value: Any, limit_bytes: int
                     ) -> tuple[int, list[types.FunctionType]]:
    """The pickled size of ``value`` and the notebook functions in it; raises
    :class:`CaptureError` naming the way out."""
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    try:
        blob, linked = shipped.dumps(value)
        size = len(blob)
    except Exception as err:
        held = sys.getsizeof(value)
        raise CaptureError(
            f"input {name!r} ({kind}, {human_size(held)} in memory) cannot be pickled, so it "
            f"cannot travel to the instance: {type(err).__name__}: {err}. "
            + _way_out(name)) from None
    if size > limit_bytes:
        raise CaptureError(
            f"input {name!r} ({kind}) is {human_size(size)} pickled, over the "
            f"{human_size(limit_bytes)} limit (%config SpotMagics.capture_limit_mb): ship it "
            "through a file or a bucket and load it inside the cell. " + _way_out(name))
    return size, linked


def human_size(size: int) -> str:
    """``size`` bytes for people: ``1.5 MiB``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MIB), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} bytes"
