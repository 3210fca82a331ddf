"""``tokenfleet api``: serve the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Any


def register(subparsers: Any) -> None:
    from tokenfleet.service.config import add_config_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "api", help="serve the OpenAI-compatible HTTP API",
        description="Serve /v1/chat/completions, /v1/models, /health, /metrics and "
                    "/openapi.json. Needs Redis (and PostgreSQL for the ledger); see "
                    "docs/live.md.")
    add_config_arguments(p)
    p.add_argument("--host", default=None, help="bind address (default: api_host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="port (default: api_port, 8000)")
    p.add_argument("--admission", default="slomax",
                   help="admission policy (default slomax; 'none' admits everything)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from werkzeug.serving import make_server

    from tokenfleet.errors import ConfigError
    from tokenfleet.live.endpoints import resolve_endpoints
    from tokenfleet.service.config import config_from_args
    from web import close_app, create_app

    from tokenfleet.cli.logs import setup_logging

    setup_logging(args.loglevel)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    cfg = config_from_args(args)
    ep = resolve_endpoints(cfg)
    keys = {cfg.api_key: "demo"} if cfg.api_key else {}
    app = create_app({"REDIS_URL": ep.redis_url, "BROKER_URL": ep.broker_url,
                      "DATABASE_URL": ep.database_url, "DATA_DIR": str(cfg.resolved_data_dir()),
                      "API_KEYS": keys, "ADMISSION": args.admission})
    host = args.host or cfg.api_host
    port = args.port if args.port is not None else cfg.api_port
    try:
        server = make_server(host, port, app, threaded=True)
    except OSError as exc:
        close_app(app)
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}; pick another --port") from None
    server.daemon_threads = True
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        stop.set()
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"tokenfleet api: listening on http://{host}:{server.server_port}", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        close_app(app)
    return 0
