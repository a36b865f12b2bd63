"""The artifact store: one interface, a local-directory backend and an S3-compatible one.

``store_from(settings)`` picks the backend: S3 for MUONFORGE_ARTIFACT_URL=s3://bucket/prefix,
otherwise files under MUONFORGE_ARTIFACT_DIR. A domain part of ``app``: the API and a worker's
service side use it; the training engine (worker.engine) never does.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

from app.storage.base import (
    STAGING,
    ArtifactStore,
    IntegrityError,
    ObjectInfo,
    ObjectNotFound,
    Staged,
    StagingWriter,
    StoreError,
    StoreUnavailable,
    delete_all,
    sweep_staging,
)
from app.storage.cache import ArtifactCache, cache_from
from app.storage.local import LocalStore

if TYPE_CHECKING:
    from app.settings import Settings

__all__ = [
    "STAGING",
    "ArtifactCache",
    "ArtifactStore",
    "IntegrityError",
    "LocalStore",
    "ObjectInfo",
    "ObjectNotFound",
    "Staged",
    "StagingWriter",
    "StoreError",
    "StoreUnavailable",
    "cache_from",
    "delete_all",
    "store_from",
    "sweep_staging",
]


def store_from(settings: Settings) -> ArtifactStore:
    """The store the settings name: S3 for an artifact URL, else the artifact directory."""
    if settings.artifact_url:
        return bucket(settings.artifact_url)
    return LocalStore(settings.artifact_dir)


@lru_cache(maxsize=None)  # noqa: UP033 - functools.cache: this package's cache module holds the name
def bucket(url: str) -> ArtifactStore:
    """The S3 store of ``url``, one per process (its client keeps its connections), configured
    from the environment when first asked for."""
    from app.storage.s3 import S3Store  # obstore loads only where a bucket is configured

    return S3Store.from_url(url)
