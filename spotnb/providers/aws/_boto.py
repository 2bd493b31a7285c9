"""The one module that talks to boto3: import, sessions, clients, and what errors mean.

Everything else in spotnb asks this module for AWS clients and for the meaning of an
error; nothing else imports ``boto3`` or ``botocore``. The contract:

* boto3 is imported lazily, on the first AWS call, so ``import spotnb`` works without
  it; without it, or with a botocore older than :data:`MIN_BOTOCORE` (an image's system
  boto3, say), :func:`boto3_module` raises :class:`~spotnb.protocol.spec.SpecError`
  naming ``pip install -U 'spotnb[aws]'``.
* Credentials come from the standard chain (environment, ``AWS_PROFILE`` and shared
  config, SSO, instance profile). ``AWS_ENDPOINT_URL`` (and the per-service
  ``AWS_ENDPOINT_URL_<SERVICE>``) are honoured by botocore itself: that is how tests
  and :mod:`spotnb.testing` point everything at moto.
* Clients retry in botocore's *adaptive* mode (exponential backoff with jitter, and a
  client-side token bucket that slows down on throttling). Best-effort lookups (prices,
  placement scores) use ``attempts=1`` and fall back to bundled data instead.
* Errors are sorted by :func:`classify` into

  ``transient``  throttling, 5xx, timeouts: already retried by botocore; callers may
                 retry again with :func:`with_backoff` or report and carry on;
  ``capacity``   no spot capacity in that pool (``InsufficientInstanceCapacity``, ...):
                 try the next pool, and tell the user the job waits for capacity;
  ``fatal``      no or bad credentials, a missing permission, an account that is not
                 opted in: retrying cannot help. :func:`fatal_error` turns them into a
                 :class:`~spotnb.protocol.spec.SpecError` whose message names the fix;
  ``other``      everything else (``NoSuchKey``, ``AlreadyExists``, validation errors):
                 the caller knows what they mean in its context.

Sessions and clients: one ``boto3.Session`` per profile and AWS environment is kept
for the process (a new one reloads botocore's data files, about a second). A session
is not thread-safe, so clients are made from it under :data:`_SESSION_LOCK`; a client
is thread-safe, and each long-lived object (a store, a provider) makes its clients once
and keeps them. Clients are not cached here: their retry settings differ by use, and
credentials that refresh (SSO, instance profile) are refreshed by each client.

Test hooks: :func:`add_hook` registers a botocore event handler on every client this
module makes, including clients made earlier (each client forwards ``before-parameter-
build``, ``before-call`` and ``after-call`` events to the hooks registered at the time
of the call). :mod:`spotnb.testing` injects capacity errors and emulates FIS with it.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal, TypeVar

from spotnb._version import __version__
from spotnb.protocol import usage
from spotnb.protocol.backoff import Backoff
from spotnb.protocol.spec import SpecError
from spotnb.providers import ProviderError

__all__ = [
    "CAPACITY_CODES",
    "FATAL_CODES",
    "INSTALL_HINT",
    "TRANSIENT_CODES",
    "AwsError",
    "CapacityError",
    "Kind",
    "TransientError",
    "account_id",
    "add_hook",
    "boto3_module",
    "capacity_code_in",
    "check_region",
    "classify",
    "client",
    "error_code",
    "fatal_error",
    "session",
    "with_backoff",
]

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'spotnb[aws]'"
#: The oldest botocore spotnb works with (``pyproject.toml``: ``boto3>=1.35.69``, which
#: requires it): the first whose S3 model has both ``IfNoneMatch`` (1.35.2) and
#: ``IfMatch`` (1.35.69) on ``PutObject``. An older one refuses them before sending, so
#: every lease, result, event chunk and ``LATEST`` pointer would fail. The models of this
#: version are vendored for the tests (``tests/aws_reference/``).
MIN_BOTOCORE = (1, 35, 69)

Kind = Literal["transient", "capacity", "fatal", "other"]

#: Codes that mean "try again later": the service is busy or briefly inconsistent.
TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestThrottledException", "TooManyRequestsException", "RequestLimitExceeded",
    "SlowDown", "PriorRequestNotComplete", "BandwidthLimitExceeded", "EC2ThrottledException",
    "InternalError", "InternalFailure", "InternalServerError", "ServiceUnavailable",
    "ServiceUnavailableException", "Unavailable", "RequestTimeout", "RequestTimeoutException",
    "RequestTimeTooSkewed", "IDPCommunicationError", "OperationAborted",
    "ResourceContention", "ConcurrentModification", "ConcurrentModificationException",
    "ScalingActivityInProgress", "500", "502", "503", "504",
})

#: Codes that mean "this pool has no spot capacity for you now": move to the next one.
CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity",
    "InsufficientReservedInstanceCapacity", "InsufficientAddressCapacity",
    "UnfulfillableCapacity", "MaxSpotInstanceCountExceeded", "SpotMaxPriceTooLow",
    "InstanceLimitExceeded", "VcpuLimitExceeded", "capacity-not-available",
    "capacity-oversubscribed", "price-too-low", "Unsupported",
})

#: Codes that no retry can fix, with the next step for the user.
FATAL_CODES: dict[str, str] = {
    "UnauthorizedOperation": "grant the missing permission (see `spotnb aws setup --dry-run` "
                             "for the policy spotnb needs), then try again",
    "AccessDenied": "grant the missing permission (see `spotnb aws setup --dry-run` for the "
                    "policy spotnb needs), then try again",
    "AccessDeniedException": "grant the missing permission (see `spotnb aws setup --dry-run` "
                             "for the policy spotnb needs), then try again",
    "AuthFailure": "AWS rejected the credentials: check them with "
                   "`aws sts get-caller-identity`",
    "InvalidClientTokenId": "AWS rejected the access key: check AWS_ACCESS_KEY_ID or the "
                            "profile in AWS_PROFILE with `aws sts get-caller-identity`",
    "InvalidAccessKeyId": "AWS rejected the access key: check AWS_ACCESS_KEY_ID or the "
                          "profile in AWS_PROFILE with `aws sts get-caller-identity`",
    "SignatureDoesNotMatch": "the secret key does not match the access key: check "
                             "AWS_SECRET_ACCESS_KEY or the profile's credentials",
    "UnrecognizedClientException": "AWS rejected the credentials: check them with "
                                   "`aws sts get-caller-identity`",
    "ExpiredToken": "the AWS session expired: log in again (`aws sso login`) or refresh "
                    "the credentials, then try again",
    "ExpiredTokenException": "the AWS session expired: log in again (`aws sso login`) or "
                             "refresh the credentials, then try again",
    "RequestExpired": "the request expired: check this machine's clock, then try again",
    "OptInRequired": "the account is not subscribed to this service in this region: opt "
                     "in (AWS console, Regions) or choose another region",
    "PendingVerification": "the AWS account is still being verified: wait for AWS's "
                           "e-mail, then try again",
    "Blocked": "the AWS account is blocked: contact AWS Support",
    "AllAccessDisabled": "all access to this bucket is disabled: choose another bucket",
}

# Exceptions botocore raises before any request is sent.
_NO_CREDENTIALS = (
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
    "ProfileNotFound", "SSOTokenLoadError", "UnauthorizedSSOTokenError",
    "TokenRetrievalError", "InvalidConfigError", "NoAuthTokenError",
)
_TRANSIENT_EXCEPTIONS = (
    "EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
    "ConnectionClosedError", "ProxyConnectionError", "ResponseStreamingError",
    "IncompleteReadError",
)

_NO_CREDENTIALS_FIX = (
    "no AWS credentials found: configure them with `aws configure`, or `aws sso login "
    "--profile NAME` and AWS_PROFILE=NAME, or the AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY environment variables; then check with `spotnb aws doctor`"
)

# Retries botocore makes itself (adaptive mode) before a call raises.
DEFAULT_ATTEMPTS = 8
CONNECT_TIMEOUT_SECONDS = 5.0
READ_TIMEOUT_SECONDS = 60.0
# Enough HTTP connections for a multipart transfer's threads plus the event log.
MAX_POOL_CONNECTIONS = 32


class AwsError(ProviderError):
    """An AWS call failed after retries. ``code`` is AWS's error code, ``kind`` its class."""

    def __init__(self, message: str, code: str = "", kind: Kind = "other") -> None:
        super().__init__(message)
        self.code = code
        self.kind = kind


