"""How an EC2 instance of a job comes up: the wheel it installs and its boot script.

The user data (:func:`user_data`, rendered from ``bootstrap.sh`` next to this file)
installs the same spotnb the notebook runs (:func:`bundle`, uploaded to the job's
prefix) into a Python environment of its own and starts the instance agent
(:mod:`.instance`) through a systemd unit, so that it comes back after a reboot. What
the instance runs, narrated::

    first boot (cloud-init, once per instance)
      Step 1  identity from IMDSv2
      Step 2  WORK/venv on the image's Python: the Deep Learning AMI's PyTorch
              environment (DLAMI_PYTHON), else python3; the venv sees what that Python
              sees (a .pth: torch) but installs nothing there, so a system Python's
              PEP 668 marker (Ubuntu 23.04+) is never in the way
      Step 3  the wheel from <job prefix>/bootstrap/ (AWS CLI, else boto3: installed
              first when the image has neither), checked against its SHA-256
      Step 4  pip install <wheel>[aws] into the venv
      Step 5  systemd unit AGENT_UNIT (enabled, started); without systemd, the agent
              runs in the script
    every boot (the unit): the instance agent; a crash is retried in place,
      AGENT_TRIES times in a row at most

    any step fails -> its log to the job (bootreport.py): boot/<instance>.log, an
      ``instance`` event ``boot-failed`` with the step and the log's end; the
      BOOT_FAILURE_LIMIT-th failed boot in a row (no instance agent came up in between,
      ``boot/<instance>.ok``) fails the job and deletes its group and template (while
      the job runs on another instance, a standby's or a node's failed boots fail it
      only at three times that); then the instance powers off and EC2 terminates it
      (InstanceInitiatedShutdownBehavior); Auto Scaling launches the next one

The script holds names and a checksum, never a secret: the instance reads the job's
prefix with its role's credentials. It must stay under EC2's 16 KB of user data.
"""

from __future__ import annotations

import ast
import base64
import dataclasses
import gzip
import hashlib
import importlib.metadata
import io
import shlex
import zipfile
from pathlib import Path

import spotnb
from spotnb.providers.aws.resources import BOOTSTRAP_PREFIX, group_name, template_name
from spotnb.providers.aws.settings import DLAMI_PYTHON

__all__ = ["AGENT_UNIT", "BOOT_FAILURE_LIMIT", "Bundle", "bundle", "user_data"]

#: Boots that fail in a row (no instance agent came up in between) before the job
#: fails: one is a fluke (PyPI's hiccup), three is the image, the network or the wheel.
BOOT_FAILURE_LIMIT = 3
#: A crashed instance agent is started again this many times in a row, this far apart,
#: before the instance counts as failed to boot (the store's outages are waited out
#: inside the agent: this is for what is not).
AGENT_TRIES = 3
AGENT_RETRY_SECONDS = 10
#: The systemd unit that runs the instance agent at every boot.
AGENT_UNIT = "spotnb-agent.service"
#: EC2's limit on user data, before base64.
USER_DATA_LIMIT = 16 * 1024

_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Bundle:
    """The installed spotnb as a wheel: what every instance of a job installs."""

    filename: str
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


_BUNDLE: Bundle | None = None
# A fixed time for every zip entry, so the same code always makes the same wheel.
_ZIP_TIME = (2020, 1, 1, 0, 0, 0)


def bundle() -> Bundle:
    """A ``py3-none-any`` wheel of the spotnb this process runs (built once, ~100 ms).

    Built from the package's files as they are installed (an editable checkout
    included), so an instance runs exactly the notebook's code. Dependencies come from
    the installed metadata.
    """
    global _BUNDLE
    if _BUNDLE is not None:
        return _BUNDLE
    version = spotnb.__version__
    root = Path(spotnb.__file__).resolve().parent
    dist = f"spotnb-{version}.dist-info"
    files: dict[str, bytes] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            files["spotnb/" + path.relative_to(root).as_posix()] = path.read_bytes()
    try:
        requires = importlib.metadata.requires("spotnb") or []
    except importlib.metadata.PackageNotFoundError:
        requires = []
    metadata = ["Metadata-Version: 2.1", "Name: spotnb", f"Version: {version}",
                "Requires-Python: >=3.10"]
    extras = sorted({r.split("extra ==")[1].strip().strip("'\"") for r in requires
                     if "extra ==" in r})
    metadata += [f"Provides-Extra: {e}" for e in extras]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    files[f"{dist}/METADATA"] = ("\n".join(metadata) + "\n").encode()
    files[f"{dist}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: spotnb\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n")
    files[f"{dist}/entry_points.txt"] = b"[console_scripts]\nspotnb = spotnb.client.cli:main\n"
    record = []
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, _ZIP_TIME)
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            wheel.writestr(info, data)
    _BUNDLE = Bundle(f"spotnb-{version}-py3-none-any.whl", buf.getvalue())
    return _BUNDLE


def _report_source() -> str:
    """``bootreport.py`` as it runs on the instance: its code without the docstrings
    and comments (the user data's 16 KB), the same program."""
    tree = ast.parse((_HERE / "bootreport.py").read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and \
                isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            body[0].value.value = ""  # kept as an empty docstring: the body stays valid
    return ast.unparse(tree)


def user_data(*, job_id: str, store_uri: str, wheel: Bundle,
              store_region: str | None = None) -> str:
    """The instance's boot script (see the module docstring). ``store_region``: the
    region of the job's bucket (its home), which the instance's S3 clients use
    wherever it runs (``SPOTNB_STORE_REGION``); none: the instance's own.

    Variables a test harness (or an image that prepares itself) may set on the
    instance: ``SPOTNB_INSTANCE_DIR`` (default ``/opt/spotnb``), ``SPOTNB_PYTHON`` (an
    interpreter that already has this spotnb: nothing is installed),
    ``SPOTNB_BASE_PYTHON`` (the Python to build the environment on),
    ``SPOTNB_SYSTEMD_UNIT_DIR`` (where systemd units go; systemd is then taken to run)
    and ``SPOTNB_IMDS_ENDPOINT``.
    """
    packed = base64.encodebytes(gzip.compress(_report_source().encode(), 9, mtime=0))
    report = packed.decode().rstrip("\n")
    values = {
        "VERSION": spotnb.__version__, "JOB_URI": store_uri, "JOB_ID": job_id,
        "WHEEL": wheel.filename, "WHEEL_SHA256": wheel.sha256,
        "BOOTSTRAP_KEY": f"{BOOTSTRAP_PREFIX}/{wheel.filename}",
        "GROUP": group_name(job_id), "TEMPLATE": template_name(job_id),
        "DLAMI_PYTHON": DLAMI_PYTHON, "BOOT_FAILURE_LIMIT": str(BOOT_FAILURE_LIMIT),
        "AGENT_TRIES": str(AGENT_TRIES), "AGENT_RETRY_SECONDS": str(AGENT_RETRY_SECONDS),
        "UNIT": AGENT_UNIT, "STORE_REGION": store_region or "",
    }
    script = (_HERE / "bootstrap.sh").read_text()
    for key, value in values.items():
        script = script.replace(f"@{key}@", shlex.quote(value))
    script = script.replace("@BOOTREPORT@", report)
    size = len(script.encode())
    if size > USER_DATA_LIMIT:
        raise TypeError(f"the boot script is {size} bytes, over EC2's {USER_DATA_LIMIT} of "
                        "user data; this is a spotnb bug")
    return script
