"""Is this job valid? Every argument of :func:`spotnb.submit`, checked and normalised
into a :class:`~spotnb.protocol.spec.JobSpec` before anything is written or started (DESIGN
invariant 4).

Arguments may come from anywhere (a script, the magics, a config file), so each one is
checked for its type as well as its value: NaN and infinity, floats where whole numbers
are meant, keywords as variable names (``outputs=['class']``), strings where lists are
meant. Each refusal is a :class:`~spotnb.protocol.spec.SpecError` whose ``field`` is the
argument, so the magics and the CLI can name the option the user typed.
"""

from __future__ import annotations

import ast
import dataclasses
import io
import itertools
import numbers
import os
import secrets
import tarfile
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from spotnb._version import __version__
from spotnb.client.capture import notebook_reads
from spotnb.client.carried import check_resume, resume_warning
from spotnb.client.freevars import bound_names_in
from spotnb.protocol import inputs as shipped
from spotnb.protocol import layout
from spotnb.protocol.secretstore import collect as collect_secrets
from spotnb.protocol.spec import (
    CheckpointEvery,
    JobSpec,
    Policy,
    Resources,
    SpecError,
    amount,
    check_input_name,
    check_output_name,
    check_user_env_name,
    parse_duration,
    parse_nodes,
    parse_peer_timeout,
    whole_number,
)
from spotnb.protocol.store import Store, StoreError, open_store
from spotnb.providers import Provider, get_provider, regions

__all__ = ["DEFAULT_INSTANCE_TYPES", "MAX_INPUT_BYTES", "PreparedJob", "prepare_job"]

DEFAULT_INSTANCE_TYPES = ("g4dn.xlarge",)
# Inputs travel inside the job's prefix; past this they belong in the store or in the
# cell's own loading code.
MAX_INPUT_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class PreparedJob:
    """A checked job, ready to be written and launched."""

    spec: JobSpec
    store: Store
    provider: Provider
    inputs: bytes
    workdir: bytes | None
    # {name: value} of the job's secrets (spotnb.protocol.secretstore): for the provider's
    # secret store only, never shown.
    secret_values: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)
    # What the user should know before the job starts (spotnb.client.carried: why the
    # cell would not resume exactly).
    warnings: tuple[str, ...] = ()


