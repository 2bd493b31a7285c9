"""Training recipes nobody here wrote, as researchers write them, resume exactly or are
told why not before launch.

The habits (each found by running such a recipe through interruptions on the local
cloud and comparing with the same cell run uninterrupted):

* an EMA of the weights updated in place through ``zip(ema.parameters(),
  model.parameters())`` (or ``torch._foreach_lerp_``), and a ``best_state`` kept when the
  accuracy improves and handed back with ``--out``;
* the epoch's end after the loop over the loader (evaluation, a scheduler stepped per
  epoch, early-stopping bookkeeping): a save due at the epoch's last batch waits for it
  (:func:`spotnb.train.loaders.in_last_batch`, tested in ``test_loaders.py``);
* ``maybe_save`` inside a ``train_one_epoch()`` helper of the notebook, whose
  ``enumerate(loader)`` counts from 0 again when the loader resumes mid-epoch;
* ``iter(loader)`` + ``next()`` over a registered loader (it resumes: no alarm), an
  ``itertools.cycle`` (it does not);
* a hand-written epoch: ``random.shuffle(indices)`` at its start, a loop over
  ``range(steps_per_epoch)``, bookkeeping after it;
* a hand-written loop over ``next()`` with NumPy noise drawn without seeding in the
  cell (``np.random.seed`` in an earlier cell: the notebook's random states travel with
  the job), a step counted in a ``global`` by a notebook helper, a smoothed loss that
  starts as ``None``, an evaluation after the save over a loader (a draw from torch's
  global RNG unless the loader has a generator of its own).

The fast tests read cells with :func:`spotnb.client.carried.check_resume`; the slow ones
run three of the recipes, fixed as the warnings say, on the local cloud with a notice at
an epoch's last batch and a kill, and compare them bit for bit with the same notebook
run without spotnb's instance.
"""

from __future__ import annotations

import linecache
import random
import re
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import numpy as np
import pytest
import torch
from helpers import beside
from nbformat.v4 import new_code_cell, new_notebook

import spotnb
from spotnb.client.carried import check_resume
from spotnb.client.notebook import run_notebook
from spotnb.client.validation import prepare_job
from spotnb.protocol import inputs as shipped


def _notebook(source: str) -> dict[str, Any]:
    """A notebook's namespace after running ``source`` in a cell, its source kept where
    ``inspect.getsource`` finds it (as IPython keeps its cells')."""
    source = textwrap.dedent(source)
    filename = f"<notebook cell {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace


def _findings(cell: str, namespace: dict[str, Any] | None = None, outputs: tuple[str, ...] = ()
              ) -> list[str]:
    """The findings' texts; line 1 is the cell's first line of code."""
    return [f.text for f in check_resume(textwrap.dedent(cell).lstrip("\n"), namespace,
                                         outputs)]


# -- an EMA of the weights, a best state -----------------------------------------------

EMA = """
    import copy, torch
    ema = copy.deepcopy(model)
    best_acc, best_state = 0.0, None
    ckpt = spot.Checkpoint(model=model, optimizer=opt, loader=loader, best_acc=best_acc)
    step = ckpt.restore()
    for epoch in range(step // len(loader), 5):
        for x, y in loader:
            opt.step()
            with torch.no_grad():
                for ema_p, p in zip(ema.parameters(), model.parameters()):
                    ema_p.mul_(0.99).add_(p, alpha=0.01)
            ckpt.maybe_save(step)
            step += 1
        acc = evaluate(ema)
        if acc > best_acc:
            best_acc = acc
            best_state = copy.deepcopy(ema.state_dict())
"""


LOADER = {"loader": torch.utils.data.DataLoader(list(range(8)), batch_size=2)}


def test_an_ema_updated_through_its_parameters_is_named() -> None:
    (finding,) = _findings(EMA, LOADER)
    assert finding.startswith(
        "ema is carried from one iteration of the loop at line 7 to the next (ema: line 11 "
        "changes it through ema_p.mul_() in every iteration)"), finding
    assert "spot.Checkpoint(..., ema=ema)" in finding


