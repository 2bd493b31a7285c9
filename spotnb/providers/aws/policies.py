"""The AWS provider's IAM documents: pure functions, no calls.

The instance role (:func:`instance_policy`) is least-privilege: objects under the job's
prefix only, listing only that prefix, deleting only its own group, template, role and
profile (by ARN and by tag), a multi-node job's own security and placement groups (by
tag), reading and deleting its own secrets (SSM parameters under
``/spotnb/<job_id>/``), plus read-only calls that AWS cannot scope to a resource. The
shared FIS role interrupts spotnb's instances only (:func:`fis_policy`); the mover
(:mod:`.mover`) moves jobs of several regions and nothing else (:func:`mover_policy`);
the notebook user's identity needs :func:`user_policy` (``spotnb aws setup`` prints
it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from spotnb.providers.aws import parameters
from spotnb.providers.aws.resources import (
    IAM_PATH,
    MOVER_FUNCTION,
    MOVER_RULE,
    TAG_JOB,
    TAG_MANAGED,
    group_name,
    role_name,
    s3_location,
)
from spotnb.providers.aws.resources import (
    partition as aws_partition,
)

# Actions AWS cannot restrict to a resource; all are read-only. The instance agent
# (:mod:`.instance`) needs each of them; nothing else on the instance calls AWS.
READ_ONLY_ACTIONS = (
    "ec2:DescribeAvailabilityZones",
    "ec2:DescribeInstances",
    "ec2:DescribeLaunchTemplates",
    "ec2:DescribeSecurityGroups",  # a multi-node job's own group, to delete it
    "ec2:DescribePlacementGroups",  # its placement group, if no peer deleted it
    "ec2:DescribeSpotPriceHistory",
    "autoscaling:DescribeAutoScalingGroups",
    "autoscaling:DescribeScalingActivities",
    "pricing:GetProducts",
)


def trust_policy(service: str) -> dict[str, Any]:
    """Who may assume a role: the AWS service ``service`` (``ec2.amazonaws.com``)."""
    return {"Version": "2012-10-17", "Statement": [{
        "Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}]}


def instance_policy(*, job_id: str, store_uri: str, region: str,
                    account: str, regions: Sequence[str] = ()) -> dict[str, Any]:
    """The job's instance role: least privilege, scoped to the job's store prefix.

    ``region``: the job's home (its store's; its queues and secrets are there);
    ``regions``: every region its group may run in (its own group, template and
    network there), home by default. One role for the job's life: a move to another
    of its regions changes no policy."""
    bucket, prefix = s3_location(store_uri)
    partition = aws_partition(region)
    role = role_name(job_id)
    where = list(dict.fromkeys(regions or (region,)))

    def arns(*templates: str) -> str | list[str]:
        found = [t.format(region=r) for t in templates for r in where]
        return found[0] if len(found) == 1 else found

    own_group = arns(f"arn:{partition}:autoscaling:{{region}}:{account}:autoScalingGroup:*:"
                     f"autoScalingGroupName/{group_name(job_id)}")
    return {"Version": "2012-10-17", "Statement": [
        {
            "Sid": "JobObjects",
            "Effect": "Allow",
            "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                       "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"],
            "Resource": f"arn:{partition}:s3:::{bucket}/{prefix}/*",
        },
        {
            "Sid": "ListJobPrefix",
            "Effect": "Allow",
            "Action": "s3:ListBucket",
            "Resource": f"arn:{partition}:s3:::{bucket}",
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/", f"{prefix}/*"]}},
        },
        {
            "Sid": "EndOwnGroup",
            "Effect": "Allow",
            "Action": "autoscaling:DeleteAutoScalingGroup",
            "Resource": own_group,
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            # Warm standbys (providers/aws/instance.py): the job's instance asks its
            # group for a second instance on a rebalance recommendation, moves the job
            # to it (ends itself through the termination hook, whose wait it ends once
            # its final save is durable), gives back one not ready in time, or leaves
            # the group at a notice (EC2 ends it; the standby is its replacement); an
            # instance that runs the job protects itself from scale-in.
            "Sid": "OwnGroupStandby",
            "Effect": "Allow",
            "Action": ["autoscaling:CompleteLifecycleAction",
                       "autoscaling:SetDesiredCapacity",
                       "autoscaling:SetInstanceProtection",
                       "autoscaling:TerminateInstanceInAutoScalingGroup",
                       "autoscaling:DetachInstances"],
            "Resource": own_group,
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnTemplate",
            "Effect": "Allow",
            "Action": "ec2:DeleteLaunchTemplate",
            "Resource": arns(f"arn:{partition}:ec2:{{region}}:{account}:launch-template/*"),
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnNetwork",
            "Effect": "Allow",
            "Action": ["ec2:DeleteSecurityGroup", "ec2:DeletePlacementGroup"],
            "Resource": arns(f"arn:{partition}:ec2:{{region}}:{account}:security-group/*",
                             f"arn:{partition}:ec2:{{region}}:{account}:placement-group/*"),
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_JOB}": job_id}},
        },
        {
            "Sid": "DeleteOwnRole",
            "Effect": "Allow",
            "Action": ["iam:DeleteRolePolicy", "iam:DeleteRole",
                       "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile"],
            "Resource": [f"arn:{partition}:iam::{account}:role{IAM_PATH}{role}",
                         f"arn:{partition}:iam::{account}:instance-profile{IAM_PATH}{role}"],
        },
        {
            "Sid": "OwnQueues",
            "Effect": "Allow",
            "Action": ["sqs:CreateQueue", "sqs:TagQueue", "sqs:GetQueueUrl",
                       "sqs:ReceiveMessage", "sqs:SendMessage", "sqs:DeleteQueue"],
            "Resource": f"arn:{partition}:sqs:{region}:{account}:spotnb-{job_id}-*",
        },
        parameters.role_statement(job_id=job_id, region=region, account=account,
                                  partition=partition),
        {
            "Sid": "ReadOnlyUnscopable",
            "Effect": "Allow",
            "Action": list(READ_ONLY_ACTIONS),
            "Resource": "*",
        },
    ]}


def fis_policy(region: str, account: str) -> dict[str, Any]:
    """The FIS role: send interruption notices to spotnb's spot instances only, in any
    region (one role for the account, whose jobs run in several: ``region`` names the
    partition)."""
    partition = aws_partition(region)
    return {"Version": "2012-10-17", "Statement": [
        {
            "Sid": "InterruptSpotnbInstances",
            "Effect": "Allow",
            "Action": "ec2:SendSpotInstanceInterruptions",
            "Resource": f"arn:{partition}:ec2:*:{account}:instance/*",
            "Condition": {"StringEquals": {f"aws:ResourceTag/{TAG_MANAGED}": "true"}},
        },
        {"Sid": "FindThem", "Effect": "Allow", "Action": "ec2:DescribeInstances",
         "Resource": "*"},
    ]}


def mover_policy(regions: Sequence[str], account: str,
                 buckets: Sequence[str]) -> dict[str, Any]:
    """The mover's role (:mod:`.mover`): what a move of a job's capacity to another of
    ``regions`` takes (its group, template and network made there and deleted where it
    leaves, its nodes there ended through their group), the job's store in one of
    ``buckets`` (its region events, its move claims, its checkpoint's size), and its own
    logs. It makes no role and reads no secret: the job's role and instance profile are
    made at its launch, for all its regions."""
    partition = aws_partition(regions[0])
    where = list(dict.fromkeys(regions))
    allowed: str | list[str] = where[0] if len(where) == 1 else where

    def arns(template: str) -> str | list[str]:
        found = [template.format(region=r) for r in where]
        return found[0] if len(found) == 1 else found

    buckets = list(dict.fromkeys(buckets))

    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "JobStores", "Effect": "Allow",
         "Action": ["s3:GetObject", "s3:PutObject"],
         "Resource": [f"arn:{partition}:s3:::{b}/*" for b in buckets]},
        {"Sid": "ListJobStores", "Effect": "Allow",
         "Action": ["s3:ListBucket", "s3:GetBucketLocation"],
         "Resource": [f"arn:{partition}:s3:::{b}" for b in buckets]},
        {"Sid": "JobGroups", "Effect": "Allow",
         "Action": ["autoscaling:CreateAutoScalingGroup", "autoscaling:UpdateAutoScalingGroup",
                    "autoscaling:DeleteAutoScalingGroup", "autoscaling:PutLifecycleHook",
                    "autoscaling:TerminateInstanceInAutoScalingGroup",
                    "autoscaling:CreateOrUpdateTags"],
         "Resource": arns(f"arn:{partition}:autoscaling:{{region}}:{account}:"
                          "autoScalingGroup:*:autoScalingGroupName/spotnb-*")},
        {"Sid": "JobCapacity", "Effect": "Allow",
         "Action": ["ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate",
                    "ec2:CreateSecurityGroup", "ec2:CreateTags", "ec2:RunInstances",
                    "ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress",
                    "ec2:DeleteSecurityGroup", "ec2:CreatePlacementGroup",
                    "ec2:DeletePlacementGroup"],
         "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": allowed}}},
        {"Sid": "PassJobRoles", "Effect": "Allow",
         "Action": ["iam:PassRole", "iam:GetInstanceProfile", "iam:GetRole"],
         "Resource": [f"arn:{partition}:iam::{account}:role{IAM_PATH}spotnb-job-*",
                      f"arn:{partition}:iam::{account}:instance-profile{IAM_PATH}spotnb-job-*"]},
        {"Sid": "OwnLogGroup", "Effect": "Allow", "Action": "logs:CreateLogGroup",
         "Resource": arns(f"arn:{partition}:logs:{{region}}:{account}:log-group:"
                          f"/aws/lambda/{MOVER_FUNCTION}")},
        {"Sid": "OwnLogs", "Effect": "Allow",
         "Action": ["logs:CreateLogStream", "logs:PutLogEvents"],
         "Resource": arns(f"arn:{partition}:logs:{{region}}:{account}:log-group:"
                          f"/aws/lambda/{MOVER_FUNCTION}:log-stream:*")},
        {"Sid": "ReadOnly", "Effect": "Allow",
         "Action": ["ec2:Describe*", "autoscaling:Describe*", "ec2:GetSpotPlacementScores",
                    "ssm:GetParameter", "ssm:GetParameters", "sts:GetCallerIdentity"],
         "Resource": "*"},
    ]}


#: The service-linked roles AWS creates in an account on a service's first use, by the
#: caller's request: Auto Scaling's at the first group (Auto Scaling User Guide,
#: "Service-linked roles for Amazon EC2 Auto Scaling"), FIS's at the first experiment
#: template (FIS User Guide, "Use service-linked roles for AWS FIS"). Without
#: ``iam:CreateServiceLinkedRole`` for them a fresh account's first launch (or first
#: ``%spot_interrupt``) fails.
SERVICE_LINKED_ROLES = {
    "autoscaling.amazonaws.com": "AWSServiceRoleForAutoScaling",
    "fis.amazonaws.com": "AWSServiceRoleForFIS",
}


def user_policy(region: str | Sequence[str], account: str, bucket: str) -> dict[str, Any]:
    """What the notebook user's identity needs (printed by ``spotnb aws setup``), in
    ``region`` (or each of several: the allowed regions, where jobs may run; the first
    is home, ``bucket``'s).

    Every action is checked against AWS's Service Authorization Reference in the tests
    (``tests/aws_reference/iam.py``): list calls that AWS cannot scope to a resource
    (``iam:ListRoles``, ``ec2:Describe*`` ...) are granted on ``*``, the rest on
    spotnb's own resources or in the allowed regions."""
    regions = [region] if isinstance(region, str) else list(dict.fromkeys(region))
    allowed: str | list[str] = regions[0] if len(regions) == 1 else regions

    def arns(template: str) -> str | list[str]:
        found = [template.format(region=r) for r in regions]
        return found[0] if len(found) == 1 else found

    return {"Version": "2012-10-17", "Statement": [
        {"Sid": "Store", "Effect": "Allow",
         "Action": ["s3:CreateBucket", "s3:ListBucket", "s3:GetObject", "s3:PutObject",
                    "s3:DeleteObject", "s3:PutBucketPublicAccessBlock",
                    "s3:PutEncryptionConfiguration", "s3:PutBucketPolicy",
                    "s3:PutLifecycleConfiguration", "s3:PutBucketTagging",
                    "s3:GetBucketLocation", "s3:AbortMultipartUpload",
                    "s3:ListMultipartUploadParts"],
         "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]},
        {"Sid": "JobRoles", "Effect": "Allow",
         "Action": ["iam:CreateRole", "iam:PutRolePolicy", "iam:TagRole", "iam:GetRole",
                    "iam:GetRolePolicy",
                    "iam:DeleteRolePolicy", "iam:DeleteRole", "iam:CreateInstanceProfile",
                    "iam:TagInstanceProfile", "iam:AddRoleToInstanceProfile",
                    "iam:RemoveRoleFromInstanceProfile", "iam:DeleteInstanceProfile",
                    "iam:GetInstanceProfile", "iam:ListRoleTags", "iam:ListRolePolicies",
                    "iam:PassRole"],
         "Resource": [f"arn:aws:iam::{account}:role{IAM_PATH}*",
                      f"arn:aws:iam::{account}:instance-profile{IAM_PATH}*"]},
        {"Sid": "ServiceLinkedRoles", "Effect": "Allow",
         "Action": "iam:CreateServiceLinkedRole",
         "Resource": [f"arn:aws:iam::{account}:role/aws-service-role/{service}/{role}"
                      for service, role in SERVICE_LINKED_ROLES.items()],
         "Condition": {"StringEquals": {"iam:AWSServiceName": list(SERVICE_LINKED_ROLES)}}},
        {"Sid": "Capacity", "Effect": "Allow",
         "Action": ["ec2:CreateLaunchTemplate", "ec2:DeleteLaunchTemplate",
                    "ec2:CreateSecurityGroup", "ec2:CreateTags", "ec2:RunInstances",
                    "ec2:AuthorizeSecurityGroupIngress", "ec2:AuthorizeSecurityGroupEgress",
                    "ec2:DeleteSecurityGroup",
                    "ec2:CreatePlacementGroup", "ec2:DeletePlacementGroup",
                    "ec2:TerminateInstances", "autoscaling:CreateAutoScalingGroup",
                    "autoscaling:UpdateAutoScalingGroup", "autoscaling:PutLifecycleHook",
                    # a move to another region ends the nodes it leaves through their
                    # group's termination hook (their notice)
                    "autoscaling:TerminateInstanceInAutoScalingGroup",
                    "autoscaling:DeleteAutoScalingGroup", "autoscaling:CreateOrUpdateTags",
                    "fis:CreateExperimentTemplate", "fis:StartExperiment",
                    "fis:DeleteExperimentTemplate", "fis:TagResource"],
         "Resource": "*",
         "Condition": {"StringEquals": {"aws:RequestedRegion": allowed}}},
        {"Sid": "Queues", "Effect": "Allow",
         "Action": ["sqs:CreateQueue", "sqs:TagQueue", "sqs:GetQueueUrl", "sqs:SendMessage",
                    "sqs:ReceiveMessage", "sqs:DeleteQueue", "sqs:ListQueueTags"],
         "Resource": arns(f"arn:aws:sqs:{{region}}:{account}:spotnb-*")},
        {"Sid": "JobSecrets", "Effect": "Allow",
         "Action": ["ssm:PutParameter", "ssm:AddTagsToResource", "ssm:ListTagsForResource",
                    "ssm:DeleteParameter", "ssm:DeleteParameters"],
         "Resource": arns(f"arn:aws:ssm:{{region}}:{account}:parameter{parameters.ROOT}/*")},
        # The mover (mover.py): deployed by setup and by a launch of several regions.
        {"Sid": "Mover", "Effect": "Allow",
         "Action": ["lambda:CreateFunction", "lambda:GetFunction",
                    "lambda:GetFunctionConfiguration", "lambda:UpdateFunctionCode",
                    "lambda:UpdateFunctionConfiguration", "lambda:AddPermission",
                    "lambda:DeleteFunction", "lambda:TagResource"],
         "Resource": arns(f"arn:aws:lambda:{{region}}:{account}:function:{MOVER_FUNCTION}")},
        {"Sid": "MoverRule", "Effect": "Allow",
         "Action": ["events:PutRule", "events:PutTargets", "events:DescribeRule",
                    "events:ListTargetsByRule", "events:RemoveTargets", "events:DeleteRule",
                    "events:TagResource"],
         "Resource": arns(f"arn:aws:events:{{region}}:{account}:rule/{MOVER_RULE}")},
        # `spotnb aws doctor` asks IAM whether this identity has the rest of this policy.
        {"Sid": "SelfCheck", "Effect": "Allow",
         "Action": "iam:SimulatePrincipalPolicy",
         "Resource": [f"arn:aws:iam::{account}:user/*", f"arn:aws:iam::{account}:role/*"]},
        {"Sid": "ReadOnly", "Effect": "Allow",
         "Action": ["ec2:Describe*", "autoscaling:Describe*", "ssm:GetParameter",
                    "ssm:DescribeParameters", "sqs:ListQueues",
                    "pricing:GetProducts", "ec2:GetSpotPlacementScores",
                    "servicequotas:ListServiceQuotas", "sts:GetCallerIdentity",
                    "tag:GetResources", "iam:ListRoles", "iam:ListInstanceProfiles"],
         "Resource": "*"},
    ]}
