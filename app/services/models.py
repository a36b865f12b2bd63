"""Models: the tenant's uploads, checked, stored, listed, shown and deleted; the staged ones beside them.

The operators' staged models (app.services.staged_models) are listed and shown with the uploads. An
upload is a tar (optionally gzipped) or zip archive of a model directory: ``config.json``,
safetensors weights (``model.safetensors``, or shards named by ``model.safetensors.index.json``)
and optional tokenizer and generation files. It is streamed to disk within
``MUONFORGE_MAX_MODEL_BYTES``, its members are checked one by one as they are read (a safe name, a
regular file, an allowed name, their count and declared sizes within the limits) and copied into
a directory of their own, never by the archive library's own extraction; then the config must name
a decoder family of contract.hf without remote code, and the weights' safetensors headers (read
alone, never the tensors) must hold exactly the tensors, with their shapes, of the model the
config builds (transformers on the meta device: no memory, no weights). Anything refused answers
422 and leaves nothing on disk.

The row and the directory are stored together as a dataset's row and file are
(app.services.datasets): the directory is written as ``<id>.part``, the row inserted under the
tenant's lock (the storage quota, shared with datasets, exact there), then the directory renamed
to ``<id>`` and removed again if the transaction does not commit. With a bucket
(MUONFORGE_ARTIFACT_URL) each file goes up to ``models/<tenant>/<id>/<file>`` before the lock is
taken (staged, then committed: no row names them until the row commits), the row records each
file's size and sha256 (``objects``, what workers verify their copies against), and the API host
keeps no copy. ``sweep_orphans`` removes what a process that died midway left behind, on disk and
in the bucket. An upload that an unfinished job starts from is not deleted
(409 ``model_in_use``); a staged model never is through the API (409 ``conflict``).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from sqlalchemy.orm import Session

from app.db.base import new_id
from app.db.models import UploadedModel
from app.db.session import on_commit, on_rollback
from app.errors import Conflict, ModelInUse, NotFound, ValidationFailed
from app.repositories.models import ModelRepository
from app.repositories.tenants import TenantRepository
from app.schemas import api as schemas
from app.services.auth import TenantRef
from app.services.datasets import ORPHAN_AGE_SECONDS, mtime, over_quota, store_reachable
from app.services.model_archive import CONFIG, TOKENIZER_FILES, extract, fsync_file, gunzipped, write_archive
from app.services.model_weights import NOT_SHAPES, check_config, check_weights
from app.services.staged_models import StagedModel, StagedModelMissing, is_staged, staged_model, staged_models
from app.settings import Settings
from app.storage import ArtifactStore, LocalStore, delete_all, store_from
from app.storage.local import sync_directory
from contract.hf import Shape, normalized

log = logging.getLogger("muonforge.models")

MODELS = "models"  # under MUONFORGE_ARTIFACT_DIR: models/<tenant id>/<model id>/


def upload_model(session: Session, tenant: TenantRef, stream: BinaryIO, name: str, settings: Settings) -> UploadedModel:
    """Store an uploaded archive as a model of the tenant: written, checked, extracted, recorded.

    413 above ``MUONFORGE_MAX_MODEL_BYTES`` (``payload_too_large``) or above what the tenant's
    storage quota leaves (``storage_quota_exceeded``, counted on the extracted files); 422 for an
    archive, a config or weights refused (the message says which member and why, ``param`` is
    ``file``).
    """
    tenants = TenantRepository(session)
    quota = settings.tenant_storage_bytes
    used = tenants.stored_bytes(tenant.id)
    session.commit()  # no connection is held while the archive is read
    model_id = new_id("mdl")
    parent = settings.artifact_dir / MODELS / tenant.id
    archive, staging, target = parent / f"{model_id}.upload", parent / f"{model_id}.part", parent / model_id
    unpacked = parent / f"{model_id}.tar"  # a gzipped tar, decompressed (within its bound) before it is read
    parent.mkdir(parents=True, exist_ok=True)
    try:
        size, sha256 = write_archive(stream, archive, settings.max_model_bytes)
        if size == 0:
            raise ValidationFailed("the file is empty", param="file")
        staging.mkdir()
        readable = gunzipped(archive, unpacked, settings)
        objects = extract(readable, staging, settings, room=max(quota - used, 0), quota=quota, used=used)
        files = list(objects)
        archive.unlink()
        unpacked.unlink(missing_ok=True)
        config = check_config(staging / CONFIG)
        parameters = check_weights(staging, files, config)
        stored = sum(size for size, _ in objects.values())
        key = str(PurePosixPath(MODELS, tenant.id, model_id))
        store = store_from(settings)
        remote = not isinstance(store, LocalStore)
        if remote:  # the files go up before the lock is taken; until the row commits, nothing names them
            with store_reachable():
                put_files(store, staging, key, files)
        else:
            for f in files:
                fsync_file(staging / f)
            sync_directory(staging)
        tenants.lock([tenant.id])  # exact under concurrent uploads (datasets' too): held until the commit
        used = tenants.stored_bytes(tenant.id)
        if used + stored > quota:
            raise over_quota(quota, used)
        model = ModelRepository(session).add(
            UploadedModel(
                id=model_id,
                tenant_id=tenant.id,
                name=name[:200],
                model_type=config["model_type"],
                parameters=parameters,
                bytes=stored,
                sha256=sha256,
                config=config,
                files=sorted(files),
                objects=objects,
                path=key,
            )
        )
        if remote:
            on_rollback(session, partial(delete_all, store, model_keys(key, files)))
            shutil.rmtree(staging)  # the bucket holds them: no host keeps a copy
        else:
            on_rollback(session, partial(shutil.rmtree, target, ignore_errors=True))
            os.utime(staging)  # its age counts from here: the sweep leaves it alone while this commits
            staging.replace(target)
            sync_directory(parent)
    except BaseException:
        archive.unlink(missing_ok=True)
        unpacked.unlink(missing_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return model


# -- reads and deletes ----------------------------------------------------------------------------
AnyModel = UploadedModel | StagedModel
SHOWN_JOBS = 3  # jobs named in a refused delete's message


def get_model(session: Session, tenant: TenantRef, model_id: str) -> UploadedModel:
    """The tenant's upload of that id; 404 (``model_id``) for another tenant's or an unknown one."""
    model = ModelRepository(session).get(model_id, tenant.id)
    if model is None:
        raise NotFound(f"no model {model_id!r}", param="model_id")
    return model


def find_model(session: Session, tenant: TenantRef, model_id: str, settings: Settings) -> AnyModel:
    """The tenant's upload, or the staged model, of that id; 404 (``model_id``) where there is none
    (for a staged directory refused, the message says so)."""
    if not is_staged(model_id):
        return get_model(session, tenant, model_id)
    try:
        return staged_model(settings, model_id)
    except StagedModelMissing as exc:
        raise NotFound(str(exc), param="model_id") from None


def view(model: AnyModel) -> schemas.Model:
    """The Model a list shows."""
    return schemas.Model(**_fields(model))


def detail(model: AnyModel) -> schemas.ModelDetail:
    """The Model with its sizes and config.json."""
    s = Shape.of(normalized({k: v for k, v in model.config.items() if k not in NOT_SHAPES}))
    sizes = schemas.ModelSizes(
        layers=s.layers,
        heads=s.heads,
        kv_heads=s.kv_heads,
        head_dim=s.head_dim,
        width=s.width,
        ffn=s.ffn,
        positions=s.positions,
        vocab=model.config["vocab_size"],
        tied_embeddings=s.tied,
    )
    return schemas.ModelDetail(**_fields(model), sizes=sizes, config=model.config)


def _fields(model: AnyModel) -> dict[str, Any]:
    return {
        "id": model.id,
        "source": "staged" if isinstance(model, StagedModel) else "upload",
        "name": model.name,
        "model_type": model.model_type,
        "parameters": model.parameters,
        "bytes": model.bytes,
        "sha256": model.sha256,
        "files": list(model.files),
        "tokenizer_files": [f for f in model.files if f in TOKENIZER_FILES],
        "created_at": model.created_at,
    }


def show_model(session: Session, tenant: TenantRef, model_id: str, settings: Settings) -> schemas.ModelDetail:
    return detail(find_model(session, tenant, model_id, settings))


def list_models(
    session: Session, tenant: TenantRef, limit: int, after: str | None, settings: Settings
) -> schemas.ModelList:
    """The tenant's uploads, newest first, then the staged models by name, a page at a time:
    ``after`` is the previous page's last id (an upload's: the uploads after it, then every staged
    model; a staged model's: the staged models after it by name)."""
    staged = staged_models(settings)
    models: list[AnyModel]
    if after is not None and is_staged(after):
        models = [m for m in staged if m.id > after]
    else:
        models = [*ModelRepository(session).page(tenant.id, limit, after), *staged]  # up to limit + 1 uploads
    page = models[:limit]
    return schemas.ModelList(
        data=[view(m) for m in page],
        has_more=len(models) > limit,
        next_after=page[-1].id if len(models) > limit else None,
    )


