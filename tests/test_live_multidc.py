"""Two datacenters, each with its own broker, joined by a delaying WAN link.

The layout of docs/deployment.md ("Several regions") on one machine: the API
and the global stores (Redis hot state, PostgreSQL) sit in dc-a's region; each
DC has its own Redis broker next to its workers. dc-b's workers reach the
global Redis, and the API reaches dc-b's broker, through a :class:`WanLink`
(20 ms each way: a 40 ms RTT). Then the failures a multi-region team asks
about: dc-b's broker down, dc-b cut off, the link slow; residency holds in
each, and the fleet heals by itself.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.stack import API_KEY, PROFILE, InstanceSpec
from tokenfleet.live.brokers import DcBrokers, dc_of_queue, parse_dc_broker_urls

BANK_KEY = "tf-bank-key"  # tenant "bank": dc-b's region only (the topology says so)
ACME_KEY = "tf-acme-key"  # tenant "acme": at home in dc-b, may spill to dc-a
ONE_WAY_MS = 20.0


# ---- units: the broker map ---------------------------------------------------------------
def test_dc_broker_urls_parse_and_name_their_mistakes() -> None:
    assert parse_dc_broker_urls("") == {}
    assert parse_dc_broker_urls(" dc-a=redis://h:1/0 , dc-b=amqp://u@h// ") == {
        "dc-a": "redis://h:1/0",
        "dc-b": "amqp://u@h//",
    }
    for bad, says in [("dc-a", "DC=URL"), ("a.b=redis://x", "without dots"), ("a=x,a=y", "twice")]:
        with pytest.raises(ValueError, match=says):
            parse_dc_broker_urls(bad)
    assert dc_of_queue("dc-b.b0.interactive") == "dc-b" and dc_of_queue("dc-a.batch") == "dc-a"


def test_a_task_goes_to_its_queues_datacenter_broker_and_a_refusal_marks_it_down() -> None:
    sent: list[tuple[str, str]] = []

    class App:
        def __init__(self, url: str) -> None:
            self.url = url

        def send_task(self, name: str, *, queue: str, **_: Any) -> None:
            sent.append((self.url, queue))

    b = DcBrokers(App("default"), {"dc-b": "redis://b"}, App, down_for_s=5.0)
    b.send_task("t", queue="dc-a.interactive")
    b.send_task("t", queue="dc-b.b0.interactive")
    assert sent == [("default", "dc-a.interactive"), ("redis://b", "dc-b.b0.interactive")]
    assert b.own("dc-b") and not b.own("dc-a")
    b.mark_down("dc-b", "test", now_s=100.0)
    b.mark_down("dc-a", "test", now_s=100.0)  # the default broker: everyone's outage, not a DC's
    assert b.down_dcs(104.9) == {"dc-b"} and b.down_dcs(105.1) == set()


# ---- the live layout ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fleet(session_postgres: Any) -> Iterator[Any]:
    from tests.support.multidc import multidc_stack
    from tests.support.stores import temp_data_dir

    with temp_data_dir("tokenfleet-multidc-") as d:
        topo: Path = d / "topology.yaml"
        topo.write_text(
            textwrap.dedent(f"""\
            name: two-regions
            datacenters:
              dc-a: {{region: eu, deployments: [{{model: m, version: "1", profile: {PROFILE}}}]}}
              dc-b: {{region: us, deployments: [{{model: m, version: "1", profile: {PROFILE}}}]}}
            rtt_ms: {{dc-a: {{dc-b: {2 * ONE_WAY_MS:g}}}}}
            tenants:
              bank: {{home: dc-b, allowed_regions: [us], allow_cross_region: false}}
              acme: {{home: dc-b}}
            """)
        )
        with multidc_stack(
            d,
            # dc-b decodes in real time, so a long request is still running when
            # the link is cut (dc-a at the test stack's 50x speed)
            [InstanceSpec("dc-a", "a0"), InstanceSpec("dc-b", "b0", emulator={"time_scale": 1.0})],
            entry_dc="dc-a",
            rtt_ms=lambda a, b: 0.0 if a == b else 2 * ONE_WAY_MS,
            router="round_robin",
            time_scale=0.02,
            shared_postgres=session_postgres,
            live_overrides={
                "topology": str(topo),
                "fleet_policy": "fleetmind",
                "broker_down_s": 3.0,
            },
            app_config={"API_KEYS": {API_KEY: "test-tenant", BANK_KEY: "bank", ACME_KEY: "acme"}},
        ) as md:
            md.stack.wait_ready(timeout_s=90)
            yield {
                "stack": md.stack,
                "broker_a": md.brokers["dc-a"],
                "broker_b": md.brokers["dc-b"],
                "api_to_b": md.api_links["dc-b"],
                "state_link": md.state_links["dc-b"],
                "links_b": md.links_of("dc-b"),  # broker, state and engine links
                "engine_link_b": md.engine_links["dc-b"][0],
            }


def _chat(stack: Any, key: str, text: str, max_tokens: int = 4) -> Any:
    import requests

    return requests.post(
        stack.url + "/v1/chat/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {key}"},
        json={
            "model": stack.model,
            "max_tokens": max_tokens,
            "ignore_eos": True,  # exactly max_tokens tokens
            "messages": [{"role": "user", "content": text}],
        },
    )


def _rows_of(stack: Any, ids: list[str]) -> dict[str, dict[str, Any]]:
    rows = stack.ledger_rows(
        expect=lambda rows: (
            set(ids) <= {x["request_id"] for x in rows if x["status"] != "in_flight"}
        )
    )
    return {x["request_id"]: x for x in rows if x["request_id"] in ids}


def _rid(r: Any) -> str:
    return str(r.headers["X-Request-Id"])


def _until(what: Any, timeout_s: float, step_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(step_s)
    return False


@pytest.mark.slow
def test_each_datacenter_is_fed_through_its_own_broker(fleet: Any) -> None:
    stack = fleet["stack"]
    bank = [_chat(stack, key, f"home {i}") for i in range(3) for key in (BANK_KEY, ACME_KEY)]
    assert [r.status_code for r in bank] == [200] * 6, [r.text for r in bank]
    rows = _rows_of(stack, [_rid(r) for r in bank])
    assert {x["dc"] for x in rows.values()} == {"dc-b"}  # both at home
    assert {x["status"] for x in rows.values()} <= {"completed", "slo_missed"}
    # dc-b's tasks crossed the WAN to dc-b's broker; dc-a's broker never held a dc-b queue
    assert fleet["api_to_b"].chunks > 0
    a = fleet["broker_a"].client()
    assert not [k for k in a.keys("*") if k.startswith(b"dc-b.")]
    assert not [k for k in fleet["broker_b"].client().keys("*") if k.startswith(b"dc-a.")]


@pytest.mark.slow
def test_a_datacenter_broker_down_spills_what_may_spill_and_heals(fleet: Any) -> None:
    stack, broker_b = fleet["stack"], fleet["broker_b"]
    broker_b.stop()
    try:
        # the probe (every second) or the first refused publish marks dc-b down
        # acme is at home in dc-b: the first refused publish (or the probe, every
        # second) marks dc-b's broker down, and acme spills to dc-a
        codes = [_chat(stack, ACME_KEY, f"spill {i}").status_code for i in range(12)]
        assert codes.count(200) >= 10, codes  # only those before dc-b was marked down fail
        assert set(codes) <= {200, 503}, codes
        ok_after = [_chat(stack, ACME_KEY, f"after {i}") for i in range(4)]
        assert [r.status_code for r in ok_after] == [200] * 4
        assert {x["dc"] for x in _rows_of(stack, [_rid(r) for r in ok_after]).values()} == {"dc-a"}
        # bank may use dc-b's region only: a clear 503, never served in dc-a
        refused = _chat(stack, BANK_KEY, "bank while down")
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] in ("server_error", "service_unavailable")
    finally:
        broker_b.start()
    # heals by itself: within the probe period plus broker_down_s, bank is served in dc-b
    served: list[Any] = []
    assert _until(
        lambda: (
            served.append(_chat(stack, BANK_KEY, "bank again")) or (served[-1].status_code == 200)
        ),
        timeout_s=30,
        step_s=0.5,
    ), [r.status_code for r in served]
    rows = _rows_of(stack, [_rid(served[-1])])
    assert next(iter(rows.values()))["dc"] == "dc-b"


@pytest.mark.slow
def test_a_cut_off_datacenter_fails_its_requests_cleanly_and_comes_back(fleet: Any) -> None:
    stack = fleet["stack"]
    stale = stack.live.stale_after_s
    # a long bank request is in flight in dc-b when the WAN goes down
    import threading

    holder: dict[str, Any] = {}
    t = threading.Thread(
        target=lambda: holder.update(r=_chat(stack, BANK_KEY, "long one", max_tokens=4000))
    )
    t.start()
    time.sleep(0.5)
    for link in fleet["links_b"]:
        link.cut()
    try:
        # dc-b's snapshots go stale: FleetMind leaves dc-b out
        assert _until(
            lambda: (
                not any(
                    i.dc == "dc-b" and i.is_live(time.time(), stale)
                    for i in stack.gateway.state.instances()
                )
            ),
            timeout_s=20,
        )
        time.sleep(0.3)
        r = _chat(stack, ACME_KEY, "while cut")
        assert r.status_code == 200 and _rows_of(stack, [_rid(r)])[_rid(r)]["dc"] == "dc-a"
        refused = _chat(stack, BANK_KEY, "bank while cut")
        assert refused.status_code == 503, refused.text  # residency: 0 violations
        t.join(120)
        assert not t.is_alive()
        # the in-flight request ended, with a final ledger row (not left in flight)
        long_r = holder["r"]
        rid = _rid(long_r)
        row = _rows_of(stack, [rid])[rid]
        assert row["status"] in ("failed", "timed_out", "cancelled", "completed", "slo_missed")
        assert row["dc"] == "dc-b"
    finally:
        for link in fleet["links_b"]:
            link.heal()
    # the link is back: dc-b's worker reconnects, publishes snapshots, serves bank again
    assert _until(
        lambda: any(
            i.dc == "dc-b" and i.is_healthy(time.time(), stale)
            for i in stack.gateway.state.instances()
        ),
        timeout_s=60,
    )
    served: list[Any] = []
    assert _until(
        lambda: served.append(_chat(stack, BANK_KEY, "bank back")) or served[-1].status_code == 200,
        timeout_s=30,
        step_s=0.5,
    ), [r.status_code for r in served]


@pytest.mark.slow
def test_a_slow_link_still_serves_and_the_tokens_cross_it_once(fleet: Any) -> None:
    stack = fleet["stack"]
    engine_link = fleet["engine_link_b"]
    for link in fleet["links_b"]:
        link.one_way_ms = 60.0
    try:
        before = engine_link.chunks
        t0 = time.monotonic()
        r = _chat(stack, BANK_KEY, "slow link", max_tokens=16)
        took_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 16
        # the publish (API -> dc-b's broker) and the engine call (API -> dc-b's
        # engine, direct path) each cross the link at least once each way
        assert took_s >= 2 * 0.060
        # the tokens came from dc-b's engine over the link, straight to the API
        assert engine_link.chunks > before
    finally:
        for link in fleet["links_b"]:
            link.one_way_ms = ONE_WAY_MS
