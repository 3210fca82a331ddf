"""``tokenfleet tenants``: tenants, quotas and API keys; ``tokenfleet admin-user``: UI logins.

Stores are found like ``tokenfleet db``: ``--database-url`` / ``--redis-url``,
else the config, else the embedded servers of ``tokenfleet services up``.
Redis is needed so that a revoke or quota change reaches running API
processes within a second (it drops their cache entries); without it the
change still lands in PostgreSQL and is seen when the caches expire (60 s).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any

from tokenfleet.errors import ConfigError
from tokenfleet.service.config import add_config_arguments, config_from_args

_QUOTA_FLAGS = {
    "rpm": "requests_per_minute",
    "tpm": "tokens_per_minute",
    "concurrency": "max_concurrent_requests",
    "daily_tokens": "daily_token_budget",
}


class _Stores:
    def __init__(self, args: argparse.Namespace) -> None:
        from tokenfleet.service.db import make_engine

        cfg = config_from_args(args)
        db_url = getattr(args, "database_url", None)
        if not db_url:
            from tokenfleet.service.endpoints import discover

            db_url = discover(cfg, require=("database",)).database_url
        self.engine = make_engine(db_url, pool_size=2)
        self.cache: Any = None
        redis_url = getattr(args, "redis_url", None)
        if not redis_url:
            from tokenfleet.service.endpoints import discover

            redis_url = discover(cfg, require=()).redis_url
        if redis_url:
            import redis

            from tokenfleet.tenancy.directory import TenantDirectory

            client = redis.Redis.from_url(redis_url, socket_connect_timeout=2)
            try:
                client.ping()
                self.cache = TenantDirectory(self.engine, client)
            except redis.RedisError:
                pass
        self.warned = False

    def warn_no_cache(self) -> None:
        if self.cache is None and not self.warned:
            self.warned = True
            print(
                "tokenfleet: warning: Redis not reachable; running API processes see this "
                "change when their cache expires (up to 60 s)",
                file=sys.stderr,
            )

    def close(self) -> None:
        self.engine.dispose()


def _with_stores(func: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        import sqlalchemy as sa

        stores = _Stores(args)
        try:
            return int(func(args, stores))
        except sa.exc.OperationalError as exc:
            first = str(exc.orig).strip().splitlines()[0] if exc.orig else str(exc)
            raise ConfigError(
                f"database error: {first}; is PostgreSQL running "
                "(`tokenfleet services status`) and migrated (`tokenfleet db upgrade`)?"
            ) from None
        finally:
            stores.close()

    return run


def _csv(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def _limit_value(text: str) -> int | None:
    if text.strip().lower() in ("none", "unlimited", "-"):
        return None
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number or 'none'") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"'{text}' must be >= 0 (or 'none' for unlimited)")
    return v


def _quota_changes(args: argparse.Namespace) -> dict[str, int | None]:
    return {
        name: getattr(args, flag)
        for flag, name in _QUOTA_FLAGS.items()
        if getattr(args, flag) is not _UNSET
    }


_UNSET: Any = object()


def _fmt_limits(d: dict[str, int | None]) -> str:
    short = {
        "requests_per_minute": "rpm",
        "tokens_per_minute": "tpm",
        "max_concurrent_requests": "conc",
        "daily_token_budget": "daily",
    }
    return " ".join(f"{short[k]}={'-' if v is None else v}" for k, v in d.items())


def _cmd_create(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    admin.create_tenant(
        st.engine,
        args.tenant_id,
        actor=args.actor,
        name=args.name,
        slo_class=args.slo_class,
        allowed_models=_csv(args.models),
        allowed_regions=_csv(args.regions),
        cache=st.cache,
    )
    changes = _quota_changes(args)
    if changes:
        admin.set_quota(
            st.engine, args.tenant_id, args.budget, changes, actor=args.actor, cache=st.cache
        )
    print(f"created tenant {args.tenant_id}")
    if args.with_key:
        key, info = admin.create_key(st.engine, args.tenant_id, actor=args.actor, cache=st.cache)
        print(f"api key (shown once, store it now): {key}")
    return 0


def _cmd_list(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    rows = admin.list_tenants(st.engine)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "id": c.id,
                        "name": c.name,
                        "slo_class": c.slo_class,
                        "allowed_models": list(c.allowed_models),
                        "allowed_regions": list(c.allowed_regions),
                        "disabled": c.disabled,
                        "active_keys": n,
                        "quotas": c.quotas.as_dict(),
                    }
                    for c, n in rows
                ],
                indent=2,
            )
        )
        return 0
    if not rows:
        print("no tenants; create one with `tokenfleet tenants create ID`")
        return 0
    print(f"{'tenant':<20} {'slo':<9} {'keys':>4}  {'interactive':<40} batch")
    for c, n in rows:
        flag = " (disabled)" if c.disabled else ""
        print(
            f"{c.id + flag:<20} {c.slo_class:<9} {n:>4}  "
            f"{_fmt_limits(c.quotas.interactive.as_dict()):<40} "
            f"{_fmt_limits(c.quotas.batch.as_dict())}"
        )
    return 0


def _cmd_set_quota(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    changes = _quota_changes(args)
    if not changes:
        raise ConfigError("nothing to change; pass --rpm, --tpm, --concurrency or --daily-tokens")
    limits = admin.set_quota(
        st.engine, args.tenant_id, args.budget, changes, actor=args.actor, cache=st.cache
    )
    st.warn_no_cache()
    print(f"{args.tenant_id} {args.budget}: {_fmt_limits(limits.as_dict())}")
    return 0


def _cmd_update(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    ctx = admin.update_tenant(
        st.engine,
        args.tenant_id,
        actor=args.actor,
        name=args.name,
        slo_class=args.slo_class,
        allowed_models=None if args.models is None else _csv(args.models),
        allowed_regions=None if args.regions is None else _csv(args.regions),
        disabled=True if args.disable else (False if args.enable else None),
        cache=st.cache,
    )
    st.warn_no_cache()
    print(
        f"{ctx.id}: slo={ctx.slo_class} models={','.join(ctx.allowed_models) or '*'} "
        f"regions={','.join(ctx.allowed_regions) or '*'} disabled={ctx.disabled}"
    )
    return 0


def _cmd_key_create(args: argparse.Namespace, st: _Stores) -> int:
    from datetime import UTC, datetime, timedelta

    from tokenfleet.tenancy import admin

    expires = None
    if args.expires_days is not None:
        if args.expires_days <= 0:
            raise ConfigError("--expires-days must be > 0")
        expires = datetime.now(UTC) + timedelta(days=args.expires_days)
    key, info = admin.create_key(
        st.engine,
        args.tenant_id,
        actor=args.actor,
        name=args.name,
        expires_at=expires,
        requests_per_minute=args.rpm,
        tokens_per_minute=args.tpm,
        cache=st.cache,
    )
    if args.quiet:
        print(key)
    else:
        print(f"key id {info.id} for {info.tenant_id} (shown once, store it now):")
        print(key)
    return 0


def _cmd_key_revoke(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    n = admin.revoke_key(
        st.engine, args.key, actor=args.actor, tenant_id=args.tenant, cache=st.cache
    )
    if n == 0:
        raise ConfigError(f"no active key matches '{args.key}'; see `tokenfleet tenants keys list`")
    st.warn_no_cache()
    print(f"revoked {n} key(s)")
    return 0


def _cmd_key_list(args: argparse.Namespace, st: _Stores) -> int:
    from tokenfleet.tenancy import admin

    keys = admin.list_keys(st.engine, args.tenant_id)
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    print(
        f"{'id':>5} {'tenant':<20} {'prefix':<12} {'name':<16} {'expires':<16} "
        f"{'last used':<16} {'key limits':<20} status"
    )
    for k in keys:
        if k.revoked_at:
            status = f"revoked {k.revoked_at:%Y-%m-%d %H:%M}"
        elif k.expires_at and k.expires_at <= now:
            status = "expired"
        else:
            status = "active"
        expires = f"{k.expires_at:%Y-%m-%d %H:%M}" if k.expires_at else "never"
        used = f"{k.last_used_at:%Y-%m-%d %H:%M}" if k.last_used_at else "-"
        own = " ".join(
            f"{name}={v}"
            for name, v in (("rpm", k.requests_per_minute), ("tpm", k.tokens_per_minute))
            if v is not None
        )
        print(
            f"{k.id:>5} {k.tenant_id:<20} {k.prefix:<12} {(k.name or ''):<16} {expires:<16} "
            f"{used:<16} {own or '-':<20} {status}"
        )
    return 0


def _cmd_demo(args: argparse.Namespace, st: _Stores) -> int:
    import os

    from tokenfleet.tenancy.demo import ensure_demo_key

    cfg = config_from_args(args)
    data_dir = cfg.resolved_data_dir()
    data_dir.mkdir(parents=True, exist_ok=True)
    configured = cfg.api_key or os.environ.get("TOKENFLEET_API_KEY") or None
    demo = ensure_demo_key(st.engine, data_dir, configured_key=configured, cache=st.cache)
    if args.quiet:
        print(demo.key)
    else:
        print(f"{demo.key}   (tenant {demo.tenant}; {demo.note})")
    return 0


def _cmd_admin_user(args: argparse.Namespace, st: _Stores) -> int:
    from web.admin.auth import set_admin_password

    if args.password_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = getpass.getpass(f"password for {args.username}: ")
    set_admin_password(st.engine, args.username, password, actor=args.actor)
    print(f"admin user {args.username} saved")
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument(
        "--database-url",
        metavar="URL",
        default=None,
        help="PostgreSQL URL (default: config / embedded server)",
    )
    p.add_argument(
        "--redis-url",
        metavar="URL",
        default=None,
        help="Redis URL whose caches are invalidated (default: config / embedded)",
    )
    p.add_argument("--actor", default="cli", help="name written to the audit log (default: cli)")


def _quota_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--budget",
        choices=["interactive", "batch"],
        default="interactive",
        help="which budget the limits apply to (default: interactive)",
    )
    for flag, name in _QUOTA_FLAGS.items():
        p.add_argument(
            "--" + flag.replace("_", "-"),
            dest=flag,
            type=_limit_value,
            default=_UNSET,
            metavar="N|none",
            help=name.replace("_", " "),
        )


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("tenants", help="tenants, quotas and API keys")
    sub = parser.add_subparsers(dest="tenants_command", metavar="ACTION", required=True)

    p = sub.add_parser("create", help="create a tenant (optionally with quotas and a key)")
    _common(p)
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None)
    p.add_argument("--slo-class", default="standard", help="standard, premium or batch")
    p.add_argument("--models", default=None, help="comma-separated allowed models (default: all)")
    p.add_argument(
        "--regions",
        default=None,
        help="comma-separated allowed regions for data residency (default: all)",
    )
    p.add_argument("--with-key", action="store_true", help="also create and print an API key")
    _quota_flags(p)
    p.set_defaults(func=_with_stores(_cmd_create))

    p = sub.add_parser("list", help="list tenants with their quotas")
    _common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_with_stores(_cmd_list))

    p = sub.add_parser("set-quota", help="change quota limits of one budget ('none' = unlimited)")
    _common(p)
    p.add_argument("tenant_id")
    _quota_flags(p)
    p.set_defaults(func=_with_stores(_cmd_set_quota))

    p = sub.add_parser("update", help="change SLO class, allowed models/regions, or disable")
    _common(p)
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None)
    p.add_argument("--slo-class", default=None)
    p.add_argument("--models", default=None, help="comma-separated; '' = all models")
    p.add_argument("--regions", default=None, help="comma-separated; '' = all regions")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--disable", action="store_true", help="reject all of the tenant's keys")
    g.add_argument("--enable", action="store_true")
    p.set_defaults(func=_with_stores(_cmd_update))

    keys = sub.add_parser("keys", help="create, revoke and list API keys")
    ksub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    p = ksub.add_parser("create", help="create a key; the plaintext is printed once")
    _common(p)
    p.add_argument("tenant_id")
    p.add_argument("--name", default=None, help="label shown in listings")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the key")
    p.add_argument(
        "--expires-days", type=float, default=None, help="refuse the key after this many days"
    )
    p.add_argument(
        "--rpm", type=int, default=None, help="this key's own requests/min (on top of the tenant's)"
    )
    p.add_argument(
        "--tpm", type=int, default=None, help="this key's own tokens/min (on top of the tenant's)"
    )
    p.set_defaults(func=_with_stores(_cmd_key_create))
    p = ksub.add_parser("revoke", help="revoke by key id, display prefix or full key")
    _common(p)
    p.add_argument("key")
    p.add_argument("--tenant", default=None, help="only revoke keys of this tenant")
    p.set_defaults(func=_with_stores(_cmd_key_revoke))
    p = ksub.add_parser("list", help="list keys (prefixes only; keys are stored hashed)")
    _common(p)
    p.add_argument("tenant_id", nargs="?", default=None)
    p.set_defaults(func=_with_stores(_cmd_key_list))

    p = sub.add_parser(
        "demo",
        help="the demo tenant and its API key, as `tokenfleet up` keeps them: created once, "
        "the key saved in the data dir; prints the key",
    )
    _common(p)
    p.add_argument("--quiet", "-q", action="store_true", help="print only the key")
    p.set_defaults(func=_with_stores(_cmd_demo))

    p = subparsers.add_parser(
        "admin-user", help="create an admin login for the web UI (or change its password)"
    )
    _common(p)
    p.add_argument("username")
    p.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    p.set_defaults(func=_with_stores(_cmd_admin_user))
