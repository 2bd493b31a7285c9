"""AWS Lambda as the simulator plays it: moto stores functions, this module runs them.

moto keeps what ``CreateFunction``, ``UpdateFunctionCode``/``Configuration`` and
``AddPermission`` make, but invokes only through Docker. :class:`LambdaRuntime` runs a
function's **code from its zip**, as Lambda's Python runtime would:

* the zip is extracted once per ``CodeSha256`` into ``<workdir>/lambda/code/<sha>``,
  read-only (Lambda's ``/var/task`` is), and run by ``sys.executable -S -B`` (no
  site-packages: the standard library and the zip only, as the runtime sees a
  bundle; the only Python is this one, whatever ``Runtime`` says, as long as it is a
  ``python3.*`` runtime) with ``PYTHONPATH`` and the working directory the extracted
  folder. A small bootstrap imports the module of ``Handler``, reads the event (JSON
  on stdin), and calls ``handler(event, context)`` (``function_name``,
  ``function_version``, ``invoked_function_arn``, ``memory_limit_in_mb``,
  ``aws_request_id``, ``log_group_name``, ``log_stream_name``,
  ``get_remaining_time_in_millis()``); the root logger has a handler, at
  ``WARNING`` as in Lambda; an import error, a missing handler or an exception is a
  function error, with Lambda's ``[ERROR]`` line;
* its environment is Lambda's: the function's ``Environment.Variables``, then
  ``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_LAMBDA_FUNCTION_NAME`` and the other
  reserved variables, and the credentials of a session of the function's role (STS
  ``AssumeRole``, session name the function's name; with IAM enforced every request
  is checked against the role's policies, as an instance's are), plus the
  simulator's endpoint variables (``AWS_ENDPOINT_URL``...), nothing of this process;
* it is killed after the function's ``Timeout`` (a function error);
* its output goes to ``<workdir>/lambda/<region>/<function>.log`` (``START``, the
  output, ``END``, ``REPORT`` with the status, per invocation, as in its CloudWatch log
  group), and a failed invocation is logged at ``WARNING`` with its output's tail;
* **asynchronous invocation** (:meth:`LambdaRuntime.invoke_async`): a thread per
  function runs its invocations one at a time, in arrival order. Simplification:
  while one runs, at most one further event *per key* (EventBridge's deliveries use
  the Auto Scaling group's name) waits; a later one replaces it (spotnb's handler
  reads the group's whole history: it loses nothing). A function error is retried
  twice, about one and two minutes later as on AWS (scaled as the simulator's notice
  period is), unless a newer event of the same key waits by then.

``CreateFunction``/``UpdateFunctionCode``/``UpdateFunctionConfiguration`` are refused
where Lambda refuses them and moto does not: a role that does not trust
``lambda.amazonaws.com`` ("cannot be assumed by Lambda"), a zip over 50 MB
(``RequestEntityTooLargeException``) or over 250 MB unzipped, a file that is not a
zip, reserved environment variables, variables over 4 KB.

Not modelled: concurrency (Lambda would run invocations of one function in parallel),
execution environments reused between invocations (each is a fresh process: no warm
start, ``/tmp`` is this machine's), memory size, layers, container images, versions
and aliases' code (``$LATEST`` runs), event ages and destinations, synchronous
``Invoke`` (moto's needs Docker), CloudWatch Logs (the log file stands for it; the
role needs no ``logs:`` permission here), IAM's propagation delay (a role made a
moment ago can be given to a function at once; on AWS ``CreateFunction`` may refuse
it for some seconds).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["RESERVED_VARIABLES", "Invocation", "LambdaRuntime"]

log = logging.getLogger(__name__)

#: Lambda's reserved environment variables: a function may not set them.
RESERVED_VARIABLES = frozenset({
    "_HANDLER", "_X_AMZN_TRACE_ID", "AWS_DEFAULT_REGION", "AWS_REGION",
    "AWS_EXECUTION_ENV", "AWS_LAMBDA_FUNCTION_NAME", "AWS_LAMBDA_FUNCTION_MEMORY_SIZE",
    "AWS_LAMBDA_FUNCTION_VERSION", "AWS_LAMBDA_INITIALIZATION_TYPE",
    "AWS_LAMBDA_LOG_GROUP_NAME", "AWS_LAMBDA_LOG_STREAM_NAME", "AWS_ACCESS_KEY",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_LAMBDA_RUNTIME_API", "LAMBDA_TASK_ROOT", "LAMBDA_RUNTIME_DIR"})
#: Lambda's quotas: a zip uploaded in the request, its unzipped size, the variables.
ZIPPED_LIMIT = 50 * 1024 * 1024
REQUEST_LIMIT = 69905067  # the request size Lambda's refusal names (50 MiB in base64)
UNZIPPED_LIMIT = 262144000
ENVIRONMENT_LIMIT = 4096
#: Lambda's waits before the two retries of a failed asynchronous invocation, in AWS
#: seconds (about one and two minutes); scaled as the simulator's notice period is.
RETRY_SECONDS = (60.0, 120.0)
# The kill after a function's Timeout, and at stop: how long a killed one may take.
KILL_WAIT_SECONDS = 5.0
LOG_TAIL_CHARS = 4000
LAMBDA_TRUST = "lambda.amazonaws.com"

# The runtime's bootstrap (argv: handler, timeout, request id, function ARN, memory).
_BOOTSTRAP = r"""
import importlib, json, logging, os, sys, time, traceback
handler_name, timeout, request_id, arn, memory = sys.argv[1:6]
deadline = time.monotonic() + float(timeout)

