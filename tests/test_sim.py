"""Scenario tests for the simulator driver: determinism, honesty, staleness, CLI errors."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tokenfleet.cli.main import main
from tokenfleet.core.routing import ROUTERS, BaseRouter
from tokenfleet.core.routing.base import eligible
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import KVEvent, PoolSnapshot, RequestInfo, RouteDecision
from tokenfleet.engine.profiles import get_profile
from tokenfleet.sim.cluster import PoolConfig, run_pool
from tokenfleet.sim.metrics import summarize
from tokenfleet.workloads.trace import TraceRequest

PROFILE = get_profile("llama3-8b-h200")


def burst(
    n: int, outputs: list[int], seed: int = 1, spacing_s: float = 0.002, prefixes: int = 5
) -> list[TraceRequest]:
    """n requests with shared prefixes arriving close together."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = rng.randrange(prefixes)
        shared = tuple(10_000 * (p + 1) + j for j in range(rng.randint(20, 200)))
        own = tuple(10_000_000 + i * 1000 + j for j in range(rng.randint(5, 100)))
        hashes = shared + own
        info = RequestInfo(
            request_id=f"r{i}",
            arrival_s=i * spacing_s,
            input_tokens=len(hashes) * 16 + 7,
            max_tokens=1024,
            block_hashes=hashes,
        )
        out.append(TraceRequest(info, outputs[i]))
    return out


def run(reqs: list[TraceRequest], policy: str, seed: int = 0, **kw: object):
    cfg = PoolConfig(profile=PROFILE, n_instances=4, router=policy, seed=seed, **kw)  # type: ignore[arg-type]
    return run_pool(reqs, cfg, SLOConfig())


def test_same_seed_same_result() -> None:
    reqs = burst(150, [random.Random(i).randint(50, 400) for i in range(150)])
    a, _ = run(reqs, "random", seed=3)
    b, _ = run(reqs, "random", seed=3)
    assert [(r.instance_id, r.first_token_s, r.finish_s) for r in a] == [
        (r.instance_id, r.first_token_s, r.finish_s) for r in b
    ]
    c, _ = run(reqs, "random", seed=4)
    assert [r.instance_id for r in a] != [r.instance_id for r in c]


@pytest.mark.parametrize("policy", ROUTERS.names())
def test_no_policy_can_read_true_output_length(policy: str) -> None:
    """Before the first request finishes, nothing observable depends on output
    lengths. So if two runs differ only in true output lengths, every routing
    decision made before the first completion must be identical. A policy that
    peeked at the truth (through any back door) would diverge."""
    n = 120
    a_out = [400] * n
    b_out = [random.Random(i).randint(300, 1000) for i in range(n)]
    ra, _ = run(burst(n, a_out, spacing_s=0.01), policy, seed=7)
    rb, _ = run(burst(n, b_out, spacing_s=0.01), policy, seed=7)
    first_done = min(
        min(r.finish_s for r in ra if r.finish_s), min(r.finish_s for r in rb if r.finish_s)
    )
    before = [
        (x.instance_id, y.instance_id)
        for x, y in zip(ra, rb, strict=False)
        if x.arrival_s < first_done
    ]
    assert len(before) >= 50, "scenario must route many requests before any completes"
    assert all(x == y for x, y in before)


class _Spy(BaseRouter):
    """Records the metric ages it is shown, to check scrape staleness."""

    ages: list[float] = []

    def __init__(self, seed: int = 0) -> None:
        self.i = 0

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        for inst in pool.instances:
            _Spy.ages.append(pool.now_s - inst.metrics.scraped_at_s)
        c = eligible(request, pool)
        self.i += 1
        return RouteDecision(c[self.i % len(c)].instance_id)


def test_routers_see_metrics_stale_by_at_most_one_scrape_interval() -> None:
    if "_spy" not in ROUTERS:
        ROUTERS.add("_spy", _Spy)
    try:
        _Spy.ages = []
        reqs = burst(200, [100] * 200, spacing_s=0.013)
        run(reqs, "_spy", scrape_interval_s=0.25)
        ages = _Spy.ages
        assert max(ages) <= 0.25 + 1e-9
        assert max(ages) > 0.2  # really stale, not magically fresh
    finally:
        ROUTERS.remove("_spy")


def test_goodput_counts_only_completed_requests_within_slo() -> None:
    reqs = burst(60, [50] * 60, spacing_s=0.05)
    recs, pool = run(reqs, "round_robin")
    s = summarize(recs, SLOConfig(), busy_s=pool.busy_s())
    good = sum(r.output_tokens for r in recs if r.slo_met)
    assert s["completed"] == 60
    assert s["goodput_tok_s"] == pytest.approx(good / s["duration_s"])
    assert 0 < s["utilization"] <= 1
    assert s["throughput_tok_s"] >= s["goodput_tok_s"]