@pytest.mark.parametrize("update", [
    # timm's ModelEmaV2 and torch's AveragedModel
    "ema.update(model)",
    "ema.update_parameters(model)",
    # a list of the EMA's tensors made before the loop, updated with one foreach call
    "torch._foreach_lerp_(ema_params, list(model.parameters()), 0.01)",
    # its state dict's tensors, by key
    "for k, v in model.state_dict().items():\n                    ema_sd[k].mul_(0.99)",
])
def test_every_way_of_updating_an_ema_in_place_is_seen(update: str) -> None:
    cell = EMA.replace("    ema = copy.deepcopy(model)\n", "    ema = copy.deepcopy(model)\n"
                       "    ema_params = list(ema.parameters())\n    ema_sd = ema.state_dict()\n")
    cell = re.sub(r"for ema_p, p in zip.*\n.*\n", update + "\n", cell)
    assert any(f.startswith("ema is carried") for f in _findings(cell, LOADER)), \
        _findings(cell, LOADER)


def test_a_best_state_set_now_and_then_and_handed_back_is_named() -> None:
    found = _findings(EMA, LOADER, outputs=("best_state",))
    (finding,) = [f for f in found if f.startswith("best_state")]
    assert finding == (
        "best_state is set in some iterations of the loop at line 6 only (line 17) and it is "
        "an output of the cell (--out): a run resumed after the last iteration that set it "
        "has the value from before the loop: register it in the Checkpoint "
        "(spot.Checkpoint(..., best_state=best_state))")
    # Read after the loop, the same.
    after = EMA + "    model.load_state_dict(best_state)\n"
    assert any("line 18 reads it after the loop" in f for f in _findings(after, LOADER))


def test_the_ema_and_the_best_state_registered_raise_no_alarm() -> None:
    fixed = EMA.replace("best_acc=best_acc)", "best_acc=best_acc, ema=ema,\n"
                        "                           best_state=best_state)")
    assert _findings(fixed, LOADER, outputs=("best_state",)) == []


# -- a train_one_epoch() helper of the notebook that saves ------------------------------

HELPER = """
    import torch.nn.functional as F

    def train_one_epoch(model, loader, optimizer, ckpt, epoch):
        model.train()
        total = 0.0
        for i, (x, y) in enumerate(loader):
            step = epoch * len(loader) + i
            for g in optimizer.param_groups:
                g["lr"] = lr_at(step)
            loss = F.cross_entropy(model(x), y)
            optimizer.step()
            total += loss.item()
            ckpt.maybe_save(step)
        return total / len(loader)
"""

HELPER_CELL = """
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    ckpt = spot.Checkpoint(model=model, optimizer=optimizer, plateau=plateau, loader=loader)
    start = ckpt.restore()
    for epoch in range(start // len(loader), 4):
        train_loss = train_one_epoch(model, loader, optimizer, ckpt, epoch)
        plateau.step(validate(model))
"""


def test_a_save_in_a_notebook_helper_is_followed_into_it() -> None:
    notebook = _notebook(HELPER)
    enumerated, total = _findings(HELPER_CELL, {
        "train_one_epoch": notebook["train_one_epoch"], **LOADER})
    # The lines are those of the helper's own cell, as a traceback would show them.
    assert enumerated.startswith(
        "the loop at line 7 in train_one_epoch() numbers the batches of loader with "
        "enumerate(), which counts from 0 again when a run resumes in the middle of an "
        "epoch (the loader continues at the batch it was at), so i (read at line 8)"), \
        enumerated
    assert "enumerate(loader, start=<the batches done in that epoch>)" in enumerated
    assert total.startswith("total is carried from one iteration of the loop at line 7 in "
                            "train_one_epoch() to the next"), total
    assert "total is a local variable of train_one_epoch(), which a checkpoint cannot " \
        "follow: keep it in a dict that the Checkpoint holds" in total


def test_the_helper_fixed_as_told_raises_no_alarm() -> None:
    fixed = _notebook(HELPER.replace(
        "ckpt, epoch):", "ckpt, epoch, first, stats):").replace(
        "        total = 0.0\n", "").replace(
        "enumerate(loader)", "enumerate(loader, start=first)").replace(
        "total += loss.item()", "stats['total'] += loss.item()").replace(
        "return total", "return stats['total']"))
    cell = HELPER_CELL.replace("loader=loader)", "loader=loader, stats=stats)").replace(
        "    start = ckpt.restore()\n", "    start = ckpt.restore()\n"
        "    first_epoch = start // len(loader)\n").replace(
        "range(start // len(loader), 4):\n", "range(first_epoch, 4):\n"
        "        first = start % len(loader) if epoch == first_epoch else 0\n").replace(
        "ckpt, epoch)\n", "ckpt, epoch, first, stats)\n        stats['total'] = 0.0\n")
    cell = "stats = {'total': 0.0}\n" + textwrap.dedent(cell)
    assert _findings(cell, {"train_one_epoch": fixed["train_one_epoch"], **LOADER}) == []


