"""Bad input is a SpecError before anything starts (DESIGN invariant 4), whatever its
type: every argument of ``spotnb.submit``, with values drawn by hypothesis, either
becomes a valid spec or is refused with a SpecError that names the argument."""

from __future__ import annotations

import json
import keyword
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spotnb
from spotnb.client.jobs import prepare
from spotnb.protocol.spec import (
    MAX_NODES,
    PEER_TIMEOUT_MAX_SECONDS,
    PEER_TIMEOUT_MIN_SECONDS,
    CheckpointEvery,
    JobSpec,
    Policy,
    SpecError,
)

CODE = "x = 1"

# Values a user might pass anywhere, right or wrong: the edges of each type, values
# that are right for one field and wrong for another, and numpy's scalars. Every field
# is tried with each of them, then with what hypothesis draws.
EDGE_VALUES = [
    None, 0, 1, 2, -1, 2.5, 2.0, 1e300, -0.0, float("nan"), float("inf"), -float("inf"),
    True, False, "", " ", "class", "None", "model", "5m", "100 steps", "0 steps", "nan",
    "inf", "2h", "-5m", "g5.xlarge", "g4dn.xlarge,g5.xlarge", "us-east-1", "NAME=value",
    "X", "a,b", "1X", "PATH", "\x00", "0\x1e", "line\nbreak", ["x"], ["class"], ["g5.xlarge"],
    [20, "45s"], [0], [-1], [float("nan")], [], {}, {"count": 2}, {"A": "1"}, {"A": None},
    {"class": 1}, ("a", "a"), np.int64(3), np.float32(2.5), np.float64("nan"),
    np.bool_(True), b"bytes", object(),
]
EDGES = st.sampled_from(EDGE_VALUES)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
ANYTHING = st.one_of(
    EDGES, SCALARS,
    st.lists(EDGES | SCALARS, max_size=3),
    st.dictionaries(st.text(max_size=8) | st.sampled_from(["A", "class", "lr", "1X"]),
                    EDGES | SCALARS, max_size=3),
)


def _finite_positive(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x) and x > 0


def _whole(x: Any, minimum: int) -> bool:
    return type(x) is int and x >= minimum


def _name(x: Any) -> bool:
    return isinstance(x, str) and x.isidentifier() and not keyword.iskeyword(x)


def _every(every: CheckpointEvery) -> bool:
    if every.steps is None:
        return _finite_positive(every.seconds)
    return every.seconds is None and _whole(every.steps, 1)


def _simulation(sim: Any) -> bool:
    if sim is None:
        return True
    if set(sim) == {"count"}:
        return _whole(sim["count"], 1)
    return set(sim) == {"schedule"} and bool(sim["schedule"]) and all(
        type(t) in (int, float) and math.isfinite(t) and t >= 0 for t in sim["schedule"])


def _signals(sig: Any) -> bool:
    if sig is None:
        return True
    numbers = [sig[k] for k in ("lead_median", "lead_sigma", "lead_max", "together",
                                "false_alarm", "no_recommendation")]
    return (all(type(x) in (int, float) and math.isfinite(x) and x >= 0 for x in numbers)
            and sig["together"] <= 1 and sig["no_recommendation"] <= 1
            and sig["false_alarm"] < 1 and (sig["seed"] is None or isinstance(sig["seed"], str))
            and all(type(t) in (int, float) and math.isfinite(t) and t >= 0
                    for t in sig["false_alarms"]))


# What an accepted value must have become, per argument of submit: checked
# independently of spotnb's own checks.
VALID: dict[str, Callable[[JobSpec], bool]] = {
    "code": lambda s: isinstance(s.code, str) and bool(s.code.strip()),
    "provider": lambda s: s.provider == "local",
    "instance_types": lambda s: bool(s.resources.instance_types) and all(
        isinstance(t, str) and t for t in s.resources.instance_types),
    "region": lambda s: isinstance(s.resources.region, str),
    "max_price": lambda s: s.resources.max_price is None or _finite_positive(
        s.resources.max_price),
    "name": lambda s: isinstance(s.name, str) and s.name.isprintable() and bool(s.name.strip()),
    "inputs": lambda s: all(_name(n) for n in s.inputs),
    "outputs": lambda s: all(_name(n) for n in s.outputs)
    and len(set(s.outputs)) == len(s.outputs),
    "checkpoint_every": lambda s: _every(s.policy.checkpoint_every),
    "max_restarts_on_error": lambda s: _whole(s.policy.max_restarts_on_error, 0),
    "budget_usd": lambda s: s.policy.budget_usd is None or _finite_positive(
        s.policy.budget_usd),
    "max_duration": lambda s: s.policy.max_duration is None or _finite_positive(
        s.policy.max_duration),
    "keep_checkpoints": lambda s: _whole(s.policy.keep_checkpoints, 1),
    "simulate_interruptions": lambda s: _simulation(s.simulate_interruptions),
    "simulate_signals": lambda s: _signals(s.simulate_signals),
    "env": lambda s: all(_name(k) or k.isidentifier() for k in s.env) and all(
        v is None or isinstance(v, str) for v in s.env.values()),
    "files": lambda s: True,  # nothing of them is in the spec; a bad one is refused
    "store": lambda s: isinstance(s.store_uri, str),
    "nodes": lambda s: _whole(s.resources.min_nodes, 1)
    and _whole(s.resources.max_nodes, s.resources.min_nodes)
    and s.resources.max_nodes <= MAX_NODES,
    "procs_per_node": lambda s: _whole(s.resources.procs_per_node, 1),
    "peer_timeout": lambda s: _finite_positive(s.policy.peer_timeout)
    and PEER_TIMEOUT_MIN_SECONDS <= s.policy.peer_timeout <= PEER_TIMEOUT_MAX_SECONDS,
}


