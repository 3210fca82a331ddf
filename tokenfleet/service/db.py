"""Engines, sessions and Alembic migrations, callable from code and the CLI.

Alembic is driven programmatically with absolute paths, so ``tokenfleet db
upgrade`` works from any working directory, from a source checkout and from
an installed wheel alike: the ``migrations`` package ships in the wheel
(:func:`migrations_dir`).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import Session, sessionmaker

from tokenfleet.errors import ConfigError, TokenFleetError
from tokenfleet.service.config import redact_url

#: the checkout's alembic.ini (logging for the `alembic` command); optional
ALEMBIC_INI = Path(__file__).resolve().parents[2] / "alembic.ini"


def migrations_dir() -> Path:
    """The Alembic script directory: the ``migrations`` package next to ``tokenfleet``
    (a checkout or an editable install), else the installed one (a wheel)."""
    beside = Path(__file__).resolve().parents[2] / "migrations"
    if (beside / "env.py").is_file():
        return beside
    spec = importlib.util.find_spec("migrations")
    if spec is not None and spec.origin is not None:
        installed = Path(spec.origin).parent
        if (installed / "env.py").is_file():
            return installed
    raise ConfigError(
        "the TokenFleet migrations are missing: neither a source checkout nor the installed "
        "'migrations' package has env.py; reinstall TokenFleet (pip install tokenfleet)"
    )


def normalize_url(url: str) -> str:
    """Use the psycopg 3 driver for plain ``postgresql://`` URLs (psycopg2 is not installed)."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def make_engine(url: str, *, pool_size: int = 5, echo: bool = False) -> Engine:
    """An engine that survives database restarts (pre-ping drops dead pooled connections)."""
    url = normalize_url(url)
    kwargs: dict[str, object] = {"echo": echo, "pool_pre_ping": True, "future": True}
    if url.startswith("postgresql"):
        kwargs.update(
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_recycle=1800,
            connect_args={"connect_timeout": 3, "application_name": "tokenfleet"},
        )
    return sa.create_engine(url, **kwargs)


def session_factory(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextlib.contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: commit on success, roll back on error."""
    with session_factory(engine)() as session, session.begin():
        yield session


# ---- migrations -------------------------------------------------------------
def alembic_config(database_url: str) -> object:
    """An ``alembic.config.Config`` bound to ``database_url`` with absolute script paths."""
    from alembic.config import Config

    cfg = Config(str(ALEMBIC_INI)) if ALEMBIC_INI.is_file() else Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' is alembic's interpolation character; URLs may contain it (escaped passwords)
    cfg.set_main_option("sqlalchemy.url", normalize_url(database_url).replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg


def _run(action: str, database_url: str, revision: str) -> None:
    from alembic import command

    cfg = alembic_config(database_url)
    try:
        getattr(command, action)(cfg, revision)
    except sa.exc.OperationalError as exc:
        raise TokenFleetError(
            f"cannot reach the database at {redact_url(database_url)}: "
            f"{str(exc.orig).strip().splitlines()[0]}; "
            "start it (`tokenfleet services up`) or fix --database-url / TOKENFLEET_DATABASE_URL"
        ) from None


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to ``revision`` (idempotent)."""
    _run("upgrade", database_url, revision)


def downgrade(database_url: str, revision: str) -> None:
    _run("downgrade", database_url, revision)


def current_revision(database_url: str) -> str | None:
    """The revision stamped in the database, or None for an unmigrated one."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()  # type: ignore[arg-type]


def schema_drift(database_url: str) -> list[object]:
    """Differences between the ORM models and the migrated database (empty = in sync)."""
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    from tokenfleet.service.ledger import Base

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()