class CapacityError(AwsError):
    """The pool has no spot capacity now (try the next pool)."""


class TransientError(AwsError):
    """AWS was busy or unreachable, even after retries."""


# ------------------------------------------------------------------- import, sessions

_boto3: ModuleType | None = None
_SESSION_LOCK = threading.RLock()
# A session is reused while these are unchanged (tests switch them between accounts).
_SESSION_VARIABLES = ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID",
                      "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")
_ACCOUNTS: dict[tuple[str | None, str | None], str] = {}
_REGIONS: frozenset[str] | None = None


def boto3_module() -> ModuleType:
    """``boto3``, imported on first use; a SpecError with the install hint without it."""
    global _boto3
    if _boto3 is None:
        try:
            import boto3
            import botocore
        except ImportError:
            raise SpecError(
                f"the AWS provider needs boto3, which is not installed: {INSTALL_HINT}"
            ) from None
        found = _version_tuple(botocore.__version__)
        if found < MIN_BOTOCORE:
            floor = ".".join(map(str, MIN_BOTOCORE))
            raise SpecError(
                f"the AWS provider needs botocore {floor} or newer (S3's conditional "
                f"writes, IfNoneMatch and IfMatch), but {botocore.__version__} is "
                f"installed: pip install -U 'spotnb[aws]'")
        _boto3 = boto3
    return _boto3


