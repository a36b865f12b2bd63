"""Celery tasks: thin, they take ids and call the attempt runner."""

from __future__ import annotations

import os
import socket

from worker.attempt import run_attempt
from worker.celery_app import celery, settings


@celery.task(name="muonforge.train_job", bind=True)
def train_job(self, job_id: str) -> str:
    owner = f"{socket.gethostname()}:{os.getpid()}:{self.request.id}"
    return run_attempt(settings, job_id, owner)
