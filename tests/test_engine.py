"""Scenario tests for the simulated engine (EngineInstance + profile timing).

Each test drives one engine through a small, hand-built workload and checks a
behaviour a router or the simulator relies on: prefill cost, prefix-cache
hits, KV-limited admission, chunked-prefill budget, LRU eviction order, abort,
preemption, and block accounting. They run in well under a second.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from tokenfleet.engine.instance import EngineInstance, EngineRequest
from tokenfleet.engine.profiles import PROFILES, EngineProfile, get_profile
from tokenfleet.errors import CapacityError

H200_8B = get_profile("llama3-8b-h200")
BLOCK = H200_8B.block_size_tokens


@dataclass
class Trace:
    """What a client would observe: first-token and finish times per request."""

    first_s: dict[str, float] = field(default_factory=dict)
    finish_s: dict[str, float] = field(default_factory=dict)
    firsts_seen: list[str] = field(default_factory=list)
    steps: int = 0
    now_s: float = 0.0


def drive(
    eng: EngineInstance,
    arrivals: list[tuple[float, EngineRequest]],
    check: Callable[[EngineInstance], None] | None = None,
    trace: Trace | None = None,
    max_steps: int = 200_000,
) -> Trace:
    """Add requests at their times and step the engine until it is idle."""
    tr = trace or Trace()
    pending = sorted(arrivals, key=lambda a: a[0])
    i = 0
    while i < len(pending) or not eng.idle:
        while i < len(pending) and pending[i][0] <= tr.now_s:
            eng.add(pending[i][1])
            i += 1
        dur = eng.plan_step()
        if check is not None:
            check(eng)
        if dur == 0.0:
            assert i < len(pending), "engine has work but planned an empty step"
            tr.now_s = pending[i][0]
            continue
        tr.now_s += dur
        res = eng.finish_step()
        tr.steps += 1
        for r in res.first_tokens:
            tr.first_s[r.request_id] = tr.now_s
            tr.firsts_seen.append(r.request_id)
        for r in res.finished:
            tr.finish_s[r.request_id] = tr.now_s
        assert tr.steps < max_steps, "engine did not drain"
    return tr


def req(
    rid: str, input_tokens: int, output_tokens: int, hashes: tuple[int, ...] | None = None
) -> EngineRequest:
    return EngineRequest(rid, input_tokens, output_tokens, hashes if hashes is not None else ())


def chain(tag: int, n: int) -> tuple[int, ...]:
    """n distinct block hashes; the same tag gives the same prefix."""
    return tuple(tag * 1_000_000 + j for j in range(n))


def assert_accounting(eng: EngineInstance) -> None:
    """Used blocks = private blocks of running requests + referenced cache blocks."""
    assert 0 <= eng.used_blocks <= eng.capacity_blocks
    referenced = sum(1 for rc in eng._cache.values() if rc > 0)
    # waiting requests hold blocks only while (or after) loading from the host tier
    private = sum(r.blocks - len(r.hashed) for r in (*eng.running, *eng.waiting))
    assert eng.used_blocks == private + referenced
    free_cached = sum(1 for rc in eng._cache.values() if rc == 0)
    assert free_cached == sum(1 for k in eng._free_queue if isinstance(k, int))
    assert eng.used_blocks + eng._fresh + len(eng._free_queue) == eng.capacity_blocks
    for r in eng.waiting:
        if eng.host_capacity_blocks == 0:
            assert r.blocks == 0 and not r.hashed
    assert eng.host_blocks <= eng.host_capacity_blocks


# -- prefill ------------------------------------------------------------------


def test_prefill_time_grows_with_uncached_tokens() -> None:
    ttft = []
    for n in (128, 1024, 4096, 16384, 65536):
        tr = drive(EngineInstance("e", H200_8B), [(0.0, req("r", n, 1))])
        ttft.append(tr.first_s["r"])
    assert all(a < b for a, b in zip(ttft, ttft[1:], strict=False)), ttft
    # compute-bound at scale, and attention makes it superlinear: 16x tokens
    # from 4096 to 65536 costs more than 16x
    assert ttft[4] / ttft[2] > 16
    # the profile's own estimate agrees with the engine for a lone prompt
    assert H200_8B.prefill_time_s(16384) == pytest.approx(ttft[3], rel=1e-9)
    # cached tokens are not recomputed: the same prompt costs less with a cached prefix
    assert H200_8B.prefill_time_s(8192, cached_tokens=8192) < H200_8B.prefill_time_s(16384)


def test_prefix_cache_hit_cuts_ttft_and_is_reported() -> None:
    eng = EngineInstance("e", H200_8B)
    hashes = chain(1, 256)  # 4096 tokens of full blocks, plus 7 more
    a = req("a", 256 * BLOCK + 7, 4, hashes)
    tr = drive(eng, [(0.0, a)])
    b = req("b", 256 * BLOCK + 7, 4, hashes)
    start = tr.now_s
    tr = drive(eng, [(start, b)], trace=tr)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 256 * BLOCK
    ttft_a = tr.first_s["a"]
    ttft_b = tr.first_s["b"] - start
    assert ttft_b < 0.25 * ttft_a
    assert eng.counters.prefix_hits_tokens == 256 * BLOCK
    assert eng.counters.prefix_queries_tokens == 2 * (256 * BLOCK + 7)


def test_last_prompt_token_is_always_recomputed() -> None:
    """A prompt made only of full cached blocks still recomputes its last block."""
    eng = EngineInstance("e", H200_8B)
    hashes = chain(2, 64)
    drive(eng, [(0.0, req("a", 64 * BLOCK, 2, hashes))])
    b = req("b", 64 * BLOCK, 2, hashes)
    drive(eng, [(0.0, b)])
    assert b.cached_tokens == 63 * BLOCK


# -- KV-limited admission -----------------------------------------------------


def test_kv_limit_queues_second_request_until_first_finishes() -> None:
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=20)
    # a: 200 prompt + 100 output = 300 tokens -> grows to 19 of 20 blocks
    a = req("a", 200, 100)
    b = req("b", 200, 5)  # needs 13 blocks, only 7 are left once a is in

    def check(e: EngineInstance) -> None:
        assert_accounting(e)
        assert e.used_blocks <= 20
        if "a" in e.by_id and e.by_id["a"].admitted:
            assert not b.admitted, "b must wait while a holds the blocks"

    tr = drive(eng, [(0.0, a), (0.0, b)], check=check)
    assert tr.first_s["b"] > tr.finish_s["a"]
    assert eng.counters.preemptions == 0
    assert a.generated_tokens == 100 and b.generated_tokens == 5


def test_request_that_can_never_fit_is_rejected_with_a_fix() -> None:
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=10)
    with pytest.raises(CapacityError, match="larger profile"):
        eng.add(req("big", 150, 20))  # 170 tokens = 11 blocks > 10


def test_max_num_seqs_caps_the_running_set() -> None:
    p = H200_8B.with_overrides(max_num_seqs=4)
    eng = EngineInstance("e", p)
    seen = []
    drive(
        eng,
        [(0.0, req(f"r{i}", 50, 20)) for i in range(10)],
        check=lambda e: seen.append(len(e.running)),
    )
    assert max(seen) == 4


# -- decode cost --------------------------------------------------------------


@pytest.mark.parametrize("name", ["llama3-8b-h200", "llama3-70b-h200-tp4"])
def test_decode_step_time_grows_with_batch_and_context(name: str) -> None:
    p = get_profile(name)
    by_batch = [p.decode_step_time_s(b, 1024) for b in (1, 8, 64, 256)]
    by_ctx = [p.decode_step_time_s(32, c) for c in (128, 2048, 32768)]
    assert all(x < y for x, y in zip(by_batch, by_batch[1:], strict=False)), by_batch
    assert all(x < y for x, y in zip(by_ctx, by_ctx[1:], strict=False)), by_ctx
    # memory-bound: 256 sequences cost far less than 256 single-sequence steps
    assert by_batch[-1] < 10 * by_batch[0]


def test_engine_decode_steps_slow_down_as_batch_and_context_grow() -> None:
    def steady_step_s(n: int, prompt: int) -> float:
        eng = EngineInstance("e", H200_8B)
        for i in range(n):
            eng.add(req(f"r{i}", prompt, 50))
        while any(r.generated_tokens == 0 for r in eng.running) or eng.waiting:
            eng.plan_step()
            eng.finish_step()
        dur = eng.plan_step()  # a pure decode step
        assert all(r.computed_tokens == r.prompt_tokens for r in eng.running)
        return dur

    assert steady_step_s(1, 100) < steady_step_s(64, 100) < steady_step_s(256, 100)
    assert steady_step_s(64, 100) < steady_step_s(64, 4000) < steady_step_s(64, 16000)


# -- chunked prefill ----------------------------------------------------------


def test_chunked_prefill_respects_max_num_batched_tokens() -> None:
    budget = 512
    p = H200_8B.with_overrides(max_num_batched_tokens=budget)
    eng = EngineInstance("e", p)
    scheduled: list[int] = []

    def check(e: EngineInstance) -> None:
        s = sum(r.scheduled for r in e.running)
        assert s <= budget
        scheduled.append(s)

    arrivals = [(0.0, req(f"d{i}", 20, 200)) for i in range(8)]
    arrivals.append((0.05, req("long", 2000, 3)))
    tr = drive(eng, arrivals, check=check)
    # the long prompt needs ceil(2000 / (512 - 8 decode tokens)) = 4 prefill steps
    prefill_steps = sum(1 for s in scheduled if s > 8)
    assert prefill_steps >= 4
    assert max(scheduled) == budget
    assert tr.first_s["long"] > 0.05
    # decodes kept going while the long prompt was prefilled in chunks
    assert all(tr.finish_s[f"d{i}"] > tr.first_s["long"] for i in range(8))


# -- prefix cache eviction ----------------------------------------------------


def test_lru_eviction_takes_least_recently_freed_blocks_tails_first() -> None:
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=16)
    a_hashes, b_hashes, c_hashes = chain(10, 10), chain(11, 5), chain(12, 2)
    # a: 11 blocks (a0..a9 cached, 1 partial) freed tail first:
    # queue = [5 never used, a_partial, a9..a0]
    drive(eng, [(0.0, req("a", 10 * BLOCK + 1, 1, a_hashes))])
    # b: 6 blocks = the 5 never-used + a's empty partial; queue = [a9..a0, b_partial, b4..b0]
    drive(eng, [(0.0, req("b", 5 * BLOCK + 1, 1, b_hashes))])
    assert eng.used_blocks == 0
    # c needs 3 blocks: the least recently freed go, a's tail (a9, a8, a7), not b's
    drive(eng, [(0.0, req("c", 40, 1, c_hashes))])
    e = req("e", 5 * BLOCK + 1, 1, b_hashes)
    drive(eng, [(0.0, e)])  # revives b0..b4 and takes a6 for its partial block
    assert e.cached_tokens == 5 * BLOCK  # b's blocks all survived
    d = req("d", 10 * BLOCK + 1, 1, a_hashes)
    drive(eng, [(0.0, d)])
    assert d.cached_tokens == 6 * BLOCK  # a0..a5 survive, a6..a9 were evicted


# -- vLLM V1 cache semantics (docs/engine-model.md, section 5) -------------------


def test_blocks_are_cached_when_scheduled_so_a_request_in_the_same_step_hits() -> None:
    """kv_cache_manager.allocate_slots caches full blocks before the step runs."""
    eng = EngineInstance("e", H200_8B)
    shared = chain(40, 64)
    a = req("a", 64 * BLOCK + 10, 2, shared + chain(41, 0))
    b = req("b", 64 * BLOCK + 10, 2, shared)
    eng.add(a)
    eng.add(b)
    eng.plan_step()
    assert a.admitted and b.admitted  # both in the first step (2,068 of 8,192 tokens)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 64 * BLOCK  # a's blocks, scheduled moments earlier
    eng.finish_step()
    assert eng.counters.prompt_tokens_computed == 64 * BLOCK + 10 + 10


def test_a_request_hits_the_chunks_another_request_is_still_prefilling() -> None:
    eng = EngineInstance("e", H200_8B)
    doc = chain(42, 760)  # 12,160 tokens: chunks of 8,192 and 3,973 (with 5 more)
    a = req("a", 760 * BLOCK + 5, 2, doc)
    eng.add(a)
    eng.plan_step()
    eng.finish_step()  # a's first chunk is done; the second is not scheduled yet
    b = req("b", 860 * BLOCK, 2, doc + chain(43, 100))
    eng.add(b)
    eng.plan_step()  # a's last chunk is scheduled (and cached) before b is admitted
    assert b.admitted
    assert b.cached_tokens == 760 * BLOCK  # a's whole prompt, not only its computed chunk


def test_generated_blocks_are_cached_for_the_next_turn() -> None:
    """A conversation's next prompt = prompt + answer + new message hits the answer."""
    eng = EngineInstance("e", H200_8B)
    seq = chain(43, 16)  # prompt (167 tokens) + answer (100 tokens) = 267 tokens
    turn1 = EngineRequest("t1", 10 * BLOCK + 7, 100, seq[:10], output_block_hashes=seq[10:])
    tr = drive(eng, [(0.0, turn1)])
    turn2 = req("t2", 267 + 20, 2, seq + chain(44, 1))
    drive(eng, [(tr.now_s, turn2)], trace=tr)
    # the answer's KV covers 266 tokens (the last sampled token is never fed
    # back): 16 full blocks, all reused; only the prompt's 10 without output hashes
    assert turn2.cached_tokens == 16 * BLOCK


