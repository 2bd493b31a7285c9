"""A researcher's own training code resumes exactly, or is told before launch why not.

* Notebook functions (and lambdas, and the methods of notebook classes) run against
  the instance's namespace: they read the cell's live variables, and what they read
  from the notebook travels as inputs named on the shipping line
  (:mod:`spotnb.protocol.inputs`, :mod:`spotnb.client.capture`).
* A value registered in a ``spot.Checkpoint`` under its variable's name is saved as
  the variable is at each save and restored into it; one that would be frozen is
  refused at registration (:mod:`spotnb.train.cellvars`).
* Before launch, the cell's loop is read for state it carries that the checkpoint
  does not hold, and for global-RNG draws after the save (:mod:`spotnb.client.carried`);
  the warning is the cell's first output line.
* The example notebook (``notebooks/gpt.ipynb``) trains a small GPT with these habits
  through two interruptions and ends bitwise where the same notebook ends uninterrupted.
"""

from __future__ import annotations

import json
import linecache
import re
import shutil
import textwrap
from pathlib import Path
from typing import Any

import cloudpickle
import nbformat
import numpy as np
import pytest
import torch
from helpers import beside
from IPython.core.getipython import get_ipython
from IPython.testing.globalipapp import start_ipython
from IPython.utils.capture import capture_output

import spotnb
from spotnb.client.capture import capture
from spotnb.client.carried import check_resume, resume_warning
from spotnb.client.notebook import run_notebook
from spotnb.client.validation import prepare_job
from spotnb.kernel_remote import channel
from spotnb.protocol import inputs as shipped
from spotnb.train import runtime as spot

REPO = Path(__file__).resolve().parents[1]

# -- notebook functions read the instance's namespace ---------------------------------

NOTEBOOK = '''
import functools
import torch

model = "the notebook's model"
eval_iters = 3
scale = 10

def get_batch(split):
    return f"{split} x{eval_iters}"

@torch.no_grad()
def estimate_loss():
    """nanoGPT's helper: it reads the global model."""
    return model, get_batch("val")

class Probe:
    def measure(self):
        return model

warmup = lambda it: it * scale
batches = functools.partial(get_batch, "train")

def counter():
    global calls
    calls = calls + 1
    return calls

calls = 0
'''

CELL = '''
model = "the cell's model"
print(estimate_loss(), Probe().measure(), warmup(2), batches(), counter(), counter())
'''


def _notebook(source: str = NOTEBOOK) -> dict[str, Any]:
    """A notebook's namespace after running ``source`` in a cell (its source kept where
    ``inspect.getsource`` finds it, as IPython keeps its cells')."""
    filename = f"<notebook cell {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _on_the_instance(payload: bytes, code: str) -> dict[str, Any]:
    """The job's inputs loaded into a fresh namespace as the runtime does, then the cell."""
    namespace: dict[str, Any] = {"__name__": "__main__"}
    shipped.load(payload, namespace)
    exec(compile(code, "<cell>", "exec"), namespace)
    return namespace


def test_notebook_functions_read_the_cells_live_variables(tmp_path: Path) -> None:
    notebook = _notebook()
    cap = capture(CELL, notebook, tmp_path)
    # What the functions read from the notebook travels too, named on the line; the
    # cell's own model is not shipped: the functions read it on the instance.
    assert set(cap.inputs) == {"Probe", "batches", "calls", "counter", "estimate_loss",
                               "eval_iters", "get_batch", "scale", "warmup"}
    line = cap.shipping_line()
    assert "estimate_loss (reads get_batch, model)" in line, line
    assert "warmup (reads scale)" in line and "Probe (reads model)" in line, line
    job = prepare_job(cap.first_line("") + "\n" + CELL, inputs=cap.inputs)
    assert set(job.spec.inputs) == set(cap.inputs)

    ran = _on_the_instance(job.inputs, "import torch\n" + CELL + "after = estimate_loss()")
    assert ran["after"] == ("the cell's model", "val x3")
    assert ran["Probe"]().measure() == "the cell's model"
    # A global a function assigns is the instance's variable, seen by the cell.
    assert ran["calls"] == 2
    # The cell changes a setting: the functions see it, as a local run would.
    exec("eval_iters = 5\nscale = 1", ran)
    assert ran["get_batch"]("val") == "val x5" and ran["warmup"](2) == 2

    # cloudpickle alone (the old way) froze the notebook's model into the function.
    frozen = cloudpickle.loads(cloudpickle.dumps(notebook["estimate_loss"]))
    assert frozen() == ("the notebook's model", "val x3")


