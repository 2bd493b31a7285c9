"""What a user typed, made into what a job's spec holds: the normalisers
(:func:`whole_number`, :func:`amount`, :func:`parse_duration`, :func:`parse_peer_timeout`,
:func:`parse_nodes`) and the checks of a name (a variable the cell reads or assigns, an
environment variable), each a :class:`~spotnb.protocol.errors.SpecError` about the
field that names the fix. The spec that holds them is :mod:`spotnb.protocol.spec`.
"""

from __future__ import annotations

import keyword
import math
import numbers
import re
from typing import Any

from spotnb.protocol.errors import SpecError

__all__ = [
    "INJECTED_NAMES",
    "IPYTHON_CACHE_NAME",
    "MAX_NODES",
    "MAX_PROCS_PER_NODE",
    "PEER_TIMEOUT_MAX_SECONDS",
    "PEER_TIMEOUT_MIN_SECONDS",
    "RESERVED_ENV_PREFIX",
    "amount",
    "bad_value",
    "check_env_name",
    "check_input_name",
    "check_nodes",
    "check_output_name",
    "check_user_env_name",
    "check_variable_name",
    "parse_duration",
    "parse_nodes",
    "parse_peer_timeout",
    "whole_number",
]


def bad_value(field: str, what: str, value: Any, fix: str = "") -> SpecError:
    """The error for a ``value`` of ``field`` that is not ``what`` it must be; ``fix``:
    what to do instead."""
    return SpecError(f"{{option}} must be {what}, not {value!r}" + (f"; {fix}" if fix else ""),
                     field=field)


def whole_number(value: Any, field: str, minimum: int = 0) -> int:
    """``value`` as an ``int`` of at least ``minimum``; SpecError for anything else
    (booleans, floats such as ``2.5`` or ``2.0``, strings, NaN)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise bad_value(field, f"a whole number of at least {minimum}", value)
    if value < minimum:
        raise bad_value(field, f"at least {minimum}", value)
    return int(value)


def amount(value: Any, field: str, unit: str, fix: str) -> float:
    """``value`` as a finite ``float`` above 0 (a price, a budget); SpecError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise bad_value(field, f"a positive number of {unit}", value, fix)
    number = float(value)
    if not (math.isfinite(number) and number > 0):
        raise bad_value(field, f"a positive, finite number of {unit}", value, fix)
    return number


