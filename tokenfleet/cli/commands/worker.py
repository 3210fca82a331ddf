"""``tokenfleet worker``: a Celery worker in front of one engine instance (or a DC pool)."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from tokenfleet.service.config import add_config_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "worker",
        help="run a Celery worker that serves one engine instance",
        description="Consume the request queues of one engine instance (affinity + its "
        "datacenter's pool queues, by tier priority) and stream tokens back "
        "through Redis. See docs/live.md.",
    )
    add_config_arguments(p)
    p.add_argument("--dc", required=True, help="datacenter name (no dots)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--instance", help="engine instance id (no dots)")
    who.add_argument("--pool", action="store_true", help="serve only the DC's shared pool queues")
    p.add_argument(
        "--engine-url",
        required=True,
        help="engine base URL, e.g. http://127.0.0.1:8001 (OpenAI API + /metrics)",
    )
    p.add_argument(
        "--public-engine-url",
        default="",
        metavar="URL",
        help="the engine's URL as the API reaches it (the API streams from the engine "
        "itself, direct_stream); default --engine-url. Set it when the worker reaches "
        "its engine locally, e.g. a pod's 127.0.0.1",
    )
    p.add_argument(
        "--profile",
        default="llama3-8b-h200",
        help="engine profile the router predicts with (tokenfleet profiles)",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=64,
        help="most requests this worker runs on its engine at once (default 64)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the served model's directory (tokenizer.json, chat template): the API "
        "hashes prompts as vLLM does, for exact prefix-cache routing (default: the "
        "engine's model root when it is a local directory)",
    )
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="subscribe to the engine's vLLM KV events (tcp://HOST:PORT) and feed "
        "them to the shared prefix index",
    )
    p.add_argument(
        "--role",
        choices=("mixed", "prefill", "decode"),
        default="mixed",
        help="P/D disaggregation role the router sees (router tokenpilot_pd and the P/D "
        "peers): prefill instances take no pool work and must run a KV connector "
        "(vLLM --kv-transfer-config); default mixed",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="also run beat's control tasks (for single-worker set-ups)",
    )
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenfleet.cli.logs import setup_logging
    from tokenfleet.errors import ConfigError
    from tokenfleet.service.config import config_from_args
    from tokenfleet.service.endpoints import discover
    from workers.worker import WorkerOptions, run_worker

    setup_logging(args.loglevel)
    if args.slots < 1:
        raise ConfigError("--slots must be >= 1")
    cfg = config_from_args(args)
    ep = discover(cfg, require=("redis",))
    assert ep.redis_url is not None and ep.broker_url is not None
    instance = args.instance or f"{args.dc}-pool"
    from tokenfleet.live.collector import space_collections

    space_collections()
    if cfg.live.worker_stall_log_ms > 0:
        from tokenfleet.live.stalls import StallWatch

        StallWatch(cfg.live.worker_stall_log_ms).start()
    opts = WorkerOptions(
        dc=args.dc,
        instance_id=instance,
        engine_url=args.engine_url,
        profile=args.profile,
        slots=args.slots,
        pool_mode=bool(args.pool),
        kv_events_endpoint=args.kv_events,
        tokenizer=args.tokenizer or "",
        public_engine_url=args.public_engine_url,
        role=args.role,
        loglevel=args.loglevel.upper(),
        control=args.control,
    )
    return run_worker(
        opts,
        redis_url=ep.redis_url,
        broker_url=ep.broker_url,
        database_url=ep.database_url,
        data_dir=cfg.resolved_data_dir(),
    )