def test_empty_freed_blocks_do_not_shield_older_cached_blocks() -> None:
    """One free queue ordered by free time (block_pool.FreeKVCacheBlockQueue)."""
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=12)
    a_hashes = chain(45, 4)
    drive(eng, [(0.0, req("a", 4 * BLOCK + 1, 1, a_hashes))])  # 5 blocks; a0..a3 cached
    drive(eng, [(0.0, req("u", 7 * BLOCK + 1, 1))])  # 8 blocks, no prefix: freed later than a's
    drive(eng, [(0.0, req("v", 2 * BLOCK - 1, 1))])  # 2 blocks: a3 and a2 are the oldest free
    d = req("d", 4 * BLOCK + 1, 1, a_hashes)
    drive(eng, [(0.0, d)])
    assert d.cached_tokens == 2 * BLOCK


def test_default_scheduler_limits_are_vllm_v1_server_defaults_on_hopper() -> None:
    # vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults: >= 70 GiB GPUs,
    # OpenAI server usage context
    for name in ("llama3-8b-h200", "llama3-8b-h100", "llama3-70b-h200-tp4"):
        p = get_profile(name)
        assert (p.max_num_seqs, p.max_num_batched_tokens) == (1024, 8192), name


# -- abort ----------------------------------------------------------------------


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=40)
    run1, wait1 = req("run", 300, 50), req("wait", 400, 10)
    eng.add(run1)
    eng.add(wait1)
    eng.plan_step()
    eng.finish_step()
    assert run1.admitted and not wait1.admitted  # 19 + 25 blocks > 40
    assert eng.used_blocks > 0
    assert eng.abort("wait") is wait1 and not eng.waiting
    assert eng.abort("run") is run1
    assert eng.used_blocks == 0 and eng.idle
    assert eng.abort("run") is None  # idempotent
    # mid-step: the step's work is spent, the request never reports a finish
    mid = req("mid", 100, 2)
    eng.add(mid)
    eng.plan_step()
    eng.abort("mid")
    res = eng.finish_step()
    assert mid not in res.finished and mid not in res.first_tokens
    assert eng.used_blocks == 0 and eng.idle and "mid" not in eng.by_id


