"""Beat's control loops and the engine KV-event relay, on a live stack.

Beat runs as its own process (Celery beat + control worker); the SLOMax tick
every 0.5 s and the FleetMind cycle every 2 s. Engines publish vLLM KV events
over ZeroMQ and the workers relay them into the shared prefix index.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import sqlalchemy as sa

from tests.support.stack import InstanceSpec, LiveStack
from tokenfleet.service.db import make_engine
from tokenfleet.tokenizer import chat_block_hashes

KV = {"kv_events_endpoint": "tcp://127.0.0.1:*"}


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    with live_stack(
        router="tokenpilot",
        with_beat=True,
        live_overrides={"control_period_s": 0.5, "fleet_period_s": 2.0},
        instances=[InstanceSpec("dc-a", "a0", dict(KV)), InstanceSpec("dc-b", "b0", dict(KV))],
    ) as s:
        yield s


def _wait(cond, timeout_s: float = 15.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_beat_runs_both_loops_visible_in_logs_metrics_and_ledger(stack: LiveStack) -> None:
    st = stack.gateway.state
    assert _wait(lambda: st.counters().get("control_ticks", 0) >= 3)
    assert _wait(lambda: st.counters().get("fleet_cycles", 0) >= 1)
    assert {"interactive", "long_context", "batch"} <= set(st.shares())
    assert {"batch_share", "long_share", "reject_factor"} <= set(st.thresholds())
    m = requests.get(stack.url + "/metrics", timeout=5).text
    assert 'tokenfleet_tier_share{tier="batch"}' in m
    assert 'tokenfleet_admission_knob{knob="reject_factor"}' in m
    assert 'tokenfleet_fleet_events_total{event="control_ticks"}' in m
    log = stack.sup.children["beat"].log_path.read_text()  # type: ignore[union-attr]
    assert "SLOMax tick" in log and "FleetMind cycle" in log
    engine = make_engine(stack.database_url)  # type: ignore[arg-type]
    try:
        with engine.connect() as conn:
            n = conn.execute(sa.text("SELECT count(*) FROM tier_shares")).scalar_one()
    finally:
        engine.dispose()
    assert n >= 3


def test_controller_cuts_the_batch_share_when_interactive_misses(stack: LiveStack) -> None:
    st = stack.gateway.state
    assert _wait(lambda: st.thresholds().get("batch_share") is not None)
    before = st.thresholds()["batch_share"]
    assert before is not None
    # what workers report when interactive requests miss their SLO while batch waits
    for _ in range(6):
        st.count(arrived_interactive=40, finished_interactive=40, slo_met_interactive=10)
        st.queued_incr("dc-a.batch", 0)
        time.sleep(0.5)
    assert _wait(lambda: (st.thresholds().get("batch_share") or 1.0) < before, 10)
    assert st.shares()["batch"] < before, "workers get the new batch share"


def test_engine_kv_events_feed_the_shared_prefix_index(stack: LiveStack) -> None:
    c = stack.client()
    msgs = [{"role": "system", "content": "Z" * 8000}, {"role": "user", "content": "kv?"}]
    resp = c.chat.completions.create(model=stack.model, max_tokens=2, messages=msgs)
    rid = resp.id.removeprefix("chatcmpl-")
    inst = stack.ledger_rows(
        f"request_id = '{rid}'", expect=lambda rows: bool(rows) and bool(rows[0]["instance"])
    )[0]["instance"]
    hashes = chat_block_hashes(msgs)
    gw = stack.gateway
    # the engine's own BlockStored events (same hashes as the emulator computes)
    assert _wait(lambda: gw.index.match_instance(inst, hashes) >= len(hashes) - 1, 10)
    # AllBlocksCleared from the engine reaches the index: the relay is exact, not guessed
    stack.emulators[inst].loop.reset_prefix_cache()
    assert _wait(lambda: gw.index.match_instance(inst, hashes) == 0, 10)


def test_the_long_context_lane_grows_with_the_long_prompt_work_it_sees(stack: LiveStack) -> None:
    """Beat's controller sizes SLOMax's long-context lane from the window's work
    mix (uncached prompt tokens per tier, counted by the API as it publishes).
    Without that count the lane kept its initial share whatever the traffic.
    Workers count first tokens and those within the TTFT limit per tier."""
    st = stack.gateway.state
    assert _wait(lambda: st.thresholds().get("long_share") is not None)
    before = st.thresholds()["long_share"]
    assert before is not None
    seen = st.counters()
    c = stack.client()
    ids = []
    for k in range(6):  # 10k-token prompts, spread over several control periods
        msgs = [{"role": "user", "content": f"{k} " + "long context " * 3200}]
        resp = c.chat.completions.create(model=stack.model, max_tokens=2, messages=msgs)
        ids.append(resp.id.removeprefix("chatcmpl-"))
        time.sleep(0.3)

    def grew(name: str) -> int:
        return st.counters().get(name, 0) - seen.get(name, 0)

    assert grew("prefill_tokens_long_context") >= 6 * 9000
    # and the faster signal, first tokens within the TTFT limit (a 10k prompt: 2 s)
    assert _wait(lambda: grew("first_tokens_long_context") == 6, 5)
    rows = stack.ledger_rows(
        "request_id IN ({})".format(",".join(f"'{i}'" for i in ids)),
        expect=lambda rows: len(rows) == 6 and all(r["first_token_ts"] for r in rows),
    )
    in_time = sum(  # within the long-context tier's TTFT limit (1 s + 0.1 s per 1k tokens)
        (r["first_token_ts"] - r["arrival_ts"]).total_seconds()
        <= 1.0 + 0.1 * r["prompt_tokens"] / 1000
        for r in rows
    )
    assert grew("ttft_met_long_context") == in_time
    assert _wait(lambda: (st.thresholds().get("long_share") or 0.0) >= before + 0.3, 15), (
        before,
        st.thresholds(),
    )
    # and says the share is measured, so the API's SLOMax stops sizing the lane
    # from its own arrivals (as it does before beat's first window with work)
    assert st.thresholds().get("lane_measured") == 1.0
