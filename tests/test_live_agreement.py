"""Sim/live agreement: the same 5-minute slice of a shared trace through the
live stack (real time, engines, workers and API as separate processes) and
through the simulator, same topology (4 instances) and router (TokenPilot);
TTFT p50 and p95 must agree within 15%.

Slow (about six minutes of real time) and needs ../shared/traces.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
TRACE = TRACES / "mooncake_synthetic.jsonl"
SLICE_S = 300.0
INSTANCES = 4
ROUTER = "tokenpilot"
SCRAPE_S = 0.25

pytestmark = [
    pytest.mark.slow,
    pytest.mark.traces,
    pytest.mark.skipif(not TRACE.exists(), reason=f"shared traces not found at {TRACES}"),
]


def test_sim_and_live_ttft_agree_on_a_trace_slice() -> None:
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.engine.profiles import get_profile
    from tokenfleet.live.bench import replay, summary
    from tokenfleet.live.testing import PROFILE, API_KEY, InstanceSpec, LiveStack
    from tokenfleet.service.testing import temp_data_dir
    from tokenfleet.sim.runner import SimSettings, run_policies
    from tokenfleet.workloads import load_workload

    rate = float(os.environ.get("TOKENFLEET_AGREEMENT_RATE_SCALE", "0.5"))
    reqs = load_workload(TRACE, model="default")
    from tokenfleet.workloads.scaling import rate_scale

    reqs = rate_scale(reqs, rate)
    t0 = reqs[0].arrival_s
    reqs = [r for r in reqs if r.arrival_s - t0 < SLICE_S]
    assert len(reqs) > 100

    sim = run_policies(reqs, [ROUTER], SimSettings(profile=get_profile(PROFILE),
                                                  instances=INSTANCES,
                                                  scrape_interval_s=SCRAPE_S))[0].summary

    specs = [InstanceSpec(dc, f"{dc[-1]}{k}", slots=256)
             for dc in ("dc-a", "dc-b") for k in range(INSTANCES // 2)]
    with temp_data_dir("tokenfleet-agree-") as d:
        stack = LiveStack(data_dir=d, instances=specs, time_scale=1.0, router=ROUTER,
                          engines_in_process=False, api_in_process=False, admission="none",
                          # the simulator has no late binding: the router places every
                          # request, so the live path is told to do the same (every request
                          # to the routed instance's queue); see docs/live.md
                          live_overrides={"affinity_min_cached_tokens": 0,
                                          "affinity_min_cached_fraction": 0.0,
                                          "scrape_interval_s": SCRAPE_S,
                                          "stale_after_s": 3.0, "lease_ttl_s": 3.0,
                                          "engine_stall_timeout_s": 60.0,
                                          "request_timeout_s": 600.0})
        stack.start()
        try:
            outs, wall = replay(stack.url, API_KEY, reqs, model=stack.model,
                                slo=SLOConfig(), max_inflight=1024)
        finally:
            stack.stop()
    live = summary(outs, wall)
    report = {"requests": len(reqs), "rate_scale": rate,
              "sim": {k: sim[k] for k in ("ttft_p50_s", "ttft_p95_s", "completed")},
              "live": {k: live[k] for k in ("ttft_p50_s", "ttft_p95_s", "completed",
                                            "failed")}}
    print(json.dumps(report, indent=2))
    assert live["completed"] >= 0.99 * len(reqs), live.get("sample_errors")
    for key in ("ttft_p50_s", "ttft_p95_s"):
        assert live[key] == pytest.approx(sim[key], rel=0.15), report
