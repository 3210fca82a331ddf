"""Sim/live agreement: the same 5-minute slice of a shared trace through the
live stack (real time, engines, workers and API as separate processes) and
through the simulator, same topology (4 instances) and router (TokenPilot);
TTFT p50 and p95 must agree within 15%.

The live path (client -> API -> broker -> worker -> engine, and the first
token back through Redis and the API) takes a few milliseconds with a long
tail on this box, which the simulator's engines otherwise never see. It
matters beyond its size at the median: requests reach an engine in a
different order than in the trace, and a short prompt that slips behind a
long prefill waits for all of it. So the simulator is given the path latency
*measured in this very run* (client send -> engine, engine first token ->
client, joined per request with the emulators' request logs;
``tokenfleet.live.bench.path_latency``); it must still predict everything
else: routing, queueing, prefill, cache hits. The latency is random, so the
simulator's prediction is the mean over ``DRAWS`` seeded draws of it (one
draw's p50 moves by +-6% on this slice, whose TTFT distribution is sparse at
its median). The idealised simulator (zero path latency) is printed too.

Both routers get exact cache knowledge: the engines publish vLLM KV events,
the workers relay them (``--kv-events``) and the simulator delivers its
engines' events (``kv_events``). Without engine events a worker publishes
an approximate ``stored`` event at each first token and never a removal, so
the live router would believe evicted prefixes are still cached, which the
simulator's router never does.

Slow (about six minutes of real time) and needs ../shared/traces.
"""

from __future__ import annotations

import dataclasses
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
DRAWS = 8

pytestmark = [
    pytest.mark.slow,
    pytest.mark.traces,
    pytest.mark.stack,
    pytest.mark.skipif(not TRACE.exists(), reason=f"shared traces not found at {TRACES}"),
]


def test_sim_and_live_ttft_agree_on_a_trace_slice() -> None:
    from tests.support.stack import API_KEY, PROFILE, InstanceSpec, LiveStack
    from tests.support.stores import temp_data_dir
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.engine.profiles import get_profile
    from tokenfleet.live.bench import path_delays, path_latency, replay, summary
    from tokenfleet.sim.runner import SimSettings, run_policies
    from tokenfleet.workloads import load_workload

    rate = float(os.environ.get("TOKENFLEET_AGREEMENT_RATE_SCALE", "0.5"))
    reqs = load_workload(TRACE, model="default")
    from tokenfleet.workloads.scaling import rate_scale

    reqs = rate_scale(reqs, rate)
    t0 = reqs[0].arrival_s
    reqs = [r for r in reqs if r.arrival_s - t0 < SLICE_S]
    assert len(reqs) > 100

    def simulate(**kw: object) -> dict[str, object]:
        return run_policies(
            reqs,
            [ROUTER],
            SimSettings(
                profile=get_profile(PROFILE),
                instances=INSTANCES,
                scrape_interval_s=SCRAPE_S,
                kv_events=True,
                **kw,
            ),
        )[0].summary  # type: ignore[arg-type]

    ideal = simulate()
    specs = [
        InstanceSpec(dc, f"{dc[-1]}{k}", slots=256)
        for dc in ("dc-a", "dc-b")
        for k in range(INSTANCES // 2)
    ]
    with temp_data_dir("tokenfleet-agree-") as d:
        logs = d / "engine-requests"
        logs.mkdir()
        stack = LiveStack(
            data_dir=d,
            instances=specs,
            time_scale=1.0,
            router=ROUTER,
            engines_in_process=False,
            api_in_process=False,
            admission="none",
            engine_env={"TOKENFLEET_EMULATOR_REQUEST_LOG": str(logs / "{instance}.jsonl")},
            engine_kv_events=True,
            # the simulator has no late binding: the router places every
            # request, so the live path is told to do the same (every request
            # to the routed instance's queue); see docs/live.md
            # nor a datacenter choice before routing: its pool is the 4
            # instances, so FleetMind's DC selection is off here too
            live_overrides={
                "fleet_policy": "off",
                "affinity_min_cached_tokens": 0,
                "affinity_min_cached_fraction": 0.0,
                "scrape_interval_s": SCRAPE_S,
                "stale_after_s": 3.0,
                "lease_ttl_s": 3.0,
                "engine_stall_timeout_s": 60.0,
                "request_timeout_s": 600.0,
            },
        )
        stack.start()
        try:
            outs, wall = replay(
                stack.url, API_KEY, reqs, model=stack.model, slo=SLOConfig(), max_inflight=1024
            )
        finally:
            stack.stop()
        latency = path_latency(outs, logs)
        delays = path_delays(outs, logs)
    assert len(delays) >= 0.99 * len(reqs)
    draws = [simulate(path_latency=latency, seed=k) for k in range(DRAWS)]
    sim = {
        key: sum(float(d[key]) for d in draws) / DRAWS  # type: ignore[arg-type]
        for key in ("ttft_p50_s", "ttft_p95_s", "completed")
    }
    live = summary(outs, wall)
    dispatch = sorted(d for _, d, _ in delays)
    relay = sorted(r for _, _, r in delays)
    report = {
        "requests": len(reqs),
        "rate_scale": rate,
        "path_latency_ms": {
            "dispatch_p50": round(dispatch[len(dispatch) // 2] * 1e3, 2),
            "relay_p50": round(relay[len(relay) // 2] * 1e3, 2),
            "model": {k: round(v * 1e3, 2) for k, v in dataclasses.asdict(latency).items()},
        },
        "sim_ideal_path": {k: ideal[k] for k in ("ttft_p50_s", "ttft_p95_s")},
        "sim": sim,
        "sim_draws_p50": [round(float(d["ttft_p50_s"]), 4) for d in draws],  # type: ignore[arg-type]
        "live": {
            k: live[k]
            for k in ("ttft_p50_s", "ttft_p95_s", "completed", "failed", "sample_errors")
            if k in live
        },
    }
    print(json.dumps(report, indent=2))
    assert live["completed"] >= 0.99 * len(reqs), live.get("sample_errors")
    for key in ("ttft_p50_s", "ttft_p95_s"):
        assert live[key] == pytest.approx(sim[key], rel=0.15), report