def test_enumerate_over_a_registered_loader_in_the_cell_is_named() -> None:
    # A Hugging Face no_trainer loop: the index decides when the optimizer steps.
    cell = """
        ckpt = spot.Checkpoint(model=model, optimizer=opt, train_dataloader=train_dataloader)
        completed_steps = ckpt.restore()
        for epoch in range(completed_steps // steps_per_epoch, epochs):
            for step, batch in enumerate(train_dataloader):
                loss = model(**batch).loss / accum
                loss.backward()
                if (step + 1) % accum == 0 or step == len(train_dataloader) - 1:
                    opt.step()
                    ckpt.maybe_save(completed_steps)
                    completed_steps += 1
    """
    (finding,) = _findings(cell, {"train_dataloader": torch.utils.data.DataLoader([1])})
    assert "numbers the batches of train_dataloader with enumerate()" in finding
    assert "so step (read at line 7)" in finding
    started = cell.replace("enumerate(train_dataloader)",
                           "enumerate(train_dataloader, start=first)")
    assert _findings(started, {"train_dataloader": torch.utils.data.DataLoader([1])}) == []


# -- iterators over a registered loader --------------------------------------------------

ITERATOR = """
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=train_loader)
    start = ckpt.restore()
    train_iter = iter(train_loader)
    for step in range(start, 100):
        try:
            x, y = next(train_iter)
        except StopIteration:
            train_iter = iter(train_loader)
            x, y = next(train_iter)
        opt.step()
        ckpt.maybe_save(step)
"""


def test_iter_of_a_registered_loader_after_restore_raises_no_alarm() -> None:
    # The loader resumes its epoch at the first iter() after restore(): tested in
    # test_loaders.py; this cell resumed bitwise on the local cloud.
    loader = {"train_loader": torch.utils.data.DataLoader([1])}
    assert _findings(ITERATOR, loader) == []
    before = ITERATOR.replace("    start = ckpt.restore()\n    train_iter = iter(train_loader)\n",
                              "    train_iter = iter(train_loader)\n    start = ckpt.restore()\n")
    (finding,) = _findings(before, loader)
    assert finding.startswith("train_iter = iter(...) at line 2 is made before ckpt.restore() "
                              "(line 3)"), finding
    assert finding.endswith("make it after ckpt.restore()")


def test_a_cycle_or_an_unregistered_loader_is_still_named() -> None:
    cycled = "import itertools\n" + textwrap.dedent(ITERATOR).lstrip().replace(
        "train_iter = iter(train_loader)", "train_iter = itertools.cycle(train_loader)")
    (finding,) = _findings(cycled)
    assert finding.startswith("train_iter is an itertools.cycle() (it repeats the items of "
                              "its first pass) the loop at line 5 advances"), finding
    unregistered = ITERATOR.replace(", loader=train_loader", "")
    (finding,) = _findings(unregistered)
    assert finding.startswith("train_iter is an iterator the loop at line 4 advances"), finding


# -- a hand-written epoch ----------------------------------------------------------------

MANUAL = """
    import random
    ckpt = spot.Checkpoint(model=model, opt=opt)
    step = ckpt.restore()
    indices = list(range(N))
    for epoch in range(step // steps_per_epoch, EPOCHS):
        random.shuffle(indices)
        for b in range(steps_per_epoch):
            idx = indices[b * B:(b + 1) * B]
            opt.step()
            ckpt.maybe_save(step)
            step += 1
"""


