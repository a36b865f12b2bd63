"""The FastAPI application: routers, the one error handler, health, readiness and metrics."""

from __future__ import annotations

import gc
import logging
import threading
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.errors import DomainError
from app.live import LiveReader
from app.observability import install_metrics, readiness
from app.queue import TaskPublisher
from app.routes import checkpoints, datasets, jobs
from app.services.admission import Admission
from app.services.auth import KeyCache
from app.services.job_writer import JobWriter
from app.services.reaper import run_reaper
from app.settings import Settings, get_settings

log = logging.getLogger("muonforge.api")
HTTP_CODES = {401: "unauthorized", 404: "not_found", 405: "not_found", 409: "conflict", 413: "payload_too_large"}


def create_app(settings: Settings | None = None, reaper: bool = True) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = threading.Event()
        thread = None
        if reaper:
            thread = threading.Thread(target=run_reaper, args=(settings, stop), name="reaper", daemon=True)
            thread.start()
        app.state.publisher.start()
        app.state.writer.start()
        app.state.live_reader = LiveReader(settings.redis_url) if settings.redis_url else None
        # Everything built so far lives as long as the process: keep it out of the cyclic
        # collector's full passes, and make those rarer (every few seconds under load, each a
        # pause of 20-100 ms for every request in flight).
        gc.collect()
        gc.freeze()
        gc.set_threshold(700, 10, 100)
        yield
        app.state.writer.stop()
        app.state.publisher.stop()
        if app.state.live_reader is not None:
            await app.state.live_reader.close()
        stop.set()
        if thread:
            thread.join(timeout=5)

    app = FastAPI(
        title="muonforge",
        version="0.1.0",
        summary="Training as a service with Muon and MuonClip.",
        description="Submit training job specs, watch them run, cancel them. All /v1 routes need "
        "`Authorization: Bearer <API key>`; errors share one shape: "
        '`{"error": {"code", "message", "param"}}`.',
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.key_cache = KeyCache(settings.auth_cache_seconds)
    app.state.admission = Admission()
    app.state.publisher = TaskPublisher(settings)
    app.state.writer = JobWriter(settings, app.state.publisher)
    app.state.open_streams = 0
    app.include_router(jobs.router)
    app.include_router(checkpoints.router)
    app.include_router(datasets.router)
    install_metrics(app, settings)

    @app.exception_handler(DomainError)
    async def domain_error(_: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if loc and loc[0] in ("body", "query", "path", "header"):
            loc = loc[1:]
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        body = {"error": {"code": "validation_error", "message": message, "param": ".".join(loc) or None}}
        return JSONResponse(body, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = HTTP_CODES.get(exc.status_code, "internal")
        body = {"error": {"code": code, "message": str(exc.detail), "param": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        body = {"error": {"code": "internal", "message": "internal error", "param": None}}
        return JSONResponse(body, status_code=500)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    def readyz() -> JSONResponse:
        """Readiness: the database and the broker are reachable."""
        checks = readiness(settings)
        ok = all(v == "ok" for v in checks.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503)

    return app
