"""A job that starts from a model (``model.hf.model_id``): its spec filled in at intake.

The submission names the model, an upload (``mdl_…``) or a staged one (``staged:<directory>``,
app.services.staged_models), and its tokenizer (``data.tokenizer: {type: model}``); the intake
writes the model's config into ``model.hf.config`` (normalized, without its vocab_size) and its
vocab_size into ``data.tokenizer.vocab_size``, and validates the spec again, so its sizes,
parameters and memory are the model's. Each refusal is a 422 naming the field to change.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from sqlalchemy.orm import Session

from app.db.models import UploadedModel
from app.errors import ValidationFailed
from app.repositories.models import ModelRepository
from app.services.auth import TenantRef
from app.services.staged_models import StagedModel, StagedModelMissing, is_staged, staged_model
from app.settings import Settings
from contract import hf
from contract.spec import JobSpec, ModelTokenizerSpec, error_path

TOKENIZER = "tokenizer.json"  # the tokenizers library's file, what data.tokenizer {type: model} reads
FILLED = ("n_layer", "n_head", "d_model", "n_experts", "top_k")  # model fields the config gives


def from_uploaded_model(session: Session, tenant: TenantRef, spec: JobSpec, settings: Settings) -> JobSpec:
    """``spec`` with the model's config and vocabulary filled in (as it is without
    ``model.hf.model_id``).

    An upload must be the tenant's (another tenant's answers as a missing one), a staged model one
    this API host's MUONFORGE_MODEL_DIR holds and takes; either must hold a tokenizer.json, and
    ``model.seq_len`` must be within its positions. A config or vocab_size the submission gives
    must be the model's (a stored spec submitted again holds both).
    """
    given = spec.model.hf
    if given is None or given.model_id is None:
        return spec
    model = named_model(session, tenant, given.model_id, settings)
    if TOKENIZER not in model.files:
        remedy = "the operators stage it" if isinstance(model, StagedModel) else "upload the model"
        raise ValidationFailed(
            f"model {model.id} has no {TOKENIZER}: tokenizer {{type: model}} reads it (a fast tokenizer's "
            f"save_pretrained writes it); {remedy} with its tokenizer",
            param="data.tokenizer",
        )
    try:
        config = hf.from_upload(model.config)
    except ValueError as exc:  # checked when uploaded or staged: a config taken then and refused now
        raise ValidationFailed(f"model {model.id}'s config: {exc}", param="model.hf.model_id") from None
    field, seq_len = hf.positions(config), spec.model.seq_len
    positions = config.setdefault(field, seq_len)
    if positions < seq_len:
        raise ValidationFailed(
            f"model.seq_len ({seq_len}) exceeds model {model.id}'s {field} ({positions})", param="model.seq_len"
        )
    if given.config is not None and given.config != config:
        raise ValidationFailed(
            f"model.hf.config is model {model.id}'s own config.json: leave it out with model.hf.model_id",
            param="model.hf.config",
        )
    vocab = int(model.config["vocab_size"])
    tokenizer = spec.data.tokenizer
    if isinstance(tokenizer, ModelTokenizerSpec) and tokenizer.vocab_size not in (None, vocab):
        raise ValidationFailed(
            f"data.tokenizer.vocab_size is model {model.id}'s ({vocab:,}): leave it out",
            param="data.tokenizer.vocab_size",
        )
    doc: dict[str, Any] = spec.model_dump()
    doc["model"] = {k: v for k, v in doc["model"].items() if k not in FILLED}
    doc["model"]["hf"]["config"] = config
    doc["data"]["tokenizer"]["vocab_size"] = vocab
    try:
        return JobSpec.model_validate(doc)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = str(error["msg"]).removeprefix("Value error, ")
        raise ValidationFailed(f"model {model.id}: {message}", param=error_path(error["loc"]) or None) from None


def named_model(session: Session, tenant: TenantRef, model_id: str, settings: Settings) -> UploadedModel | StagedModel:
    """The upload or the staged model that ``model.hf.model_id`` names; a 422 at that field where
    there is none (for a staged directory refused, the message says so)."""
    if is_staged(model_id):
        try:
            return staged_model(settings, model_id)
        except StagedModelMissing as exc:
            raise ValidationFailed(str(exc), param="model.hf.model_id") from None
    model = ModelRepository(session).get(model_id, tenant.id)
    if model is None:
        raise no_model(model_id)
    return model


def no_model(model_id: str) -> ValidationFailed:
    return ValidationFailed(f"no model {model_id!r} for this tenant", param="model.hf.model_id")


def uploaded_model_id(spec: dict[str, Any]) -> str | None:
    """The uploaded model a stored spec starts from (None: a config, or a staged model)."""
    model_id = ((spec.get("model") or {}).get("hf") or {}).get("model_id")
    return None if model_id is None or is_staged(model_id) else model_id
