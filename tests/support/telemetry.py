"""A job's run recorded as a worker records it, without training: for the tests of what is stored,
shown and streamed (history, pages, zoom) where the training itself is not what is tested."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from app.db.session import transaction
from app.messaging.live_bus import live_bus
from app.services import lifecycle
from app.services.auth import authenticate
from app.services.intake import insert_submissions
from app.services.submission import prepare_submission
from app.settings import Settings
from contract import metrics
from contract.spec import JobSpec
from worker.engine.telemetry import Report
from worker.sink import JobSink


def report(step: int, values: dict[str, float]) -> Report:
    """The trainer's report of a training step's values."""
    return Report(step, values, completed=step + 1, summary={k: v for k, v in values.items() if k in metrics.SUMMARY})


def stored_job(settings: Settings, key: str, spec: dict[str, Any]) -> str:
    """A job of the tenant of ``key``, stored as the API stores it, with no task sent to a worker."""
    with transaction(settings) as session:
        tenant = authenticate(session, f"Bearer {key}")
        new = prepare_submission(session, tenant, JobSpec.model_validate(spec), None, settings)
        ((job, _),) = insert_submissions(session, [new])
    return job.id


def plausible(spec: JobSpec) -> Callable[[int], dict[str, float]]:
    """Every series a real run of ``spec`` reports at a step, with made-up values: a loss that
    falls, val_loss at each eval and the last step, an attention logit that grows."""
    steps, every = spec.train.steps, spec.train.eval_every
    names = [n for n in metrics.GLOBAL if n != metrics.VAL_LOSS] + list(metrics.OPTIMIZER[spec.optimizer.name])
    if spec.model.arch != "mlp":
        names += [metrics.ATTN_MAX_LOGIT] + [metrics.layer_max_logit(i) for i in range(spec.model.n_layer)]

    def values(step: int) -> dict[str, float]:
        loss = 1.0 + 3.0 * math.exp(-step / (steps / 4)) + 0.05 * math.sin(step)
        decay = 0.5 * (1 + math.cos(math.pi * step / steps)) if spec.train.lr_schedule == "cosine" else 1.0
        out = {name: 1.0 + 0.1 * math.sin(step / 10) for name in names} | {metrics.LOSS: loss}
        out[metrics.LR] = spec.optimizer.lr * decay
        out[metrics.GRAD_NORM] = 2.0 / (1 + step / 100)
        out[metrics.TOKENS_PER_S] = 10_000.0 + 500 * math.sin(step / 25)
        out[metrics.ATTN_MAX_LOGIT] = 5.0 + step / steps
        out[metrics.ELAPSED_S] = step * 0.01
        if step % every == 0 or step == steps:
            out[metrics.VAL_LOSS] = loss + 0.1
        if step == steps:  # the last report: the final eval alone
            return {metrics.VAL_LOSS: out[metrics.VAL_LOSS]}
        return out

    return values


def synthetic_run(settings: Settings, key: str, spec: dict[str, Any]) -> str:
    """A job of ``spec`` that ran all its steps: claimed as a worker claims it, each step's
    ``plausible`` values reported through the worker's JobSink (to the database and the live bus),
    then finished succeeded. Returns its id."""
    job_id = stored_job(settings, key, spec)
    validated = JobSpec.model_validate(spec)
    bus = live_bus(settings)
    with transaction(settings) as session:
        claim = lifecycle.claim(session, bus, job_id, "synthetic:0:run", timedelta(minutes=10))
    assert claim is not None
    sink = JobSink(settings, job_id, claim.attempt, 0, {})
    values, steps, summary = plausible(validated), validated.train.steps, {}
    for step in range(steps + 1):
        reported = values(step)
        summary |= {k: v for k, v in reported.items() if k in metrics.SUMMARY}
        sink.metrics(Report(step, reported, completed=min(step + 1, steps), summary=dict(summary)))
    sink.close()
    with transaction(settings) as session:
        lifecycle.finish(session, bus, job_id, claim.attempt, "succeeded", steps, summary)
    return job_id
