"""``spotnb record``: execute a notebook head-less and keep it as an experiment record.

:func:`record_notebook` does, step by step:

1. Overrides parameters, papermill-style: a new cell tagged ``injected-parameters``
   goes right after the cell tagged ``parameters`` (at the top if there is none) and
   assigns the given values (Python literals, or strings).
2. Notes what is about to run: versions, the git commit of the notebook's directory
   and whether it has uncommitted changes.
3. Executes the notebook with nbclient in a fresh kernel started in the notebook's
   directory (:func:`spotnb.client.notebook.execute`); ``provider`` becomes the kernel's
   ``SpotMagics.provider``. Before the kernel goes, it is asked for the ``--out``
   values of the jobs the run submitted: they load there.
4. Finds those jobs: every job created while the notebook ran (in the default store
   and in the index of jobs submitted from this machine), plus any job whose record
   a cell's output metadata carries (:func:`spotnb.records.summary.job_ended`). Each is
   tied to its cell by that metadata, by its id in the cell's output, or by its code.
   A job no cell shows (another process's, submitted meanwhile) is only named, under
   ``run.other_jobs``: the record counts what the notebook demonstrably ran.
5. Writes each job's record into ``metadata.spotnb.jobs`` and the job's
   ``summary.json``, and a PNG of its final dashboard into its cell.
6. Drops the bundled plotly.js from the widget state (:mod:`spotnb.records.document`),
   scrubs credentials (:mod:`spotnb.records.scrub`), validates and writes the record;
   with ``html``, writes the HTML export next to it.

A run whose cell fails is still recorded, with ``status: failed`` and the error.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.metadata
import json
import keyword
import logging
import os
import platform
import re
import subprocess
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import nbformat

from spotnb._version import __version__
from spotnb.client.jobs import JobHandle, JobNotFound, attach
from spotnb.client.notebook import DEFAULT_CELL_TIMEOUT, CellFailure, execute
from spotnb.protocol import layout
from spotnb.protocol.events import EventReader
from spotnb.protocol.events.fold import savings_pct
from spotnb.protocol.store import open_store
from spotnb.providers import PROVIDERS
from spotnb.records import document, figures
from spotnb.records.scrub import scrub
from spotnb.records.summary import SCHEMA_VERSION, iso, job_record, store_summary

__all__ = [
    "MAX_RECORD_BYTES",
    "Recording",
    "default_record_output",
    "inject_parameters",
    "parse_parameters",
    "record_notebook",
]

log = logging.getLogger(__name__)

#: Past this a record is unwieldy to share (and GitHub stops rendering notebooks
#: around 10 MB): the command warns.
MAX_RECORD_BYTES = 3 * 2**20
#: Packages whose versions a record notes, when installed.
KEY_PACKAGES = ("torch", "numpy", "scikit-learn", "ipykernel", "ipython", "jupyter_client",
                "nbclient", "nbformat", "ipywidgets", "plotly", "matplotlib", "cloudpickle",
                "boto3")
#: How long the kernel may take to load the jobs' outputs at the end.
KERNEL_QUERY_SECONDS = 120
_GIT_SECONDS = 10
_JOB_ID_TIME = re.compile(r"^(\d{8}-\d{6})-")
_MAX_ERROR_CHARS = 20_000


@dataclasses.dataclass(frozen=True)
class Recording:
    """The outcome of :func:`record_notebook`."""

    source: Path
    output: Path
    html: Path | None
    status: str
    failure: CellFailure | None
    seconds: float
    job_ids: tuple[str, ...]
    size_bytes: int
    redactions: int
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "completed"


def default_record_output(path: Path) -> Path:
    """``<name>.record.ipynb`` next to the notebook."""
    return path.with_name(path.stem + ".record.ipynb")


# -- parameters ------------------------------------------------------------------------

def parse_parameters(items: Sequence[str]) -> dict[str, Any]:
    """``["STEPS=100", "NAME=run a"]`` -> ``{"STEPS": 100, "NAME": "run a"}``: each value
    is a Python literal if it parses as one, else a string. Raises ``ValueError``."""
    params: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name.isidentifier() or keyword.iskeyword(name):
            raise ValueError(f"a parameter is name=value, e.g. -p STEPS=100; not {item!r}")
        try:
            params[name] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            params[name] = raw
    return params


def _tags(cell: nbformat.NotebookNode) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


def inject_parameters(nb: nbformat.NotebookNode, params: Mapping[str, Any]) -> int | None:
    """Put a cell tagged ``injected-parameters`` assigning ``params`` after the cell
    tagged ``parameters`` (at the top without one), replacing an earlier injected
    cell; its index, or None without parameters."""
    nb.cells = [c for c in nb.cells if "injected-parameters" not in _tags(c)]
    if not params:
        return None
    lines = ["# Parameters (injected by spotnb record)"]
    lines += [f"{name} = {value!r}" for name, value in params.items()]
    cell = nbformat.v4.new_code_cell("\n".join(lines), metadata={"tags": ["injected-parameters"]})
    marked = [i for i, c in enumerate(nb.cells) if "parameters" in _tags(c)]
    at = marked[0] + 1 if marked else 0
    nb.cells.insert(at, cell)
    return at


def default_parameters(nb: nbformat.NotebookNode) -> dict[str, Any]:
    """The literal assignments of the cell tagged ``parameters`` (``{}`` without one)."""
    for cell in nb.cells:
        if "parameters" not in _tags(cell):
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            return {}
        found = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                try:
                    found[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
        return found
    return {}


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


# -- provenance ------------------------------------------------------------------------

def versions() -> dict[str, str]:
    """Python, spotnb and the key packages installed here (no import needed)."""
    found = {"python": platform.python_version(), "spotnb": __version__}
    for name in KEY_PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def git_info(directory: Path) -> dict[str, Any] | None:
    """The commit checked out in ``directory`` and whether the directory has changes
    (uncommitted or untracked files); None outside a git work tree."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(directory), *args], capture_output=True,
                                  text=True, timeout=_GIT_SECONDS, check=False,
                                  env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None
    status = git("status", "--porcelain", "--", ".") or ""
    top = git("rev-parse", "--show-toplevel")
    remote = git("remote", "get-url", "origin")
    return {
        "commit": commit,
        "dirty": bool(status),
        "changes": [line[3:] for line in status.splitlines()][:20],
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "directory": (os.path.relpath(directory, top) if top else None),
        # user:token@ in a remote URL is a credential: never kept.
        "remote": re.sub(r"(?<=//)[^/@]+@", "", remote) if remote else None,
    }


