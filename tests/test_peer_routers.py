"""Peer routers (today's production policies) on hand-built pool snapshots.

Each test drives a router the way a driver does: route, then record the
dispatch in the instance's accounting, and deliver stream events where the
router listens to them.
"""

from __future__ import annotations

import itertools

import pytest

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.routing.dynamo_kv import DynamoKVRouter
from tokenfleet.core.routing.llmd_weighted import LlmdWeightedRouter
from tokenfleet.core.routing.sglang_cache_aware import SGLangCacheAwareRouter
from tokenfleet.core.types import (
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
    ScrapedMetrics,
)
from tokenfleet.engine.profiles import get_profile

PROFILE = get_profile("llama3-8b-h200")
PEERS = [
    "round_robin",
    "random",
    "least_requests",
    "sglang_cache_aware",
    "llmd_weighted",
    "dynamo_kv",
    "vllm_router_kv_aware",
]
_ids = itertools.count()


def make_instances(n: int, **kwargs: object) -> list[InstanceView]:
    return [
        InstanceView(
            instance_id=f"i{k}",
            profile=PROFILE,
            kv_capacity_tokens=PROFILE.kv_capacity_tokens,
            index=k,
            **kwargs,
        )  # type: ignore[arg-type]
        for k in range(n)
    ]


def chain(*segments: tuple[int, int]) -> tuple[int, ...]:
    """Chained block hashes: segments of (content id, block count).

    Two chains share hashes exactly as long as their segments agree, like
    real chained prefix hashes.
    """
    out: list[int] = []
    prev = 0
    for content, count in segments:
        for k in range(count):
            prev = hash((prev, content, k))
            out.append(prev)
    return tuple(out)


def req(
    hashes: tuple[int, ...], extra_tokens: int = 0, model: str = "default", rid: str | None = None
) -> RequestInfo:
    return RequestInfo(
        request_id=rid or f"r{next(_ids)}",
        arrival_s=0.0,
        input_tokens=16 * len(hashes) + extra_tokens,
        max_tokens=64,
        block_hashes=hashes,
        model=model,
    )


def dispatch(router: object, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
    decision: RouteDecision = router.route(request, pool)  # type: ignore[attr-defined]
    inst = next(i for i in pool.instances if i.instance_id == decision.instance_id)
    inst.accounting.on_dispatch(request, decision.expected_cached_tokens)
    return decision


def finish(router: DynamoKVRouter, request: RequestInfo, instance_id: str) -> None:
    router.on_first_token(
        FirstTokenEvent(request=request, instance_id=instance_id, now_s=0.0, ttft_s=0.1)
    )
    router.on_complete(
        CompletionEvent(
            request=request,
            instance_id=instance_id,
            now_s=0.0,
            status="completed",
            output_tokens=10,
            cached_tokens=0,
            ttft_s=0.1,
            e2e_s=1.0,
        )
    )


# --------------------------------------------------------------------------
# All peers
# --------------------------------------------------------------------------
def test_every_registered_router_is_constructible_and_routes() -> None:
    for name in PEERS:
        assert name in ROUTERS
    for name in ROUTERS.names():
        router = ROUTERS.create(name, seed=0)
        pool = PoolSnapshot(now_s=0.0, instances=make_instances(3))
        decision = router.route(req(chain((1, 4))), pool)
        assert decision.instance_id in {"i0", "i1", "i2"}, name


@pytest.mark.parametrize("name", PEERS)
def test_ineligible_instances_are_never_chosen(name: str) -> None:
    insts = make_instances(6, model="m1")
    insts[0].ready = False
    insts[1].model = "other-model"
    insts[2].metrics.healthy = False
    insts[3].max_model_len_tokens = 64  # too short for the prompts below
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = ROUTERS.create(name, seed=0)
    for k in range(40):
        d = dispatch(router, req(chain((k % 3, 8)), model="m1"), pool)
        assert d.instance_id in {"i4", "i5"}


@pytest.mark.parametrize("name", PEERS)
def test_instance_going_unready_loses_its_cached_prompt(name: str) -> None:
    insts = make_instances(2)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = ROUTERS.create(name, seed=0)
    prompt = chain((7, 12))
    first = dispatch(router, req(prompt), pool).instance_id
    holder = next(i for i in insts if i.instance_id == first)
    holder.ready = False
    for _ in range(10):
        assert dispatch(router, req(prompt), pool).instance_id != first


@pytest.mark.parametrize("name", PEERS)
def test_ties_on_an_empty_pool_spread_over_instances(name: str) -> None:
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(8))
    router = ROUTERS.create(name, seed=0)
    chosen = [dispatch(router, req(chain((100 + k, 4))), pool).instance_id for k in range(16)]
    assert len(set(chosen)) >= 5, chosen
    assert chosen.count("i0") <= 4, chosen


