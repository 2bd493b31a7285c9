"""The local cloud's IMDSv2 server and the agent's client, over real HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from spotnb.providers.imds import DEFAULT_ENDPOINT, ImdsClient, ImdsError
from spotnb.providers.local.imds import ImdsServer, InstanceIdentity, iso_utc

IDENTITY = InstanceIdentity(
    instance_id="i-0123456789abcdef0", instance_type="g5.xlarge", region="us-east-1",
    az="us-east-1d", az_id="use1-az4", ami_id="ami-0abcdef0123456789", launched=time.time(),
)
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture
def server() -> Iterator[ImdsServer]:
    srv = ImdsServer(IDENTITY).start()
    yield srv
    srv.stop()


def call(server: ImdsServer, method: str, path: str,
         headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(server.endpoint + path, method=method,
                                     headers=headers or {})
    try:
        with _NO_PROXY.open(request, timeout=5) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode(), dict(e.headers)


def token(server: ImdsServer, ttl: int = 60) -> str:
    code, body, headers = call(server, "PUT", "/latest/api/token",
                               {"X-aws-ec2-metadata-token-ttl-seconds": str(ttl)})
    assert code == 200
    assert headers["X-aws-ec2-metadata-token-ttl-seconds"] == str(ttl)
    return body


def get(server: ImdsServer, path: str, tok: str) -> tuple[int, str]:
    code, body, _ = call(server, "GET", path, {"X-aws-ec2-metadata-token": tok})
    return code, body


def test_token_needs_a_ttl_between_1_and_21600(server: ImdsServer) -> None:
    for headers in ({}, {"X-aws-ec2-metadata-token-ttl-seconds": "0"},
                    {"X-aws-ec2-metadata-token-ttl-seconds": "21601"},
                    {"X-aws-ec2-metadata-token-ttl-seconds": "soon"}):
        assert call(server, "PUT", "/latest/api/token", headers)[0] == 400
    ok = {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
    assert call(server, "PUT", "/latest/api/token", ok)[0] == 200
    # Like EC2, a token request that went through a proxy is refused.
    proxied = {**ok, "X-Forwarded-For": "10.0.0.1"}
    assert call(server, "PUT", "/latest/api/token", proxied)[0] == 403


def test_get_without_a_valid_token_is_401(server: ImdsServer) -> None:
    assert call(server, "GET", "/latest/meta-data/instance-id")[0] == 401
    assert get(server, "/latest/meta-data/instance-id", "not-a-token")[0] == 401
    assert get(server, "/latest/meta-data/instance-id", token(server)) == (
        200, "i-0123456789abcdef0")


def test_token_expires_after_its_ttl(server: ImdsServer) -> None:
    tok = token(server, ttl=1)
    assert get(server, "/latest/meta-data/instance-type", tok) == (200, "g5.xlarge")
    time.sleep(1.1)
    assert get(server, "/latest/meta-data/instance-type", tok)[0] == 401


def test_metadata_keys_and_listings(server: ImdsServer) -> None:
    tok = token(server)
    code, listing = get(server, "/latest/meta-data/", tok)
    assert code == 200
    assert set(listing.splitlines()) == {
        "ami-id", "instance-id", "instance-life-cycle", "instance-type", "local-ipv4",
        "placement/"}
    assert get(server, "/latest/meta-data/placement/", tok)[1].splitlines() == [
        "availability-zone", "availability-zone-id", "region"]
    assert get(server, "/latest/meta-data/placement/availability-zone", tok)[1] == "us-east-1d"
    assert get(server, "/latest/meta-data/placement/availability-zone-id", tok)[1] == "use1-az4"
    assert get(server, "/latest/meta-data/placement/region", tok)[1] == "us-east-1"
    assert get(server, "/latest/meta-data/instance-life-cycle", tok)[1] == "spot"
    assert get(server, "/latest/meta-data/local-ipv4", tok)[1] == "127.0.0.1"
    assert get(server, "/latest/meta-data/ami-id", tok)[1] == "ami-0abcdef0123456789"
    assert get(server, "/latest/meta-data/no-such-thing", tok)[0] == 404
    document = json.loads(get(server, "/latest/dynamic/instance-identity/document", tok)[1])
    assert document["instanceId"] == "i-0123456789abcdef0"
    assert document["availabilityZone"] == "us-east-1d"


def test_instance_action_is_404_until_a_notice(server: ImdsServer) -> None:
    tok = token(server)
    assert get(server, "/latest/meta-data/spot/instance-action", tok)[0] == 404
    assert get(server, "/latest/meta-data/events/recommendations/rebalance", tok)[0] == 404
    at = time.time() + 120
    server.set_rebalance(time.time())
    server.set_instance_action(at)
    code, body = get(server, "/latest/meta-data/spot/instance-action", tok)
    assert code == 200
    assert json.loads(body) == {"action": "terminate", "time": iso_utc(at)}
    assert iso_utc(at).endswith("Z") and len(iso_utc(at)) == len("2026-11-22T02:10:00Z")
    code, body = get(server, "/latest/meta-data/events/recommendations/rebalance", tok)
    assert code == 200 and set(json.loads(body)) == {"noticeTime"}
    assert get(server, "/latest/meta-data/spot/termination-time", tok)[1] == iso_utc(at)
    assert "spot/" in get(server, "/latest/meta-data/", tok)[1].splitlines()


def test_client_reads_identity_and_notices(server: ImdsServer) -> None:
    client = ImdsClient(server.endpoint)
    assert client.identity() == {
        "instance_id": "i-0123456789abcdef0", "instance_type": "g5.xlarge",
        "az": "us-east-1d", "az_id": "use1-az4", "region": "us-east-1",
        "address": "127.0.0.1"}
    assert client.instance_action() is None
    assert client.rebalance() is None
    assert client.get("no-such-thing") is None
    server.set_instance_action(time.time() + 5)
    server.set_rebalance(time.time())
    action = client.instance_action()
    assert action is not None and action["action"] == "terminate"
    assert client.rebalance() is not None
    assert server.tokens_issued == 1  # one token for all of the above


def test_client_renews_its_token_before_expiry(server: ImdsServer) -> None:
    client = ImdsClient(server.endpoint, token_ttl=1)
    assert client.get("instance-id") == "i-0123456789abcdef0"
    assert server.tokens_issued == 1
    # Within the last quarter of the TTL the client asks for a new token first, so it
    # never sends one that expires in flight.
    time.sleep(0.8)
    assert client.get("instance-id") == "i-0123456789abcdef0"
    assert server.tokens_issued == 2


def test_client_retries_once_on_401(server: ImdsServer) -> None:
    client = ImdsClient(server.endpoint)
    assert client.get("instance-type") == "g5.xlarge"
    server.revoke_tokens()
    assert client.get("instance-type") == "g5.xlarge"
    assert server.tokens_issued == 2


def test_client_fails_fast_without_a_service() -> None:
    srv = ImdsServer(IDENTITY)
    endpoint = srv.endpoint
    srv.stop()  # the port is free again: nothing listens there
    started = time.monotonic()
    with pytest.raises(ImdsError, match="cannot reach the instance metadata service"):
        ImdsClient(endpoint, timeout=0.5).instance_action()
    # It fails at once rather than retrying for long (a generous bound: a busy machine
    # must not fail this; a client that retried for its full budget would).
    assert time.monotonic() - started < 30


def test_client_endpoint_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTNB_IMDS_ENDPOINT", raising=False)
    monkeypatch.delenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", raising=False)
    assert ImdsClient().endpoint == DEFAULT_ENDPOINT
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", "http://127.0.0.1:1/")
    assert ImdsClient().endpoint == "http://127.0.0.1:1"
    monkeypatch.setenv("SPOTNB_IMDS_ENDPOINT", "http://127.0.0.1:2")
    assert ImdsClient().endpoint == "http://127.0.0.1:2"
    assert ImdsClient("http://127.0.0.1:3").endpoint == "http://127.0.0.1:3"


def test_auto_scaling_ending_the_instance_is_a_notice_to_the_agent(
        server: ImdsServer) -> None:
    from spotnb.kernel_remote.watch import NoticeWatcher

    watcher = NoticeWatcher(ImdsClient(server.endpoint))
    assert watcher.poll() == (None, None)
    server.set_target_lifecycle_state("InService")
    assert watcher.poll() == (None, None)
    # Capacity rebalancing ends it once its standby is in service: a termination
    # hook's wait, read as the notice (the final save, then the lease for the standby).
    server.set_target_lifecycle_state("Terminated")
    action, rebalance = watcher.poll()
    assert action is not None and action["action"] == "terminate" and rebalance is None
    assert action["source"] == "auto-scaling" and watcher.notice == action
    assert watcher.poll() == (None, None)  # said once
