"""``tokenfleet beat``: the control loops (SLOMax tick, FleetMind cycle) on a schedule."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    from tokenfleet.service.config import add_config_arguments

    p: argparse.ArgumentParser = subparsers.add_parser(
        "beat",
        help="run the control loops (Celery beat + its control worker)",
        description="Every control period, run the SLOMax feedback controller over the "
        "ledger and Redis counters and publish new tier shares and admission "
        "knobs; every long cycle, run the FleetMind planner. Run exactly one.",
    )
    add_config_arguments(p)
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenfleet.cli.logs import setup_logging
    from tokenfleet.service.config import config_from_args
    from tokenfleet.service.endpoints import discover
    from workers.beat import run_beat

    setup_logging(args.loglevel)
    cfg = config_from_args(args)
    ep = discover(cfg, require=("redis",))
    assert ep.redis_url is not None and ep.broker_url is not None
    return run_beat(
        redis_url=ep.redis_url,
        broker_url=ep.broker_url,
        database_url=ep.database_url,
        data_dir=cfg.resolved_data_dir(),
        loglevel=args.loglevel.upper(),
    )
