"""The machine a simulated instance boots on: a plain image, and its operating system.

The AWS simulator (:mod:`spotnb.testing.simulator`) runs each instance's real user
data. This module is the machine it runs on, so that the boot script is tried as EC2
runs it, not in the test's own environment:

* :func:`power_on` starts the instance's **operating system**: one process (a child
  subreaper, so every process of the instance stays below it) that plays cloud-init,
  systemd and the power button. It runs the user data once, with bash (its output to
  ``console.log``); starts the systemd units the user data enables (``systemctl`` on
  the instance's ``PATH`` asks it through ``run/initctl``; their output to
  ``journal.log``) and, at every later boot, those it enabled; and takes
  ``poweroff``, ``shutdown`` and ``reboot`` from the instance. At a power-off it does
  EC2's part: the instance is terminated (or stopped), as its
  ``InstanceInitiatedShutdownBehavior`` says; moto does not copy that setting from a
  launch template (it answers ``stop``), so it is read from the template the instance
  was launched from, as EC2 applies it.
* :func:`reboot` reboots the instance's operating system: every process stopped
  (SIGTERM, then SIGKILL), then the enabled units started again, the user data not run
  again (cloud-init runs it once per instance); its metadata service stays.
* :class:`PlainImage` is what a plain image has: a "system" Python that has neither
  spotnb nor anything else installed (a copy of this interpreter under a prefix of its
  own, its standard library linked), with pip and a PEP 668 ``EXTERNALLY-MANAGED``
  marker, as on Ubuntu 23.04+; by default the Deep Learning AMI's PyTorch environment
  on it (a virtual environment, as ``/opt/pytorch`` is, with a stand-in for torch);
  optionally without ``ensurepip`` (Debian and Ubuntu without ``python3-venv``); no
  boto3, and optionally the AWS CLI; in place of the internet, a local wheel index of
  spotnb's dependencies (:func:`wheel_index`: ``pip download`` once per session, kept
  in the temporary directory for the next one; the image is deleted at exit) that pip
  on the instance is configured to use (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``; no pip
  configuration file of this machine). The instance's environment has no
  ``PYTHONPATH`` and no virtual environment: only the simulator's variables
  (``SPOTNB_*``, ``AWS_*``) come through.

What it does not model: the instance's own root file system (the boot script's files
go to ``SPOTNB_INSTANCE_DIR``, the instance's directory, and its systemd units to
``SPOTNB_SYSTEMD_UNIT_DIR``); systemd's dependencies between units, restart policies
and start limits (the boot script needs none: it retries the agent itself); a reboot's
new boot id and clock (processes keep this machine's); the network (PyPI is the local
index; IMDS and AWS are the simulator's endpoints); GPUs.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["PlainImage", "plain_image", "power_on", "preinstalled_environment", "reboot",
           "wheel_index"]

log = logging.getLogger(__name__)

#: systemd waits this long for a stopping service before it kills it (its default is
#: 90 s; a simulated instance has nothing that needs more).
STOP_GRACE_SECONDS = 5.0
#: The instance's systemd units (``SPOTNB_SYSTEMD_UNIT_DIR``), its control channel and
#: its tools, under the instance's directory.
UNITS = "etc/systemd/system"
WANTS = "multi-user.target.wants"
INITCTL = "run/initctl"
TOOLS = "sbin"
MACHINE = "machine.json"

# ----------------------------------------------------------------- the operating system


def power_on(home: Path, user_data: Path, env: Mapping[str, str], *, instance_id: str,
             region: str, ec2_credentials: Mapping[str, str] | None = None
             ) -> subprocess.Popen[bytes]:
    """Boot an instance whose directory is ``home`` for the first time: its operating
    system, which runs ``user_data`` with ``env`` (plus the systemd unit directory and
    its tools on ``PATH``). Returns the operating system's process: the instance runs
    while it does. ``ec2_credentials``: the keys (``AWS_ACCESS_KEY_ID``, ...) of EC2's
    part at a power-off (the simulator's administrator's, with IAM enforced: not the
    instance's and not the notebook's); by default this process's environment's."""
    home = home.resolve()
    for sub in (UNITS, "run", TOOLS):
        (home / sub).mkdir(parents=True, exist_ok=True)
    fifo = home / INITCTL
    if not fifo.exists():
        os.mkfifo(fifo)
    _write_tools(home / TOOLS, fifo)
    machine_env = dict(env)
    machine_env["SPOTNB_SYSTEMD_UNIT_DIR"] = str(home / UNITS)
    machine_env["PATH"] = os.pathsep.join([str(home / TOOLS), env.get("PATH", os.defpath)])
    (home / MACHINE).write_text(json.dumps({
        "instance_id": instance_id, "region": region, "user_data": str(user_data),
        "env": machine_env}))
    # The operating system itself runs with the simulator's environment (it plays EC2
    # at a power-off), never the instance's.
    os_env = {**os.environ, **(ec2_credentials or {})}
    package_root = str(Path(__file__).resolve().parents[2])
    os_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, os.environ.get("PYTHONPATH")) if p)
    with open(home / "console.log", "ab") as console:
        return subprocess.Popen([sys.executable, "-c", _OS_MAIN, str(home)],
                                cwd=home, env=os_env, stdin=subprocess.DEVNULL,
                                stdout=console, stderr=subprocess.STDOUT,
                                start_new_session=True)


# The operating system's process (not ``-m``: the package imports this module first).
_OS_MAIN = "import sys; from spotnb.testing.boot import _main; sys.exit(_main(sys.argv[1:]))"


def reboot(instance: Any) -> None:
    """Reboot a simulated instance (a :class:`~spotnb.testing.SimInstance`, or its
    directory): what ``sudo reboot`` on it does. Returns once asked; the processes stop
    and the enabled units start again a moment later."""
    home = Path(getattr(instance, "dir", instance))
    _tell(home / INITCTL, "reboot")


def _tell(fifo: Path, command: str) -> None:
    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, (command + "\n").encode())
    finally:
        os.close(fd)


_SYSTEMCTL = r"""#!/bin/bash
# systemctl of a simulated instance (spotnb.testing.boot): daemon-reload, enable,
# start, enable --now; --no-block and --quiet are accepted. Nothing else is simulated.
units="${SPOTNB_SYSTEMD_UNIT_DIR:?}"
cmd="" now=0 names=()
for arg in "$@"; do
  case "$arg" in
    --now) now=1 ;;
    --no-block|--quiet|-q) ;;
    -*) echo "systemctl (simulated): option $arg is not simulated" >&2; exit 1 ;;
    *) if [ -z "$cmd" ]; then cmd=$arg; else names+=("$arg"); fi ;;
  esac