# --------------------------------------------------------------------------
# round_robin / random / least_requests
# --------------------------------------------------------------------------
def test_round_robin_cycles_and_skips_unready() -> None:
    insts = make_instances(3)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = ROUTERS.create("round_robin", seed=0)
    seq = [router.route(req(chain((1, 2))), pool).instance_id for _ in range(6)]
    assert seq == ["i0", "i1", "i2", "i0", "i1", "i2"]
    insts[1].ready = False
    seq = [router.route(req(chain((1, 2))), pool).instance_id for _ in range(4)]
    assert set(seq) == {"i0", "i2"}
    assert seq[0::2] == [seq[0]] * 2 and seq[0] != seq[1]


def test_random_is_seeded_and_covers_the_pool() -> None:
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(4))
    a = ROUTERS.create("random", seed=7)
    b = ROUTERS.create("random", seed=7)
    sa = [a.route(req(()), pool).instance_id for _ in range(40)]
    sb = [b.route(req(()), pool).instance_id for _ in range(40)]
    assert sa == sb
    assert set(sa) == {"i0", "i1", "i2", "i3"}


def test_least_requests_picks_fewest_inflight() -> None:
    insts = make_instances(3)
    for inst, n in zip(insts, (3, 1, 2), strict=False):
        inst.accounting.inflight_requests = n
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = ROUTERS.create("least_requests", seed=0)
    assert router.route(req(()), pool).instance_id == "i1"
    # Filling by own accounting: i1 reaches 2 (tied with i2), then 3 and so on.
    chosen = [dispatch(router, req(()), pool).instance_id for _ in range(5)]
    loads = [i.accounting.inflight_requests for i in insts]
    assert max(loads) - min(loads) <= 1, (chosen, loads)


def test_least_requests_rotates_ties_even_before_accounting_catches_up() -> None:
    # A burst routed before any dispatch is recorded: all loads stay tied.
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(8))
    router = ROUTERS.create("least_requests", seed=0)
    chosen = [router.route(req(()), pool).instance_id for _ in range(8)]
    assert sorted(chosen) == [f"i{k}" for k in range(8)]


# --------------------------------------------------------------------------
# sglang_cache_aware
# --------------------------------------------------------------------------
def test_sglang_routes_to_best_match_above_threshold() -> None:
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(4))
    router = SGLangCacheAwareRouter(seed=0)
    homes = [dispatch(router, req(chain((k, 10))), pool).instance_id for k in range(4)]
    assert sorted(homes) == ["i0", "i1", "i2", "i3"]  # each went to an empty tree
    for k, home in enumerate(homes):
        # 8 of 10 blocks shared: match rate 0.8 > 0.3
        d = dispatch(router, req(chain((k, 8), (50 + k, 2))), pool)
        assert d.instance_id == home
        assert d.expected_cached_tokens == 8 * 16
        assert d.reason.startswith("cache_hit")


def test_sglang_falls_back_to_smallest_tree_below_threshold() -> None:
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(2))
    router = SGLangCacheAwareRouter(seed=0)
    big = dispatch(router, req(chain((1, 20))), pool).instance_id
    small = dispatch(router, req(chain((2, 5))), pool).instance_id
    assert big != small  # second prompt went to the empty tree
    assert router.tree_size_tokens(big) == 20 * 16
    # 2 of 20 blocks match the big tree: rate 0.1 <= 0.3 -> smallest tree.
    d = dispatch(router, req(chain((1, 2), (3, 18))), pool)
    assert d.instance_id == small
    assert d.reason.startswith("smallest_tree")
    # At exactly the threshold the match does not count (strict '>').
    r2 = SGLangCacheAwareRouter(seed=0, cache_threshold=0.5)
    big2 = dispatch(r2, req(chain((1, 20))), pool).instance_id
    dispatch(r2, req(chain((2, 5))), pool)
    assert dispatch(r2, req(chain((1, 10), (4, 10))), pool).instance_id != big2