def prepare_job(
    code: Any, *, provider: Any = "local", instance_types: Any = DEFAULT_INSTANCE_TYPES,
    region: Any = "us-east-1", max_price: Any = None, name: Any = None, inputs: Any = None,
    outputs: Any = None, checkpoint_every: Any = "5m", max_restarts_on_error: Any = 0,
    budget_usd: Any = None, max_duration: Any = None, keep_checkpoints: Any = 3,
    simulate_interruptions: Any = None, simulate_signals: Any = None, env: Any = None,
    files: Any = None, store: Any = None, notify_url: Any = None, nodes: Any = 1,
    procs_per_node: Any = 1, peer_timeout: Any = "2m", secrets: Any = None,
    standby: Any = True, standby_first_hour: Any = False, allowed_regions: Any = None,
) -> PreparedJob:
    """Check and normalise every argument of :func:`spotnb.submit` (see there); values
    of any type are handled: a wrong type is a SpecError too. Writes and starts nothing.
    """
    python = _check_code(code)
    tree = ast.parse(python)
    if not isinstance(provider, str):
        raise SpecError(f"{{option}} must be a provider name ('local' or 'aws'), not "
                        f"{provider!r}", field="provider")
    prov = get_provider(provider)
    types = _instance_types(instance_types)
    # The first is home: the job's store is there (spotnb.providers.regions).
    where = regions.job_regions(region, types, regions.allowed_regions(allowed_regions))
    home = where[0]
    if max_price is not None:
        max_price = amount(max_price, "max_price", "USD per hour",
                           "leave it unset to cap at the on-demand price")
    min_nodes, max_nodes = parse_nodes(nodes)
    procs = whole_number(procs_per_node, "procs_per_node", minimum=1)
    if name is not None and not isinstance(name, str):
        raise SpecError(f"{{option}} must be text, not {name!r}", field="name")
    if name is not None and not name.strip():
        raise SpecError(f"{{option}} is empty ({name!r}): give the job a name (e.g. "
                        "gpt-small), or leave it out for the default", field="name")
    if inputs is not None and not isinstance(inputs, Mapping):
        raise SpecError(f"{{option}} must map variable names to values, not {inputs!r}",
                        field="inputs")
    if notify_url is not None:
        from spotnb.protocol.notify import check_url

        if not isinstance(notify_url, str):
            raise SpecError(f"{{option}} must be a webhook URL (https://...), not "
                            f"{notify_url!r}", field="notify_url")
        problem = check_url(notify_url)
        if problem is not None:
            raise SpecError(problem, field="notify_url")
    policy = Policy(
        checkpoint_every=CheckpointEvery.parse(checkpoint_every),
        max_restarts_on_error=whole_number(max_restarts_on_error, "max_restarts_on_error"),
        budget_usd=(amount(budget_usd, "budget_usd", "USD", "leave it unset for no budget")
                    if budget_usd is not None else None),
        max_duration=(parse_duration(max_duration, "max_duration")
                      if max_duration is not None else None),
        keep_checkpoints=whole_number(keep_checkpoints, "keep_checkpoints", minimum=1),
        peer_timeout=parse_peer_timeout(peer_timeout),
        standby=_standby(standby),
        standby_first_hour=_standby_first_hour(standby_first_hour),
    )
    out_names = _variable_names(outputs, "outputs")
    simulation = _simulation(simulate_interruptions, provider)
    signals = _signals(simulate_signals, provider)
    environment = _environment(env, provider)
    # The values stay in this process (and the provider's secret store), not the spec.
    secret_values = collect_secrets(secrets, notify_url=notify_url)
    payload, input_names = _pickle_inputs(inputs or {}, bound_names_in(tree))
    archive = _pack_files(files)
    if store is not None and not isinstance(store, (str, os.PathLike)):
        raise SpecError(f"{{option}} must be a path or URI, not {store!r}", field="store")
    job_id = _new_job_id()
    job_store = jobs_root(prov, store, home).child(f"jobs/{job_id}")
    spec = JobSpec(
        job_id=job_id,
        name="job" if name is None else name,
        code=code,
        provider=provider,
        resources=Resources(instance_types=types, region=home, regions=where,
                            max_price=max_price, min_nodes=min_nodes, max_nodes=max_nodes,
                            procs_per_node=procs),
        policy=policy,
        store_uri=job_store.uri,
        created=time.time(),
        inputs=input_names,
        outputs=out_names,
        simulate_interruptions=simulation,
        simulate_signals=signals,
        env=environment,
        secrets=tuple(secret_values),
        spotnb_version=__version__,
    )
    prov.validate(spec)
    resume = resume_warning(check_resume(tree, inputs or {}))
    return PreparedJob(spec, job_store, prov, payload, archive, secret_values,
                       warnings=(resume,) if resume else ())


def jobs_root(provider: Any, store: Any, region: str) -> Store:
    """The store a job of ``provider`` goes to: ``store``, else the provider's default
    for ``region`` (an S3 bucket on AWS), else the local default; SpecError if it
    cannot be opened."""
    prov = get_provider(provider) if isinstance(provider, str) else provider
    try:
        return open_store(store or prov.default_store(region) or layout.default_store_root())
    except StoreError as err:
        raise SpecError(f"{{option}}: {err}", field="store") from None


def _check_code(code: Any) -> str:
    """The cell as Python (after IPython's transformations), if it compiles."""
    from IPython.core.inputtransformer2 import TransformerManager

    if not isinstance(code, str):
        raise SpecError(f"the code must be text (a str), not {type(code).__name__}")
    if not code.strip():
        raise SpecError("the cell is empty: put the training code below the magic line")
    try:
        with warnings.catch_warnings():
            # IPython warns about line ends str.splitlines knows and it does not
            # (\x1c-\x1e, \x85, ...): whether the cell compiles is what matters here.
            warnings.simplefilter("ignore")
            python = TransformerManager().transform_cell(code)
            compile(python, "<cell>", "exec")
    except SyntaxError as err:
        line = (err.text or "").rstrip()
        raise SpecError(
            f"the cell does not compile: line {err.lineno}: {err.msg}"
            + (f"\n    {line}" if line else "")
            + "\nFix the line and run the cell again; nothing was started."
        ) from None
    except ValueError as err:  # compile() refuses null bytes
        raise SpecError(f"the cell does not compile: {err}") from None
    return python


