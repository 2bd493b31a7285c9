"""Providers: where capacity comes from. One contract, several implementations.

A provider creates one *capacity group* per job: a group that keeps one instance of
the job's ranked instance types running, and replaces an interrupted instance by
itself, whether or not the notebook is open (local cloud: a supervisor process; AWS:
an Auto Scaling group). Every instance runs the same agent
(``python -m spotnb.kernel_remote --job <store-uri>``) with an instance-metadata
endpoint (IMDSv2) that announces interruptions.

The contract, which every implementation follows (implementations say "see the
contract" rather than repeat it):

``validate(spec)``
    Raise :class:`spotnb.protocol.spec.SpecError` (message names the fix) if the provider
    cannot run the spec: unknown instance type, bad region, missing credentials.
    Starts nothing.
``launch(spec, secrets=None)``
    Create the capacity group. Returns once the group exists (not once an instance
    runs). If a step fails, release what was already created, then raise.
    ``secrets`` (``{name: value}``, the names are ``spec.secrets``) go to the provider's
    secret store before any instance starts, readable by the job's instances alone,
    and are deleted with the group (:mod:`spotnb.protocol.secretstore`); no value is written
    anywhere else, logged or put in an exception.
``read_secrets(spec)`` (called on the instance, by the agent at its start)
    ``{name: value}`` of ``spec.secrets``; raises
    :class:`spotnb.protocol.secretstore.SecretsUnavailable` (naming them, no value) when they
    cannot be read.
``interrupt(job_id, instance=None)``
    Deliver a spot interruption notice to the job's current instance now (a multi-node
    job's node ``instance`` when named); it is terminated after the notice period, and
    the group replaces it.
``kill(job_id, instance=None)`` (optional: the local cloud)
    End the job's instance (``instance`` when named, else the first running) at once,
    without a notice, as a lost machine: the way to test a cell against one. The group
    replaces it. Providers that cannot simulate it raise :class:`ProviderError`.
``terminate(job_id)``
    Delete the capacity group, its instances and the job's secrets. Idempotent;
    called on completion, failure, stop, budget and deadline (DESIGN invariant 6).
``cleanup(dry_run)``
    Find leftovers of this provider (groups whose job ended, orphan instances) and,
    unless ``dry_run``, remove them. Returns a description of each.
``prices(instance_type, region)``
    The on-demand and current spot prices (USD/hour) and where they come from.
``default_store(region)`` (optional)
    The store URI for jobs submitted without one (AWS: the default bucket); None means
    spotnb's local default store.
``ensure_supervised(job_id, spec=None, store=None)`` (optional)
    Called by every spotnb entry point that looks at a job without a result (attach,
    wait, follow, listing). A provider whose capacity group needs a live process of
    its own (the local cloud's supervisor, which a crash or a reboot can end) starts a
    new one that takes over; failing that, it ends the job with a result that says
    why. Returns a sentence saying what it did, or None when nothing was needed.
    ``spec`` and ``store`` come from a caller that follows the job (attach, wait,
    follow; not a listing): AWS's Auto Scaling group lives in AWS, but the watch that
    moves a job of several regions and fails a launch that cannot work lives in a
    follower's process (:mod:`spotnb.providers.aws.capacity`), and such a caller takes
    it over.
``instance_gone(job_id, instance_id)`` (optional, called on the instance)
    Whether the instance is known to be terminated (EC2: ``shutting-down``,
    ``terminated`` or unknown). A replacement whose job's lease is held by that
    instance takes it over at once rather than waiting out the lease's TTL; False
    when unsure.
``notice_seconds()`` (optional)
    The interruption notice period of the provider's instances (default: EC2's 120 s).
    :func:`notice_seconds` answers it for the agent without importing the provider.
``upload_mbps(spec)`` (optional)
    The bandwidth (MB/s) an instance of the job can be expected to write checkpoints to
    its store with, or None if unknown: spotnb warns at submit time when a checkpoint
    of the captured inputs would not be durable within the notice
    (:mod:`spotnb.ckpt.notice`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping

from spotnb.protocol.spec import JobSpec, SpecError
from spotnb.protocol.store import Store

__all__ = ["PROVIDERS", "PoolPrice", "Provider", "ProviderError", "get_provider",
           "notice_seconds"]

PROVIDERS = ("local", "aws")


class ProviderError(RuntimeError):
    """A provider operation failed after validation; the message says what to do next."""


@dataclasses.dataclass(frozen=True)
class PoolPrice:
    """Prices of one instance type in one place, USD per instance-hour."""

    instance_type: str
    region: str
    az: str | None
    spot: float | None
    ondemand: float | None
    source: str


class Provider(ABC):
    """The provider contract; see the module docstring."""

    name: str

    @abstractmethod
    def validate(self, spec: JobSpec) -> None: ...

    @abstractmethod
    def launch(self, spec: JobSpec, secrets: Mapping[str, str] | None = None) -> None: ...

    @abstractmethod
    def read_secrets(self, spec: JobSpec) -> dict[str, str]: ...

    @abstractmethod
    def interrupt(self, job_id: str, instance: str | None = None) -> None: ...

    def kill(self, job_id: str, instance: str | None = None) -> None:
        """See the contract: only the local cloud simulates a lost machine."""
        raise ProviderError(f"the {self.name} provider cannot kill an instance without "
                            "notice; test a lost machine on the local cloud "
                            "(provider='local')")

    @abstractmethod
    def terminate(self, job_id: str) -> None: ...

    @abstractmethod
    def cleanup(self, dry_run: bool = False) -> list[str]: ...

    @abstractmethod
    def prices(self, instance_type: str, region: str) -> PoolPrice: ...

    def default_store(self, region: str) -> str | None:
        """The store URI for jobs submitted without one; None: the local default store."""
        return None

    def ensure_supervised(self, job_id: str, spec: JobSpec | None = None,
                          store: Store | None = None) -> str | None:
        """Restart the job's supervision if it died (see the contract)."""
        return None

    def instance_gone(self, job_id: str, instance_id: str) -> bool:
        """Whether ``instance_id`` is known to be terminated (see the contract)."""
        return False

    def notice_seconds(self) -> float:
        """The interruption notice period of this provider's instances, in seconds."""
        return notice_seconds(self.name)

    def upload_mbps(self, spec: JobSpec) -> float | None:
        """MB/s an instance of ``spec`` can write checkpoints to its store; None: unknown."""
        return None


def notice_seconds(provider: str) -> float:
    """The interruption notice period of ``provider``'s instances (cheap to call)."""
    if provider == "local":
        from spotnb.providers.local.state import Settings

        return Settings.load().notice_seconds
    from spotnb.ckpt.notice import EC2_NOTICE_SECONDS

    return EC2_NOTICE_SECONDS


def get_provider(name: str) -> Provider:
    """The provider called ``name``; raises :class:`SpecError` naming the valid ones."""
    if name == "local":
        from spotnb.providers.local import LocalProvider

        return LocalProvider()
    if name == "aws":
        from spotnb.providers.aws import AwsProvider

        return AwsProvider()
    raise SpecError(f"unknown provider {name!r}: choose one of {', '.join(PROVIDERS)}")
