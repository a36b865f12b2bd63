"""Warm start (``init_from``): the checkpoint a new job starts from, resolved and checked at intake.

A job that cannot load it is refused with the field to change instead of failing later.
"""

from __future__ import annotations

import json
from typing import Any

from sqlalchemy.orm import Session

from app.db.models import Job
from app.errors import ValidationFailed
from app.repositories.checkpoints import CheckpointRepository
from app.repositories.jobs import JobRepository
from app.repositories.tenants import DatasetRepository
from app.services.auth import TenantRef
from contract.spec import DataSpec, InitFromSpec, JobSpec, ModelSpec
from worker.engine.facts import vocabulary

MODEL_FIELDS = tuple(ModelSpec.model_fields)  # compared in the order people write them


def resolve_init_from(session: Session, tenant: TenantRef, spec: JobSpec, vocab: int) -> InitFromSpec | None:
    """The spec's ``init_from`` with its step resolved, once every check of the warm start holds (None without one).

    The parent must be the tenant's own job (another tenant's answers as a missing one), have a
    checkpoint at ``init_from.step`` (omitted: its latest), and train the same model on a
    vocabulary of the same size; loading its optimizer state needs the same optimizer.
    ``vocab``: the new job's vocabulary size.
    """
    init = spec.init_from
    if init is None:
        return None
    parent = JobRepository(session).get(init.job_id, tenant.id)
    if parent is None:
        raise ValidationFailed(f"no job {init.job_id!r} for this tenant", param="init_from.job_id")
    steps = [c.step for c in CheckpointRepository(session).checkpoints(parent.id)]
    step = checkpoint_step(parent.id, steps, init.step)
    if difference := first_difference(spec.model.model_dump(), parent.spec["model"]):
        name, ours, theirs = difference
        raise ValidationFailed(
            f"model.{name} is {json.dumps(ours)} here and {json.dumps(theirs)} in job {parent.id}: a warm start "
            "loads its weights into the same model",
            param=f"model.{name}",
        )
    theirs = parent_vocabulary(session, parent)
    if theirs is not None and theirs != vocab:
        raise ValidationFailed(
            f"this job's data has a vocabulary of {vocab:,} tokens and job {parent.id}'s had {theirs:,}: a warm "
            "start needs the same tokenizer on a vocabulary of the same size",
            param="data.tokenizer",
        )
    ours, theirs_name = spec.optimizer.name, parent.spec["optimizer"]["name"]
    if init.optimizer_state and ours != theirs_name:
        raise ValidationFailed(
            f"job {parent.id} trained with optimizer {theirs_name!r}, this job with {ours!r}: its optimizer state "
            f"loads into the same optimizer (set optimizer.name to {theirs_name!r}, or optimizer_state to false)",
            param="init_from.optimizer_state",
        )
    return init.model_copy(update={"step": step})


def checkpoint_step(job_id: str, steps: list[int], wanted: int | None) -> int:
    """``wanted``, if the job has a checkpoint there; its latest if None. ``steps``: its checkpoints'."""
    if not steps:
        raise ValidationFailed(f"job {job_id} has no checkpoint yet", param="init_from.step")
    if wanted is None:
        return max(steps)
    if wanted not in steps:
        listed = ", ".join(str(s) for s in sorted(steps))
        raise ValidationFailed(
            f"job {job_id} has no checkpoint at step {wanted}; it has checkpoints at steps {listed}",
            param="init_from.step",
        )
    return wanted


def first_difference(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, Any, Any] | None:
    """The first model field (in ModelSpec's order) whose values differ: (name, ours, theirs)."""
    for name in MODEL_FIELDS:
        if ours.get(name) != theirs.get(name):
            return name, ours.get(name), theirs.get(name)
    return None


def parent_vocabulary(session: Session, parent: Job) -> int | None:
    """The vocabulary size the parent's model was built for; None where it cannot be known any
    more (a char tokenizer on a dataset deleted since: the worker's strict load decides)."""
    data = DataSpec.model_validate(parent.spec["data"])
    if data.tokenizer != "char" or data.dataset_id is None:
        return vocabulary(data)
    dataset = DatasetRepository(session).get_any(data.dataset_id)
    return vocabulary(data, dataset.char_vocab) if dataset else None