def _split(value: Any, field: str, what: str) -> list[str]:
    """A list of strings from one comma-separated string or a sequence of strings."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, Sequence):
        items = list(value)
    else:
        raise SpecError(f"{{option}} must be {what}, not {value!r}", field=field)
    if not all(isinstance(item, str) for item in items):
        raise SpecError(f"{{option}} must be {what}, not {value!r}", field=field)
    return [part.strip() for item in items for part in item.split(",") if part.strip()]


def _instance_types(value: Any) -> tuple[str, ...]:
    types = _split(value, "instance_types", "instance type names such as 'g5.xlarge'")
    if not types:
        raise SpecError("give at least one instance type ({option}), e.g. g5.xlarge; "
                        "%spot_picker or `spotnb catalog` lists them", field="instance_types")
    return tuple(dict.fromkeys(types))


def _variable_names(value: Any, field: str) -> tuple[str, ...]:
    names = _split(value, field, "variable names, e.g. ['model', 'accuracy']") \
        if value is not None else []
    return tuple(dict.fromkeys(check_output_name(n, field) for n in names))


def _pickle_inputs(inputs: Mapping[Any, Any], bound: set[str]) -> tuple[bytes, tuple[str, ...]]:
    """``inputs.pkl`` (:mod:`spotnb.protocol.inputs`) and the names of its inputs: those
    given, and what the notebook functions among them read from the notebook that the
    code does not assign (``bound``): those functions read the instance's namespace."""
    values: dict[str, bytes] = {}
    todo = list(inputs.items())
    seen = set(inputs)
    while todo:
        key, value = todo.pop(0)
        check_input_name(key, "inputs")
        try:
            blob, linked = shipped.dumps(value)
        except Exception as err:
            raise SpecError(
                f"input {key!r} ({type(value).__name__}) cannot be pickled: {err}. "
                f"Create it inside the cell instead, or leave it out of the inputs."
            ) from None
        if len(blob) > MAX_INPUT_BYTES:
            raise SpecError(
                f"input {key!r} is {len(blob) / 2**20:,.0f} MiB pickled, over the "
                f"{MAX_INPUT_BYTES / 2**20:,.0f} MiB limit: load it inside the cell "
                "(from a file or a bucket) instead of shipping it."
            )
        values[key] = blob
        for name, read in sorted(notebook_reads(linked, bound).items()):
            if name not in seen and name not in bound:
                seen.add(name)
                todo.append((name, read))
    return shipped.pack(values), tuple(sorted(values))


def _pack_files(files: Any) -> bytes | None:
    """A gzipped tar of ``files`` ({remote relative path: local path}), or None."""
    if not files:
        return None
    if not isinstance(files, Mapping):
        raise SpecError(f"{{option}} must map remote paths to local files, not {files!r}",
                        field="files")
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for remote, local in sorted(files.items()):
            if not isinstance(remote, str) or not isinstance(local, (str, os.PathLike)):
                raise SpecError(f"{{option}} must map remote paths to local files, not "
                                f"{remote!r}: {local!r}", field="files")
            parts = Path(remote).parts
            if Path(remote).is_absolute() or ".." in parts or not parts:
                raise SpecError(f"shipped file {remote!r} must be a relative path below "
                                "the working directory", field="files")
            if not Path(local).is_file():
                raise SpecError(f"shipped file {str(local)!r} does not exist", field="files")
            total += Path(local).stat().st_size
            if total > MAX_INPUT_BYTES:
                raise SpecError(f"the shipped files pass {MAX_INPUT_BYTES / 2**20:,.0f} MiB; "
                                "ship code, and load data inside the cell", field="files")
            tar.add(str(local), arcname=str(Path(*parts)))
    return buf.getvalue()


def _simulation(value: Any, provider: str) -> dict[str, Any] | None:
    """``{"count": N}``, ``{"schedule": [seconds, ...]}`` or None (no simulation)."""
    if value is None:
        return None
    usage = ("{option} takes a count of interruptions (2) or times after launch "
             f"(seconds or durations: [20, '45s']), not {value!r}")
    if provider != "local":
        raise SpecError("{option} works on the local cloud only (provider 'local'); "
                        "interrupt a running job elsewhere with spotnb interrupt JOB",
                        field="simulate_interruptions")
    if isinstance(value, (str, bytes, bool)) or not isinstance(
            value, (numbers.Integral, Sequence)):
        raise SpecError(usage, field="simulate_interruptions")
    if isinstance(value, numbers.Integral):
        count = whole_number(value, "simulate_interruptions")
        return {"count": count} if count else None

    def seconds(at: Any) -> float:
        if isinstance(at, numbers.Real) and not isinstance(at, bool) and at == 0:
            return 0.0  # at launch
        return parse_duration(at, "simulate_interruptions")

    try:
        schedule = sorted(seconds(at) for at in value)
    except SpecError:
        raise SpecError(usage, field="simulate_interruptions") from None
    return {"schedule": schedule} if schedule else None


