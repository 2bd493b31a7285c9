"""A job's bucket: the default one's name (:func:`default_bucket`), whether a bucket can
be used (:func:`bucket_problem`: a launch, ``spotnb aws doctor``), and spotnb's settings
on the bucket it makes (:func:`ensure_bucket`: ``spotnb aws setup``, a launch into the
default bucket when it is missing). The store in it is :mod:`.store`'s.

:func:`ensure_bucket` creates the default bucket ``spotnb-<account>-<region>`` with
public access blocked, default encryption (SSE-S3), TLS-only access and the lifecycle
rules in :data:`LIFECYCLE_RULES`. Object ownership is S3's default for a new bucket,
bucket-owner-enforced (ACLs off): asking for it in ``CreateBucket``
(``ObjectOwnership``) would need ``s3:PutBucketOwnershipControls`` too (S3 API
Reference, CreateBucket, "Permissions"), for nothing.
"""

from __future__ import annotations

import json
from typing import Any

from spotnb.protocol.spec import SpecError
from spotnb.providers.aws import _boto

__all__ = ["CHECKPOINT_DAYS", "LIFECYCLE_RULES", "bucket_problem", "default_bucket",
           "ensure_bucket", "tls_only_policy"]

#: Checkpoints of finished jobs are the bulk of a bucket: objects over 1 MiB under
#: ``jobs/`` (checkpoint data; specs, events and results are far smaller) expire after
#: :data:`CHECKPOINT_DAYS`. S3 lifecycle filters take a prefix, not a pattern like
#: ``jobs/*/checkpoints/``, hence the size filter. Unfinished multipart uploads (an
#: instance interrupted mid-upload) are aborted after a day.
CHECKPOINT_DAYS = 30
LIFECYCLE_RULES = [
    {
        "ID": "spotnb-expire-old-checkpoints",
        "Status": "Enabled",
        "Filter": {"And": {"Prefix": "jobs/", "ObjectSizeGreaterThan": 1 << 20}},
        "Expiration": {"Days": CHECKPOINT_DAYS},
    },
    {
        "ID": "spotnb-abort-incomplete-uploads",
        "Status": "Enabled",
        "Filter": {"Prefix": ""},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    },
]


def default_bucket(account: str, region: str) -> str:
    """``spotnb-<account>-<region>``: unique per account and region, and says whose."""
    return f"spotnb-{account}-{region}"


def bucket_problem(s3: Any, bucket: str, owner: str) -> str | None:
    """Why ``bucket`` cannot be used by ``owner`` (a message naming the fix), or None.

    ``"missing"`` when there is no such bucket (the caller may create it).
    """
    try:
        s3.head_bucket(Bucket=bucket, ExpectedBucketOwner=owner)
        return None
    except Exception as err:
        code = _boto.error_code(err)
        if code in ("404", "NoSuchBucket", "NotFound"):
            return "missing"
        if code not in ("403", "AccessDenied"):
            if _boto.classify(err) == "fatal":
                return str(_boto.fatal_error(err, f"checking the bucket {bucket}"))
            return f"cannot check the bucket {bucket}: {err}"
    # 403 with ExpectedBucketOwner: someone else's bucket, or no permission. A plain
    # HeadBucket tells the two apart (it succeeds on a foreign bucket we may read).
    try:
        s3.head_bucket(Bucket=bucket)
    except Exception:
        return (f"access to the bucket {bucket} is denied to account {owner}: grant "
                "s3:ListBucket, s3:GetObject and s3:PutObject on it (see `spotnb aws setup "
                "--dry-run`), or use the default bucket (leave the store unset)")
    return (f"the bucket {bucket} belongs to another AWS account, not to {owner}: spotnb "
            "only writes to buckets of the account it runs in. Use a bucket of your own "
            f"(the default is {default_bucket(owner, 'REGION')}, created by `spotnb aws "
            "setup`)")


def ensure_bucket(s3: Any, bucket: str, region: str, owner: str,
                  dry_run: bool = False) -> list[str]:
    """Create ``bucket`` if it is missing and (re)apply spotnb's settings; what was done.

    Raises SpecError if the bucket belongs to someone else or cannot be used.
    """
    done: list[str] = []
    problem = bucket_problem(s3, bucket, owner)
    if problem is not None and problem != "missing":
        raise SpecError(problem)
    verb = "would" if dry_run else "did"
    if problem == "missing":
        done.append(f"{verb} create bucket s3://{bucket} in {region}")
        if not dry_run:
            # No ObjectOwnership: BucketOwnerEnforced is S3's default (module docstring).
            params: dict[str, Any] = {"Bucket": bucket}
            if region != "us-east-1":
                params["CreateBucketConfiguration"] = {"LocationConstraint": region}
            try:
                s3.create_bucket(**params)
            except Exception as err:
                code = _boto.error_code(err)
                if code == "BucketAlreadyExists":
                    raise SpecError(
                        f"the bucket name {bucket} is taken by another AWS account: pass "
                        "store='s3://<a bucket of yours>/spotnb'"
                    ) from None
                if code != "BucketAlreadyOwnedByYou":
                    _boto.raise_for(err, f"creating the bucket {bucket}")
    settings: list[tuple[str, str, dict[str, Any]]] = [
        ("block all public access", "put_public_access_block", {
            "PublicAccessBlockConfiguration": {
                "BlockPublicAcls": True, "IgnorePublicAcls": True,
                "BlockPublicPolicy": True, "RestrictPublicBuckets": True}}),
        ("turn on default encryption (SSE-S3)", "put_bucket_encryption", {
            "ServerSideEncryptionConfiguration": {"Rules": [{
                "ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"},
                "BucketKeyEnabled": True}]}}),
        (f"expire checkpoint objects after {CHECKPOINT_DAYS} days and abort unfinished "
         "uploads after 1 day", "put_bucket_lifecycle_configuration", {
             "LifecycleConfiguration": {"Rules": LIFECYCLE_RULES}}),
        ("tag it spotnb:managed=true", "put_bucket_tagging", {
            "Tagging": {"TagSet": [{"Key": "spotnb:managed", "Value": "true"}]}}),
    ]
    if not _plain_http_endpoint(s3):
        # Behind a plain-HTTP endpoint (moto in tests) a TLS-only policy would lock
        # spotnb out of its own bucket.
        settings.insert(2, ("refuse requests without TLS", "put_bucket_policy", {
            "Policy": json.dumps(tls_only_policy(bucket))}))
    for label, method, params in settings:
        done.append(f"{verb} {label} on s3://{bucket}")
        if dry_run:
            continue
        try:
            getattr(s3, method)(Bucket=bucket, ExpectedBucketOwner=owner, **params)
        except Exception as err:
            _boto.raise_for(err, f"configuring the bucket {bucket} ({label})")
    return done


def tls_only_policy(bucket: str) -> dict[str, Any]:
    """The bucket policy: deny every request that does not use TLS."""
    return {
        "Version": "2012-10-17",
        "Statement": [{
            "Sid": "DenyInsecureTransport",
            "Effect": "Deny",
            "Principal": "*",
            "Action": "s3:*",
            "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            "Condition": {"Bool": {"aws:SecureTransport": "false"}},
        }],
    }


def _plain_http_endpoint(s3: Any) -> bool:
    return str(getattr(s3.meta, "endpoint_url", "")).startswith("http://")
