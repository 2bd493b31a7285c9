"""A plain DataLoader registered in spot.Checkpoint resumes mid-epoch at its batch.

Each case trains a small model with dropout (draws from the global torch RNG at every
step) on a shuffled loader for three epochs, uninterrupted; then the same code is
killed right after a durable save (SIGKILL, a subprocess) or stopped (in-process), and
run again: the batches after the resume, their order and the final weights must be
bitwise those of the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_runtime import ENV_KEYS
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from spotnb.protocol.spec import CheckpointEvery
from spotnb.train import loaders
from spotnb.train import runtime as spot

# torchdata 0.11's StatefulDataLoader calls a torch function that torch 2.13 deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")


class Numbers(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """37 samples: the value of a sample is its index (so a batch names its indices)."""

    def __init__(self, loads: list[int] | None = None) -> None:
        self.loads = loads  # the indices whose data was loaded (single-process)

    def __len__(self) -> int:
        return 37

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.loads is not None:
            self.loads.append(i)
        return torch.full((3,), float(i)), torch.tensor(i % 5)


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """An iterable dataset of 30 samples whose order is drawn from the global RNG."""

    def __len__(self) -> int:
        return 30

    def __iter__(self) -> Any:
        for i in torch.randperm(30).tolist():
            yield torch.full((3,), float(i)), torch.tensor(i % 5)


def _loader(kind: str, workers: int = 0, generator: bool = False, persistent: bool = False,
            drop_last: bool = False, loads: list[int] | None = None) -> DataLoader[Any]:
    extra: dict[str, Any] = ({"num_workers": workers, "persistent_workers": persistent}
                             if workers else {})
    if kind == "dist":
        sampler: DistributedSampler[Any] = DistributedSampler(Numbers(loads), num_replicas=2,
                                                              rank=1, seed=3)
        return DataLoader(Numbers(loads), batch_size=4, sampler=sampler,
                          drop_last=drop_last, **extra)
    if kind == "stream":
        return DataLoader(Stream(), batch_size=4, **extra)
    if kind == "stateful":
        stateful = pytest.importorskip("torchdata.stateful_dataloader")
        return stateful.StatefulDataLoader(Numbers(loads), batch_size=4, shuffle=True,
                                           **extra)
    g = torch.Generator().manual_seed(1) if generator else None
    return DataLoader(Numbers(loads), batch_size=4, shuffle=True, drop_last=drop_last,
                      generator=g, **extra)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 5))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _train(loader: DataLoader[Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
           ckpt: Any, start: int, epochs: int, stop_at: int = -1) -> list[tuple[int, list[int]]]:
    """The cell's loop: (step, indices of its batch) for each step run."""
    seen = []
    n = len(loader)
    step = start
    for epoch in range(start // n, epochs):
        sampler = loader.sampler
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append((step, x[:, 0].int().tolist()))
            if step == stop_at:
                ckpt.save(step)
                ckpt.wait()
                return seen
            step += 1
    return seen


def _digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _seed() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


@pytest.fixture
def standalone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """spot.* without a job: checkpoints in ./.spotnb-local (each attempt a new session)."""
    spot._finish()
    for key in ENV_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    spot._finish()


def _run(stop_at: int, epochs: int = 3, **kw: Any) -> tuple[list[tuple[int, list[int]]], str]:
    """One attempt in this process: fresh objects, as the cell re-run from the top."""
    _seed()
    loader = _loader(**kw)
    model, opt = _model()
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
    start = ckpt.restore()
    seen = _train(loader, model, opt, ckpt, start, epochs, stop_at)
    spot._finish()
    return seen, _digest(model)


CASES: dict[str, tuple[dict[str, Any], int]] = {
    # (loader settings, the step the first attempt stops after); 10 batches an epoch
    # (9 with drop_last).
    "mid-epoch, no generator": ({"kind": "shuffle"}, 13),
    "mid-epoch, a generator": ({"kind": "shuffle", "generator": True}, 4),
    "after the first batch": ({"kind": "shuffle"}, 10),
    "the epoch's last batch": ({"kind": "shuffle", "drop_last": True}, 17),
    "DistributedSampler": ({"kind": "dist"}, 12),
    "workers": ({"kind": "shuffle", "workers": 2}, 14),
    "persistent workers, third epoch": ({"kind": "shuffle", "workers": 2, "persistent": True,
                                         "generator": True}, 23),
    # torchdata's loader keeps its own position: saved through its state_dict.
    "StatefulDataLoader": ({"kind": "stateful"}, 13),
    "StatefulDataLoader, workers": ({"kind": "stateful", "workers": 2}, 14),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_plain_loader_resumes_at_its_batch(standalone: Path, case: str) -> None:
    kw, stop_at = CASES[case]
    reference, final = _run(-1, **kw)
    shutil.rmtree(standalone / spot.LOCAL_DIR, ignore_errors=True)
    first, _ = _run(stop_at, **kw)
    torch.manual_seed(12345)  # the new attempt's process: the RNGs are anywhere
    random.seed(12345)
    second, resumed = _run(-1, **kw)
    assert first == reference[:stop_at + 1]
    assert second[0][0] == stop_at + 1
    assert second == reference[stop_at + 1:]  # the same batches, in the same order
    assert resumed == final  # and the same weights: dropout's draws went on too


def test_the_skipped_batches_are_not_loaded(standalone: Path) -> None:
    loads: list[int] = []
    _run(5, loads=loads, kind="shuffle")
    loads.clear()
    second, _ = _run(-1, epochs=1, loads=loads, kind="shuffle")
    # Only the rest of the epoch was read: 37 - 6 batches of 4 = 13 samples.
    assert sorted(loads) == sorted(i for _, batch in second for i in batch)
    assert len(loads) == 37 - 6 * 4


def test_an_iterable_dataset_is_read_up_to_its_position(
    standalone: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reference, final = _run(-1, kind="stream")
    shutil.rmtree(standalone / spot.LOCAL_DIR, ignore_errors=True)
    _run(3, kind="stream")
    with caplog.at_level(logging.WARNING, logger="spotnb.train.loaders"):
        second, resumed = _run(-1, kind="stream")
    assert second == reference[4:] and resumed == final
    assert "reads and drops the 4 batches" in caplog.text


def test_a_different_epoch_starts_at_its_first_batch(
    standalone: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _seed()
    loader = _loader("dist")
    model, opt = _model()
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
    _train(loader, model, opt, ckpt, 0, 1, stop_at=3)
    spot._finish()
    loader = _loader("dist")
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
    assert ckpt.restore() == 4
    assert isinstance(loader.sampler, DistributedSampler)
    loader.sampler.set_epoch(5)  # not the epoch that was interrupted
    with caplog.at_level(logging.WARNING, logger="spotnb.train.loaders"):
        batches = list(loader)
    assert len(batches) == len(loader)  # the whole epoch 5, not its last batches
    assert "saved in epoch 0 of its sampler (set_epoch) at batch 4" in caplog.text


def test_the_loader_stays_the_users_object() -> None:
    loader = _loader("shuffle", workers=2)
    cls = type(loader)
    assert loaders.resumable(loader) is loader
    assert isinstance(loader, cls) and type(loader).__name__ == "DataLoader"
    assert len(loader) == 10 and loader.batch_size == 4
    stateful: Any = loader
    assert stateful.state_dict()["complete"] is True  # not iterated yet: nothing to skip
    with pytest.raises(ValueError, match="not the state of a plain data loader"):
        stateful.load_state_dict({"sampler_iter_yielded": 3})
    # A loader with a state of its own (torchdata's StatefulDataLoader) keeps it.

    class Stateful(DataLoader[Any]):
        def state_dict(self) -> dict[str, Any]:
            return {"mine": 1}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            pass

    own = Stateful(Numbers(), batch_size=4)
    assert loaders.resumable(own) is own and type(own) is Stateful


_CELL = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from test_loaders import _digest, _loader, _model, _seed, _train
    from spotnb.train import runtime as spot

    stop_at = int(sys.argv[1])
    _seed()
    loader = _loader("shuffle", workers=2, persistent=True)
    model, opt = _model()
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
    start = ckpt.restore()
    seen = _train(loader, model, opt, ckpt, start, 3, stop_at)
    for step, batch in seen:
        print("batch", step, batch, flush=True)
    if stop_at >= 0:
        os.kill(os.getpid(), signal.SIGKILL)  # the instance is gone, nothing flushed
    print("result", _digest(model), flush=True)
    """
)


@pytest.mark.slow  # three training runs with worker processes
def test_a_killed_attempt_resumes_at_its_batch(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    code = _CELL.format(tests=str(Path(__file__).parent))

    def run(where: Path, stop_at: int) -> subprocess.CompletedProcess[str]:
        where.mkdir(exist_ok=True)
        return subprocess.run([sys.executable, "-c", code, str(stop_at)], cwd=where, env=env,
                              capture_output=True, text=True, timeout=300)

    reference = run(tmp_path / "alone", -1)
    assert reference.returncode == 0, reference.stderr
    first = run(tmp_path / "job", 16)
    assert first.returncode == -signal.SIGKILL, first.stderr
    second = run(tmp_path / "job", -1)
    assert second.returncode == 0, second.stderr
    ref_lines = reference.stdout.splitlines()
    lines = second.stdout.splitlines()
    assert lines[0].startswith("batch 17 ")
    assert lines == ref_lines[17:]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_loaders_resumed_iter_draws_nothing_from_the_global_rngs(
    workers: int
) -> None:
    # The uninterrupted run drew the epoch's seeds before the save; the resumed
    # iterator of torchdata's loader draws them again unless spotnb undoes it.
    loader = loaders.resumable(_loader("stateful", workers=workers))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    again = loaders.resumable(_loader("stateful", workers=workers))
    again.load_state_dict(state)
    before = torch.get_rng_state()
    batch = next(iter(again))
    assert torch.equal(torch.get_rng_state(), before)
    assert batch[0][:, 0].tolist() == next(it)[0][:, 0].tolist()


def _epochs_with_an_end(stop_after_save_at: int) -> tuple[list[Any], str]:
    """One attempt of a cell whose epochs end with work after the loop over the loader
    (an evaluation over another DataLoader, which draws from the global torch RNG; a
    scheduler stepped per epoch; a history): ``maybe_save`` every step. It stops (as a
    kill would) right after the first save made at or after step
    ``stop_after_save_at``; -1: runs to the end."""
    _seed()
    loader = _loader("shuffle", drop_last=True)  # 9 batches an epoch
    val = DataLoader(Numbers(), batch_size=16)
    model, opt = _model()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    history: list[Any] = []
    ckpt = spot.Checkpoint(model=model, opt=opt, sched=sched, loader=loader,
                           history=history)
    spot._rt().every = CheckpointEvery(seconds=None, steps=1)
    step = ckpt.restore()
    for epoch in range(step // len(loader), 3):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            saved = ckpt.maybe_save(step)
            if saved and 0 <= stop_after_save_at <= step:
                ckpt.wait()
                spot._finish()
                return history, _digest(model)
            step += 1
        with torch.no_grad():
            val_loss = sum(F.cross_entropy(model(x), y).item() for x, y in val)
        sched.step()
        history.append((epoch, round(val_loss, 6)))
    spot._finish()
    return history, _digest(model)


def test_a_save_due_at_an_epochs_last_batch_waits_for_the_epochs_end(
        standalone: Path) -> None:
    """Saved at the epoch's last batch, a resumed run would start the next epoch and never
    run this epoch's end: its evaluation, its scheduler step, its history entry (and the
    evaluation's draw from the global RNG would be missing from the next epoch's
    shuffle). The save due there is taken at the next step instead."""
    reference = _epochs_with_an_end(-1)
    assert len(reference[0]) == 3
    shutil.rmtree(standalone / spot.LOCAL_DIR, ignore_errors=True)
    _epochs_with_an_end(8)  # step 8 is the first epoch's last batch
    torch.manual_seed(12345)  # the new attempt's process: the RNGs are anywhere
    resumed = _epochs_with_an_end(-1)
    assert resumed == reference


def test_a_save_after_the_loop_over_the_loader_is_not_delayed(standalone: Path) -> None:
    """Once the loop over the loader is over, the epoch's end is behind: a save there (a
    cell that saves once per epoch) is taken at once, also after a loop that stopped at
    the last batch without asking the loader for more (its iterator never ended)."""
    loader = _loader("shuffle")
    model, opt = _model()
    ckpt = spot.Checkpoint(model=model, opt=opt, loader=loader)
    spot._rt().every = CheckpointEvery(seconds=None, steps=1)
    for epoch in range(2):
        for _ in loader:
            pass
        assert ckpt.maybe_save(epoch + 1)
    for epoch in range(2, 4):
        for _ in itertools.islice(loader, len(loader)):
            pass
        assert ckpt.maybe_save(epoch + 1)
