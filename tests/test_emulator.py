"""The engine emulator over real HTTP: OpenAI API, metrics, caching, faults, KV events."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from tokenfleet.emulator import EmulatorServer, chat_block_hashes, prompt_block_hashes
from tokenfleet.emulator.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventSubscriber,
    decode_batch,
    encode_batch,
)
from tokenfleet.engine.profiles import get_profile
from tokenfleet.tokenizer import approx_num_tokens, render_chat

PROFILE = "llama3-8b-h200"
MODEL = get_profile(PROFILE).model.name
FAST = 0.05  # wall seconds per model second in most tests

# ~8000 tokens under the 4-bytes-per-token approximation
SYSTEM_PROMPT = " ".join(f"Rule {i}: answer politely and cite the handbook." for i in range(640))


@pytest.fixture
def server() -> Iterator[EmulatorServer]:
    srv = EmulatorServer(PROFILE, port=0, time_scale=FAST, seed=7)
    srv.start()
    yield srv
    srv.stop()


def chat(
    url: str,
    content: str,
    *,
    system: str | None = None,
    timeout: float = 10.0,
    headers: dict[str, str] | None = None,
    **body: Any,
) -> requests.Response:
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": content}
    ]
    payload = {"model": MODEL, "messages": messages, **body}
    return requests.post(
        url + "/v1/chat/completions",
        json=payload,
        headers=headers,
        timeout=timeout,
        stream=bool(body.get("stream")),
    )


def metrics(url: str) -> dict[str, float]:
    """Sample name -> value (labels dropped: one engine, one model)."""
    text = requests.get(url + "/metrics", timeout=5).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.endswith("_bucket") or s.name.endswith("_created"):
                continue
            key = s.name
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            out[key] = s.value
    return out


def sse_events(resp: requests.Response) -> list[Any]:
    events: list[Any] = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: ") :]
        events.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return events


def wait_for(cond: Any, timeout_s: float = 3.0, every_s: float = 0.02) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(every_s)
    return bool(cond())


# -- OpenAI API -----------------------------------------------------------------
def test_non_stream_chat_reports_usage_and_forced_length(server: EmulatorServer) -> None:
    content = "Summarise the plot of a long novel in detail. " * 20
    r = chat(server.url, content, max_tokens=100, headers={"X-Emulator-Output-Tokens": "7"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert len(choice["message"]["content"].split()) == 7
    use = body["usage"]
    expected_prompt = approx_num_tokens(render_chat([{"role": "user", "content": content}]))
    assert use["prompt_tokens"] == expected_prompt
    assert use["completion_tokens"] == 7
    assert use["total_tokens"] == expected_prompt + 7
    assert use["prompt_tokens_details"]["cached_tokens"] == 0

    # budget caps the forced length; ignore_eos runs to the budget
    r = chat(server.url, "hi", max_tokens=5, vllm_xargs={"output_tokens": 50})
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = chat(server.url, "hi", max_tokens=33, ignore_eos=True)
    assert r.json()["usage"]["completion_tokens"] == 33

    # /v1/completions with a token-id prompt and the body extension
    r = requests.post(
        server.url + "/v1/completions",
        timeout=10,
        json={
            "model": MODEL,
            "prompt": list(range(1, 41)),
            "max_tokens": 64,
            "vllm_xargs": {"output_tokens": 12},
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 40
    assert body["usage"]["completion_tokens"] == 12


def test_tokenize_detokenize_and_render_speak_vllms_shapes(server: EmulatorServer) -> None:
    """What real routers and benchmark clients call besides completions
    (vllm-router's kv_aware policy renders and tokenizes prompts itself)."""
    messages = [{"role": "user", "content": "count these tokens, please"}]
    tok = requests.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert tok.status_code == 200
    body = tok.json()
    used = chat(server.url, "count these tokens, please", max_tokens=2).json()["usage"]
    assert body["count"] == len(body["tokens"]) == used["prompt_tokens"]
    assert body["max_model_len"] > body["count"]
    plain = requests.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello"})
    back = requests.post(server.url + "/detokenize", json={"tokens": plain.json()["tokens"]})
    assert back.json() == {"prompt": "hello"}
    rendered = requests.post(
        server.url + "/v1/chat/completions/render",
        json={"model": MODEL, "messages": messages, "max_tokens": 9},
    ).json()
    assert rendered["token_ids"] == body["tokens"]
    assert rendered["sampling_params"]["max_tokens"] == 9
    bad = requests.post(server.url + "/detokenize", json={"tokens": ["x"]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_default_output_lengths_are_seeded_and_capped() -> None:
    def lengths(seed: int) -> list[int]:
        with EmulatorServer(PROFILE, time_scale=0.01, seed=seed) as srv:
            return [
                chat(srv.url, f"question {i}", max_tokens=300).json()["usage"]["completion_tokens"]
                for i in range(6)
            ]

    a, b, c = lengths(1), lengths(1), lengths(2)
    assert a == b
    assert a != c
    assert all(1 <= n <= 300 for n in a + c)


def test_stream_chat_sends_one_chunk_per_token_then_usage(server: EmulatorServer) -> None:
    r = chat(
        server.url,
        "Tell me a story.",
        max_tokens=64,
        stream=True,
        stream_options={"include_usage": True},
        headers={"X-Emulator-Output-Tokens": "25"},
    )
    assert r.status_code == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 25
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    chunks = events[:-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    tokens = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(tokens) == 25
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)

    # without include_usage there is no usage chunk
    r = chat(server.url, "Tell me a story.", max_tokens=8, stream=True, ignore_eos=True)
    events = sse_events(r)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e or e["usage"] is None for e in events[:-1])
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_client_works_against_the_emulator(server: EmulatorServer) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    models = [m.id for m in client.models.list()]
    assert models == [MODEL]
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=9,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 9
    assert resp.choices[0].message.content
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"X-Emulator-Output-Tokens": "11"},
    )
    text, final_usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            final_usage = chunk.usage
    assert len(text) == 11
    assert final_usage is not None and final_usage.completion_tokens == 11
    assert final_usage.prompt_tokens_details is not None
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", max_tokens=3, messages=[{"role": "user", "content": "x"}]
        )


