"""``spotnb aws selftest``: its refusals and its plan, its run on the simulator, and the
run on real AWS (marked ``aws``: only with credentials, ``SPOTNB_AWS_TESTS=1`` and a
budget in ``SPOTNB_AWS_SELFTEST_BUDGET``, in USD)."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spotnb.client import aws_selftest
from spotnb.client.aws_selftest import Sizes, expected_result
from spotnb.client.cli import main as cli_main
from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto


@contextlib.contextmanager
def requests() -> Iterator[list[str]]:
    """Every AWS request spotnb's clients make meanwhile (before it is sent)."""
    sent: list[str] = []
    remove = _boto.add_hook("before-call.*", lambda event_name="", **kw: sent.append(
        event_name))
    try:
        yield sent
    finally:
        remove()


def test_the_selftest_refuses_to_start_without_a_budget() -> None:
    with requests() as sent:
        with pytest.raises(SpecError, match=r"starts billed spot instances: give it a "
                                            r"budget, e\.g\. --budget 1"):
            aws_selftest.run(None)
        with pytest.raises(SpecError, match="positive amount"):
            aws_selftest.run(0)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert cli_main(["aws", "selftest"]) == 2
        assert "give it a budget" in err.getvalue()
    assert sent == [], "refused before any AWS request"


def test_the_plan_costs_about_a_dollar_and_says_what_each_step_proves() -> None:
    chosen = aws_selftest.plan("us-east-1")
    assert [s.name for s, _ in chosen] == ["setup", "doctor", "quickstart", "standby",
                                           "multinode", "cleanup"]
    total = sum(cost for _, cost in chosen)
    assert 0.3 < total <= 1.0, total
    assert all(s.proves for s, _ in chosen)
    # A budget under the bound is refused, before anything starts.
    with requests() as sent, pytest.raises(
            SpecError, match=rf"may cost up to \${total:.2f}, above the budget of "
                             r"\$0\.50.*--steps quickstart"):
        aws_selftest.run(0.5, region="us-east-1")
    assert sent == []
    # Fewer steps, a smaller bound; setup and cleanup always run.
    few = aws_selftest.plan("us-east-1", steps=["quickstart"])
    assert [s.name for s, _ in few] == ["setup", "quickstart", "cleanup"]
    with pytest.raises(SpecError, match="no selftest step quikstart"):
        aws_selftest.plan("us-east-1", steps=["quikstart"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["aws", "--region", "us-east-1", "selftest", "--budget", "1",
                         "--dry-run"]) == 0
    text = out.getvalue()
    assert "standby    at most $" in text and "proves a rebalance recommendation" in text
    assert "(dry run: nothing was started)" in text


class _Checkpoint:
    """``spot.Checkpoint`` for a run with no instance: nothing saved, nothing restored."""

    def __init__(self, **state: Any) -> None:
        self.state = dict(state)

    def restore(self) -> int:
        return 0

    def __getitem__(self, name: str) -> Any:
        return self.state[name]

    def __setitem__(self, name: str, value: Any) -> None:
        self.state[name] = value

    def maybe_save(self, step: int) -> bool:
        return False


class _Spot:
    """The ``spot`` a cell sees, for a run with no instance."""

    Checkpoint = _Checkpoint
    attempt = 0  # no instance, no attempt: the first attempt's hold is not this run's

    @staticmethod
    def log(step: int, **values: Any) -> None:
        pass


def test_the_cells_result_is_the_uninterrupted_runs() -> None:
    # The value a run must end with is computed here, with no instance: the cells run
    # the same integer recurrence, which no GPU or library version can change.
    namespace: dict[str, Any] = {"STEPS": 37, "STEP_SECONDS": 0.0, "spot": _Spot}
    exec(aws_selftest.SINGLE_CELL, namespace)
    assert namespace["result"] == expected_result(37) != expected_result(36)


def test_the_multi_node_cell_trains_its_steps_and_ends_in_a_whole_world(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The multinode step's cell in a world of one process (gloo, as on the nodes):
    # whole (NODES=1), it stops at STEPS with the uninterrupted result; the steps it
    # took are what the step checks the result against.
    pytest.importorskip("torch")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)

    namespace: dict[str, Any] = {"STEPS": 37, "STEP_SECONDS": 0.0, "NODES": 1,
                                 "spot": _Spot}
    exec(aws_selftest.MULTI_CELL, namespace)
    assert (namespace["result"], namespace["steps"], namespace["world"]) == (
        expected_result(37), 37, 1)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_selftest_runs_on_the_simulator(spotnb_home: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The whole plan, against the simulator: the same code as on AWS, shorter jobs.
    pytest.importorskip("torch")
    from spotnb.testing import AwsSimulator

    monkeypatch.setenv("SPOTNB_AWS_CAPACITY_POLL", "0.5")
    monkeypatch.setattr(aws_selftest, "CLEANUP_POLL_SECONDS", 1.0)
    said: list[str] = []
    with AwsSimulator(tmp_path / "sim") as sim:
        sim.notice_seconds = 20.0  # FIS's two minutes: room for the final saves
        outcomes = aws_selftest.run(
            1.0, region="us-east-1", say=said.append,
            sizes=Sizes(steps=90, step_seconds=0.05, standby_lead=780.0,
                        require_gpu=False, step_timeout=300.0))
        sim.wait_until_idle(60)
    report = {o.step: (o.ok, o.detail) for o in outcomes}
    assert all(ok for ok, _ in report.values()), "\n".join(said)
    assert "across 1 FIS interruption" in report["quickstart"][1]
    assert "moved to its warm standby" in report["standby"][1]
    assert "2 -> 1" in report["multinode"][1]
    assert report["cleanup"][1].startswith("nothing left")


# ------------------------------------------------------------------ real AWS


def _real_aws() -> bool:
    if os.environ.get("SPOTNB_AWS_TESTS") != "1" or os.environ.get("AWS_ENDPOINT_URL") \
            or not os.environ.get("SPOTNB_AWS_SELFTEST_BUDGET"):
        return False
    try:
        return _boto.session().get_credentials() is not None
    except Exception:
        return False


@pytest.mark.aws
@pytest.mark.skipif(not _real_aws(), reason=(
    "needs AWS credentials, SPOTNB_AWS_TESTS=1 and SPOTNB_AWS_SELFTEST_BUDGET (USD): "
    "starts billed spot instances"))
@pytest.mark.timeout(3 * 3600)
def test_real_aws_selftest(spotnb_home: Path) -> None:
    """`spotnb aws selftest` on a real account: every step passes and nothing is left."""
    said: list[str] = []
    outcomes = aws_selftest.run(float(os.environ["SPOTNB_AWS_SELFTEST_BUDGET"]),
                                region=os.environ.get("AWS_DEFAULT_REGION"),
                                say=said.append)
    assert all(o.ok for o in outcomes), "\n".join(said)
