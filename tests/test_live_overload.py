"""Overload at the front door: a full process answers /health and refuses at
once (503/429 + Retry-After) instead of letting requests wait unseen; a client
that leaves, streamed or not, cancels its request at the engine.

The stack's engines run in real time (time_scale 1.0) so that a long answer
really takes long: a request that is not cancelled would still be running
(and end ``completed``) long after the checks below give up waiting.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.support.stack import API_KEY, InstanceSpec, LiveStack
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import RequestInfo
from tokenfleet.live.gateway import AtCapacity, Overloaded
from tokenfleet.live.gateway.overload import FrontGate, InflightBound, WaitPredictor

MAX_INFLIGHT = 3
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    emu = {"time_scale": 1.0}
    with live_stack(
        instances=[InstanceSpec("dc-a", "a0", dict(emu)), InstanceSpec("dc-b", "b0", dict(emu))],
        live_overrides={"api_max_inflight": MAX_INFLIGHT},
    ) as s:
        yield s


def _long_body(model: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "stream": stream,
        "max_tokens": 4000,
        "vllm_xargs": {"output_tokens": 4000},
        "messages": [{"role": "user", "content": "a long one"}],
    }


def _engine_requests(stack: LiveStack) -> int:
    return sum(len(e.loop.handles) for e in stack.emulators.values())


def _wait_for(pred: Any, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return bool(pred())


def _open_stream(stack: LiveStack, session: requests.Session) -> requests.Response:
    """A long stream, opened as a client would: a 503 that is not this process's
    bound (an engine briefly unscraped on a starved CI machine) is retried after
    its Retry-After, a few times; the bound's own 503 is returned at once."""
    for _ in range(5):
        r = session.post(
            stack.url + "/v1/chat/completions",
            json=_long_body(stack.model, True),
            headers=HEADERS,
            stream=True,
            timeout=30,
        )
        if r.status_code != 503 or r.json()["error"]["code"] == "server_overloaded":
            return r
        time.sleep(min(5.0, float(r.headers.get("Retry-After", "1"))))
    return r


def test_full_process_answers_health_and_refuses_at_once(stack: LiveStack) -> None:
    gw = stack.gateway
    streams: list[tuple[requests.Response, Iterator[bytes]]] = []
    sessions: list[requests.Session] = []
    try:
        for _ in range(MAX_INFLIGHT):
            # a session each: requests.post's own session closes its connection
            session = requests.Session()
            sessions.append(session)
            r = _open_stream(stack, session)
            assert r.status_code == 200, r.text
            lines = r.iter_lines()  # kept: closing the iterator closes the connection
            next(lines)  # streaming: it holds its place
            streams.append((r, lines))
        assert gw.inflight.inflight == MAX_INFLIGHT
        # /health does not wait behind the streams
        h = requests.get(stack.url + "/health", timeout=10)
        assert h.status_code == 200 and h.json()["status"] == "ok"
        # one more chat request is refused now, not queued
        r = requests.post(
            stack.url + "/v1/chat/completions",
            json={"model": stack.model, "messages": [{"role": "user", "content": "hi"}]},
            headers=HEADERS,
            timeout=10,
        )
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "server_overloaded" and err["type"] == "server_error"
        assert 1 <= int(r.headers["Retry-After"]) <= 120
    finally:
        for r, _ in streams:
            r.close()
        for session in sessions:
            session.close()
    # the places come back when the clients leave, and a request is served again
    assert _wait_for(lambda: gw.inflight.inflight == 0)
    c = stack.client()
    resp = c.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert _wait_for(lambda: _engine_requests(stack) == 0)


def test_non_streamed_client_that_leaves_is_cancelled_at_the_engine(stack: LiveStack) -> None:
    port = int(stack.url.rsplit(":", 1)[1])
    body = json.dumps(_long_body(stack.model, False)).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert _wait_for(lambda: _engine_requests(stack) == 1), "the engine never got the request"
    # the engine call's id is the request's, with its attempt (the row is looked up
    # by it: the last row of the ledger may be an earlier test's, written later)
    (engine_id,) = [k for e in stack.emulators.values() for k in list(e.loop.handles)]
    rid = engine_id.rsplit("-", 1)[0]
    sock.close()  # the client gives up while the answer is being generated
    # the engine stops generating (4000 tokens in real time would take a minute)
    assert _wait_for(lambda: _engine_requests(stack) == 0), "still running at the engine"
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        timeout_s=15,
        expect=lambda rows: bool(rows) and rows[0]["status"] == "cancelled",
    )
    assert [r["status"] for r in rows] == ["cancelled"]
    assert (rows[0]["completion_tokens"] or 0) < 4000
    assert _wait_for(lambda: stack.gateway.inflight.inflight == 0)


