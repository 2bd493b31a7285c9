"""An IMDSv2 client for the agent: who am I, and is my spot instance being reclaimed?

Standard library only (the agent must start on a bare Deep Learning AMI). The same code
talks to EC2's instance-metadata service and to the local cloud's, which speaks the
same protocol.

Endpoint: ``SPOTNB_IMDS_ENDPOINT`` (set by the local cloud), else
``AWS_EC2_METADATA_SERVICE_ENDPOINT`` (the AWS SDKs' variable), else
``http://169.254.169.254``. Proxies are never used: the endpoint is link-local.

Protocol: a session token from ``PUT /latest/api/token`` is sent with every ``GET``.
The client renews the token shortly before its TTL runs out, and on a 401 fetches a
new token and retries once. Timeouts are short: a caller polling for the interruption
notice every few seconds must not hang.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any

__all__ = ["DEFAULT_ENDPOINT", "TERMINATION_HOOK_SECONDS", "ImdsClient", "ImdsError",
           "termination_hook_seconds"]

DEFAULT_ENDPOINT = "http://169.254.169.254"
ENV_ENDPOINT = "SPOTNB_IMDS_ENDPOINT"
ENV_AWS_ENDPOINT = "AWS_EC2_METADATA_SERVICE_ENDPOINT"
TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_TOKEN_TTL = 21600  # EC2's maximum, six hours
DEFAULT_TIMEOUT = 1.0
#: How long a capacity-rebalancing group's termination lifecycle hook waits before Auto
#: Scaling ends an instance whose standby is in service: the agent's notice period
#: when ``autoscaling/target-lifecycle-state`` says ``Terminated`` (EC2's own notice
#: period, for the final save). ``SPOTNB_TERMINATION_HOOK_SECONDS`` overrides it: the
#: local cloud's compressed time.
TERMINATION_HOOK_SECONDS = 120.0
ENV_HOOK_SECONDS = "SPOTNB_TERMINATION_HOOK_SECONDS"


def termination_hook_seconds() -> float:
    """The termination hook's wait here (:data:`TERMINATION_HOOK_SECONDS`)."""
    try:
        return float(os.environ.get(ENV_HOOK_SECONDS, TERMINATION_HOOK_SECONDS))
    except ValueError:
        return TERMINATION_HOOK_SECONDS


class ImdsError(OSError):
    """The metadata service could not be reached or answered unexpectedly."""


class ImdsClient:
    """Reads instance metadata with IMDSv2 session tokens. Safe to share between threads."""

    def __init__(self, endpoint: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
                 token_ttl: int = DEFAULT_TOKEN_TTL) -> None:
        self.endpoint = (endpoint or os.environ.get(ENV_ENDPOINT)
                         or os.environ.get(ENV_AWS_ENDPOINT) or DEFAULT_ENDPOINT).rstrip("/")
        self.timeout = timeout
        self.token_ttl = token_ttl
        self._token: str | None = None
        self._token_expiry = 0.0  # monotonic
        self._lock = threading.Lock()
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __repr__(self) -> str:
        return f"ImdsClient({self.endpoint!r})"

    def get(self, path: str) -> str | None:
        """The value at ``path`` (below ``/latest/meta-data/`` unless it starts with
        ``/``), or None if the service has no such item (404)."""
        url = self.endpoint + (path if path.startswith("/") else "/latest/meta-data/" + path)
        for attempt in range(2):
            token = self._current_token(force_new=attempt > 0)
            try:
                return self._request("GET", url, {TOKEN_HEADER: token})
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code != 401 or attempt:
                    raise ImdsError(f"IMDS GET {url} failed: HTTP {e.code}") from None
            # 401: the token was revoked or expired early; fetch a new one and retry once.
        raise TypeError("unreachable: this is a spotnb bug")

    def get_json(self, path: str) -> dict[str, Any] | None:
        """Like :meth:`get`, parsed as a JSON object."""
        text = self.get(path)
        if text is None:
            return None
        try:
            value = json.loads(text)
        except ValueError:
            raise ImdsError(f"IMDS {path} is not JSON: {text[:200]!r}") from None
        if not isinstance(value, dict):
            raise ImdsError(f"IMDS {path} is not a JSON object: {text[:200]!r}")
        return value

    def instance_action(self) -> dict[str, Any] | None:
        """The spot interruption notice ``{"action": ..., "time": ...}``, or None."""
        return self.get_json("spot/instance-action")

    def rebalance(self) -> dict[str, Any] | None:
        """The rebalance recommendation ``{"noticeTime": ...}``, or None."""
        return self.get_json("events/recommendations/rebalance")

    def target_lifecycle_state(self) -> str | None:
        """Auto Scaling's target lifecycle state (``InService``, ``Terminated``...),
        or None outside a group."""
        text = self.get("autoscaling/target-lifecycle-state")
        return None if text is None else text.strip()

    def identity(self) -> dict[str, str]:
        """``instance_id``, ``instance_type``, ``az`` (name), ``az_id`` and ``region``;
        also ``address`` (the private IPv4 address the job's other nodes reach this
        one at) where the service has ``local-ipv4``."""
        keys = {
            "instance_id": "instance-id",
            "instance_type": "instance-type",
            "az": "placement/availability-zone",
            "az_id": "placement/availability-zone-id",
            "region": "placement/region",
        }
        out = {}
        for name, path in keys.items():
            value = self.get(path)
            if value is None:
                raise ImdsError(f"IMDS at {self.endpoint} has no {path}")
            out[name] = value
        address = self.get("local-ipv4")
        if address:
            out["address"] = address
        return out

    # -- tokens

    def _current_token(self, force_new: bool = False) -> str:
        with self._lock:
            # Renew a little before expiry so a request never carries a dying token.
            margin = min(60.0, self.token_ttl / 4)
            if force_new or self._token is None or time.monotonic() >= self._token_expiry - margin:
                issued = time.monotonic()
                url = self.endpoint + "/latest/api/token"
                try:
                    self._token = self._request("PUT", url, {TTL_HEADER: str(self.token_ttl)})
                except urllib.error.HTTPError as e:
                    raise ImdsError(f"IMDS token request failed: HTTP {e.code}") from None
                self._token_expiry = issued + self.token_ttl
            return self._token

    def _request(self, method: str, url: str, headers: dict[str, str]) -> str:
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout) as response:
                return response.read().decode()
        except urllib.error.HTTPError as e:
            e.close()
            raise
        except (urllib.error.URLError, OSError) as e:
            raise ImdsError(f"cannot reach the instance metadata service at "
                            f"{self.endpoint}: {e}") from None
