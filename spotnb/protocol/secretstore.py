"""A job's secrets: values its cell needs (``HF_TOKEN``, ``WANDB_API_KEY``) and its
notification webhook, kept out of every spec, event, record and log (DESIGN invariant 7).

How a secret travels::

    notebook machine                 the provider's secret store        each instance
    ────────────────                 ───────────────────────────        ─────────────
    --secret HF_TOKEN     ─ submit ─► local: $SPOTNB_HOME/secrets/     ─► the agent reads it
    secrets=[...] / {...}   (launch)         <job-id>.json (mode 0600)    at every start
    SpotMagics.secrets                aws:   SSM SecureString            (every attempt,
    notify_url (the webhook)                 /spotnb/<job-id>/<NAME>      every node), sets
                                                                          NAME in the kernel

* The spec holds the names only (:attr:`spotnb.protocol.spec.JobSpec.secrets`); the values are
  collected by :func:`collect` when the job is checked (a missing one is refused before
  anything starts, naming it) and handed to ``Provider.launch(spec, secrets)``, which
  stores them where only the job's instances can read them, before any instance starts.
* The agent asks ``Provider.read_secrets(spec)`` when it starts and gives the values to
  its kernels' environment; the webhook (:data:`NOTIFY_SECRET`) goes to the agent's
  notifier only, never to the cell.
* They are deleted with the job's capacity group (local: when its supervisor ends, on
  ``terminate`` and by ``spotnb cleanup``; AWS: by the instance agent's teardown, by
  ``terminate`` and by ``spotnb aws cleanup``).

Messages and exceptions name secrets, never quote their values.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spotnb.protocol import layout
from spotnb.protocol.spec import SpecError, check_env_name

__all__ = ["MAX_VALUE_BYTES", "NOTIFY_SECRET", "SecretsUnavailable", "collect",
           "delete_local", "local_dir", "local_path", "read_local", "values_for",
           "write_local"]

#: The secret that carries a job's notification webhook (``notify_url``).
NOTIFY_SECRET = "SPOTNB_NOTIFY_URL"
#: The most a value may hold: an SSM standard parameter's limit (4 KB), on every
#: provider alike, so a job that runs on the local cloud runs on AWS too.
MAX_VALUE_BYTES = 4096
#: Secrets a job may have: each is an SSM parameter, put at submit and read in
#: batches of 10 by every attempt.
MAX_SECRETS = 50


class SecretsUnavailable(RuntimeError):
    """The agent could not read its job's secrets; the message names them, no value."""


def collect(value: Any, *, notify_url: str | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``secrets`` of :func:`spotnb.submit` as ``{name: value}``, values taken from
    this machine's environment for names given alone; the webhook as
    :data:`NOTIFY_SECRET`. Refuses (SpecError, ``field="secrets"``) a bad name, a name
    whose variable is not set here, or a value that is not text; no message quotes a
    value."""
    environ = os.environ if environ is None else environ
    if value is None:
        pairs: list[tuple[Any, Any]] = []
    elif isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        pairs = [(name, None) for name in value]
    else:
        raise SpecError("{option} takes names of this machine's environment variables "
                        "(['HF_TOKEN']) or {'NAME': value}, not a "
                        f"{type(value).__name__}", field="secrets")
    found: dict[str, str] = {}
    for name, given in pairs:
        check_env_name(name, "secrets")
        if name == NOTIFY_SECRET:
            raise SpecError(f"{{option}}: {NOTIFY_SECRET} is spotnb's own (the notification "
                            "webhook): pass the webhook as notify_url (--notify)",
                            field="secrets")
        if given is None:
            given = environ.get(name)
            if given is None:
                raise SpecError(
                    f"{{option}}: {name} is not set in this machine's environment, so "
                    f"there is no value to give the job: set it (export {name}=... before "
                    "starting Jupyter, or os.environ[...] in the notebook), or give its "
                    f"value in Python (secrets={{'{name}': value}}). Nothing was started.",
                    field="secrets")
        _check_value(name, given)
        found[name] = given
    if len(found) > MAX_SECRETS:
        raise SpecError(f"{{option}}: at most {MAX_SECRETS} secrets per job, not "
                        f"{len(found)}", field="secrets")
    if notify_url is not None:
        found[NOTIFY_SECRET] = notify_url
    return found


def values_for(names: Sequence[str], given: Mapping[str, str] | None) -> dict[str, str]:
    """The values of a job's secrets ``names`` among those ``launch`` was ``given``;
    SpecError naming any it was not given (a caller that skipped :func:`collect`)."""
    given = given or {}
    missing = [n for n in names if n not in given]
    if missing:
        raise SpecError(f"the job's secrets {', '.join(missing)} have no value: launch a "
                        "job through spotnb.submit, which collects them", field="secrets")
    return {n: given[n] for n in names}


def _check_value(name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise SpecError(f"{{option}}: the value of {name} must be text, not a "
                        f"{type(value).__name__}", field="secrets")
    if not value or "\0" in value:
        raise SpecError(f"{{option}}: the value of {name} is empty or holds a NUL "
                        "character; give the secret's text", field="secrets")
    size = len(value.encode())
    if size > MAX_VALUE_BYTES:
        raise SpecError(f"{{option}}: the value of {name} is {size} bytes; a secret holds at "
                        f"most {MAX_VALUE_BYTES} (the limit of an SSM standard parameter): "
                        "ship a larger one as a file the cell reads", field="secrets")


# -- the local cloud's store: one file per job, readable by the user alone -----------------

def local_dir() -> Path:
    """Where the local cloud keeps jobs' secrets: under ``$SPOTNB_HOME``, outside the
    store (whose objects are the jobs' shareable history)."""
    return layout.home() / "secrets"


def local_path(job_id: str) -> Path:
    """The file of a job's secrets on the local cloud."""
    return local_dir() / f"{job_id}.json"


def write_local(job_id: str, values: Mapping[str, str]) -> None:
    """Write ``values`` to the job's file, created with mode 0600 (in a 0700 folder)
    before a byte is written."""
    path = local_path(job_id)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(dict(values), out)
    os.replace(tmp, path)


def read_local(job_id: str, names: Sequence[str]) -> dict[str, str]:
    """The job's secrets ``names`` from its file; SecretsUnavailable naming what is
    missing."""
    try:
        values = json.loads(local_path(job_id).read_text())
    except (OSError, ValueError) as err:
        raise SecretsUnavailable(
            f"the job's secrets ({', '.join(names)}) are gone from the local cloud "
            f"({type(err).__name__}): they are deleted when the job ends") from None
    missing = [n for n in names if not isinstance(values.get(n), str)]
    if missing:
        raise SecretsUnavailable(f"the job's secrets {', '.join(missing)} are missing")
    return {n: values[n] for n in names}


def delete_local(job_id: str) -> bool:
    """Delete the job's file; False if there was none."""
    with contextlib.suppress(FileNotFoundError):
        local_path(job_id).unlink()
        return True
    return False
