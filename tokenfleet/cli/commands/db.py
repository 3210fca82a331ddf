"""``tokenfleet db``: migrate the ledger database and query it.

The database is ``--database-url``, else ``TOKENFLEET_DATABASE_URL`` / the
config file, else the embedded PostgreSQL that ``tokenfleet services up``
recorded in the data dir.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from tokenfleet.errors import ConfigError, TokenFleetError
from tokenfleet.service.config import add_config_arguments, config_from_args, redact_url


def _database_url(args: argparse.Namespace) -> str:
    if getattr(args, "database_url", None):
        return str(args.database_url)
    from tokenfleet.service.endpoints import discover

    url = discover(config_from_args(args), require=("database",)).database_url
    assert url is not None
    return url


def _parse_time(text: str | None, default: datetime) -> datetime:
    """ISO 8601, or a negative number of seconds relative to now (``-3600``)."""
    if text is None:
        return default
    try:
        offset = float(text)
    except ValueError:
        pass
    else:
        return datetime.now(UTC) + timedelta(seconds=offset)
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(
            f"bad time '{text}': use ISO 8601 (2025-01-01T00:00:00) or -SECONDS"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _friendly(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """An unreachable database is one line with the fix, not a traceback."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        import sqlalchemy as sa

        try:
            return func(args)
        except sa.exc.OperationalError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            raise TokenFleetError(
                f"database error: {first}; check that PostgreSQL is running "
                "(`tokenfleet services status`) and the URL is right"
            ) from None

    return wrapper


def _cmd_upgrade(args: argparse.Namespace) -> int:
    from tokenfleet.service import db

    url = _database_url(args)
    db.upgrade(url, args.revision)
    print(f"database {redact_url(url)} at revision {db.current_revision(url)}")
    return 0


def _cmd_downgrade(args: argparse.Namespace) -> int:
    from tokenfleet.service import db

    url = _database_url(args)
    db.downgrade(url, args.revision)
    print(f"database {redact_url(url)} at revision {db.current_revision(url)}")
    return 0


def _cmd_current(args: argparse.Namespace) -> int:
    from tokenfleet.service import db

    url = _database_url(args)
    current, head = db.current_revision(url), db.head_revision()
    print(f"current: {current or '(empty database)'}  head: {head}")
    if current != head:
        print("run `tokenfleet db upgrade` to migrate")
        return 1
    drift = db.schema_drift(url)
    if drift:
        print("schema differs from the models:")
        for diff in drift:
            print(f"  {diff}")
        return 1
    return 0


def _cmd_goodput(args: argparse.Namespace) -> int:
    from tokenfleet.service.db import make_engine
    from tokenfleet.service.queries import goodput

    now = datetime.now(UTC)
    until = _parse_time(args.until, now)
    since = _parse_time(args.since, until - timedelta(hours=1))
    engine = make_engine(_database_url(args))
    try:
        rows = goodput(engine, since=since, until=until, group_by=args.by)
    finally:
        engine.dispose()
    if args.json:
        print(json.dumps([r.__dict__ for r in rows], default=str, indent=2))
        return 0
    print(f"window {since.isoformat()} .. {until.isoformat()}  ({args.by})")
    print(
        f"{'key':<20} {'total':>8} {'completed':>10} {'attain':>7} "
        f"{'goodput_rps':>12} {'tok/s':>10}"
    )
    for r in rows:
        att = "-" if r.attainment is None else f"{r.attainment:.3f}"
        print(
            f"{str(r.key):<20} {r.total:>8} {r.completed:>10} {att:>7} "
            f"{r.goodput_rps:>12.3f} {r.goodput_tokens_per_s:>10.1f}"
        )
    return 0


def _cmd_create_key(args: argparse.Namespace) -> int:
    from tokenfleet.service.db import make_engine, session_scope
    from tokenfleet.service.ledger import Tenant
    from tokenfleet.service.queries import append_audit, create_api_key, create_tenant

    engine = make_engine(_database_url(args))
    try:
        with session_scope(engine) as session:
            if session.get(Tenant, args.tenant) is None:
                if not args.create_tenant:
                    raise ConfigError(
                        f"tenant '{args.tenant}' does not exist; add --create-tenant to create it"
                    )
                create_tenant(session, args.tenant, slo_class=args.slo_class)
                session.flush()
            key = create_api_key(session, args.tenant, name=args.name)
            append_audit(
                session, "cli", "api_key.create", {"tenant": args.tenant, "prefix": key[:10]}
            )
    finally:
        engine.dispose()
    print(key)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("db", help="migrate and query the ledger database")
    sub = parser.add_subparsers(dest="db_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        add_config_arguments(p)
        p.add_argument(
            "--database-url",
            metavar="URL",
            default=None,
            help="PostgreSQL URL (default: config / embedded server)",
        )

    p = sub.add_parser("upgrade", help="apply migrations (alembic upgrade)")
    common(p)
    p.add_argument("--revision", default="head", help="target revision (default: head)")
    p.set_defaults(func=_friendly(_cmd_upgrade))

    p = sub.add_parser("downgrade", help="revert migrations down to REVISION ('base' = empty)")
    common(p)
    p.add_argument("revision")
    p.set_defaults(func=_friendly(_cmd_downgrade))

    p = sub.add_parser("current", help="show the revision; exit 1 if not at head or drifted")
    common(p)
    p.set_defaults(func=_friendly(_cmd_current))

    p = sub.add_parser("goodput", help="goodput and SLO attainment over a window")
    common(p)
    p.add_argument("--by", choices=["tier", "tenant", "dc", "model", "all"], default="tier")
    p.add_argument("--since", default=None, help="ISO time or -SECONDS (default: until - 1h)")
    p.add_argument("--until", default=None, help="ISO time or -SECONDS (default: now)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_friendly(_cmd_goodput))

    p = sub.add_parser("create-key", help="create an API key for a tenant; prints it once")
    common(p)
    p.add_argument("--tenant", required=True)
    p.add_argument("--name", default=None, help="label shown in listings")
    p.add_argument("--create-tenant", action="store_true", help="create the tenant if missing")
    p.add_argument("--slo-class", default="standard", help="SLO class of a created tenant")
    p.set_defaults(func=_friendly(_cmd_create_key))
