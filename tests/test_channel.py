"""The channel between the agent and the runtime: every op typed, listed, handled."""

from __future__ import annotations

import re
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


def test_every_op_the_runtime_sends_or_handles_is_in_the_protocol() -> None:
    sent: set[str] = set()
    for name in ("session.py", "runtime.py", "process.py", "syncdir.py"):
        text = (ROOT / "train" / name).read_text()
        sent |= set(re.findall(r'send\(\{"op": "(\w+)"', text))
    assert sent and sent <= set(channel.TO_AGENT), sent - set(channel.TO_AGENT)
    from spotnb.train.session import Session

    # The runtime's handlers are its bound methods: no session needs to be set up.
    assert set(Session.__new__(Session).handlers()) == set(channel.TO_RUNTIME)


def test_messages_are_typed_and_round_trip() -> None:
    message = channel.parse({"op": "checkpoint", "phase": "begin", "id": "c1", "step": 3})
    assert isinstance(message, channel.CheckpointPhase)
    assert message.get("step") == 3
    assert message.to_dict() == {"op": "checkpoint", "phase": "begin", "id": "c1", "step": 3}
    assert channel.decode(channel.encode(channel.FenceReply(id=4, ok=True))) == {
        "op": "fence", "id": 4, "ok": True, "unknown": False}
    assert channel.decode(channel.encode(channel.Notice(kind="join"))) == {
        "op": "notice", "kind": "join"}
    with pytest.raises(channel.UnknownOp, match="'bogus'"):
        channel.parse({"op": "bogus"})


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