# -- metrics ---------------------------------------------------------------------
def test_metrics_use_vllm_names_and_counters_move(server: EmulatorServer) -> None:
    text = requests.get(server.url + "/metrics", timeout=5).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:num_preemptions",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
    ):
        assert name in families, name
        for s in families[name].samples:
            assert s.labels.get("model_name") == MODEL
    assert families["vllm:prefix_cache_hits"].type == "counter"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert "vllm:prefix_cache_hits_total" in text

    before = metrics(server.url)
    r = chat(
        server.url,
        "count to twenty " * 30,
        max_tokens=40,
        headers={"X-Emulator-Output-Tokens": "20"},
    )
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    after = metrics(server.url)
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 20
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == prompt_tokens
    assert after["vllm:prefix_cache_queries_total"] > before["vllm:prefix_cache_queries_total"]
    assert (
        after["vllm:time_to_first_token_seconds_count"]
        == before["vllm:time_to_first_token_seconds_count"] + 1
    )
    assert (
        after["vllm:time_per_output_token_seconds_count"]
        == before["vllm:time_per_output_token_seconds_count"] + 19
    )
    assert (
        after["vllm:request_success_total{stop}"] == before["vllm:request_success_total{stop}"] + 1
    )
    assert after["vllm:num_requests_running"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0


# -- prefix caching --------------------------------------------------------------
def test_repeated_system_prompt_hits_the_prefix_cache_and_cuts_ttft() -> None:
    scale = 1.0  # cold prefill ~0.25 s: far above scheduling noise on a busy box
    with EmulatorServer(PROFILE, time_scale=scale) as srv:

        def ttft_and_usage(question: str) -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            r = chat(
                srv.url,
                question,
                system=SYSTEM_PROMPT,
                max_tokens=8,
                ignore_eos=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            first = None
            data = []
            for line in r.iter_lines():
                if first is None and b'"content": "' in line and b'"content": ""' not in line:
                    first = time.perf_counter() - t0
                if line:
                    data.append(line)
            assert first is not None and data[-1] == b"data: [DONE]"
            return first, json.loads(data[-2][len(b"data: ") :])["usage"]

        cold_ttft, cold = ttft_and_usage("What is rule 7?")
        warm_ttft, warm = ttft_and_usage("What is rule 9?")

    sys_tokens = approx_num_tokens(render_chat([{"role": "system", "content": SYSTEM_PROMPT}]))
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["prompt_tokens_details"]["cached_tokens"]
    assert sys_tokens - 16 <= cached <= warm["prompt_tokens"]
    assert cached % 16 == 0
    # The cold TTFT is the engine model's prefill time, scaled; the warm one skips it.
    model_prefill_s = get_profile(PROFILE).prefill_time_s(cold["prompt_tokens"])
    assert cold_ttft >= 0.9 * model_prefill_s * scale
    assert warm_ttft < cold_ttft / 3


def test_router_side_hashes_predict_the_emulators_cache_hit(server: EmulatorServer) -> None:
    first = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "hello there, how are you today?"},
    ]
    second = [first[0], {"role": "user", "content": "bye"}]
    h1, h2 = chat_block_hashes(first), chat_block_hashes(second)
    assert len(h1) == approx_num_tokens(render_chat(first)) // 16
    assert h1 == prompt_block_hashes(render_chat(first))
    shared = 0
    while shared < min(len(h1), len(h2)) and h1[shared] == h2[shared]:
        shared += 1
    assert shared > 400  # the ~8000-token system prompt
    for messages in (first, second):
        r = requests.post(
            server.url + "/v1/chat/completions",
            timeout=10,
            json={"model": MODEL, "messages": messages, "max_tokens": 2},
        )
    use = r.json()["usage"]
    # vLLM always recomputes the last prompt token, so a full hit stops one short.
    usable = min(shared, (use["prompt_tokens"] - 1) // 16)
    assert use["prompt_tokens_details"]["cached_tokens"] == 16 * usable


# -- errors ----------------------------------------------------------------------
def test_errors_come_in_openai_shape() -> None:
    with EmulatorServer(PROFILE, time_scale=FAST, max_model_len_tokens=1024) as srv:
        r = chat(srv.url, "x" * 5000, max_tokens=10)
        assert r.status_code == 400
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "maximum context length is 1024" in err["message"]
        assert err["code"] == 400

        r = chat(srv.url, "x" * 2000, max_tokens=900)  # ~510 prompt + 900 > 1024
        assert r.status_code == 400 and "completion" in r.json()["error"]["message"]

        r = requests.post(
            srv.url + "/v1/chat/completions",
            data=b"{not json",
            headers={"Content-Type": "application/json"},
            timeout=5,
        )
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]

        r = requests.post(
            srv.url + "/v1/chat/completions",
            timeout=5,
            json={"model": "gpt-5", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 404
        assert r.json()["error"]["param"] == "model"

        r = requests.post(srv.url + "/v1/completions", json={"model": MODEL}, timeout=5)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


# -- fault injection -----------------------------------------------------------------
def test_5xx_injection_is_seeded_and_near_the_rate() -> None:
    def pattern(seed: int) -> list[int]:
        with EmulatorServer(PROFILE, time_scale=0.01, fail_5xx_rate=0.3, seed=seed) as srv:
            s = requests.Session()
            codes = []
            for i in range(150):
                r = s.post(
                    srv.url + "/v1/completions",
                    timeout=5,
                    json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2},
                )
                codes.append(r.status_code)
                if r.status_code == 500:
                    assert r.json()["error"]["type"] == "InternalServerError"
            return codes

    a, b = pattern(3), pattern(3)
    assert a == b
    assert set(a) == {200, 500}
    assert 25 <= a.count(500) <= 65  # binomial(150, 0.3): mean 45, sd 5.6


def test_stall_turns_health_503_and_makes_no_progress() -> None:
    with EmulatorServer(PROFILE, time_scale=FAST, stall_after_s=0.3) as srv:
        assert requests.get(srv.url + "/health", timeout=2).status_code == 200
        time.sleep(0.35)
        assert requests.get(srv.url + "/health", timeout=2).status_code == 503
        with pytest.raises(requests.exceptions.ReadTimeout):
            chat(srv.url, "anyone there?", max_tokens=4, timeout=0.5)
        m = metrics(srv.url)  # metrics still answer while stalled
        assert m["vllm:generation_tokens_total"] == 0
        # the timed-out client hung up: its request is aborted, not left queued
        assert wait_for(lambda: metrics(srv.url)["vllm:num_requests_waiting"] == 0)


def test_latency_spikes_pause_the_stream() -> None:
    with EmulatorServer(PROFILE, time_scale=1.0, latency_spike_ms=120, spike_every_s=0.25) as srv:
        t_prev = None
        gaps = []
        r = chat(srv.url, "go", max_tokens=90, ignore_eos=True, stream=True)
        for line in r.iter_lines():
            now = time.perf_counter()
            if line.startswith(b"data: {"):
                if t_prev is not None:
                    gaps.append(now - t_prev)
                t_prev = now
    step_s = get_profile(PROFILE).decode_step_time_s(1, 100)
    assert max(gaps) >= 0.08  # a spike, far above one decode step
    assert sorted(gaps)[len(gaps) // 2] < 3 * step_s + 0.005  # most gaps are one step


def test_crash_exits_the_process(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenfleet.cli.main",
            "engine-sim",
            "--port",
            "0",
            "--profile",
            PROFILE,
            "--time-scale",
            "0.05",
            "--crash-after-s",
            "1.5",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert "serving" in line, line
        url = re.search(r"http://\S+", line).group(0)  # type: ignore[union-attr]
        assert requests.get(url + "/health", timeout=2).status_code == 200
        r = chat(url, "quick", max_tokens=3)
        assert r.status_code == 200
        assert proc.wait(timeout=10) == 1
        assert "injected crash" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- aborts ----------------------------------------------------------------------
def test_client_disconnect_aborts_and_frees_kv() -> None:
    with EmulatorServer(PROFILE, time_scale=1.0, kv_capacity_blocks=4000) as srv:
        r = chat(srv.url, "write forever " * 200, max_tokens=20000, ignore_eos=True, stream=True)
        it = r.iter_lines()
        got = 0
        for line in it:
            if line.startswith(b"data: {"):
                got += 1
            if got >= 5:
                break
        m = metrics(srv.url)
        assert m["vllm:num_requests_running"] == 1
        assert m["vllm:kv_cache_usage_perc"] > 0
        r.close()  # hang up mid-stream
        assert wait_for(lambda: metrics(srv.url)["vllm:kv_cache_usage_perc"] == 0.0)
        m = metrics(srv.url)
        assert m["vllm:num_requests_running"] == 0
        assert m["vllm:request_success_total{abort}"] == 1
        assert m["vllm:generation_tokens_total"] < 1000


def test_non_streamed_client_that_hangs_up_while_waiting_is_aborted() -> None:
    """Nothing is written to a non-streamed client before its answer, so only the
    hang-up watch can tell the engine: the request must not run to its end."""
    import socket as _socket

    with EmulatorServer(PROFILE, time_scale=1.0, kv_capacity_blocks=4000) as srv:
        assert srv.hangups.available
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "write forever"}],
                "max_tokens": 20000,
                "ignore_eos": True,
            }
        ).encode()
        s = _socket.create_connection((host, int(port)))
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert wait_for(lambda: metrics(srv.url)["vllm:num_requests_running"] == 1)
        s.close()
        # the abort is counted when it is asked for; the request leaves the running
        # set (and frees its KV) at the engine's next step: wait for all three
        assert wait_for(
            lambda: (
                (m := metrics(srv.url))["vllm:request_success_total{abort}"] == 1
                and m["vllm:num_requests_running"] == 0
                and m["vllm:kv_cache_usage_perc"] == 0.0
            )
        ), metrics(srv.url)
        m = metrics(srv.url)
        assert m["vllm:generation_tokens_total"] < 20000


