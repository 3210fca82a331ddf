"""The live request path end to end: openai client -> Flask -> Celery -> worker ->
emulated engine -> Redis Stream -> client, with the ledger in real PostgreSQL.

One stack per module (embedded Redis + PostgreSQL, two emulators, two real
Celery worker processes, the API on a real socket); nothing is mocked.
"""

from __future__ import annotations

import json
import logging
import time
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


def test_a_stream_the_engine_refuses_gets_the_engines_status_not_a_200(
    stack: LiveStack, caplog: pytest.LogCaptureFixture
) -> None:
    """A streamed response is returned to the server before its first token
    (web.chat._deferred_sse); when the engine refuses the request instead,
    the client still gets that status, an OpenAI error body, its request id
    and a keep-alive connection that serves the next request."""
    body = {
        "model": stack.model,
        "messages": [{"role": "user", "content": "refused"}],
        "stream": True,
        "max_tokens": 5,
        "vllm_xargs": {"output_tokens": 0},  # the emulator's 400, as vLLM's own validation
    }
    caplog.set_level(logging.INFO, logger="tokenfleet.access")
    errors_before = _http_errors(stack, "400")
    with requests.Session() as s:
        s.headers["Authorization"] = f"Bearer {API_KEY}"
        r = s.post(stack.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.headers["Content-Type"] == "application/json"
        rid = r.headers.get("X-Request-Id")
        assert rid
        err = r.json()["error"]
        assert "output_tokens" in err["message"] and err["type"] == "invalid_request_error"
        ok = s.post(
            stack.url + "/v1/chat/completions",
            json={**body, "vllm_xargs": {"output_tokens": 3}},
            timeout=30,
            stream=True,
        )
        assert ok.status_code == 200 and ok.headers["Content-Type"].startswith("text/event-stream")
        text = ok.content.decode()
        assert text.rstrip().endswith("data: [DONE]")
    assert _http_errors(stack, "400") == errors_before + 1

    def access_line() -> dict[str, Any] | None:
        mine = [
            x for x in caplog.records if x.name == "tokenfleet.access" and rid in x.getMessage()
        ]
        return mine[0].fields if mine else None  # type: ignore[attr-defined]

    deadline = time.monotonic() + 10
    while access_line() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    line = access_line()
    assert line is not None and line["status"] == 400, line  # the status sent, not the 200 returned
    gw = stack.gateway
    deadline = time.monotonic() + 10
    while gw.inflight.inflight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gw.inflight.inflight == 0, "the refused stream kept its place in the in-flight bound"


def _http_errors(stack: LiveStack, status: str) -> float:
    text = requests.get(stack.url + "/metrics", timeout=10).text
    line = f'tokenfleet_http_errors_total{{status="{status}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(line))


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
    assert 'tokenfleet_api_thread_cpu_seconds_total{thread="CP Server"}' in m
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


# ---- input limits (issue #16) and compatibility (issue #18) ---------------------------------
def _chat(stack: LiveStack, body: dict[str, Any], key: str = API_KEY) -> requests.Response:
    return requests.post(
        stack.url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"Authorization": f"Bearer {key}"},
    )


def _raw_request(stack: LiveStack, head: bytes, body: bytes = b"") -> tuple[int, dict[str, Any]]:
    """Send ``head`` (and ``body``), then read the answer without sending the rest."""
    import http.client
    import socket

    port = int(stack.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, json.loads(resp.read())


def test_a_body_over_the_limit_is_refused_from_its_content_length(stack: LiveStack) -> None:
    declared = 300 * 1024 * 1024
    for path, ctype in (
        ("/v1/chat/completions", "application/json"),
        ("/v1/files", "multipart/form-data; boundary=x"),
    ):
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: {ctype}\r\nContent-Length: {declared}\r\n\r\n"
        ).encode()
        # only 1 KiB of the 300 MB is ever sent: the answer cannot wait for the rest
        status, body = _raw_request(stack, head, b"{" + b" " * 1023)
        err = body["error"]
        assert status == 413, body
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
        assert f"{declared:,} bytes" in err["message"]


def test_a_chunked_body_is_cut_off_with_413_once_past_the_limit(stack: LiveStack) -> None:
    limits = stack.app.extensions["tokenfleet.limits"]
    saved = (limits.max_body_bytes, limits.max_upload_bytes)
    limits.max_body_bytes = limits.max_upload_bytes = 64 * 1024
    try:

        def chunks() -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(64):  # 4 MiB if it were all read
                yield b"x" * 65536
            yield b'"}]}'

        r = requests.post(
            stack.url + "/v1/chat/completions",
            data=chunks(),
            timeout=30,
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        )
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"

        # a chunked upload past max_upload_bytes (+ 1 MiB of multipart framing): 413
        # naming the file, not "purpose must be one of batch (got None)"
        def multipart() -> Iterator[bytes]:
            yield (
                b'--b\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"'
                b"\r\nContent-Type: application/octet-stream\r\n\r\n"
            )
            for _ in range(64):  # 2 MiB
                yield b'{"a": 1}\n' * 3277
            yield b'\r\n--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch'
            yield b"\r\n--b--\r\n"

        r = requests.post(
            stack.url + "/v1/files",
            data=multipart(),
            timeout=30,
            headers={
                "Authorization": f"Bearer {API_KEY}",
                "Content-Type": "multipart/form-data; boundary=b",
            },
        )
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["param"] == "file" and err["code"] == "request_too_large"
        assert "split the file" in err["message"]
    finally:
        limits.max_body_bytes, limits.max_upload_bytes = saved


