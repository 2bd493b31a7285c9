"""The job index: where each job lives (the index of the jobs submitted from this
machine, ``$SPOTNB_HOME/index/``, or a store's ``jobs/``), and which job an id, a name
or the end of an id means (:func:`find_job`), for the API, the command line and the
magics alike.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from spotnb.client.results import job_outcome, when_text
from spotnb.protocol import layout
from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import NotFound, Store, StoreError, open_store

__all__ = ["JobNotFound", "JobRef", "find_job", "index_job", "open_job"]


class JobNotFound(LookupError):
    """No job, or more than one, matches what was asked for.

    ``query`` is what was asked for (None: the latest job), ``where`` the store looked
    in, ``candidates`` the jobs an ambiguous query matches (empty if none matched).
    :meth:`message` names the command that lists jobs (the magics say ``%spot_jobs``).
    """

    def __init__(self, query: str | None, where: str,
                 candidates: Sequence[JobRef] = ()) -> None:
        self.query = query
        self.where = where
        self.candidates = tuple(candidates)
        super().__init__(self.message())

    def message(self, lister: str = "`spotnb jobs`") -> str:
        if self.query is None:
            return (f"no jobs yet in {self.where}: submit one with %%spot_train in a "
                    "notebook or spotnb.submit()")
        if not self.candidates:
            return (f"no job {self.query!r} in {self.where}: give a job's id, the end of "
                    f"its id, or its name, as {lister} lists them")
        rows = "\n".join(f"  {c.job_id}  {c.name}  (submitted {when_text(c.created)}, "
                         f"{c.status()})" for c in self.candidates)
        return (f"{self.query!r} matches {len(self.candidates)} jobs:\n{rows}\n"
                "Give the id of the one you mean (or the end of it).")


@dataclasses.dataclass(frozen=True)
class JobRef:
    """A job found by :func:`find_job`: its id and name, when it was submitted, and
    where it lives."""

    job_id: str
    name: str
    created: float
    store_uri: str

    def status(self) -> str:
        """How the job ended (:func:`job_outcome`'s status: ``completed``, ``failed``,
        ``stopped``, ``pruned``...), ``not ended`` or ``unknown``."""
        try:
            store = open_store(self.store_uri)
            record = dict(json.loads(store.get(layout.RESULT)))
            return job_outcome(store, record)[0]
        except NotFound:
            return "not ended"
        except (StoreError, ValueError, KeyError, TypeError, OSError):
            return "unknown"


def index_job(spec: JobSpec) -> None:
    """Remember where the job lives, so attach and jobs() find it in any store."""
    path = layout.index_dir() / f"{spec.job_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"store_uri": spec.store_uri, "provider": spec.provider,
                                "name": spec.name, "created": spec.created}))


def _indexed_store(job_id: str) -> str | None:
    try:
        return str(json.loads((layout.index_dir() / f"{job_id}.json").read_text())["store_uri"])
    except (FileNotFoundError, ValueError, KeyError):
        return None


def open_job(job_id: str, store: str | None = None) -> tuple[Store, JobSpec]:
    if store is None and (uri := _indexed_store(job_id)) is not None:
        job_store = open_store(uri)
        where = uri
    else:
        root = open_store(store or layout.default_store_root())
        job_store = root.child(f"jobs/{job_id}")
        where = root.uri
    try:
        spec = JobSpec.from_json(job_store.get(layout.SPEC))
    except NotFound:
        raise JobNotFound(job_id, where) from None
    return job_store, spec


# What a job id looks like (spotnb's are 20250101-120000-ab12cd): only such a query is
# tried as an id directly, before any listing.
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def find_job(job: str | None = None, store: str | None = None) -> JobRef:
    """The job that ``job`` names: its id, its name, or the end of its id (tried in
    this order); None names the latest job. The magics, the CLI and :func:`attach` all
    resolve jobs here.

    Raises :class:`JobNotFound` if nothing matches, or if a name or an id's end matches
    several jobs (``candidates`` lists them).
    """
    if job is not None and _JOB_ID.match(job):
        try:  # the common case, a whole id: one read, no listing
            job_store, spec = open_job(job, store)
            return JobRef(spec.job_id, spec.name, spec.created, job_store.uri)
        except JobNotFound:
            pass
    where = store or layout.default_store_root()
    if job is not None and not job.strip():
        raise JobNotFound(job, str(where))  # every id ends with ""
    refs = _job_refs(store)
    if job is None:
        if not refs:
            raise JobNotFound(None, str(where))
        return max(refs, key=lambda r: r.created)
    for matches in ([r for r in refs if r.name == job],
                    [r for r in refs if r.job_id.endswith(job)]):
        if len(matches) == 1:
            return matches[0]
        if matches:
            raise JobNotFound(job, str(where), sorted(matches, key=lambda r: r.created))
    raise JobNotFound(job, str(where))


def _job_refs(store: str | None) -> list[JobRef]:
    """Every job of ``store`` (default: the local store, and every job submitted from
    this machine), from the job index where it has them, else from ``spec.json``."""
    refs: dict[str, JobRef] = {}
    if store is None and layout.index_dir().is_dir():
        for path in layout.index_dir().glob("*.json"):
            try:
                raw = json.loads(path.read_text())
                refs[path.stem] = JobRef(path.stem, str(raw["name"]), float(raw["created"]),
                                         str(raw["store_uri"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    root = open_store(store or layout.default_store_root())
    for job_id in root.list_children("jobs"):
        if job_id in refs:
            continue
        job_store = root.child(f"jobs/{job_id}")
        try:
            spec = JobSpec.from_json(job_store.get(layout.SPEC))
        except (NotFound, SpecError, ValueError, KeyError, TypeError):
            continue  # not a job (yet): its spec is written last
        refs[job_id] = JobRef(job_id, spec.name, spec.created, job_store.uri)
    return list(refs.values())
