"""/v1/webhooks: event endpoints and their delivery logs, thin routes over app.services.webhooks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from app.api.deps import After, WebhookId, Work
from app.api.routes.jobs import ERRORS
from app.schemas import api as schemas
from app.services import webhooks as service

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
Limit = Annotated[int, Query(ge=1, le=100)]


@router.post("", status_code=201, response_model=schemas.WebhookCreated, responses={**ERRORS, 413: ERRORS[422]})
async def create_webhook(body: schemas.WebhookCreate, work: Work) -> schemas.WebhookCreated:
    """Create an endpoint; the answer holds its signing `secret`, shown this once.

    422 `url` when the URL's host is outside the destinations the operator allows
    (MUONFORGE_WEBHOOK_ALLOW: none by default) or does not resolve; 409 over the tenant's endpoint
    cap (MUONFORGE_WEBHOOK_TENANT_CAP). Each event it takes (`job.succeeded`, `job.failed`,
    `job.cancelled`, `sweep.completed`) then arrives as a signed POST (headers `webhook-id`,
    `webhook-timestamp`, `webhook-signature`), retried with backoff for 24 h until a 2xx answer.
    """
    endpoint = await work(service.create_endpoint, body.url, body.events, work.settings)
    return schemas.WebhookCreated.model_validate(endpoint)


@router.get("", response_model=schemas.WebhookList, responses=ERRORS)
async def list_webhooks(work: Work, limit: Limit = 20, after: After = None) -> schemas.WebhookList:
    """Newest first. Pass the previous page's `next_after` as `after`."""
    return await work(service.list_endpoints, limit, after)


@router.get("/{webhook_id}", response_model=schemas.Webhook, responses=ERRORS)
async def get_webhook(webhook_id: WebhookId, work: Work) -> schemas.Webhook:
    return schemas.Webhook.model_validate(await work(service.get_endpoint, webhook_id))


@router.delete("/{webhook_id}", status_code=204, response_class=Response, responses=ERRORS)
async def delete_webhook(webhook_id: WebhookId, work: Work) -> Response:
    """Delete an endpoint and its delivery log; nothing more is sent to it."""
    await work(service.delete_endpoint, webhook_id)
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=schemas.WebhookDeliveryList, responses=ERRORS)
async def list_deliveries(
    webhook_id: WebhookId, work: Work, limit: Limit = 20, after: After = None
) -> schemas.WebhookDeliveryList:
    """The endpoint's deliveries, newest first, each with its attempts (status code or error,
    duration). Pass the previous page's `next_after` as `after`."""
    return await work(service.list_deliveries, webhook_id, limit, after)