# -- preemption -----------------------------------------------------------------


def test_decode_growth_past_kv_preempts_and_recomputes() -> None:
    # a small token budget makes the victim's first re-prefill chunk need one
    # block only, so it would fit right away if admissions were not paused
    p = H200_8B.with_overrides(max_num_batched_tokens=16)
    eng = EngineInstance("e", p, kv_capacity_blocks=12)
    a, b = req("a", 80, 60), req("b", 80, 60)  # 5 blocks each at admission, 9 at the end
    victims_readmitted_same_step = []
    last = [0]

    def check(e: EngineInstance) -> None:
        assert_accounting(e)
        if e.counters.preemptions > last[0]:
            last[0] = e.counters.preemptions
            victims_readmitted_same_step.append(b.admitted)

    tr = drive(eng, [(0.0, a), (0.0, b)], check=check)
    assert eng.counters.preemptions >= 1 and b.preemptions >= 1 and a.preemptions == 0
    assert victims_readmitted_same_step and not any(victims_readmitted_same_step)
    # recompute is invisible to the client: one first token each, exact lengths
    assert sorted(tr.firsts_seen) == ["a", "b"]
    assert a.generated_tokens == 60 and b.generated_tokens == 60
    assert eng.counters.generation_tokens == 120
    # as vLLM exports them, the prefix-cache counters hold each request's first
    # admission only (a readmission is recorded apart): a router reading admitted
    # prefill from them does not see the recompute, as it would not against vLLM
    assert eng.counters.prefix_queries_tokens == 80 + 80
    assert eng.counters.prompt_tokens_computed > 160
    assert tr.finish_s["b"] > tr.finish_s["a"]
    assert eng.used_blocks == 0


