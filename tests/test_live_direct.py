"""The direct path (tokenfleet/live/direct.py): the worker claims the request and
hands the engine call to the API, which streams the engine itself; the worker
settles. Checked on a live stack by what crosses Redis per request, and by the
worker settling a request whose API never took it."""

from __future__ import annotations

import dataclasses
import gc
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.stack import LiveStack
from tokenfleet.live.direct import outcome_key
from tokenfleet.live.gateway.pump import StreamPump
from tokenfleet.live.jobs import ChatJob, send_chat_job


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    # the worker's hand-over is what these tests check: the API's own
    # attempts (express dispatch) are tests/test_live_express.py's
    with live_stack(
        app_config={"CHAT_QUOTAS": False}, live_overrides={"express_dispatch": False}
    ) as s:
        yield s


def _kinds(stack: LiveStack, key: str) -> list[str]:
    r = stack.gateway.state.r
    return [fields[b"k"].decode() for _id, fields in r.xrange(key)]


def _served(stack: LiveStack, rid: str) -> dict[str, Any]:
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        expect=lambda rows: bool(rows) and rows[0]["status"] in ("completed", "slo_missed"),
    )
    assert rows and rows[0]["status"] in ("completed", "slo_missed"), rows
    return rows[0]


def _chat(stack: LiveStack, stream: bool, tokens: int, tag: str) -> tuple[str, str, Any, int]:
    """One chat of exactly ``tokens`` output tokens: its request id, text,
    usage and how many chunks carried text (1 when not streamed)."""
    c = stack.client()
    kw: dict[str, Any] = {
        "model": stack.model,
        "max_tokens": tokens,
        "extra_body": {"vllm_xargs": {"output_tokens": tokens}},
        "messages": [{"role": "user", "content": f"{tag} {uuid.uuid4().hex}"}],
    }
    if not stream:
        resp = c.chat.completions.create(**kw)
        return (
            resp.id.removeprefix("chatcmpl-"),
            resp.choices[0].message.content or "",
            resp.usage,
            1,
        )
    chunks = list(
        c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    texts = [ch.choices[0].delta.content for ch in chunks if ch.choices]
    rid = chunks[0].id.removeprefix("chatcmpl-")
    return rid, "".join(t or "" for t in texts), chunks[-1].usage, sum(1 for t in texts if t)


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_cross_no_redis_stream_and_the_worker_settles(
    stack: LiveStack, stream: bool
) -> None:
    """Per request: ``go`` and ``end`` on the relay stream, ``ft`` and ``out`` on
    the outcome stream, none per token; the answer and the worker's row whole."""
    rid, text, usage, _ = _chat(stack, stream, 40, "direct")
    assert usage is not None and usage.completion_tokens == 40
    assert len(text.split()) >= 20
    state = stack.gateway.state
    assert _kinds(stack, state.stream_key(rid)) == ["go", "end"]
    assert _kinds(stack, outcome_key(state, rid, 1)) == ["ft", "out"]
    row = _served(stack, rid)
    assert row["completion_tokens"] == 40 and row["first_token_ts"] is not None
    assert row["instance"] and row["attempts"] == 1


def test_the_relay_path_is_still_there_behind_the_switch(stack: LiveStack) -> None:
    gw = stack.gateway
    before = gw.live
    gw.live = dataclasses.replace(before, direct_stream=False)
    try:
        resp = stack.client().chat.completions.create(
            model=stack.model,
            max_tokens=5,
            extra_body={"vllm_xargs": {"output_tokens": 5}},
            messages=[{"role": "user", "content": "relayed"}],
        )
    finally:
        gw.live = before
    rid = resp.id.removeprefix("chatcmpl-")
    kinds = _kinds(stack, gw.state.stream_key(rid))
    assert "go" not in kinds and "d" in kinds and kinds[-1] == "end"
    assert _served(stack, rid)["completion_tokens"] == 5


def test_without_engine_kv_events_the_api_publishes_the_prompts_blocks(stack: LiveStack) -> None:
    """The worker has no prompt on this path: the API, which hashed it, tells
    every replica that the serving instance holds it once prefill is done."""
    state = stack.gateway.state
    last, _ = state.read_kv_events("0-0", count=100_000)
    resp = stack.client().chat.completions.create(
        model=stack.model,
        max_tokens=2,
        messages=[{"role": "user", "content": "blocks " * 400 + uuid.uuid4().hex}],
    )
    row = _served(stack, resp.id.removeprefix("chatcmpl-"))
    deadline = time.time() + 10
    events: list[Any] = []
    while time.time() < deadline:
        _, events = state.read_kv_events(last, count=100_000)
        if any(not e.exact and e.instance_id == row["instance"] for e in events):
            break
        time.sleep(0.1)
    mine = [e for e in events if not e.exact and e.instance_id == row["instance"]]
    assert mine and len(mine[0].block_hashes) >= 40  # ~700 byte-tokenizer tokens, 16 a block


def test_a_request_whose_api_is_gone_is_settled_by_its_worker(stack: LiveStack) -> None:
    """An API that dies holding direct requests stops renewing its liveness key;
    the worker that handed one over settles it (failed) instead of holding its
    slot for the request timeout."""
    state = stack.gateway.state
    rid = uuid.uuid4().hex
    spec = stack.instances[0]
    queue = f"{spec.dc}.{spec.instance_id}.interactive"
    job = ChatJob(
        request_id=rid,
        attempt=1,
        tenant="default",
        tier="interactive",
        model=stack.model,
        body={},
        input_tokens=10,
        max_tokens=3,
        arrival_ts=time.time(),
        queue=queue,
        direct="an-api-that-died",
    )
    assert state.create_request(rid, queue, 600)
    state.queued_incr(queue)
    send_chat_job(stack.app.extensions["tokenfleet.celery"].send_task, job)
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        timeout_s=30,
        expect=lambda rows: bool(rows) and rows[0]["status"] == "failed",
    )
    assert rows and rows[0]["status"] == "failed", rows
    assert "API" in (rows[0]["error"] or "")
    assert state.request_state(rid).get("final") == "failed"
    assert _kinds(stack, state.stream_key(rid)) == ["go", "err"]