def test_deeply_nested_json_is_a_400_not_a_500(stack: LiveStack) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for depth in (10_000, 100):  # past the parser's recursion; parsed but over the limit
        for path in ("/v1/chat/completions", "/v1/batches"):
            r = requests.post(
                stack.url + path, data=b"[" * depth + b"]" * depth, headers=headers, timeout=30
            )
            assert r.status_code == 400, (path, depth, r.text)
            err = r.json()["error"]
            assert err["code"] == "invalid_json" and "nested deeper than 64" in err["message"]


@pytest.mark.parametrize(
    "extra, param, code",
    [
        ({"temperature": 5}, "temperature", "invalid_value"),
        ({"temperature": "hot"}, "temperature", None),
        ({"top_p": 1.5}, "top_p", "invalid_value"),
        ({"presence_penalty": -3}, "presence_penalty", "invalid_value"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"logit_bias": {"50256": 200}}, "logit_bias", None),
        ({"service_tier": "priority"}, "service_tier", "invalid_value"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", None),
        ({"response_format": {"type": "json_object"}}, "response_format", None),
        ({"logprobs": True}, "logprobs", None),
        ({"frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ],
)
def test_unsupported_or_invalid_parameters_are_400_naming_the_field(
    stack: LiveStack, extra: dict[str, Any], param: str, code: str | None
) -> None:
    body = {"model": stack.model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = _chat(stack, {**body, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert err["code"] == (code or err["code"])
    if param in ("tools", "response_format", "logprobs"):
        assert err["code"] == "unsupported_parameter"


def test_off_values_and_documented_pass_through_fields_are_accepted(stack: LiveStack) -> None:
    r = _chat(
        stack,
        {
            "model": stack.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x"}],
            "temperature": 0,
            "top_p": 1,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "logprobs": False,
            "store": False,
            "metadata": {"run": "ci"},
            "safety_identifier": "u-42",
            "service_tier": "auto",
        },
    )
    assert r.status_code == 200, r.text


def test_models_retrieve_works_with_the_slash_encoded(stack: LiveStack) -> None:
    assert "/" in stack.model  # meta-llama/Llama-3.1-8B-Instruct
    m = stack.client().models.retrieve(stack.model)  # the client sends meta-llama%2F...
    assert m.id == stack.model
    for path in (stack.model, stack.model.replace("/", "%2F")):
        r = requests.get(
            f"{stack.url}/v1/models/{path}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=10,
        )
        assert r.status_code == 200 and r.json()["id"] == stack.model, (path, r.text)


def test_401_is_one_message_everywhere_and_a_disabled_tenant_is_403(stack: LiveStack) -> None:
    from tokenfleet.tenancy import admin

    svc = stack.app.extensions["tokenfleet.tenancy"]
    admin.create_tenant(svc.engine, "off-co", actor="test", cache=svc.directory)
    key, _ = admin.create_key(svc.engine, "off-co", actor="test", cache=svc.directory)
    long_key = "tf-" + "k" * 6000
    messages = set()
    for path, method in (
        ("/v1/chat/completions", "post"),
        ("/v1/models", "get"),
        ("/v1/files", "get"),
        ("/v1/batches", "get"),
    ):
        for auth in (None, "Basic abc", "Bearer tf-unknown-key", f"Bearer {long_key}"):
            headers = {"Authorization": auth} if auth else {}
            r = requests.request(method, stack.url + path, headers=headers, timeout=10, json={})
            assert r.status_code == 401, (path, auth, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key"
            messages.add(r.json()["error"]["message"])
    assert len(messages) == 1, messages
    # an over-long key is refused before any lookup: nothing was cached for it
    from tokenfleet.service.ledger import hash_api_key

    assert svc.redis.exists(svc.directory._key_entry(hash_api_key(long_key))) == 0
    assert svc.redis.exists(svc.directory._key_entry(hash_api_key("tf-unknown-key"))) == 1

    body = {"model": stack.model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    assert _chat(stack, body, key).status_code == 200
    admin.update_tenant(svc.engine, "off-co", actor="test", disabled=True, cache=svc.directory)
    r = _chat(stack, body, key)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "tenant_disabled" and "off-co" in r.text
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0).models.list()


def test_oversized_headers_are_refused_by_the_server(stack: LiveStack) -> None:
    r = requests.get(
        stack.url + "/v1/models",
        headers={"Authorization": "Bearer " + "k" * 100_000},
        timeout=10,
    )
    assert r.status_code in (413, 431), r.status_code  # cheroot's "too large", not buffered