# -- accounting under a messy workload ---------------------------------------------


def test_block_accounting_returns_to_zero_after_everything_finishes() -> None:
    rng = random.Random(5)
    eng = EngineInstance(
        "e", H200_8B.with_overrides(max_num_batched_tokens=1024), kv_capacity_blocks=300
    )
    arrivals = []
    for i in range(150):
        prefix = chain(rng.randrange(6), rng.randint(5, 60))
        own = tuple(90_000_000 + i * 1000 + j for j in range(rng.randint(0, 30)))
        hashes = prefix + own
        arrivals.append(
            (
                rng.uniform(0, 2.0),
                req(f"r{i}", len(hashes) * BLOCK + rng.randint(0, 15), rng.randint(1, 600), hashes),
            )
        )
    doomed = {f"r{i}" for i in rng.sample(range(150), 20)}
    aborted = []

    def check(e: EngineInstance) -> None:
        assert_accounting(e)
        for rid in list(doomed):
            r = e.by_id.get(rid)
            if r is not None and (r.generated_tokens > 3 or not r.admitted and rng.random() < 0.01):
                e.abort(rid)
                doomed.discard(rid)
                aborted.append(rid)

    tr = drive(eng, arrivals, check=check)
    assert eng.counters.preemptions > 0  # the scenario does exercise preemption
    assert eng.counters.prefix_hits_tokens > 0  # and prefix sharing
    assert eng.used_blocks == 0 and eng.idle and not eng.by_id
    assert_accounting(eng)
    finished = set(tr.finish_s)
    assert finished.isdisjoint(aborted)
    assert len(finished) + len(aborted) == 150