class Context:
    function_name = os.environ["AWS_LAMBDA_FUNCTION_NAME"]
    function_version = os.environ["AWS_LAMBDA_FUNCTION_VERSION"]
    invoked_function_arn = arn
    memory_limit_in_mb = int(memory)
    aws_request_id = request_id
    log_group_name = os.environ["AWS_LAMBDA_LOG_GROUP_NAME"]
    log_stream_name = os.environ["AWS_LAMBDA_LOG_STREAM_NAME"]

    def get_remaining_time_in_millis(self):
        return max(0, int((deadline - time.monotonic()) * 1000))

logging.basicConfig(format="[%(levelname)s]\t%(asctime)s\t" + request_id + "\t%(message)s")
event = json.load(sys.stdin)
module_name, _, attribute = handler_name.rpartition(".")
try:
    module = importlib.import_module(module_name)
except Exception as err:
    print(f"[ERROR] Runtime.ImportModuleError: Unable to import module '{module_name}': "
          f"{err}", file=sys.stderr, flush=True)
    traceback.print_exc()
    sys.exit(2)
handler = getattr(module, attribute, None)
if handler is None:
    print(f"[ERROR] Runtime.HandlerNotFound: Handler '{attribute}' missing on module "
          f"'{module_name}'", file=sys.stderr, flush=True)
    sys.exit(2)
try:
    handler(event, Context())