_SESSIONS: dict[tuple[str | None, ...], Any] = {}


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"1.35.69"`` -> ``(1, 35, 69)``; a pre-release suffix is ignored."""
    return tuple(int("".join(c for c in piece if c.isdigit()) or 0)
                 for piece in version.split(".")[:3])


def session(region: str | None = None, profile: str | None = None) -> Any:
    """The process's ``boto3.Session`` for ``profile`` (default ``AWS_PROFILE``) and the
    current AWS environment variables; made once, because a new session reloads
    botocore's endpoint and service data (about a second)."""
    import os

    boto3 = boto3_module()
    key = (profile, region, *(os.environ.get(name) for name in _SESSION_VARIABLES))
    with _SESSION_LOCK:
        if key not in _SESSIONS:
            try:
                _SESSIONS[key] = boto3.session.Session(region_name=region,
                                                       profile_name=profile)
            except Exception as err:
                raise fatal_error(err, "opening an AWS session") from None
        return _SESSIONS[key]


def client(service: str, region: str | None = None, *, sess: Any = None,
           attempts: int = DEFAULT_ATTEMPTS, read_timeout: float = READ_TIMEOUT_SECONDS,
           pool: int = MAX_POOL_CONNECTIONS, origin: str | None = None) -> Any:
    """A botocore client with adaptive retries and spotnb's test hooks.

    ``attempts=1`` makes a best-effort client that fails fast (callers fall back).
    ``origin`` (default ``$SPOTNB_ORIGIN``, else ``notebook``) names the part of spotnb
    that makes the requests, in their User-Agent: the request benchmark sorts them by
    it. Every request is counted in :mod:`spotnb.protocol.usage`, but a test harness's own
    (origin ``simulator``).
    """
    origin = origin or os.environ.get(ENV_ORIGIN) or "notebook"
    from botocore.config import Config

    retries: dict[str, Any] = ({"mode": "adaptive", "max_attempts": attempts}
                               if attempts > 1 else {"mode": "standard", "max_attempts": 1})
    config = Config(
        retries=retries,
        connect_timeout=CONNECT_TIMEOUT_SECONDS,
        read_timeout=read_timeout,
        max_pool_connections=pool,
        user_agent_extra=f"spotnb/{__version__} spotnb-origin/{origin}",
    )
    with _SESSION_LOCK:
        sess = sess if sess is not None else session(region)
        try:
            made = sess.client(service, region_name=region, config=config)
        except Exception as err:
            raise fatal_error(err, f"creating an AWS {service} client") from None
    for event in ("before-parameter-build", "before-call", "after-call"):
        made.meta.events.register(event, _dispatch)
    # Every request is a line item (spotnb.protocol.usage): count each one this process makes.
    if origin != "simulator":
        made.meta.events.register("before-call", _count_request)
    return made


#: Names the part of spotnb a process is (job-agent, instance-agent, runtime, cli...).
ENV_ORIGIN = "SPOTNB_ORIGIN"


def _count_request(model: Any = None, **kwargs: Any) -> None:
    if model is not None:
        usage.count(model.service_model.endpoint_prefix, model.name)