def test_hangup_watch_fires_on_close_not_on_data() -> None:
    import socket as _socket

    from tokenfleet.emulator.hangup import HangupWatch

    watch = HangupWatch()
    a, b = _socket.socketpair()
    gone = threading.Event()
    try:
        assert watch.watch(a, gone.set)
        b.sendall(b"GET /next HTTP/1.1\r\n\r\n")  # a pipelined request is no hang-up
        assert not gone.wait(0.3)
        b.close()
        assert gone.wait(3.0)
        watch.unwatch(a)  # already fired: a no-op
    finally:
        watch.close()
        a.close()


def test_admin_abort_ends_a_request_by_id() -> None:
    with EmulatorServer(PROFILE, time_scale=1.0) as srv:
        result: dict[str, Any] = {}

        def call() -> None:
            result["resp"] = chat(
                srv.url,
                "long answer please",
                max_tokens=5000,
                ignore_eos=True,
                headers={"X-Request-Id": "req-42"},
            )

        t = threading.Thread(target=call)
        t.start()
        assert wait_for(lambda: metrics(srv.url)["vllm:num_requests_running"] == 1)
        r = requests.post(srv.url + "/abort_request", json={"rid": "req-42"}, timeout=5)
        assert r.json() == {"aborted": 1}
        t.join(timeout=5)
        body = result["resp"].json()
        assert body["id"] == "chatcmpl-req-42"
        assert body["choices"][0]["finish_reason"] == "abort"
        assert body["usage"]["completion_tokens"] < 5000
        # Aborted mid-step, the blocks come back when that step ends (as in vLLM).
        assert wait_for(lambda: metrics(srv.url)["vllm:kv_cache_usage_perc"] == 0.0)


