"""Entry point of ``tokenfleet worker``: one Celery worker for one engine instance.

The process runs Celery's threads pool with ``concurrency = slots`` (the most
requests it lets its engine run at once) and consumes, in priority order, the
affinity and pool queues of its instance's datacenter
(:func:`tokenfleet.live.queues.worker_queues`); ``--pool`` serves only the
DC's pool queues.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from celery import bootsteps

from tokenfleet.engine.profiles import get_profile
from tokenfleet.errors import ConfigError
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.queues import CONTROL_QUEUE
from tokenfleet.live.scrape import cache_config
from tokenfleet.live.state import InstanceInfo, LiveState
from workers.pool import WakingThreadPool

log = logging.getLogger("tokenfleet.worker")


class _GateLines(logging.Filter):
    """Drops Celery's INFO line per queue the tier gate pauses or resumes: it
    pauses the pool queues around every prompt that fills the prefill budget,
    so they came to several lines per request."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        return not (
            isinstance(msg, str) and msg.startswith(("Canceling queue", "Started consuming from"))
        )


class AttachConsumer(bootsteps.StartStopStep):
    """Hands Celery's consumer to the runtime so the tier gate can steer it."""

    requires = {"celery.worker.consumer.tasks:Tasks"}

    def start(self, c: Any) -> None:
        from workers import runtime

        if runtime.RUNTIME is not None:
            runtime.RUNTIME.attach_consumer(c)
        try:
            ch = c.connection.default_channel
            log.info(
                "consumer attached: queue cycle %s over %s",
                type(getattr(ch, "_queue_cycle", None)).__name__,
                getattr(getattr(ch, "_queue_cycle", None), "items", None),
            )
        except Exception:  # noqa: BLE001
            pass

    def stop(self, c: Any) -> None:
        from workers import runtime

        if runtime.RUNTIME is not None:
            runtime.RUNTIME.attach_consumer(None)


@dataclass
class WorkerOptions:
    dc: str
    instance_id: str
    engine_url: str
    profile: str = "llama3-8b-h200"
    slots: int = 64
    pool_mode: bool = False
    kv_events_endpoint: str | None = None
    loglevel: str = "INFO"
    control: bool = False
    #: the served model's tokenizer directory ("": the engine's model root if
    #: it is a local directory with a tokenizer, else the byte tokenizer)
    tokenizer: str = ""
    #: the engine's URL as the API reaches it, for the direct path ("": engine_url);
    #: differs when the worker reaches its engine locally (a pod's 127.0.0.1)
    public_engine_url: str = ""
    #: P/D role: "prefill" instances take no pool work (a P/D router sends them
    #: prefills directly); "decode" and "mixed" consume as usual
    role: str = "mixed"


def model_tokenizer_dir(root: str) -> str:
    """``root`` if it is a model directory with a Hugging Face tokenizer here."""
    if root and os.path.isfile(os.path.join(root, "tokenizer.json")):
        return os.path.abspath(root)
    return ""


def probe_block_size(url: str) -> int:
    """The engine's KV block size in tokens from vLLM's ``cache_config_info``
    (0: not exported, e.g. the emulator, whose blocks are the router's)."""
    u = urlsplit(url)
    try:
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=5.0)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode("utf-8", "replace")
        conn.close()
    except (OSError, http.client.HTTPException):
        return 0
    cfg = cache_config(text)
    algo = cfg.get("prefix_caching_hash_algo", "sha256")
    if algo != "sha256":
        log.warning(
            "engine %s hashes prefix blocks with %s; TokenFleet computes vLLM's default "
            "sha256, so exact cache matching will miss (start vLLM without "
            "--prefix-caching-hash-algo)",
            url,
            algo,
        )
    try:
        return int(cfg.get("block_size", "0"))
    except ValueError:
        return 0


def probe_engine(url: str, timeout_s: float = 30.0) -> tuple[str, int, str]:
    """(served model, max_model_len, model root) from the engine's ``/v1/models``;
    waits for it. vLLM's ``root`` is the model path it loaded ("" if none)."""
    u = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=2.0)
            conn.request("GET", "/v1/models")
            resp = conn.getresponse()
            body = json.loads(resp.read())
            conn.close()
            if resp.status == 200 and body.get("data"):
                m = body["data"][0]
                return str(m["id"]), int(m.get("max_model_len") or 0), str(m.get("root") or "")
            last = RuntimeError(f"/v1/models answered {resp.status}")
        except (OSError, ValueError, http.client.HTTPException) as exc:
            last = exc
        time.sleep(0.2)
    raise ConfigError(
        f"engine at {url} did not answer /v1/models within {timeout_s:.0f}s "
        f"({last!r}); start it first or fix --engine-url"
    )