def _check(field: str, value: Any) -> None:
    """``value`` for ``field`` becomes a valid spec, or a SpecError about ``field``."""
    if field == "provider" and value == "aws":
        return  # a valid name; validating it needs AWS (tests/test_aws_provider.py)
    kwargs = {field: value} if field != "code" else {}
    code = value if field == "code" else CODE
    try:
        spec = prepare(code, **kwargs)
    except SpecError as err:
        # Refused, naming the argument (or, for a value the catalog does not know, the
        # value itself).
        assert err.field in (field, None), (field, err.field, str(err))
        assert "{option}" not in str(err)
        return
    assert VALID[field](spec), (field, value, spec)
    assert JobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize("field", sorted(VALID))
def test_any_value_of_any_argument_is_a_valid_spec_or_a_spec_error(
        field: str, spotnb_home: Path) -> None:
    for value in EDGE_VALUES:
        _check(field, value)

    @settings(max_examples=60, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(value=ANYTHING)
    def drawn(value: Any) -> None:
        _check(field, value)

    drawn()
    # prepare() writes and starts nothing.
    assert not any(spotnb_home.iterdir()), list(spotnb_home.rglob("*"))


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    ({"keep_checkpoints": 2.5}, "keep_checkpoints", "a whole number of at least 1, not 2.5"),
    ({"keep_checkpoints": 2.0}, "keep_checkpoints", "a whole number"),
    ({"keep_checkpoints": 0}, "keep_checkpoints", "at least 1, not 0"),
    ({"checkpoint_every": float("nan")}, "checkpoint_every", "a time like '60s'"),
    ({"checkpoint_every": float("inf")}, "checkpoint_every", "a time like '60s'"),
    ({"checkpoint_every": "0 steps"}, "checkpoint_every", "or a step count like '500 steps'"),
    ({"max_duration": float("nan")}, "max_duration", "finite and above 0, not nan"),
    ({"max_duration": -5}, "max_duration", "finite and above 0, not -5"),
    ({"outputs": ["class"]}, "outputs", "'class' is a Python keyword"),
    ({"outputs": ["not-a-name"]}, "outputs", "'not-a-name' is not a variable name"),
    ({"outputs": [3]}, "outputs", "variable names"),
    ({"inputs": {"class": 1}}, "inputs", "'class' is a Python keyword"),
    ({"simulate_interruptions": 1.5}, "simulate_interruptions", "a count of interruptions"),
    ({"simulate_interruptions": ["x"]}, "simulate_interruptions", "times after launch"),
    ({"simulate_interruptions": [float("nan")]}, "simulate_interruptions", "times after"),
    ({"simulate_interruptions": "2"}, "simulate_interruptions", "a count of interruptions"),
    ({"max_restarts_on_error": 1.5}, "max_restarts_on_error", "a whole number"),
    ({"max_restarts_on_error": True}, "max_restarts_on_error", "a whole number"),
    ({"budget_usd": float("nan")}, "budget_usd", "leave it unset for no budget"),
    ({"budget_usd": "5"}, "budget_usd", "a positive number of USD"),
    ({"max_price": float("inf")}, "max_price", "leave it unset to cap at the on-demand"),
    ({"instance_types": [1]}, "instance_types", "instance type names"),
    ({"instance_types": []}, "instance_types", "give at least one instance type"),
    ({"name": "two\nlines"}, "name", "a printable name"),
    ({"name": 7}, "name", "must be text"),
    ({"env": {"1X": "a"}}, "env", "'1X' is not an environment variable name"),
    ({"env": "A=1"}, "env", "takes {'NAME': 'value'}"),
    ({"env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz"}}, "env", "HF_TOKEN names a secret"),
    ({"env": {"AWS_SECRET_ACCESS_KEY": "short"}}, "env", "--secret AWS_SECRET_ACCESS_KEY"),
    ({"env": ["WANDB_API_KEY=x"]}, "env", "secrets={'WANDB_API_KEY': value}"),
    ({"env": ["AWS_ACCESS_KEY_ID=AKIAEXAMPLE"]}, "env", "AWS_ACCESS_KEY_ID names a secret"),
    ({"env": {"KAGGLE_KEY": "k"}}, "env", "KAGGLE_KEY names a secret"),
    ({"env": {"PATH": ""}}, "env", "PATH='' would leave the kernel unable to find any program"),
    ({"name": ""}, "name", "is empty"),
    ({"name": "  "}, "name", "is empty"),
    ({"name": ".."}, "name", "without '/' or '\\' that is not '.' or '..'"),
    ({"name": "a/b"}, "name", "without '/'"),
    ({"outputs": ["model", "spot"]}, "outputs", "'spot' is the spotnb runtime module"),
    ({"outputs": "__builtins__"}, "outputs", "'__builtins__' is Python's own"),
    ({"inputs": {"__builtins__": {}}}, "inputs", "'__builtins__' is a name the instance's"),
    ({"env": {"DB_URL": "postgres://me:hunter22@db/x"}}, "env", "looks like a credential"),
    ({"files": {"../up.py": __file__}}, "files", "must be a relative path"),
    ({"store": 5}, "store", "must be a path or URI"),
    ({"store": "gs://bucket"}, "store", "unknown store URI scheme"),
    ({"nodes": 0}, "nodes", "a job needs at least one node"),
    ({"nodes": "4:3"}, "nodes", "MIN must not exceed MAX"),
    ({"nodes": 2.0}, "nodes", "a count of nodes (4) or MIN:MAX"),
    ({"nodes": MAX_NODES + 1}, "nodes", f"limit of {MAX_NODES} nodes"),
    ({"procs_per_node": 0}, "procs_per_node", "at least 1, not 0"),
    ({"procs_per_node": 1.5}, "procs_per_node", "a whole number"),
    ({"peer_timeout": float("nan")}, "peer_timeout", "finite and above 0, not nan"),
    ({"peer_timeout": "soon"}, "peer_timeout", "a duration like"),
    ({"peer_timeout": 5}, "peer_timeout", "between 10s and 60m (how long a rank waits"),
    ({"peer_timeout": "2h"}, "peer_timeout", "use e.g. 2m (the default)"),
])
def test_bad_input_names_the_argument_and_the_fix(
        spotnb_home: Path, kwargs: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(SpecError) as err:
        spotnb.submit(CODE, **kwargs)
    assert err.value.field == field
    assert words in str(err.value)
    # The magics and the CLI name the option the user typed in its place.
    named = err.value.message({field: "--opt"})
    assert words in named
    if field != "files":  # the magics ship files themselves: no option to name
        assert "--opt" in named and "{option}" not in named
    assert not any(spotnb_home.iterdir()), "nothing may be written before the checks pass"


def test_good_values_are_normalised() -> None:
    spec = prepare(CODE, instance_types="g5.xlarge, g4dn.xlarge,g5.xlarge",
                   outputs="model, accuracy", checkpoint_every="500 steps",
                   max_duration="2h", budget_usd=np.float32(2.5), keep_checkpoints=np.int64(2),
                   max_restarts_on_error=1, simulate_interruptions=[0, "45s", 20],
                   env=["WANDB_MODE=offline", "HF_HOME"], inputs={"lr": 0.1})
    assert spec.resources.instance_types == ("g5.xlarge", "g4dn.xlarge")
    assert spec.outputs == ("model", "accuracy")
    assert spec.policy == Policy(checkpoint_every=CheckpointEvery(seconds=None, steps=500),
                                 max_restarts_on_error=1, budget_usd=2.5,
                                 max_duration=7200.0, keep_checkpoints=2)
    assert type(spec.policy.keep_checkpoints) is int
    assert spec.simulate_interruptions == {"schedule": [0.0, 20.0, 45.0]}
    assert spec.env == {"WANDB_MODE": "offline", "HF_HOME": None}
    assert JobSpec.from_json(spec.to_json()) == spec


def test_env_names_that_only_look_like_secrets_pass() -> None:
    env = {"TOKENIZERS_PARALLELISM": "false", "MAX_TOKENS": "512", "KEYBOARD": "us",
           "PATH": "/opt/tools/bin:/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    assert prepare(CODE, env=env).env == env


def test_a_spec_read_back_is_checked_too() -> None:
    spec = prepare(CODE)
    raw = spec.to_json().replace('"keep_checkpoints": 3', '"keep_checkpoints": 2.5')
    with pytest.raises(SpecError, match="keep_checkpoints must be a whole number"):
        JobSpec.from_json(raw)


def test_a_read_back_spec_checks_its_nodes_too() -> None:
    spec = prepare(CODE, nodes="2:3", procs_per_node=2, peer_timeout="30s")
    assert (spec.resources.min_nodes, spec.resources.max_nodes,
            spec.resources.procs_per_node, spec.policy.peer_timeout) == (2, 3, 2, 30.0)
    assert JobSpec.from_json(spec.to_json()) == spec
    for old, new, words in (('"min_nodes": 2', '"min_nodes": 4', "MIN must not exceed MAX"),
                            ('"max_nodes": 3', '"max_nodes": 2.5', "a whole number"),
                            ('"procs_per_node": 2', '"procs_per_node": 0', "at least 1"),
                            ('"peer_timeout": 30.0', '"peer_timeout": -1', "above 0")):
        raw = spec.to_json()
        assert old in raw
        with pytest.raises(SpecError, match=words):
            JobSpec.from_json(raw.replace(old, new))


def test_an_unpicklable_input_is_still_named() -> None:
    with pytest.raises(SpecError, match=r"input 'lock' .* cannot be pickled"):
        prepare(CODE, inputs={"lock": threading.Lock()})


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"procs_per_node": 10**6}, r"procs_per_node 1000000 is above spotnb's limit"),
    ({"env": {"SPOTNB_LOCAL_JOB_ID": "other"}}, r"env: SPOTNB_LOCAL_JOB_ID is spotnb's own"),
    ({"env": ["spotnb_lease_ttl=1"]}, r"env: spotnb_lease_ttl is spotnb's own"),
    ({"inputs": {"spot": 1}}, r"inputs: 'spot' is a name the instance's kernel defines"),
    ({"inputs": {"_i3": 1}}, r"inputs: '_i3' is a name the instance's kernel defines"),
])
def test_values_that_would_override_spotnbs_own_are_refused(kwargs: dict[str, Any],
                                                             words: str) -> None:
    with pytest.raises(SpecError, match=words) as err:
        prepare(CODE, **kwargs)
    assert err.value.field == next(iter(kwargs))