@pytest.mark.parametrize(
    ("home_load", "other_load", "imbalanced"),
    [
        (100, 10, True),  # diff 90 > 64 and 100 > 1.5 * 10
        (300, 210, False),  # diff 90 > 64 but 300 <= 315: only abs holds
        (60, 10, False),  # 60 > 15 but diff 50 <= 64: only rel holds
        (74, 10, False),  # diff exactly 64: not strictly greater
    ],
)
def test_sglang_imbalance_rule_needs_both_conditions(
    home_load: int, other_load: int, imbalanced: bool
) -> None:
    insts = make_instances(2)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = SGLangCacheAwareRouter(seed=0)
    prompt = chain((1, 10))
    home = dispatch(router, req(prompt), pool).instance_id
    other = "i1" if home == "i0" else "i0"
    for inst in insts:
        inst.accounting.inflight_requests = home_load if inst.instance_id == home else other_load
    d = router.route(req(prompt), pool)
    if imbalanced:
        assert d.instance_id == other
        assert d.reason.startswith("imbalanced")
        # The tree still learns where the prompt went.
        assert router.tree_size_tokens(other) == 10 * 16
    else:
        assert d.instance_id == home
        assert d.reason.startswith("cache_hit")


def test_sglang_tree_eviction_is_bounded_and_leaf_first() -> None:
    pool = PoolSnapshot(now_s=0.0, instances=make_instances(1))
    router = SGLangCacheAwareRouter(seed=0, max_tree_size_tokens=10 * 16, eviction_interval_s=0)
    a = chain((1, 8))
    dispatch(router, req(a), pool)
    dispatch(router, req(chain((2, 4))), pool)
    assert router.tree_size_tokens("i0") == 10 * 16
    # The two evicted blocks were a's leaves, so a's head still matches.
    assert router.route(req(a), pool).expected_cached_tokens == 6 * 16


def test_sglang_eviction_runs_on_its_interval() -> None:
    insts = make_instances(1)
    router = SGLangCacheAwareRouter(seed=0, max_tree_size_tokens=10 * 16, eviction_interval_s=120.0)
    router.route(req(chain((1, 8))), PoolSnapshot(now_s=0.0, instances=insts))
    router.route(req(chain((2, 8))), PoolSnapshot(now_s=60.0, instances=insts))
    assert router.tree_size_tokens("i0") == 16 * 16
    router.route(req(chain((3, 1))), PoolSnapshot(now_s=121.0, instances=insts))
    assert router.tree_size_tokens("i0") == 10 * 16


# --------------------------------------------------------------------------
# llmd_weighted
# --------------------------------------------------------------------------
def _llmd_pool() -> tuple[list[InstanceView], LlmdWeightedRouter]:
    insts = make_instances(3)
    router = LlmdWeightedRouter(seed=0)
    # Seed i0's prefix index: the others are briefly unready.
    insts[1].ready = insts[2].ready = False
    router.route(req(chain((1, 8))), PoolSnapshot(now_s=0.0, instances=insts))
    insts[1].ready = insts[2].ready = True
    insts[0].metrics = ScrapedMetrics(num_waiting=4, kv_usage=0.5)
    insts[1].metrics = ScrapedMetrics(num_waiting=0, kv_usage=0.9)
    insts[2].metrics = ScrapedMetrics(num_waiting=2, kv_usage=0.2)
    return insts, router


def test_llmd_scores_combine_as_weighted() -> None:
    insts, router = _llmd_pool()
    follow = req(chain((1, 6), (2, 2)))  # 6 of 8 blocks cached on i0
    scores = router.scores(follow, insts)
    # i0: 3*6/8 + 2*(4-4)/4 + 2*(1-0.5) = 2.25 + 0 + 1.0
    # i1: 3*0   + 2*(4-0)/4 + 2*(1-0.9) = 0 + 2.0 + 0.2
    # i2: 3*0   + 2*(4-2)/4 + 2*(1-0.2) = 0 + 1.0 + 1.6
    assert scores == pytest.approx({"i0": 3.25, "i1": 2.2, "i2": 2.6})
    d = router.route(follow, PoolSnapshot(now_s=0.0, instances=insts))
    assert d.instance_id == "i0"
    assert d.expected_cached_tokens == 6 * 16


