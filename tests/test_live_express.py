"""Express dispatch (``LiveConfig.express_dispatch``): a request whose routed
instance is idle is claimed and run by the API itself, with no broker message
and no worker hop; a busy instance's request still goes through its worker.

Two engines with one slot each, round robin, on a real live stack (Redis,
PostgreSQL, Celery workers, emulators in this process at 1/5 real time).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import redis

from tests.support.stack import InstanceSpec, LiveStack
from tokenfleet.live import steps
from tokenfleet.live.direct import outcome_key


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    with live_stack(
        router="round_robin",
        time_scale=0.2,
        app_config={"CHAT_QUOTAS": False},
        # unhealthy for a minute: the check below must not race the mark's expiry
        live_overrides={
            "engine_fail_threshold": 2,
            "engine_unhealthy_s": 60.0,
            "fleet_policy": "off",
        },
        instances=[InstanceSpec("dc-a", "a0", slots=1), InstanceSpec("dc-a", "a1", slots=1)],
    ) as s:
        yield s


def _wait_for(pred: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _kinds(stack: LiveStack, rid: str) -> list[str]:
    state = stack.gateway.state
    return [f[b"k"].decode() for _id, f in state.r.xrange(state.stream_key(rid))]


def _express_count(stack: LiveStack) -> int:
    return stack.gateway.state.counters().get("dispatched_express", 0)


def _chat(stack: LiveStack, tokens: int, tag: str, stream: bool = True) -> tuple[str, str, Any]:
    """One chat of exactly ``tokens`` output tokens: (request id, text, usage)."""
    kw: dict[str, Any] = {
        "model": stack.model,
        "max_tokens": tokens,
        "extra_body": {"vllm_xargs": {"output_tokens": tokens}},
        "messages": [{"role": "user", "content": f"{tag} {uuid.uuid4().hex}"}],
    }
    c = stack.client(timeout=60)
    if not stream:
        resp = c.chat.completions.create(**kw)
        return resp.id.removeprefix("chatcmpl-"), resp.choices[0].message.content or "", resp.usage
    text, usage, rid = "", None, ""
    for chunk in c.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kw
    ):
        rid = chunk.id.removeprefix("chatcmpl-")
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    return rid, text, usage


def _row(stack: LiveStack, rid: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        timeout_s=15,
        expect=lambda rows: bool(rows) and rows[0]["status"] in statuses,
    )
    assert rows and rows[0]["status"] in statuses, rows
    return rows[0]


def _idle(stack: LiveStack) -> bool:
    """No request at an engine and no dispatch booked on any instance."""
    state = stack.gateway.state
    accts = state.accounting(["a0", "a1"]).values()
    engines = sum(len(e.loop.handles) for e in stack.emulators.values())
    return engines == 0 and all(a.inflight_requests == 0 for a in accts)


@pytest.mark.parametrize("stream", [True, False])
def test_an_idle_instance_is_served_by_the_api_alone(stack: LiveStack, stream: bool) -> None:
    assert _wait_for(lambda: _idle(stack))
    before = _express_count(stack)
    rid, text, usage = _chat(stack, 30, "express", stream)
    assert usage is not None and usage.completion_tokens == 30
    assert len(text.split()) >= 15
    assert _express_count(stack) == before + 1
    # no worker took part: no hand-over on the request's stream, no outcome
    # stream for a worker to read; the API's own settle wrote the end entry
    assert _kinds(stack, rid) == ["end"]
    assert not stack.gateway.state.r.exists(outcome_key(stack.gateway.state, rid, 1))
    st = stack.gateway.state.request_state(rid)
    assert st["status"] == "done" and st["owner"] == stack.gateway.direct_calls.owner
    row = _row(stack, rid, ("completed", "slo_missed"))
    assert row["instance"] in ("a0", "a1") and row["attempts"] == 1
    assert row["completion_tokens"] == 30 and row["dispatched_ts"] is not None
    # the dispatch booked on the instance is released, and so is the count
    # the API adds to the workers' running counts for admission
    assert _wait_for(lambda: _idle(stack))
    assert stack.gateway.express_running == {}


def test_busy_instances_get_their_requests_through_their_workers(stack: LiveStack) -> None:
    """Both instances run a long answer in their only slot: a third request
    is not run by the API but queued for a worker, which hands it over."""
    assert _wait_for(lambda: _idle(stack))
    before = _express_count(stack)
    out: list[tuple[str, str, Any]] = []
    long = [
        threading.Thread(target=lambda: out.append(_chat(stack, 900, "long"))) for _ in range(2)
    ]
    for t in long:
        t.start()
        time.sleep(0.2)
    assert _wait_for(lambda: sum(len(e.loop.handles) for e in stack.emulators.values()) == 2)
    assert _express_count(stack) == before + 2
    rid, _text, usage = _chat(stack, 10, "queued")
    for t in long:
        t.join(60)
    assert usage is not None and usage.completion_tokens == 10
    assert _express_count(stack) == before + 2
    assert _kinds(stack, rid) == ["go", "end"]  # a worker claimed it and handed it over
    assert len(out) == 2 and all(u is not None and u.completion_tokens == 900 for *_, u in out)
    _row(stack, rid, ("completed", "slo_missed"))
    assert _wait_for(lambda: _idle(stack))


def test_a_client_that_leaves_cancels_the_api_run_request(stack: LiveStack) -> None:
    assert _wait_for(lambda: _idle(stack))
    before = _express_count(stack)
    c = stack.client(timeout=60)
    resp = c.chat.completions.create(
        model=stack.model,
        max_tokens=3000,
        extra_body={"vllm_xargs": {"output_tokens": 3000}},
        messages=[{"role": "user", "content": f"leave {uuid.uuid4().hex}"}],
        stream=True,
    )
    first = next(iter(resp))
    rid = first.id.removeprefix("chatcmpl-")
    assert _express_count(stack) == before + 1
    resp.close()  # the client goes away mid-answer
    row = _row(stack, rid, ("cancelled",))
    assert (row["completion_tokens"] or 0) < 3000
    assert _wait_for(lambda: _idle(stack)), "the engine call or its booking outlived the client"


def test_engine_errors_resend_through_the_broker_and_mark_the_engine(stack: LiveStack) -> None:
    """a0 answers 500 to everything: the requests the API ran there are re-sent
    through the broker (attempt 2, served by a1's worker), and after two such
    failures the API marks a0 unhealthy as a worker would."""
    assert _wait_for(lambda: _idle(stack))
    state = stack.gateway.state
    stack.emulators["a0"].config.fail_5xx_rate = 1.0
    try:
        ids = [_chat(stack, 3, f"fail {i}", stream=i % 2 == 0)[0] for i in range(6)]
        rows = [_row(stack, rid, ("completed", "slo_missed")) for rid in ids]
        assert all(r["instance"] == "a1" for r in rows), [r["instance"] for r in rows]
        assert any(r["attempts"] == 2 for r in rows), "none was tried on a0 first"
        a0 = next(i for i in state.instances() if i.instance_id == "a0")
        assert a0.unhealthy_until_s > time.time() and "500" in a0.unhealthy_reason
    finally:
        stack.emulators["a0"].config.fail_5xx_rate = 0.0
        state.mark_unhealthy("a0", -1.0, "")
    assert _wait_for(lambda: _idle(stack))


def test_the_engine_starts_before_the_dispatch_writes_and_a_failed_write_aborts_it(
    stack: LiveStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The express request is on its engine while the dispatch's Redis round
    trip runs (the writes no longer precede the engine's prefill); when that
    round trip fails the client gets a 503 and the engine's request is
    aborted, not left running unowned."""
    for i in range(2):  # a keep-alive connection to each engine (round robin) to send on
        _chat(stack, 1, f"warm {i}")
    assert _wait_for(lambda: _idle(stack))
    gw = stack.gateway
    writes = gw._dispatch_writes
    at_writes: list[int] = []

    def failing_writes(*args: Any, **kwargs: Any) -> None:
        express = args[-1] if len(args) >= 8 else kwargs.get("express", False)
        if express:
            _wait_for(lambda: sum(len(e.loop.handles) for e in stack.emulators.values()) > 0, 5)
            at_writes.append(sum(len(e.loop.handles) for e in stack.emulators.values()))
            raise redis.ConnectionError("injected: the dispatch's round trip failed")
        writes(*args, **kwargs)

    monkeypatch.setattr(gw, "_dispatch_writes", failing_writes)
    with pytest.raises(openai.APIStatusError) as exc:
        stack.client(timeout=30).chat.completions.create(
            model=stack.model,
            max_tokens=3000,
            extra_body={"vllm_xargs": {"output_tokens": 3000}},
            messages=[{"role": "user", "content": f"lost write {uuid.uuid4().hex}"}],
        )
    assert exc.value.status_code == 503
    assert at_writes == [1], "the engine had not received the request when the writes ran"
    monkeypatch.undo()
    assert _wait_for(lambda: _idle(stack)), "the engine call outlived its failed dispatch"


def test_the_api_stamps_each_step_of_an_express_stream_in_order(
    stack: LiveStack, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/live_routers.py --steps`` reads these: every step of the
    request path, in the order the request takes them, once per request."""
    monkeypatch.setattr(steps, "_DIR", str(tmp_path))
    monkeypatch.setattr(steps, "ENABLED", True)
    assert _wait_for(lambda: _idle(stack))
    before = _express_count(stack)
    rid, _text, usage = _chat(stack, 5, "steps")
    assert usage is not None and _express_count(stack) == before + 1
    got = steps.read_steps(tmp_path)
    assert list(got) == [rid]
    names = [n for n, _ in got[rid]]
    assert names == [
        "app",
        "view",
        "authenticated",
        "body_read",
        "validated",
        "dispatch",
        "prefetched",
        "admitted",
        "routed",
        "engine_call",
        "engine_sent",
        "state_written",
        "dispatched",
        "first_event",
        "first_written",
    ]
    times = [t for _, t in got[rid]]
    assert times == sorted(times)
    # nothing is written once the stamps are off
    monkeypatch.setattr(steps, "ENABLED", False)
    _chat(stack, 3, "unstamped")
    assert list(steps.read_steps(tmp_path)) == [rid]