def account_id(sess: Any = None, region: str | None = None) -> str:
    """The caller's AWS account id (``sts:GetCallerIdentity``, needs no permission).

    Cached per profile and endpoint for the life of the process. Raises SpecError
    (naming the fix) when there are no usable credentials.
    """
    import os

    key = (os.environ.get("AWS_PROFILE"), os.environ.get("AWS_ENDPOINT_URL"))
    if sess is None and key in _ACCOUNTS:
        return _ACCOUNTS[key]
    sts = client("sts", region, sess=sess, attempts=3)
    try:
        found = str(sts.get_caller_identity()["Account"])
    except Exception as err:
        kind = classify(err)
        if kind == "fatal":
            raise fatal_error(err, "checking the AWS credentials") from None
        raise AwsError(f"cannot reach AWS STS to check the credentials: {err}",
                       error_code(err), kind) from None
    if sess is None:
        _ACCOUNTS[key] = found
    return found


def check_region(region: str) -> str:
    """``region`` if AWS has it (from botocore's offline endpoint data); else SpecError."""
    import difflib

    global _REGIONS
    if _REGIONS is None:
        sess = session()
        found: set[str] = set()
        for partition in ("aws", "aws-us-gov", "aws-cn"):
            found |= set(sess.get_available_regions("ec2", partition))
        _REGIONS = frozenset(found)
    known = _REGIONS
    if region in known:
        return region
    close = difflib.get_close_matches(region, sorted(known), n=3)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise SpecError(f"unknown AWS region {region!r}: {hint}pass region='us-east-1' (or "
                    "another region from `aws ec2 describe-regions`)")


# ------------------------------------------------------------------------ errors

def error_code(err: BaseException) -> str:
    """AWS's error code of a ``ClientError`` (``""`` for other exceptions)."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        code = response.get("Error", {}).get("Code")
        if code:
            return str(code)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status:
            return str(status)
    return ""


def _status(err: BaseException) -> int:
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def classify(err: BaseException) -> Kind:
    """Sort an exception from an AWS call; see the module docstring."""
    name = type(err).__name__
    if name in _NO_CREDENTIALS:
        return "fatal"
    if name in _TRANSIENT_EXCEPTIONS:
        return "transient"
    if isinstance(err, AwsError):
        return err.kind
    code = error_code(err)
    if not code:
        return "other"
    if code in CAPACITY_CODES:
        return "capacity"
    if code in FATAL_CODES:
        return "fatal"
    if code in TRANSIENT_CODES or _status(err) >= 500:
        return "transient"
    return "other"


def capacity_code_in(text: str) -> str | None:
    """The capacity error code mentioned in a message (an Auto Scaling activity's
    ``StatusMessage``), or None."""
    for code in sorted(CAPACITY_CODES, key=len, reverse=True):
        if code in text:
            return code
    if "no Spot capacity" in text or "not have sufficient" in text:
        return "InsufficientInstanceCapacity"
    return None


def fatal_error(err: BaseException, what: str) -> SpecError:
    """A :class:`SpecError` for a fatal error, saying what failed and the fix."""
    name = type(err).__name__
    if name in _NO_CREDENTIALS:
        detail = str(err)
        if name == "ProfileNotFound":
            return SpecError(f"{what}: {detail}. Fix AWS_PROFILE (list profiles with `aws "
                             "configure list-profiles`).")
        return SpecError(f"{what}: {_NO_CREDENTIALS_FIX} ({detail})")
    if name == "NoRegionError":
        return SpecError(f"{what}: no AWS region is set: pass region='us-east-1' or set "
                         "AWS_DEFAULT_REGION.")
    code = error_code(err)
    message = (getattr(err, "response", None) or {}).get("Error", {}).get("Message") or str(err)
    fix = FATAL_CODES.get(code, "check the AWS account and settings with `spotnb aws doctor`")
    return SpecError(f"{what}: AWS said {code or name}: {message}. Next step: {fix}.")


def raise_for(err: BaseException, what: str) -> None:
    """Re-raise ``err`` as spotnb's typed error for its class (never returns)."""
    kind = classify(err)
    if kind == "fatal":
        raise fatal_error(err, what) from None
    code = error_code(err)
    if kind == "capacity":
        raise CapacityError(f"{what}: no spot capacity ({code}): {err}", code, kind) from None
    if kind == "transient":
        raise TransientError(f"{what}: AWS is busy or unreachable ({code or type(err).__name__})"
                             f" even after retries; try again in a minute: {err}",
                             code, kind) from None
    raise AwsError(f"{what}: {err}", code, kind) from None