done
start() { [ -f "$units/$1" ] || { echo "Unit $1 not found." >&2; exit 5; }
          echo "start $1" >@INITCTL@; }
case "$cmd" in
  daemon-reload) ;;
  enable)
    mkdir -p "$units/@WANTS@"
    for n in "${names[@]}"; do
      [ -f "$units/$n" ] || { echo "Unit file $n does not exist." >&2; exit 1; }
      ln -sf "$units/$n" "$units/@WANTS@/$n"
      echo "Created symlink $units/@WANTS@/$n -> $units/$n."
      if [ "$now" = 1 ]; then start "$n"; fi
    done ;;
  start) for n in "${names[@]}"; do start "$n"; done ;;
  *) echo "systemctl (simulated): $cmd is not simulated" >&2; exit 1 ;;
esac
"""


def _write_tools(tools: Path, fifo: Path) -> None:
    """``systemctl``, ``poweroff``, ``halt``, ``shutdown`` and ``reboot`` of the
    instance: each asks its operating system through ``fifo``."""
    quoted = shlex.quote(str(fifo))
    scripts = {
        "systemctl": _SYSTEMCTL.replace("@INITCTL@", quoted).replace("@WANTS@", WANTS),
        "poweroff": f"#!/bin/sh\necho poweroff >{quoted}\n",
        "halt": f"#!/bin/sh\necho poweroff >{quoted}\n",
        "reboot": f"#!/bin/sh\necho reboot >{quoted}\n",
        # shutdown [-h|-P|-r] [TIME]: at once whatever the time (a simulated instance
        # has no one to warn).
        "shutdown": ("#!/bin/sh\ncase \" $* \" in *\" -r \"*) what=reboot ;; *) "
                     f"what=poweroff ;; esac\necho $what >{quoted}\n"),
    }
    for name, text in scripts.items():
        path = tools / name
        path.write_text(text)
        path.chmod(0o755)


class _OperatingSystem:
    """The instance's operating system (module docstring); ``run`` is its life."""

    def __init__(self, home: Path) -> None:
        machine = json.loads((home / MACHINE).read_text())
        self.home = home
        self.instance_id: str = machine["instance_id"]
        self.region: str = machine["region"]
        self.user_data = Path(machine["user_data"])
        self.env: dict[str, str] = machine["env"]
        self.units = home / UNITS
        # pid -> what it is (for the console) and its process
        self.children: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
        self.halted = threading.Event()

    def say(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} os] {text}", flush=True)

    def run(self) -> int:
        _become_subreaper()
        signal.signal(signal.SIGTERM, lambda *_: self.halted.set())
        fifo = os.open(self.home / INITCTL, os.O_RDWR | os.O_NONBLOCK)
        self.say(f"booting {self.instance_id} (first boot: cloud-init runs the user data)")
        self._spawn(["/bin/bash", str(self.user_data)], self.env, self.home,
                    "user data", self.home / "console.log")
        pending = b""
        while not self.halted.is_set():
            ready, _, _ = select.select([fifo], [], [], 0.2)
            if ready:
                with contextlib.suppress(BlockingIOError):
                    pending += os.read(fifo, 4096)
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if self._command(line.decode().split()):
                    return 0
            self._reap()
        self.say("ended by EC2")
        return 0

    def _command(self, words: list[str]) -> bool:
        """Carry out one request; whether the machine is off."""
        if words[:1] == ["start"] and len(words) == 2:
            self._start_unit(words[1])
        elif words == ["reboot"]:
            self.say("reboot: stopping every process")
            self._stop_all()
            self.say("booting again: the enabled units start (the user data does not run)")
            for unit in sorted((self.units / WANTS).glob("*")) if (
                    self.units / WANTS).is_dir() else ():
                self._start_unit(unit.name)
        elif words == ["poweroff"]:
            self.say("power-off: stopping every process")
            self._stop_all()
            self._ec2_shutdown()
            return True
        else:
            self.say(f"unknown request {' '.join(words)!r}")
        return False

    def _start_unit(self, name: str) -> None:
        path = self.units / name
        try:
            command, extra, cwd = _parse_unit(path.read_text())
        except (OSError, ValueError) as err:
            self.say(f"cannot start {name}: {err}")
            return
        self.say(f"starting {name}: {shlex.join(command)}")
        self._spawn(command, {**self.env, **extra}, Path(cwd) if cwd else Path("/"), name,
                    self.home / "journal.log")

    def _spawn(self, command: list[str], env: Mapping[str, str], cwd: Path, what: str,
               out: Path) -> None:
        with open(out, "ab") as sink:
            proc = subprocess.Popen(command, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                    stdout=sink, stderr=subprocess.STDOUT)
        self.children[proc.pid] = (what, proc)

    def _reap(self) -> None:
        """Collect every child that ended (orphans come here too: a subreaper)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            known = self.children.pop(pid, None)
            if known is not None:
                what, proc = known
                proc.returncode = os.waitstatus_to_exitcode(status)
                self.say(f"{what} ended with {proc.returncode}")

    def _stop_all(self) -> None:
        """Every process of the instance: SIGTERM, then SIGKILL after the grace."""
        import psutil

        family = psutil.Process().children(recursive=True)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in family:
                with contextlib.suppress(psutil.Error):
                    proc.send_signal(sig)
            _gone, family = psutil.wait_procs(family, timeout=STOP_GRACE_SECONDS)
            self._reap()
            if not family:
                break
        self._reap()

    def _ec2_shutdown(self) -> None:
        """EC2, after the instance's operating system powered off: terminate or stop it
        as its InstanceInitiatedShutdownBehavior says."""
        from spotnb.providers.aws import _boto

        ec2 = _boto.client("ec2", self.region, origin="simulator")
        behaviour = _shutdown_behaviour(ec2, self.instance_id)
        if behaviour == "terminate":
            ec2.terminate_instances(InstanceIds=[self.instance_id])
        else:
            ec2.stop_instances(InstanceIds=[self.instance_id])
        self.say(f"powered off: EC2 {'terminated' if behaviour == 'terminate' else 'stopped'} "
                 f"{self.instance_id} (InstanceInitiatedShutdownBehavior={behaviour})")


def _shutdown_behaviour(ec2: Any, instance_id: str) -> str:
    """The instance's InstanceInitiatedShutdownBehavior: its launch template's, which EC2
    applies at launch (moto does not), else its own attribute."""
    described = ec2.describe_instances(InstanceIds=[instance_id])["Reservations"]
    tags = {t["Key"]: t["Value"] for r in described for i in r["Instances"]
            for t in i.get("Tags", ())}
    template = tags.get("aws:ec2launchtemplate:id")
    if template:
        versions = ec2.describe_launch_template_versions(
            LaunchTemplateId=template,
            Versions=[tags.get("aws:ec2launchtemplate:version", "$Latest")],
        )["LaunchTemplateVersions"]
        for version in versions:
            behaviour = version["LaunchTemplateData"].get("InstanceInitiatedShutdownBehavior")
            if behaviour:
                return str(behaviour)
    return str(ec2.describe_instance_attribute(
        InstanceId=instance_id, Attribute="instanceInitiatedShutdownBehavior",
    )["InstanceInitiatedShutdownBehavior"]["Value"])


def _parse_unit(text: str) -> tuple[list[str], dict[str, str], str | None]:
    """A service unit's ``ExecStart``, ``Environment`` and ``WorkingDirectory``."""
    command: list[str] | None = None
    env: dict[str, str] = {}
    cwd = None
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, _, value = line.partition("=")
        if section != "Service":
            continue
        if key == "ExecStart":
            command = shlex.split(value)
        elif key == "Environment":
            for item in shlex.split(value):
                name, _, setting = item.partition("=")
                env[name] = setting
        elif key == "WorkingDirectory":
            cwd = value
    if not command:
        raise ValueError("no ExecStart= in [Service]")
    return command, env, cwd


