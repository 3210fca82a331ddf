"""Entry point of ``tokenfleet beat``: Celery beat plus the worker that runs its tasks.

One process: a Celery worker consuming only ``tokenfleet.control`` with the
beat scheduler running as a thread beside it, so the control loop needs no
extra process and never takes an engine worker's slot. Run exactly one.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.queues import CONTROL_QUEUE
from tokenfleet.live.state import LiveState

log = logging.getLogger("tokenfleet.beat")


def run_beat(
    *,
    redis_url: str,
    broker_url: str,
    database_url: str | None,
    data_dir: Any,
    live: LiveConfig | None = None,
    loglevel: str = "INFO",
) -> int:
    from workers import control
    from workers.app import app, celery_settings

    live = live or LiveConfig.load()
    state = LiveState.from_url(redis_url, prefix=live.redis_prefix)
    engine = None
    if database_url:
        from tokenfleet.service.db import make_engine

        engine = make_engine(database_url)
    control.CONTEXT = control.ControlContext(live=live, state=state, db_engine=engine)
    app.conf.update(celery_settings(broker_url, live))
    sched = Path(data_dir) / "run" / "celerybeat-schedule"
    sched.parent.mkdir(parents=True, exist_ok=True)
    app.conf.beat_schedule = control.beat_schedule(live)
    app.conf.beat_schedule_filename = str(sched)
    app.conf.beat_max_loop_interval = min(5.0, live.control_period_s)
    warnings.filterwarnings("ignore", message="You're running the worker with superuser")
    log.info(
        "beat: SLOMax control every %.1fs, FleetMind cycle every %.0fs",
        live.control_period_s,
        live.fleet_period_s,
    )
    from celery.beat import EmbeddedService

    # beat as a thread of this process (Celery's embedded beat would fork a child)
    scheduler = EmbeddedService(
        app, thread=True, schedule_filename=str(sched), max_interval=app.conf.beat_max_loop_interval
    )
    scheduler.start()
    try:
        worker = app.Worker(
            hostname="beat@tokenfleet",
            pool_cls="threads",
            concurrency=2,
            queues=[CONTROL_QUEUE],
            loglevel=loglevel,
            without_mingle=True,
            without_gossip=True,
            without_heartbeat=not live.worker_events,  # Flower lists it (worker_events)
            quiet=True,
        )
        worker.start()
        return int(getattr(worker, "exitcode", 0) or 0)
    finally:
        scheduler.stop()
        if engine is not None:
            engine.dispose()