def test_a_shuffle_at_the_epochs_start_is_named_with_the_right_fix() -> None:
    found = _findings(MANUAL)
    indices, shuffle, starts_over = found
    assert indices.startswith("indices is changed at the start of each iteration of the loop "
                              "at line 5 (line 6), from its value in the iteration before"), indices
    assert shuffle.startswith("line 6 draws from the global RNG (random.shuffle) at the start "
                              "of each iteration of the loop at line 5, before the loop at "
                              "line 7, which saves"), shuffle
    assert "random.Random(seed + epoch)" in shuffle
    assert "start it at the step saved (range(start % n, n) there" in starts_over
    # Fixed as told: the epoch's order from the epoch, the inner loop from the step.
    fixed = MANUAL.replace("    indices = list(range(N))\n", "").replace(
        "        random.shuffle(indices)\n", "        indices = list(range(N))\n"
        "        random.Random(seed + epoch).shuffle(indices)\n").replace(
        "range(steps_per_epoch)", "range(step % steps_per_epoch, steps_per_epoch)")
    assert _findings(fixed) == []


def test_bookkeeping_after_an_inner_loop_that_saves_is_named_unless_it_is_a_loader() -> None:
    cell = MANUAL.replace("opt=opt)", "opt=opt, history=history)") + \
        "        history.append(epoch)\n"
    cell = cell.replace("        random.shuffle(indices)\n", "")
    (_, after) = _findings(cell)
    assert after.startswith("line 11 changes history after the loop at line 6 ends, and a "
                            "save at its last step comes before it: a run resumed from that "
                            "save skips it"), after
    loader = cell.replace("for b in range(steps_per_epoch):", "for x, y in loader:").replace(
        "opt=opt, history", "opt=opt, loader=loader, history")
    assert _findings(loader, LOADER) == []


@pytest.mark.parametrize(("start", "words"), [
    # a sum registered and reset at the epoch's start: the resumed run resets it again
    ("        running = 0.0\n", "line 6 assigns running at the start of each iteration"),
    # a scheduler stepped per epoch, at the start
    ("        sched.step()\n", "line 6 steps sched at the start of each iteration"),
    # the RNG seeded per epoch: the resumed run's steps draw the epoch's first numbers
    ("        torch.manual_seed(7 + epoch)\n",
     "line 6 draws from the global RNG (torch.manual_seed) at the start of each iteration"),
])
def test_a_change_of_registered_state_at_the_epochs_start_is_named(start: str,
                                                                   words: str) -> None:
    cell = f"""
    running = 0.0
    ckpt = spot.Checkpoint(model=model, opt=opt, sched=sched, loader=loader, running=running)
    step = ckpt.restore()
    for epoch in range(step // len(loader), 9):
{start}        for x, y in loader:
            running += opt.step()
            ckpt.maybe_save(step)
            step += 1
"""
    (finding,) = _findings("import torch\n" + textwrap.dedent(cell).lstrip(), LOADER)
    fix = "seed per step instead" if "seed" in start else \
        "do it at the end of each iteration instead"
    assert finding.startswith(words) and fix in finding, finding  # line 1: import torch


@pytest.mark.parametrize(("cell", "words"), [
    # a registered scheduler stepped after the save: the resumed run never steps it
    ("ckpt = spot.Checkpoint(model=model, opt=opt, sched=sched)\n"
     "for step in range(ckpt.restore(), 9):\n    opt.step()\n    ckpt.maybe_save(step)\n"
     "    sched.step()\n", "line 5 steps sched after the checkpoint is saved (line 4)"),
    # epochs counted from 0 again around a registered loader
    ("ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)\n"
     "step = ckpt.restore()\nfor epoch in range(10):\n    for x, y in loader:\n"
     "        ckpt.maybe_save(step)\n        step += 1\n",
     "the loop at line 3 goes over range(10) from its first item"),
])
def test_what_a_resumed_run_skips_or_redoes_is_named(cell: str, words: str) -> None:
    (finding,) = _findings(cell)
    assert finding.startswith(words), finding