# -- finding the run's jobs --------------------------------------------------------------

def _created_between(start: float, end: float) -> list[str]:
    """Ids of the jobs created in [start, end], from the default store and the index
    of jobs submitted from this machine (whatever their store)."""
    ids: set[str] = set()
    index = layout.index_dir()
    if index.is_dir():
        ids |= {p.stem for p in index.glob("*.json")}
    store_root = layout.default_store_root()
    if store_root.is_dir():
        ids |= set(open_store(store_root).list_children("jobs"))
    lo = time.strftime("%Y%m%d-%H%M%S", time.gmtime(start - 1))
    hi = time.strftime("%Y%m%d-%H%M%S", time.gmtime(end + 1))
    found = []
    for job_id in sorted(ids):
        stamp = _JOB_ID_TIME.match(job_id)
        if stamp and not lo <= stamp.group(1) <= hi:
            continue  # ids start with their creation time: no need to read the spec
        try:
            created = attach(job_id).spec.created
        except Exception as err:  # a job we cannot read (a bucket gone) is skipped
            log.debug("skipping job %s: %s", job_id, err)
            continue
        if start <= created <= end:
            found.append(job_id)
    return found


def _hook_records(nb: nbformat.NotebookNode) -> dict[str, tuple[int, dict[str, Any]]]:
    """Job records that the notebook layer left in output metadata, by job id, with
    their cell's index."""
    found = {}
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            job = ((output.get("metadata") or {}).get("spotnb") or {}).get("job")
            if isinstance(job, dict) and job.get("job_id"):
                found[str(job["job_id"])] = (index, dict(job))
    return found


def _code_body(code: str) -> str:
    """A ``%%spot_train`` cell's code after its first line (IPython passes the magic a
    trailing newline the cell does not have: blank ends do not count)."""
    return code.split("\n", 1)[1].strip() if "\n" in code else ""


def _cells_of(nb: nbformat.NotebookNode, handles: Sequence[JobHandle],
              hooked: Mapping[str, tuple[int, dict[str, Any]]]) -> dict[str, int | None]:
    """The cell each job ran from: by the record in its output metadata, else by its
    code (the first ``%%spot_train`` cell not yet taken whose body is the job's code;
    jobs come in creation order), else by its id in a cell's output (a job submitted
    from code), else None."""
    cells: dict[str, int | None] = {
        h.job_id: hooked[h.job_id][0] if h.job_id in hooked else None for h in handles}
    taken = {i for i in cells.values() if i is not None}
    for handle in handles:
        if cells[handle.job_id] is not None:
            continue
        body = _code_body(handle.spec.code)
        for i, cell in enumerate(nb.cells):
            if i not in taken and cell.cell_type == "code" and \
                    cell.source.lstrip().startswith("%%spot_train") and \
                    _code_body(cell.source.lstrip()) == body:
                cells[handle.job_id] = i
                taken.add(i)
                break
    for handle in handles:
        if cells[handle.job_id] is None:
            cells[handle.job_id] = next(
                (i for i, c in enumerate(nb.cells)
                 if c.cell_type == "code" and document.cell_mentions(c, handle.job_id)), None)
    return cells


