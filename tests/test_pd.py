"""Prefill/decode disaggregation: engine halves, KV transfer, the P/D pool and policies.

Engine tests drive one or two ``EngineInstance`` objects by hand; pool tests
run a few hundred generated requests through ``run_pool`` (about a second)
and check what happened, not what a policy intended.
"""

from __future__ import annotations

import statistics

import pytest

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.routing.pd_base import DECODE, MIXED, PREFILL, static_roles
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import DispatchAccounting, InstanceView, PoolSnapshot, RequestInfo
from tokenfleet.engine.instance import EngineInstance, EngineRequest
from tokenfleet.engine.kv_link import KVLink
from tokenfleet.engine.profiles import get_profile
from tokenfleet.sim.cluster import PoolConfig, run_pool
from tokenfleet.sim.pd import PDPoolSim
from tokenfleet.workloads.synthetic import generate

PROF = get_profile("llama3-8b-h200")


def _drain(eng: EngineInstance, t: float = 0.0) -> tuple[float, list[str], list[str]]:
    firsts: list[str] = []
    loaded: list[str] = []
    while True:
        dur = eng.plan_step()
        if dur == 0.0:
            return t, firsts, loaded
        t += dur
        res = eng.finish_step()
        firsts += [r.request_id for r in res.first_tokens]
        loaded += [r.request_id for r in res.remote_loaded]


def test_prefill_side_holds_kv_until_released() -> None:
    eng = EngineInstance("p", PROF)
    eng.add(EngineRequest("r/prefill", 4096, 1, tuple(range(256)), hold_kv=True))
    _drain(eng)
    assert "r/prefill" in eng.held
    assert eng.used_blocks == 256  # the prompt's KV; the sampled token's is never written
    eng.release("r/prefill", transferred=True)
    assert eng.used_blocks == 0 and not eng.held
    assert eng.counters.kv_transfer_out_tokens == 4096


def test_decode_side_waits_for_transfer_then_skips_the_prefill() -> None:
    xfer = KVLink().transfer_s(PROF, 4096, same_node=False)
    dec = EngineInstance("d", PROF)
    dec.add(EngineRequest("r", 4096, 10, tuple(range(256)), remote_kv_tokens=4096))
    dec.by_id["r"].remote_load_s = xfer
    t, firsts, loaded = _drain(dec)
    assert loaded == ["r"] and firsts == ["r"]
    # transfer + one short step + 9 decode steps, far below a 4k-token prefill
    assert xfer < t < xfer + 0.1
    assert t < PROF.prefill_time_s(4096)
    assert dec.counters.prompt_tokens_computed < 2 * PROF.block_size_tokens
    assert dec.counters.kv_transfer_in_tokens == 4095 // 16 * 16


def test_transfer_cost_nvlink_vs_rdma() -> None:
    link = KVLink()
    tokens = 4000
    nv = link.transfer_s(PROF, tokens, same_node=True)
    rdma = link.transfer_s(PROF, tokens, same_node=False)
    bytes_ = tokens * PROF.model.kv_bytes_per_token
    assert rdma == pytest.approx(link.latency_s + bytes_ / link.rdma_bytes_per_s)
    assert nv < rdma
    assert link.node_of(7, PROF) == 0 and link.node_of(8, PROF) == 1


def test_static_roles() -> None:
    assert static_roles(8, 0.5) == [PREFILL] * 4 + [DECODE] * 4
    assert static_roles(8, 1.0).count(DECODE) == 1
    assert static_roles(1, 0.5) == [MIXED]


def _view(i: int, role: str) -> InstanceView:
    return InstanceView(f"i{i}", PROF, index=i, role=role, accounting=DispatchAccounting())


def test_llmd_threshold_and_dynamo_local_prefill_length() -> None:
    views = [_view(0, PREFILL), _view(1, DECODE)]
    snap = PoolSnapshot(0.0, views)
    short = RequestInfo("s", 0.0, 500, 64, tier="interactive")
    long = RequestInfo("l", 0.0, 3000, 64, tier="interactive")
    for name in ("llmd_pd", "dynamo_disagg"):
        r = ROUTERS.create(name)
        assert not r.route_pd(short, snap).disaggregated  # type: ignore[attr-defined]
        d = r.route_pd(long, snap)  # type: ignore[attr-defined]
        assert d.disaggregated and d.prefill_instance_id == "i0" and d.decode_instance_id == "i1"