def test_a_function_reading_a_variable_only_the_cell_defines_works(tmp_path: Path) -> None:
    notebook = _notebook(NOTEBOOK.replace('model = "the notebook\'s model"\n', ""))
    assert "model" not in notebook
    cap = capture(CELL, notebook, tmp_path)
    job = prepare_job("import torch\n" + CELL + "after = estimate_loss()", inputs=cap.inputs)
    ran = _on_the_instance(job.inputs, "import torch\n" + CELL + "after = estimate_loss()")
    assert ran["after"][0] == "the cell's model"  # cloudpickle: NameError on the instance


def test_the_python_api_ships_what_a_notebook_function_reads() -> None:
    notebook = _notebook()
    job = prepare_job("out = get_batch('val')", inputs={"get_batch": notebook["get_batch"]})
    assert job.spec.inputs == ("eval_iters", "get_batch")
    assert _on_the_instance(job.inputs, "out = get_batch('val')")["out"] == "val x3"


def test_recursive_and_nested_functions_travel_linked(tmp_path: Path) -> None:
    notebook = _notebook('''
def fact(n):
    return 1 if n <= 1 else n * fact(n - 1)

def make(k):
    def inner(x):
        return x * k + offset
    return inner

offset = 1
times3 = make(3)
''')
    cap = capture("print(fact(5), times3(2))", notebook, tmp_path)
    assert set(cap.inputs) == {"fact", "offset", "times3"}
    assert "fact (reads" not in cap.shipping_line()  # its own name is not news
    job = prepare_job("x = 1", inputs=cap.inputs)
    ran = _on_the_instance(job.inputs, "offset = 100\nresult = (fact(5), times3(2))")
    assert ran["result"] == (120, 106)


# -- values registered in a Checkpoint follow their variables -------------------------

@pytest.fixture
def standalone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runtime as in a local session (checkpoints under ./.spotnb-local)."""
    for key in (channel.ENV_JOB_URI, channel.ENV_JOB_ID, channel.ENV_ATTEMPT,
                channel.ENV_SOCKET, channel.ENV_RESTORE_DIR, channel.ENV_SCRATCH):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    spot._finish()
    yield tmp_path
    spot._finish()


def _run_cell(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """``code`` at a cell's top level (module-level frame), then the runtime's end."""
    namespace.setdefault("__name__", "__main__")
    namespace["spot"] = spot
    exec(compile(textwrap.dedent(code), "<cell>", "exec"), namespace)
    spot._finish()
    return namespace


TRAIN = """
    import torch
    X = torch.zeros(2)
    best_val_loss = 1e9
    history = ("start",)
    smooth = None  # set in the loop's first step
    ckpt = spot.Checkpoint(w=w, best_val_loss=best_val_loss, history=history, X=X,
                           smooth=smooth)
    start = ckpt.restore()
    for step in range(start, STOP):
        w.add_(1.0)
        if 10.0 - step < best_val_loss:
            best_val_loss = 10.0 - step
        history = history + (step,)
        X = torch.full((2,), float(step))
        smooth = float(step) if smooth is None else 0.5 * smooth + step
        ckpt.save(step)