# -- the parts, without a stack -------------------------------------------------------------
def test_inflight_bound_refuses_over_its_limit_with_retry_after() -> None:
    bound = InflightBound(2)
    bound.enter()
    bound.enter()
    with pytest.raises(Overloaded) as exc:
        bound.enter()
    assert exc.value.status == 503 and exc.value.retry_after_s is not None
    bound.leave()
    bound.enter()  # a place came back


def _info(tier: str = "interactive") -> RequestInfo:
    return RequestInfo(
        request_id="r1",
        arrival_s=0.0,
        tenant="t",
        input_tokens=100,
        max_tokens=16,
        tier=tier,
    )


def test_front_gate_refuses_at_once_when_the_wait_ahead_outlasts_its_limit() -> None:
    """A request that would wait longer than the gate's limit for its turn (the
    requests waiting ahead times the mean time a request holds a slot) is
    refused without waiting; one that can make it waits and gets in when a
    slot frees."""
    now = [0.0]
    gate = FrontGate(1, wait_s=5.0, clock=lambda: now[0])
    gate.enter()
    now[0] = 3.0
    gate.leave()  # a request held the slot 3 s: the gate passes one per 3 s
    assert gate.mean_hold_s == pytest.approx(3.0)
    gate.enter()  # the slot is held from here on
    entered = threading.Event()

    def waiter() -> None:
        gate.enter()  # its turn is ~3 s away: under 5 s, so it waits
        entered.set()

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while gate._waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate._waiting == 1 and not entered.is_set()
    # a second waiter's turn is ~6 s away: refused now, not after 5 s
    with pytest.raises(Overloaded) as exc:
        gate.enter()
    assert exc.value.retry_after_s > 0
    assert gate._waiting == 1 and not entered.is_set()  # refused, not queued
    gate.leave()
    assert entered.wait(10)
    t.join(10)
    gate.leave()


def test_front_gate_reads_a_quiet_spell_as_idle_not_slow() -> None:
    """A burst after minutes of quiet waits its short turn: the prediction is
    the time a request holds a slot, not how few requests came lately (a pass
    rate refused the first burst a fresh API replica got)."""
    now = [0.0]
    gate = FrontGate(1, wait_s=1.0, clock=lambda: now[0])
    gate.enter()
    now[0] = 0.01
    gate.leave()
    now[0] = 300.0  # quiet for five minutes
    gate.enter()
    entered = threading.Event()
    t = threading.Thread(target=lambda: (gate.enter(), entered.set()), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while gate._waiting < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate._waiting == 1  # waiting its turn, not refused
    gate.leave()
    assert entered.wait(10)
    t.join(10)
    gate.leave()


def test_wait_predictor_sheds_when_the_queue_outlasts_the_tier_limit() -> None:
    slo = SLOConfig()
    limit = slo.slo_for("interactive").ttft_limit_s(100)
    assert limit is not None
    p = WaitPredictor(slo)
    depths = {"dc-a.interactive": 30, "dc-a.batch": 500, "dc-b.interactive": 400}
    # 10 starts per second over two seconds of history
    assert p.check(_info(), "dc-a", depths, lambda: [0], now=0.0) is None  # no history yet
    p.check(_info(), "dc-a", {}, lambda: [10], now=1.0)
    with pytest.raises(AtCapacity) as exc:
        p.check(_info(), "dc-a", depths, lambda: [20], now=2.0)
    # 30 ahead at 10/s: a 3 s wait; Retry-After is what is over the limit
    assert exc.value.status == 429
    assert exc.value.retry_after_s == pytest.approx(3.0 - limit)
    # batch waits behind interactive and has no TTFT limit: never shed here
    assert p.check(_info("batch"), "dc-a", depths, lambda: [20], now=2.0) is None
    # a short queue is admitted with its prediction
    assert p.check(_info(), "dc-a", {"dc-a.interactive": 5}, lambda: [20], now=2.0) == 0.5


def test_server_pool_grows_so_health_never_waits_behind_busy_requests() -> None:
    from tests.support.blocking import blocking_app
    from web.server import ApiServer

    app, release, inside = blocking_app("pool-test")
    server = ApiServer(app, threads=2, max_threads=64, linger_s=0)
    server.start_background()
    busy = 12
    results: list[int] = []
    try:
        workers = [
            threading.Thread(
                target=lambda: results.append(
                    requests.get(server.url + "/block", timeout=30).status_code
                )
            )
            for _ in range(busy)
        ]
        for t in workers:
            t.start()
        for _ in range(busy):  # every one of them is being served at once
            assert inside.acquire(timeout=15), "a request waited for a thread"
        assert requests.get(server.url + "/health", timeout=10).text == "from the route"
    finally:
        release.set()
        for t in workers:
            t.join(30)
        server.shutdown()
    assert results == [200] * busy


# -- many streams (slow suite) --------------------------------------------------------------
async def _stream(port: int, body: bytes) -> tuple[int, str, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), 300)
    finally:
        writer.close()
    head = data.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    status = int(head[0].split()[1])
    retry = next(
        (h.split(":", 1)[1].strip() for h in head if h.lower().startswith("retry-after")), ""
    )
    return status, retry.strip(), data


