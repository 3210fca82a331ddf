"""Alembic environment for the TokenFleet ledger.

The URL is taken, in order, from: the Config's ``sqlalchemy.url`` (set by
``tokenfleet.service.db``), ``-x database_url=...``, ``TOKENFLEET_DATABASE_URL``
/ the config file, and finally the embedded PostgreSQL recorded in the data dir.
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from tokenfleet.service.db import make_engine, normalize_url
from tokenfleet.service.ledger import Base

config = context.config
target_metadata = Base.metadata

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _database_url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    x_url = context.get_x_argument(as_dictionary=True).get("database_url")
    if x_url:
        return normalize_url(x_url)
    from tokenfleet.service.config import load_config
    from tokenfleet.service.endpoints import discover

    url = discover(load_config(), require=("database",)).database_url
    assert url is not None
    return url


def run_migrations_offline() -> None:
    context.configure(
        url=_database_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                compare_type=True,
                render_as_batch=connection.dialect.name == "sqlite",
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