def _become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (Linux), as to an init."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_child_subreaper = 36
    if libc.prctl(pr_set_child_subreaper, 1, 0, 0, 0) != 0:
        log.warning("could not become a child subreaper: errno %d", ctypes.get_errno())


# ------------------------------------------------------------------- the images

#: What an instance's environment keeps of the process that runs the simulator, on an
#: image with spotnb preinstalled, besides the simulator's own variables: the machine's.
#: (The compute threads a process may use, too: every simulated instance shares this
#: machine's cores.)
MACHINE_VARIABLES = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "PYTHONPATH",
                     "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "VIRTUAL_ENV",
                     "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def preinstalled_environment(harness: Mapping[str, str]) -> dict[str, str]:
    """An instance's environment on an image with spotnb preinstalled (this interpreter,
    spotnb where this process imports it from, ``PYTHONPATH``): the simulator's
    variables from ``harness`` (``SPOTNB_*``, ``AWS_*``) and the machine's
    (:data:`MACHINE_VARIABLES`), nothing else. The notebook's own environment (a
    secret, a token in it) never reaches an EC2 instance, so it does not reach a
    simulated one either."""
    return {k: v for k, v in harness.items()
            if k.startswith(("SPOTNB_", "AWS_")) or k in MACHINE_VARIABLES}