except Exception as err:
    print(f"[ERROR] {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    traceback.print_exc()
    sys.exit(1)
"""


@dataclasses.dataclass(frozen=True)
class Invocation:
    """One finished (or refused) asynchronous invocation of a function."""

    function: str
    region: str
    request_id: str
    #: what the function received (the event, or what the target's Input made of it)
    event: Any
    #: 0 for the first, 1 and 2 for Lambda's retries after a function error
    attempt: int
    #: ``succeeded``, ``failed`` (the handler raised, or its process exited non-zero),
    #: ``timed out`` (killed after the function's Timeout), ``not run`` (``reason``)
    status: str
    exit_code: int | None
    started: float
    ended: float
    #: this invocation's output (its last characters), or why it did not run
    output: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


@dataclasses.dataclass
class _Pending:
    event: Any
    attempt: int
    due: float


@dataclasses.dataclass
class _Function:
    """One function's queue, thread and running process."""

    region: str
    name: str
    pending: dict[str, _Pending] = dataclasses.field(default_factory=dict)
    thread: threading.Thread | None = None
    proc: subprocess.Popen[bytes] | None = None


class LambdaRuntime:
    """Runs functions of moto's Lambda (see the module docstring). ``session(role_arn,
    name)``: the role's credentials (``AccessKeyId``, ``SecretAccessKey``,
    ``SessionToken``) or why Lambda could not assume it; ``endpoint_env()``: the
    variables that point an SDK at the simulator; ``scale()``: real seconds per AWS
    second, for the retries' waits."""

    def __init__(self, workdir: Path, account: str,
                 session: Callable[[str, str], dict[str, str] | str],
                 endpoint_env: Callable[[], dict[str, str]],
                 scale: Callable[[], float]) -> None:
        self.root = workdir / "lambda"
        self.account = account
        self._session = session
        self._endpoint_env = endpoint_env
        self._scale = scale
        self._lock = threading.Condition()
        self._stopping = False
        self._functions: dict[tuple[str, str], _Function] = {}
        self._done: dict[tuple[str, str], list[Invocation]] = {}
        self._extracted: dict[str, Path] = {}

    # ------------------------------------------------------------------- the API

    def log_path(self, region: str, function: str) -> Path:
        """Where ``function``'s invocations in ``region`` write their output."""
        return self.root / region / f"{function}.log"

    def invoke_async(self, region: str, function: str, event: Any,
                     key: str) -> None:
        """Queue an asynchronous invocation of ``function`` (its name) in ``region``;
        a waiting event of the same ``key`` is replaced (module docstring)."""
        with self._lock:
            if self._stopping:
                return
            found = self._functions.setdefault((region, function), _Function(region, function))
            found.pending[key] = _Pending(event, 0, 0.0)
            if found.thread is None:
                found.thread = threading.Thread(target=self._serve, args=(found,),
                                                name=f"spotnb-sim-lambda-{function}",
                                                daemon=True)
                found.thread.start()
            self._lock.notify_all()

    def invocations(self, function: str, region: str | None = None) -> list[Invocation]:
        """The finished invocations of ``function`` (in every region by default), in
        the order they ended."""
        with self._lock:
            return [i for (r, name), done in self._done.items()
                    if name == function and region in (None, r) for i in done]

    def wait_for(self, function: str, count: int = 1, timeout: float = 60.0,
                 region: str | None = None,
                 until: Callable[[list[Invocation]], bool] | None = None) -> list[Invocation]:
        """Wait until ``function`` has ``count`` finished invocations (or ``until`` of
        them holds); they are returned. TimeoutError (with the function's log's tail)
        if not within ``timeout``."""
        def ready() -> bool:
            found = self.invocations(function, region)
            return until(found) if until is not None else len(found) >= count

        with self._lock:
            if self._lock.wait_for(ready, timeout):
                return self.invocations(function, region)
        tails = [self._tail(path, 0) for path in sorted(self.root.glob(f"*/{function}.log"))]
        raise TimeoutError(f"{function}: {len(self.invocations(function, region))} "
                           f"invocation(s) after {timeout}s, not what was awaited; its "
                           f"log ends:\n" + "\n".join(tails))

    def stop(self) -> None:
        """End every running invocation and every function's thread; the extracted
        code is writable again (so that the work folder can be removed)."""
        with self._lock:
            self._stopping = True
            functions = list(self._functions.values())
            self._lock.notify_all()
        for found in functions:
            self._kill(found.proc)
        for found in functions:
            if found.thread is not None:
                found.thread.join(timeout=KILL_WAIT_SECONDS * 2)
        for path in self._extracted.values():
            _writable(path)

    # ------------------------------------------------------------ moto's refusals

    def install(self) -> Callable[[], None]:
        """Lambda's refusals that moto lacks (module docstring); returns the undo."""
        from moto.awslambda.exceptions import InvalidParameterValueException, LambdaClientError
        from moto.awslambda.models import LambdaBackend

        runtime = self

        def check_code(code: dict[str, Any] | None) -> None:
            if not code or "ZipFile" not in code:
                return
            raw = code["ZipFile"]
            data = base64.b64decode(raw) if isinstance(raw, (str, bytes)) else b""
            if len(data) > ZIPPED_LIMIT:
                raise LambdaClientError("RequestEntityTooLargeException", (
                    f"Request must be smaller than {REQUEST_LIMIT} bytes for the "
                    "CreateFunction operation"))
            try:
                with zipfile.ZipFile(io.BytesIO(data)) as archive:
                    unzipped = sum(i.file_size for i in archive.infolist())
            except zipfile.BadZipFile:
                raise InvalidParameterValueException(
                    "Could not unzip uploaded file. Please check your file, then try to "
                    "upload again.") from None
            if unzipped > UNZIPPED_LIMIT:
                raise InvalidParameterValueException(
                    f"Unzipped size must be smaller than {UNZIPPED_LIMIT} bytes")

        def check_configuration(spec: dict[str, Any]) -> None:
            variables = (spec.get("Environment") or {}).get("Variables") or {}
            reserved = sorted(set(variables) & RESERVED_VARIABLES)
            if reserved:
                raise InvalidParameterValueException(
                    "Lambda was unable to configure your environment variables because the "
                    "environment variables you have provided contains reserved keys that "
                    "are currently not supported for modification. Reserved keys used in "
                    f"this request: {', '.join(reserved)}")
            if len(json.dumps(variables, separators=(",", ":"))) > ENVIRONMENT_LIMIT:
                raise InvalidParameterValueException(
                    "Lambda was unable to configure your environment variables because the "
                    "environment variables you have provided exceeded the 4KB limit. "
                    f"String measured: {json.dumps(variables)}")
            role = spec.get("Role")
            if role and isinstance(runtime._trust(str(role)), str):
                raise InvalidParameterValueException(
                    "The role defined for the function cannot be assumed by Lambda.")

        original_create = LambdaBackend.create_function
        original_code = LambdaBackend.update_function_code
        original_configuration = LambdaBackend.update_function_configuration

        def create_function(backend: Any, spec: dict[str, Any]) -> Any:
            check_configuration(spec)
            check_code(spec.get("Code"))
            return original_create(backend, spec)

        def update_function_code(backend: Any, name: str, qualifier: str,
                                 body: dict[str, Any]) -> Any:
            check_code(body)
            return original_code(backend, name, qualifier, body)

        def update_function_configuration(backend: Any, name: str, qualifier: str,
                                          body: dict[str, Any]) -> Any:
            check_configuration(body)
            return original_configuration(backend, name, qualifier, body)

        LambdaBackend.create_function = create_function  # type: ignore[method-assign,assignment]
        LambdaBackend.update_function_code = update_function_code  # type: ignore[method-assign,assignment]
        LambdaBackend.update_function_configuration = update_function_configuration  # type: ignore[method-assign,assignment]

        def undo() -> None:
            LambdaBackend.create_function = original_create  # type: ignore[method-assign]
            LambdaBackend.update_function_code = original_code  # type: ignore[method-assign]
            LambdaBackend.update_function_configuration = original_configuration  # type: ignore[method-assign]

        return undo

    def _trust(self, role_arn: str) -> bool | str:
        """True if ``role_arn`` exists and trusts Lambda, else why not."""
        from moto.iam.models import iam_backends

        try:
            role = iam_backends[self.account]["aws"].get_role_by_arn(role_arn)
        except Exception:
            return f"the role {role_arn} does not exist"
        document = role.assume_role_policy_document
        trust = json.loads(document) if isinstance(document, str) else document
        for s in trust.get("Statement", []):
            services = (s.get("Principal") or {}).get("Service", [])
            services = [services] if isinstance(services, str) else services
            if s.get("Effect") == "Allow" and LAMBDA_TRUST in services:
                return True
        return f"the role {role_arn} does not trust {LAMBDA_TRUST}"

    # ------------------------------------------------------------- invocations

    def _serve(self, found: _Function) -> None:
        """A function's thread: its invocations one at a time, in arrival order."""
        while True:
            with self._lock:
                while True:
                    if self._stopping:
                        return
                    now = time.time()
                    ready = next((k for k, p in found.pending.items() if p.due <= now), None)
                    if ready is not None:
                        key, item = ready, found.pending.pop(ready)
                        break
                    # Only retries wait for a time; otherwise for an event or the stop.
                    due = min((p.due for p in found.pending.values()), default=None)
                    self._lock.wait(None if due is None else max(0.0, due - now))
            done = self._invoke(found, item)
            with self._lock:
                self._done.setdefault((found.region, found.name), []).append(done)
                if done.status in ("failed", "timed out") and done.attempt < len(
                        RETRY_SECONDS) and key not in found.pending and not self._stopping:
                    found.pending[key] = _Pending(item.event, done.attempt + 1, time.time()
                                                  + RETRY_SECONDS[done.attempt] * self._scale())
                self._lock.notify_all()

    def _invoke(self, found: _Function, item: _Pending) -> Invocation:
        """Run one invocation to its end (module docstring)."""
        from moto.awslambda.models import lambda_backends

        request_id = _uuid()
        started = time.time()

        def not_run(reason: str) -> Invocation:
            log.warning("Lambda %s in %s did not run: %s", found.name, found.region,
                        reason)
            return Invocation(found.name, found.region, request_id, item.event,
                              item.attempt, "not run", None, started, time.time(), reason)

        try:
            fn = lambda_backends[self.account][found.region].get_function(found.name)
        except Exception:
            return not_run("the function does not exist")
        if not str(fn.run_time or "").startswith("python3."):
            return not_run(f"the simulator runs python3.* runtimes only, not {fn.run_time}")
        trusted = self._trust(fn.role)
        if isinstance(trusted, str):
            return not_run(f"the role defined for the function cannot be assumed by "
                           f"Lambda: {trusted}")
        credentials = self._session(fn.role, found.name)
        if isinstance(credentials, str):
            return not_run(credentials)
        code = self._extract(fn.code_digest, fn.code_bytes)
        env = {**(fn.environment_vars or {}), **self._endpoint_env(),
               "AWS_REGION": found.region, "AWS_DEFAULT_REGION": found.region,
               "AWS_LAMBDA_FUNCTION_NAME": found.name, "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
               "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(fn.memory_size),
               "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{found.name}",
               "AWS_LAMBDA_LOG_STREAM_NAME": f"{time.strftime('%Y/%m/%d')}/[$LATEST]"
                                             f"{secrets.token_hex(16)}",
               "AWS_EXECUTION_ENV": f"AWS_Lambda_{fn.run_time}", "_HANDLER": str(fn.handler),
               "LAMBDA_TASK_ROOT": str(code), "LANG": "en_US.UTF-8", "TZ": ":UTC",
               "PATH": "/usr/local/bin:/usr/bin/:/bin", "PYTHONPATH": str(code),
               "AWS_ACCESS_KEY_ID": credentials["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": credentials["SecretAccessKey"],
               "AWS_SESSION_TOKEN": credentials["SessionToken"]}
        path = self.log_path(found.region, found.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        timeout = float(fn.timeout or 3)
        with path.open("ab") as out:
            offset = out.tell()
            out.write(f"START RequestId: {request_id} Version: $LATEST\n".encode())
            out.flush()
            with self._lock:
                if self._stopping:
                    return not_run("the simulator stopped")
                found.proc = subprocess.Popen(
                    [sys.executable, "-S", "-B", "-c", _BOOTSTRAP, str(fn.handler),
                     str(timeout), request_id, str(fn.function_arn), str(fn.memory_size)],
                    stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=code,
                    env=env, start_new_session=True)
            proc = found.proc
            status = "succeeded"
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(item.event).encode())
                proc.stdin.close()
            except OSError:
                pass  # it ended before reading: its exit status says why
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                status = "timed out"
                self._kill(proc)
            with self._lock:
                found.proc = None
            if status != "timed out" and proc.returncode != 0:
                status = "failed"
            ended = time.time()
            if status == "timed out":
                out.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {request_id} Task timed "
                          f"out after {timeout:.2f} seconds\n".encode())
            out.write(f"END RequestId: {request_id}\nREPORT RequestId: {request_id}\t"
                      f"Duration: {(ended - started) * 1000:.2f} ms\tStatus: {status}\n"
                      .encode())
        output = self._tail(path, offset)
        if status != "succeeded":
            log.warning("Lambda %s in %s: invocation %s (attempt %d) %s; its log (%s) "
                        "ends:\n%s", found.name, found.region, request_id, item.attempt + 1,
                        status, path, output)
        return Invocation(found.name, found.region, request_id, item.event, item.attempt,
                          status, proc.returncode, started, ended, output)

    def _extract(self, digest: str, data: bytes) -> Path:
        """The function's zip, extracted once per CodeSha256 (read-only)."""
        with self._lock:
            if digest in self._extracted:
                return self._extracted[digest]
            target = self.root / "code" / digest
            partial = target.with_name(target.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                archive.extractall(partial)
            _read_only(partial)
            partial.rename(target)
            self._extracted[digest] = target
            return target

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        """SIGKILL to an invocation's process group (its children too)."""
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=KILL_WAIT_SECONDS)
        except subprocess.TimeoutExpired:
            log.warning("Lambda invocation process %d did not end after SIGKILL", proc.pid)

    @staticmethod
    def _tail(path: Path, offset: int) -> str:
        try:
            with path.open("rb") as f:
                f.seek(max(offset, path.stat().st_size - LOG_TAIL_CHARS))
                return f.read().decode(errors="replace")
        except OSError:
            return ""


def _uuid() -> str:
    import uuid

    return str(uuid.uuid4())


def _read_only(root: Path) -> None:
    for path in [*root.rglob("*"), root]:
        path.chmod(0o555 if path.is_dir() else 0o444)


def _writable(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
