"""Old module paths keep importing after the package was laid out by side.

Each old path (``spotnb.runtime``, ``spotnb.tb``, ``spotnb.jobs``, ...) and every module
under an old package path (``spotnb.events.fold``) is the module at its new path: the
same object, so state, ``isinstance`` and pickles are shared (``spotnb/_moved.py``).
"""

from __future__ import annotations

import subprocess
import sys

from spotnb._moved import MOVED, new_name


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_every_old_path_is_the_module_at_its_new_path() -> None:
    names = [f"spotnb.{old}" for old in MOVED
             if old not in ("integrations",)]  # its frameworks need not be installed
    names += ["spotnb.events.fold", "spotnb.events.codec", "spotnb.integrations"]
    code = ("import importlib, sys\n"
            f"for old in {names!r}:\n"
            "    module = importlib.import_module(old)\n"
            "    new = sys.modules[module.__name__]\n"
            "    assert module is new and module.__name__ != old, old\n"
            "    assert sys.modules[old] is new and new.__spec__.name == new.__name__, old\n"
            "print(len(sys.modules))")
    assert int(_run(code)) > 0


def test_old_paths_of_public_names() -> None:
    out = _run(
        "import pickle, sys\n"
        "import spotnb.runtime\n"
        "from spotnb import runtime as spot\n"
        "from spotnb.tb import tensorboard\n"
        "from spotnb.jobs import JobHandle\n"
        "import spotnb.jobs, spotnb.display, spotnb.notebook\n"
        "import spotnb\n"
        "from spotnb.events.fold import JobState\n"
        "from spotnb.protocol.events.fold import JobState as New\n"
        "assert JobState is New and spot is spotnb.runtime and callable(spot.log)\n"
        "assert spot is sys.modules['spotnb.train.runtime']\n"
        "assert tensorboard is sys.modules['spotnb.train.tb'].tensorboard\n"
        "assert spotnb.JobHandle is JobHandle and callable(spotnb.jobs)\n"
        "assert spotnb.display.TextRenderer.__module__ == 'spotnb.client.display'\n"
        "assert callable(spotnb.notebook.run_notebook)\n"
        # a pickle made before the move names the old module
        "old = pickle.dumps(JobHandle, protocol=0).replace(b'spotnb.client.jobs', b'spotnb.jobs')\n"
        "assert b'spotnb.jobs' in old and pickle.loads(old) is JobHandle\n"
        "print('ok')")
    assert out == "ok"


def test_only_old_paths_are_mapped() -> None:
    assert new_name("spotnb.runtime") == "spotnb.train.runtime"
    assert new_name("spotnb.events.fold") == "spotnb.protocol.events.fold"
    assert new_name("spotnb.train.runtime") is None
    assert new_name("spotnb.widgets") is None
    assert new_name("spotnb.runtimes") is None
    assert new_name("numpy") is None


def test_python_m_runs_an_old_path() -> None:
    out = subprocess.run([sys.executable, "-m", "spotnb.cli", "--version"], check=True,
                         capture_output=True, text=True).stdout
    from spotnb._version import __version__

    assert __version__ in out