# -- KV events -------------------------------------------------------------------
def test_kv_event_codec_round_trips_both_vllm_formats() -> None:
    events = [BlockStored((1, 2**64 - 1), None, (5, 6), 16), BlockRemoved((3,)), AllBlocksCleared()]
    for fmt in ("map", "array"):
        ts, back = decode_batch(encode_batch(12.5, events, fmt))
        assert ts == 12.5
        assert back == events


@pytest.mark.parametrize("fmt,engine_binds", [("map", True), ("array", False)])
def test_kv_events_reach_a_subscriber(fmt: str, engine_binds: bool) -> None:
    """Engine binds and the subscriber connects (vLLM's usual layout), or one
    subscriber binds and engines connect (llm-d's indexer layout)."""
    sub: KVEventSubscriber | None = None
    if not engine_binds:
        sub = KVEventSubscriber("tcp://127.0.0.1:*", bind=True, instance_id="emu-a")
    endpoint = "tcp://127.0.0.1:*" if engine_binds else sub.last_endpoint  # type: ignore[union-attr]
    try:
        with EmulatorServer(
            PROFILE,
            time_scale=FAST,
            kv_capacity_blocks=1200,
            kv_events_endpoint=endpoint,
            kv_events_format=fmt,
            kv_events_connect=not engine_binds,
        ) as srv:
            if sub is None:
                assert srv.kv_events_endpoint is not None
                assert not srv.kv_events_endpoint.endswith("*")
                sub = KVEventSubscriber(srv.kv_events_endpoint, instance_id="emu-a")
            stored: list[int] = []
            removed: list[int] = []

            def drain(timeout_s: float = 0.02) -> int:
                evs = sub.poll(timeout_s)
                assert all(e.instance_id == "emu-a" for e in evs)
                for e in evs:
                    (removed if e.kind == "removed" else stored).extend(e.block_hashes)
                return len(evs)

            # PUB drops messages until the subscription reaches it: retry briefly.
            for attempt in range(40):
                chat(srv.url, f"warm-up {attempt} " * 40, max_tokens=2)
                if drain(0.05):
                    break
            assert stored, "no KV events arrived"

            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "q"},
            ]
            expected = set(chat_block_hashes(messages))
            r = requests.post(
                srv.url + "/v1/chat/completions",
                timeout=10,
                json={"model": MODEL, "messages": messages, "max_tokens": 2},
            )
            assert r.status_code == 200
            assert wait_for(lambda: drain() >= 0 and expected.issubset(stored))

            # Fill the 1200-block cache with other prompts: old blocks get evicted.
            for i in range(4):
                chat(srv.url, f"{i} other long prompt " * 1200, max_tokens=2)
            assert wait_for(lambda: drain() >= 0 and bool(expected & set(removed)))
            assert sub.missed == 0

            # /reset_prefix_cache drops the rest and reports it
            requests.post(srv.url + "/reset_prefix_cache", timeout=5)
            assert wait_for(lambda: drain() >= 0 and set(stored) <= set(removed))
    finally:
        if sub is not None:
            sub.close()