@pytest.mark.parametrize(("path", "value", "words"), [
    ("outputs", float("nan"), "outputs must be a list of names"),
    ("resources.instance_types", -1, "instance_types must be a list of names"),
    ("resources.procs_per_node", 10**6, "above spotnb's limit"),
    ("inputs", ["spot"], "'spot' is a name the instance's kernel"),
    ("env", {"SPOTNB_LOCAL_JOB_ID": "x"}, "SPOTNB_LOCAL_JOB_ID is spotnb's own"),
    ("policy", 7, "policy must be a JSON object"),
    ("policy.checkpoint_every", [1], "checkpoint_every must be a JSON object"),
    ("created", "x", "created must be a time"),
    ("job_id", 5, "job_id must be a string"),
    ("policy.extra", 1, "fields this spotnb does not know .extra."),
    ("resources.region", {}, "region must be"),
    ("simulate_interruptions", [1], "simulate_interruptions must be"),
    ("env", [], "env must be a dict"),
    ("schema", "2", "schema must be a whole number"),
    ("schema", 0, "schema 0 is not one this spotnb reads"),
    ("schema", -3, "schema -3 is not one this spotnb reads"),
    ("schema", 99, "written by a newer spotnb .spec schema 99; this spotnb reads 1."),
    ("name", "..", "without '/'"),
    ("outputs", ["spot"], "'spot' is the spotnb runtime module"),
    ("inputs", ["__builtins__"], "'__builtins__' is a name the instance's kernel"),
])
def test_a_tampered_spec_json_is_a_spec_error(path: str, value: Any, words: str) -> None:
    raw = json.loads(prepare(CODE).to_json())
    *parents, key = path.split(".")
    node = raw
    for parent in parents:
        node = node[parent]
    node[key] = value
    with pytest.raises(SpecError, match=words) as err:
        JobSpec.from_json(json.dumps(raw))
    assert "Traceback" not in str(err.value)


@pytest.mark.parametrize("text", ["[1, 2]", "null", "{", "[" * 100_000 + "]" * 100_000,
                                  '{"schema": "2"}', '{"resources": []}'])
def test_a_spec_json_of_the_wrong_shape_is_a_spec_error(text: str) -> None:
    with pytest.raises(SpecError, match=r"spec\.json|submit the job again"):
        JobSpec.from_json(text)


def test_the_standby_setting_is_a_flag_checked_at_submit_and_read_back() -> None:
    assert prepare(CODE).policy.standby is True
    spec = prepare(CODE, standby=False)
    assert spec.policy.standby is False and JobSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SpecError, match=r"standby must be True .* or False"):
        prepare(CODE, standby="no")
    with pytest.raises(SpecError, match="standby must be True or False"):
        JobSpec.from_json(spec.to_json().replace('"standby": false', '"standby": 0'))