def delete_model(session: Session, tenant: TenantRef, model_id: str, settings: Settings) -> None:
    """Delete the upload's row, then (once committed) its directory.

    A staged model is refused (409 ``conflict``): it is the operators', read-only, shared by every
    tenant; no key deletes it (a 403 would say another key could). An upload is refused (409
    ``model_in_use``, naming the jobs) while an unfinished job of the tenant (queued, running,
    paused at a rung) starts from it. The tenant's row is locked first, as a job's insert locks it,
    so that the jobs counted are all those committed.
    """
    if is_staged(model_id):
        model = find_model(session, tenant, model_id, settings)
        raise Conflict(
            f"model {model.id!r} is staged by the service's operators (MUONFORGE_MODEL_DIR), read-only and shared by "
            "every tenant: no API key can delete it; the operators remove its directory",
            param="model_id",
        )
    TenantRepository(session).lock([tenant.id])
    model = get_model(session, tenant, model_id)
    repo = ModelRepository(session)
    if using := repo.unfinished_jobs_using(tenant.id, model.id):
        named = ", ".join(f"{job_id} ({status})" for job_id, status in using[:SHOWN_JOBS])
        more = f" and {len(using) - SHOWN_JOBS} more" if len(using) > SHOWN_JOBS else ""
        jobs, them = ("job", "it") if len(using) == 1 else (f"{len(using)} jobs:", "them")
        raise ModelInUse(
            f"model {model.id!r} is used by {jobs} {named}{more}, not finished yet: cancel {them} or let {them} "
            "finish, then delete the model",
            param="model_id",
        )
    repo.delete(model)
    store = store_from(settings)
    if isinstance(store, LocalStore):
        on_commit(session, partial(shutil.rmtree, settings.artifact_dir / model.path, ignore_errors=True))
    else:
        on_commit(session, partial(delete_all, store, model_keys(model.path, model.files)))