# -- capacity of the built-in profiles -------------------------------------------


@pytest.mark.parametrize(
    "name, low, high",
    [
        ("llama3-8b-h200", 0.7e6, 0.9e6),
        ("llama3-8b-h100", 0.35e6, 0.5e6),
        ("llama3-70b-h200-tp4", 0.9e6, 1.4e6),
        ("llama3-70b-h100-tp4", 0.35e6, 0.6e6),
    ],
)
def test_builtin_kv_capacity_is_physically_sensible(name: str, low: float, high: float) -> None:
    p: EngineProfile = get_profile(name)
    assert low <= p.kv_capacity_tokens <= high
    # what the KV pool and the weights take fits in the memory vLLM may use
    used = p.kv_capacity_tokens * p.model.kv_bytes_per_token + p.model.weight_bytes
    assert used <= p.tp * p.gpu.hbm_bytes * p.gpu_memory_utilization


def test_kv_bytes_per_token_match_the_llama_configs() -> None:
    # 2 (K and V) x layers x KV heads x head dim x 2 bytes (bf16)
    assert get_profile("llama3-8b-h200").model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert get_profile("llama3-70b-h200-tp4").model.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2


def test_every_builtin_profile_can_serve_a_long_request() -> None:
    for name in PROFILES.names():
        p = get_profile(name)
        assert p.kv_capacity_tokens >= 32 * 1024, name
        eng = EngineInstance("e", p)
        tr = drive(eng, [(0.0, req("r", 8000, 8))])
        assert tr.finish_s["r"] > tr.first_s["r"] > 0