def test_llmd_load_outweighs_a_partial_prefix_hit() -> None:
    insts, router = _llmd_pool()
    insts[0].metrics.kv_usage = 0.95  # i0: 2.25 + 0 + 0.1 = 2.35 < i2's 2.6
    d = router.route(req(chain((1, 6), (2, 2))), PoolSnapshot(now_s=0.0, instances=insts))
    assert d.instance_id == "i2"


def test_llmd_equal_queues_score_one_and_prefix_is_truncated() -> None:
    insts = make_instances(2)
    router = LlmdWeightedRouter(seed=0)
    scores = router.scores(req(chain((1, 4))), insts)
    assert scores == pytest.approx({"i0": 4.0, "i1": 4.0})  # 2*1.0 + 2*(1-0)
    # Only the first 256 blocks are hashed: a 300-block prompt whose first
    # 256 blocks are cached scores a full prefix match.
    insts[1].ready = False
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router.route(req(chain((5, 256))), pool)
    insts[1].ready = True
    scores = router.scores(req(chain((5, 256), (6, 44))), insts)
    assert scores["i0"] == pytest.approx(3.0 + 4.0)


def test_llmd_index_is_sized_by_kv_blocks() -> None:
    insts = make_instances(1)
    insts[0].kv_capacity_tokens = 10 * 16
    router = LlmdWeightedRouter(seed=0)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    for k in range(3):
        router.route(req(chain((k, 4))), pool)
    assert router.index_entries("i0") == 10


def test_llmd_uses_the_precise_prefix_scorer_once_engines_publish_events() -> None:
    insts = make_instances(3)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = LlmdWeightedRouter(seed=0)
    assert not router.precise
    prompt = chain((1, 8), (2, 4))
    # engine events: i1 holds the first 8 blocks, i2 only the first 2 blocks
    router.on_kv_event(KVEvent(instance_id="i1", kind="stored", block_hashes=prompt[:8]))
    router.on_kv_event(KVEvent(instance_id="i2", kind="stored", block_hashes=prompt[:2]))
    assert router.precise
    # longest prefix 8 vs 2, min-max normalised over the holders: i1 1.0, i2 0.0;
    # i0 holds nothing: 0. Queue and KV terms are equal (2 + 2).
    assert router.scores(req(prompt), insts) == pytest.approx({"i0": 4.0, "i1": 7.0, "i2": 4.0})
    d = router.route(req(prompt), pool)
    assert (d.instance_id, d.expected_cached_tokens) == ("i1", 8 * 16)
    # routing adds nothing to the precise index (speculative indexing is off)
    assert router.scores(req(chain((9, 4))), insts) == pytest.approx(
        {"i0": 4.0, "i1": 4.0, "i2": 4.0}
    )
    # evictions reach it: i1 loses blocks 4.., so its run is 4 blocks
    router.on_kv_event(KVEvent(instance_id="i1", kind="removed", block_hashes=prompt[4:8]))
    d = router.route(req(prompt), pool)
    assert (d.instance_id, d.expected_cached_tokens) == ("i1", 4 * 16)
    router.on_kv_event(KVEvent(instance_id="i1", kind="cleared", block_hashes=()))
    # a single holder (i2) scores a full 1.0
    assert router.scores(req(prompt), insts)["i2"] == pytest.approx(7.0)
    # inferred hints (not engine events) never switch the scorer
    fresh = LlmdWeightedRouter(seed=0)
    fresh.on_kv_event(KVEvent(instance_id="i0", kind="stored", block_hashes=prompt, exact=False))
    assert not fresh.precise