def _kernel_outputs(client: Any, job_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Ask the kernel for the jobs' ``--out`` values (see
    :func:`spotnb.records.summary.kernel_outputs`); ``{}`` if it cannot say."""
    if not job_ids:
        return {}
    expr = ("__import__('spotnb.records.summary', fromlist=['kernel_outputs'])"
            f".kernel_outputs({json.dumps(list(job_ids))})")
    saved = client.timeout
    client.timeout = KERNEL_QUERY_SECONDS
    try:
        msg_id = client.kc.execute("", silent=True, store_history=False,
                                   user_expressions={"spotnb": expr})
        reply = client.wait_for_reply(msg_id)
        result = reply["content"]["user_expressions"]["spotnb"]
        if result.get("status") != "ok":
            log.warning("the kernel could not report the jobs' outputs: %s: %s",
                        result.get("ename"), result.get("evalue"))
            return {}
        return dict(json.loads(ast.literal_eval(result["data"]["text/plain"])))
    except Exception as err:  # the record goes on without the outputs' values
        log.warning("the kernel could not report the jobs' outputs: %s", err)
        return {}
    finally:
        client.timeout = saved


# -- recording ------------------------------------------------------------------------

def record_notebook(
    path: str | os.PathLike[str],
    output: str | os.PathLike[str] | None = None,
    *,
    parameters: Mapping[str, Any] | None = None,
    html: bool = False,
    provider: str | None = None,
    timeout: float | None = DEFAULT_CELL_TIMEOUT,
    kernel_name: str = "python3",
) -> Recording:
    """Execute the notebook at ``path`` and write its record to ``output`` (default
    ``NAME.record.ipynb`` next to it); see the module docstring.

    Raises ``FileNotFoundError`` without a notebook at ``path`` and ``ValueError`` for
    an unknown provider; a run that fails is a :class:`Recording` with status
    ``failed``, not an exception.
    """
    source = Path(path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"no notebook at {source}")
    if provider is not None and provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: choose one of {', '.join(PROVIDERS)}")
    out = Path(output).resolve() if output is not None else default_record_output(source)
    params = dict(parameters or {})
    warnings: list[str] = []

    nb = nbformat.read(source, as_version=4)
    defaults = default_parameters(nb)
    inject_parameters(nb, params)
    git = git_info(source.parent)
    start = time.time()
    kernel_said: dict[str, dict[str, Any]] = {}

    def before_shutdown(client: Any) -> None:
        ids = set(_created_between(start, time.time())) | set(_hook_records(nb))
        kernel_said.update(_kernel_outputs(client, sorted(ids)))

    # The magics name a job after the notebook, as in Jupyter; the provider is the
    # kernel's SpotMagics.provider, which %config and %%spot_train --provider override.
    env = {**os.environ, "JPY_SESSION_NAME": str(source)}
    extra = [f"--SpotMagics.provider={provider}"] if provider else []
    try:
        failure = execute(nb, source.parent, timeout=timeout, kernel_name=kernel_name,
                          extra_arguments=extra, env=env, before_shutdown=before_shutdown)
    except Exception as err:  # the kernel did not start, or died outside a cell
        text = traceback.format_exc()
        failure = CellFailure(index=-1, execution_count=None, first_line="",
                              ename=type(err).__name__, evalue=str(err), traceback=text)
    end = time.time()

    hooked = _hook_records(nb)
    handles, jobs, others = [], [], []
    for job_id in sorted(set(_created_between(start, end)) | set(hooked)):
        try:
            handles.append(attach(job_id))
        except JobNotFound:
            if job_id not in hooked:
                continue  # deleted while we looked
            # Its store is out of reach: the record the notebook layer left is all there is.
            jobs.append({**hooked[job_id][1], "cell": hooked[job_id][0]})
            warnings.append(f"job {job_id} is not in any store here: its record is the one "
                            "its cell's output metadata holds")
    cells = _cells_of(nb, handles, hooked)
    for handle in handles:
        cell = cells[handle.job_id]
        if cell is None:
            # Nothing in the notebook shows it: maybe another process's job. Named, not
            # counted: a record's totals are only what the notebook demonstrably ran.
            others.append({"job_id": handle.job_id, "name": handle.spec.name,
                           "created": iso(handle.spec.created)})
            warnings.append(f"job {handle.job_id} ({handle.spec.name!r}) was submitted while "
                            "the notebook ran, but no cell shows it: it is listed under "
                            "run.other_jobs, not counted")
            continue
        outputs = kernel_said.get(handle.job_id) or \
            (hooked.get(handle.job_id, (0, {}))[1].get("outputs") or {})
        jobs.append(_record_job(nb, handle, cell, outputs, warnings))

    dropped = document.drop_bundled_widgets(nb)
    status = "failed" if failure is not None else "completed"
    nb.metadata["spotnb"] = {
        "schema": SCHEMA_VERSION,
        "run": {
            "notebook": source.name,
            "status": status,
            "error": _failure_dict(failure),
            "parameters": _jsonable(params),
            "default_parameters": _jsonable(defaults),
            "provider": provider,
            "kernel": kernel_name,
            "start": iso(start),
            "end": iso(end),
            "duration_s": round(end - start, 3),
            "versions": {**versions(), "kernel_python":
                         nb.metadata.get("language_info", {}).get("version")},
            "platform": f"{platform.system()} {platform.machine()}",
            "git": git,
            "widgets_dropped": dropped,
            "other_jobs": others,
        },
        "jobs": jobs,
        "totals": totals(jobs),
    }
    clean, redactions = scrub(nb)
    nb = nbformat.from_dict(clean)
    nb.metadata["spotnb"]["run"]["redactions"] = redactions
    if redactions:
        warnings.append(f"{redactions} credential(s) in the notebook's output were replaced "
                        "by [redacted] in the record")
    try:
        nbformat.validate(nb)
    except nbformat.ValidationError as err:  # written anyway: an invalid record beats none
        warnings.append(f"the record does not pass nbformat validation: {err.message}")
    out.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out)
    size = out.stat().st_size
    if size > MAX_RECORD_BYTES:
        warnings.append(f"the record is {size / 2**20:.1f} MB: large outputs (images, "
                        "tables) make it heavy to share; clear or shrink them")
    html_path = document.export_html(nb, out.with_suffix(".html")) if html else None
    for line in warnings:  # returned to the caller, who tells the user
        log.info("%s", line)
    log.info("recorded %s (%s, %d job(s)) -> %s", source, status, len(jobs), out)
    return Recording(source=source, output=out, html=html_path, status=status,
                     failure=failure, seconds=end - start,
                     job_ids=tuple(j["job_id"] for j in jobs), size_bytes=size,
                     redactions=redactions, warnings=tuple(warnings))


def _record_job(nb: nbformat.NotebookNode, handle: JobHandle, cell_index: int,
                outputs: Mapping[str, Any], warnings: list[str]) -> dict[str, Any]:
    """The job's record (also stored as its ``summary.json``); its dashboard as a PNG
    in its cell, unless the cell already has one."""
    events = EventReader(handle.store).poll()
    record = job_record(handle, outputs=outputs, events=events)
    store_summary(handle, record)
    record["cell"] = cell_index
    cell = nb.cells[cell_index]
    if document.static_figures(cell, handle.job_id):
        return record
    if not figures.available():
        warnings.append(f"no static figure of job {handle.job_id}: {figures.INSTALL_HINT}")
        return record
    try:
        png = figures.dashboard_png(events, record)
    except Exception as err:  # a figure we cannot draw must not cost the record
        log.exception("drawing the dashboard of job %s failed", handle.job_id)
        warnings.append(f"no static figure of job {handle.job_id}: {err}")
        return record
    document.add_static_figure(
        cell, handle.job_id, png,
        f"Final dashboard of spotnb job {handle.job_id} ({handle.spec.name}): metrics, "
        "utilisation and spot price")
    return record


def _failure_dict(failure: CellFailure | None) -> dict[str, Any] | None:
    if failure is None:
        return None
    tb = failure.traceback
    if len(tb) > _MAX_ERROR_CHARS:
        tb = "…" + tb[-_MAX_ERROR_CHARS:]
    return {"cell": failure.index if failure.index >= 0 else None,
            "execution_count": failure.execution_count, "first_line": failure.first_line,
            "ename": failure.ename, "evalue": failure.evalue, "traceback": tb}


def totals(jobs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Cost, on-demand cost, savings and interruptions over a run's jobs."""
    cost = sum(float(j.get("cost_usd") or 0.0) for j in jobs)
    ondemand = sum(float(j.get("ondemand_cost_usd") or 0.0) for j in jobs)
    return {
        "jobs": len(jobs),
        "cost_usd": cost,
        "ondemand_cost_usd": ondemand,
        "savings_pct": None if (saving := savings_pct(cost, ondemand)) is None
        else round(saving, 2),
        "interruptions": sum(int(j.get("interruptions") or 0) for j in jobs),
        "attempts": sum(len(j.get("attempts") or []) for j in jobs),
    }

