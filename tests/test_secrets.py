"""A job's secrets (spotnb.protocol.secretstore): refused when missing, never in a spec, kept in a
file only the user reads on the local cloud. The end-to-end search of both providers'
state for secret values is in tests/test_aws_provider.py
(``test_secrets_reach_every_attempt_and_no_store_file_or_cloud_state_holds_them``).
"""

from __future__ import annotations

import secrets as random_tokens
import stat
from pathlib import Path

import pytest

import spotnb
from spotnb.protocol import secretstore
from spotnb.protocol.secretstore import NOTIFY_SECRET, SecretsUnavailable
from spotnb.protocol.spec import JobSpec, SpecError


def test_a_missing_secret_is_refused_before_launch_naming_it(
        spotnb_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPOTNB_TEST_ABSENT_TOKEN", raising=False)
    monkeypatch.setenv("HF_TOKEN", "hf_" + random_tokens.token_hex(8))
    with pytest.raises(SpecError) as err:
        spotnb.submit("x = 1", secrets=["HF_TOKEN", "SPOTNB_TEST_ABSENT_TOKEN"])
    assert err.value.field == "secrets"
    assert "SPOTNB_TEST_ABSENT_TOKEN is not set in this machine's environment" in str(err.value)
    assert "Nothing was started" in str(err.value)
    assert not list(spotnb_home.rglob("spec.json")), "refused before anything is written"
    assert not secretstore.local_dir().exists()
    # A value that cannot be one is refused too, without being quoted.
    value = "x" * (secretstore.MAX_VALUE_BYTES + 1)
    with pytest.raises(SpecError, match="the value of BIG is 4097 bytes") as big:
        spotnb.prepare("x = 1", secrets={"BIG": value})
    assert value not in str(big.value)
    with pytest.raises(SpecError, match="the value of B must be text, not a bytes") as raw:
        spotnb.prepare("x = 1", secrets={"B": b"hf_raw-bytes-token"})
    assert "raw-bytes" not in str(raw.value)


def test_a_credential_given_as_env_is_refused_with_a_hint_to_use_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = "hf_" + random_tokens.token_urlsafe(24)
    with pytest.raises(SpecError) as err:
        spotnb.prepare("x = 1", env={"HF_TOKEN": token})
    assert err.value.field == "env"
    assert "--secret HF_TOKEN" in str(err.value) and "secrets=['HF_TOKEN']" in str(err.value)
    assert token not in str(err.value)
    # As a secret, the same value passes; the spec names it and holds no value.
    monkeypatch.setenv("HF_TOKEN", token)
    spec = spotnb.prepare("x = 1", secrets=["HF_TOKEN"], env={"WANDB_MODE": "offline"},
                          notify_url="https://hooks.slack.com/services/T0/B0/" + token[3:])
    assert spec.secrets == ("HF_TOKEN", NOTIFY_SECRET)
    text = spec.to_json()
    assert token not in text and token[3:] not in text and token not in repr(spec)
    assert JobSpec.from_json(text) == spec
    # One name, once: a secret is not also an env variable.
    with pytest.raises(SpecError, match="HF_TOKEN is given both as a secret and in env"):
        spotnb.prepare("x = 1", secrets=["HF_TOKEN"], env=["HF_TOKEN"])


def test_the_local_cloud_keeps_secrets_in_a_file_only_the_user_reads(
        spotnb_home: Path) -> None:
    secretstore.write_local("job-1", {"HF_TOKEN": "hf_local-value"})
    path = secretstore.local_path("job-1")
    assert spotnb_home in path.parents and (spotnb_home / "store") not in path.parents
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert secretstore.read_local("job-1", ("HF_TOKEN",)) == {"HF_TOKEN": "hf_local-value"}
    with pytest.raises(SecretsUnavailable, match="WANDB_API_KEY are missing") as err:
        secretstore.read_local("job-1", ("HF_TOKEN", "WANDB_API_KEY"))
    assert "hf_local-value" not in str(err.value)
    assert secretstore.delete_local("job-1") and not path.exists()
    with pytest.raises(SecretsUnavailable, match="deleted when the job ends"):
        secretstore.read_local("job-1", ("HF_TOKEN",))


def test_cleanup_removes_secrets_a_job_left_on_the_local_cloud(
        spotnb_home: Path, private_tmpdir: Path) -> None:
    from spotnb.providers.local import LocalProvider

    secretstore.write_local("20260101-000000-abcdef", {"HF_TOKEN": "hf_left-behind"})
    provider = LocalProvider()
    assert provider.cleanup(dry_run=True) == [
        "would remove the secrets of job 20260101-000000-abcdef (it has no capacity group)"]
    assert secretstore.local_path("20260101-000000-abcdef").exists()
    provider.cleanup()
    assert not secretstore.local_path("20260101-000000-abcdef").exists()
    assert provider.cleanup(dry_run=True) == []


def test_aws_cleanup_without_the_ssm_permission_says_so_and_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    from botocore.exceptions import ClientError

    from spotnb.providers.aws import AwsProvider, _cleanup_failure, parameters

    def denied(ssm: object, job_id: str | None = None) -> dict[str, list[str]]:
        raise ClientError({"Error": {"Code": "AccessDeniedException", "Message": "no"}},
                          "DescribeParameters")

    monkeypatch.setattr(parameters, "leftovers", denied)
    provider = AwsProvider(region="us-east-1")
    done: list[str] = []
    with pytest.raises(ClientError) as caught:
        provider._secrets_left("us-east-1", lambda job, store: (True, "its job has a result"),
                               "would delete", True, done)
    assert done == []
    line = _cleanup_failure("look for jobs' secrets in us-east-1", caught.value,
                            [provider.client("ssm", "us-east-1")])
    assert "permission ssm:DescribeParameters" in line
    assert "spotnb aws setup --dry-run" in line
