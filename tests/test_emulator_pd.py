"""The emulator speaks vLLM's disaggregation protocol: one request prefilled on
one emulator and decoded on another, driven the way vllm-router drives vLLM
(prefill with ``kv_transfer_params``, then decode carrying the returned ones).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import requests

from tests.support.prom import scrape
from tokenfleet.emulator.server import EmulatorServer
from tokenfleet.engine.profiles import get_profile
from tokenfleet.live.engine_client import PREFILL_PARAMS

PROFILE = "llama3-8b-h200"
MODEL = get_profile(PROFILE).model.name
PROMPT = " ".join(f"def f{i}(x): return x + {i}" for i in range(600))  # ~thousands of tokens


def _wait(cond: Any, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return bool(cond())


def test_prefill_on_one_emulator_decode_on_another(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenfleet.emulator.pd")
    with (
        EmulatorServer(PROFILE, time_scale=0.05, instance_id="prefill-0") as p,
        EmulatorServer(PROFILE, time_scale=0.05, instance_id="decode-0") as d,
    ):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": False}
        r = requests.post(
            p.url + "/v1/completions",
            json={**body, "kv_transfer_params": PREFILL_PARAMS},
            headers={"X-Request-Id": "pd-1"},
            timeout=10,
        )
        r.raise_for_status()
        kv = r.json()["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "prefill-0"
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert prompt_tokens > 1000
        # the prefill side holds the prompt's KV until the decode side reads it
        assert scrape(p.url)["tokenfleet:kv_transfer_held_blocks"] > 0

        r2 = requests.post(
            d.url + "/v1/completions",
            json={**body, "max_tokens": 20, "kv_transfer_params": kv},
            headers={"X-Request-Id": "pd-1", "X-Emulator-Output-Tokens": "20"},
            timeout=10,
        )
        r2.raise_for_status()
        assert r2.json()["usage"]["completion_tokens"] == 20

        dm = scrape(d.url)
        assert dm["tokenfleet:kv_transfer_received_tokens_total"] >= prompt_tokens - 16
        assert dm["tokenfleet:kv_transfer_received_seconds_total"] > 0
        # a connector's hit, as vLLM counts NIXL's: queried and not hit by the
        # GPU prefix cache, served by the connector (a router reading admitted
        # prefill from the scrape must not count it as computed)
        received = dm["tokenfleet:kv_transfer_received_tokens_total"]
        assert dm["vllm:external_prefix_cache_hits_total"] == received
        gpu_missed = dm["vllm:prefix_cache_queries_total"] - dm["vllm:prefix_cache_hits_total"]
        assert gpu_missed >= received
        # the decode side computed (almost) none of the prompt itself
        assert dm["vllm:prompt_tokens_total"] == prompt_tokens  # counted, as vLLM does
        assert d.engine.counters.prompt_tokens_computed < 32
        assert _wait(lambda: scrape(p.url)["tokenfleet:kv_transfer_held_blocks"] == 0)
        assert scrape(p.url)["tokenfleet:kv_transfer_sent_tokens_total"] == prompt_tokens
        logs = caplog.text
        assert "pd-1 received" in logs and "from engine prefill-0" in logs
        assert "pd-1 sent" in logs and "to engine decode-0" in logs


def test_bad_kv_transfer_params_are_rejected() -> None:
    with EmulatorServer(PROFILE, time_scale=0.05) as srv:
        r = requests.post(
            srv.url + "/v1/completions",
            json={
                "model": MODEL,
                "prompt": "hi",
                "max_tokens": 2,
                "kv_transfer_params": {"do_remote_prefill": True},
            },
            timeout=5,
        )
        assert r.status_code == 400
        assert "remote_host" in r.json()["error"]["message"]
