"""``tokenfleet api``: serve the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any


def register(subparsers: Any) -> None:
    from tokenfleet.service.config import add_config_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "api",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/models, /health, /metrics and "
        "/openapi.json. Needs Redis (and PostgreSQL for the ledger); see "
        "docs/live.md.",
    )
    add_config_arguments(p)
    p.add_argument("--host", default=None, help="bind address (default: api_host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: api_port, 8000)")
    p.add_argument(
        "--admission",
        default=None,
        help="admission policy (default: the 'admission' setting, slomax; "
        "'none' admits everything)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=128,
        help="server threads kept ready (default 128); the pool grows with the "
        "connections up to api_max_inflight plus a reserve for /health and /metrics",
    )
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=run)


def tune_interpreter(switch_interval_ms: float) -> None:
    """Shorter interpreter turns, and rare full collections, for the API process.

    One process holds thousands of streams on threads: a request's parse and
    routing, the stream pump and the watch thread take turns at the
    interpreter, and ``/health`` waits for its turn at every step of its
    answer (accept, parse, the Redis ping, the write). At the default 5 ms
    interval a probe waited longer behind them. Streams live for minutes, so
    the collector's young generations, run every 700 allocations, promoted
    thousands of live stream objects a second; a full collection of the
    process (about 240,000 objects, 200 ms on a loaded 2-core machine, the
    interpreter held throughout) then ran every ~9 s and was the longest
    ``/health`` wait. With young collections every 50,000 allocations most
    of those objects are gone before they are looked at (docs/benchmarks.md,
    "Overload"); full collections run at quiet moments
    (:mod:`tokenfleet.live.collector`). ``gc.freeze()`` takes
    what start-up built (Flask, Celery, kombu, the routers) out of every
    collection."""
    if switch_interval_ms > 0:
        sys.setswitchinterval(switch_interval_ms / 1000.0)
    from tokenfleet.live.collector import space_collections

    space_collections()


def run(args: argparse.Namespace) -> int:
    from tokenfleet.cli.logs import setup_logging
    from tokenfleet.errors import ConfigError
    from tokenfleet.service.config import config_from_args
    from tokenfleet.service.endpoints import discover
    from web import close_app, create_app
    from web.server import ApiServer

    setup_logging(args.loglevel)
    cfg = config_from_args(args, admission=args.admission)
    ep = discover(cfg, require=("redis",))
    assert ep.redis_url is not None and ep.broker_url is not None
    keys = {cfg.api_key: "demo"} if cfg.api_key else {}
    app = create_app(
        {
            "REDIS_URL": ep.redis_url,
            "BROKER_URL": ep.broker_url,
            "DATABASE_URL": ep.database_url,
            "DATA_DIR": str(cfg.resolved_data_dir()),
            "API_KEYS": keys,
            "LIVE": cfg.live,
        }
    )
    tune_interpreter(cfg.live.api_switch_interval_ms)
    if cfg.live.api_full_gc_every_s > 0:
        from tokenfleet.live.collector import QuietCollector

        gw = app.extensions["tokenfleet"]
        QuietCollector(
            lambda: int(gw.inflight.inflight),
            every_s=cfg.live.api_full_gc_every_s,
            at_most_s=max(cfg.live.api_full_gc_every_s, cfg.live.api_full_gc_at_most_s),
        ).start()
    if cfg.live.api_stall_log_ms > 0:
        from tokenfleet.live.stalls import StallWatch

        StallWatch(cfg.live.api_stall_log_ms).start()
    host = args.host or cfg.api_host
    port = args.port if args.port is not None else cfg.api_port
    try:
        server = ApiServer(app, host, port, threads=args.threads, linger_s=cfg.live.api_linger_s)
    except OSError as exc:
        close_app(app)
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}; pick another --port") from None

    def _stop(signum: int, _frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"tokenfleet api: listening on {server.url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        close_app(app)
    return 0
