"""Schema migrations: `alembic upgrade head` against the settings' database."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]  # the repository: alembic.ini and migrations/


def alembic_config(url: str) -> Config:
    config = Config(str(ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(settings: Settings, revision: str = "head") -> None:
    if settings.embedded:
        Path(settings.sqlalchemy_url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(settings.sqlalchemy_url), revision)


def downgrade(settings: Settings, revision: str = "base") -> None:
    command.downgrade(alembic_config(settings.sqlalchemy_url), revision)