@pytest.mark.parametrize("stream", [True, False])
def test_the_stream_pump_carries_a_stream_past_its_first_token(
    stack: LiveStack, stream: bool
) -> None:
    """With the pump on (``api_stream_pump``), the request's thread sends the
    first token and the pump the rest: the answer is whole, its usage right,
    the worker settles it, and the pump holds nothing afterwards."""
    gw = stack.gateway
    before, gw.pump = gw.pump, StreamPump()
    try:
        rid, text, usage, text_chunks = _chat(stack, stream, 60, "pumped")
        assert text_chunks > 1 or not stream
        assert usage is not None and usage.completion_tokens == 60
        assert len(text.split()) >= 30
        row = _served(stack, rid)
        assert row["completion_tokens"] == 60
        assert gw.pump.carried == 1 and len(gw.pump) == 0
    finally:
        pump, gw.pump = gw.pump, before
        if pump is not None:
            pump.close()


def test_a_pumped_stream_leaves_no_reference_cycle(stack: LiveStack) -> None:
    """A finished stream's request objects are freed when the request ends, not
    by a full collection: with thousands of streams those are what a full
    collection of the API process spent hundreds of milliseconds on."""
    from tokenfleet.live.gateway.dispatch import Dispatched

    gw = stack.gateway
    before, gw.pump = gw.pump, StreamPump()
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # cyclic garbage is kept in gc.garbage, not freed
    try:
        rid, _text, _usage, chunks = _chat(stack, True, 40, "no-cycle")
        _served(stack, rid)
        assert chunks > 1 and gw.pump.carried == 1
        gc.collect()
        stuck = [o for o in gc.garbage if isinstance(o, Dispatched)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        pump, gw.pump = gw.pump, before
        if pump is not None:
            pump.close()
    assert stuck == [], "a streamed request's Dispatched was freed only by the cycle collector"
