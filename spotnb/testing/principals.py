"""Who runs what in the simulator: the notebook's IAM user and the instances' roles.

:class:`PrincipalsPlay` is a part of :class:`~spotnb.testing.AwsSimulator`: with IAM
enforced (:mod:`spotnb.testing.iam`), spotnb runs as an IAM user that holds exactly the
policy spotnb prints for users, each instance as its instance profile's role (a session
of it, served by the instance's metadata service as EC2 serves it), and FIS as its
experiment's role.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from spotnb.testing.server import DEFAULT_ACCOUNT, MotoServer

__all__ = ["INSTANCE_CREDENTIAL_SECONDS", "USER_NAME", "PrincipalsPlay"]

log = logging.getLogger(__name__)

USER_NAME = "spotnb-user"
#: How long an instance's role session lasts (EC2 refreshes them; the simulator does not).
INSTANCE_CREDENTIAL_SECONDS = 12 * 3600


class PrincipalsPlay:
    """The principals of :class:`~spotnb.testing.AwsSimulator` (a part of it)."""

    region: str
    regions: tuple[str, ...]
    iam: bool
    server: MotoServer
    user_credentials: dict[str, str]
    _lock: threading.RLock
    _undo: list[Callable[[], None]]

    def _client(self, service: str, region: str | None = None) -> Any:
        raise NotImplementedError

    def _enforce_iam(self) -> None:
        """The notebook's user, with exactly the policy spotnb prints for users, in the
        environment; IAM enforced per principal from here on (:mod:`spotnb.testing.iam`)."""
        from spotnb.providers.aws import _boto
        from spotnb.providers.aws.bucket import default_bucket
        from spotnb.providers.aws.policies import user_policy

        iam = self._client("iam")
        iam.create_user(UserName=USER_NAME, Path="/")
        iam.put_user_policy(UserName=USER_NAME, PolicyName="spotnb", PolicyDocument=json.dumps(
            user_policy(self.regions, DEFAULT_ACCOUNT, default_bucket(DEFAULT_ACCOUNT,
                                                                      self.region))))
        key = iam.create_access_key(UserName=USER_NAME)["AccessKey"]
        #: the user's key (what spotnb runs with: the environment's credentials)
        self.user_credentials = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                                 "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        os.environ.update(self.user_credentials)  # restored by aws_environment on exit
        _boto._ACCOUNTS.clear()
        self.server.iam.placement_tags = self._placement_tags
        self.server.iam.enabled = True
        self._undo.append(lambda: setattr(self.server.iam, "enabled", False))

    @property
    def denied(self) -> list[Any]:
        """Every request IAM refused (:class:`spotnb.testing.iam.Denial`), in order."""
        return list(self.server.iam.denied)

    def _placement_groups(self, region: str) -> dict[str, dict[str, Any]]:
        raise NotImplementedError

    def _placement_tags(self, region: str, name: str) -> dict[str, str] | None:
        with self._lock:
            found = self._placement_groups(region).get(name)
        return None if found is None else {t["Key"]: t["Value"] for t in found["Tags"]}

    def _role_may(self, role_arn: str, action: str, resource: str) -> str | None:
        """Why ``role_arn`` may not do ``action`` on ``resource`` (None: it may), its
        policies evaluated as IAM does (an EC2 instance's tags as its resource tags)."""
        from spotnb.testing import iam

        if not self.iam:
            return None
        name = role_arn.rsplit("/", 1)[-1]
        client = self._client("iam")
        try:
            documents = [client.get_role_policy(RoleName=name, PolicyName=n)["PolicyDocument"]
                         for n in client.list_role_policies(RoleName=name)["PolicyNames"]]
        except Exception as err:
            return f"the role cannot be used: {err}"
        policies = [json.loads(d) if isinstance(d, str) else d for d in documents]
        # The resource's region (an instance's ARN names it), else the session's.
        parts = resource.split(":")
        region = parts[3] if len(parts) > 3 and parts[3] else self.region
        world = iam.World(DEFAULT_ACCOUNT, region, self._placement_tags)
        tags = world.ec2_tags(resource.rsplit("/", 1)[-1]) if ":instance/" in resource else {}
        check = iam.Check(action, resource, {
            "aws:RequestedRegion": (region,),
            **{f"{p}:ResourceTag/{k}": (v,) for p in ("aws", "ec2") for k, v in tags.items()}})
        verdict = iam.evaluate(policies, check)
        return None if verdict == "allow" else (
            f"{role_arn} is not authorized to perform {action} on {resource}")

    def _instance_role(self, region: str, inst: dict[str, Any]
                       ) -> tuple[str | None, dict[str, str] | None]:
        """The instance profile's role of an instance launched in ``region`` and a
        session of it (the keys EC2 serves in the instance's metadata); (None, None)
        without one."""
        from spotnb.testing import iam

        profile = (inst.get("IamInstanceProfile") or {}).get("Arn")
        world = iam.World(DEFAULT_ACCOUNT, region, self._placement_tags)
        if not profile:
            template = next((t["Value"] for t in inst.get("Tags", ())
                             if t["Key"] == "aws:ec2launchtemplate:id"), None)
            profile = world.template_profile(template) if template else None
        role_arn = world.profile_role(profile) if profile else None
        if role_arn is None:
            return None, None
        if not self._trusts_ec2(role_arn):
            log.info("instance %s: its role %s does not trust EC2: no credentials",
                     inst["InstanceId"], role_arn)
            return None, None
        session = self._client("sts").assume_role(
            RoleArn=role_arn, RoleSessionName=inst["InstanceId"],
            DurationSeconds=INSTANCE_CREDENTIAL_SECONDS)["Credentials"]
        return role_arn.rsplit("/", 1)[-1], {
            "AccessKeyId": session["AccessKeyId"], "SecretAccessKey": session["SecretAccessKey"],
            "SessionToken": session["SessionToken"],
            "Expiration": session["Expiration"].strftime("%Y-%m-%dT%H:%M:%SZ"),
            "ProfileArn": str(profile)}

    def _trust_policy(self, role_arn: str) -> dict[str, Any]:
        document = self._client("iam").get_role(RoleName=role_arn.rsplit("/", 1)[-1])[
            "Role"]["AssumeRolePolicyDocument"]
        return dict(json.loads(document) if isinstance(document, str) else document)

    def _trusts_ec2(self, role_arn: str) -> bool:
        for s in self._trust_policy(role_arn).get("Statement", []):
            services = (s.get("Principal") or {}).get("Service", [])
            services = [services] if isinstance(services, str) else services
            if s.get("Effect") == "Allow" and "ec2.amazonaws.com" in services:
                return True
        return False
