"""Prometheus metrics (requests, jobs by status, queue depth, training steps) and readiness checks."""

from __future__ import annotations

import hmac
import time
from typing import Annotated

from fastapi import FastAPI, Header, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.db.session import open_session
from app.errors import Unauthorized
from app.messaging.broker import broker_reachable
from app.repositories.jobs import JobRepository
from app.settings import Settings
from contract.status import JobStatus


class JobCollector:
    """Read at scrape time from the database, the source of truth."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self):
        with open_session(self.settings) as session:
            repo = JobRepository(session)
            counts, steps = repo.count_by_status(), repo.steps_completed()
        jobs = GaugeMetricFamily("muonforge_jobs", "Jobs by status.", labels=["status"])
        for status in JobStatus:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        queued = counts.get(JobStatus.QUEUED, 0)
        yield GaugeMetricFamily("muonforge_queue_depth", "Jobs waiting for a worker.", value=queued)
        yield CounterMetricFamily(
            "muonforge_training_steps", "Optimizer steps completed over all jobs (rate() = step rate).", value=steps
        )


class StreamCollector:
    """Open events streams and live feeds of this API process, read at scrape time."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self):
        state = self.app.state
        yield GaugeMetricFamily(
            "muonforge_event_streams",
            "Open events streams (SSE clients).",
            value=state.tenant_limits.streams.total if hasattr(state, "tenant_limits") else 0,
        )
        reader = getattr(state, "live_reader", None)
        yield GaugeMetricFamily(
            "muonforge_live_feeds",
            "Jobs whose live stream this process reads.",
            value=len(reader.feeds) if reader else 0,
        )


class RequestMetrics:
    """Counts requests and times them per route: a pure ASGI middleware (the decorator form,
    BaseHTTPMiddleware, costs an extra task and a body stream on every request)."""

    def __init__(self, app: ASGIApp, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            path = getattr(scope.get("route"), "path", "unmatched")
            self.requests.labels(scope["method"], path, str(status)).inc()
            self.latency.labels(path).observe(time.perf_counter() - start)


def install_metrics(app: FastAPI, settings: Settings) -> None:
    registry = CollectorRegistry()
    requests = Counter("muonforge_http_requests", "HTTP requests.", ["method", "route", "status"], registry=registry)
    latency = Histogram("muonforge_http_request_seconds", "HTTP request latency.", ["route"], registry=registry)
    registry.register(JobCollector(settings))
    registry.register(StreamCollector(app))

    app.add_middleware(RequestMetrics, requests=requests, latency=latency)

    @app.get(
        "/metrics",
        tags=["health"],
        response_class=PlainTextResponse,
        responses={401: {"description": "A wrong or missing metrics token."}},
    )
    def metrics(authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> Response:
        """Prometheus exposition; with MUONFORGE_METRICS_TOKEN set, only for `Authorization:
        Bearer <that token>` (API keys are for tenants: these figures cover all of them)."""
        check_metrics_token(settings.metrics_token, authorization)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def check_metrics_token(token: str | None, authorization: str | None) -> None:
    """Raise Unauthorized unless no token is set or ``authorization`` is ``Bearer <token>``."""
    if token is None:
        return
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        challenge = {"WWW-Authenticate": "Bearer"}
        raise Unauthorized("send Authorization: Bearer <MUONFORGE_METRICS_TOKEN>", headers=challenge)


def readiness(settings: Settings) -> dict[str, str]:
    checks = {}
    try:
        with open_session(settings) as session:
            session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # the message says which part is down
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        broker_reachable(settings)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    return checks
