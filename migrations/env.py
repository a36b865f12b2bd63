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
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as connection:
        if sqlite:
            # render_as_batch: SQLite alters a table by copying it and dropping the old one. With
            # foreign keys on, that drop would cascade to every row referencing the table (a
            # job's events and checkpoints). Off for the migration (it cannot change inside a
            # transaction), then every reference is checked before the work is committed.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            connection.commit()
        context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
            if sqlite and (broken := connection.exec_driver_sql("PRAGMA foreign_key_check").fetchall()):
                raise RuntimeError(f"the migration left rows whose foreign keys point nowhere: {broken[:5]}")
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