def check_variable_name(name: Any, field: str) -> str:
    """``name`` if it can be a Python variable (``class`` cannot); SpecError otherwise."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        what = "a Python keyword" if isinstance(name, str) and keyword.iskeyword(name) \
            else "not a variable name"
        raise SpecError(f"{{option}}: {name!r} is {what}; name variables of the cell, "
                        "e.g. model, accuracy", field=field)
    return name


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_env_name(name: Any, field: str = "env") -> str:
    """``name`` if it can name an environment variable; SpecError otherwise."""
    if not isinstance(name, str) or not _ENV_NAME.match(name):
        raise SpecError(f"{{option}}: {name!r} is not an environment variable name "
                        "(letters, digits and _)", field=field)
    return name


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(s|sec|secs|m|min|mins|h|hr|hrs|d)?\s*$")
_UNITS = {None: 1.0, "s": 1.0, "sec": 1.0, "secs": 1.0, "m": 60.0, "min": 60.0,
          "mins": 60.0, "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "d": 86400.0}


def parse_duration(value: float | int | str, what: str = "duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"5m"``, ``"2h"`` or ``"1.5d"``: finite and
    above 0. ``what`` is the field the value is for (it names it in the SpecError)."""
    usage = "a duration like 90, '90s', '5m' or '2h'"
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise bad_value(what, usage, value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if not m:
            raise bad_value(what, usage, value)
        seconds = float(m.group(1)) * _UNITS[m.group(2)]
    else:
        seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise bad_value(what, f"{usage}, finite and above 0", value)
    return seconds


#: The shortest peer timeout (``Policy.peer_timeout``) a job may set: a live peer may
#: be silent this long while rank 0 writes a coordinated checkpoint or a loaded node
#: answers late, and a shorter timeout takes such a peer for dead (a needless restart).
PEER_TIMEOUT_MIN_SECONDS = 10.0
#: The longest: a rank waits this long at most on a dead peer before the world
#: re-forms (NCCL's own default of 10 minutes is a hang on a dead peer; an hour
#: is past any reason to wait and still bounds the idle instances' cost).
PEER_TIMEOUT_MAX_SECONDS = 3600.0


def parse_peer_timeout(value: Any, what: str = "peer_timeout") -> float:
    """Seconds a rank waits on a silent peer, from a duration (:func:`parse_duration`)
    within :data:`PEER_TIMEOUT_MIN_SECONDS`..:data:`PEER_TIMEOUT_MAX_SECONDS`."""
    seconds = parse_duration(value, what)
    if not PEER_TIMEOUT_MIN_SECONDS <= seconds <= PEER_TIMEOUT_MAX_SECONDS:
        raise SpecError(
            f"{{option}} must be between {PEER_TIMEOUT_MIN_SECONDS:g}s and "
            f"{PEER_TIMEOUT_MAX_SECONDS / 60:g}m (how long a rank waits on a dead peer "
            f"before the world re-forms), not {value!r}: use e.g. 2m (the default); "
            "shorter restarts a slow but live world, longer leaves the others idle "
            "and billed", field=what)
    return seconds


# A multi-node job's nodes, at most: one node slot (lease, event stream) per node.
MAX_NODES = 64
# Worker processes (kernels) per node, at most: the largest GPU instances have 8 or 16
# GPUs; one kernel per CPU core of a big CPU instance is still under this. More is a
# typo, and each kernel costs an interpreter's memory on the instance.
MAX_PROCS_PER_NODE = 128

# Names the instance's kernel defines itself (the runtime's ``spot``, IPython's own),
# and IPython's output cache (``_``, ``_i3``, ...): an input of such a name would shadow
# them (or be shadowed). spotnb.client.capture skips them for the same reason.
INJECTED_NAMES = frozenset({"spot", "get_ipython", "display", "In", "Out", "exit", "quit"})
IPYTHON_CACHE_NAME = re.compile(r"^_(i{1,3}|i\d+|_{0,2}|dh|ih|oh|sh)$")
# Environment variables spotnb sets on the instance (the local cloud's markers, the
# metadata endpoint, its own settings): a job's env may not set them.
RESERVED_ENV_PREFIX = "SPOTNB_"


def check_input_name(name: Any, field: str = "inputs") -> str:
    """``name`` if it can be an input variable of the cell; SpecError otherwise."""
    check_variable_name(name, field)
    if name in INJECTED_NAMES or IPYTHON_CACHE_NAME.match(name) or _dunder(name):
        owner = ("the spotnb runtime" if name == "spot" else
                 "Python" if _dunder(name) else "IPython")
        raise SpecError(
            f"{{option}}: {name!r} is a name the instance's kernel defines itself "
            f"({owner}), so an input of that name would shadow it; rename the variable "
            f"(e.g. {name.strip('_') or 'value'}_value) and use that name in the cell",
            field=field)
    return name


def check_output_name(name: Any, field: str = "outputs") -> str:
    """``name`` if it can be an output variable of the cell: not the runtime ``spot``,
    IPython's own names or Python's (``__builtins__``); SpecError otherwise."""
    check_variable_name(name, field)
    if name in INJECTED_NAMES or IPYTHON_CACHE_NAME.match(name) or _dunder(name):
        owner = ("the spotnb runtime module, not a result" if name == "spot" else
                 "Python's own" if _dunder(name) else "IPython's own")
        raise SpecError(
            f"{{option}}: {name!r} is {owner}; bring back a variable the cell assigns "
            "(e.g. model, accuracy)", field=field)
    return name


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def check_user_env_name(name: Any, field: str = "env") -> str:
    """``name`` if a job's env may set it: not one of spotnb's own ``SPOTNB_*``."""
    check_env_name(name, field)
    if name.upper().startswith(RESERVED_ENV_PREFIX):
        raise SpecError(
            f"{{option}}: {name} is spotnb's own variable ({RESERVED_ENV_PREFIX}*: spotnb "
            "sets these on the instance, and a job's value would override them); remove "
            "it from env, or configure the local cloud through its settings "
            "(cloud/config.json) instead", field=field)
    return name


def parse_nodes(value: Any, field: str = "nodes") -> tuple[int, int]:
    """``(min, max)`` nodes from ``4``, ``"4"``, ``"3:4"`` or ``(3, 4)``; SpecError
    (about ``field``) for anything else.

    MIN is how few nodes training goes on with while a lost node's replacement boots
    (torchrun's ``--nnodes MIN:MAX``); MAX is how many the capacity group keeps.
    """
    usage = ("{option} must be a count of nodes (4) or MIN:MAX ('3:4': train on 3 while a "
             f"lost node's replacement boots, on 4 otherwise), not {value!r}")

    def count(v: Any) -> bool:
        return isinstance(v, numbers.Integral) and not isinstance(v, bool)

    if count(value):
        low = high = int(value)
    elif isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(count(v) for v in value):
            raise SpecError(usage, field=field)
        low, high = int(value[0]), int(value[1])
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", value, flags=re.ASCII)
        if not m:
            raise SpecError(usage, field=field)
        low = int(m.group(1))
        high = int(m.group(2)) if m.group(2) is not None else low
    else:
        raise SpecError(usage, field=field)
    check_nodes(low, high, field, value)
    return low, high


def check_nodes(low: int, high: int, field: str, value: Any) -> None:
    """MIN:MAX nodes (``low``, ``high``, as ``value`` gave them) a job may have."""
    if low < 1 or high < 1:
        raise SpecError(f"{{option}}: a job needs at least one node, not {value!r}; use 1 "
                        "(the default) or more", field=field)
    if low > high:
        raise SpecError(f"{{option}} {low}:{high} asks for at least {low} nodes but at most "
                        f"{high}: MIN must not exceed MAX (e.g. {high}:{low})", field=field)
    if high > MAX_NODES:
        raise SpecError(f"{{option}} {value!r} is above spotnb's limit of {MAX_NODES} nodes",
                        field=field)
