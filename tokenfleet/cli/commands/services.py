"""``tokenfleet services``: run the embedded Redis and PostgreSQL for development.

``up`` starts both (unless external URLs are configured), migrates the
database and blocks until Ctrl-C/SIGTERM, then stops them; ``up --detach``
leaves them running for other terminals, and ``down`` stops them.
"""

from __future__ import annotations

import argparse
import shlex
import time

from tokenfleet.service.config import add_config_arguments, config_from_args, env_var


def _print_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        print(f"export {key}={shlex.quote(value)}")


def _cmd_up(args: argparse.Namespace) -> int:
    from tokenfleet.service.endpoints import ServiceStack
    from tokenfleet.service.processes import install_sigterm_handler

    cfg = config_from_args(args)
    install_sigterm_handler()
    stack = ServiceStack(cfg, detach=args.detach, migrate=not args.no_migrate)
    endpoints = stack.start()
    print(f"# data dir: {cfg.resolved_data_dir()}")
    _print_env({**endpoints.as_env(), env_var("data_dir"): str(cfg.resolved_data_dir())})
    if args.detach:
        print("# running detached; stop with `tokenfleet services down`")
        return 0
    print("# services running; Ctrl-C or SIGTERM stops them", flush=True)
    try:
        while True:
            for server in (stack.redis, stack.postgres):
                if server is not None and not server.is_running():
                    print(f"# embedded {server.name} exited unexpectedly; stopping")
                    return 1
            time.sleep(1.0)
    finally:
        stack.stop()


def _cmd_down(args: argparse.Namespace) -> int:
    from tokenfleet.service.endpoints import stop_embedded

    stopped = stop_embedded(config_from_args(args))
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from tokenfleet.service.endpoints import embedded_status

    cfg = config_from_args(args)
    print(f"data dir: {cfg.resolved_data_dir()}")
    shown = cfg.redacted()
    for name, key in (("redis", "redis_url"), ("postgres", "database_url")):
        if shown[key]:
            print(f"  {name:<9} external {shown[key]}")
    all_up = True
    for st in embedded_status(cfg):
        state = "answering" if st["answering"] else ("running" if st["running"] else "stopped")
        extra = f" pid={st['pid']} {st['url']}" if st["running"] else ""
        print(f"  {st['name']:<9} embedded {state}{extra}{' (detached)' if st['detached'] else ''}")
        all_up = all_up and bool(st["answering"])
    return 0 if all_up else 1


def _cmd_env(args: argparse.Namespace) -> int:
    from tokenfleet.service.endpoints import discover

    cfg = config_from_args(args)
    _print_env({**discover(cfg).as_env(), env_var("data_dir"): str(cfg.resolved_data_dir())})
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    for key, value in cfg.redacted().items():
        print(f"{key:<26} {value or '(unset)':<40} {cfg.sources.get(key, 'default')}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser("services", help="embedded Redis/PostgreSQL for development")
    sub = parser.add_subparsers(dest="services_command", metavar="ACTION", required=True)

    p = sub.add_parser("up", help="start Redis + PostgreSQL, migrate, print TOKENFLEET_* exports")
    add_config_arguments(p)
    p.add_argument("--detach", action="store_true", help="leave them running and exit")
    p.add_argument("--no-migrate", action="store_true", help="skip `db upgrade`")
    p.set_defaults(func=_cmd_up)

    for name, func, text in (
        ("down", _cmd_down, "stop embedded servers of the data dir"),
        ("status", _cmd_status, "show embedded servers; exit 1 unless all answer"),
        ("env", _cmd_env, 'print export lines: eval "$(tokenfleet services env)"'),
        ("config", _cmd_config, "show the resolved configuration and where each value came from"),
    ):
        p = sub.add_parser(name, help=text)
        add_config_arguments(p)
        p.set_defaults(func=func)
