"""What the job's Auto Scaling group says of its failed launches (its scaling
activities): those about spot capacity, as ``instance`` events, and the others.
Pure functions, no calls."""

from __future__ import annotations

import re
from typing import Any

_TYPE = re.compile(r"\b([a-z][a-z0-9-]*\d[a-z0-9-]*\.\d*[a-z]+)\b")
_AZ = re.compile(r"\b([a-z]{2}(?:-gov)?-[a-z]+-\d[a-z])\b")


def launch_failures(activities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed Auto Scaling activities that were not about spot capacity (an instance
    profile IAM has not propagated yet or that is gone, an image that does not exist,
    a type the image cannot run, a missing permission...), oldest first: ``activity_id``
    and AWS's ``reason`` (the activity's status message)."""
    from spotnb.providers.aws._boto import capacity_code_in

    found = []
    for act in activities:
        if act.get("StatusCode") not in ("Failed", "Cancelled"):
            continue
        message = str(act.get("StatusMessage") or act.get("Description") or "").strip()
        if capacity_code_in(message) is None:
            found.append({"activity_id": act.get("ActivityId"), "reason": message,
                          "start": str(act.get("StartTime"))})
    found.sort(key=lambda f: str(f["start"]))
    return found


def capacity_failures(activities: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed Auto Scaling activities that were about spot capacity, oldest first, as
    ``instance`` event data (``action="capacity_error"``, ``reason`` the AWS code)."""
    from spotnb.providers.aws._boto import capacity_code_in

    found = []
    for act in activities:
        if act.get("StatusCode") not in ("Failed", "Cancelled"):
            continue
        message = str(act.get("StatusMessage") or act.get("Description") or "")
        code = capacity_code_in(message)
        if code is None:
            continue
        instance_type = _TYPE.search(message)
        az = _AZ.search(message)
        found.append({
            "action": "capacity_error", "reason": code, "detail": message,
            "instance_id": None,
            "instance_type": instance_type.group(1) if instance_type else None,
            "az": None,  # events name AZs by id; AWS's messages by name (az_name)
            "az_name": az.group(1) if az else None,
            "activity_id": act.get("ActivityId"),
            "start": act.get("StartTime"),
        })
    found.sort(key=lambda f: str(f["start"]))
    for f in found:
        f.pop("start")
    return found
