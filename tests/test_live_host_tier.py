"""The live path in front of engines with a host-memory KV tier (vLLM's
OffloadingConnector, the emulator's ``host_kv_gb``): a conversation's turn
whose prefix the GPU evicted is served from host memory, and its TTFT shows
the transfer, not a prefill."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.stack import InstanceSpec
from tokenfleet.engine.profiles import get_profile
from tokenfleet.tokenizer import approx_num_tokens

PROFILE = get_profile("llama3-8b-h200")
DOC = " ".join(f"clause {i} of the contract says nothing new." for i in range(1100))
OTHER = " ".join(f"line {i} of an unrelated log file, no match." for i in range(1100))


@pytest.mark.slow  # a whole live stack: ~20 s on the 2-core box
def test_a_turn_evicted_from_gpu_comes_back_from_host_memory(
    live_stack: Any, tmp_path: Path
) -> None:
    log = tmp_path / "engine.jsonl"
    scale = 0.5
    engine = {"kv_capacity_blocks": 1000, "host_kv_gb": 4.0, "request_log": str(log)}
    with live_stack(
        router="tokenpilot",
        time_scale=scale,
        instances=[InstanceSpec("dc-a", "a0", emulator=engine)],
    ) as stack:
        c = stack.client(timeout=60.0)
        cached = []
        for text in (DOC, OTHER, DOC + " So, which clause?"):  # turn 1, other traffic, turn 2
            resp = c.chat.completions.create(
                model=stack.model, max_tokens=2, messages=[{"role": "user", "content": text}]
            )
            assert resp.usage is not None
            cached.append(resp.usage.prompt_tokens_details.cached_tokens or 0)
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(log.read_text().splitlines()) < 3:
            time.sleep(0.1)
        host_hits = stack.emulators["a0"].engine.counters.host_hits_tokens
    first, _, back = (json.loads(x) for x in log.read_text().splitlines()[:3])
    n = approx_num_tokens(DOC)
    assert cached[0] == 0 and cached[2] >= 0.95 * n, cached  # the client sees the reuse
    assert host_hits >= 0.5 * n  # most of it was loaded from host memory
    ttft_first = (first["first_model"] - first["submitted"]) / scale
    ttft_back = (back["first_model"] - back["submitted"]) / scale
    load_s = PROFILE.host_load_time_s(host_hits)
    assert ttft_first >= 0.9 * PROFILE.prefill_time_s(first["input_tokens"])
    assert load_s <= ttft_back < 0.3 * ttft_first, (load_s, ttft_back, ttft_first)