"""


def test_registered_values_are_saved_as_they_are_and_restored_into_the_cell(
        standalone: Path) -> None:
    first = _run_cell(TRAIN, {"w": torch.zeros(3), "STOP": 4})
    assert first["best_val_loss"] == 7.0 and first["history"] == ("start", 0, 1, 2, 3)

    # The next run of the cell (a resume): the variables come back as they were saved.
    again = _run_cell(TRAIN.replace("    for step in", "    resumed_at = start\n    for step in"),
                      {"w": torch.zeros(3), "STOP": 4})
    assert again["resumed_at"] == 4
    assert again["best_val_loss"] == 7.0, "a float is saved as it is at each save"
    assert again["history"] == ("start", 0, 1, 2, 3)
    assert torch.equal(again["X"], torch.full((2,), 3.0)), "a rebound tensor too"
    assert again["smooth"] == first["smooth"] == 4.25, "and a value registered as None"
    assert torch.equal(again["w"], torch.full((3,), 4.0))
    ckpt = again["ckpt"]
    assert ckpt["best_val_loss"] == 7.0
    ckpt["best_val_loss"] = 0.5  # ckpt[name] = value sets the variable it follows
    assert again["best_val_loss"] == 0.5


def test_a_batch_sliced_from_the_data_is_restored_without_writing_into_the_data(
        standalone: Path) -> None:
    cell = """
        import numpy as np
        import torch
        data = torch.arange(100.0)
        table = np.arange(100.0)
        X, row = data[0:4], table[0:4]  # views into the data sets
        ckpt = spot.Checkpoint(X=X, row=row)
        start = ckpt.restore()
        for step in range(start, 3):
            X, row = data[10 * step + 10:10 * step + 14], table[50:54]
            ckpt.save(step)
    """
    _run_cell(cell, {})
    again = _run_cell(cell.replace("for step", "resumed = X.tolist()\n        for step"), {})
    assert again["resumed"] == [30.0, 31.0, 32.0, 33.0]  # the batch saved last
    assert torch.equal(again["data"], torch.arange(100.0)), "the data set is untouched"
    assert (again["table"] == np.arange(100.0)).all()


def test_a_wrapped_module_keeps_the_registered_one_in_the_checkpoint(standalone: Path) -> None:
    cell = _run_cell("""
        import torch
        model = torch.nn.Linear(2, 2)
        ckpt = spot.Checkpoint(model=model)
        inner = model
        model = torch.nn.DataParallel(model)  # as torch.compile(model) would wrap it
        ckpt.save(0)
        keys = sorted(ckpt["model"].state_dict())
    """, {})
    assert cell["keys"] == ["bias", "weight"]  # not module.weight
    assert cell["model"].module is cell["inner"]


@pytest.mark.parametrize(("code", "words"), [
    ("best_val_loss = 1e9\nckpt = spot.Checkpoint(best=best_val_loss)",
     "Register it under the variable's own name, spot.Checkpoint(..., "
     "best_val_loss=best_val_loss)"),
    ("def train():\n    best = 1e9\n    return spot.Checkpoint(best=best)\ntrain()",
     "best is a float in a local variable of train()"),
    ("def train(cfg):\n    return spot.Checkpoint(cfg=cfg)\ntrain((1, 2))",
     "Keep it in a dict that the checkpoint holds"),
])
def test_a_value_that_would_be_frozen_is_refused_at_registration(
        standalone: Path, code: str, words: str) -> None:
    with pytest.raises(TypeError, match=re.escape(words)):
        _run_cell(code, {})


def test_literals_and_objects_changed_in_place_register_as_before(standalone: Path) -> None:
    cell = _run_cell("""
        stats = {"seen": 0}
        def register(stats):
            return spot.Checkpoint(stats=stats, epoch=0, tag="run-1")
        ckpt = register(stats)
        ckpt["epoch"] = 3
        stats["seen"] = 5
        ckpt.save(0)
    """, {})
    again = _run_cell("""
        stats = {"seen": 0}
        ckpt = spot.Checkpoint(stats=stats, epoch=0, tag="run-1")
        ckpt.restore()
    """, {})
    assert again["stats"] == {"seen": 5} and again["ckpt"]["epoch"] == 3
    assert cell["ckpt"]["tag"] == "run-1"


# -- what the analysis reports before launch -----------------------------------------

NANOGPT = '''import time
import torch
X, Y = get_batch("train")
best_val_loss = 1e9
t0 = time.time()
ckpt = spot.Checkpoint(model=model, optimizer=optimizer, scaler=scaler)
for iter_num in range(ckpt.restore(), max_iters):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
    for micro_step in range(accum):
        logits, loss = model(X, Y)
        loss = loss / accum
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    t1 = time.time()
    dt, t0 = t1 - t0, t1
    spot.log(iter_num, loss=loss.item() * accum, lr=lr)
    ckpt.maybe_save(iter_num)
'''


def _findings(code: str, namespace: dict[str, Any] | None = None) -> list[str]:
    return [f.text for f in check_resume(code, namespace)]


def test_a_prefetched_batch_and_a_best_loss_are_named_with_the_fix() -> None:
    (finding,) = _findings(NANOGPT)
    assert finding.startswith("X, Y and best_val_loss are carried from one iteration of "
                              "the loop at line 7 to the next (X: line 16 reads it before "
                              "the iteration assigns it at line 18)"), finding
    assert "spot.Checkpoint(..., X=X, Y=Y, best_val_loss=best_val_loss)" in finding
    # The fix it proposes is enough: the same cell, registered, has nothing to say.
    fixed = NANOGPT.replace("scaler=scaler)", "scaler=scaler, X=X, Y=Y, "
                            "best_val_loss=best_val_loss)")
    assert _findings(fixed) == []


SAMPLE = '''
import random
def draw():
    return random.random()
ckpt = spot.Checkpoint(model=model)
for step in range(ckpt.restore(), 10):
    train_step()
    ckpt.maybe_save(step)
'''


@pytest.mark.parametrize(("after", "words"), [
    ("    X, Y = torch.randint(0, 9, (2,)), 1", "draws from the global RNG (torch.randint)"),
    ("    idx = torch.randperm(10)", "(torch.randperm)"),
    ("    noise = np.random.rand(3)", "(np.random.rand)"),
    ("    random.shuffle(data)", "(random.shuffle)"),
    ("    if step % 5 == 0:\n        sample = draw()", "(random.random in draw())"),
    ("    x = nb_batch()", "(torch.randint in nb_batch())"),
    ("    w = torch.empty(3).normal_()", "(.normal_())"),
])
def test_a_global_rng_draw_after_the_save_is_named(after: str, words: str) -> None:
    notebook = _notebook("import torch\ndef nb_batch():\n    return torch.randint(0, 5, (2,))\n")
    source = "import numpy as np\nimport torch\n" + SAMPLE + after + "\n"
    # (random.shuffle(data) also changes data in every step: a finding of its own.)
    (finding,) = [f for f in _findings(source, notebook) if "global RNG" in f]
    assert words in finding and "after the checkpoint is saved (line 10)" in finding, finding
    assert "move the draw before the save" in finding


@pytest.mark.parametrize("after", [
    "    X = torch.randint(0, 9, (2,), generator=g)",  # its own generator
    "    print(step)",
    "    spot.log(step, loss=1.0)",
])
def test_what_does_not_draw_from_the_global_rng_after_the_save_passes(after: str) -> None:
    assert _findings("import torch\n" + SAMPLE.replace("model=model", "model=model, g=g")
                     + after + "\n") == []


@pytest.mark.parametrize(("code", "words"), [
    # A running average and a list of losses
    ("ema = 0.0\nckpt = spot.Checkpoint(model=model)\n"
     "for step in range(ckpt.restore(), 9):\n    ema = 0.9 * ema + 0.1 * f()\n"
     "    ckpt.maybe_save(step)", "ema is carried from one iteration of the loop at line 3"),
    ("losses = []\nckpt = spot.Checkpoint(model=model)\n"
     "for step in range(ckpt.restore(), 9):\n    losses.append(f())\n"
     "    ckpt.maybe_save(step)", "(losses: line 4 changes it in every iteration)"),
    # An unregistered scheduler, stepped in the loop
    ("ckpt = spot.Checkpoint(model=model, optimizer=opt)\n"
     "for step in range(ckpt.restore(), 9):\n    opt.step()\n    sched.step()\n"
     "    ckpt.maybe_save(step)", "(sched: line 4 steps it in every iteration)"),
    # A GradScaler stepped in the loop but not registered
    ("ckpt = spot.Checkpoint(model=model, optimizer=opt)\n"
     "for step in range(ckpt.restore(), 9):\n    scaler.scale(f()).backward()\n"
     "    scaler.step(opt)\n    scaler.update()\n    ckpt.maybe_save(step)",
     "scaler is carried from one iteration of the loop at line 2 to the next (scaler: "
     "line 4 steps it in every iteration)"),
    # A value checked every few steps: read before it is assigned on most steps
    ("ckpt = spot.Checkpoint(model=model)\nfor step in range(ckpt.restore(), 9):\n"
     "    if step % 3 == 0:\n        val = evaluate()\n    spot.log(step, val=val)\n"
     "    ckpt.maybe_save(step)", "val is carried"),
    # A while loop whose counter is not the restored step
    ("ckpt = spot.Checkpoint(model=model)\nckpt.restore()\nn = 0\nwhile n < 9:\n"
     "    n += 1\n    ckpt.maybe_save(n)", "n is carried"),
    # An iterator
    ("it = iter(loader)\nckpt = spot.Checkpoint(model=model)\n"
     "for step in range(ckpt.restore(), 9):\n    batch = next(it)\n    ckpt.maybe_save(step)",
     "it is an iterator the loop at line 3 advances (line 4)"),
    # A loop over a data loader the checkpoint does not hold
    ("ckpt = spot.Checkpoint(model=model)\nstep = ckpt.restore()\nfor batch in loader:\n"
     "    step += 1\n    ckpt.maybe_save(step)",
     "the loop at line 3 goes over loader from its first item every time"),
    ("ckpt = spot.Checkpoint(model=model)\nfor step in range(100):\n    ckpt.maybe_save(step)",
     "loop over range(ckpt.restore(), N)"),
    # Registered under another name, then assigned
    ("best = 1e9\nckpt = spot.Checkpoint(best_loss=best)\n"
     "for step in range(ckpt.restore(), 9):\n    best = min(best, f())\n"
     "    ckpt.maybe_save(step)", "spot.Checkpoint(best_loss=best) holds the object given"),
    # A counter the cell's function keeps as a global
    ("n_seen = 0\ndef train_step():\n    global n_seen\n    n_seen += 1\n"
     "ckpt = spot.Checkpoint(model=model)\nfor step in range(ckpt.restore(), 9):\n"
     "    train_step()\n    ckpt.maybe_save(step)",
     "(n_seen: line 7 changes it through train_step() in every iteration)"),
    # A checkpoint registered in a function cannot follow its variables
    ("def train():\n    best = 1e9\n    ckpt = spot.Checkpoint(model=model, best=best)\n"
     "    for step in range(ckpt.restore(), 9):\n        best = min(best, f())\n"
     "        ckpt.maybe_save(step)\ntrain()", "at the cell's top level"),
])
def test_state_the_checkpoint_does_not_hold_is_named(code: str, words: str) -> None:
    found = _findings(code)
    assert len(found) == 1 and words in found[0], found


@pytest.mark.parametrize("code", [
    # The quickstart's loop: a per-step batch and loss, a registered optimizer and
    # scheduler, a range from restore().
    json.loads((REPO / "notebooks" / "quickstart.ipynb").read_text())["cells"],
    # A while loop over the restored step, a timer, a progress bar.
    "import time\nfrom tqdm import tqdm\nckpt = spot.Checkpoint(model=model, opt=opt)\n"
    "step = ckpt.restore()\nbar = tqdm(total=9)\nt0 = time.perf_counter()\nwhile step < 9:\n"
    "    loss = f()\n    opt.step()\n    t1 = time.perf_counter()\n    dt = t1 - t0\n"
    "    t0 = t1\n    bar.update(1)\n    ckpt.maybe_save(step)\n    step += 1",
    # A loop over a registered loader; gradient accumulation with a per-step total.
    "ckpt = spot.Checkpoint(model=model, optimizer=opt, loader=loader)\n"
    "step = ckpt.restore()\nfor batch in loader:\n    total = 0.0\n"
    "    for micro in range(4):\n        loss = f(batch, micro)\n        total += loss\n"
    "    opt.step()\n    spot.log(step, loss=total)\n    ckpt.maybe_save(step)\n"
    "    step += 1",
    # State kept in a registered dict; ckpt[...] updated by the cell itself.
    "stats = {'best': 1e9}\nbest = 1e9\nckpt = spot.Checkpoint(model=model, stats=stats)\n"
    "for step in range(ckpt.restore(), 9):\n    stats['best'] = min(stats['best'], f())\n"
    "    best = min(best, f())\n    ckpt['best'] = best\n    ckpt.maybe_save(step)",
    # No checkpoint at all: nothing resumes, nothing to say.
    "total = 0\nfor i in range(9):\n    total += i",
])
def test_common_correct_cells_raise_no_alarm(code: Any) -> None:
    if isinstance(code, list):  # the quickstart notebook's cells
        code = next("".join(c["source"]).split("\n", 1)[1] for c in code
                    if "".join(c["source"]).startswith("%%spot_train"))
    assert _findings(code) == []


def test_the_warning_is_one_line_naming_everything() -> None:
    text = resume_warning(check_resume(NANOGPT + "    sample = torch.multinomial(p, 1)\n"))
    assert text is not None and "\n" not in text
    assert text.startswith("this cell will not resume exactly after an interruption: "
                           "X, Y and best_val_loss are carried")
    assert "line 28 draws from the global RNG (torch.multinomial) after the checkpoint is " \
        "saved (line 27)" in text
    assert resume_warning([]) is None


@pytest.mark.slow
def test_the_warning_is_the_cells_first_output_line(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    monkeypatch.chdir(tmp_path)
    ip = start_ipython() or get_ipython()
    ip.run_line_magic("load_ext", "spotnb")
    ip.user_ns["STEPS"] = 3
    try:
        with capture_output() as out:
            ip.run_cell_magic("spot_train", "--detach --name told", textwrap.dedent("""
                import random
                best = 1e9
                ckpt = spot.Checkpoint(state={})
                for step in range(ckpt.restore(), STEPS):
                    best = min(best, random.random())
                    ckpt.maybe_save(step)
            """))
        lines = out.stdout.splitlines()
        # Line numbers are the notebook cell's: line 1 is the %%spot_train line.
        assert lines[0] == (
            "[spotnb] warning: this cell will not resume exactly after an interruption: "
            "best is carried from one iteration of the loop at line 6 to the next (best: "
            "line 7 reads it before the iteration assigns it at line 7) and the checkpoint "
            "does not hold it: register it in the Checkpoint (spot.Checkpoint(..., "
            "best=best)). Fix the cell, or run it as it is if these values need not "
            "survive an interruption"), lines
        assert lines[1].startswith("[spotnb] shipping inputs STEPS")
    finally:
        del ip.user_ns["STEPS"]
        for job in spotnb.jobs():
            spotnb.attach(job.job_id).stop()
            spotnb.attach(job.job_id).wait(timeout=120)


# -- the example notebook ---------------------------------------------------------------

def _outputs(cell: Any) -> str:
    return "".join(o.get("text", "") if o["output_type"] == "stream"
                   else o.get("data", {}).get("text/plain", "") + "\n"
                   for o in cell.get("outputs", []))


def _figures(nb: Any) -> dict[str, str]:
    """The last cell's ``best val loss``, ``final val loss`` and ``weights`` lines."""
    return dict(re.findall(r"^(best val loss|final val loss|weights) (\S+)$",
                           _outputs(nb.cells[-1]), re.MULTILINE))