def put_files(store: ArtifactStore, directory: Path, key: str, files: list[str]) -> None:
    """Write each of the directory's ``files`` to the store under ``key/<file>``, staged then committed."""
    for f, final in zip(files, model_keys(key, files), strict=True):
        staged = store.stage_file(directory / f)
        store.commit(staged.key, final)


def model_keys(key: str, files: list[str]) -> list[str]:
    """The store keys of a model's files."""
    return [f"{key}/{f}" for f in files]


def sweep_orphans(session: Session, settings: Settings, now: float | None = None) -> int:
    """Remove what no row names under the models directory, once older than ORPHAN_AGE_SECONDS;
    returns how many entries went: archives and directories of uploads cut off (``.upload``,
    ``.tar``, ``.part``), and directories whose row was never committed or whose delete committed before
    its directory went; with a bucket, its models' objects that no row names too."""
    cutoff = (time.time() if now is None else now) - ORPHAN_AGE_SECONDS
    removed = sweep_bucket(session, settings, cutoff)
    root = settings.artifact_dir / MODELS
    if not root.is_dir():
        return removed
    repo = ModelRepository(session)
    for directory in (d for d in root.iterdir() if d.is_dir()):
        old = [e for e in directory.iterdir() if mtime(e) < cutoff]
        known = repo.existing_ids({e.name for e in old if "." not in e.name})
        for entry in old:
            if entry.name in known:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed += 1
    if removed:
        log.info("removed %d model upload(s) that no model names", removed)
    return removed


def sweep_bucket(session: Session, settings: Settings, cutoff: float) -> int:
    """With a bucket, delete its model objects (``models/<tenant>/<model id>/<file>``) older than
    ``cutoff`` whose model has no row; how many."""
    store = store_from(settings)
    if isinstance(store, LocalStore):
        return 0
    old = [o for o in store.list(MODELS) if o.modified.timestamp() < cutoff and o.key.count("/") == 3]
    known = ModelRepository(session).existing_ids({o.key.split("/")[2] for o in old})
    orphans = [o.key for o in old if o.key.split("/")[2] not in known]
    for key in orphans:
        store.delete(key)
    return len(orphans)
