"""The webhook event types and delivery statuses. The one place they are spelled."""

from __future__ import annotations

from enum import StrEnum


class WebhookEventType(StrEnum):
    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
    SWEEP_COMPLETED = "sweep.completed"  # accepted in subscriptions; nothing emits it yet (no sweeps)


class DeliveryStatus(StrEnum):
    PENDING = "pending"  # due at next_attempt_at
    DELIVERED = "delivered"  # a 2xx answer
    FAILED = "failed"  # the retry window passed, or the destination is not allowed


def job_event_type(status: str) -> WebhookEventType:
    """The event of a job that reached the final ``status`` (succeeded, failed or cancelled)."""
    return WebhookEventType(f"job.{status}")