@pytest.mark.slow
# A kernel, three attempts and the uninterrupted run in a second kernel beside them:
# about 50 s on a busy 2-core machine (torch on one thread: tests/conftest.py).
@pytest.mark.timeout(900)
def test_the_gpt_example_resumes_twice_and_ends_as_the_uninterrupted_run(
        spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the interruptions the notebook asks for: the Spot Advisor hazard is off.
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    for name in ("gpt.ipynb", "model.py"):
        shutil.copy(REPO / "notebooks" / name, tmp_path / name)
    # The same notebook with the training cell run in its own kernel, uninterrupted
    # and without spotnb's instance, beside the job (it needs nothing of it; its steps
    # without the pause that lets the interruptions land mid-run, which changes no
    # number): compared below, the same figures, the same weights bit for bit.
    reference = nbformat.read(tmp_path / "gpt.ipynb", as_version=4)
    cell = next(c for c in reference.cells if c.source.startswith("%%spot_train"))
    cell.source = "from spotnb import runtime as spot\n" + cell.source.split("\n", 1)[1]
    settings = next(c for c in reference.cells if "STEP_SECONDS = " in c.source)
    settings.source, paused = re.subn(r"STEP_SECONDS = [\d.]+", "STEP_SECONDS = 0",
                                      settings.source)
    assert paused == 1, settings.source
    (tmp_path / "local").mkdir()
    shutil.copy(tmp_path / "model.py", tmp_path / "local" / "model.py")
    nbformat.write(reference, tmp_path / "local" / "gpt.ipynb")
    uninterrupted_run = beside(run_notebook, tmp_path / "local" / "gpt.ipynb")
    run = run_notebook(tmp_path / "gpt.ipynb", tmp_path / "executed.ipynb")
    uninterrupted = uninterrupted_run.result(timeout=600)
    assert run.ok, run.failure
    nb = nbformat.read(run.output, as_version=4)
    train = next(c for c in nb.cells if c.source.startswith("%%spot_train"))
    text = _outputs(train)
    # Nothing to warn about: the first line says what was shipped, the helpers by name
    # with what they read (the model is the cell's, read on the instance).
    first = text.splitlines()[0]
    assert first.startswith("[spotnb] shipping inputs "), text
    assert "estimate_loss (reads eval_iters, get_batch, model)" in first, first
    assert "get_batch (reads batch_size, block_size, train_data, val_data)" in first, first
    assert "files model.py" in first

    (job,) = spotnb.jobs()
    assert (job.status, job.interruptions, job.attempts) == ("completed", 2, 3)
    starts = [int(s) for s in re.findall(r"attempt \d: starting at step (\d+)", text)]
    assert len(starts) == 3 and starts[0] == 0 < starts[1] < starts[2], text
    # estimate_loss() measured the model being trained: the val loss fell.
    val = [float(v) for v in re.findall(r"val loss (\d+\.\d+)", text)]
    assert len(val) >= 5 and val[-1] < val[0] - 1.0, text

    # The uninterrupted run: the same figures, the same weights bit for bit.
    assert uninterrupted.ok, uninterrupted.failure
    expected = _figures(nbformat.read(uninterrupted.output, as_version=4))
    assert set(expected) == {"best val loss", "final val loss", "weights"}, expected
    assert _figures(nb) == expected