@pytest.mark.parametrize("cell", [
    # the learning rate set through the optimizer's groups, gradients cleared by hand
    "ckpt = spot.Checkpoint(model=model, opt=opt)\nfor step in range(ckpt.restore(), 9):\n"
    "    for g in opt.param_groups:\n        g['lr'] = lr_at(step)\n"
    "    for p in model.parameters():\n        p.grad = None\n"
    "    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)\n    ckpt.maybe_save(step)",
    # augmentation of a batch indexed out of the data (a copy): the data is not changed
    "ckpt = spot.Checkpoint(model=model)\nfor step in range(ckpt.restore(), 9):\n"
    "    x = X[idx]\n    x.add_(noise)\n    ckpt.maybe_save(step)",
    # epochs skipped by hand from the restored step
    "ckpt = spot.Checkpoint(model=model, loader=loader)\nstart = ckpt.restore()\n"
    "for epoch in range(10):\n    if epoch < start // len(loader):\n        continue\n"
    "    for x in loader:\n        ckpt.maybe_save(start)\n        start += 1",
    # per-step reseeding at the top of the loop, a validation loader before the save
    "ckpt = spot.Checkpoint(model=model, opt=opt)\nfor step in range(ckpt.restore(), 9):\n"
    "    torch.manual_seed(7 + step)\n    opt.step()\n    if step % 3 == 0:\n"
    "        model.eval()\n        val = sum(float(b) for b in val_loader)\n"
    "        model.train()\n    ckpt.maybe_save(step)",
])
def test_correct_recipes_raise_no_alarm(cell: str) -> None:
    assert _findings("import torch\n" + cell, LOADER) == []


# -- an evaluation after the save -----------------------------------------------------------

def test_an_evaluation_over_a_loader_after_the_save_is_a_draw() -> None:
    """Iterating a DataLoader draws its epoch's seed from torch's global RNG (even
    unshuffled, without workers): an evaluation after the save, every N steps, is a draw
    the resumed run does not make, and every later dropout mask differs."""
    before = torch.get_rng_state()
    list(torch.utils.data.DataLoader(list(range(4))))
    assert not torch.equal(before, torch.get_rng_state())
    notebook = _notebook("""
        def evaluate(model, loader):
            return sum(float(model(x)) for x in loader)
    """)
    namespace = {"evaluate": notebook["evaluate"], **LOADER,
                 "val_loader": torch.utils.data.DataLoader([1])}
    cell = """
        ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
        for step in range(ckpt.restore(), 100):
            opt.step()
            ckpt.maybe_save(step)
            if step % 10 == 0:
                print(evaluate(model, val_loader))
    """
    (finding,) = _findings(cell, namespace)
    assert finding.startswith("line 6 draws from the global RNG (iterating val_loader in "
                              "evaluate()) after the checkpoint is saved (line 4)"), finding
    assert "give the loader a generator of its own" in finding
    # Before the save, or over a loader with a generator of its own: nothing to say.
    moved = cell.replace("            ckpt.maybe_save(step)\n", "") + \
        "            ckpt.maybe_save(step)\n"
    assert _findings(moved, namespace) == []
    seeded = torch.utils.data.DataLoader([1], generator=torch.Generator().manual_seed(0))
    assert _findings(cell, {**namespace, "val_loader": seeded}) == []


# -- a file written on the instance --------------------------------------------------------

BEST_FILE = """
    best_val = float("inf")
    ckpt = spot.Checkpoint(model=model, opt=opt, best_val=best_val)
    for step in range(ckpt.restore(), 50):
        opt.step()
        if step % 10 == 0:
            val = validate(model)
            if val < best_val:
                best_val = val
                torch.save(model.state_dict(), "best.pt")
        ckpt.maybe_save(step)
    model.load_state_dict(torch.load("best.pt"))
"""


def test_a_best_model_saved_to_the_instances_disk_is_named() -> None:
    # With best_val registered, a resumed run that never beats it never writes best.pt
    # on its instance: torch.load fails at the end of the job.
    (finding,) = _findings("import torch\n" + textwrap.dedent(BEST_FILE).lstrip())
    assert finding.startswith("'best.pt' is written at line 10 (torch.save()) and read at "
                              "line 12 (torch.load()): the files a cell writes stay on the "
                              "disk of its instance"), finding
    assert "spot.sync_dir(...)" in finding
    synced = BEST_FILE.replace('"best.pt"', '"out/best.pt"').replace(
        "    best_val = ", '    spot.sync_dir("out")\n    best_val = ')
    assert _findings("import torch\n" + synced) == []


# -- the notebook's random states ------------------------------------------------------------