@dataclasses.dataclass(frozen=True)
class PlainImage:
    """A machine image without spotnb (module docstring). ``root`` holds its "system"
    Python (``root/bin/python3``); ``index`` is its internet: the wheels pip may
    install; ``pytorch`` is its Deep Learning AMI's PyTorch environment, if it has one
    (``root/opt/pytorch``: a virtual environment on the system Python, with a stand-in
    for torch, the package ``image_torch``)."""

    root: Path
    index: Path
    pytorch: Path | None = None

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python3"

    def environment(self, harness: Mapping[str, str], home: Path) -> dict[str, str]:
        """An instance's environment on this image: the simulator's variables from
        ``harness`` (``SPOTNB_*`` but the interpreter overrides, ``AWS_*``), a ``PATH``
        of the image's Python and the system's tools, pip pointed at the index (and
        not compiling bytecode: a boot in half the time). The PyTorch environment is
        named in ``SPOTNB_BASE_PYTHON``: the boot script looks for the DLAMI's at
        ``/opt/pytorch``, which a test cannot make."""
        env = {k: v for k, v in harness.items()
               if k.startswith("AWS_") or (k.startswith("SPOTNB_") and k not in (
                   "SPOTNB_PYTHON", "SPOTNB_BASE_PYTHON"))}
        (home / "root").mkdir(parents=True, exist_ok=True)
        env.update({
            "PATH": os.pathsep.join([str(self.root / "bin"), "/usr/local/bin", "/usr/bin",
                                     "/bin", "/usr/sbin", "/sbin"]),
            "HOME": str(home / "root"), "LANG": "C.UTF-8",
            "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": str(self.index), "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_CACHE_DIR": "1", "PIP_NO_COMPILE": "1",
        })
        if self.pytorch is not None:
            env["SPOTNB_BASE_PYTHON"] = str(self.pytorch / "bin" / "python")
        return env

    def offline(self) -> PlainImage:
        """The same image with no route to PyPI (a private subnet without a NAT
        gateway): its index is empty."""
        return dataclasses.replace(self, index=Path(tempfile.mkdtemp(prefix="spotnb-index-",
                                                                     dir=self.root)))

    def without(self, *projects: str) -> PlainImage:
        """The same image whose index lacks ``projects`` (a mirror without them, or no
        route to PyPI for them): pip fails on them."""
        names = {_normalise(p) for p in projects}
        index = Path(tempfile.mkdtemp(prefix="spotnb-index-", dir=self.root))
        for wheel in self.index.iterdir():
            if _normalise(wheel.name.split("-")[0]) not in names:
                (index / wheel.name).symlink_to(wheel)
        return dataclasses.replace(self, index=index)


