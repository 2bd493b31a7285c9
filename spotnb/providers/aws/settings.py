"""The AWS provider's settings from the environment, and the image a job runs by
default (AWS's Deep Learning AMI for PyTorch) with the instance families it supports:
pure functions, no calls."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from spotnb.protocol.spec import SpecError

#: The default image: AWS's Deep Learning AMI for PyTorch, the newest framework line AWS
#: supports ("Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.11 (Ubuntu 24.04)",
#: first released 2026-08-15; DLAMI release notes), from its public SSM parameter
#: (DLAMI Developer Guide, "Finding the ID of a DLAMI": the AMI's name without "deep",
#: "learning" and "ami"), whose ``latest`` follows the line's patch releases. Python
#: with PyTorch at /opt/pytorch/bin/python. When AWS ends the line's support, move to
#: the next one here. Override with SPOTNB_AWS_AMI_PARAMETER or SPOTNB_AWS_AMI.
DLAMI_NAME = "Deep Learning OSS Nvidia Driver AMI GPU PyTorch 2.11 (Ubuntu 24.04)"
DLAMI_PARAMETER = ("/aws/service/deeplearning/ami/x86_64/"
                   "oss-nvidia-driver-gpu-pytorch-2.11-ubuntu-24.04/latest/ami-id")
DLAMI_PYTHON = "/opt/pytorch/bin/python"
#: The instance families that image supports (its release notes' supported_ec2_instances:
#: G4dn, G5, G6, Gr6, G6e, P4 (p4d), P4de, P5, P5e, P5en, P6-B200). Others are refused
#: with it: AMD (g4ad), Arm (g5g), Inferentia/Trainium and V100 (p3) instances need
#: another image (SPOTNB_AWS_AMI).
DLAMI_FAMILIES = ("g4dn", "g5", "g6", "gr6", "g6e", "p4d", "p4de", "p5", "p5e", "p5en",
                  "p6-b200")


@dataclasses.dataclass(frozen=True)
class AwsSettings:
    """Provider settings from the environment (none is needed; all have defaults).

    ``SPOTNB_AWS_AMI``             an AMI id to use instead of the Deep Learning AMI
    ``SPOTNB_AWS_AMI_PARAMETER``   the SSM parameter to read the AMI id from
    ``SPOTNB_AWS_SUBNETS``         comma-separated subnet ids (default: the default VPC's
                                   subnets in every AZ that offers one of the types)
    ``SPOTNB_AWS_ONDEMAND_AFTER``  seconds without spot capacity after which the group
                                   may launch on-demand (default: never, spot only)
    ``SPOTNB_AWS_CAPACITY_POLL``   seconds between looks at the group's scaling
                                   activities while waiting for capacity (default 5)
    ``SPOTNB_AWS_LAUNCH_FAILURE``  seconds of failed launches that are not about
                                   capacity (and no instance) after which the job fails
                                   with AWS's reason (default 300: IAM propagation of a
                                   new instance profile heals within it)
    ``SPOTNB_AWS_SPOT_STRATEGY``   how Auto Scaling picks among the job's types
                                   (:data:`SPOT_STRATEGIES`; default
                                   ``price-capacity-optimized``, which ignores their order)
    """

    ami: str | None = None
    ami_parameter: str = DLAMI_PARAMETER
    subnets: tuple[str, ...] = ()
    ondemand_after: float | None = None
    capacity_poll: float = 5.0
    launch_failure: float = 300.0
    spot_strategy: str = "price-capacity-optimized"

    @classmethod
    def from_env(cls) -> AwsSettings:
        env = os.environ
        subnets = tuple(s.strip() for s in env.get("SPOTNB_AWS_SUBNETS", "").split(",")
                        if s.strip())
        return cls(
            ami=env.get("SPOTNB_AWS_AMI") or None,
            ami_parameter=env.get("SPOTNB_AWS_AMI_PARAMETER") or DLAMI_PARAMETER,
            subnets=subnets,
            ondemand_after=_seconds(env, "SPOTNB_AWS_ONDEMAND_AFTER"),
            capacity_poll=_seconds(env, "SPOTNB_AWS_CAPACITY_POLL") or 5.0,
            launch_failure=_seconds(env, "SPOTNB_AWS_LAUNCH_FAILURE") or 300.0,
            spot_strategy=check_strategy(env.get("SPOTNB_AWS_SPOT_STRATEGY") or
                                    "price-capacity-optimized"),
        )


#: The spot allocation strategies a job's group may use, and what each does with the
#: order of the job's instance types (Auto Scaling User Guide, "Allocation strategies
#: for multiple instance types"):
SPOT_STRATEGIES = {
    # The pools least likely to be interrupted soon, then the lowest price among them:
    # the order of the types is no preference. spotnb's default (AWS recommends it).
    "price-capacity-optimized": "the order of the types is no preference",
    # The pools with the most capacity, taking the order as a preference "on a
    # best-effort basis": for a job whose first type matters (a faster GPU, say).
    "capacity-optimized-prioritized": "the order of the types is a preference, "
                                      "capacity first",
}


def image_problem(settings: AwsSettings, instance_types: tuple[str, ...]) -> str | None:
    """Why the job's types cannot run the image it would get, or None: the default image
    (:data:`DLAMI_PARAMETER`) supports the families :data:`DLAMI_FAMILIES` only. An image
    of the user's own (SPOTNB_AWS_AMI or SPOTNB_AWS_AMI_PARAMETER) is the user's call."""
    if settings.ami or settings.ami_parameter != DLAMI_PARAMETER:
        return None
    others = [t for t in instance_types if t.split(".")[0] not in DLAMI_FAMILIES]
    if not others:
        return None
    return (f"{', '.join(others)} cannot run spotnb's default image, the {DLAMI_NAME} "
            f"(it supports {', '.join(DLAMI_FAMILIES)}): choose one of those types, or "
            "set SPOTNB_AWS_AMI to an image of yours for them")


def check_strategy(name: str) -> str:
    """``name`` if it is one of :data:`SPOT_STRATEGIES`; else a SpecError."""
    if name not in SPOT_STRATEGIES:
        raise SpecError(f"SPOTNB_AWS_SPOT_STRATEGY must be one of "
                        f"{', '.join(SPOT_STRATEGIES)}, not {name!r}")
    return name


def _seconds(env: Any, name: str) -> float | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value < 0:
        raise SpecError(f"{name} must be a number of seconds, not {raw!r}")
    return value
