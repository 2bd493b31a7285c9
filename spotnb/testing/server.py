"""moto in server mode on loopback, with the S3 behaviour moto lacks, and the
environment that points boto3 at it. See :mod:`spotnb.testing`."""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import io
import logging
import os
import re
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from spotnb.testing import contract
from spotnb.testing.contract import Call
from spotnb.testing.iam import IamEnforcer

__all__ = ["DEFAULT_ACCOUNT", "DEFAULT_REGION", "FAKE_CREDENTIALS", "LostResponses",
           "MotoServer", "Request", "RequestLog", "aws_environment"]

log = logging.getLogger(__name__)

# moto's reset of every backend, the first right after its start: a bound for a
# machine under load (10 s was too short with six test runs on two cores), not a pace.
RESET_TIMEOUT_SECONDS = 120.0

DEFAULT_ACCOUNT = "123456789012"
# The simulator reaches into moto's in-process state (see the module docstring): it is
# tested with this moto.
MOTO_REQUIREMENT = "moto[server]>=5.2,<5.3"
DEFAULT_REGION = "us-east-1"
# Fake, but shaped like real keys, so tests can scan for them (moto accepts any key).
FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "AKIASPOTNBFAKE000000",
                    "AWS_SECRET_ACCESS_KEY": "spotnbFakeSecretKeyNeverReal0000000000000"}
CLOSED_ENDPOINT = "http://127.0.0.1:9"  # the discard port: nothing listens there
_AWS_VARIABLES = (
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_PRICING", "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_DEFAULT_REGION",
    "AWS_REGION", "AWS_EC2_METADATA_DISABLED", "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)


def _list_moto_modules_once() -> None:
    """moto's dispatcher lists its package's directory (a ``listdir`` and an ``isdir``
    per service, ~150) for every request, under its one lock: an eighth of the server's
    CPU in an AWS test. The listing cannot change while the process runs, so it is read
    once."""
    from moto import backends

    listing = backends.list_of_moto_modules
    if getattr(listing, "spotnb_once", False):
        return
    modules = tuple(listing())

    def list_of_moto_modules() -> Iterator[str]:
        return iter(modules)

    list_of_moto_modules.spotnb_once = True  # type: ignore[attr-defined]
    backends.list_of_moto_modules = list_of_moto_modules


def _moto_server_class() -> Any:
    """``ThreadedMotoServer`` with spotnb's S3 middleware and no request logging."""
    try:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            create_backend_app,
        )
        from werkzeug.serving import WSGIRequestHandler, make_server
    except ImportError as err:
        raise ImportError(f"spotnb.testing needs moto in server mode ({err}): "
                          f"pip install {MOTO_REQUIREMENT!r}") from None

    _list_moto_modules_once()

    class QuietHandler(WSGIRequestHandler):
        def log(self, type: str, message: str, *args: Any) -> None:
            log.debug("moto %s: " + message, type, *args)

    class Server(ThreadedMotoServer):
        requests: RequestLog
        lost: LostResponses
        outage: Outage
        wrong_region: list[tuple[str, str, str, str]]
        iam: Any  # spotnb.testing.iam.IamEnforcer

        def _server_entry(self) -> None:
            self.iam.app = _S3Middleware(DomainDispatcherApplication(create_backend_app),
                                         self.lost, self.outage, self.wrong_region)
            app = self.requests.wrap(self.iam)
            self._server = make_server(self._ip_address, self._port, app, True,
                                       request_handler=QuietHandler)
            self._server_ready_event.set()
            self._server.serve_forever(poll_interval=0.1)

    return Server


@dataclasses.dataclass(frozen=True)
class Request:
    """One request that reached the simulated AWS."""

    time: float
    service: str
    operation: str
    origin: str
    status: int
    #: the request as its operation's parameters (:mod:`spotnb.testing.contract`)
    call: Call | None = dataclasses.field(default=None, compare=False, repr=False)


