"""The live request path end to end: openai client -> Flask -> Celery -> worker ->
emulated engine -> Redis Stream -> client, with the ledger in real PostgreSQL.

One stack per module (embedded Redis + PostgreSQL, two emulators, two real
Celery worker processes, the API on a real socket); nothing is mocked.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from tests.support.stack import API_KEY, TENANT, InstanceSpec, LiveStack

MAX_LEN = 8192  # small context so the "prompt too long" case stays cheap


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    emu = {"max_model_len_tokens": MAX_LEN}
    with live_stack(
        router="tokenpilot",
        instances=[InstanceSpec("dc-a", "a0", dict(emu)), InstanceSpec("dc-b", "b0", dict(emu))],
    ) as s:
        yield s


def _words(text: str) -> int:
    return len(text.split())


def test_non_stream_completion_through_the_full_path(stack: LiveStack) -> None:
    c = stack.client()
    resp = c.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Say hello to the fleet."}],
        max_tokens=12,
        user="u-1",
    )
    assert resp.object == "chat.completion"
    assert resp.model == stack.model
    text = resp.choices[0].message.content or ""
    assert resp.usage is not None
    assert 1 <= resp.usage.completion_tokens <= 12
    # the emulator writes one word per token: the relay lost and duplicated nothing
    assert _words(text) == resp.usage.completion_tokens
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.prompt_tokens > 0


def _ttft_observed(stack: LiveStack) -> float:
    """Requests the API's TTFT histogram has seen (the first token's feedback
    ran: router, admission, FleetMind and this metric)."""
    text = requests.get(stack.url + "/metrics", timeout=10).text
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("tokenfleet_ttft_seconds_count")
    )


def test_stream_with_usage_then_done(stack: LiveStack) -> None:
    before = _ttft_observed(stack)
    c = stack.client()
    stream = c.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Stream me some words."}],
        max_completion_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finishes = [
        ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason
    ]
    assert finishes == [finishes[-1]] and finishes[-1] in ("stop", "length")
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None, "usage chunk comes last"
    assert last.usage.completion_tokens == _words(content)
    assert all(ch.usage is None for ch in chunks[:-1])
    assert len({ch.id for ch in chunks}) == 1
    assert _ttft_observed(stack) == before + 1


def test_raw_sse_framing_ends_with_done(stack: LiveStack) -> None:
    r = requests.post(
        stack.url + "/v1/chat/completions",
        stream=True,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": stack.model,
            "stream": True,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in r.iter_lines() if line and not line.startswith(b":")]
    assert events[-1] == b"data: [DONE]"
    first = json.loads(events[0][len(b"data: ") :])
    assert first["choices"][0]["delta"]["role"] == "assistant"
    # no usage chunk when not asked for
    assert all(b'"usage"' not in e for e in events)


def test_ledger_rows_match_the_requests(stack: LiveStack) -> None:
    c = stack.client()
    ids = {}
    for i in range(4):
        resp = c.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"ledger check {i}"}],
            max_tokens=6,
        )
        assert resp.usage is not None
        ids[resp.id.removeprefix("chatcmpl-")] = resp.usage
    rows = stack.ledger_rows(
        expect=lambda rows: (
            ids.keys()
            <= {r["request_id"] for r in rows if r["status"] in ("completed", "slo_missed")}
        )
    )
    by_id = {r["request_id"]: r for r in rows}
    for rid, usage in ids.items():
        row = by_id[rid]
        assert row["status"] in ("completed", "slo_missed")
        assert row["tenant_id"] == TENANT
        assert row["tier"] == "interactive"
        assert row["model"] == stack.model
        assert row["dc"] in ("dc-a", "dc-b") and row["instance"] in ("a0", "b0")
        assert row["prompt_tokens"] == usage.prompt_tokens
        assert row["completion_tokens"] == usage.completion_tokens
        assert row["cached_tokens"] == (usage.prompt_tokens_details.cached_tokens or 0)
        assert row["attempts"] == 1
        ts = [
            row[k]
            for k in ("arrival_ts", "admitted_ts", "dispatched_ts", "first_token_ts", "finished_ts")
        ]
        assert all(t is not None for t in ts), row
        assert ts == sorted(ts), f"timestamps out of order: {ts}"
    # exactly one row per request: no duplicate rows under other ids either
    assert not [r for r in rows if r["status"] == "duplicate"]


@pytest.mark.parametrize(
    "payload, status, param, code",
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model", None),
        (
            {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model",
            "model_not_found",
        ),
        (
            {"model": "@MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": "@MODEL", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
            400,
            "max_tokens",
            "invalid_value",
        ),
        (
            {"model": "@MODEL", "messages": [{"role": "user", "content": "x" * (4 * MAX_LEN)}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        (
            {
                "model": "@MODEL",
                "messages": [{"role": "user", "content": "x" * (2 * MAX_LEN)}],
                "max_tokens": MAX_LEN,
            },
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ({"model": "@MODEL", "messages": []}, 400, "messages", None),
        (
            {
                "model": "@MODEL",
                "messages": [{"role": "user", "content": "x"}],
                "stream_options": {"include_usage": True},
            },
            400,
            "stream_options",
            None,
        ),
    ],
)
def test_bad_requests_get_openai_shaped_errors(
    stack: LiveStack, payload: dict, status: int, param: str, code: str | None
) -> None:
    if payload.get("model") == "@MODEL":
        payload = dict(payload, model=stack.model)
    r = requests.post(
        stack.url + "/v1/chat/completions",
        json=payload,
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code
    assert err["message"]


def test_malformed_json_is_a_400(stack: LiveStack) -> None:
    r = requests.post(
        stack.url + "/v1/chat/completions",
        data=b"{not json",
        timeout=10,
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


def test_missing_or_bad_api_key_is_a_401(stack: LiveStack) -> None:
    body = {"model": stack.model, "messages": [{"role": "user", "content": "x"}]}
    r = requests.post(stack.url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}])
    assert exc.value.status_code == 401


def test_openai_client_maps_errors_to_its_exceptions(stack: LiveStack) -> None:
    c = stack.client()
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(
            model=stack.model, max_tokens=0, messages=[{"role": "user", "content": "x"}]
        )
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]


def test_models_health_metrics_openapi(stack: LiveStack) -> None:
    c = stack.client()
    c.chat.completions.create(
        model=stack.model, max_tokens=2, messages=[{"role": "user", "content": "metrics please"}]
    )
    models = [m.id for m in c.models.list()]
    assert models == [stack.model]
    h = requests.get(stack.url + "/health", timeout=5).json()
    assert h["status"] == "ok" and set(h["instances"]) == {"a0", "b0"}
    assert all(v["age_s"] < 2.0 for v in h["instances"].values())
    m = requests.get(stack.url + "/metrics", timeout=5).text
    assert 'tokenfleet_instance_healthy{dc="dc-a",instance="a0"} 1.0' in m
    assert "tokenfleet_requests_total" in m and "tokenfleet_ttft_seconds_bucket" in m
    doc = requests.get(stack.url + "/openapi.json", timeout=5).json()
    assert doc["openapi"].startswith("3.")
    routes = {
        str(rule.rule).replace("<path:model>", "{model}")
        for rule in stack.app.url_map.iter_rules()
        if rule.endpoint.split(".")[0] in ("openai", "ops")
    }
    assert "/v1/chat/completions" in routes
    assert routes <= set(doc["paths"]), routes - set(doc["paths"])
    props = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for f in (
        "model",
        "messages",
        "max_completion_tokens",
        "max_tokens",
        "stream",
        "stream_options",
        "user",
        "prompt_cache_key",
    ):
        assert f in props


def test_unknown_route_and_method_are_openai_shaped(stack: LiveStack) -> None:
    r = requests.get(stack.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(stack.url + "/v1/chat/completions", timeout=5)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_client_disconnect_cancels_and_records_it(stack: LiveStack) -> None:
    before = _ttft_observed(stack)
    r = requests.post(
        stack.url + "/v1/chat/completions",
        stream=True,
        timeout=30,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": stack.model,
            "stream": True,
            "max_tokens": 4000,
            "vllm_xargs": {"output_tokens": 4000},
            "messages": [{"role": "user", "content": "a long one"}],
        },
    )
    rid = r.headers["X-Request-Id"]
    lines = r.iter_lines()
    next(lines)
    next(lines)
    r.close()  # the client goes away mid-stream
    rows = stack.ledger_rows(
        f"request_id = '{rid}'",
        timeout_s=15,
        expect=lambda rows: bool(rows) and rows[0]["status"] == "cancelled",
    )
    assert rows and rows[0]["status"] == "cancelled"
    # the engine stopped generating: far fewer than 4000 tokens were made
    assert (rows[0]["completion_tokens"] or 0) < 4000
    # the first token's feedback ran once, though the client left right after it
    assert _ttft_observed(stack) == before + 1
