"""The FastAPI application: routers, error handlers, metrics, and the parts that live with the process.

Those parts are the job intake, the live reader, the reaper and webhook delivery.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI

from app.api.limits import Limits
from app.api.observability import install_metrics
from app.api.routes import checkpoints, datasets, health, jobs, models, session, sweeps, uploads, webhooks
from app.errors import install_error_handlers
from app.messaging.live_bus import LiveReader
from app.messaging.shared_limits import SharedLimits
from app.services.auth import KeyCache
from app.services.intake import Intake
from app.services.quotas import TenantLimits, TenantThreads
from app.services.reaper import run_reaper
from app.services.webhook_delivery import run_deliveries
from app.settings import Settings, get_settings
from app.web.pages import install_web


def create_app(settings: Settings | None = None, reaper: bool = True) -> FastAPI:
    settings = settings or get_settings()
    app = FastAPI(
        title="muonforge",
        version="0.1.0",
        summary="Training as a service with Muon and MuonClip.",
        description="Submit training job specs, watch them run, cancel them. All /v1 routes need "
        "`Authorization: Bearer <API key>`; errors share one shape: "
        '`{"error": {"code", "message", "param"}}`.',
        lifespan=lambda app: _lifespan(app, reaper),
    )
    app.state.settings = settings
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    app.state.intake = Intake(settings)
    app.state.live_reader = None
    app.state.tenant_limits = TenantLimits(settings, SharedLimits(settings.redis_url) if settings.redis_url else None)
    app.state.tenant_threads = TenantThreads(settings.tenant_threads)
    for module in (jobs, checkpoints, datasets, models, uploads, sweeps, webhooks, session, health):
        app.include_router(module.router)
    install_web(app)
    install_error_handlers(app)
    app.add_middleware(
        Limits,
        settings=settings,
        key_cache=app.state.key_cache,
        tenant_limits=app.state.tenant_limits,
    )
    install_metrics(app, settings)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI, reaper: bool):
    state, stop = app.state, threading.Event()
    threads = [
        threading.Thread(target=run, args=(state.settings, stop), name=name, daemon=True)
        for run, name in ((run_reaper, "reaper"), (run_deliveries, "webhooks"))
    ]
    if reaper:  # the background work: leases, dataset files, webhook deliveries
        for thread in threads:
            thread.start()
    state.intake.start()
    state.live_reader = LiveReader(state.settings.redis_url) if state.settings.redis_url else None
    renewals = asyncio.create_task(state.tenant_limits.renew_leases())
    # Everything built so far lives as long as the process: keep it out of the cyclic collector's
    # full passes, and make those rarer (every few seconds under load, each a pause of 20-100 ms
    # for every request in flight).
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 10, 100)
    yield
    renewals.cancel()
    state.intake.stop()
    await state.tenant_limits.close()
    if state.live_reader is not None:
        await state.live_reader.close()
    stop.set()
    if reaper:
        for thread in threads:
            thread.join(timeout=5)