def test_request_log_records_engine_side_times_in_order(tmp_path: Path) -> None:
    """The request log (TOKENFLEET_EMULATOR_REQUEST_LOG) gives, per request,
    wall-clock times from receipt to the model's first-token step and its
    delivery; the first-token step ends one prefill after submission."""
    log = tmp_path / "engine.jsonl"
    with EmulatorServer(PROFILE, time_scale=0.2, request_log=str(log)) as srv:
        before = time.time()
        r = chat(
            srv.url,
            "hello " * 400,
            max_tokens=4,
            ignore_eos=True,
            stream=True,
            headers={"X-Request-Id": "probe-1"},
        )
        assert sse_events(r)[-1] == "[DONE]"
        chat(srv.url, "again", max_tokens=2, ignore_eos=True)
        assert wait_for(lambda: log.exists() and len(log.read_text().splitlines()) == 2)
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    e = next(x for x in lines if x["id"] == "probe-1")
    assert before <= e["received"] <= e["submitted"] <= e["first_model"] <= e["first"] <= e["done"]
    assert e["status"] == "completed" and e["generated"] == 4 and e["cached_tokens"] == 0
    prefill_s = get_profile(PROFILE).prefill_time_s(e["input_tokens"]) * 0.2
    assert e["first_model"] - e["submitted"] >= 0.9 * prefill_s
    assert e["loop_resyncs"] >= 0 and e["loop_lost_s"] >= 0.0


