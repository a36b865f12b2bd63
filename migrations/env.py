"""Alembic environment: the URL from app.settings (or the caller's ``sqlalchemy.url``)."""

from alembic import context

from app.db import models  # noqa: F401  (registers the tables)
from app.db.base import Base
from app.db.session import make_engine
from app.settings import get_settings

config = context.config
url = config.get_main_option("sqlalchemy.url") or get_settings().sqlalchemy_url


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    engine = make_engine(url)
    with engine.connect() as connection:
        # render_as_batch: SQLite alters tables by copying them.
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
