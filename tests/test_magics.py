"""The magics in-process (IPython's ``globalipapp``): options, configuration, the
free-variable analysis, what is shipped, the follow loop, and refusals before launch.

Real kernels and real jobs are in ``test_notebooks.py``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from helpers import Watch, wait_until
from IPython.core.error import UsageError
from IPython.core.getipython import get_ipython
from IPython.core.inputtransformer2 import TransformerManager
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output
from traitlets import TraitError
from traitlets.config import Config

import spotnb
from spotnb.client import display
from spotnb.client.capture import Capture, CaptureError, capture, local_module_files
from spotnb.client.freevars import free_names
from spotnb.client.jobs import JobHandle
from spotnb.client.magics import SpotMagics
from spotnb.protocol import layout
from spotnb.protocol.events import Event, EventWriter
from spotnb.protocol.spec import JobSpec, Policy, Resources, SpecError
from spotnb.protocol.store import open_store


@pytest.fixture
def ip(spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The test IPython shell with spotnb loaded, in an empty notebook directory."""
    # The first call starts the shared test shell; later ones return None.
    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "spotnb")
    workdir = tmp_path / "nb"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    before = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - before:
        del shell.user_ns[name]
    magics = _magics(shell)
    for name, trait in SpotMagics.class_traits(config=True).items():
        setattr(magics, name, trait.default())
    magics.last_job = None


def _magics(shell: Any) -> SpotMagics:
    return shell.magics_manager.registry["SpotMagics"]


def _no_job_started(home: Path) -> None:
    jobs = home / "store" / "jobs"
    assert not jobs.exists() or not any(jobs.iterdir()), list(jobs.iterdir())
    cloud = home / "cloud"
    assert not cloud.exists() or not any(cloud.rglob("*.json")), list(cloud.rglob("*"))


# -- loading, options, configuration ----------------------------------------------------

def test_load_ext_registers_every_magic(ip: Any) -> None:
    magics = ip.magics_manager.magics
    assert "spot_train" in magics["cell"]
    for name in ("spot_jobs", "spot_attach", "spot_stop", "spot_interrupt", "spot_kill",
                 "spot_logs", "spot_config", "spot_result"):
        assert name in magics["line"], name