# -- host-memory KV tier (vLLM's OffloadingConnector; docs/engine-model.md) -------


def test_host_tier_is_off_by_default() -> None:
    eng = EngineInstance("e", H200_8B)
    assert H200_8B.host_kv_bytes == 0 and eng.host_capacity_blocks == 0
    hashes = chain(1, 64)
    drive(eng, [(0.0, req("a", 64 * BLOCK + 3, 4, hashes))])
    assert eng.host_blocks == 0 and not eng.in_host(hashes[0])
    assert eng.counters.host_stored_blocks == 0 and eng.counters.host_queries_tokens == 0


def test_host_capacity_comes_from_bytes() -> None:
    prof = H200_8B.with_overrides(host_kv_bytes=256e9)
    per_block = prof.model.kv_bytes_per_token * BLOCK  # 2 MiB for Llama-3-8B
    assert prof.host_kv_capacity_blocks == int(256e9 // per_block)
    assert EngineInstance("e", prof).host_capacity_blocks == prof.host_kv_capacity_blocks
    # about 2.2x one H200's GPU KV
    assert 2.0 < prof.host_kv_capacity_blocks / prof.kv_capacity_blocks < 2.5


def _evict_then_return(host_blocks: int) -> tuple[EngineInstance, EngineRequest, float, Trace]:
    """a (500 blocks) runs, b (600 other blocks) evicts it from a 700-block GPU,
    then a's conversation comes back: returns the engine, the returning turn,
    its arrival and the trace."""
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=700, host_capacity_blocks=host_blocks)
    a_hashes = chain(1, 500)
    tr = drive(eng, [(0.0, req("a", 500 * BLOCK, 1, a_hashes))])
    tr = drive(eng, [(tr.now_s, req("b", 600 * BLOCK, 1, chain(2, 600)))], trace=tr)
    start = tr.now_s
    back = req("a2", 500 * BLOCK + 40, 1, a_hashes + chain(3, 2))
    tr = drive(eng, [(start, back)], trace=tr, check=assert_accounting)
    return eng, back, start, tr


def test_a_block_evicted_from_the_gpu_is_found_in_the_host_tier() -> None:
    eng, back, _, _ = _evict_then_return(host_blocks=5000)
    a0 = chain(1, 500)[0]
    assert eng.counters.host_stored_blocks >= 1100  # write-through: a's and b's blocks
    assert back.cached_tokens == 500 * BLOCK  # all of a's blocks came back
    # from the host tier, not the GPU (b evicted a's head there)
    assert back.host_hit_tokens >= 400 * BLOCK
    assert back.cached_tokens - back.host_hit_tokens == eng.counters.prefix_hits_tokens
    assert eng.in_host(a0)
    assert eng.counters.host_hits_tokens == back.host_hit_tokens
    assert eng.used_blocks == 0  # the loaded blocks return to the free queue