def test_the_notebooks_random_states_reach_the_instance() -> None:
    """``np.random.seed(0)`` in an earlier cell, then a cell that draws without seeding
    (an augmentation in the main process): the instance's kernel draws what the notebook
    would, so two jobs of the cell, and the cell run here, draw the same numbers."""
    def seed(n: int) -> None:
        random.seed(n)
        np.random.seed(n)
        torch.manual_seed(n)

    seed(1)
    expected = (random.random(), float(np.random.rand()), torch.rand(1).item())
    seed(1)
    job = prepare_job("x = np.random.rand()", inputs={"scale": 2})
    assert job.spec.inputs == ("scale",)  # not an input of the cell
    seed(99)  # the instance's kernel: its own states
    namespace: dict[str, Any] = {}
    shipped.load(job.inputs, namespace)
    assert set(namespace) == {"scale"}
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == expected


def test_the_random_states_load_where_numpy_is_not_installed() -> None:
    """The notebook imported NumPy; the instance's image has none (a cell that never
    imports it): the inputs still load (NumPy's state travels in plain Python types;
    as a NumPy array it failed the cell before its first line on the AWS simulator's
    image: ModuleNotFoundError)."""
    import subprocess
    import sys

    np.random.seed(3)
    job = prepare_job("x = 1", inputs={"scale": 2})
    script = ("import sys, cloudpickle\n"
              "sys.modules['numpy'] = None  # not installed\n"
              "from spotnb.protocol import inputs\n"
              "ns = {}\n"
              "inputs.load(sys.stdin.buffer.read(), ns)\n"
              "print(sorted(ns))\n")
    done = subprocess.run([sys.executable, "-c", script], input=job.inputs,
                          capture_output=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().strip() == "['scale']"


# -- end to end: three recipes fixed as told, interrupted, bitwise --------------------------

# The harness: a notice (or a kill) at a chosen (attempt, step), from inside the cell.
CHAOS = '''
import time

def chaos(step):
    """Interrupts this job at chosen steps (the test's harness, not the recipe)."""
    from spotnb.train import runtime
    what = PLAN.get((runtime.attempt, step))
    if what is None:
        return
    import spotnb
    job = spotnb.attach(runtime.job_id)
    if what == "notice":
        job.interrupt()
        while not runtime.interrupt_pending:
            time.sleep(0.05)
    else:
        ckpt.wait()  # the last save is durable: the kill redoes the steps since
        job.kill()
        time.sleep(600)
'''

DIGITS = '''
import copy, hashlib
import torch, torch.nn as nn, torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

digits = load_digits()
X = torch.tensor(digits.data / 16.0, dtype=torch.float32)
y = torch.tensor(digits.target)
train_loader = DataLoader(TensorDataset(X[:1400], y[:1400]), batch_size=100, shuffle=True,
                          num_workers=2, drop_last=True)
val_loader = DataLoader(TensorDataset(X[1400:], y[1400:]), batch_size=200)
EPOCHS, PATIENCE, EMA_DECAY = 4, 2, 0.9

def digest(state):
    return hashlib.sha256(b"".join(t.numpy().tobytes() for t in state.values())).hexdigest()[:16]

@torch.no_grad()
def evaluate(model, loader):
    model.eval()
    correct = sum((model(x).argmax(1) == y).sum().item() for x, y in loader)
    model.train()
    return correct / len(loader.dataset)
'''

# An MLP with dropout, AdamW and OneCycleLR, an EMA of the weights, early stopping on the
# EMA's accuracy and its best state, a running loss: registered as the warnings say.
DIGITS_CELL = '''
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
ema_model = copy.deepcopy(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2,
                                                total_steps=EPOCHS * len(train_loader))
best_acc, best_state, bad_epochs, history, running_loss = 0.0, None, 0, [], 0.0
ckpt = spot.Checkpoint(model=model, optimizer=optimizer, scheduler=scheduler,
                       loader=train_loader, ema_model=ema_model, best_acc=best_acc,
                       best_state=best_state, bad_epochs=bad_epochs, history=history,
                       running_loss=running_loss)
global_step = ckpt.restore()
for epoch in range(global_step // len(train_loader), EPOCHS):
    for xb, yb in train_loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        with torch.no_grad():
            for ema_p, p in zip(ema_model.parameters(), model.parameters()):
                ema_p.mul_(EMA_DECAY).add_(p, alpha=1 - EMA_DECAY)
        running_loss += loss.item()
        spot.log(global_step, loss=loss.item())
        chaos(global_step)
        ckpt.maybe_save(global_step)
        global_step += 1
    acc = evaluate(ema_model, val_loader)
    history.append((epoch, acc, running_loss))
    running_loss = 0.0
    if acc > best_acc:
        best_acc, bad_epochs, best_state = acc, 0, copy.deepcopy(ema_model.state_dict())
    else:
        bad_epochs += 1
        if bad_epochs >= PATIENCE:
            break
weights = digest(model.state_dict()) + " " + digest(ema_model.state_dict())
best = best_state and digest(best_state)
'''

# A notebook helper that saves, in the shape of Hugging Face's no_trainer scripts: the
# batch index from enumerate() decides when the optimizer steps (gradient accumulation
# over ACCUM batches, a global of the notebook that the helper reads), an LR warm-up
# from the step, a plateau scheduler stepped after each epoch's evaluation: fixed as the
# warnings say.
HELPER_NOTEBOOK = '''
ACCUM = 2

def train_one_epoch(model, loader, optimizer, ckpt, epoch, first, stats):
    model.train()
    for i, (x, y) in enumerate(loader, start=first):
        step = epoch * len(loader) + i
        loss = F.cross_entropy(model(x), y) / ACCUM
        loss.backward()
        stats["total"] += loss.item()
        if (i + 1) % ACCUM == 0 or i == len(loader) - 1:
            for g in optimizer.param_groups:
                g["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
            optimizer.step()
            optimizer.zero_grad()
            spot.log(step, loss=loss.item())
            chaos(step)
            ckpt.maybe_save(step)
    return stats["total"] / len(loader)
'''

HELPER_TRAIN = '''
torch.manual_seed(1)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=3e-3, momentum=0.9)
plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0)
stats = {"total": 0.0}
history = []
ckpt = spot.Checkpoint(model=model, optimizer=optimizer, plateau=plateau, loader=train_loader,
                       stats=stats, history=history)
start = ckpt.restore()
first_epoch = start // len(train_loader)
for epoch in range(first_epoch, EPOCHS):
    first = start % len(train_loader) if epoch == first_epoch else 0
    train_loss = train_one_epoch(model, train_loader, optimizer, ckpt, epoch, first, stats)
    stats["total"] = 0.0
    acc = evaluate(model, val_loader)
    plateau.step(-acc)
    history.append((epoch, train_loss, acc))
weights = digest(model.state_dict())
'''


# A hand-written loop over an iterator (the fix the warning gives for an
# itertools.cycle): next() over the registered loader, made again at each epoch's end,
# gradient accumulation over two micro-batches, a noise augmentation drawn from NumPy's
# global RNG without seeding in the cell (np.random.seed is in an earlier cell), the
# step counted in a global by a notebook helper that reads the cell's model and
# optimizer, a smoothed loss, an evaluation printed after the save every 5 steps over a
# validation loader with a generator of its own.
ITERATOR_NOTEBOOK = '''
import numpy as np
np.random.seed(0)
global_step = 0

def optimizer_step():
    global global_step
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    global_step += 1
'''

ITERATOR_TRAIN = '''
torch.manual_seed(2)
model = nn.Sequential(nn.Linear(64, 48), nn.GELU(), nn.Dropout(0.1), nn.Linear(48, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
val_loader = DataLoader(TensorDataset(X[1400:], y[1400:]), batch_size=200,
                        generator=torch.Generator().manual_seed(0))
ACCUM, MAX_STEPS = 2, 30
smooth_loss = None
ckpt = spot.Checkpoint(model=model, optimizer=optimizer, loader=train_loader,
                       global_step=global_step, smooth_loss=smooth_loss)
ckpt.restore()
batches = iter(train_loader)
while global_step < MAX_STEPS:
    for micro in range(ACCUM):
        try:
            xb, yb = next(batches)
        except StopIteration:
            batches = iter(train_loader)
            xb, yb = next(batches)
        xb = xb + torch.from_numpy(np.random.normal(0, 0.05, xb.shape).astype(np.float32))
        loss = F.cross_entropy(model(xb), yb) / ACCUM
        loss.backward()
    optimizer_step()
    smooth_loss = loss.item() if smooth_loss is None else 0.9 * smooth_loss + 0.1 * loss.item()
    spot.log(global_step, loss=smooth_loss)
    chaos(global_step)
    ckpt.maybe_save(global_step)
    if global_step % 5 == 0:
        print("val", global_step, evaluate(model, val_loader))
weights = digest(model.state_dict())
'''


def _run_both(tmp_path: Path, cells: list[str], train: str, plan: str, outputs: str) -> str:
    """The notebook with ``train`` under %%spot_train, interrupted as ``plan`` says, and
    beside it in a plain kernel without spotnb's instance: the ``outputs`` it hands back
    are the same (printed by the last cell)."""
    result = f"print({outputs})"

    def write(folder: str, first: str, magic: str, plan: str) -> Path:
        nb = new_notebook(cells=[new_code_cell(c) for c in [
            first, f"PLAN = {plan}", CHAOS, DIGITS, *cells, magic + "\n" + train, result]],
            metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}})
        (tmp_path / folder).mkdir()
        nbformat.write(nb, tmp_path / folder / "recipe.ipynb")
        return tmp_path / folder / "recipe.ipynb"

    local_nb = write("local", "pass", "from spotnb.train import runtime as spot", "{}")
    spot_nb = write("spot", "%load_ext spotnb", "%%spot_train --checkpoint-every "
                    f"4steps --out {outputs.replace(' ', '')}", plan)
    local_run = beside(run_notebook, local_nb, timeout=900)
    spot = run_notebook(spot_nb, timeout=900)
    local = local_run.result(timeout=900)
    assert spot.ok, spot.failure
    executed = nbformat.read(spot.output, as_version=4)
    text = "".join(o.get("text", "") for c in executed.cells for o in c.get("outputs", []))
    assert "[spotnb] warning" not in text, text  # fixed as told: nothing left to say
    (job,) = spotnb.jobs()
    # A notice, then an instance lost without one: two interruptions (the fold's one
    # definition), three attempts.
    assert (job.status, job.interruptions, job.attempts) == ("completed", 2, 3), text
    assert local.ok, local.failure
    # The last cell's printed line, however its stream came in pieces (a busy kernel
    # may flush one print in two outputs).
    expected = _printed(nbformat.read(local.output, as_version=4).cells[-1])
    assert _printed(executed.cells[-1]) == expected
    return expected


