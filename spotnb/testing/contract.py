"""The request shapes spotnb sends, held to botocore's service models.

The simulator's server parses every request it receives back into the parameters of
its operation (``PutObject``'s ``Bucket``, ``Key``, ``IfNoneMatch``, ...), with moto's
request parsers and the running botocore's service models: what the client serialised,
from any process (the notebook, the CLI, every instance's agents). :func:`check` then
validates each recorded call with ``botocore.validate.ParamValidator`` against a set of
service models (:class:`ModelSet`): the running botocore's, or an older botocore's
``data`` folder, such as the oldest one spotnb's requirements allow (spotnb's own
tests keep that one's models in ``tests/aws_reference/``: nothing is downloaded). A
call that the older botocore cannot make (a parameter its model lacks, a required one
missing, an operation it does not know) is a request that a user with that botocore
would see fail before it is sent.

Parameters that the running botocore adds by itself (flexible checksums, ``EncodingType``
on listings, ``ContentMD5``) are not spotnb's: an older botocore would simply not send
those it does not know, so they are left out of the check where the model lacks them.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["Call", "ModelSet", "Violation", "check", "parse_request"]

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
    """Replace a streamed payload (an object's bytes) and every blob (a Lambda
    function's zip) by an empty one: the records keep shapes, not data."""
    payload = shape.serialization.get("payload") if shape is not None else None
    if payload and payload in params and shape.members[payload].type_name in (
            "blob", "string"):
        params[payload] = b"" if shape.members[payload].type_name == "blob" else ""
    for name, member in (shape.members.items() if shape is not None else ()):
        if name not in params:
            continue
        if member.type_name == "blob":
            params[name] = b""
        elif member.type_name == "structure" and isinstance(params[name], dict):
            _drop_payload(member, params[name])


def _plain(value: Any) -> Any:
    """moto's parsed mappings as plain dicts and lists."""
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class ModelSet:
    """Service models of one botocore: a folder laid out as its ``data`` folder
    (``<service>/<api-version>/service-2.json[.gz]``), named ``name`` in reports."""

    def __init__(self, name: str, source: str | os.PathLike[str]) -> None:
        self.name = name
        self.source = Path(source)
        if not self.source.is_dir():
            raise FileNotFoundError(f"no botocore models folder at {self.source}")
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
        folder = self.source / name
        versions = sorted(p for p in folder.iterdir() if p.is_dir()) if folder.is_dir() \
            else []
        for version in reversed(versions):
            for filename in ("service-2.json", "service-2.json.gz"):
                path = version / filename
                if path.exists():
                    data = path.read_bytes()
                    return dict(json.loads(gzip.decompress(data) if filename.endswith(
                        ".gz") else data))
        raise FileNotFoundError(f"no service-2 model of {name} in {self.source}")


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