def test_engines_publish_kv_events_for_dynamo_on_shipped_defaults() -> None:
    from tokenfleet.core.tiers import SLOConfig
    from tokenfleet.sim.cluster import run_pool
    from tokenfleet.sim.runner import SimSettings, run_policies
    from tokenfleet.workloads.synthetic import generate

    reqs = generate("chat", 60, 0, 20.0)
    settings = SimSettings(profile=PROFILE, instances=2)
    assert settings.kv_events is None  # each peer as shipped
    _, pool = run_pool(reqs, settings.pool_config("dynamo_kv"), SLOConfig())
    router = pool.routers[0]
    assert isinstance(router, DynamoKVRouter) and router.exact  # got engine events
    _, pool = run_pool(reqs, settings.pool_config("llmd_weighted"), SLOConfig())
    llmd = pool.routers[0]
    assert isinstance(llmd, LlmdWeightedRouter) and not llmd.precise  # llm-d's default
    runs = {r.policy: r for r in run_policies(reqs, ["dynamo_kv", "llmd_weighted"], settings)}
    assert runs["dynamo_kv"].as_json()["kv_events"] is True
    assert runs["llmd_weighted"].as_json()["kv_events"] is False
    # --kv-events: every peer gets them, llm-d then scores precisely
    on = SimSettings(profile=PROFILE, instances=2, kv_events=True)
    _, pool = run_pool(reqs, on.pool_config("llmd_weighted"), SLOConfig())
    llmd = pool.routers[0]
    assert isinstance(llmd, LlmdWeightedRouter) and llmd.precise
    # --no-kv-events: Dynamo's approximate mode
    off = SimSettings(profile=PROFILE, instances=2, kv_events=False)
    _, pool = run_pool(reqs, off.pool_config("dynamo_kv"), SLOConfig())
    router = pool.routers[0]
    assert isinstance(router, DynamoKVRouter) and not router.exact


def test_a_dynamo_dc_in_the_fleet_sim_gets_kv_events() -> None:
    from tokenfleet.sim.fleet import FleetSim, scenario_from_mapping

    data = {
        "name": "t",
        "settings": {"default_router": "dynamo_kv"},
        "datacenters": {
            "A": {
                "region": "r1",
                "gpus": 2,
                "deployments": [
                    {"model": "m", "version": "1", "profile": "llama3-8b-h200", "instances": 2}
                ],
            }
        },
        "tenants": {"t": {"home": "A"}},
        "workload": {
            "duration_s": 5,
            "streams": [
                {
                    "name": "s",
                    "tenant": "t",
                    "generator": "chat",
                    "rate_rps": 4,
                    "seed": 1,
                    "model": "m",
                    "version": "1",
                }
            ],
        },
    }
    sc = scenario_from_mapping(data, "<test>")
    from tokenfleet.sim.fleet import build_workload

    sim = FleetSim(sc, "none")
    sim.run(build_workload(sc))
    router = next(iter(sim.pools.values())).sim.routers[0]
    assert isinstance(router, DynamoKVRouter) and router.exact


# --------------------------------------------------------------------------
# dynamo_kv
# --------------------------------------------------------------------------
def test_dynamo_picks_min_cost_and_tracks_active_load() -> None:
    insts = make_instances(2)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = DynamoKVRouter(seed=0)
    r1 = req(chain((1, 10)))
    home = dispatch(router, r1, pool).instance_id
    other = "i1" if home == "i0" else "i0"
    assert router.active_blocks(home) == 10
    assert router.active_prefill_tokens(home) == 160

    r2 = req(chain((1, 8), (2, 2)))
    costs = router.costs(r2, insts)
    # home: overlap 8 -> prefill (160 + 32)/16 = 12, decode 10 + 2 = 12
    # other: prefill 160/16 = 10, decode 0 + 10 = 10
    assert costs[home] == (pytest.approx(24.0), 8)
    assert costs[other] == (pytest.approx(20.0), 0)
    assert router.route(r2, pool).instance_id == other  # r1's prefill still pending

    router2 = DynamoKVRouter(seed=0)
    home2 = dispatch(router2, r1, pool).instance_id
    router2.on_first_token(FirstTokenEvent(request=r1, instance_id=home2, now_s=0.1, ttft_s=0.1))
    # home2: prefill 32/16 = 2, decode 12 -> 14 < 20
    d = router2.route(r2, pool)
    assert d.instance_id == home2
    assert d.expected_cached_tokens == 8 * 16

    finish(router2, r1, home2)
    finish(router2, r2, home2)
    assert router2.active_blocks(home2) == 0
    assert router2.active_prefill_tokens(home2) == 0


