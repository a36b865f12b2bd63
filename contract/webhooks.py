"""The webhook event types and delivery statuses: the one place they are spelled."""

from __future__ import annotations

from enum import StrEnum


class WebhookEventType(StrEnum):
    JOB_SUCCEEDED = "job.succeeded"
    JOB_FAILED = "job.failed"
    JOB_CANCELLED = "job.cancelled"
    SWEEP_COMPLETED = "sweep.completed"  # once, when every trial of a sweep has finished


class DeliveryStatus(StrEnum):
    PENDING = "pending"  # due at next_attempt_at
    DELIVERED = "delivered"  # a 2xx answer
    FAILED = "failed"  # the retry window passed, or the destination is not allowed


def job_event_type(status: str) -> WebhookEventType | None:
    """The event of a job that reached the final ``status`` (succeeded, failed or cancelled);
    None for stopped_early (a sweep's trial: its sweep's end is the event)."""
    try:
        return WebhookEventType(f"job.{status}")
    except ValueError:
        return None