_IMAGES: dict[tuple[bool, bool, bool], PlainImage] = {}
_IMAGES_LOCK = threading.Lock()


def plain_image(*, dlami: bool = True, ensurepip: bool = True,
                aws_cli: bool = False) -> PlainImage:
    """The plain image (built once per process, in the temporary directory; see the
    module docstring). ``dlami``: it has the Deep Learning AMI's PyTorch environment
    (:attr:`PlainImage.pytorch`), else only the system Python (a custom image).
    ``ensurepip=False``: its Python cannot make a virtual environment with pip in it
    (Debian's and Ubuntu's without ``python3-venv``). ``aws_cli``: it has the AWS CLI
    (version 1, from PyPI, its packages apart from the system Python's, as a system
    package's are), and still no boto3 for its Python."""
    key = (dlami, ensurepip, aws_cli)
    with _IMAGES_LOCK:
        image = _IMAGES.get(key)
        if image is None:
            root = Path(tempfile.mkdtemp(prefix="spotnb-image-"))
            atexit.register(shutil.rmtree, root, True)  # the wheel index stays
            _system_python(root, ensurepip)
            if aws_cli:
                _aws_cli(root)
            pytorch = _pytorch_environment(root) if dlami else None
            image = _IMAGES[key] = PlainImage(root, wheel_index(), pytorch)
        return image


def _pytorch_environment(root: Path) -> Path:
    """``root/opt/pytorch``, as the DLAMI's: a virtual environment on the system Python,
    holding ``image_torch`` (no pip of its own: nothing is to install into it)."""
    env = root / "opt" / "pytorch"
    subprocess.run([str(root / "bin" / "python3"), "-m", "venv", "--without-pip", str(env)],
                   check=True, capture_output=True, env={"PATH": "/usr/bin:/bin"})
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(subprocess.run([str(env / "bin" / "python"), "-c", where], check=True,
                               capture_output=True, text=True,
                               env={"PATH": "/usr/bin:/bin"}).stdout.strip())
    (site / "image_torch").mkdir()
    (site / "image_torch" / "__init__.py").write_text(
        '"""A stand-in for the image\'s torch (spotnb.testing.boot)."""\n__version__ = "2.99"\n')
    return env


