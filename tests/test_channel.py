"""The channel between the agent and the runtime: every op typed, listed, handled."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from spotnb.kernel_remote import channel
from spotnb.protocol import layout
from spotnb.protocol.spec import JobSpec, Policy, Resources
from spotnb.protocol.store import LocalStore

ROOT = Path(__file__).resolve().parent.parent / "spotnb"


def _agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    from spotnb.kernel_remote.agent import Agent

    monkeypatch.chdir(tmp_path)
    # The agent's socket directory: here, not a new one in /tmp left behind.
    (tmp_path / "sock").mkdir()
    monkeypatch.setenv("SPOTNB_AGENT_SOCKET_DIR", str(tmp_path / "sock"))
    store = LocalStore(tmp_path / "job")
    spec = JobSpec(job_id="j-chan", name="chan", code="x = 1", provider="local",
                   resources=Resources(("g4dn.xlarge",)), policy=Policy(),
                   store_uri=store.uri, created=time.time())
    store.put(layout.SPEC, spec.to_json().encode())
    return Agent(store.uri)


def test_every_op_the_agent_handles_is_in_the_protocol_and_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(tmp_path, monkeypatch)
    assert set(agent.handlers) == set(channel.TO_AGENT)  # type: ignore[attr-defined]
    # ... and the protocol's text describes each op, both ways.
    doc = channel.__doc__ or ""
    for op in {*channel.TO_AGENT, *channel.TO_RUNTIME}:
        assert f'``{{"op": "{op}"' in doc, f"the protocol does not describe {op!r}"


def test_the_runtime_sends_only_typed_messages_of_the_protocol() -> None:
    # Every send of the runtime (and of the agent) builds a message of the protocol:
    # no dict is written to the channel by hand (only the codec, channel.py, makes one).
    import ast

    sent: set[str] = set()
    for path in [*(ROOT / "train").rglob("*.py"), *(ROOT / "kernel_remote").rglob("*.py")]:
        if path.name == "channel.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and any(
                    isinstance(k, ast.Constant) and k.value == "op" for k in node.keys):
                pytest.fail(f"{path.name}:{node.lineno} builds a message by hand")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "channel" \
                    and isinstance(getattr(channel, node.func.attr, None), type) \
                    and issubclass(getattr(channel, node.func.attr), channel.Message):
                sent.add(getattr(channel, node.func.attr).op)
    ops = {*channel.TO_AGENT, *channel.TO_RUNTIME}
    assert sent == ops, ops ^ sent
    from spotnb.train.session import Session

    # The runtime's handlers are its bound methods: no session needs to be set up.
    assert set(Session.__new__(Session).handlers()) == set(channel.TO_RUNTIME)


def test_messages_are_typed_and_round_trip() -> None:
    message = channel.parse({"op": "checkpoint", "phase": "begin", "id": "c1", "step": 3})
    assert isinstance(message, channel.CheckpointPhase)
    assert message.step == 3 and message.bytes is None
    assert message.to_dict() == {"op": "checkpoint", "phase": "begin", "id": "c1", "step": 3}
    assert channel.decode(channel.encode(channel.FenceReply(id=4, ok=True))) == {
        "op": "fence", "id": 4, "ok": True, "unknown": False}
    assert channel.decode(channel.encode(channel.Notice(kind="join"))) == {
        "op": "notice", "kind": "join"}
    with pytest.raises(channel.UnknownOp, match="'bogus'"):
        channel.parse({"op": "bogus"})


def test_every_op_reads_back_as_it_was_sent() -> None:
    examples = [
        channel.Hello(pid=7), channel.Metrics(rows=[[1, 2.5, {"loss": 0.5}]]),
        channel.CheckpointPhase(phase="durable", id="c", step=3, forced=False, join=True,
                                bytes=10, seconds=1.5, stall=0.1),
        channel.CheckpointPhase(phase="failed", id="c", step=3, forced=True, bytes=0,
                                seconds=0.0, error="OSError: full"),
        channel.Restored(id="c", step=3, seconds=0.2),
        channel.Sync(name="ck", phase="durable", id="s", files=2, bytes=9, step=4,
                     forced=True),
        channel.Usage(requests={"s3": {"PutObject": 3}}),
        channel.Replay(attempt=2, rows=[[1, 2.0, {}]], events=['{"type": "stream"}'],
                       checkpoint={"id": "c", "phase": "durable"}, saved=12.5),
        channel.Unlogged(id=3, mark="tok"), channel.Fence(id=4), channel.Mark(token="t"),
        channel.Parked(step=5), channel.Reform(step=None, join=True), channel.Reform(step=6),
        channel.Caution(kind="notice-fit", text="too slow"),
        channel.Params(params={"lr": 0.1}, source="transformers"),
        channel.Progress(total=100, source="range"),
        channel.Ping(until=5.5), channel.Ping(),
        channel.Notice(kind="instance-action", action="terminate", time="2026-01-01T00:00Z"),
        channel.UnloggedReply(id=3, events=["{}"], next=9),
        channel.FenceReply(id=4, ok=False, unknown=True), channel.Durable(t=3.5),
        channel.Error(about="bogus", error="unknown"),
    ]
    assert {type(m) for m in examples} == {*channel.TO_AGENT.values(),
                                           *channel.TO_RUNTIME.values()}
    for message in examples:
        ops = channel.TO_RUNTIME if type(message) in channel.TO_RUNTIME.values() \
            else channel.TO_AGENT
        assert channel.parse(channel.decode(channel.encode(message)), ops) == message
    # What a peer sends that a field cannot hold is refused, or read as nothing.
    with pytest.raises(ValueError):
        channel.parse({"op": "parked", "step": "x"})
    assert channel.parse({"op": "ping", "until": "soon"}, channel.TO_RUNTIME) == channel.Ping()
    assert channel.parse({"op": "unlogged", "id": 1, "events": "x"},
                         channel.TO_RUNTIME) == channel.UnloggedReply(id=1)
    assert channel.parse({"op": "replay", "attempt": 2, "checkpoint": {"id": 5},
                          "saved": 1.0}) == channel.Replay(attempt=2)


def test_an_unknown_op_is_answered_with_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent(tmp_path, monkeypatch)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        agent.handle_message({"op": "bogus", "x": 1}, ours)  # type: ignore[attr-defined]
        with theirs.makefile("rb") as lines:
            reply = channel.decode(lines.readline())
    assert reply["op"] == "error" and reply["about"] == "bogus"
    assert "does not know the op 'bogus'" in reply["error"]


def test_the_agents_parts_and_the_node_use_no_private_name_of_another_module() -> None:
    # The agent's seams are public: no module of kernel_remote/ (multinode/ too) imports
    # a private name of another module, or reaches into the agent's private members.
    import ast

    offenders = []
    for path in (ROOT / "kernel_remote").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("spotnb"):
                offenders += [f"{path.name}: imports {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__")]
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                owner = node.value
                name = owner.attr if isinstance(owner, ast.Attribute) else \
                    owner.id if isinstance(owner, ast.Name) else ""
                if name == "agent":
                    offenders.append(f"{path.name}:{node.lineno}: agent.{node.attr}")
    assert not offenders, offenders
