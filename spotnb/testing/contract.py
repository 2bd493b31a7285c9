"""The request shapes spotnb sends, held to botocore's service models.

The simulator's server parses every request it receives back into the parameters of
its operation (``PutObject``'s ``Bucket``, ``Key``, ``IfNoneMatch``, ...), with moto's
request parsers and the running botocore's service models: what the client serialised,
from any process (the notebook, the CLI, every instance's agents). :func:`check` then
validates each recorded call with ``botocore.validate.ParamValidator`` against a set of
service models: the running botocore's, or an older botocore's (:func:`models_of`), such
as the oldest one spotnb's requirements allow. A call that the older botocore cannot
make (a parameter its model lacks, a required one missing, an operation it does not
know) is a request that a user with that botocore would see fail before it is sent.

Parameters that the running botocore adds by itself (flexible checksums, ``EncodingType``
on listings, ``ContentMD5``) are not spotnb's: an older botocore would simply not send
those it does not know, so they are left out of the check where the model lacks them.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import gzip
import io
import json
import logging
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Call", "ModelSet", "Violation", "check", "models_of", "parse_request"]

log = logging.getLogger(__name__)

#: Parameters that botocore adds to requests by itself (never spotnb's code).
BOTOCORE_ADDED = frozenset({
    "ChecksumAlgorithm", "ChecksumCRC32", "ChecksumCRC32C", "ChecksumCRC64NVME",
    "ChecksumSHA1", "ChecksumSHA256", "ContentMD5", "ContentLength", "EncodingType",
    "SdkChecksumAlgorithm",
})
# moto's names for services whose signing name differs from botocore's model name.
_MODEL_NAMES = {"monitoring": "cloudwatch", "email": "ses", "servicequotas": "service-quotas",
                "tagging": "resourcegroupstaggingapi", "execute-api": "apigateway"}
_CREDENTIAL = re.compile(r"Credential=[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request")


@dataclasses.dataclass(frozen=True)
class Call:
    """One request as its operation's parameters (payloads left out)."""

    service: str  # the model's name: "s3", "ec2", "autoscaling", ...
    operation: str  # "PutObject"
    params: dict[str, Any]
    origin: str = "other"
    #: why the request could not be parsed ("" when it was)
    error: str = ""


@dataclasses.dataclass(frozen=True)
class Violation:
    """A recorded call that a set of service models refuses."""

    call: Call
    models: str  # which models: "botocore 1.35.0"
    report: str  # ParamValidator's report, or why the operation is unknown

    def __str__(self) -> str:
        return (f"{self.call.service}.{self.call.operation} (from {self.call.origin}) "
                f"against {self.models}: {self.report}")


def parse_request(environ: dict[str, Any], body: bytes) -> Call | None:
    """The call a WSGI request to moto makes, parsed with the running botocore's model
    (moto's own parsers); None for requests that are not AWS API calls."""
    from moto.core.parse import PROTOCOL_PARSERS
    from moto.core.request import Request, determine_request_protocol
    from moto.core.routing import get_service_router
    from moto.core.utils import get_service_model

    m = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
    if not m:
        return None
    service = _MODEL_NAMES.get(m.group(1), m.group(1))
    request = Request(dict(environ, **{"wsgi.input": io.BytesIO(body)}))
    model = get_service_model(service)
    protocol = determine_request_protocol(model, request.content_type)
    url_params: dict[str, Any] = {}
    if protocol in ("query", "ec2"):
        operation = model.operation_model(request.values.get("Action", ""))
    elif protocol == "json":
        target = request.headers.get("X-Amz-Target", "")
        operation = model.operation_model(target.rsplit(".", 1)[-1])
    else:
        operation, url_params = get_service_router(model.service_name).match(request)
    parser = PROTOCOL_PARSERS[protocol](operation)
    params = parser.parse({"method": request.method, "values": request.values,
                           "headers": request.headers, "body": body,
                           "url_path": request.path, "url_params": url_params})
    _drop_payload(operation.input_shape, params)
    return Call(service, operation.name, _plain(params))


def _drop_payload(shape: Any, params: dict[str, Any]) -> None:
    """Replace a streamed payload (an object's bytes) by an empty one: the records
    keep shapes, not data."""
    payload = shape.serialization.get("payload") if shape is not None else None
    if payload and payload in params and shape.members[payload].type_name in (
            "blob", "string"):
        params[payload] = b"" if shape.members[payload].type_name == "blob" else ""