def test_kv_limit_queues_instead_of_overcommitting() -> None:
    reqs = burst(40, [300] * 40, spacing_s=0.001)
    recs, pool = run(reqs, "round_robin", kv_capacity_blocks=600)
    assert all(r.status == "completed" for r in recs)
    for e in pool.engines:
        assert e.used_blocks == 0


# -- CLI: bad input is one clear line and exit code 2 ----------------------------
def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        rc = main(list(argv))
    except SystemExit as exc:  # argparse
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    return rc, err


def test_cli_rejects_malformed_trace_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
    p.write_text(json.dumps(good) + "\n" + "{not json\n")
    rc, err = _cli(
        capsys,
        "sim",
        "--trace",
        str(p),
        "--trace-format",
        "mooncake",
        "--policy",
        "round_robin",
        "--quiet",
    )
    assert rc == 2
    assert f"{p}:2" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--policy", "no_such_router"], "no_such_router"),
        (["--profile", "no_such_profile"], "no_such_profile"),
        (["--load", "-0.5"], "--load"),
        (["--routers", "4", "--shared-state-ms", "-5"], "--shared-state-ms must be >= 0"),
    ],
)
def test_cli_bad_arguments(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, err = _cli(
        capsys, "sim", "--synthetic", "chat", "--synthetic-requests", "20", "--quiet", *argv
    )
    assert rc == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_results_do_not_depend_on_python_hash_seed(tmp_path: Path) -> None:
    """String hashing is randomised per process; a policy that iterates a set of
    instance ids to break ties would silently make runs irreproducible."""
    import subprocess
    import sys

    policies = [n for n in ROUTERS.names() if not n.startswith("_")]
    procs = []
    for seed in ("1", "2"):  # both at once: one per core
        out = tmp_path / f"run{seed}.json"
        cmd = [
            sys.executable,
            "-m",
            "tokenfleet.cli.main",
            "sim",
            "--synthetic",
            "chat",
            "--synthetic-requests",
            "150",
            "--instances",
            "4",
            "--load",
            "0.9",
            "--quiet",
            "--json",
            str(out),
        ]
        for p in policies:
            cmd += ["--policy", p]
        env = {**__import__("os").environ, "PYTHONHASHSEED": seed}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        procs.append((proc, out))
    outs = []
    for proc, out in procs:
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log.decode(errors="replace")[-2000:]
        outs.append(json.loads(out.read_text())["runs"])
    assert len(outs[0]) == len(policies)
    for a, b in zip(*outs, strict=True):
        assert a["policy"] == b["policy"]
        for key in ("ttft_p50_s", "ttft_p95_s", "throughput_tok_s", "prefix_hit_ratio"):
            assert a[key] == b[key], (a["policy"], key)


class _KVSpy(_Spy):
    kinds: dict[str, int] = {}

    def on_kv_event(self, event: KVEvent) -> None:
        _KVSpy.kinds[event.kind] = _KVSpy.kinds.get(event.kind, 0) + len(event.block_hashes)


def test_kv_events_reach_routers_when_enabled() -> None:
    if "_kvspy" not in ROUTERS:
        ROUTERS.add("_kvspy", _KVSpy)
    try:
        _KVSpy.kinds = {}
        reqs = burst(80, [50] * 80, spacing_s=0.02, prefixes=40)
        run(reqs, "_kvspy", kv_capacity_blocks=1500)
        assert _KVSpy.kinds == {}, "events are off by default"
        recs, pool = run(reqs, "_kvspy", kv_capacity_blocks=1500, kv_events=True)
        stored = sum(len(r.block_hashes) for r in (t.info for t in reqs))
        assert 0 < _KVSpy.kinds["stored"] <= stored
        assert _KVSpy.kinds["removed"] > 0  # small caches must evict
    finally:
        ROUTERS.remove("_kvspy")


def test_path_latency_delays_engine_arrival_and_client_tokens() -> None:
    """With a live path latency the engine sees each request ``dispatch`` after
    it arrives and the client its first token ``relay`` after the engine made
    it; all zero (the default) is the idealised path, unchanged."""
    from tokenfleet.sim.cluster import PathLatency

    reqs = burst(40, [random.Random(i).randint(5, 50) for i in range(40)], spacing_s=0.5)
    ideal, _ = run(reqs, "round_robin")
    fixed = PathLatency(dispatch_min_s=0.010, relay_min_s=0.003)
    late, _ = run(reqs, "round_robin", path_latency=fixed)
    # requests 0.5 s apart never queue: each TTFT grows by exactly the two latencies
    for a, b in zip(ideal, late, strict=False):
        assert a.request_id == b.request_id and a.instance_id == b.instance_id
        assert b.first_token_s - b.arrival_s == pytest.approx(
            a.first_token_s - a.arrival_s + 0.013, abs=1e-9
        )
        assert b.finish_s - b.first_token_s == pytest.approx(a.finish_s - a.first_token_s)
    zero, _ = run(reqs, "round_robin", path_latency=PathLatency())
    assert [(r.first_token_s, r.finish_s) for r in zero] == [
        (r.first_token_s, r.finish_s) for r in ideal
    ]
    # exponential tails: seeded, at least the minimum, different per request
    jitter = PathLatency(
        dispatch_min_s=0.004, dispatch_tail_s=0.006, relay_min_s=0.001, relay_tail_s=0.003
    )
    x, _ = run(reqs, "round_robin", path_latency=jitter)
    y, _ = run(reqs, "round_robin", path_latency=jitter)
    assert [r.first_token_s for r in x] == [r.first_token_s for r in y]
    extra = [
        b.first_token_s - b.arrival_s - (a.first_token_s - a.arrival_s)
        for a, b in zip(ideal, x, strict=False)
    ]
    assert min(extra) >= 0.005 - 1e-9 and len({round(e, 9) for e in extra}) > 30


def test_path_latency_request_cancelled_before_reaching_its_engine() -> None:
    from tokenfleet.sim.cluster import PathLatency

    info = RequestInfo(
        request_id="c0",
        arrival_s=0.0,
        input_tokens=4000,
        max_tokens=64,
        block_hashes=tuple(range(250)),
    )
    tr = TraceRequest(info, 32, client_timeout_s=0.005)
    recs, pool = run([tr], "round_robin", path_latency=PathLatency(dispatch_min_s=0.050))
    assert recs[0].status == "cancelled" and recs[0].first_token_s is None
    assert all(not e.waiting and not e.running for e in pool.engines)


def test_a_conversation_reuses_the_previous_answer_in_the_simulator() -> None:
    """Synthetic chat carries its answers' block hashes; the engine caches them."""
    from dataclasses import replace

    from tokenfleet.workloads.synthetic import generate

    reqs = generate("chat", 300, 5, 3.0)
    assert sum(1 for r in reqs if r.output_block_hashes) == len(reqs)
    without = [replace(r, output_block_hashes=()) for r in reqs]
    cfg = PoolConfig(profile=PROFILE, n_instances=1, router="round_robin")
    with_answers = summarize(run_pool(reqs, cfg, SLOConfig())[0], SLOConfig())
    prompt_only = summarize(run_pool(without, cfg, SLOConfig())[0], SLOConfig())
    # every turn after the first now also hits the previous answer's blocks
    assert with_answers["prefix_hit_ratio"] > prompt_only["prefix_hit_ratio"] + 0.05
    assert with_answers["completed"] == prompt_only["completed"] == len(reqs)


def test_p50_floor_engines_share_every_block_and_the_oracle_starts_prefills_first() -> None:
    """``benchmarks/p50_floor.py``'s what-if pool, through ``run_pool``'s
    ``pool_factory``: a prompt prefilled on one instance is a hit on every
    other (round robin spreads the prompts of a burst, yet every repeat hits),
    and the step oracle never sends a request behind a step it could avoid."""
    from benchmarks.p50_floor import _SharedCachePool

    def factory(oracle: bool):  # type: ignore[no-untyped-def]
        return lambda env, cfg, slo, done: _SharedCachePool(env, cfg, slo, done, oracle)

    prefix = tuple(50_000 + j for j in range(100))
    reqs = [
        TraceRequest(
            RequestInfo(
                request_id=f"r{i}",
                arrival_s=0.5 * i,
                input_tokens=(len(prefix) + 1) * 16 + 7,
                max_tokens=64,
                block_hashes=(*prefix, 90_000 + i),
            ),
            16,
        )
        for i in range(8)
    ]
    cfg = PoolConfig(profile=PROFILE, n_instances=4, router="round_robin")
    plain, _ = run_pool(reqs, cfg, SLOConfig())
    shared, _ = run_pool(reqs, cfg, SLOConfig(), pool_factory=factory(False))
    assert [r.instance_id for r in shared] == [r.instance_id for r in plain]  # the same spread
    full = len(prefix) * 16
    # plain engines: only the 4 requests that come back to an instance hit
    assert sum(r.cached_tokens == full for r in plain) == 4
    assert all(r.cached_tokens == full for r in shared[1:])  # every instance holds it
    assert max(r.ttft_s for r in shared[1:]) < min(r.ttft_s for r in plain[:4])
    # a burst: the oracle spreads it over idle instances before queueing any
    burst_reqs = [replace(t, info=replace(t.info, arrival_s=0.0)) for t in reqs[:4]]
    oracle, _ = run_pool(burst_reqs, cfg, SLOConfig(), pool_factory=factory(True))
    assert len({r.instance_id for r in oracle}) == 4