T = TypeVar("T")


def with_backoff(fn: Callable[[], T], *, what: str, attempts: int = 6, base: float = 0.5,
                 cap: float = 8.0, retry_codes: frozenset[str] = frozenset(),
                 retry_if: Callable[[BaseException], bool] | None = None) -> T:
    """Call ``fn``; retry transient errors (and ``retry_codes``, and errors ``retry_if``
    says are worth another try) with jittered backoff.

    For the few cases botocore's own retries do not cover: IAM's eventual consistency
    (a new instance profile is "invalid" for some seconds) and an Auto Scaling group
    still busy with a scaling activity. Anything else is raised at once through
    :func:`raise_for`.
    """
    delays = Backoff(min(base, cap), cap, jitter=0.5)
    for attempt in range(attempts):
        try:
            return fn()
        except Exception as err:
            retryable = classify(err) == "transient" or error_code(err) in retry_codes or (
                any(code in str(err) for code in retry_codes)) or (
                retry_if is not None and retry_if(err))
            if not retryable or attempt == attempts - 1:
                raise_for(err, what)
            delay = delays.next()
            log.info("%s: %s; retrying in %.1fs", what, error_code(err) or err, delay)
            time.sleep(delay)
    raise TypeError("with_backoff ran out of attempts; this is a spotnb bug; please report it")


# -------------------------------------------------------------------------- hooks

_HOOKS: list[tuple[str, Callable[..., Any]]] = []
_HOOKS_LOCK = threading.Lock()


def add_hook(event: str, handler: Callable[..., Any]) -> Callable[[], None]:
    """Run ``handler`` for botocore events matching ``event`` (``fnmatch`` pattern, e.g.
    ``before-call.fis.StartExperiment``) on every client of this module; returns a
    function that removes the hook. For tests and :mod:`spotnb.testing`."""
    entry = (event, handler)
    with _HOOKS_LOCK:
        _HOOKS.append(entry)

    def remove() -> None:
        with _HOOKS_LOCK:
            if entry in _HOOKS:
                _HOOKS.remove(entry)

    return remove


def _dispatch(event_name: str = "", **kwargs: Any) -> Any:
    with _HOOKS_LOCK:
        hooks = [h for pattern, h in _HOOKS if fnmatch.fnmatchcase(event_name, pattern)]
    for handler in hooks:
        response = handler(event_name=event_name, **kwargs)
        if response is not None:
            return response
    return None


# ------------------------------------------------------------------------ transfers

#: Multipart settings for checkpoints: parts of 16 MiB (boto3's default is 8) halve the
#: requests of a multi-GB checkpoint (a 20 GB one is ~1,200 parts of S3's 10,000) at the
#: same ten threads; files under 16 MiB go in one PUT (a multipart upload costs three
#: extra requests). See benchmarks/bench_s3_upload.py for the comparison with boto3's
#: defaults.
TRANSFER_THRESHOLD = 16 * 2**20
TRANSFER_CHUNK = 16 * 2**20
TRANSFER_THREADS = 10


def transfer_config(threshold: int = TRANSFER_THRESHOLD, chunk: int = TRANSFER_CHUNK
                    ) -> Any:
    """A ``boto3.s3.transfer.TransferConfig`` tuned for checkpoints (see the constants)."""
    boto3_module()
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=threshold, multipart_chunksize=chunk,
                          max_concurrency=TRANSFER_THREADS, use_threads=True)


def unwrap_transfer_error(err: BaseException) -> BaseException:
    """The ``ClientError`` behind boto3's ``S3UploadFailedError``/``RetriesExceededError``."""
    if type(err).__name__ in ("S3UploadFailedError", "RetriesExceededError"):
        inner = getattr(err, "last_exception", None) or err.__context__
        if inner is not None:
            return inner
    return err


def error_message(err: BaseException) -> str:
    """AWS's message of a ``ClientError`` (``str(err)`` for other exceptions)."""
    response = getattr(err, "response", None)
    if isinstance(response, dict):
        message = response.get("Error", {}).get("Message")
        if message:
            return str(message)
    return str(err)
