"""The live path with RabbitMQ as the Celery broker (Redis keeps the live state).

Needs the RabbitMQ at amqp://guest:guest@127.0.0.1:5672// (skipped with the
reason when it does not answer). Queue names carry a random datacenter suffix
so runs never share queues, and the queues are deleted afterwards.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stack import InstanceSpec, LiveStack
from tokenfleet.live.queues import worker_queues

BROKER = os.environ.get("TOKENFLEET_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
LONG = " ".join(f"Section {i} of the appendix, revised." for i in range(3300))


def _rabbit_up() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1.0):
            return True
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _rabbit_up(), reason="RabbitMQ not reachable at 127.0.0.1:5672")


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    tag = uuid.uuid4().hex[:6]
    specs = [InstanceSpec(f"rq{tag}a", "a0"), InstanceSpec(f"rq{tag}b", "b0")]
    try:
        with live_stack(
            router="round_robin",
            time_scale=1.0,
            broker_url=BROKER,
            app_config={"CHAT_QUOTAS": False},
            instances=specs,
        ) as s:
            yield s
    finally:
        from kombu import Connection

        with Connection(BROKER) as conn:
            ch = conn.channel()
            for spec in specs:
                for q in worker_queues(spec.dc, spec.instance_id):
                    try:
                        ch.queue_delete(q)
                    except Exception:  # noqa: BLE001 - never declared
                        ch = conn.channel()


def test_chat_through_rabbitmq(stack: LiveStack) -> None:
    c = stack.client()
    r = c.chat.completions.create(
        model=stack.model, max_tokens=5, messages=[{"role": "user", "content": "via amqp"}]
    )
    assert r.usage is not None and r.usage.completion_tokens >= 1
    chunks = list(
        c.chat.completions.create(
            model=stack.model,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": "via amqp, streamed"}],
        )
    )
    assert chunks[-1].usage is not None
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == chunks[-1].usage.completion_tokens


def test_broker_redelivery_after_kill_is_a_recorded_duplicate(stack: LiveStack) -> None:
    """kill -9 mid-prefill: RabbitMQ puts the unacked message back at once; the
    API re-sends the request elsewhere meanwhile. When the dead worker's
    replacement gets the redelivered message, it must not run it again."""
    c = stack.client(timeout=60)
    out: dict[str, Any] = {}
    # The relay path: there the engine call dies with the worker, so the re-send
    # elsewhere does not depend on the lease lapsing before the prefill ends. On
    # the direct path the API's engine call outlives the worker, and a first
    # token before the lost lease is noticed ends the request as failed
    # (docs/live.md, "Idempotency and faults"); this test is about the broker's
    # redelivery, which both paths refuse to run twice.
    gw = stack.gateway
    before = gw.live
    gw.live = dataclasses.replace(before, direct_stream=False)

    def call() -> None:
        try:
            out["resp"] = c.chat.completions.create(
                model=stack.model,
                max_tokens=3,
                messages=[{"role": "user", "content": f"[{uuid.uuid4().hex}] {LONG}"}],
            )
        finally:
            gw.live = before

    t0 = time.time()
    th = threading.Thread(target=call)
    th.start()
    st = stack.gateway.state
    victim = rid = None
    deadline = time.time() + 10
    while time.time() < deadline and victim is None:
        for key in st.r.scan_iter(match=st.k("req", "*")):
            h = {k.decode(): v.decode() for k, v in st.r.hgetall(key).items()}
            if h.get("status") == "running" and float(h.get("queued_at", 0)) >= t0:
                victim, rid = h["instance"], key.decode().rsplit(":", 1)[1]
        time.sleep(0.05)
    assert victim is not None and rid is not None
    stack.sup.kill(f"worker-{victim}")  # type: ignore[union-attr]
    th.join(60)
    assert "resp" in out
    # bring the worker back: RabbitMQ hands it the redelivered attempt-1 message
    spec = next(s for s in stack.instances if s.instance_id == victim)
    stack.start_worker(spec)
    stack.wait_ready(timeout_s=30)
    deadline = time.time() + 20
    while time.time() < deadline and not st.counters().get("duplicates", 0):
        time.sleep(0.2)
    assert st.counters().get("duplicates", 0) >= 1, "the redelivery was not seen"
    # the redelivery is an attempt of the request, not a second ledger row
    rows = stack.ledger_rows(
        f"request_id LIKE '{rid}%'", timeout_s=3, expect=lambda rows: len(rows) > 1
    )
    assert len(rows) == 1
    row = rows[0]
    assert row["status"] in ("completed", "slo_missed") and row["attempts"] == 2
    assert row["instance"] != victim