class RequestLog:
    """Every request the server answered: service, operation, origin, status.

    The origin is the ``spotnb-origin/<name>`` part of the User-Agent that spotnb's
    clients send (:func:`spotnb.providers.aws._boto.client`): ``job-agent``,
    ``instance-agent``, ``runtime``, ``notebook``, ``cli``, ``simulator``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Request] = []

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def calls(self) -> list[Call]:
        """Every request as its operation's parameters, for
        :func:`spotnb.testing.contract.check`."""
        return [r.call for r in self.snapshot() if r.call is not None]

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def wrap(self, app: Callable[..., Any]) -> Callable[..., Any]:
        def logged(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
            service, operation, origin = _describe(environ)
            call = _parse(environ, origin) if service else None
            if call is not None:
                environ[CALL_KEY] = call
                if not call.error:
                    operation = call.operation
            status: list[int] = []

            def respond(code: str, headers: Any, *args: Any) -> Any:
                status.append(int(code.split()[0]))
                return start_response(code, headers, *args)

            result = app(environ, respond)
            if service:
                with self._lock:
                    self._requests.append(Request(time.time(), service, operation, origin,
                                                  status[0] if status else 0, call))
            return result
        return logged


#: Where a request's parsed :class:`~spotnb.testing.contract.Call` is kept in its WSGI
#: environ, for the middlewares inside the log (IAM, faults).
CALL_KEY = "spotnb.call"


def _parse(environ: dict[str, Any], origin: str) -> Call:
    """The request's call (parameters); a call with ``error`` set if moto's parsers
    cannot read it. The body is read once and put back."""
    size = int(environ.get("CONTENT_LENGTH") or 0)
    body = environ["wsgi.input"].read(size) if size else b""
    environ["wsgi.input"] = io.BytesIO(body)
    service = ""
    try:
        parsed = contract.parse_request(environ, body)
    except Exception as err:  # a request moto's parsers cannot read: the check says so
        m = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
        service = m.group(1) if m else ""
        return contract.Call(service, "?", {}, origin,
                             error=f"{type(err).__name__}: {str(err)[:300]} "
                                   f"({environ.get('PATH_INFO')})")
    if parsed is None:
        return contract.Call(service, "?", {}, origin, error="no AWS signature")
    return dataclasses.replace(parsed, origin=origin)


_CREDENTIAL = re.compile(r"Credential=[^/]+/\d{8}/[^/]+/([^/]+)/aws4_request")
_ORIGIN = re.compile(r"spotnb-origin/([\w.-]+)")


def _describe(environ: dict[str, Any]) -> tuple[str, str, str]:
    """(service, operation, origin) of a WSGI request to moto; ("", "", "") for moto's
    own API."""
    path = environ.get("PATH_INFO", "/")
    if path.startswith("/moto-api"):
        return "", "", ""
    m = _CREDENTIAL.search(environ.get("HTTP_AUTHORIZATION", ""))
    service = m.group(1) if m else ""
    o = _ORIGIN.search(environ.get("HTTP_USER_AGENT", ""))
    origin = o.group(1) if o else "other"
    method = environ.get("REQUEST_METHOD", "GET")
    query = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    target = environ.get("HTTP_X_AMZ_TARGET")
    if target:
        return service, target.rsplit(".", 1)[-1], origin
    if service == "s3":
        return service, _s3_operation(method, path, query, environ), origin
    action = query.get("Action", [""])[0]
    if not action and method == "POST":
        # Query protocol: the action is in the form body; read it, then put it back.
        size = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(size) if size else b""
        environ["wsgi.input"] = io.BytesIO(body)
        action = urllib.parse.parse_qs(body.decode(errors="replace")).get("Action", [""])[0]
    return service, action or method, origin


def _s3_operation(method: str, path: str, query: dict[str, list[str]],
                  environ: dict[str, Any]) -> str:
    key = path.lstrip("/").partition("/")[2]
    if method == "GET":
        if key:
            return "GetObject"
        return "ListObjectsV2" if "list-type" in query else (
            "GetBucketLocation" if "location" in query else "ListObjects")
    if method == "HEAD":
        return "HeadObject" if key else "HeadBucket"
    if method == "PUT":
        if "partNumber" in query:
            return "UploadPart"
        if key:
            return "CopyObject" if "HTTP_X_AMZ_COPY_SOURCE" in environ else "PutObject"
        return "PutBucket" + (next(iter(query), "").capitalize())
    if method == "POST":
        if "delete" in query:
            return "DeleteObjects"
        if "uploads" in query:
            return "CreateMultipartUpload"
        if "uploadId" in query:
            return "CompleteMultipartUpload"
        return "PostObject"
    if method == "DELETE":
        if "uploadId" in query:
            return "AbortMultipartUpload"
        return "DeleteObject" if key else "DeleteBucket"
    return method


class LostResponses:
    """A fault: conditional S3 writes that commit, then lose their response.

    S3 may commit a ``PutObject`` and the client still see no answer (a connection
    reset, a timeout, a ``500``); botocore then sends it again, and the retry of a
    conditional write meets the object the first try wrote: ``412 PreconditionFailed``
    although the write went through. :meth:`arm` makes the next ``count`` conditional
    writes whose key (below the bucket) matches ``key`` (an ``fnmatch`` pattern) commit
    and answer ``500 InternalError``, which botocore retries.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: list[tuple[str, int]] = []
        #: the keys whose response was lost, in order
        self.lost: list[str] = []

    def arm(self, key: str = "*", count: int = 1) -> None:
        with self._lock:
            self._armed.append((key, count))

    def disarm(self) -> None:
        with self._lock:
            self._armed.clear()

    def take(self, key: str) -> bool:
        """Whether this write's response is to be lost (counts it)."""
        with self._lock:
            for i, (pattern, left) in enumerate(self._armed):
                if fnmatch.fnmatchcase(key, pattern):
                    if left <= 1:
                        del self._armed[i]
                    else:
                        self._armed[i] = (pattern, left - 1)
                    self.lost.append(key)
                    return True
        return False