def _plain(value: Any) -> Any:
    """moto's parsed mappings as plain dicts and lists."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class ModelSet:
    """Service models of one botocore: its ``data`` folder, or a botocore wheel."""

    def __init__(self, name: str, source: Path) -> None:
        self.name = name
        self.source = source
        self._models: dict[str, Any] = {}

    @classmethod
    def installed(cls) -> ModelSet:
        """The running botocore's models."""
        import botocore

        return cls(f"botocore {botocore.__version__} (installed)",
                   Path(botocore.__file__).parent / "data")

    def service(self, name: str) -> Any:
        """``botocore.model.ServiceModel`` of ``name`` (its newest API version)."""
        from botocore.model import ServiceModel

        if name not in self._models:
            self._models[name] = ServiceModel(self._load(name), service_name=name)
        return self._models[name]

    def _load(self, name: str) -> dict[str, Any]:
        if self.source.is_dir():
            versions = sorted(p for p in (self.source / name).iterdir() if p.is_dir())
            for filename in ("service-2.json", "service-2.json.gz"):
                path = versions[-1] / filename
                if path.exists():
                    data = path.read_bytes()
                    return dict(json.loads(gzip.decompress(data) if filename.endswith(
                        ".gz") else data))
            raise FileNotFoundError(f"no service-2 model of {name} in {versions[-1]}")
        with zipfile.ZipFile(self.source) as wheel:
            found = sorted(n for n in wheel.namelist() if n.startswith(
                f"botocore/data/{name}/") and "/service-2.json" in n)
            if not found:
                raise FileNotFoundError(f"no service-2 model of {name} in {self.source}")
            data = wheel.read(found[-1])
            return dict(json.loads(gzip.decompress(data) if found[-1].endswith(".gz")
                                   else data))


@functools.lru_cache(maxsize=4)
def models_of(version: str, cache: Path | None = None) -> ModelSet:
    """The service models of botocore ``version``: its wheel, downloaded from PyPI with
    pip into ``cache`` (``~/.cache/spotnb/botocore``) the first time."""
    import botocore

    if version == botocore.__version__:
        return ModelSet.installed()
    folder = cache or Path.home() / ".cache" / "spotnb" / "botocore"
    wheel = folder / f"botocore-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # test workers share the cache
        if not wheel.exists():
            _download(version, folder, wheel)
    return ModelSet(f"botocore {version}", wheel)


def _download(version: str, folder: Path, wheel: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--disable-pip-version-check", "-q", "-d", str(folder), f"botocore=={version}"],
        capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not wheel.exists():
        raise RuntimeError(f"could not get botocore {version}'s models with pip (PyPI "
                           f"must be reachable once; the wheel is kept in {folder}): "
                           f"{done.stderr.strip()[-500:]}")


def check(calls: Iterable[Call], models: ModelSet) -> list[Violation]:
    """Every call that ``models`` refuse (each distinct shape once)."""
    from botocore.model import OperationNotFoundError
    from botocore.validate import ParamValidator

    validator = ParamValidator()
    found: list[Violation] = []
    seen: set[str] = set()
    for call in calls:
        key = json.dumps([call.service, call.operation, call.params, call.error],
                         sort_keys=True, default=repr)
        if key in seen:
            continue
        seen.add(key)
        if call.error:
            found.append(Violation(call, models.name, f"not parsed: {call.error}"))
            continue
        try:
            operation = models.service(call.service).operation_model(call.operation)
        except (OperationNotFoundError, FileNotFoundError) as err:
            found.append(Violation(call, models.name, f"unknown operation ({err})"))
            continue
        shape = operation.input_shape
        members = set(shape.members) if shape is not None else set()
        params = {k: v for k, v in call.params.items()
                  if k in members or k not in BOTOCORE_ADDED}
        report = validator.validate(params, shape) if shape is not None else None
        if report is not None and report.has_errors():
            found.append(Violation(call, models.name, report.generate_report()))
        elif shape is None and params:
            found.append(Violation(call, models.name, f"takes no parameters: {params}"))
    return found