def _aws_cli(root: Path) -> None:
    """``root/bin/aws``: the AWS CLI, installed apart in ``root/opt/aws-cli``."""
    target = root / "opt" / "aws-cli"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet",
                           "--disable-pip-version-check", "--only-binary=:all:", "--target",
                           str(target), "awscli"], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"installing the AWS CLI failed: {done.stderr.strip()[-2000:]}")
    aws = root / "bin" / "aws"
    aws.write_text(f"#!/bin/sh\nPYTHONPATH={shlex.quote(str(target))} exec "
                   f"{shlex.quote(str(root / 'bin' / 'python3'))} -m awscli \"$@\"\n")
    aws.chmod(0o755)


def _system_python(root: Path, ensurepip: bool) -> None:
    """A Python whose prefix is ``root``, as ``/usr`` is a system Python's: this
    interpreter's binary (``root/bin/python3``), a standard library that links this
    one's, pip (from ``ensurepip``'s wheel) and a PEP 668 marker. (A prefix of its own
    also for the virtual environments made on it: their ``home`` is ``root/bin``.)"""
    import zipfile

    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    prefix = root
    (prefix / "bin").mkdir(parents=True)
    binary = Path(os.path.realpath(Path(sys.base_prefix) / "bin" / version))
    if not binary.exists():
        binary = Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))
    shutil.copy2(binary, prefix / "bin" / version)
    lib = prefix / "lib"
    lib.mkdir()
    shared = sysconfig.get_config_var("INSTSONAME")
    libdir = sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and shared and libdir:
        (lib / shared).symlink_to(Path(libdir) / shared)
    stdlib = Path(sysconfig.get_paths(vars={"installed_base": sys.base_prefix,
                                            "base": sys.base_prefix})["stdlib"])
    own = lib / version
    own.mkdir()
    for entry in stdlib.iterdir():
        if entry.name == "site-packages" or (entry.name == "ensurepip" and not ensurepip):
            continue
        (own / entry.name).symlink_to(entry)
    site = own / "site-packages"
    site.mkdir()
    bundled = sorted((stdlib / "ensurepip" / "_bundled").glob("pip-*.whl"))
    if bundled:  # the image's pip (python3-pip), which PEP 668 keeps to itself
        with zipfile.ZipFile(bundled[-1]) as wheel:
            wheel.extractall(site)
    (own / "EXTERNALLY-MANAGED").write_text(
        "[externally-managed]\nError=This is the image's Python (spotnb.testing.boot): "
        "install into a virtual environment.\n")
    (root / "bin" / "python3").symlink_to(version)


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


_INDEX: Path | None = None


def wheel_index() -> Path:
    """A directory of wheels: what ``pip install spotnb[aws]`` needs besides spotnb
    (which the job's prefix holds), for this interpreter, downloaded from PyPI (or this
    machine's pip configuration) once. Kept in the temporary directory under the hash
    of spotnb's requirements, so the next session reuses it."""
    global _INDEX
    if _INDEX is not None:
        return _INDEX
    from spotnb.providers.aws.bootstrap import bundle

    wheel = bundle()
    requires = _requirements(wheel.data)
    key = hashlib.sha256("\n".join([sys.version, *requires]).encode()).hexdigest()[:16]
    index = Path(tempfile.gettempdir()) / f"spotnb-wheels-{key}"
    if not (index / ".complete").exists():
        work = Path(tempfile.mkdtemp(prefix="spotnb-wheels-"))
        source = work / wheel.filename
        source.write_bytes(wheel.data)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
             "--only-binary=:all:", "--dest", str(work / "index"), f"{source}[aws]"],
            capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"pip download of spotnb's dependencies failed: "
                               f"{done.stderr.strip()[-2000:]}")
        for own in (work / "index").glob("spotnb-*.whl"):
            own.unlink()  # PyPI has no such spotnb: the job's prefix does
        (work / "index" / ".complete").write_text("\n".join(requires))
        with contextlib.suppress(OSError):  # another session made it meanwhile
            (work / "index").rename(index)
        shutil.rmtree(work, ignore_errors=True)
    _INDEX = index
    return index


def _requirements(wheel: bytes) -> list[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(wheel)) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def _main(argv: Iterable[str]) -> int:
    (home,) = list(argv)
    logging.basicConfig(level=logging.INFO)
    return _OperatingSystem(Path(home)).run()


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
