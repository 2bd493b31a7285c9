"""A local instance-metadata service (IMDSv2), one per local-cloud instance.

It speaks EC2's protocol, so the agent runs the same code here as on AWS:

* ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds: 1..21600``
  returns a session token (400 for a missing or out-of-range TTL; 403 if the request
  carries ``X-Forwarded-For``, as EC2 refuses proxied token requests).
* Every ``GET`` needs ``X-aws-ec2-metadata-token`` with a valid, unexpired token, else
  401 (IMDSv1 is disabled, as spotnb's launch templates require IMDSv2 on AWS).
* ``GET /latest/meta-data/`` lists keys (directories end in ``/``). Served:
  ``ami-id``, ``instance-id``, ``instance-type``, ``instance-life-cycle`` (``spot``),
  ``placement/availability-zone``, ``placement/availability-zone-id``,
  ``placement/region``, ``local-ipv4`` (127.0.0.1: a local cloud's instances share
  this machine's loopback); ``spot/instance-action`` (404 until an interruption notice,
  then ``{"action": "terminate", "time": "2026-11-22T02:10:00Z"}``, the time of
  termination) and the older ``spot/termination-time``;
  ``events/recommendations/rebalance`` (404 until set, then
  ``{"noticeTime": "..."}``); and ``/latest/dynamic/instance-identity/document``.
* Unknown paths are 404.

The server runs in a thread of the capacity-group supervisor on 127.0.0.1, on a free
port; the agent finds it through ``SPOTNB_IMDS_ENDPOINT``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import secrets
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["ImdsServer", "InstanceIdentity", "iso_utc"]

log = logging.getLogger(__name__)

TOKEN_PATH = "/latest/api/token"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TOKEN_TTL = 21600  # six hours, EC2's limit
META = "/latest/meta-data/"
IDENTITY_DOCUMENT = "/latest/dynamic/instance-identity/document"


def iso_utc(epoch: float) -> str:
    """``2026-11-22T02:10:00Z``: how EC2 writes times in instance metadata."""
    return datetime.datetime.fromtimestamp(epoch, datetime.timezone.utc).strftime(
        "%Y-%m-%dT%H:%M:%SZ")


@dataclasses.dataclass(frozen=True)
class InstanceIdentity:
    """What the metadata service says about its instance."""

    instance_id: str
    instance_type: str
    region: str
    az: str  # the AZ name, e.g. us-east-1d
    az_id: str  # the AZ id, e.g. use1-az4
    ami_id: str
    launched: float
    #: ``local-ipv4``: where the job's other nodes reach this one. Every local instance
    #: is this machine (loopback); the AWS simulator gives each instance its own
    #: loopback address (127.x.y.z from its private IP in moto).
    address: str = "127.0.0.1"


class ImdsServer:
    """One instance's metadata service. :meth:`start` it, then use :attr:`endpoint`."""

    def __init__(self, identity: InstanceIdentity, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.identity = identity
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> monotonic expiry
        self._instance_action: dict[str, str] | None = None
        self._rebalance: dict[str, str] | None = None
        self._lifecycle: str | None = None
        self.tokens_issued = 0
        self._httpd = _Server((host, port), _Handler)
        self._httpd.imds = self
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> ImdsServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name=f"imds-{self.identity.instance_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def set_instance_action(self, at: float, action: str = "terminate") -> None:
        """Announce a spot interruption: ``action`` at epoch time ``at``."""
        with self._lock:
            self._instance_action = {"action": action, "time": iso_utc(at)}

    def set_rebalance(self, notice_time: float) -> None:
        """Publish a rebalance recommendation issued at ``notice_time``."""
        with self._lock:
            self._rebalance = {"noticeTime": iso_utc(notice_time)}

    def set_target_lifecycle_state(self, state: str) -> None:
        """Auto Scaling's ``autoscaling/target-lifecycle-state`` (``Terminated``: the
        group ends the instance, through a termination lifecycle hook's wait)."""
        with self._lock:
            self._lifecycle = state

    def revoke_tokens(self) -> None:
        """Forget every token (as after an instance restart); clients must get a new one."""
        with self._lock:
            self._tokens.clear()

    # -- used by the handler

    def issue_token(self, ttl: int) -> str:
        token = secrets.token_urlsafe(42)
        with self._lock:
            now = time.monotonic()
            self._tokens = {t: exp for t, exp in self._tokens.items() if exp > now}
            self._tokens[token] = now + ttl
            self.tokens_issued += 1
        return token

    def token_ttl_left(self, token: str | None) -> int | None:
        """Seconds left on ``token``, or None if it is unknown or expired."""
        if not token:
            return None
        with self._lock:
            expiry = self._tokens.get(token)
        left = None if expiry is None else expiry - time.monotonic()
        return int(left) if left is not None and left > 0 else None

    def leaves(self) -> dict[str, str]:
        """Every metadata path (below ``/latest/meta-data/``) and its value."""
        ident = self.identity
        leaves = {
            "ami-id": ident.ami_id,
            "instance-id": ident.instance_id,
            "instance-type": ident.instance_type,
            "instance-life-cycle": "spot",
            "placement/availability-zone": ident.az,
            "placement/availability-zone-id": ident.az_id,
            "placement/region": ident.region,
            "local-ipv4": ident.address,
        }
        with self._lock:
            if self._instance_action is not None:
                leaves["spot/instance-action"] = json.dumps(self._instance_action)
                leaves["spot/termination-time"] = self._instance_action["time"]
            if self._rebalance is not None:
                leaves["events/recommendations/rebalance"] = json.dumps(self._rebalance)
            if self._lifecycle is not None:
                leaves["autoscaling/target-lifecycle-state"] = self._lifecycle
        return leaves

    def identity_document(self) -> str:
        ident = self.identity
        return json.dumps({
            "instanceId": ident.instance_id,
            "instanceType": ident.instance_type,
            "imageId": ident.ami_id,
            "region": ident.region,
            "availabilityZone": ident.az,
            "architecture": "x86_64",
            "pendingTime": iso_utc(ident.launched),
        }, indent=2)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    imds: ImdsServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up waiting (its short timeout, on a busy machine) closed
        # the connection before the answer: nothing to report.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "EC2ws"
    sys_version = ""

    def log_message(self, format: str, *args: object) -> None:
        log.debug("imds %s: " + format, self.server.imds.identity.instance_id, *args)

    def _reply(self, code: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_PUT(self) -> None:
        imds = self.server.imds
        if self.path != TOKEN_PATH:
            self._reply(405, "Method Not Allowed")
            return
        if self.headers.get("X-Forwarded-For"):
            self._reply(403, "Forbidden")
            return
        raw = self.headers.get(TTL_HEADER, "")
        try:
            ttl = int(raw)
        except ValueError:
            ttl = 0
        if not 1 <= ttl <= MAX_TOKEN_TTL:
            self._reply(400, "Bad Request")
            return
        self._reply(200, imds.issue_token(ttl), {TTL_HEADER: str(ttl)})

    def do_GET(self) -> None:
        imds = self.server.imds
        if self.path == TOKEN_PATH:
            self._reply(405, "Method Not Allowed")
            return
        left = imds.token_ttl_left(self.headers.get(TOKEN_HEADER))
        if left is None:
            self._reply(401, "Unauthorized")
            return
        headers = {TTL_HEADER: str(left)}
        body = self._lookup(self.path.split("?", 1)[0])
        if body is None:
            self._reply(404, "Not Found")
        else:
            self._reply(200, body, headers)

    do_HEAD = do_GET

    def _lookup(self, path: str) -> str | None:
        imds = self.server.imds
        if path == IDENTITY_DOCUMENT:
            return imds.identity_document()
        if path in ("/latest", "/latest/"):
            return "dynamic\nmeta-data"
        if path in ("/latest/meta-data", META):
            return _listing(imds.leaves(), "")
        if not path.startswith(META):
            return None
        key = path[len(META):]
        leaves = imds.leaves()
        if key in leaves:
            return leaves[key]
        return _listing(leaves, key.rstrip("/") + "/")


def _listing(leaves: dict[str, str], prefix: str) -> str | None:
    """The names directly below ``prefix`` (directories with a trailing ``/``)."""
    names = set()
    for key in leaves:
        if key.startswith(prefix):
            head, sep, _ = key[len(prefix):].partition("/")
            names.add(head + sep)
    return "\n".join(sorted(names)) if names else None
