"""The Celery app: broker settings chosen for long-running LLM requests.

Settings and why (Celery 5.6 docs):

* ``task_acks_late`` + ``task_reject_on_worker_lost``: a request is
  acknowledged only after it finished, so a worker killed mid-request gives
  it back to the broker instead of losing it ("Tasks > acks_late";
  "Configuration > task_reject_on_worker_lost"). Redelivery can duplicate a
  run; :mod:`workers.tasks` makes that harmless (Redis claim per attempt +
  ledger upsert on ``request_id``) and records the duplicate.
* ``worker_prefetch_multiplier = 1``: with late acks a worker then holds at
  most ``concurrency`` messages, i.e. only the requests it is running, so a
  busy worker never sits on queued work another one could start ("Optimizing
  > Prefetch limits": long tasks want multiplier 1). ``worker_disable_prefetch``
  (5.6, Redis only) is not needed on top: the threads pool's qos already
  equals its free slots.
* ``broker_transport_options.visibility_timeout``: Redis/SQS redeliver an
  unacknowledged message after this long, so it must exceed the longest
  queued+running time of any request ("Backends and Brokers > Redis >
  Visibility timeout"); we use ``LiveConfig.visibility_timeout_s`` (2 h,
  above the batch tier's 1 h deadline). Faster recovery from a dead worker
  does not wait for it: the API re-sends the request (see tokenfleet.live.gateway.watch).
* ``queue_order_strategy = "priority"`` (kombu Redis transport): a worker
  polls its queues in the order given (interactive, long_context, batch)
  instead of round-robin, so a free slot always takes the highest tier
  waiting. RabbitMQ has no cross-queue order; there the worker's tier gate
  stops consuming lower tiers while a higher one has work queued.
  ``polling_interval`` (= the BRPOP timeout) is 0.1 s instead of 1 s so a
  queue the gate re-enables is polled again at once. ``priority_steps = [0]``:
  we never set message priorities (tiers are separate queues), so the
  transport's default of four sub-lists per queue (``[0, 3, 6, 9]``,
  "Routing Tasks > Redis Message Priorities") only made every BRPOP name
  four keys per queue, rebuilt in Python after each message. A message of
  priority 0 goes to the plain queue key either way, so publishers with the
  default steps stay compatible.
* Direct routing by computed name: ``task_create_missing_queues`` makes
  each ``<dc>.<tier>`` / ``<dc>.<instance>.<tier>`` a queue bound to a
  direct exchange of the same name with that routing key, so publishing is
  an exact-match lookup, never a topic pattern ("Routing Tasks > Automatic
  routing").
* ``broker_transport``: kombu's Redis transport, subclassed to cut round
  trips off the request path (one redis-py client per channel, a publish
  that can join the API's state pipeline, the late-ack copy written after
  the hand-off); wire format unchanged (:mod:`tokenfleet.live.redis_transport`;
  measured in docs/live.md).
* No result backend: tokens go through Redis Streams (tokenfleet.live.relay);
  nothing ever waits on ``AsyncResult.get()``.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from tokenfleet.live.config import LiveConfig
from tokenfleet.live.redis_transport import TRANSPORT_PATH


def celery_settings(broker_url: str, live: LiveConfig) -> dict[str, Any]:
    transport: dict[str, Any] = {"visibility_timeout": live.visibility_timeout_s}
    if broker_url.startswith(("redis://", "rediss://", "unix://")):
        transport["queue_order_strategy"] = "priority"
        # BRPOP timeout: a consumer whose queue set changed (tier gate) re-polls
        # with the new set within this long (kombu default: 1 s)
        transport["polling_interval"] = 0.1
        transport["priority_steps"] = [0]
        transport["socket_connect_timeout"] = 2.0
    extra: dict[str, Any] = {}
    if broker_url.startswith(("redis://", "rediss://")):
        extra["broker_transport"] = TRANSPORT_PATH  # kombu's, subclassed
    return {
        **extra,
        "broker_url": broker_url,
        "result_backend": None,
        "task_ignore_result": True,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": transport,
        "task_create_missing_queues": True,
        "task_default_exchange_type": "direct",
        "task_serializer": "json",
        "accept_content": ["json"],
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "broker_pool_limit": 64,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        # task events only for Flower (``worker_events``): a message per state change
        "worker_send_task_events": live.worker_events,
        "task_send_sent_event": False,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "enable_utc": True,
        # heartbeats on AMQP connections let RabbitMQ drop a dead worker quickly
        "broker_heartbeat": 10,
    }


def create_celery(
    broker_url: str, live: LiveConfig | None = None, name: str = "tokenfleet"
) -> Celery:
    """A configured Celery app; the API uses one only to publish."""
    app = Celery(name, set_as_current=False)
    app.conf.update(celery_settings(broker_url, live or LiveConfig.load()))
    return app


def _default_broker() -> str:
    return (
        os.environ.get("TOKENFLEET_BROKER_URL")
        or os.environ.get("TOKENFLEET_REDIS_URL")
        or "redis://127.0.0.1:6379/0"
    )


#: the worker/beat app; ``tokenfleet worker`` re-points it at the real broker
app = Celery("tokenfleet", set_as_current=True)
app.conf.update(celery_settings(_default_broker(), LiveConfig.load()))
app.conf.include = ["workers.tasks"]