class Outage:
    """A fault: S3 unavailable to one kind of client (an ``origin`` of
    :class:`RequestLog`: ``instance-agent``, ``job-agent``...) while switched on. Every
    S3 request of that origin is answered ``503 SlowDown``, which botocore retries a few
    times and then raises, as in a regional S3 event or an instance's lost route to it.
    ``met``: how many requests it answered so."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._origins: set[str] = set()
        self.met = 0

    def start(self, origin: str) -> None:
        with self._lock:
            self._origins.add(origin)

    def end(self) -> None:
        with self._lock:
            self._origins.clear()

    def hits(self, origin: str) -> bool:
        """Whether a request of ``origin`` fails now (counts it)."""
        with self._lock:
            if origin in self._origins:
                self.met += 1
                return True
        return False


_SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
              b"<Message>Please reduce your request rate.</Message></Error>")


_INTERNAL_ERROR = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
                   b"<Message>We encountered an internal error. Please try again.</Message>"
                   b"</Error>")


_S3_SIGNING = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")


class _S3Middleware:
    """S3 behaviour moto lacks: ``ExpectedBucketOwner``, a request signed for another
    region than its bucket's refused (``400 AuthorizationHeaderMalformed`` naming the
    bucket's region, as S3 answers it; botocore then sends it again to that region,
    and each such request is kept in ``wrong_region``: (bucket, signed for, the
    bucket's, origin)), atomic conditional writes, and the :class:`LostResponses` and
    :class:`Outage` faults."""

    def __init__(self, app: Callable[..., Any], lost: LostResponses, outage: Outage,
                 wrong_region: list[tuple[str, str, str, str]]) -> None:
        self.app = app
        self.conditional_lock = threading.Lock()
        self.lost = lost
        self.outage = outage
        self.wrong_region = wrong_region

    def _wrong_region(self, environ: dict[str, Any], call: Any,
                      start_response: Callable[..., Any]) -> list[bytes] | None:
        """S3's answer to a request signed for another region than its bucket's."""
        signed = _S3_SIGNING.search(environ.get("HTTP_AUTHORIZATION", ""))
        path = environ.get("PATH_INFO", "/").lstrip("/")
        bucket, _, key = path.partition("/")
        if signed is None or not bucket or (environ.get("REQUEST_METHOD") == "PUT"
                                            and not key and not environ.get("QUERY_STRING")):
            return None  # not signed for S3, or a CreateBucket (its own rules)
        region = _bucket_region(bucket)
        if region is None or region == signed.group(1):
            return None
        self.wrong_region.append((bucket, signed.group(1), region,
                                  call.origin if call is not None else "other"))
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>'
                f"AuthorizationHeaderMalformed</Code><Message>The authorization header is "
                f"malformed; the region '{signed.group(1)}' is wrong; expecting "
                f"'{region}'</Message><Region>{region}</Region></Error>").encode()
        start_response("400 Bad Request", [("Content-Type", "application/xml"),
                                           ("x-amz-bucket-region", region),
                                           ("Content-Length", str(len(body)))])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [body]

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        call = environ.get(CALL_KEY)
        if call is not None and call.service == "s3" and self.outage.hits(call.origin):
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(_SLOW_DOWN)))])
            return [] if environ.get("REQUEST_METHOD") == "HEAD" else [_SLOW_DOWN]
        refused = self._wrong_region(environ, call, start_response)
        if refused is not None:
            return refused
        expected = environ.get("HTTP_X_AMZ_EXPECTED_BUCKET_OWNER")
        if expected:
            bucket = environ.get("PATH_INFO", "/").lstrip("/").split("/", 1)[0]
            owner = _bucket_owner(bucket)
            if owner is not None and owner != expected:
                denied = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied'
                          b"</Code><Message>Access Denied</Message></Error>")
                start_response("403 Forbidden", [("Content-Type", "application/xml"),
                                                  ("Content-Length", str(len(denied)))])
                return [] if environ.get("REQUEST_METHOD") == "HEAD" else [denied]
        conditional = environ.get("REQUEST_METHOD") in ("PUT", "POST", "DELETE") and (
            "HTTP_IF_MATCH" in environ or "HTTP_IF_NONE_MATCH" in environ)
        if not conditional:
            return self.app(environ, start_response)
        with self.conditional_lock:
            answered: list[tuple[str, Any]] = []

            def hold(status: str, headers: Any, exc_info: Any = None) -> Callable[..., Any]:
                answered.append((status, headers))
                return lambda data: None

            body = list(self.app(environ, hold))
        status, headers = answered[0]
        key = environ.get("PATH_INFO", "/").lstrip("/").partition("/")[2]
        if status.startswith("2") and environ.get("REQUEST_METHOD") == "PUT" and \
                self.lost.take(key):
            log.info("fault: the conditional write of %s committed; its response is lost",
                     key)
            start_response("500 Internal Server Error", [
                ("Content-Type", "application/xml"),
                ("Content-Length", str(len(_INTERNAL_ERROR)))])
            return [_INTERNAL_ERROR]
        start_response(status, headers)
        return body


def _bucket_region(bucket: str) -> str | None:
    """The region of ``bucket`` (None: no such bucket)."""
    from moto.s3.models import s3_backends

    found = s3_backends.bucket_accounts.get(bucket)
    if found is None:
        return None
    partition, account = found
    try:
        return str(s3_backends[account][partition].buckets[bucket].region_name)
    except KeyError:
        return None


def _bucket_owner(bucket: str) -> str | None:
    from moto.s3.models import s3_backends

    found = s3_backends.bucket_accounts.get(bucket)
    return found[1] if found else None


class MotoServer:
    """moto in server mode on 127.0.0.1 (a free port), with :class:`_S3Middleware`."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._server = _moto_server_class()(ip_address=host, port=port, verbose=False)
        #: Every request the server answered (see :class:`RequestLog`).
        self.requests = RequestLog()
        self._server.requests = self.requests
        #: The lost-response fault of conditional S3 writes (:class:`LostResponses`).
        self.lost_responses = LostResponses()
        self._server.lost = self.lost_responses
        #: S3 requests signed for another region than their bucket's, which S3 refused
        #: (botocore sends each again to the bucket's region): (bucket, signed for,
        #: the bucket's region, origin).
        self.s3_wrong_region: list[tuple[str, str, str, str]] = []
        self._server.wrong_region = self.s3_wrong_region
        #: S3 unavailable to one kind of client (:class:`Outage`).
        self.s3_outage = Outage()
        self._server.outage = self.s3_outage
        #: IAM per principal (:mod:`spotnb.testing.iam`); off until switched on.
        self.iam = IamEnforcer(None, account=DEFAULT_ACCOUNT,
                               admin_key=FAKE_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                               call_key=CALL_KEY)
        self._server.iam = self.iam
        self.endpoint = ""

    def start(self) -> MotoServer:
        # werkzeug prints requests and errors to stderr unless its logger has a handler;
        # keep them in logging (moto answers 500 for services it lacks, e.g. Pricing).
        werkzeug_log = logging.getLogger("werkzeug")
        if not any(isinstance(h, logging.NullHandler) for h in werkzeug_log.handlers):
            werkzeug_log.addHandler(logging.NullHandler())
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def reset(self) -> None:
        """Forget every resource (moto's ``/moto-api/reset``)."""
        request = urllib.request.Request(self.endpoint + "/moto-api/reset", method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(request, timeout=RESET_TIMEOUT_SECONDS) as reply:
            reply.read()

    def stop(self) -> None:
        self._server.stop()


@contextlib.contextmanager
def aws_environment(endpoint: str, region: str = DEFAULT_REGION) -> Iterator[dict[str, str]]:
    """Point boto3 (here and in child processes) at ``endpoint`` with fake credentials.

    Every AWS variable is restored on exit; profiles and config files are hidden so a
    real account is never touched.
    """
    from spotnb.providers.aws import _boto

    saved = {name: os.environ.get(name) for name in _AWS_VARIABLES}
    env = {
        "AWS_ENDPOINT_URL": endpoint, **FAKE_CREDENTIALS, "AWS_DEFAULT_REGION": region,
        "AWS_REGION": region, "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        # moto has no Pricing API: a closed port makes spotnb fall back at once, as when
        # the Pricing API is unreachable.
        "AWS_ENDPOINT_URL_PRICING": CLOSED_ENDPOINT,
    }
    for name in _AWS_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(env)
    _boto._ACCOUNTS.clear()
    try:
        yield env
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        _boto._ACCOUNTS.clear()