def test_load_ext_reads_no_notebook_format() -> None:
    """`%load_ext spotnb` is the first cell of every notebook: it imported nbformat
    (for a name of spotnb.client.notebook), whose schema validation loads jsonschema's
    format checkers: 3.5 s on a busy 2-core machine, against 0.1 s for the magics."""
    code = ("import sys\n"
            "from IPython.testing.globalipapp import start_ipython\n"
            "ip = start_ipython()\n"
            "ip.run_line_magic('load_ext', 'spotnb')\n"
            "ip.run_line_magic('spot_config', '')\n"
            "assert 'spot_train' in ip.magics_manager.magics['cell']\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('nbformat', 'nbclient', 'jsonschema')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_help_documents_every_option_with_an_example(ip: Any) -> None:
    doc = _magics(ip).spot_train.__doc__
    assert doc.lstrip(": \n").startswith("%%spot_train")
    for option in ("--instance-type", "--max-price", "--provider", "--name",
                   "--checkpoint-every", "--max-restarts-on-error", "--budget",
                   "--max-duration", "--out", "--in", "--no-capture",
                   "--simulate-interruptions", "--detach", "--secret"):
        assert option in doc, option
    assert "Example::" in doc and "spot.Checkpoint" in doc


def test_options_override_configuration(ip: Any) -> None:
    ip.run_line_magic("config", "SpotMagics.instance_types = 'g5.xlarge, g4dn.xlarge'")
    ip.run_line_magic("config", "SpotMagics.max_price = 0.5")
    ip.run_line_magic("config", "SpotMagics.checkpoint_every = '10 steps'")
    magics = _magics(ip)

    default = magics.train_request("")
    assert default.submit["instance_types"] == ("g5.xlarge", "g4dn.xlarge")
    assert default.submit["max_price"] == 0.5
    assert default.submit["checkpoint_every"] == "10 steps"
    assert default.submit["simulate_interruptions"] is None
    assert default.inputs is None and default.capture and not default.detach

    req = magics.train_request(
        "-t p3.2xlarge,g5.xlarge --max-price 0.9 --name run1 --out model,acc --in data "
        "--checkpoint-every 5m --max-restarts-on-error 2 --budget 3.5 --max-duration 2h "
        "--simulate-interruptions 2 --detach")
    assert req.submit["instance_types"] == ("p3.2xlarge", "g5.xlarge")
    assert req.submit["max_price"] == 0.9
    assert req.submit["name"] == "run1"
    assert req.submit["outputs"] == ("model", "acc")
    assert req.inputs == ("data",)
    assert req.submit["checkpoint_every"] == "5m"
    assert req.submit["max_restarts_on_error"] == 2
    assert req.submit["budget_usd"] == 3.5
    assert req.submit["max_duration"] == "2h"
    assert req.submit["simulate_interruptions"] == 2
    assert req.detach
    assert magics.train_request("--simulate-interruptions 20s,1m").submit[
        "simulate_interruptions"] == [20.0, 60.0]
    assert not magics.train_request("--no-capture").capture
    # A warm standby on a rebalance recommendation unless turned off, per cell or always.
    assert default.submit["standby"] is True
    assert magics.train_request("--no-standby").submit["standby"] is False
    ip.run_line_magic("config", "SpotMagics.standby = False")
    assert magics.train_request("").submit["standby"] is False
    ip.run_line_magic("config", "SpotMagics.standby = True")
    # A distributed job: MIN:MAX nodes, processes per node; bad counts refused at once.
    assert "nodes" not in default.submit and "procs_per_node" not in default.submit
    multi = magics.train_request("--nodes 3:4 --procs-per-node 2")
    assert multi.submit["nodes"] == (3, 4) and multi.submit["procs_per_node"] == 2
    assert magics.train_request("--nodes 4").submit["nodes"] == (4, 4)
    # How long a rank waits on a dead peer: a duration, as submit(peer_timeout=) takes.
    assert "peer_timeout" not in default.submit
    assert magics.train_request("--nodes 2 --peer-timeout 90").submit["peer_timeout"] == 90.0
    assert magics.train_request("--nodes 2 --peer-timeout 5m").submit["peer_timeout"] == 300.0
    for bad, words in (("0", "at least one node"), ("4:3", "MIN must not exceed MAX")):
        with pytest.raises(SpecError, match=words):
            magics.train_request(f"--nodes {bad}")


def test_configuration_from_ipython_config(ip: Any) -> None:
    # What `c.SpotMagics.x = ...` in ipython_config.py amounts to.
    config = Config({"SpotMagics": {"instance_types": ["g6.xlarge"], "region": "us-west-2",
                                    "budget": 4.0}})
    magics = SpotMagics(shell=ip, config=config)
    try:
        req = magics.train_request("")
        assert req.submit["instance_types"] == ("g6.xlarge",)
        assert req.submit["region"] == "us-west-2"
        assert req.submit["budget_usd"] == 4.0
    finally:
        ip.configurables.remove(magics)


@pytest.mark.parametrize(("name", "value"), [
    ("max_price", 0.0), ("max_price", -1.0), ("budget", 0.0), ("checkpoint_every", "soon"),
])
def test_bad_configuration_is_refused(ip: Any, name: str, value: Any) -> None:
    with pytest.raises(TraitError):
        setattr(_magics(ip), name, value)


def test_spot_config_shows_effective_settings(ip: Any) -> None:
    ip.run_line_magic("config", "SpotMagics.instance_types = ['g5.2xlarge']")
    with capture_output() as out:
        ip.run_line_magic("spot_config", "")
    text = out.outputs[0].data["text/plain"]
    assert "SpotMagics.instance_types" in text and "g5.2xlarge" in text
    assert "SpotMagics.checkpoint_every" in text and "%config SpotMagics" in text


# -- refusals: a UsageError with the fix, and nothing started -------------------------

@pytest.mark.parametrize(("line", "cell", "expected"), [
    ("", "x = 1\ny = = 2\n", "does not compile: line 3: invalid syntax"),
    ("--bogus", "print(1)\n", "unrecognized arguments: --bogus"),
    ("-t g9.nonexistent", "print(1)\n", "unknown instance type 'g9.nonexistent'"),
    ("--max-price 0", "print(1)\n", "--max-price must be a positive, finite number of USD "
                                    "per hour, not 0.0; leave it unset"),
    ("--max-price nan", "print(1)\n", "--max-price must be a positive, finite number"),
    ("--budget 0", "print(1)\n", "--budget must be a positive, finite number of USD, not 0.0; "
                                 "leave it unset for no budget"),
    ("--budget inf", "print(1)\n", "--budget must be a positive, finite number"),
    ("--keep-checkpoints 0", "print(1)\n", "--keep-checkpoints must be at least 1, not 0"),
    ("--keep-checkpoints 2.5", "print(1)\n", "invalid int value: '2.5'"),
    ("--max-restarts-on-error -1", "print(1)\n", "--max-restarts-on-error must be at least 0"),
    ("--checkpoint-every nan", "print(1)\n", "--checkpoint-every must be a time like '60s'"),
    ("--checkpoint-every 0steps", "print(1)\n", "--checkpoint-every must be a time like"),
    ("--max-duration nan", "print(1)\n", "--max-duration must be a duration like 90"),
    ("--max-duration soon", "print(1)\n", "--max-duration must be a duration like 90"),
    ("--out class", "print(1)\n", "--out: 'class' is a Python keyword"),
    ("--simulate-interruptions 1.5", "print(1)\n", "a count"),
    ("--simulate-interruptions 20,45", "print(1)\n", "with units"),
    ("--env 1X=2", "print(1)\n", "--env: '1X' is not an environment variable name"),
    ("--env AWS_SECRET_ACCESS_KEY=abcdefghijklmnopqrstuvwxyz0123456789ABCD", "print(1)\n",
     "--env: AWS_SECRET_ACCESS_KEY names a secret, and env values are written into the "
     "job's spec in plain text"),
    # A secret's name is enough, whatever its value looks like.
    ("--env HF_TOKEN=hf_x1", "print(1)\n", "Pass it as a secret: --secret HF_TOKEN"),
    ("--env OPENAI_API_KEY=sk", "print(1)\n", "--secret OPENAI_API_KEY"),
    ("--env GITHUB_TOKEN=abc", "print(1)\n", "--env: GITHUB_TOKEN names a secret"),
    ("--env PATH=", "print(1)\n", "--env: PATH='' would leave the kernel unable to find"),
    ("--env PATH=::", "print(1)\n", "leave PATH out to keep the instance's own"),
    ("--name=", "print(1)\n", "--name is empty"),
    ("--name ..", "print(1)\n", "--name must be a name without '/'"),
    ("--name runs/a", "print(1)\n", "not '.' or '..'"),
    ("--out spot", "print(1)\n", "--out: 'spot' is the spotnb runtime module, not a result"),
    ("--out __builtins__", "print(1)\n", "--out: '__builtins__' is Python's own"),
    ("--provider aws --env HOME", "print(1)\n", "--env: HOME has no value"),
    ("--env AWS_SECRET_ACCESS_KEY=abcdefghijklmnopqrstuvwxyz0123456789ABCD", "print(1)\n",
     "Pass it as a secret: --secret AWS_SECRET_ACCESS_KEY"),
    ("--secret SPOTNB_TEST_UNSET_SECRET", "print(1)\n",
     "--secret: SPOTNB_TEST_UNSET_SECRET is not set in this machine's environment"),
    ("--max-price cheap", "print(1)\n", "invalid float value"),
    ("--simulate-interruptions soon", "print(1)\n", "a count"),
    ("", "   \n", "the cell is empty"),
    ("--in nothing_here", "print(1)\n", "no such variable"),
    ("--in a --no-capture", "print(1)\n", "choose one"),
    ("--out not-a-name", "print(1)\n", "is not a variable name"),
    ("--provider nimbus", "print(1)\n", "unknown provider 'nimbus'"),
    ("--nodes 2 --peer-timeout 5", "print(1)\n",
     "--peer-timeout must be between 10s and 60m (how long a rank waits on a dead peer"),
    ("--nodes 2 --peer-timeout 2h", "print(1)\n", "--peer-timeout must be between 10s"),
    ("--nodes 2 --peer-timeout 0", "print(1)\n", "--peer-timeout must be a duration like"),
    ("--nodes 2 --peer-timeout soon", "print(1)\n", "--peer-timeout must be a duration"),
])
def test_bad_input_is_a_usage_error_and_starts_nothing(
        ip: Any, spotnb_home: Path, line: str, cell: str, expected: str) -> None:
    with pytest.raises(UsageError) as err:
        ip.run_cell_magic("spot_train", line, cell)
    assert expected in str(err.value)
    # It names the option typed, never the API's field.
    for field in ("budget_usd", "max_price", "keep_checkpoints", "checkpoint_every", "outputs",
                  "peer_timeout"):
        assert field not in str(err.value)
    _no_job_started(spotnb_home)


def test_a_bad_setting_is_named_as_the_setting(ip: Any, spotnb_home: Path) -> None:
    # No option on the line: the value came from %config, so the message names that.
    ip.run_line_magic("config", "SpotMagics.keep_checkpoints = 0")
    with pytest.raises(UsageError, match=r"^SpotMagics\.keep_checkpoints must be at least 1"):
        ip.run_cell_magic("spot_train", "", "print(1)\n")
    with pytest.raises(UsageError, match=r"^--keep-checkpoints must be at least 1, not -3"):
        ip.run_cell_magic("spot_train", "--keep-checkpoints -3", "print(1)\n")
    _no_job_started(spotnb_home)


def test_provider_help_names_both_providers(ip: Any) -> None:
    doc = _magics(ip).spot_train.__doc__
    provider = doc[doc.index("  --provider NAME "):doc.index("  --region REGION ")]
    assert "local" in provider and "aws" in provider
    assert "aws" in SpotMagics.class_traits()["provider"].help


def test_unpicklable_input_names_the_variable_its_size_and_the_way_out(
        ip: Any, spotnb_home: Path) -> None:
    ip.user_ns["lock"] = threading.Lock()
    with pytest.raises(UsageError) as err:
        ip.run_cell_magic("spot_train", "", "with lock:\n    print('locked')\n")
    message = str(err.value)
    assert "'lock'" in message and "cannot be pickled" in message
    assert "bytes in memory" in message
    assert "--in" in message and "--no-capture" in message and "inside the cell" in message
    _no_job_started(spotnb_home)


def test_too_large_input_is_refused_with_its_size(ip: Any, spotnb_home: Path) -> None:
    ip.run_line_magic("config", "SpotMagics.capture_limit_mb = 0.01")
    ip.user_ns["blob"] = b"x" * 50_000
    with pytest.raises(UsageError, match=r"'blob' \(bytes\) is 48\.8 KiB pickled, over the"):
        ip.run_cell_magic("spot_train", "", "print(len(blob))\n")
    _no_job_started(spotnb_home)


def test_a_cell_magic_inside_is_refused(ip: Any, spotnb_home: Path) -> None:
    with pytest.raises(UsageError, match="cell magic"):
        ip.run_cell_magic("spot_train", "", "%%time\nx = 1\n")
    _no_job_started(spotnb_home)


# -- free variables ------------------------------------------------------------------------

@pytest.mark.parametrize(("code", "free"), [
    ("y = x + 1", {"x"}),
    ("x = 1\ny = x", set()),
    ("x += 1", {"x"}),
    ("x.attr = 3\nxs[0] = 1", {"x", "xs"}),
    ("[a for a in b if a > c]", {"b", "c"}),
    ("x = [v for v in range(3)]\nv", {"range", "v"}),
    ("{k: w for k in keys}", {"keys", "w"}),
    ("def f():\n    return z + w\nz = 1\nf()", {"w"}),
    ("def f(a=default):\n    return a", {"default"}),
    ("def f():\n    global n\n    n += 1\nf()", {"n"}),
    ("f = lambda a: a + b", {"b"}),
    ("class A:\n    k = base\n    def m(self):\n        return k", {"base", "k"}),
    ("del q", {"q"}),
    ("q = 1\ndel q", set()),
    ("if (n := size(data)) > k:\n    pass\nn", {"data", "k", "size"}),
    ("[y := 5 for _ in r]\ny", {"r"}),
    ("if c:\n    m = 1\nm", {"c", "m"}),
    ("if c:\n    m = 1\nelse:\n    m = 2\nm", {"c"}),
    ("if c:\n    m = 1\nelse:\n    raise E\nm", {"c", "E"}),
    ("for i in range(3):\n    t = i\nt", {"range"}),
    ("try:\n    import foo\nexcept ImportError:\n    foo = None\nfoo", {"ImportError"}),
    ("try:\n    r = 1\nexcept OSError:\n    pass\nr", {"OSError", "r"}),
    ("with open(p) as fh:\n    d = fh.read()\nd", {"open", "p"}),
    ("match v:\n    case [a, *rest]:\n        out = a\n    case _:\n        out = 0\nout", {"v"}),
    ("model: Net = make()", {"Net", "make"}),
    ("import numpy as np\nfrom os import path\nnp.zeros(3), path", set()),
    ("%time x = y\nx", {"y"}),
    ("!ls {folder} $other $$HOME", {"folder", "other"}),
    ("files = !ls {d}", {"d"}),
    ("%timeit -n 3 step(a)", {"a", "step"}),
])
def test_free_names(code: str, free: set[str]) -> None:
    assert set(free_names(code)) - {"get_ipython", "print"} == free


def test_capture_takes_free_names_from_the_namespace(tmp_path: Path) -> None:
    ns = {"lr": 0.1, "steps": 10, "unused": object(), "print": print, "spot": object(),
          "In": [], "_i3": "x", "hidden_thing": 1}
    cell = "x = lr * steps\nfor _ in range(steps):\n    print(x, undefined_here)\n"
    cap = capture(cell, ns, tmp_path, hidden={"hidden_thing"})
    assert cap.inputs == {"lr": 0.1, "steps": 10}
    assert capture(cell, ns, tmp_path, names=["unused"]).inputs.keys() == {"unused"}
    assert capture(cell, ns, tmp_path, variables=False).inputs == {}


def test_first_line_keeps_the_cells_line_numbers() -> None:
    cap = Capture(inputs={}, imports=("import numpy as np",))
    body = "a = 1\n\nraise ValueError('line 4 of the notebook cell')\n"
    remote = cap.first_line("-t g5.xlarge") + "\n" + body
    # IPython drops leading blank lines before compiling: line 1 must not be blank.
    python = TransformerManager().transform_cell(remote)
    assert python.splitlines()[0].startswith("import numpy as np  # %%spot_train -t g5")
    code = compile(python, "<cell>", "exec")
    with pytest.raises(ValueError) as err:
        exec(code, {})
    assert err.value.__traceback__ is not None
    assert err.value.__traceback__.tb_next.tb_lineno == 4  # type: ignore[union-attr]


# -- local modules ----------------------------------------------------------------------------

@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A notebook directory with helper modules, a package and a .gitignore."""
    root = tmp_path / "project"
    (root / "pkg" / "__pycache__").mkdir(parents=True)
    (root / "pkg" / "cache").mkdir()
    (root / ".gitignore").write_text("secret_mod.py\npkg/*.bin\ncache/\n")
    (root / "helper.py").write_text("import util\n\nclass Model:\n    pass\n\n"
                                    "def answer():\n    return 42\n")
    (root / "util.py").write_text("import os\nVALUE = 1\n")
    (root / "secret_mod.py").write_text("X = 1\n")
    (root / "pkg" / "__init__.py").write_text("from . import core\n")
    (root / "pkg" / "core.py").write_text("import util\n")
    (root / "pkg" / "weights.bin").write_bytes(b"0" * 100)
    (root / "pkg" / "config.json").write_text("{}")
    (root / "pkg" / "cache" / "a.txt").write_text("cached")
    (root / "pkg" / "__pycache__" / "core.cpython-311.pyc").write_bytes(b"")
    (root / "unrelated.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("helper", "util", "pkg", "pkg.core"):
        sys.modules.pop(name, None)


def test_local_modules_are_shipped_respecting_gitignore(project: Path) -> None:
    cell = "import helper\nimport pkg\nimport secret_mod\nimport json\nhelper.answer()\n"
    cap = capture(cell, {}, project)
    assert sorted(cap.files) == ["helper.py", "pkg/__init__.py", "pkg/config.json",
                                 "pkg/core.py", "util.py"]
    assert cap.files["helper.py"] == project / "helper.py"
    assert any("secret_mod" in note and ".gitignore" in note for note in cap.notes)


def test_gitignore_rules_follow_git_syntax(tmp_path: Path) -> None:
    """Rules git reads one way and a hand-written subset another: escapes, ``**``
    inside a name, a class with ``]``, negation (none below an ignored directory),
    anchors and directory-only rules, in a nested ``.gitignore`` too. The expected
    list is what ``git ls-files --others --exclude-standard`` says of the same tree."""
    root = tmp_path / "repo"
    files = ["pkg/__init__.py", "pkg/#notes.py", "pkg/notes.py", "pkg/!bang.py",
             "pkg/bang.py", "pkg/trail ", "pkg/*star", "pkg/xstar", "pkg/gen_a.py",
             "pkg/gen/x.py", "pkg/x]y", "pkg/ab", "pkg/keep.log", "pkg/sub/keep.log",
             "pkg/other.log", "pkg/build/keep.py", "pkg/build/x.py", "pkg/out/keep.py",
             "pkg/out/x.py", "pkg/data", "pkg/data2/a.py", "pkg/top.py", "pkg/sub/top.py",
             "pkg/sub/deep/a.py", "pkg/sub/deep/b.txt", "pkg/sub/deeper/c.txt"]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / ".git").mkdir()
    (root / ".gitignore").write_text("\n".join([
        "\\#notes.py", "\\!bang.py", "trail\\ ", "\\*star", "gen**.py", "x[]]y",
        "a\\b", "*.log", "!/pkg/keep.log", "build/", "!build/keep.py", "out/*",
        "!out/keep.py", "data/", "data2/", "/pkg/top.py", "!"]) + "\n")
    (root / "pkg" / "sub" / ".gitignore").write_text("/deep/*\n!*.py\n!/deeper/\n")
    shipped, _ = local_module_files(["pkg"], root, max_bytes=1 << 20)
    # out/* is anchored by its inner slash: pkg/out/x.py stays.
    assert sorted(shipped) == ["pkg/__init__.py", "pkg/bang.py", "pkg/data", "pkg/gen/x.py",
                               "pkg/keep.log", "pkg/notes.py", "pkg/out/keep.py",
                               "pkg/out/x.py", "pkg/sub/.gitignore", "pkg/sub/deep/a.py",
                               "pkg/sub/deeper/c.txt", "pkg/sub/top.py", "pkg/xstar"]


def test_module_variables_become_imports(project: Path) -> None:
    import helper
    import numpy

    ns = {"np": numpy, "h": helper, "model": helper.Model(), "fn": helper.answer}
    cap = capture("np.zeros(1)\nh.answer()\nmodel, fn\n", ns, project)
    assert cap.imports == ("import helper as h", "import numpy as np")
    assert set(cap.inputs) == {"model", "fn"}
    # helper ships because a module variable and two values come from it.
    assert {"helper.py", "util.py"} <= set(cap.files)
    assert cap.first_line("").startswith("import helper as h; import numpy as np  #")


def test_shipped_files_have_a_size_limit(project: Path) -> None:
    (project / "pkg" / "big.dat").write_bytes(b"0" * 300_000)
    with pytest.raises(CaptureError, match=r"pkg/big\.dat \(0\.3 MiB\).*\.gitignore"):
        local_module_files(["pkg"], project, max_bytes=100_000)


# -- following a job: the loop and the renderer, on a job written by hand ------------------

class Recorder:
    """A renderer that records what it is asked to show."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def update(self, view: display.JobView) -> None:
        self.calls.append(("update", view.state))

    def stream(self, name: str, text: str) -> None:
        self.calls.append(("stream", text))

    def rich(self, kind: str, data: dict[str, Any], metadata: dict[str, Any],
             display_id: str | None) -> None:
        self.calls.append(("rich", data.get("text/plain")))

    def milestone(self, view: display.JobView, event: Event, text: str) -> None:
        self.calls.append(("milestone", text))

    def finished(self, view: display.JobView, result: Any) -> None:
        self.calls.append(("finished", (view.state, view.interruptions)))

    def detached(self, view: display.JobView) -> None:
        self.calls.append(("detached", view.job_id))