def _amqp_depths(app: Any) -> Any:
    """Exact ready-message counts from RabbitMQ (passive queue.declare)."""
    conn = app.connection_for_write()

    def depths(queues: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        ch = conn.default_channel
        for q in queues:
            try:
                _name, count, _consumers = ch.queue_declare(q, passive=True)
                out[q] = int(count)
            except Exception:  # noqa: BLE001 - queue not declared yet: empty
                conn.close()
                ch = conn.default_channel
                out[q] = 0
        return out

    return depths


def run_worker(
    opts: WorkerOptions,
    *,
    redis_url: str,
    broker_url: str,
    database_url: str | None,
    data_dir: Any,
    live: LiveConfig | None = None,
) -> int:
    from workers import runtime
    from workers.app import app, celery_settings

    live = live or LiveConfig.load()
    model, max_len, root = probe_engine(opts.engine_url)
    tokenizer = opts.tokenizer or model_tokenizer_dir(root)
    block_size = probe_block_size(opts.engine_url) if tokenizer else 0
    prof = get_profile(opts.profile)
    state = LiveState.from_url(redis_url, prefix=live.redis_prefix)
    info = InstanceInfo(
        instance_id=opts.instance_id,
        dc=opts.dc,
        model=model,
        url=opts.engine_url.rstrip("/"),
        profile=prof.name,
        max_model_len_tokens=max_len or prof.model.max_model_len_tokens,
        kv_capacity_tokens=prof.kv_capacity_tokens,
        slots=opts.slots,
        tokenizer=tokenizer,
        block_size_tokens=block_size,
        role=opts.role,
    )
    ledger = None
    if database_url:
        from pathlib import Path

        from tokenfleet.service.writer import LedgerWriter

        ledger = LedgerWriter(
            database_url, spill_dir=Path(data_dir) / "spill", name=f"ledger-{opts.instance_id}"
        )
    dc_brokers = live.dc_brokers()
    # multi-region: a worker consumes from its own datacenter's broker
    broker_url = dc_brokers.pop(opts.dc, broker_url)
    app.conf.update(celery_settings(broker_url, live))
    send_task = None
    if dc_brokers:  # a re-send to another datacenter goes to that DC's broker
        from tokenfleet.live.brokers import DcBrokers
        from workers.app import create_celery

        send_task = DcBrokers(app, dc_brokers, lambda url: create_celery(url, live)).send_task
    rt = runtime.WorkerRuntime(
        live,
        state,
        info,
        ledger=ledger,
        pool_mode=opts.pool_mode,
        kv_events_endpoint=opts.kv_events_endpoint,
        public_engine_url=opts.public_engine_url.rstrip("/"),
        send_task=send_task,
    )
    runtime.RUNTIME = rt
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        rt.broker_orders_queues = True  # queue_order_strategy=priority (workers.app)
    elif broker_url.startswith(("amqp://", "amqps://", "pyamqp://")):
        rt.queue_depths = _amqp_depths(app)
    if AttachConsumer not in app.steps["consumer"]:
        app.steps["consumer"].add(AttachConsumer)
    queues = list(rt.queues) + ([CONTROL_QUEUE] if opts.control else [])
    # Celery warns about root (pickle); we accept JSON only, which is safe as root.
    warnings.filterwarnings("ignore", message="You're running the worker with superuser")
    # per-request INFO lines of Celery ("received", "succeeded") cost more than the
    # routing decision at high rates; the ledger and metrics carry that information
    if opts.loglevel != "DEBUG":
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)
        logging.getLogger("celery.worker.consumer.consumer").addFilter(_GateLines())
    rt.start()
    log.info(
        "worker %s (dc %s) serving %s at %s, %d slots, queues: %s",
        opts.instance_id,
        opts.dc,
        model,
        opts.engine_url,
        opts.slots,
        ", ".join(queues),
    )
    try:
        worker = app.Worker(
            hostname=f"{opts.instance_id}@{opts.dc}",
            pool_cls=WakingThreadPool,
            concurrency=opts.slots,
            queues=queues,
            loglevel=opts.loglevel,
            without_mingle=True,
            without_gossip=True,
            # heartbeats let Flower list the worker (worker_events); off by default:
            # TokenFleet's own liveness is the snapshot age in Redis
            without_heartbeat=not live.worker_events,
            quiet=True,
        )
        worker.start()
        return int(getattr(worker, "exitcode", 0) or 0)
    finally:
        rt.stop(deregister=True)
        if ledger is not None:
            ledger.close(timeout=5.0)