@pytest.mark.slow
def test_many_concurrent_streams_get_tokens_or_a_clean_refusal(live_stack: Any) -> None:
    n, bound = 600, 400
    with live_stack(
        admission="slomax",
        instances=[
            InstanceSpec("dc-a", "a0", {"time_scale": 0.5}, slots=64),
            InstanceSpec("dc-b", "b0", {"time_scale": 0.5}, slots=64),
        ],
        live_overrides={"api_max_inflight": bound},
    ) as stack:
        port = int(stack.url.rsplit(":", 1)[1])
        body = json.dumps(
            {
                "model": stack.model,
                "stream": True,
                "max_tokens": 32,
                "vllm_xargs": {"output_tokens": 32},
                "messages": [{"role": "user", "content": "many at once"}],
            }
        ).encode()

        async def run() -> list[tuple[int, str, bytes]]:
            return await asyncio.gather(*(_stream(port, body) for _ in range(n)))

        results = asyncio.run(run())
        ok = [d for s, _, d in results if s == 200]
        refused = [(s, r) for s, r, _ in results if s in (429, 503)]
        assert len(ok) + len(refused) == n, {s for s, _, _ in results}
        assert all(b"data: [DONE]" in d for d in ok)
        assert all(1 <= int(r) <= 120 for _, r in refused)
        assert ok, "nothing was served"
        assert _wait_for(lambda: stack.gateway.inflight.inflight == 0, 60)


# -- the relay hub: one reader for every stream of the process -------------------------------
def test_relay_hub_delivers_every_stream_in_order_and_ends_each() -> None:
    from tests.support.stores import embedded_redis, temp_data_dir
    from tokenfleet.live.relay import RelayHub, RelayWriter
    from tokenfleet.live.state import LiveState

    n = 300  # above RelayHub.PAUSE_FROM: the batched reads
    with temp_data_dir() as d, embedded_redis(d) as server:
        state = LiveState.from_url(server.url, prefix="hub")
        hub = RelayHub(state)
        try:
            subs = {}
            for i in range(n):
                rid = f"r{i}"
                subs[rid] = hub.subscribe(rid)
                if i % 50 == 0:
                    hub.wake_now()
            hub.wake_now()
            writers = {rid: RelayWriter(state, rid, ttl_s=60) for rid in subs}
            for k in range(3):
                for rid, w in writers.items():
                    w.delta(f"{rid}-{k} ", 1)
            for w in writers.values():
                w.end("stop", {"completion_tokens": 3})
            for rid, sub in subs.items():

                def never_idle() -> None:
                    raise AssertionError("a stream went quiet")

                events = list(sub.events(never_idle, idle_ms=10_000))
                assert [e.kind for e in events] == ["d", "d", "d", "end"]
                assert "".join(e.text for e in events) == f"{rid}-0 {rid}-1 {rid}-2 "
            assert len(hub) == 0  # every finished stream left the hub's set
        finally:
            hub.close()