def _printed(cell: Any) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", ())
                   if o.get("output_type") == "stream")


@pytest.fixture
def recipe_env(spotnb_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")  # only the interruptions asked for
    return tmp_path


@pytest.mark.slow
# Three attempts and a plain kernel: about 2 minutes on a busy 2-core machine.
@pytest.mark.timeout(900)
def test_a_digits_classifier_with_an_ema_and_early_stopping_resumes_bitwise(
        recipe_env: Path) -> None:
    # 14 batches an epoch: the notice comes in the first epoch's last batch (its save
    # waits for the epoch's evaluation), the kill in the third epoch.
    result = _run_both(recipe_env, [], DIGITS_CELL, "{(1, 13): 'notice', (2, 33): 'kill'}",
                       "history, best_acc, bad_epochs, weights, best")
    assert result.startswith("[(0, ")  # the first epoch's entry was not skipped


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_notebook_helper_that_saves_resumes_bitwise(recipe_env: Path) -> None:
    # The notice in the second epoch's last batch, the kill in the middle of the third
    # (optimizer steps at the odd batch indices).
    result = _run_both(recipe_env, [HELPER_NOTEBOOK], HELPER_TRAIN,
                       "{(1, 27): 'notice', (2, 37): 'kill'}", "history, weights")
    assert result.count("(") >= 4  # every epoch's entry


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_hand_written_loop_over_an_iterator_resumes_bitwise(recipe_env: Path) -> None:
    # 7 optimizer steps an epoch: the notice comes in the first epoch's last batch
    # (the save waits for the next step, after the iterator is made again), the kill in
    # the third epoch. Without the notebook's random states on the instance, the noise
    # of the first attempt differs from the notebook's.
    result = _run_both(recipe_env, [ITERATOR_NOTEBOOK], ITERATOR_TRAIN,
                       "{(1, 7): 'notice', (2, 18): 'kill'}",
                       "global_step, smooth_loss, weights")
    assert result.startswith("30 ")  # every step done