def test_dynamo_follows_kv_events() -> None:
    insts = make_instances(2)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = DynamoKVRouter(seed=0)
    prompt = chain((1, 10))
    router.on_kv_event(KVEvent(instance_id="i1", kind="stored", block_hashes=prompt))
    assert router.exact
    r = req(prompt)
    d = router.route(r, pool)  # i1: 0 + 10 = 10, i0: 10 + 10 = 20
    assert (d.instance_id, d.expected_cached_tokens) == ("i1", 160)
    finish(router, r, "i1")

    router.on_kv_event(KVEvent(instance_id="i1", kind="removed", block_hashes=prompt[5:]))
    r = req(prompt)
    d = router.route(r, pool)  # i1: 80/16 + 10 = 15 < 20
    assert (d.instance_id, d.expected_cached_tokens) == ("i1", 80)
    finish(router, r, "i1")
    # Exact mode: routing did not add anything to the index.
    assert router.costs(req(prompt), insts)["i1"][1] == 5

    router.on_kv_event(KVEvent(instance_id="i1", kind="cleared", block_hashes=()))
    assert router.costs(req(prompt), insts)["i1"][1] == 0


def test_dynamo_approximate_index_expires_after_ttl() -> None:
    insts = make_instances(2)
    router = DynamoKVRouter(seed=0, approx_ttl_s=120.0)
    prompt = chain((1, 10))
    r1 = req(prompt)
    home = router.route(r1, PoolSnapshot(now_s=0.0, instances=insts)).instance_id
    finish(router, r1, home)
    r2 = req(prompt)
    d = router.route(r2, PoolSnapshot(now_s=60.0, instances=insts))
    assert (d.instance_id, d.expected_cached_tokens) == (home, 160)
    finish(router, r2, home)
    # r2 refreshed the entries at t=60, so they live until t=180.
    r3 = req(prompt)
    d = router.route(r3, PoolSnapshot(now_s=170.0, instances=insts))
    assert d.expected_cached_tokens == 160
    finish(router, r3, d.instance_id)
    d = router.route(req(prompt), PoolSnapshot(now_s=400.0, instances=insts))
    assert d.expected_cached_tokens == 0


def test_dynamo_temperature_samples_but_prefers_cheaper() -> None:
    insts = make_instances(2)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    prompt = chain((1, 10))
    picks = []
    for seed in range(200):
        router = DynamoKVRouter(seed=seed, router_temperature=1.0)
        router.on_kv_event(KVEvent(instance_id="i1", kind="stored", block_hashes=prompt))
        picks.append(router.route(req(prompt), pool).instance_id)
    # costs 20 vs 10: p(i1) = 1 / (1 + e^-1) ~ 0.73
    share = picks.count("i1") / len(picks)
    assert 0.6 < share < 0.85, share


# --------------------------------------------------------------------------
# Host-memory KV tier (vLLM offloading: events with medium "CPU")
# --------------------------------------------------------------------------
def test_llmd_precise_scorer_weighs_host_tier_blocks_by_the_cpu_weight() -> None:
    insts = make_instances(3)
    router = LlmdWeightedRouter(seed=0, prefix_scorer="precise")
    prompt = chain((1, 10))
    # i1: 6 blocks on the GPU; i2: all 10, but only in host memory (0.8 each = 8.0)
    router.on_kv_event(KVEvent("i1", "stored", prompt[:6]))
    router.on_kv_event(KVEvent("i2", "stored", prompt, medium="CPU"))
    s = router.scores(req(prompt), insts)
    # 8.0 beats 6.0: min-max over the holders puts i2 at 1 and i1 at 0, as i0
    assert s["i2"] == pytest.approx(s["i1"] + 3.0) and s["i1"] == pytest.approx(s["i0"])
    d = router.route(req(prompt), PoolSnapshot(0.0, insts))
    assert (d.instance_id, d.expected_cached_tokens) == ("i2", 160)
    # a GPU copy of the whole prompt on i1 outweighs the host copy on i2
    router.on_kv_event(KVEvent("i1", "stored", prompt[6:]))
    assert router.route(req(prompt), PoolSnapshot(0.0, insts)).instance_id == "i1"
    # a run goes on across tiers: i0 holds 5 on the GPU and the rest on the host
    router.on_kv_event(KVEvent("i0", "stored", prompt[:5]))
    router.on_kv_event(KVEvent("i0", "stored", prompt[5:], medium="CPU"))
    assert router._precise.longest_prefix(prompt)[1]["i0"] == 10


