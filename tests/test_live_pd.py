"""The live path runs a disaggregated request: TokenPilot-PD picks a prefill
and a decode instance, the decode instance's Celery worker claims the job, and
the engine call (the API's on the direct path, the worker's on the relay path)
prefills on one emulator and decodes on the other over vLLM's
``kv_transfer_params`` protocol. The transfer shows in both emulators' logs and
metrics, and the client gets its answer."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.support.prom import scrape
from tests.support.stack import InstanceSpec
from tokenfleet.engine.profiles import get_profile
from tokenfleet.live.engine_client import EngineError
from tokenfleet.live.jobs import ChatJob
from tokenfleet.live.queues import is_pool_queue, worker_queues
from tokenfleet.tokenizer import approx_num_tokens

MODEL = get_profile("llama3-8b-h200").model.name
PROMPT = " ".join(f"def handler_{i}(event): return event.get('k{i}')" for i in range(500))


@pytest.mark.slow  # a whole live stack per path: ~20 s each on the 2-core box
@pytest.mark.parametrize(
    ("direct", "admission"),
    [(True, "none"), (False, "slomax")],  # SLOMax's instance split must not hide the P pool
    ids=["direct", "relay-slomax"],
)
def test_one_request_prefilled_on_one_instance_and_decoded_on_another(
    live_stack: Any, caplog: pytest.LogCaptureFixture, direct: bool, admission: str
) -> None:
    caplog.set_level(logging.INFO, logger="tokenfleet.emulator.pd")
    n_prompt = approx_num_tokens(PROMPT)
    assert n_prompt > 3000  # one 8k chunk step exceeds the decode budget: P/D pays
    with live_stack(
        router="tokenpilot_pd",
        time_scale=0.2,
        instances=[
            InstanceSpec("dc-a", "p0", worker_args=["--role", "prefill"]),
            InstanceSpec("dc-a", "d0", worker_args=["--role", "decode"]),
        ],
        admission=admission,
        live_overrides={"direct_stream": direct},
    ) as stack:
        c = stack.client(timeout=60.0)
        stream = c.chat.completions.create(
            model=stack.model,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": PROMPT}],
            extra_headers={"X-Emulator-Output-Tokens": "12"},
        )
        text, usage = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == 12, usage
        assert text
        p_url, d_url = stack.engine_urls["p0"], stack.engine_urls["d0"]
        pm, dm = scrape(p_url), scrape(d_url)
        rows = stack.ledger_rows(expect=lambda rs: any(r["status"] != "in_flight" for r in rs))
        p_engine = stack.emulators["p0"].engine.counters
        d_engine = stack.emulators["d0"].engine.counters
    # the prefill instance computed the prompt and sent its KV; the decode
    # instance received it instead of prefilling, and streamed the answer
    assert pm.get("tokenfleet:kv_transfer_sent_tokens_total", 0) >= 0.9 * n_prompt, pm
    assert dm.get("tokenfleet:kv_transfer_received_tokens_total", 0) >= 0.9 * n_prompt, dm
    assert p_engine.kv_transfer_out_tokens >= 0.9 * n_prompt
    assert d_engine.kv_transfer_in_tokens >= 0.9 * n_prompt
    assert d_engine.prompt_tokens_computed < 32, d_engine.prompt_tokens_computed
    assert p_engine.prompt_tokens_computed >= 0.9 * n_prompt
    assert "from engine p0" in caplog.text and "to engine d0" in caplog.text, caplog.text
    assert [r["status"] for r in rows] == ["completed"], rows
    assert rows[0]["instance"] == "d0"
    assert rows[0]["completion_tokens"] == 12


def test_engine_call_prefills_remotely_then_decodes_with_the_returned_params() -> None:
    from tokenfleet.emulator.server import EmulatorServer
    from tokenfleet.live.engine_client import EngineCall

    with (
        EmulatorServer("llama3-8b-h200", time_scale=0.05, instance_id="p0") as p,
        EmulatorServer("llama3-8b-h200", time_scale=0.05, instance_id="d0") as d,
    ):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        pieces = list(EngineCall(d.url, body, "r1", prefill_url=p.url).stream())
        n = approx_num_tokens(PROMPT)
        assert sum(x.tokens for x in pieces) == 5
        assert p.engine.counters.prompt_tokens_computed >= 0.9 * n
        assert d.engine.counters.prompt_tokens_computed < 32
        assert d.engine.counters.kv_transfer_in_tokens >= 0.9 * n

        # a prefill instance that is gone: a retryable error (the job's re-send
        # then runs aggregated), and the decode instance never got the request
        before = d.engine.counters.prompt_tokens_computed
        with pytest.raises(EngineError) as err:
            list(EngineCall(d.url, body, "r2", prefill_url="http://127.0.0.1:9").stream())
        assert err.value.retryable and err.value.kind == "connect"
        assert d.engine.counters.prompt_tokens_computed == before


def test_a_prefill_instance_without_a_kv_connector_is_a_clear_error() -> None:
    """A prefill answer without ``kv_transfer_params`` (vLLM started without
    a KV connector) fails the attempt: the decode side must not prefill it all."""
    from tokenfleet.emulator.server import EmulatorServer
    from tokenfleet.live.engine_client import EngineCall

    class Plain(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            out = json.dumps({"choices": [{"text": "x"}], "usage": {}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *_: Any) -> None:
            pass

    plain = ThreadingHTTPServer(("127.0.0.1", 0), Plain)
    threading.Thread(target=plain.serve_forever, daemon=True).start()
    try:
        with EmulatorServer("llama3-8b-h200", time_scale=0.05, instance_id="d0") as d:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}
            url = f"http://127.0.0.1:{plain.server_address[1]}"
            with pytest.raises(EngineError) as err:
                list(EngineCall(d.url, body, "r3", prefill_url=url).stream())
            assert "kv_transfer_params" in str(err.value) and "--role mixed" in str(err.value)
            assert d.engine.counters.prompt_tokens_computed == 0
    finally:
        plain.shutdown()
        plain.server_close()


def test_a_disaggregated_job_survives_the_wire_and_its_resend_is_aggregated() -> None:
    job = ChatJob(
        request_id="r",
        attempt=1,
        tenant="t",
        tier="interactive",
        model="m",
        body={},
        input_tokens=5000,
        max_tokens=8,
        arrival_ts=1.0,
        queue="dc-a.d0.interactive",
        expected_cached=4999,
        prefill_instance="p0",
        prefill_url="http://p0:8000",
        prefill_cached=1024,
    )
    back = ChatJob.from_message(json.loads(json.dumps(job.to_message())))
    assert (back.prefill_instance, back.prefill_url, back.prefill_cached) == (
        "p0",
        "http://p0:8000",
        1024,
    )
    again = back.next_attempt(2, "dc-a.interactive", tried={"d0"})
    assert (again.prefill_instance, again.prefill_url, again.prefill_cached) == ("", "", 0)
    assert "prefill" not in again.to_message()


def test_a_prefill_only_worker_takes_no_pool_work() -> None:
    mine = worker_queues("dc-a", "p0", pool=False)
    assert mine and all(not is_pool_queue(q) for q in mine)
    assert any(is_pool_queue(q) for q in worker_queues("dc-a", "d0"))