# -- host-memory KV tier (vLLM's OffloadingConnector) --------------------------------
def test_host_kv_tier_serves_an_evicted_prefix_over_the_link(tmp_path: Path) -> None:
    """With ``host_kv_gb``, a prefix the GPU evicted comes back from host
    memory: the turn's first token costs the transfer, not the prefill; the
    metrics count external hits and the KV events name the CPU tier."""
    log = tmp_path / "engine.jsonl"
    scale = 0.5
    prof = get_profile(PROFILE)
    doc = " ".join(f"clause {i} of the contract says nothing new." for i in range(1100))
    other = " ".join(f"line {i} of an unrelated log file, no match." for i in range(1100))
    with EmulatorServer(
        PROFILE,
        time_scale=scale,
        kv_capacity_blocks=1000,
        host_kv_gb=4.0,
        request_log=str(log),
        kv_events_endpoint="tcp://127.0.0.1:*",
    ) as srv:
        assert srv.kv_events_endpoint is not None
        sub = KVEventSubscriber(srv.kv_events_endpoint, instance_id="emu")
        media: set[str] = set()
        try:
            for attempt in range(40):  # PUB drops messages until the subscription lands
                chat(srv.url, f"warm-up {attempt} " * 40, max_tokens=2)
                evs = sub.poll(0.05)
                media.update(e.medium for e in evs)
                if evs:
                    break
            for rid, text in (("first", doc), ("other", other), ("back", doc + " Which?")):
                r = chat(srv.url, text, max_tokens=2, headers={"X-Request-Id": rid})
                assert r.status_code == 200
            assert wait_for(lambda: len(log.read_text().splitlines()) >= 3, timeout_s=10)
            assert wait_for(
                lambda: media.update(e.medium for e in sub.poll(0.05)) or "CPU" in media
            )
            m = metrics(srv.url)
        finally:
            sub.close()
    lines = {x["id"]: x for x in map(json.loads, log.read_text().splitlines())}
    first, back = lines["first"], lines["back"]
    assert first["cached_tokens"] == 0
    assert back["cached_tokens"] >= 0.95 * first["input_tokens"]
    host_tokens = m["vllm:external_prefix_cache_hits_total"]
    assert host_tokens >= 0.5 * first["input_tokens"]  # most of it came from host memory
    assert m["vllm:external_prefix_cache_queries_total"] >= host_tokens
    assert 0.0 < m["tokenfleet:kv_offload_cpu_usage_perc"] <= 1.0
    ttft_first = (first["first_model"] - first["submitted"]) / scale
    ttft_back = (back["first_model"] - back["submitted"]) / scale
    load_s = prof.host_load_time_s(int(host_tokens))
    assert ttft_first >= 0.9 * prof.prefill_time_s(first["input_tokens"])
    assert load_s <= ttft_back < 0.3 * ttft_first, (load_s, ttft_back, ttft_first)
    assert media == {"GPU", "CPU"}