def test_llmd_threshold_zero_always_disaggregates() -> None:
    """llm-d's prefix-based decider: nonCachedTokens <= 0 means always P/D (the
    shipped guide's always-disagg decider), even for a 500-token prompt."""
    snap = PoolSnapshot(0.0, [_view(0, PREFILL), _view(1, DECODE)])
    short = RequestInfo("s", 0.0, 500, 64, tier="interactive")
    r = ROUTERS.create("llmd_pd", non_cached_tokens=0)
    assert r.route_pd(short, snap).disaggregated  # type: ignore[attr-defined]
    r = ROUTERS.create("llmd_pd", non_cached_tokens=400)
    assert r.route_pd(short, snap).disaggregated  # type: ignore[attr-defined]


def test_tokenpilot_pd_splits_long_prompts_off_a_busy_decoder() -> None:
    r = ROUTERS.create("tokenpilot_pd")
    views = [_view(0, MIXED), _view(1, MIXED)]
    # instance 1 decodes 50 streams and has 30k prompt tokens queued
    views[1].accounting.decoding_requests = 50
    views[1].accounting.prefill_pending_uncached_tokens = 30000
    views[1].accounting.prefill_pending_requests = 8
    snap = PoolSnapshot(0.0, views)
    d = r.route_pd(RequestInfo("x", 0.0, 3000, 64, tier="interactive"), snap)  # type: ignore[attr-defined]
    assert d.prefill_instance_id == "i0"
    assert d.predicted_ttft_s is not None and d.predicted_tpot_s is not None


def test_tokenpilot_pd_split_leaves_the_decode_side_room_for_short_prompts() -> None:
    """Long prefill demand alone would ask for 3 prefill instances of 4; the
    short prompts it prefills locally need 2 decode instances, so it splits 2/2."""
    r = ROUTERS.create("tokenpilot_pd")
    views = [_view(i, MIXED) for i in range(4)]
    plans = []
    for now in (14.0, 29.0):  # two planning cycles must agree (hysteresis)
        snap = PoolSnapshot(now, views)
        for k in range(150):  # 150 x 8,000 tokens in 15 s: ~2.5 instances of prefill
            r.route_pd(RequestInfo(f"L{now}-{k}", now, 8000, 16, tier="interactive"), snap)  # type: ignore[attr-defined]
        for k in range(500):  # 500 x 1,000 tokens: ~0.95 instance, kept local
            r.route_pd(RequestInfo(f"S{now}-{k}", now, 1000, 16, tier="interactive"), snap)  # type: ignore[attr-defined]
        plans.append(r.plan_roles(PoolSnapshot(now + 1.0, views)))  # type: ignore[attr-defined]
    assert plans[0] is None
    assert plans[1] is not None and plans[1].count(PREFILL) == 2 and plans[1].count(DECODE) == 2


def _code_and_chat(n_code: int, n_chat: int) -> list:  # type: ignore[type-arg]
    from dataclasses import replace

    code = generate("code_completion", n_code, 1, 40.0, prompt_median_tokens=3000)
    chat = generate("chat", n_chat, 2, 15.0)
    reqs = [replace(r, info=replace(r.info, request_id="c" + r.info.request_id)) for r in code]
    reqs += chat
    return sorted(reqs, key=lambda r: r.info.arrival_s)


def test_disaggregation_runs_two_phases_and_lowers_chat_tpot() -> None:
    reqs = _code_and_chat(400, 150)
    slo = SLOConfig()
    base, _ = run_pool(reqs, PoolConfig(PROF, n_instances=4, router="round_robin"), slo)
    recs, pool = run_pool(
        reqs,
        PoolConfig(PROF, n_instances=4, router="llmd_pd", router_kwargs={"prefill_share": 0.5}),
        slo,
    )
    assert isinstance(pool, PDPoolSim)
    assert all(r.status == "completed" for r in recs)
    assert pool.pd.disaggregated > 300  # code prompts are over the 1000-token threshold
    # the KV moved: decode sides received it, prefill sides sent it and hold nothing now
    got = sum(e.counters.kv_transfer_in_tokens for e in pool.engines)
    sent = sum(e.counters.kv_transfer_out_tokens for e in pool.engines)
    assert got > 0 and sent > 0 and all(not e.held for e in pool.engines)
    # every disaggregated request was prefilled on a prefill instance, decoded on another
    for p, d, xfer in pool.pd.placements.values():
        assert p != d and xfer > 0
    # transfer time is inside TTFT: no disaggregated request beats prefill + transfer
    by_id = {r.request_id: r for r in recs}
    for rid, (_, _, xfer) in list(pool.pd.placements.items())[:50]:
        rec = by_id[rid]
        assert rec.ttft_s is not None
        assert rec.ttft_s >= PROF.prefill_time_s(rec.input_tokens - rec.cached_tokens) + xfer

    def chat_tpot(rs: list) -> float:  # type: ignore[type-arg]
        vals = [r.tpot_s for r in rs if r.tenant != "code" and r.tpot_s is not None]
        return statistics.median(vals)

    assert chat_tpot(recs) < 0.8 * chat_tpot(base)
