"""Hugging Face Trainer, PyTorch Lightning and Accelerate on spot instances.

The example notebooks (``notebooks/{transformers,lightning,accelerate}.ipynb``) run in
real kernels on the local cloud, as ``spotnb run`` runs them. Each training job is
interrupted twice (after step 2, before the framework's first periodic save, and after
step 14, after one), resumes through the framework's own resume argument, and must end
exactly where the same seeded code ends uninterrupted (the notebook's last cell runs
it in the notebook's kernel and compares optimizer steps, final loss and a digest of
the weights: bitwise, all three on CPU). From the job's event log: the saves forced by
the notices, no step logged twice, the framework's metrics and hyperparameters.

The core and the notebook side must not import the frameworks: checked in a fresh
interpreter where importing them fails.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nbformat
import pytest

import spotnb
from spotnb.client.notebook import run_notebook
from spotnb.protocol import layout

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
FRAMEWORKS = ("transformers", "lightning", "accelerate", "pytorch_lightning")


@pytest.fixture(autouse=True)
def _local_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    # Only the interruptions the notebooks ask for: the Spot Advisor hazard is off.
    monkeypatch.setenv("SPOTNB_LOCAL_HAZARD", "0")
    # The notice period: the local cloud's default (2 s, EC2's 2 minutes time-
    # compressed) is tight for a framework's save on a busy 2-core machine; 6 s is
    # still short, and the replacement starts when it is over.
    monkeypatch.setenv("SPOTNB_LOCAL_NOTICE_SECONDS", "6")


def test_core_and_notebook_side_never_import_a_framework() -> None:
    script = textwrap.dedent(f"""
        import importlib.abc, sys
        BLOCKED = {FRAMEWORKS!r}
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"{{name}} is not installed here")
                return None
        sys.meta_path.insert(0, Block())
        from IPython.testing.globalipapp import start_ipython
        ip = start_ipython()
        ip.run_line_magic("load_ext", "spotnb")
        import spotnb, spotnb.client.magics, spotnb.train.runtime, spotnb.records
        import spotnb.train.integrations
        from spotnb.train import runtime as spot
        assert spot.callbacks is spotnb.train.integrations
        ip.run_line_magic("spot_config", "")
        try:
            spot.callbacks.transformers()
        except ImportError as e:
            print("transformers:", e)
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        print("loaded:", loaded)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stdout
    # Asking for an integration without its framework says what is missing.
    assert "transformers: transformers is not installed here" in done.stdout


def _run_example(name: str, tmp_path: Path) -> Any:
    for file in (f"{name}.ipynb", "spot_demo.py", "digits_data.py"):
        shutil.copy(NOTEBOOKS / file, tmp_path / file)
    run = run_notebook(tmp_path / f"{name}.ipynb", tmp_path / "executed.ipynb")
    assert run.ok, run.failure
    return nbformat.read(run.output, as_version=4)


@pytest.mark.slow
# Three attempts (a kernel and the framework's imports each) and the uninterrupted run:
# about 100 s on a quiet 2-core machine, three times that on a busy one.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("name", "first_periodic_save", "params"), [
    ("transformers", 10, {"learning_rate": 0.001, "max_steps": 30, "model.n_layer": 2}),
    ("lightning", 10, {"lr": 0.01, "hidden": 32, "dropout": 0.2}),
    # every_steps=10 counts from the last save: step 9 on a fresh start, but the first
    # attempt is interrupted at step 2, so the first periodic save comes at 12.
    ("accelerate", 12, {"lr": 0.01, "batch": 64, "steps": 40}),
])
def test_example_interrupted_twice_ends_like_an_uninterrupted_run(
        spotnb_home: Path, tmp_path: Path, name: str, first_periodic_save: int,
        params: dict[str, Any]) -> None:
    nb = _run_example(name, tmp_path)

    # The notebook's last cell: the interrupted run against the uninterrupted one.
    compared = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    rows = dict(re.findall(r"^(optimizer steps|global step|final loss|weights) +(.*)$",
                           compared, re.MULTILINE))
    assert {"optimizer steps", "final loss", "weights"} <= set(rows), compared
    assert all(row.endswith(" same") for row in rows.values()), compared

    (job,) = spotnb.jobs()
    assert (job.status, job.interruptions, job.attempts) == ("completed", 2, 3)
    handle = spotnb.attach(job.job_id)
    events = list(handle.events(follow=False))

    # Each notice made the framework save at that step, durable before the instance went;
    # the first came before the framework's first periodic save.
    saves = [e for e in events if e.type == "checkpoint" and e.data.get("kind") == "sync"
             and e.data.get("phase") == "durable" and "step" in e.data]
    forced = [(e.attempt, e.data["step"]) for e in saves if e.data["forced"]]
    assert forced == [(1, 2), (2, 14)], forced
    periodic = [e.data["step"] for e in saves if not e.data["forced"]]
    assert periodic and min(periodic) == first_periodic_save > forced[0][1]
    parked = [e.data["detail"] for e in events if e.type == "status"
              and "is durable; waiting for the instance" in e.data.get("detail", "")]
    assert len(parked) == 2, parked

    # No step redone: every attempt logs only steps no earlier attempt logged, and
    # together they log every step once (the framework's logging reached spot.log).
    steps: dict[int, list[int]] = {}
    for e in events:
        if e.type == "metric" and "loss" in e.data["values"]:
            steps.setdefault(e.attempt, []).append(int(e.data["step"]))
    assert sorted(steps) == [1, 2, 3]
    logged = [s for attempt in sorted(steps) for s in steps[attempt]]
    assert logged == sorted(set(logged)), steps
    assert logged == list(range(logged[0], logged[-1] + 1))
    assert steps[1][-1] <= 2 and steps[2][-1] <= 14  # each attempt's logging ended at its notice

    # The framework's hyperparameters are in the job's record.
    record = json.loads(handle.store.get(layout.SUMMARY))
    assert record["params_source"] == [name]
    assert {k: record["params"].get(k) for k in params} == params