def test_a_host_hit_costs_the_transfer_not_the_prefill() -> None:
    eng, back, start, tr = _evict_then_return(host_blocks=5000)
    ttft = tr.first_s["a2"] - start
    load = H200_8B.host_load_time_s(back.host_hit_tokens)
    gpu_hit = back.cached_tokens - back.host_hit_tokens
    rest = H200_8B.prefill_time_s(back.input_tokens - back.cached_tokens, back.cached_tokens)
    # the load (at most one 2 ms poll late) then a prefill of the uncached tail only
    assert load <= ttft - rest + 1e-9 <= load + 0.0021, (ttft, load, rest, gpu_hit)
    # recomputing instead (no host tier) costs the whole prefill, several times more
    _, again, start2, tr2 = _evict_then_return(host_blocks=0)
    ttft_recompute = tr2.first_s["a2"] - start2
    assert again.host_hit_tokens == 0
    assert ttft_recompute > 4 * ttft


def test_the_host_tier_evicts_its_least_recently_used_blocks() -> None:
    events: list[tuple[str, tuple[int, ...]]] = []
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=700, host_capacity_blocks=50)
    eng.host_listener = lambda kind, hashes: events.append((kind, tuple(hashes)))
    a_hashes, b_hashes = chain(1, 40), chain(2, 40)
    drive(eng, [(0.0, req("a", 40 * BLOCK + 1, 1, a_hashes))])
    drive(eng, [(0.0, req("b", 40 * BLOCK + 1, 1, b_hashes))])
    assert eng.host_blocks == 50
    assert eng.counters.host_evicted_blocks == 30
    assert all(eng.in_host(h) for h in b_hashes)
    # the oldest 30 of a's blocks went, in LRU order, and the events say so
    assert [h for h in a_hashes if eng.in_host(h)] == list(a_hashes[30:])
    removed = [h for kind, hs in events if kind == "removed" for h in hs]
    assert removed == list(a_hashes[:30])
    stored = [h for kind, hs in events if kind == "stored" for h in hs]
    assert stored == list(a_hashes) + list(b_hashes)


def test_a_request_loading_from_host_does_not_hold_up_the_queue() -> None:
    """vLLM parks it in WAITING_FOR_REMOTE_KVS and schedules the others."""
    eng = EngineInstance("e", H200_8B, kv_capacity_blocks=3000, host_capacity_blocks=20000)
    long = chain(1, 2000)  # 32k tokens: a 84 ms load
    drive(eng, [(0.0, req("a", 2000 * BLOCK, 1, long))])
    eng.reset_prefix_cache()  # the GPU forgets it, the host tier does not
    back = req("a2", 2000 * BLOCK + 8, 1, long)
    short = req("s", 64, 1, chain(9, 4))
    tr = drive(eng, [(0.0, back), (0.0, short)], check=assert_accounting)
    assert back.host_hit_tokens == 2000 * BLOCK  # every full block (8 tokens are left)
    assert tr.first_s["s"] < H200_8B.host_load_time_s(back.host_hit_tokens) < tr.first_s["a2"]


def test_accounting_holds_with_the_host_tier_aborts_and_preemption() -> None:
    rng = random.Random(7)
    eng = EngineInstance(
        "e",
        H200_8B.with_overrides(max_num_batched_tokens=1024),
        kv_capacity_blocks=300,
        host_capacity_blocks=400,
    )
    arrivals = []
    for i in range(150):
        prefix = chain(rng.randrange(6), rng.randint(5, 60))
        own = tuple(90_000_000 + i * 1000 + j for j in range(rng.randint(0, 30)))
        hashes = prefix + own
        n_in = len(hashes) * BLOCK + rng.randint(0, 15)
        arrivals.append((rng.uniform(0, 2.0), req(f"r{i}", n_in, rng.randint(1, 600), hashes)))
    doomed = {f"r{i}" for i in rng.sample(range(150), 20)}

    def check(e: EngineInstance) -> None:
        assert_accounting(e)
        for rid in list(doomed):
            r = e.by_id.get(rid)
            if r is not None and (r.loading or r.generated_tokens > 3):
                e.abort(rid)
                doomed.discard(rid)

    drive(eng, arrivals, check=check)
    assert eng.counters.host_hits_tokens > 0 and eng.counters.preemptions > 0
    assert eng.used_blocks == 0 and eng.idle and not eng.by_id
    assert_accounting(eng)