def test_dynamo_counts_only_device_blocks_as_overlap() -> None:
    insts = make_instances(2)
    router = DynamoKVRouter(seed=0)
    prompt = chain((1, 10))
    router.on_kv_event(KVEvent("i1", "stored", prompt, medium="CPU"))
    assert router.costs(req(prompt), insts)["i1"][1] == 0
    router.on_kv_event(KVEvent("i1", "stored", prompt[:4]))
    assert router.costs(req(prompt), insts)["i1"][1] == 4


def test_vllm_router_kv_aware_scores_the_longest_prefix_with_tier_penalties() -> None:
    from tokenfleet.core.routing.vllm_router_kv_aware import VllmRouterKvAware

    insts = make_instances(3)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = VllmRouterKvAware(enable_speculative=False)
    prompt = chain((1, 20))
    router.on_kv_event(KVEvent("i0", "stored", prompt[:10]))  # 10 x 1.0
    router.on_kv_event(KVEvent("i1", "stored", prompt[:11], medium="CPU"))  # 11 x 0.8
    d = router.route(req(prompt), pool)
    assert (d.instance_id, d.expected_cached_tokens) == ("i0", 160)
    router.on_kv_event(KVEvent("i1", "stored", prompt[11:20], medium="CPU"))  # 20 x 0.8
    d = router.route(req(prompt), pool)
    assert (d.instance_id, d.expected_cached_tokens) == ("i1", 319)  # the last token recomputes
    # a gap ends a run; BlockRemoved on the host tier leaves the GPU copy alone
    router.on_kv_event(KVEvent("i1", "removed", prompt[:1], medium="CPU"))
    assert router.route(req(prompt), pool).instance_id == "i0"


def test_vllm_router_kv_aware_credits_tiers_as_the_shipped_router() -> None:
    """vllm-router 0.1.17's defaults: a host copy scores 0.8 of a block, an
    external (shared-pool) copy 0.6; so 10 GPU blocks beat 12 host ones
    (9.6) and lose to 13 (10.4), and 17 external ones (10.2) beat them too."""
    from tokenfleet.core.routing.vllm_router_kv_aware import VllmRouterKvAware

    insts = make_instances(3)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    prompt = chain((1, 24))

    def winner(host_blocks: int, external_blocks: int) -> str:
        router = VllmRouterKvAware(enable_speculative=False)
        router.on_kv_event(KVEvent("i0", "stored", prompt[:10]))
        router.on_kv_event(KVEvent("i1", "stored", prompt[:host_blocks], medium="CPU"))
        router.on_kv_event(KVEvent("i2", "stored", prompt[:external_blocks], medium="LMCACHE"))
        return router.route(req(prompt), pool).instance_id

    assert winner(12, 0) == "i0"
    assert winner(13, 0) == "i1"
    assert winner(0, 16) == "i0"  # 9.6
    assert winner(0, 17) == "i2"  # 10.2


def test_vllm_router_kv_aware_falls_back_to_least_load_and_speculates() -> None:
    from tokenfleet.core.routing.vllm_router_kv_aware import VllmRouterKvAware

    insts = make_instances(3)
    pool = PoolSnapshot(now_s=0.0, instances=insts)
    router = VllmRouterKvAware()
    insts[0].accounting.inflight_requests = 2
    insts[2].accounting.inflight_requests = 1
    prompt = chain((7, 8))
    d = dispatch(router, req(prompt), pool)  # no hit anywhere: least load, i1
    assert d.instance_id == "i1" and d.expected_cached_tokens == 0
    # the next request with that prefix follows it (speculative entries, 2 s) ...
    assert dispatch(router, req(prompt + chain((8, 2))), pool).instance_id == "i1"
    # ... until they expire with no BlockStored to confirm them
    later = PoolSnapshot(now_s=2.5, instances=insts)
    insts[1].accounting.inflight_requests = 5
    assert router.route(req(prompt), later).instance_id in {"i0", "i2"}