def test_transformers_params_are_recorded_without_secrets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TrainingArguments into log_params: bounded, JSON, tokens masked by the Trainer."""
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)  # standalone mode keeps its store here
    from transformers import TrainingArguments

    from spotnb.train import runtime as spot

    args = TrainingArguments(output_dir=str(tmp_path / "out"), hub_token="hf_secret",
                             report_to="none", use_cpu=True)
    cb = spot.callbacks.transformers()
    try:
        from transformers import TrainerControl, TrainerState

        cb.on_init_end(args, TrainerState(), TrainerControl())
        params = spot._rt().params
    finally:
        spot._finish()
    assert params["output_dir"] == str(tmp_path / "out")
    assert "hf_secret" not in json.dumps(params)
    assert all(isinstance(v, (type(None), bool, int, float, str, list)) for v in params.values())
    assert re.fullmatch(r"\w+", str(params["lr_scheduler_type"]))


# Notices after step 3 of attempt 1 and step 24 of attempt 2; attempt 3 stops moving
# one step after its periodic save of step 30, and the test kills it there.
LIGHTNING_KILLED = textwrap.dedent("""
    import time
    import lightning.pytorch as L
    import torch
    import spotnb

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Staging(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            step = trainer.global_step
            print(f"step {step}")
            if (spot.attempt, step) in ((1, 3), (2, 24)) and not spot.interrupt_pending:
                spotnb.attach(spot.job_id).interrupt()
                deadline = time.monotonic() + 300
                while not spot.interrupt_pending and time.monotonic() < deadline:
                    time.sleep(0.05)
            while (spot.attempt, step) == (3, 31):
                time.sleep(0.05)

    torch.manual_seed(0)
    X = torch.randn(64, 8)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(X, X.sum(1, keepdim=True)), batch_size=64)
    trainer = L.Trainer(max_steps=STEPS, logger=False, log_every_n_steps=1,
                        callbacks=[Staging(), spot.callbacks.lightning(every_n_train_steps=10)],
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", default_root_dir=".")
    trainer.fit(Net(), loader, ckpt_path="last")
""")


@pytest.mark.slow
@pytest.mark.timeout(900)  # four attempts, each a kernel and Lightning's imports
def test_lightning_notice_notice_kill_resumes_from_the_newest_save_and_loses_no_line(
        spotnb_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # After a notice SpotCheckpoint writes last.ckpt; the restored callback state named
    # the previous instance's directory, so Lightning's next periodic saves went to
    # last-v1.ckpt, last-v2.ckpt beside it, and after a kill ckpt_path="last" took
    # the last.ckpt of the second notice (step 24) although the snapshot held step 30.
    # Nobody follows the job: what attempt 3 logged and printed before the kill
    # reaches the log through the snapshot it saved.
    import psutil
    from helpers import wait_until
    from test_reliability import booted, kernel_of

    from spotnb.ckpt.checkpoints import CheckpointStore
    from spotnb.client import cli
    from spotnb.train.syncdir import sync_name

    steps = 40
    handle = spotnb.submit(LIGHTNING_KILLED, inputs={"STEPS": steps})
    snapshots = CheckpointStore(handle.store, f"sync/{sync_name('checkpoints')}")
    boot = wait_until(lambda: booted(handle, 3), 600, "attempt 3")

    def saved_30() -> bool:
        latest = snapshots.latest()
        return latest is not None and latest.metadata.get("step") == 30 \
            and latest.attempt == 3
    wait_until(saved_30, 300, "attempt 3's periodic save of step 30", interval=0.02)
    agent = psutil.Process(boot.data["pid"])
    kernel = kernel_of(agent.pid)
    agent.kill()
    _, alive = psutil.wait_procs([kernel], timeout=30)
    assert not alive, "the kernel outlived its agent"
    result = handle.wait(timeout=600)
    assert result.status == "completed", (result.reason, result.error)

    # Resumed from step 30: attempt 4 redoes at most what attempt 3 did after it.
    logged: dict[int, list[int]] = {}
    for step, attempt in ((int(e.data["step"]), e.attempt)
                          for e in handle.events(follow=False) if e.type == "metric"):
        logged.setdefault(attempt, []).append(step)
    assert sorted(logged) == [1, 2, 3, 4], logged
    redone = set(logged[3]) & set(logged[4])
    assert len(redone) <= 4, (sorted(redone), logged)
    # Every step's row and line, none missing, whatever was killed.
    every = sorted({s for s, _ in handle.metrics()["loss"]})
    assert every == list(range(every[0], steps)), every
    capsys.readouterr()
    assert cli.main(["logs", handle.job_id]) == 0
    printed = {int(line.split()[1]) for line in capsys.readouterr().out.splitlines()
               if re.fullmatch(r"step \d+", line)}
    assert printed == set(range(1, steps + 1)), sorted(set(range(1, steps + 1)) - printed)