def _standby_first_hour(value: Any) -> bool:
    """Whether a standby starts at once in an instance's first hour too."""
    if not isinstance(value, bool):
        raise SpecError(f"{{option}} must be False (in an instance's first hour, time a "
                        f"standby to be ready as the hour ends: an interruption before then "
                        f"is free) or True (start it at once), not {value!r}",
                        field="standby_first_hour")
    return value


def _standby(value: Any) -> bool:
    """Whether the job starts a warm standby on a rebalance recommendation."""
    if not isinstance(value, bool):
        raise SpecError(f"{{option}} must be True (start a warm standby when EC2 recommends "
                        f"a rebalance; it is billed to the job) or False (replace an "
                        f"instance only once it is gone), not {value!r}", field="standby")
    return value


def _signals(value: Any, provider: str) -> dict[str, Any] | None:
    """The job's signal model (:class:`spotnb.protocol.signals.SignalModel`'s
    fields, all of them) or None (the model's defaults)."""
    if value is None:
        return None
    if provider != "local":
        raise SpecError("{option} works on the local cloud only (provider 'local'); "
                        "on AWS, EC2 sends the signals", field="simulate_signals")
    from spotnb.protocol.signals import check_signals

    return check_signals(value)


def _environment(value: Any, provider: str) -> dict[str, str | None]:
    """``env`` as ``{name: value or None}``; refuses values that look like credentials
    (DESIGN invariant 7: they would be written into the spec)."""
    if value is None:
        return {}
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        pairs = []
        for item in value:
            if not isinstance(item, str):
                raise SpecError(f"{{option}} takes NAME or NAME=VALUE entries, not {item!r}",
                                field="env")
            key, sep, text = item.partition("=")
            pairs.append((key, text if sep else None))
    else:
        raise SpecError(f"{{option}} takes {{'NAME': 'value'}} or ['NAME=value', 'NAME'], "
                        f"not {value!r}", field="env")
    from spotnb.records.scrub import find_credentials

    env: dict[str, str | None] = {}
    for key, text in pairs:
        check_user_env_name(key)
        if text is not None and (not isinstance(text, str) or "\0" in text):
            raise SpecError(f"{{option}}: the value of {key} must be text, not {text!r}",
                            field="env")
        if text is not None and _secret_name(key):
            raise SpecError(
                f"{{option}}: {key} names a secret, and env values are written into the "
                f"job's spec in plain text. Pass it as a secret: --secret {key} "
                f"(secrets=['{key}'], or secrets={{'{key}': value}} in Python) keeps its "
                "value in the cloud's secret store, and the cell sees it in its environment "
                "as before", field="env")
        if key == "PATH" and text is not None and not text.strip(": \t"):
            raise SpecError(
                f"{{option}}: PATH={text!r} would leave the kernel unable to find any "
                "program (python, nvidia-smi, git); set it to directories "
                "(PATH=/opt/tools/bin:/usr/bin:/bin), or leave PATH out to keep the "
                "instance's own", field="env")
        if text is None and provider != "local":
            raise SpecError(
                f"{{option}}: {key} has no value; passing a variable of this machine's "
                f"environment works on the local cloud only. Give a value ({key}=...), "
                f"or for a secret pass it as one (--secret {key}, secrets=['{key}'])",
                field="env")
        if text is not None and find_credentials(f"{key}={text}"):
            raise SpecError(
                f"{{option}}: the value of {key} looks like a credential, and env values are "
                f"written into the job's spec. Pass it as a secret: --secret {key} "
                f"(secrets=['{key}'] in Python) takes it from this machine's environment "
                "into the cloud's secret store, and the cell sees it as before",
                field="env")
        env[key] = text
    return env


# Parts of an environment variable's name that say its value is a secret: HF_TOKEN,
# WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, DB_PASSWORD (not TOKENIZERS_PARALLELISM).
_SECRET_PARTS = frozenset({"SECRET", "TOKEN", "PASSWORD", "PASSWD", "PASSPHRASE",
                           "CREDENTIAL", "CREDENTIALS", "APIKEY"})
_SECRET_PAIRS = frozenset({("API", "KEY"), ("ACCESS", "KEY"), ("PRIVATE", "KEY"),
                           ("SECRET", "KEY"), ("AUTH", "KEY")})


def _secret_name(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (``HF_TOKEN``,
    ``OPENAI_API_KEY``, ``AWS_SECRET_ACCESS_KEY``, ``KAGGLE_KEY``)."""
    parts = name.upper().split("_")
    return bool(_SECRET_PARTS & set(parts)) or parts[-1] == "KEY" or any(
        pair in _SECRET_PAIRS for pair in itertools.pairwise(parts))


def _new_job_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
