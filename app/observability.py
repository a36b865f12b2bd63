"""Prometheus metrics (requests, jobs by status, queue depth, training steps) and readiness checks."""

from __future__ import annotations

import time

from fastapi import FastAPI, Response
from kombu import Connection
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import func, select, text
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.db.models import JOB_STATUSES, Job
from app.db.session import session_factory
from app.settings import Settings


class JobCollector:
    """Read at scrape time from the database, the source of truth."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def collect(self):
        with session_factory(self.settings.sqlalchemy_url)() as session:
            counts = dict(session.execute(select(Job.status, func.count()).group_by(Job.status)).all())
            steps = session.scalar(select(func.coalesce(func.sum(Job.progress_step), 0))) or 0
        jobs = GaugeMetricFamily("muonforge_jobs", "Jobs by status.", labels=["status"])
        for status in JOB_STATUSES:
            jobs.add_metric([status], counts.get(status, 0))
        yield jobs
        yield GaugeMetricFamily("muonforge_queue_depth", "Jobs waiting for a worker.", value=counts.get("queued", 0))
        yield CounterMetricFamily(
            "muonforge_training_steps", "Optimizer steps completed over all jobs (rate() = step rate).", value=steps
        )


class StreamCollector:
    """Open events streams and live feeds of this API process, read at scrape time."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self):
        state = self.app.state
        yield GaugeMetricFamily("muonforge_event_streams", "Open events streams (SSE clients).",
                                value=getattr(state, "open_streams", 0))  # fmt: skip
        reader = getattr(state, "live_reader", None)
        yield GaugeMetricFamily("muonforge_live_feeds", "Jobs whose live stream this process reads.",
                                value=len(reader.feeds) if reader else 0)  # fmt: skip


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
    requests = Counter(
        "muonforge_http_requests", "HTTP requests.", ["method", "route", "status"], registry=registry
    )  # fmt: skip
    latency = Histogram("muonforge_http_request_seconds", "HTTP request latency.", ["route"], registry=registry)
    registry.register(JobCollector(settings))
    registry.register(StreamCollector(app))

    app.add_middleware(RequestMetrics, requests=requests, latency=latency)

    @app.get("/metrics", tags=["health"], include_in_schema=True)
    def metrics() -> Response:
        """Prometheus exposition."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def readiness(settings: Settings) -> dict[str, str]:
    checks = {}
    try:
        with session_factory(settings.sqlalchemy_url)() as session:
            session.execute(text("SELECT 1"))
        checks["database"] = "ok"
    except Exception as exc:  # the message says which part is down
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        with Connection(settings.broker_url, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    return checks