def _fake_job(home: Path, job_id: str, *, status: str | None, outputs: dict[str, Any],
              error: dict[str, Any] | None = None) -> JobHandle:
    """A job's store prefix as the agents and the group would leave it."""
    store = open_store(home / "store").child(f"jobs/{job_id}")
    spec = JobSpec(job_id=job_id, name="fake", code="# %%spot_train\nx", provider="local",
                   resources=Resources(instance_types=("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time() - 5, outputs=tuple(outputs))
    store.put(layout.SPEC, spec.to_json().encode())
    group = EventWriter(store, 0)
    group.emit("instance", action="launched", instance_id="i-1", instance_type="g4dn.xlarge",
               az="use1-az1", pool="g4dn.xlarge@use1-az1", price=0.2, ondemand=0.526)
    group.close()
    first = EventWriter(store, 1, "i-1")
    first.emit("status", state="booting", detail="attempt 1", instance_type="g4dn.xlarge",
               az="use1-az1")
    first.emit("stream", name="stdout", text="step 0\n")
    first.emit("metric", step=0, t=time.time(), values={"loss": 2.0})
    first.emit("checkpoint", phase="durable", step=0, id="c0", bytes=10)
    first.emit("notice", kind="instance-action", action="terminate", notice_time="now")
    first.close()
    group = EventWriter(store, 0)
    group.emit("instance", action="notice", instance_id="i-1", reason="simulated")
    group.emit("instance", action="terminated", instance_id="i-1")
    group.emit("instance", action="launched", instance_id="i-2", instance_type="g5.xlarge",
               az="use1-az2", pool="g5.xlarge@use1-az2", price=0.4, ondemand=1.006)
    group.close()
    second = EventWriter(store, 2, "i-2")
    second.emit("status", state="booting", detail="attempt 2", instance_type="g5.xlarge",
                az="use1-az2")
    second.emit("status", state="running", detail="restored checkpoint of step 0 in 0.1s")
    second.emit("warning", kind="notice-fit", text="a checkpoint of 24.0 GB took 240 s to "
                "become durable (100 MB/s), more than 50% of the 120 s interruption notice")
    second.emit("stream", name="stdout", text="step 1\n")
    second.emit("display", kind="display_data", data={"text/plain": "a figure"},
                metadata={}, display_id=None)
    if status is not None:
        second.emit("display", kind="execute_result", data={"text/plain": "0.97"},
                    metadata={}, display_id=None)
        if error:
            second.emit("error", retrying=False, **error)
        second.emit("result", status=status, reason="the cell finished")
    second.close()
    if status is not None:
        store.put(layout.OUTPUTS, cloudpickle.dumps(outputs))
        store.put(layout.RESULT, json.dumps({"status": status, "reason": "the cell finished",
                                             "attempt": 2, "error": error}).encode())
    return JobHandle(store, spec)


def test_follow_replays_history_and_shows_the_last_value_once(spotnb_home: Path) -> None:
    handle = _fake_job(spotnb_home, "20250101-000000-aaaaaa", status="completed",
                       outputs={"model": [1, 2]})
    recorder = Recorder()
    outcome = display.follow(handle, recorder)
    assert isinstance(outcome, display.Finished)
    assert outcome.result.status == "completed"
    assert outcome.result.outputs == {"model": [1, 2]}
    assert outcome.execute_result == {"data": {"text/plain": "0.97"}, "metadata": {}}
    kinds = [c for c in recorder.calls if c[0] != "update"]
    streams = [text for kind, text in kinds if kind == "stream"]
    assert streams == ["step 0\n", "step 1\n"]
    assert ("rich", "a figure") in kinds and ("rich", "0.97") not in kinds
    milestones = [text for kind, text in kinds if kind == "milestone"]
    assert any("spot interruption notice for i-1" in m for m in milestones)
    assert any(m.startswith("attempt 2: resuming") for m in milestones)
    # The restore is status (the header shows it), not a second line for the resume.
    assert not any("restored checkpoint" in m for m in milestones)
    assert any(m.startswith("warning: a checkpoint of 24.0 GB took 240 s") for m in milestones)
    assert kinds[-1] == ("finished", ("completed", 1))


def test_attach_sets_outputs_and_returns_the_remote_value(ip: Any, spotnb_home: Path) -> None:
    job_id = "20250101-000000-bbbbbb"
    _fake_job(spotnb_home, job_id, status="completed", outputs={"model": {"w": 3}})
    with capture_output() as out:
        value = ip.run_line_magic("spot_attach", job_id[-6:])
    assert isinstance(value, display.RemoteValue) and repr(value) == "0.97"
    assert ip.user_ns["model"] == {"w": 3}
    # The whole history, with the interruption between the lines it separates.
    stdout = out.stdout
    assert stdout.index("step 0\n") < stdout.index("spot interruption notice") \
        < stdout.index("attempt 2: resuming") < stdout.index("step 1\n")
    # The terminal shell shows each update of the status display as a new output.
    status = [o.data["text/plain"] for o in out.outputs
              if o.data["text/plain"].startswith("spotnb job")][-1]
    assert "completed" in status and "interruptions 1" in status
    assert "on-demand $" in status and "outputs set in the notebook: model" in status


def test_spot_result_reads_well_and_carries_the_outputs(ip: Any, spotnb_home: Path) -> None:
    job_id = "20250101-000000-ffffff"
    _fake_job(spotnb_home, job_id, status="completed",
              outputs={"model": {"w": [1.5] * 40}, "accuracy": 0.97})
    ip.run_cell("r = %spot_result ffffff")
    result = ip.user_ns["r"]
    assert result.outputs == {"model": {"w": [1.5] * 40}, "accuracy": 0.97}
    text = repr(result)
    assert text.splitlines()[0] == f"JobResult {job_id} 'fake'"
    # Every field is there, readable: dates, durations, dollars, the outputs.
    for field in dataclasses.fields(result):
        if field.name not in ("job_id", "name"):
            assert re.search(rf"^\s+{field.name}\s", text, re.M), field.name
    assert re.search(r"start \d{4}-\d\d-\d\d \d\d:\d\d:\d\d", text)
    assert re.search(r"cost_usd\s+\$\d+\.\d{4}$", text, re.M)
    assert re.search(r"duration\s+\d+\.\ds$", text, re.M)
    assert "accuracy = 0.97" in text and "savings_pct" in text
    assert re.search(r"^  interruptions +1$", text, re.M)
    assert "e+09" not in text  # no epoch floats
    html = result._repr_html_()
    assert "<table>" in html and "ondemand_cost_usd" in html and "<th>instance_type</th>" in html


def test_a_new_result_field_appears_in_the_repr_without_further_work() -> None:
    @dataclasses.dataclass(frozen=True, repr=False)
    class Richer(spotnb.JobResult):
        control_plane_cost_usd: float = 0.00042
        finished_at: float = 1.7e9

    result = Richer(job_id="j", name="n", status="completed", reason="", attempts=(),
                    interruptions=0, cost_usd=0.1, ondemand_cost_usd=0.3, metrics={},
                    duration=4000.0)
    text = repr(result)
    assert re.search(r"control_plane_cost_usd\s+\$0\.0004$", text, re.M)
    assert re.search(r"finished_at\s+20\d\d-\d\d-\d\d \d\d:\d\d:\d\d$", text, re.M)
    assert re.search(r"duration\s+1h 06m 40s$", text, re.M)
    assert "control_plane_cost_usd" in result._repr_html_()


def test_magics_find_jobs_by_name_and_list_an_ambiguous_one(
        ip: Any, spotnb_home: Path) -> None:
    first = "20250101-000000-aaaaa1"
    second = "20250101-000000-aaaaa2"
    _fake_job(spotnb_home, first, status="completed", outputs={})
    _fake_job(spotnb_home, second, status="completed", outputs={})
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("spot_result", "fake")  # both are called 'fake'
    assert "'fake' matches 2 jobs" in str(err.value)
    assert first in str(err.value) and second in str(err.value)
    assert ip.run_line_magic("spot_result", "aaaaa2").job_id == second


def test_spot_logs_writes_the_history_at_once(
        ip: Any, spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = "20250101-000000-ababab"
    _fake_job(spotnb_home, job_id, status="completed", outputs={})

    class Flushes(io.StringIO):
        """A stdout that counts flushes: each one is an output message in Jupyter."""

        count = 0

        def flush(self) -> None:
            self.count += 1

    out = Flushes()
    monkeypatch.setattr(sys, "stdout", out)
    ip.run_line_magic("spot_logs", job_id)
    assert out.count == 1
    assert "step 0" in out.getvalue() and "step 1" in out.getvalue()


def test_a_failed_job_shows_the_remote_traceback_with_the_cells_number(
        spotnb_home: Path) -> None:
    tb = ["\x1b[0;31mValueError\x1b[0m  Traceback (most recent call last)",
          "Cell \x1b[0;32mIn[1], line 4\x1b[0m", "ValueError: boom"]
    handle = _fake_job(spotnb_home, "20250101-000000-cccccc", status="failed", outputs={},
                       error={"ename": "ValueError", "evalue": "boom", "traceback": tb})
    outcome = display.follow(handle, Recorder())
    assert isinstance(outcome, display.Finished)
    rendered = display.SpotJobError(outcome.result, cell_number=7)._render_traceback_()
    assert "Cell \x1b[0;32mIn[7], line 4\x1b[0m" in rendered
    assert "failed on attempt 2: the cell finished" in rendered[-1]


class Interrupting(display.TextRenderer):
    """The stop button, pressed while output streams in."""

    def stream(self, name: str, text: str) -> None:
        raise KeyboardInterrupt


def test_interrupting_the_cell_detaches_and_says_how_to_come_back(
        ip: Any, spotnb_home: Path) -> None:
    job_id = "20250101-000000-dddddd"
    handle = _fake_job(spotnb_home, job_id, status=None, outputs={})
    _magics(ip).renderer_class = Interrupting
    with capture_output() as out:
        value = ip.run_line_magic("spot_attach", job_id)
    assert value is None
    assert "keeps running" in out.stderr
    assert f"%spot_attach {job_id}" in out.stderr and f"%spot_stop {job_id}" in out.stderr
    assert not handle.store.exists(layout.STOP)  # detaching does nothing to the job


def test_spot_jobs_lists_jobs(ip: Any, spotnb_home: Path) -> None:
    _fake_job(spotnb_home, "20250101-000000-eeeeee", status="completed", outputs={})
    with capture_output() as out:
        ip.run_line_magic("spot_jobs", "")
    table = out.outputs[0].data["text/plain"]
    assert "20250101-000000-eeeeee" in table and "completed" in table and "interruptions" in table


def test_unknown_job_is_a_usage_error(ip: Any) -> None:
    with pytest.raises(UsageError, match=r"no job 'nope' in .*as %spot_jobs lists them"):
        ip.run_line_magic("spot_attach", "nope")


def test_module_docstring_example_parses() -> None:
    # The README shows this cell; keep it compiling.
    body = textwrap.dedent("""
        ckpt = spot.Checkpoint(model=model, optimizer=opt)
        for step in range(ckpt.restore(), 1000):
            loss = train_step()
            spot.log(step, loss=loss)
            ckpt.maybe_save(step)
    """)
    assert set(free_names(body)) == {"model", "opt", "train_step", "range", "spot"}


# -- a real job on the local cloud, driven by the line magics ------------------------------

@pytest.mark.slow
def test_detach_interrupt_logs_and_stop_a_real_job(
        ip: Any, spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    ip.user_ns["PAUSE"] = 0.05
    with capture_output() as out:
        value = ip.run_cell_magic("spot_train", "--detach --name endless", textwrap.dedent("""
            import time
            state = {"total": 0}
            ckpt = spot.Checkpoint(state=state)
            for step in range(ckpt.restore(), 10**6):
                state["total"] += step
                spot.log(step, total=state["total"])
                ckpt.maybe_save(step)
                time.sleep(PAUSE)
        """))
    assert value is None
    job_id = _magics(ip).last_job
    assert job_id is not None
    assert "[spotnb] shipping inputs PAUSE" in out.stdout
    assert f"submitted job {job_id}" in out.stdout and f"%spot_stop {job_id}" in out.stdout

    handle = spotnb.attach(job_id)
    # Followed live: an unwatched job writes its metrics to the store once a minute.
    live = handle.events(timeout=120)
    assert any(e.type == "metric" and "total" in e.data["values"] for e in live)
    live.close()
    # Followed live, as a notebook follows it: the agents send their events within a
    # second (unwatched, the log is written about once a minute, and a wait on it
    # raced that flush under load).
    with Watch(handle) as watch:
        with capture_output() as out:
            ip.run_line_magic("spot_interrupt", "")  # the latest job
        assert f"interruption notice delivered to job {job_id}" in out.stdout
        watch.until(lambda events: any(
            e.type == "status" and e.attempt == 2
            and e.data.get("detail", "").startswith("restored") for e in events),
            180, "the resumed attempt")

        def logs() -> str:
            with capture_output() as out:
                ip.run_line_magic("spot_logs", job_id)
            return out.stdout

        said = wait_until(lambda: (text := logs()) and "running: restored checkpoint of step"
                          in text and text, 120, "the restore in the job's log")
    assert "notice: instance-action terminate" in said

    with capture_output() as out:
        ip.run_line_magic("spot_stop", "endless")  # by name
    assert f"job {job_id} stopped" in out.stdout
    assert handle.status == "stopped"
    result = handle.summary()
    assert result.interruptions == 1 and len(result.attempts) == 2
