"""The package's shape, as ARCHITECTURE.md draws it.

One subpackage per side: the notebook side (``client``, ``widgets``, ``records``,
``sweep``), the job protocol and store (``protocol``), the instance side (``train``: the
runtime inside the cell; ``kernel_remote``: the agent, and its distributed jobs under
``multinode``; ``ckpt``: checkpoint formats), and ``providers``. The rules, for every
``import`` anywhere in a module (at import, inside a function, for type checking):

* no import circle between modules (a package's ``__init__`` importing its own
  submodules is the package's face, not an arrow of the circle);
* the instance side imports nothing of the notebook side;
* the protocol imports nothing of either side.

Checked statically over the files, and by importing the instance side's entry points in
a fresh interpreter and looking at what got loaded (``spotnb/__init__`` is lazy for this).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spotnb"

# Module prefixes of each part (a prefix covers a subpackage).
NOTEBOOK_SIDE = ("spotnb.client", "spotnb.widgets", "spotnb.records", "spotnb.sweep")
INSTANCE_SIDE = ("spotnb.train", "spotnb.kernel_remote", "spotnb.ckpt")
PROTOCOL = ("spotnb.protocol",)
# What the package's top level hands out lazily from the notebook side.
LAZY_NAMES = ("submit", "attach", "jobs", "prepare", "find_job", "JobHandle", "JobResult",
              "JobInfo", "JobNotFound", "Attempt", "compare")


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every spotnb module ``path`` imports, anywhere in it: (line, module name)."""
    found = []
    package = _module_name(path).rsplit(".", 1)[0] if path.name != "__init__.py" \
        else _module_name(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.append((node.lineno, base))
            # `from spotnb.client import jobs` (a module) or `from spotnb import submit`
            # (a lazy name of the notebook side)
            for a in node.names:
                found.append((node.lineno, f"{base}.{a.name}"))
                if base == "spotnb" and a.name in LAZY_NAMES:
                    found.append((node.lineno, "spotnb.client.jobs"))
    return [(line, name) for line, name in found if _under(name, ("spotnb",))]


def _module_of(name: str) -> str:
    """The module ``name`` is, or is in (``spotnb.client.jobs.JobHandle`` -> ``...jobs``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _graph() -> dict[str, set[str]]:
    """Module -> the modules it imports; a package's face to its own parts left out."""
    graph = {}
    for module, path in MODULES.items():
        face = path.name == "__init__.py"
        graph[module] = {t for _, name in _imports(path)
                         if (t := _module_of(name)) != module and t in MODULES
                         and not (face and t.startswith(module + "."))}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _wrong(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{p.relative_to(PACKAGE.parent)}:{line} imports {name}"
            for m, p in MODULES.items() if _under(m, sources)
            for line, name in _imports(p) if _under(name, forbidden)]


def test_no_import_circle_between_modules() -> None:
    graph = _graph()
    assert len(graph) > 80, "the package's modules were not found"
    circles = _circles(graph)
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(
        " <-> ".join(c) for c in circles)


def test_the_rule_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_of_the_instance_side_imports_the_notebook_side() -> None:
    assert sum(_under(m, INSTANCE_SIDE) for m in MODULES) > 30
    wrong = _wrong(INSTANCE_SIDE, NOTEBOOK_SIDE)
    assert not wrong, "the instance side imports the notebook side:\n" + "\n".join(wrong)


def test_the_protocol_imports_neither_side() -> None:
    assert sum(_under(m, PROTOCOL) for m in MODULES) > 10
    wrong = _wrong(PROTOCOL, NOTEBOOK_SIDE + INSTANCE_SIDE)
    assert not wrong, "the protocol imports a side above it:\n" + "\n".join(wrong)


def test_the_agent_and_the_runtime_load_nothing_of_the_notebook_side() -> None:
    code = ("import sys, spotnb.kernel_remote.agent, spotnb.train.runtime, "
            "spotnb.kernel_remote.multinode.node, spotnb.train.integrations\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('spotnb'))))")
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True).stdout.split()
    assert "spotnb.kernel_remote.agent" in loaded and "spotnb.train.runtime" in loaded
    wrong = [m for m in loaded if _under(m, NOTEBOOK_SIDE)]
    assert not wrong, f"importing the instance side loaded {wrong}"


def test_the_public_names_stay_where_they_were() -> None:
    code = ("import spotnb\n"
            "from spotnb import submit, attach, jobs, prepare, SpecError, __version__\n"
            "from spotnb.client.jobs import JobHandle\n"
            "import sys, spotnb.client.jobs\n"
            "module = sys.modules['spotnb.client.jobs']\n"
            "assert spotnb.JobHandle is JobHandle and callable(submit)\n"
            "assert spotnb.jobs is jobs is module.jobs and callable(spotnb.jobs)\n"
            "spotnb.jobs = len; assert spotnb.jobs is len\n"
            "spotnb.jobs = jobs; assert spotnb.jobs is module.jobs\n"
            "assert set(spotnb.__all__) <= set(dir(spotnb)), set(spotnb.__all__) - "
            "set(dir(spotnb))\n"
            "from spotnb import runtime as spot; assert callable(spot.log)\n"
            "assert spot is sys.modules['spotnb.train.runtime']\n"
            # the path a cell names the runtime by, both ways, is the module itself
            "import spotnb.runtime; assert spotnb.runtime is spot\n"
            "assert sys.modules['spotnb.runtime'] is spot and spot.Checkpoint\n"
            "import spotnb.sweep.view; assert callable(spotnb.sweep)\n"
            "print(__version__)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout.strip()
    from spotnb._version import __version__

    assert out == __version__
