"""The live glue piece by piece, against a real (embedded) Redis and a real emulator:
metrics parsing, queue names, request-state transitions, the token relay, the
engine client's abort, the tier gate's choice of queues, error shapes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import requests

from tests.support.stores import embedded_redis, temp_data_dir
from tokenfleet.core.types import DispatchAccounting, KVEvent, RequestInfo, ScrapedMetrics
from tokenfleet.emulator import EmulatorServer
from tokenfleet.engine.profiles import get_profile
from tokenfleet.errors import ConfigError
from tokenfleet.live import engine_client
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.engine_client import (
    EngineCall,
    EngineError,
    _Dechunker,
    first_token_timeout_s,
)
from tokenfleet.live.queues import affinity_queue, pool_queue, tier_of_queue, worker_queues
from tokenfleet.live.relay import RelayReader, RelayWriter
from tokenfleet.live.scrape import Scraper, parse_metrics
from tokenfleet.live.state import InstanceInfo, LiveState
from tokenfleet.tokenizer import approx_num_tokens
from web.errors import ApiError, retry_after_header
from workers.runtime import ACCT_REPAIR_SCRAPES, WorkerRuntime


@pytest.fixture(scope="module")
def state() -> Iterator[LiveState]:
    with temp_data_dir() as d, embedded_redis(d) as r:
        yield LiveState.from_url(r.url, prefix="unit")


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorServer]:
    emu = EmulatorServer("llama3-8b-h200", port=0, time_scale=0.05, seed=3)
    emu.start()
    yield emu
    emu.stop()


def _req(rid: str = "r1", n: int = 100) -> RequestInfo:
    return RequestInfo(rid, 0.0, n, 10)


# -- metrics ---------------------------------------------------------------------------
def test_parse_vllm_metrics_sums_engines_and_averages_kv() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_running x",
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 2.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25',
            'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9',
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0',
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0',
            'vllm:external_prefix_cache_queries_total{engine="0",model_name="m"} 750.0',
            'vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 600.0',
            'vllm:time_to_first_token_seconds_bucket{le="0.1"} 7.0',
        ]
    )
    m = parse_metrics(text, 12.5)
    assert (m.num_running, m.num_waiting) == (5, 4)
    assert m.kv_usage == pytest.approx(0.375)  # the new name wins over the deprecated one
    assert (m.prefix_queries_total, m.prefix_hits_total) == (1000, 250)
    assert m.external_hits_total == 600  # the host tier's loads (the CPU offloading connector)
    assert m.scraped_at_s == 12.5 and m.healthy


def test_scraper_reads_a_real_emulator_and_notices_a_stall(emulator: EmulatorServer) -> None:
    sc = Scraper(emulator.url)
    res = sc.scrape()
    assert res.metrics.healthy and res.error == ""
    emulator.loop.stall_after_s = 0.0
    try:
        bad = sc.scrape()
        assert not bad.metrics.healthy and "503" in bad.error
    finally:
        emulator.loop.stall_after_s = None
    gone = Scraper("http://127.0.0.1:1").scrape()
    assert not gone.metrics.healthy and "scrape failed" in gone.error


def test_one_timed_out_scrape_after_a_good_one_is_not_a_dead_engine() -> None:
    """A scrape can time out because the scraping host is busy: only a second
    one in a row marks the engine unhealthy (a refusal or a 503 does at once)."""
    import http.server
    import threading

    hang = threading.Event()
    release = threading.Event()

    class Engine(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if hang.is_set():
                release.wait(5)
            body = b"vllm:num_requests_running 1\n" if self.path == "/metrics" else b"ok"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Engine)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        sc = Scraper(f"http://127.0.0.1:{srv.server_address[1]}", timeout_s=0.2)
        assert sc.scrape().metrics.healthy
        hang.set()
        once = sc.scrape()
        assert once.metrics.healthy and "timed out" in once.error
        twice = sc.scrape()
        assert not twice.metrics.healthy and "timed out again" in twice.error
        hang.clear()
        release.set()
        assert sc.scrape().metrics.healthy
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


# -- queues and config -------------------------------------------------------------------
def test_queue_names_are_computed_and_ordered_by_tier() -> None:
    assert pool_queue("dc1", "batch") == "dc1.batch"
    assert affinity_queue("dc1", "i7", "interactive") == "dc1.i7.interactive"
    assert tier_of_queue("dc1.i7.long_context") == "long_context"
    assert worker_queues("dc1", "i7") == [
        "dc1.i7.interactive",
        "dc1.interactive",
        "dc1.i7.long_context",
        "dc1.long_context",
        "dc1.i7.batch",
        "dc1.batch",
    ]
    assert worker_queues("dc1", None) == ["dc1.interactive", "dc1.long_context", "dc1.batch"]
    with pytest.raises(ValueError):
        pool_queue("dc.1", "batch")


def test_live_config_from_env_and_seed_keys() -> None:
    cfg = LiveConfig.load(
        env={
            "TOKENFLEET_ROUTER": "round_robin",
            "TOKENFLEET_SCRAPE_INTERVAL_S": "0.2",
            "TOKENFLEET_SEED_API_KEYS": "k1=t1, k2=t2",
        }
    )
    assert cfg.router == "round_robin" and cfg.scrape_interval_s == 0.2
    assert cfg.seed_keys() == {"k1": "t1", "k2": "t2"}
    assert LiveConfig.load(env=cfg.as_env()) == cfg
    with pytest.raises(ConfigError):
        LiveConfig.load(env={"TOKENFLEET_MAX_ATTEMPTS": "zero"})
    with pytest.raises(ConfigError):
        LiveConfig.load(env={}, stale_after_s=0.5, scrape_interval_s=0.5)
    with pytest.raises(ConfigError):
        LiveConfig.load(env={"TOKENFLEET_SEED_API_KEYS": "nokey"}).seed_keys()


def test_error_shape_and_retry_after_bounds() -> None:
    e = ApiError(429, "busy", code="rate_limit_exceeded", retry_after_s=500)
    assert e.body() == {
        "error": {
            "message": "busy",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert e.headers() == {"Retry-After": "120"}
    assert retry_after_header(0.2) == 1 and retry_after_header(None) == 1
    assert retry_after_header(float("inf")) == 1 and retry_after_header(7.1) == 8
    assert ApiError(400, "x").headers() == {}


# -- request state: the idempotency record ----------------------------------------------
def test_claim_runs_an_attempt_once(state: LiveState) -> None:
    state.create_request("c1", "q.interactive", 60)
    assert state.claim("c1", 1, "w1", 5, "i1") == "run"
    assert state.claim("c1", 1, "w2", 5, "i2") == "busy"  # redelivered while running
    assert state.lease_alive("c1")
    assert state.finish("c1", "completed", "w1") == (True, "completed")
    assert state.claim("c1", 1, "w2", 5, "i2") == "done"  # redelivered after the end
    assert state.finish("c1", "failed") == (False, "completed")  # settled once
    assert state.claim("nope", 1, "w", 5, "i") == "missing"


def test_a_winning_claim_hands_the_call_over_in_the_same_step(state: LiveState) -> None:
    """The direct path's ``go`` entry is written by the claim that wins, and
    only by it: a redelivered message's claim must not start a second engine
    call. The claim's bookings (accounting, queue depth) still apply."""
    from tokenfleet.live.relay import RelayReader

    state.create_request("g1", "q.interactive", 60)
    state.queued_incr("q.interactive", 1)
    relay = RelayWriter(state, "g1", 60, "gi1")
    wake = state.k("wake-test")
    fields = relay.go_fields("http://e:1", "g1-1", 1, first_token_timeout_s=2.5)
    go = (relay.key, fields, 60.0, wake)
    before = state.queued().get("q.interactive", 0)
    req = _req("g1", n=300)
    won = state.claim("g1", 1, "w1", 5, "gi1", queue="q.interactive", dispatch=(req, 0), go=go)
    assert won == "run"
    assert state.claim("g1", 1, "w2", 5, "gi2", go=go) == "busy"  # redelivered: no second go
    entries = state.r.xrange(relay.key)
    assert len(entries) == 1 and state.r.ttl(relay.key) > 0
    assert state.r.xlen(wake) == 1  # the worker's outcome reader is woken for its new stream
    ev = next(RelayReader(state, "g1", block_ms=10).events(lambda: None))
    assert ev.kind == "go" and ev.facts is not None
    assert (ev.facts["u"], ev.facts["e"], ev.facts["a"], ev.facts["w"]) == (
        "http://e:1",
        "g1-1",
        "1",
        "2.5",
    )
    assert state.queued().get("q.interactive", 0) == before - 1
    assert state.accounting(["gi1"])["gi1"].prefill_pending_tokens >= 300


def test_a_lapsed_lease_is_taken_back_by_its_owner_only_while_it_runs(state: LiveState) -> None:
    state.create_request("c9", "q.interactive", 60)
    assert state.claim("c9", 1, "w1", 5, "i1") == "run"
    lease = state.k("lease", "c9")
    state.r.delete(lease)  # the worker was starved past its lease
    state.renew_leases(["c9"], 5, owner="w2")  # not its request
    assert not state.lease_alive("c9")
    state.renew_leases(["c9"], 5)  # a plain renewal extends, never creates
    assert not state.lease_alive("c9")
    state.renew_leases(["c9"], 5, owner="w1")
    assert state.lease_alive("c9") and 4000 < state.r.pttl(lease) <= 5000
    state.r.delete(lease)
    assert state.redispatch("c9", 1, 3, "q2.interactive") == 2  # re-sent meanwhile
    state.renew_leases(["c9"], 5, owner="w1")
    assert not state.lease_alive("c9")  # the re-send wins
    assert state.claim("c9", 2, "w2", 5, "i2") == "run"
    assert state.finish("c9", "completed", "w2") == (True, "completed")
    state.renew_leases(["c9"], 5, owner="w2")
    assert not state.lease_alive("c9")  # settled: nothing to hold


def test_a_worker_renews_and_reads_cancel_flags_of_many_requests_in_batches(
    state: LiveState,
) -> None:
    """More requests than one script call or MGET carries: every lease is
    renewed (or taken back by its owner) and every cancel flag is seen."""
    rids = [f"b{i}" for i in range(600)]
    for rid in rids:
        state.create_request(rid, "q.interactive", 60)
        assert state.claim(rid, 1, "w1", 1, "i1") == "run"
    state.r.delete(*(state.k("lease", rid) for rid in rids[::3]))  # starved past these
    state.renew_leases(rids, 5, owner="w1")
    assert all(4000 < state.r.pttl(state.k("lease", rid)) <= 5000 for rid in rids)
    for rid in rids[5::100]:
        state.cancel(rid)
    assert state.cancelled(rids) == set(rids[5::100])


def test_a_streaming_direct_call_survives_a_lease_lapsed_for_less_than_its_grace(
    state: LiveState,
) -> None:
    """After the first token a lapsed lease ends the API's stream only when it
    stays lapsed for two lease periods of checks; before it, the first check
    re-sends."""
    from tokenfleet.live.gateway.direct import LOST, DirectCall, DirectCalls

    live = LiveConfig()
    calls = DirectCalls(state, live)
    for rid in ("s1", "s2"):
        state.create_request(rid, "q.interactive", 60)
        assert state.claim(rid, 1, "w1", 5, "i1") == "run"
        state.r.delete(state.k("lease", rid))
    state.mark_first_token("s1")
    started = DirectCall("s1", 1, EngineCall("http://127.0.0.1:9", {}, "s1"), time.time() + 60)
    fresh = DirectCall("s2", 1, EngineCall("http://127.0.0.1:9", {}, "s2"), time.time() + 60)
    t = 100.0
    calls._check_state([started, fresh], now_m=t)
    assert fresh.call.aborted == LOST and started.call.aborted is None
    calls._check_state([started], now_m=t + 1.9 * live.lease_ttl_s)
    assert started.call.aborted is None  # lapsed, but not for two periods yet
    state.renew_leases(["s1"], 5, owner="w1")  # the starved worker is back
    calls._check_state([started], now_m=t + 2.5 * live.lease_ttl_s)
    assert started.lease_missing_since is None
    state.r.delete(state.k("lease", "s1"))  # now it is gone for good
    t = 200.0
    for dt in (0.0, 1.0, 1.9 * live.lease_ttl_s):
        calls._check_state([started], now_m=t + dt)
        assert started.call.aborted is None
    calls._check_state([started], now_m=t + 2.0 * live.lease_ttl_s)
    assert started.call.aborted == LOST


def test_redispatch_moves_to_a_new_attempt_and_stales_the_old(state: LiveState) -> None:
    state.create_request("c2", "q.interactive", 60)
    assert state.claim("c2", 1, "w1", 0.2, "i1") == "run"
    assert state.redispatch("c2", 1, 3, "q2.interactive") == -4  # still leased
    time.sleep(0.3)  # the worker died: its lease ran out
    assert state.redispatch("c2", 1, 3, "q2.interactive") == 2
    assert state.redispatch("c2", 1, 3, "q3.interactive") == -3  # someone moved it already
    assert state.claim("c2", 1, "w1", 5, "i1") == "stale"  # the old message, redelivered
    assert state.claim("c2", 2, "w2", 5, "i2") == "run"
    state.mark_first_token("c2")
    assert state.redispatch("c2", 2, 3, "q4.interactive", owner="w2") == -2  # streaming
    st = state.request_state("c2")
    assert st["attempt"] == "2" and st["queue"] == "q2.interactive"


def test_lost_after_first_token_is_reported_as_started(state: LiveState) -> None:
    state.create_request("c3", "q.interactive", 60)
    assert state.claim("c3", 1, "w1", 0.1, "i1") == "run"
    state.mark_first_token("c3")
    time.sleep(0.2)
    assert state.claim("c3", 1, "w2", 5, "i2") == "started"


def test_out_of_attempts_and_cancel(state: LiveState) -> None:
    state.create_request("c4", "q.interactive", 60)
    assert state.redispatch("c4", 1, 1, "q2.interactive") == -5
    state.create_request("c5", "q.interactive", 60)
    state.cancel("c5")
    assert state.claim("c5", 1, "w", 5, "i") == "cancelled"
    assert state.cancelled(["c5", "c4"]) == {"c5"}


def test_claim_books_queue_depth_and_dispatch_accounting(state: LiveState) -> None:
    state.create_request("c6", "dcx.interactive", 60)
    state.queued_incr("dcx.interactive", 1)
    req = _req("c6", 320)
    assert state.claim("c6", 1, "w", 5, "ix", queue="dcx.interactive", dispatch=(req, 64)) == "run"
    assert state.queued()["dcx.interactive"] == 0
    acct = state.accounting(["ix"])["ix"]
    want = DispatchAccounting()
    want.on_dispatch(req, 64)
    assert acct == want
    state.account_first_token("ix", req, 64)
    state.account_finish("ix", req, True, 64)
    assert state.accounting(["ix"])["ix"].inflight_requests == 0


def test_a_booking_answers_with_every_writers_accounting_and_can_be_taken_back(
    state: LiveState,
) -> None:
    """The booking check's round trip: another replica booked two requests on
    the instance; our booking's reply shows them (without ours), and taking
    ours back leaves exactly theirs."""
    theirs = [_req("bk1", 400), _req("bk2", 900)]
    for r in theirs:
        state.book_dispatch("ibk", r, 0)
    mine = _req("bk3", 500)
    delta, before = state.book_dispatch("ibk", mine, 128)
    want = DispatchAccounting()
    for r in theirs:
        want.on_dispatch(r, 0)
    assert before == want
    assert delta["dispatched_total"] == 1 and delta["prefill_pending_uncached_tokens"] == 372
    want.on_dispatch(mine, 128)
    assert state.accounting(["ibk"])["ibk"] == want
    state.unbook("ibk", delta)
    assert state.accounting(["ibk"])["ibk"] == before


def test_the_shared_accounting_splits_pending_prefill_by_tier(state: LiveState) -> None:
    """Admission prices a long prefill apart from short ones (SLOMax's lane and
    queued-prefill terms), so the accounting every writer books keeps the
    long-context and batch parts; a first token, or an end without one, takes
    a request's part back."""
    chat = replace(_req("t1", 900), tier="interactive")
    long_ = replace(_req("t2", 20_000), tier="long_context")
    batch = replace(_req("t3", 3_000), tier="batch")
    for r, cached in ((chat, 100), (long_, 4_000), (batch, 0)):
        state.book_dispatch("itier", r, cached)
    pending = state.accounting(["itier"])["itier"].tier_prefill_pending()
    assert pending == {
        "interactive": (1, 800),
        "long_context": (1, 16_000),
        "batch": (1, 3_000),
    }
    state.account_first_token("itier", long_, 4_000)
    state.account_finish("itier", batch, False, 0)  # failed before its first token
    pending = state.accounting(["itier"])["itier"].tier_prefill_pending()
    assert pending == {"interactive": (1, 800), "long_context": (0, 0), "batch": (0, 0)}


def test_api_replicas_count_each_others_heartbeats(state: LiveState) -> None:
    assert state.api_heartbeat("api-a", 100.0, 3.0) == 0
    assert state.api_heartbeat("api-b", 101.0, 3.0) == 1
    assert state.api_heartbeat("api-a", 103.5, 3.0) == 1
    # api-b's last beat is 4.5 s old: gone; after 10 x the window it is removed
    assert state.api_heartbeat("api-a", 105.5, 3.0) == 0
    assert state.api_heartbeat("api-a", 200.0, 3.0) == 0
    assert set(state.r.hkeys(state.k("apis"))) == {b"api-a"}


def test_finish_appends_the_end_entry_only_for_the_winner(state: LiveState) -> None:
    state.create_request("c7", "q.interactive", 60)
    w = RelayWriter(state, "c7", 60, "i1")
    w.delta("hello", 1)
    assert state.finish("c7", "completed", end_event=w.end_fields("stop", {"a": 1}))[0]
    assert not state.finish("c7", "failed", end_event=w.end_fields("stop", None))[0]
    kinds = [ev.kind for ev in RelayReader(state, "c7", block_ms=50).events(lambda: None)]
    assert kinds == ["d", "end"]


# -- relay -------------------------------------------------------------------------------
def test_relay_carries_tokens_in_order_and_ends(state: LiveState) -> None:
    w = RelayWriter(state, "s1", 30, "i9")

    def produce() -> None:
        for i in range(50):
            w.delta(f"t{i} ", 1)
        w.end("length", {"completion_tokens": 50})

    threading.Thread(target=produce).start()
    evs = list(RelayReader(state, "s1", block_ms=100).events(lambda: None))
    deltas = [e for e in evs if e.kind == "d"]
    assert "".join(e.text for e in deltas) == "".join(f"t{i} " for i in range(50))
    assert evs[-1].kind == "end" and evs[-1].usage == {"completion_tokens": 50}
    assert all(e.instance == "i9" for e in deltas)
    assert 0 < state.r.ttl(state.stream_key("s1")) <= 30


def test_relay_reader_reports_idle_and_a_terminal_idle_verdict(state: LiveState) -> None:
    ticks = []

    def on_idle():  # type: ignore[no-untyped-def]
        ticks.append(1)
        if len(ticks) == 3:
            from tokenfleet.live.relay import RelayEvent

            return RelayEvent("err", message="gave up", code=504)
        return None

    evs = list(RelayReader(state, "silent", block_ms=20).events(on_idle))
    assert [e.kind for e in evs] == ["idle", "idle", "err"]


@pytest.mark.parametrize(
    ("entries", "where"),
    [
        (["d", "err"], ("dc-a", "v0")),  # relay path: the attempt that streamed
        (["d", "retry", "err"], (None, None)),  # re-sent: the next attempt's unknown
        (["go", "err"], ("dc-a", "v0")),  # direct path: the attempt handed over
    ],
)
def test_the_apis_error_row_says_where_the_attempt_ran(
    state: LiveState, entries: list[str], where: tuple[str | None, str | None]
) -> None:
    """The API records its own copy of every error it relays; the worker's may
    land later (or never, when it is killed), so the copy names the instance of
    the attempt that was serving, as the worker's row does."""
    from tokenfleet.live.config import LiveConfig
    from tokenfleet.live.gateway.direct import DirectCalls
    from tokenfleet.live.gateway.dispatch import Dispatched
    from tokenfleet.live.gateway.validate import ChatRequest
    from tokenfleet.live.gateway.watch import Watcher
    from tokenfleet.live.jobs import ChatJob
    from tokenfleet.service.embedded import free_port
    from tokenfleet.service.writer import RequestRecord

    class _Watcher(Watcher):
        def __init__(self) -> None:
            self.state = state
            self.live = LiveConfig.load(env={})
            self.metrics = None
            self.direct_calls = DirectCalls(state, self.live)
            self.rows: list[RequestRecord] = []

        def instances(self, max_age_s: float = 60.0) -> list[InstanceInfo]:
            return [InstanceInfo("v0", "dc-a", "m", "", "p", 4096, 1 << 20, 8)]

        def _ledger(self, row: RequestRecord) -> None:
            self.rows.append(row)

        def first_token_feedback(self, d: Dispatched) -> None:
            pass

        def _settle_dc_choice(self, d: Dispatched, status: str) -> None:
            pass

    rid = f"placed-{'-'.join(entries)}"
    info = RequestInfo(rid, time.time(), 10, 4, tier="interactive", model="m")
    req = ChatRequest(info, {"messages": []}, True, include_usage=False, model="m", created=0)
    job = ChatJob(rid, 1, "default", "interactive", "m", req.body, 10, 4, info.arrival_s, "dc-a.q")
    d = Dispatched(req, job, job.queue, "", None, info.arrival_s, affinity=False)
    w = RelayWriter(state, rid, 30, "v0")
    for kind in entries:
        if kind == "d":
            w.delta("hi", 1)
        elif kind == "retry":
            w.retry(2)
        elif kind == "go":  # an engine that refuses the connection: the API reports it
            url = f"http://127.0.0.1:{free_port()}"
            state.r.xadd(state.stream_key(rid), w.go_fields(url, f"{rid}-1", 1))
        else:
            w.error("engine failed", 502)
    watcher = _Watcher()
    try:
        kinds = [ev.kind for ev in watcher.events(d)]
    finally:
        watcher.direct_calls.close()
    assert kinds[-1] == "err"
    (row,) = watcher.rows
    assert (row.status, row.dc, row.instance) == ("failed", *where)


# -- instances and the shared prefix feed ------------------------------------------------
def test_instance_views_show_age_health_and_accounting(state: LiveState) -> None:
    info = InstanceInfo("v1", "dcv", "m", "http://x", "llama3-8b-h200", 4096, 100000, 8)
    state.publish_snapshot(
        "v1", ScrapedMetrics(scraped_at_s=time.time(), num_running=2), {"interactive": 2}, info=info
    )
    now = time.time()
    (v,) = [x for x in state.instance_views(now, 3.0) if x.instance_id == "v1"]
    assert v.ready and v.metrics.healthy and v.metrics.num_running == 2
    assert v.dc == "dcv" and v.max_model_len_tokens == 4096 and v.profile.name
    state.mark_unhealthy("v1", 5.0, "engine answered 500")
    (v,) = [x for x in state.instance_views(time.time(), 3.0) if x.instance_id == "v1"]
    assert v.ready and not v.metrics.healthy
    (v,) = [x for x in state.instance_views(time.time() + 10, 3.0) if x.instance_id == "v1"]
    assert not v.ready, "a snapshot older than stale_after_s means a dead worker"


def test_kv_event_stream_round_trip(state: LiveState) -> None:
    last, _ = state.read_kv_events("0-0", block_ms=None)
    sent = [
        KVEvent("i1", "stored", (1, 2, 3)),
        KVEvent("i1", "cleared", ()),
        KVEvent("i2", "stored", (4, 5), exact=False),
        KVEvent("i2", "removed", (6,), medium="CPU"),  # the host tier's (vLLM offloading)
    ]
    state.publish_kv_events(sent)
    last2, evs = state.read_kv_events(last, block_ms=100)
    assert evs == sent and [e.exact for e in evs] == [True, True, False, True]
    assert [e.medium for e in evs] == ["GPU", "GPU", "GPU", "CPU"]
    assert last2 != last


# -- engine client ---------------------------------------------------------------------
def _body(n: int) -> dict:  # type: ignore[type-arg]
    return {
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": n,
        "stream_options": {"include_usage": True},
        "vllm_xargs": {"output_tokens": n},
    }


def test_accounting_view_adds_own_writes_until_a_read_includes_them(state: LiveState) -> None:
    """The API's cached accounting: Redis as of the last read plus this
    replica's writes since, never counted twice once a read has them."""
    from tokenfleet.live.accounting import AccountingView

    now = [100.0]
    reads: list[list[str]] = []

    def read(ids: list[str]) -> dict[str, DispatchAccounting]:
        reads.append(ids)
        return state.accounting(ids)

    view = AccountingView(read, period_s=0.02, clock=lambda: now[0])
    req = RequestInfo(request_id="v1", arrival_s=0.0, input_tokens=300, max_tokens=50)
    assert view.get(["i1"])["i1"].inflight_requests == 0 and len(reads) == 1  # inline
    with state.batch() as b:  # our own dispatch, as the gateway writes it
        delta = b.account("i1", "on_dispatch", req, 100)
    now[0] += 0.001
    view.wrote("i1", delta)
    got = view.get(["i1"])["i1"]
    assert (got.inflight_requests, got.prefill_pending_uncached_tokens) == (1, 200)
    assert len(reads) == 1, "fresh enough: no read on the request path"
    now[0] += 0.01
    view.refresh(["i1"])  # began after the write returned: it holds the write
    assert view.get(["i1"])["i1"].inflight_requests == 1, "not counted twice"
    state.account_first_token("i1", req, 100)  # a worker's update: seen after a read
    assert view.get(["i1"])["i1"].prefill_pending_requests == 1
    now[0] += 0.05  # the refresh thread fell two periods behind: read inline
    assert view.get(["i1"])["i1"].prefill_pending_requests == 0 and len(reads) == 3
    assert view.get(["i1", "i2"])["i2"].inflight_requests == 0 and len(reads) == 4  # new id
    view.refresh_if_used(["i1", "i2"])  # used just now: the refresh thread reads
    assert len(reads) == 5
    now[0] += 5.0
    view.refresh_if_used(["i1", "i2"])  # idle for 5 s: no polling
    assert len(reads) == 5


def test_engine_call_streams_and_reports_usage(emulator: EmulatorServer) -> None:
    pieces = list(EngineCall(emulator.url, _body(12), "e1").stream())
    assert sum(p.tokens for p in pieces) == 12
    assert pieces[-1].usage is not None and pieces[-1].usage["completion_tokens"] == 12
    assert any(p.finish_reason == "length" for p in pieces)


def test_dechunker_decodes_chunked_framing_split_anywhere() -> None:
    """The direct path reads chunked bytes as they arrive (several chunks, or
    part of one, per read): every split of the same body gives the same payload."""
    payloads = [b'data: {"a": 1}\n\n', b"x" * 300, b"\r\n" * 9, b"data: [DONE]\n\n"]
    for ext in (b"", b";ext=1", b" "):  # the whole-chunk pass, and the state machine
        body = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in payloads)
        body += b"0\r\nX-Trailer: 1\r\n\r\n"
        for step in (1, 2, 7, 64, 330, len(body)):
            dec = _Dechunker()
            out = b"".join(dec.feed(body[i : i + step]) for i in range(0, len(body), step))
            assert out == b"".join(payloads) and dec.done and dec.rest == b""
    with pytest.raises(ValueError):
        _Dechunker().feed(b"zz\r\n")


def test_engine_call_coalesces_tokens_after_the_first(emulator: EmulatorServer) -> None:
    """With ``coalesce_s`` one read carries what several engine steps flushed
    (the first piece does not wait for them), and the connection is reused after."""
    call = EngineCall(emulator.url, _body(40), "e1c")
    pieces = list(call.stream(coalesce_s=0.05))
    assert sum(p.tokens for p in pieces) == 40
    assert pieces[0].tokens < 40
    assert 2 <= len(pieces) < 20
    assert pieces[-1].usage is not None and pieces[-1].usage["completion_tokens"] == 40
    pooled = engine_client._idle.get((call.host, call.port))
    assert pooled and pooled[-1].sock is not None  # kept for the next call
    again = list(EngineCall(emulator.url, _body(3), "e1d").stream())
    assert sum(p.tokens for p in again) == 3


def test_engine_call_abort_stops_the_engine(emulator: EmulatorServer) -> None:
    call = EngineCall(emulator.url, _body(5000), "e2")
    got = []
    with pytest.raises(EngineError) as exc:
        for p in call.stream():
            got.append(p.tokens)
            if sum(got) >= 3:
                call.abort("cancelled by client")
    assert exc.value.kind == "aborted" and exc.value.started
    time.sleep(0.3)
    m = requests.get(emulator.url + "/metrics", timeout=5).text
    assert 'finished_reason="abort"' in m and "vllm:num_requests_running" in m
    running = [ln for ln in m.splitlines() if ln.startswith("vllm:num_requests_running")]
    assert running and float(running[0].split()[-1]) == 0.0


def _running(emulator: EmulatorServer) -> float:
    m = requests.get(emulator.url + "/metrics", timeout=5).text
    return sum(
        float(ln.split()[-1]) for ln in m.splitlines() if ln.startswith("vllm:num_requests_running")
    )


def test_an_engine_call_sent_ahead_runs_before_its_read(emulator: EmulatorServer) -> None:
    """``start`` (express dispatch, before the dispatch's Redis writes) puts the
    request on the engine at once over a pooled connection (without one it
    leaves the send to ``stream``); ``stream`` reads its answer later, and
    ``discard`` aborts one that will never be read."""
    fresh = EngineCall(emulator.url, _body(5000), "ahead-0")
    with engine_client._idle_lock:
        engine_client._idle.pop((fresh.host, fresh.port), None)
    fresh.start()  # no pooled connection: a connect is not made on the caller's time
    time.sleep(0.2)
    assert _running(emulator) == 0
    assert sum(p.tokens for p in EngineCall(emulator.url, _body(2), "warm").stream()) == 2
    call = EngineCall(emulator.url, _body(5000), "ahead-1")
    call.start()  # on the connection the warm call left in the pool
    deadline = time.monotonic() + 5
    while _running(emulator) < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(emulator) == 1  # running, nothing read yet
    got = 0
    for piece in call.stream():
        got += piece.tokens
        if got >= 3:
            break
    assert got >= 3
    call.discard("done reading")
    dropped = EngineCall(emulator.url, _body(5000), "ahead-2")
    dropped.start()
    time.sleep(0.2)
    dropped.discard("dispatch failed")
    deadline = time.monotonic() + 5
    while _running(emulator) > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _running(emulator) == 0  # both aborted on the engine


def test_an_engine_call_sent_ahead_on_a_stale_connection_is_sent_again(
    emulator: EmulatorServer,
) -> None:
    """A pooled keep-alive connection the engine had closed takes the request
    (the write succeeds) and then answers nothing: the read sends it again on
    a new connection, as a call that was not started ahead does."""
    import http.client
    import socket

    call = EngineCall(emulator.url, _body(4), "stale-1")
    ours, theirs = socket.socketpair()
    stale = http.client.HTTPConnection(call.host, call.port)
    stale.sock = ours
    with engine_client._idle_lock:
        engine_client._idle[(call.host, call.port)] = [stale]
    call.start()
    assert theirs.recv(65536).startswith(b"POST /v1/chat/completions")  # it went out there
    theirs.close()  # the engine's side was gone: no answer comes
    pieces = list(call.stream())
    assert sum(p.tokens for p in pieces) == 4
    assert pieces[-1].usage is not None and pieces[-1].usage["completion_tokens"] == 4


def test_engine_call_classifies_failures(emulator: EmulatorServer) -> None:
    with pytest.raises(EngineError) as exc:
        list(EngineCall("http://127.0.0.1:1", _body(2), "e3").stream())
    assert exc.value.kind == "connect" and exc.value.retryable
    bad = dict(_body(2), max_tokens=10**7)
    with pytest.raises(EngineError) as exc:
        list(EngineCall(emulator.url, bad, "e4").stream())
    assert exc.value.status == 400 and not exc.value.retryable
    emulator.config.fail_5xx_rate = 1.0
    try:
        with pytest.raises(EngineError) as exc:
            list(EngineCall(emulator.url, _body(2), "e5").stream())
        assert exc.value.status == 500 and exc.value.retryable
    finally:
        emulator.config.fail_5xx_rate = 0.0
    emulator.loop.stall_after_s = 0.0
    try:
        with pytest.raises(EngineError) as exc:
            list(EngineCall(emulator.url, _body(2), "e6", stall_timeout_s=0.3).stream())
        assert exc.value.kind == "stall" and exc.value.retryable
    finally:
        emulator.loop.stall_after_s = None


# -- the tier gate ------------------------------------------------------------------------
def test_tier_gate_applies_shares_health_and_yielding(state: LiveState) -> None:
    info = InstanceInfo("g1", "dcg", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 4)
    rt = WorkerRuntime(LiveConfig.load(env={}), state, info)
    rt._shares, rt._shares_at = (
        {"interactive": 1.0, "long_context": 1.0, "batch": 0.5},
        time.monotonic() + 1e6,
    )
    all_q = worker_queues("dcg", "g1")
    assert rt.desired_queues() == all_q
    from workers.runtime import RequestInFlight

    for rid in ("t1", "t2"):  # batch at its share (2 of 4 slots), decoding
        rt.add_flight(RequestInFlight(rid, "batch", 1, first_token=True))
    assert rt.desired_queues() == [q for q in all_q if not q.endswith(".batch")]
    rt.remove_flight("t1")
    rt.remove_flight("t2")
    # RabbitMQ-style broker: lower tiers pause while a higher one has work queued
    assert rt.desired_queues({"dcg.interactive": 2}) == ["dcg.g1.interactive", "dcg.interactive"]
    rt.broker_orders_queues = True  # Redis: the poll order already does it
    assert rt.desired_queues({"dcg.interactive": 2}) == all_q
    rt.unhealthy_until = time.time() + 5
    assert rt.desired_queues() == []


def test_a_started_task_holds_its_tier_slot_until_its_flight_does(state: LiveState) -> None:
    """Between the pool thread starting a task and the task's flight (after the
    claim round trip) the slot must stay counted, or the gate opens the tier
    for one message more than its share."""
    from workers.runtime import RequestInFlight

    info = InstanceInfo("h1", "dch", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 4)
    rt = WorkerRuntime(LiveConfig.load(env={}), state, info)
    rt._shares, rt._shares_at = (
        {"interactive": 1.0, "long_context": 1.0, "batch": 0.25},
        time.monotonic() + 1e6,
    )
    batch_qs = [q for q in worker_queues("dch", "h1") if q.endswith(".batch")]
    rt.on_received("r1.1", "dch.batch", 100)
    assert rt.started("r1.1") is not None
    assert rt.running_by_tier(include_reserved=True)["batch"] == 1
    assert not set(batch_qs) & set(rt.desired_queues()), "claim in flight: still full"
    rt.add_flight(RequestInFlight("r1", "batch", 1, prefill_tokens=100), "r1.1")
    assert rt.running_by_tier(include_reserved=True)["batch"] == 1  # moved, not doubled
    rt.task_done("r1.1")
    assert rt.running_by_tier(include_reserved=True)["batch"] == 1  # the flight holds it
    rt.remove_flight("r1")
    assert set(batch_qs) <= set(rt.desired_queues())
    # a delivery that never becomes a flight (a duplicate) frees its slot when it ends
    rt.on_received("r2.1", "dch.batch", None)
    rt.started("r2.1")
    assert rt.running_by_tier(include_reserved=True)["batch"] == 1
    rt.task_done("r2.1")
    assert rt.running_by_tier(include_reserved=True)["batch"] == 0 and rt.gate_kick.is_set()


def test_a_worker_bug_ends_the_request_with_an_error_event(state: LiveState) -> None:
    """A job the worker cannot handle (here: no input_tokens) must not leave
    the client waiting for its request timeout."""
    from tokenfleet.live.relay import RelayReader
    from workers.tasks import run_job_guarded

    info = InstanceInfo("b1", "dcb", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 4)
    rt = WorkerRuntime(LiveConfig.load(env={}), state, info)
    state.create_request("bug1", "dcb.interactive", 60.0)
    job = {"rid": "bug1", "attempt": 1, "tier": "interactive", "queue": "dcb.interactive"}
    assert run_job_guarded(rt, job) == "failed"
    events = list(RelayReader(state, "bug1", block_ms=100).events(lambda: None))
    assert [e.kind for e in events] == ["err"] and events[0].code == 500
    assert "KeyError" in events[0].message
    st = state.request_state("bug1")
    assert st["status"] == "done" and st["final"] == "failed"
    assert state.counters().get("failed_interactive") == 1


def test_pool_queues_pause_while_the_engine_has_prefill_queued(state: LiveState) -> None:
    from workers.runtime import RequestInFlight

    info = InstanceInfo("p1", "dcp", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 8)
    rt = WorkerRuntime(LiveConfig.load(env={}, pool_prefill_budget_tokens=2048), state, info)
    rt._shares, rt._shares_at = {"batch": 1.0}, time.monotonic() + 1e6
    affinity_only = [q for q in worker_queues("dcp", "p1") if q.count(".") == 2]
    rt.add_flight(RequestInFlight("long", "interactive", 1, prefill_tokens=30000))
    assert rt.desired_queues() == affinity_only, "late binding waits for a free engine"
    rt._flights["long"].first_token = True  # prefill done: decoding does not block
    assert rt.desired_queues() == worker_queues("dcp", "p1")
    rt.add_flight(RequestInFlight("short", "interactive", 1, prefill_tokens=300))
    assert rt.desired_queues() == worker_queues("dcp", "p1")
    rt.reserved["m1"] = "interactive"  # a message on its way counts as a full budget
    assert rt.desired_queues() == affinity_only


def test_pool_queues_pause_while_an_api_prefills_on_the_engine(state: LiveState) -> None:
    """A request the API runs itself (express dispatch) is no flight of the
    worker's, but its booking in the shared accounting closes the pool as
    the worker's own long prefill does (a short pool request pulled here
    would wait behind it; the Mooncake slice's SLO misses of 2026-12-05)."""
    from tokenfleet.core.types import RequestInfo

    info = InstanceInfo("x1", "dcx", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 8)
    rt = WorkerRuntime(LiveConfig.load(env={}, pool_prefill_budget_tokens=2048), state, info)
    rt._shares, rt._shares_at = {"batch": 1.0}, time.monotonic() + 1e6
    affinity_only = [q for q in worker_queues("dcx", "x1") if q.count(".") == 2]
    long = RequestInfo(
        request_id="api-run", arrival_s=0.0, tenant="t", input_tokens=30000, max_tokens=16
    )
    with state.batch() as b:  # what the API's express dispatch books
        b.account("x1", "on_dispatch", long, 0)
    assert rt.desired_queues() == worker_queues("dcx", "x1"), "not read yet"
    rt.read_shared_prefill()
    assert rt.desired_queues() == affinity_only
    with state.batch() as b:  # its first token: prefill done, decoding does not block
        b.account("x1", "on_first_token", long, 0)
    rt.read_shared_prefill()
    assert rt.desired_queues() == worker_queues("dcx", "x1")


def test_a_booking_that_moves_the_prefill_wakes_the_instances_gate(state: LiveState) -> None:
    """The tier gate no longer polls the shared accounting every 50 ms: a
    booking that changes the instance's pending prefill publishes on its gate
    channel in the same round trip, and the worker's listener wakes the gate.
    Bookings that leave the prefill alone (a fully cached prompt) publish
    nothing."""
    from tokenfleet.core.types import RequestInfo
    from workers.runtime import GATE_IDLE_S, GATE_POLL_S

    info = InstanceInfo("g1", "dcg", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 8)
    rt = WorkerRuntime(LiveConfig.load(env={}), state, info)
    rt.broker_orders_queues = True
    assert rt._gate_period_s() == GATE_POLL_S  # not subscribed yet: it polls
    listener = threading.Thread(target=rt._gate_listen_loop, daemon=True)
    listener.start()
    spy = state.r.pubsub(ignore_subscribe_messages=True)
    spy.subscribe(state.gate_channel("g1"))
    try:
        deadline = time.monotonic() + 5
        while not rt._gate_listening and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rt._gate_period_s() == GATE_IDLE_S
        rt.broker_orders_queues = False  # RabbitMQ: the gate needs the queue depths
        assert rt._gate_period_s() == GATE_POLL_S
        while spy.get_message(timeout=0.05) is not None:
            pass
        rt.gate_kick.clear()

        cached = RequestInfo(
            request_id="c", arrival_s=0.0, tenant="t", input_tokens=64, max_tokens=4
        )
        with state.batch() as b:
            b.account("g1", "on_dispatch", cached, 64)  # all of it cached: no prefill
        assert spy.get_message(timeout=0.3) is None
        long = RequestInfo(
            request_id="l", arrival_s=0.0, tenant="t", input_tokens=9000, max_tokens=4
        )
        with state.batch() as b:  # an API's express dispatch onto g1
            b.account("g1", "on_dispatch", long, 0)
        assert rt.gate_kick.wait(5.0), "the gate was not woken by the booking"
        assert spy.get_message(timeout=1.0) is not None
        rt.gate_kick.clear()
        state.account_first_token("g1", long, 0)  # its prefill done: the pool may reopen
        assert rt.gate_kick.wait(5.0)
        rt.read_shared_prefill()
        assert rt.shared_prefill_tokens == 0
    finally:
        rt._stop.set()
        listener.join(5)
        spy.close()
    assert not listener.is_alive()


def test_up_engine_option_names_dc_url_and_optional_kv_and_tokenizer() -> None:
    """``tokenfleet up --engine`` serves engines it did not start (real vLLM)."""
    from tokenfleet.cli.commands.up import ExternalEngine, parse_engine
    from tokenfleet.errors import ConfigError

    assert parse_engine("dc-east=http://10.0.0.5:8000/") == ExternalEngine(
        "dc-east", "http://10.0.0.5:8000"
    )
    e = parse_engine("dc-west=http://h:8000,kv=tcp://h:5557,tokenizer=/models/llama")
    assert (e.dc, e.kv, e.tokenizer) == ("dc-west", "tcp://h:5557", "/models/llama")
    for bad, why in [
        ("http://h:8000", "DC=URL"),
        ("dc-east=h:8000", "http://"),
        ("dc-east=http://h:8000,zmq=tcp://h:1", "unknown option"),
    ]:
        with pytest.raises(ConfigError, match=why):
            parse_engine(bad)


def test_worker_relay_coalesces_tokens_within_the_flush_interval(
    state: LiveState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens after the first go out at most every ``relay_flush_interval_s``
    (held text waits for the next piece or the end), all of them, in order."""
    import workers.tasks as tasks

    now = [100.0]
    monkeypatch.setattr(tasks.time, "monotonic", lambda: now[0])

    def entries(rid: str) -> list[tuple[str, int]]:
        return [(f[b"t"].decode(), int(f[b"n"])) for _, f in state.r.xrange(state.stream_key(rid))]

    # 0: one entry per engine flush, as before
    c = tasks._RelayCoalescer(RelayWriter(state, "co0", 30, "i1"), 0.0)
    for i in range(3):
        c.add(f"w{i} ", 1)
    c.flush()
    assert entries("co0") == [("w0 ", 1), ("w1 ", 1), ("w2 ", 1)]

    c = tasks._RelayCoalescer(RelayWriter(state, "co1", 30, "i1"), 0.02)
    c.written()  # the first token's entry, at t=100
    c.add("a", 1)
    c.add("b", 2)  # both within 20 ms of it: held
    assert entries("co1") == []
    now[0] += 0.021
    c.add("c", 1)  # the interval passed: all held text in one entry
    assert entries("co1") == [("abc", 4)]
    now[0] += 0.005
    c.add("d", 1)
    c.flush()  # the stream's end: nothing is left behind
    c.flush()  # nothing held: no empty entry
    assert entries("co1") == [("abc", 4), ("d", 1)]


def test_relay_flush_interval_is_a_live_setting() -> None:
    assert LiveConfig.load(env={}).relay_flush_interval_s == 0.02
    off = LiveConfig.load(env={"TOKENFLEET_RELAY_FLUSH_INTERVAL_S": "0"})
    assert off.relay_flush_interval_s == 0
    with pytest.raises(ConfigError, match="relay_flush_interval_s"):
        LiveConfig.load(env={}, relay_flush_interval_s=-1.0)


def test_the_refresh_hands_beats_knobs_and_their_measured_flag_to_slomax() -> None:
    """Before beat's controller has measured a window with prompt work, the
    API's SLOMax sizes the lane from its own arrivals; the flag beat writes
    beside the knobs ends that, and the knob's share rules from then on."""
    from tokenfleet.live.gateway.core import make_admission
    from tokenfleet.live.gateway.refresh import LiveView

    knobs: dict[str, float] = {"long_share": 0.25, "lane_measured": 0.0}

    class _State:
        def thresholds(self) -> dict[str, float]:
            return dict(knobs)

    view = LiveView()
    view.state = _State()  # type: ignore[assignment]
    view.admission = pol = make_admission("slomax")  # as the API builds it
    assert not pol.adaptive and not pol.lane_measured  # beat adapts its knobs
    view._knobs_at = 0.0  # the one field of _start_view this reads (no threads)
    pol._cold_share = 0.875  # what a run of long prompts would have set
    view._refresh_admission_knobs(max_age_s=0.0)
    assert pol.long_share == 0.25 and not pol.lane_measured
    assert pol._lane_size(4) == 3  # the arrivals' mix, one instance spared
    knobs["lane_measured"] = 1.0
    view._refresh_admission_knobs(max_age_s=0.0)
    assert pol.lane_measured and pol._lane_size(4) == 1


def test_refresh_thread_polls_queue_depths_only_while_requests_read_them() -> None:
    """An API without requests does not read the queue depths 40 times a second
    (nor wake up to find them unused); while dispatches keep reading them
    (``_depths``), the thread keeps them fresh."""
    from tokenfleet.live.gateway.refresh import LiveView

    polled = threading.Event()

    class _State:
        accounting = staticmethod(lambda ids: {})

        def queued(self) -> dict[str, int]:
            polled.set()
            return {"dc-a.interactive": 2}

        def instances(self) -> list[InstanceInfo]:
            return []

        def read_kv_events(self, last: str, block_ms: int = 0) -> tuple[str, list[KVEvent]]:
            time.sleep(block_ms / 1000)
            return last, []

        def thresholds(self) -> dict[str, float]:
            return {}

        def spill_shares(self) -> dict[str, float]:
            return {}

    view = LiveView()
    view.state = _State()  # type: ignore[assignment]
    view.admission = object()
    view.dc_selector = None
    view._start_view()
    try:
        time.sleep(0.3)  # many depth periods (25 ms) with nobody reading them
        assert not polled.is_set()
        assert view._depths == {}
        # dispatches read them, 100 a second: the thread polls again within its
        # idle period (0.25 s), and the dispatches meanwhile saw the old copy
        deadline = time.monotonic() + 5.0
        while not polled.is_set() and time.monotonic() < deadline:
            assert view._depths in ({}, {"dc-a.interactive": 2})
            time.sleep(0.01)
        assert polled.is_set()
        deadline = time.monotonic() + 5.0
        while view._depths_copy != {"dc-a.interactive": 2} and time.monotonic() < deadline:
            time.sleep(0.01)
        assert view._depths == {"dc-a.interactive": 2}
    finally:
        view.close()


def test_a_long_prefill_is_not_a_stall() -> None:
    """vLLM streams nothing while it prefills. A prompt whose prefill outlasts
    the stall timeout must wait for its first token (the first-token timeout
    scales with the prompt), and the stall timeout holds again after it."""
    prof = get_profile("llama3-8b-h200")
    text = " ".join(f"line {i} of a long log file" for i in range(2700))
    n = approx_num_tokens(text)
    with EmulatorServer("llama3-8b-h200", port=0, time_scale=1.0, seed=3) as emu:
        body = {
            "model": prof.model.name,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 4,
            "stream": True,
        }
        assert prof.prefill_time_s(n) > 0.35  # longer than the stall timeout below
        with pytest.raises(EngineError) as flat:
            list(EngineCall(emu.url, body, "s1", stall_timeout_s=0.2).stream())
        assert flat.value.kind == "stall" and not flat.value.started
        assert first_token_timeout_s(0.2, prof, n) > 0.2 + 2.9 * prof.prefill_time_s(n)
        wait_s = first_token_timeout_s(5.0, prof, n)  # room for a busy machine
        call = EngineCall(emu.url, body, "s2", stall_timeout_s=0.2, first_token_timeout_s=wait_s)
        assert sum(p.tokens for p in call.stream()) == 4
        assert call._timeout_s == 0.2  # back to the stall timeout after the first token


def test_a_lost_workers_accounting_is_cleared_once_the_instance_is_idle(state: LiveState) -> None:
    """Bookings of a request whose worker was killed are never released; the
    instance's next worker clears them once its engine, its slots and its
    queues have been idle over several scrapes. A booking whose message still
    waits in the instance's queue is kept, and a booking landing between the
    read and the clear wins."""
    info = InstanceInfo("r1", "dcr", "m", "http://127.0.0.1:9", "llama3-8b-h200", 8192, 1, 4)
    rt = WorkerRuntime(LiveConfig.load(env={}), state, info)
    idle = ScrapedMetrics(num_running=0, num_waiting=0)
    lost = _req("lost", 5000)
    with state.batch() as b:  # what a killed worker left behind
        b.account("r1", "on_dispatch", lost, 0)
    mine = affinity_queue("dcr", "r1", "interactive")
    with state.batch() as b:  # ... and a request still queued for this instance
        b.account("r1", "on_dispatch", _req("queued", 300), 0)
        b.queued(mine, 1)
    for _ in range(2 * ACCT_REPAIR_SCRAPES):
        rt._repair_accounting(idle)
    assert state.accounting(["r1"])["r1"].inflight_requests == 2  # a message waits: kept
    state.queued_incr(mine, -1)  # the queued one was claimed, ran and was released
    state.account_finish("r1", _req("queued", 300), False, 0)
    busy = ScrapedMetrics(num_running=1, num_waiting=0)
    for _ in range(2 * ACCT_REPAIR_SCRAPES):
        rt._repair_accounting(busy)  # the engine runs something: nothing is phantom yet
    assert state.accounting(["r1"])["r1"].inflight_requests == 1
    for _ in range(ACCT_REPAIR_SCRAPES - 1):
        rt._repair_accounting(idle)
    seen = state.acct_raw("r1")
    with state.batch() as b:  # a dispatch lands between the read and the clear
        b.account("r1", "on_dispatch", _req("new", 100), 0)
    assert not state.clear_acct_if("r1", seen)
    state.account_finish("r1", _req("new", 100), False, 0)
    for _ in range(ACCT_REPAIR_SCRAPES):
        rt._repair_accounting(idle)
    acct = state.accounting(["r1"])["r1"]
    assert acct.inflight_requests == 0 and acct.prefill_pending_uncached_tokens == 0
    # the count of dispatches stays: routers tell shared accounting by it
    assert acct.dispatched_total == 3


def test_replay_over_several_front_doors_sends_the_requests_in_turn() -> None:
    """``tokenfleet.live.bench.replay`` with two URLs, as a load balancer over
    two API replicas: each gets every other request (here two engines stand
    in for the replicas; their success counters say who served what)."""
    from tokenfleet.live.bench import replay
    from tokenfleet.workloads.trace import TraceRequest

    emus = [EmulatorServer("llama3-8b-h200", port=0, time_scale=0.01, seed=k) for k in (1, 2)]
    for e in emus:
        e.start()
    try:
        reqs = [TraceRequest(RequestInfo(f"rp{i}", 0.01 * i, 64, 4), 2) for i in range(6)]
        outs, _ = replay([e.url for e in emus], "none", reqs, model=emus[0].model_name)
        assert [o.status for o in outs] == ["completed"] * 6, [o.error for o in outs]
        for e in emus:
            text = requests.get(e.url + "/metrics", timeout=10).text
            served = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("vllm:request_success_total{")
            )
            assert served == 3, text
    finally:
        for e in emus:
            e.stop()


def test_a_requests_prefetch_reads_accounting_and_depths_before_its_dispatch(
    state: LiveState, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At low load the refresh thread stops polling, so a request's dispatch
    would read the dispatch accounting and the queue depths inline, two round
    trips on its time to first token. ``prefetch`` at arrival writes both
    reads to Redis; the dispatch reads their replies, no round trip of its own."""
    from tokenfleet.live.gateway import refresh

    # copies stay fresh for seconds: a slow machine cannot age them mid-test
    monkeypatch.setattr(refresh, "QUEUE_DEPTHS_MAX_AGE_S", 5.0)

    class View(refresh.LiveView):
        def __init__(self) -> None:
            self.state = state
            self.live = LiveConfig.load(env={})
            self.admission = None
            self.dc_selector = None
            # its KV-event thread hands the module's earlier events to a router
            self.router = SimpleNamespace(on_kv_event=lambda ev: None)
            self.router_lock = threading.Lock()
            self.tier_shares = {}
            self._start_view()

    info = InstanceInfo("pf1", "dcp", "m", "http://127.0.0.1:1", "llama3-8b-h200", 4096, 1, 8)
    state.register_instance(info)
    state.book_dispatch("pf1", _req("pf-r", n=900), 0)
    state.queued_incr("dcp.interactive", 3)
    view = View()
    view.accounting.period_s = 5.0
    try:
        inline: list[list[str]] = []  # reads on this (the request's) thread
        read = view.accounting._read

        def spy(ids: list[str]) -> dict[str, DispatchAccounting]:
            if threading.current_thread() is threading.main_thread():
                inline.append(ids)
            return read(ids)

        view.accounting._read = spy  # type: ignore[method-assign]

        view.prefetch()  # nothing read yet: both reads are written to Redis now
        assert view._pending is not None and view.accounting._read_at == float("-inf")
        view.await_prefetch()  # their replies read, no other round trip
        got = view.accounting.get(["pf1"])["pf1"]
        assert inline == [], "the dispatch read the accounting itself"
        assert got.dispatched_total >= 1 and got.prefill_pending_tokens >= 900
        assert view._depths.get("dcp.interactive") == 3
        view.prefetch()  # both copies fresh: nothing to read
        assert view._pending is None

        # a request refused while parsing never dispatches: the refresh
        # thread reads its prefetch, and the connection goes back to the pool
        view.accounting._read_at, view._depths_at = float("-inf"), -1.0
        monkeypatch.setattr(refresh, "ABANDONED_PREFETCH_S", 0.0)
        view.prefetch()
        abandoned = view._pending
        assert abandoned is not None and abandoned._conn is not None
        view._kick.set()
        deadline = time.monotonic() + 5.0

        def landed() -> bool:
            return abandoned._conn is None and view.accounting._read_at > float("-inf")

        while not landed() and time.monotonic() < deadline:
            time.sleep(0.005)
        assert view._pending is None
        assert landed(), "the refresh thread did not read it (its connection stays out)"
    finally:
        view.close()
        state.deregister_instance("pf1")
        state.queued_incr("dcp.interactive", -3)


def test_a_datacenter_dropped_from_the_views_is_not_chosen_from_a_stale_fleet_view() -> None:
    """FleetMind's per-DC view is re-aggregated at most every 0.1 s. A DC whose
    broker was just marked down leaves the request's views, and a choice from
    the copy made before would pick it and leave the router no instance (a
    503 "check the deployment"; the flaky multi-DC broker test). The copy is
    refreshed whenever the set of DCs in the views changes."""
    from tokenfleet.live.gateway.dispatch import Dispatcher

    class Selector:
        """Prefers dc-b (the tenant's home) when its view has it."""

        def __init__(self) -> None:
            self.views: dict[str, Any] = {}
            self.snap = SimpleNamespace(now_s=0.0)

        def refresh(self, views: list[Any], now: float) -> None:
            self.views = {v.dc: v for v in views}

        def select(self, info: Any, tenant: Any) -> tuple[Any, str]:
            dc = "dc-b" if "dc-b" in self.views else "dc-a"
            return SimpleNamespace(dc=dc, reason="home" if dc == "dc-b" else "spill"), "dc-b"

        def compliant_dcs(self, info: Any, tenant: Any) -> set[str]:
            return set(self.views)

    a0, b0 = (
        SimpleNamespace(dc="dc-a", instance_id="a0"),
        SimpleNamespace(dc="dc-b", instance_id="b0"),
    )
    gw = SimpleNamespace(
        dc_selector=Selector(),
        _refresh_fleet_plan=lambda: None,
        _tenant=lambda t: None,
        router_lock=threading.Lock(),
        _dc_views_at=-1.0,
        _dc_views_dcs=frozenset(),
        metrics=None,
    )
    req = SimpleNamespace(info=_req("dc-stale"))
    chosen, _, _ = Dispatcher._pick_dc(gw, req, [a0, b0], 100.0)  # type: ignore[arg-type]
    assert chosen == [b0]
    # dc-b's broker is marked down 10 ms later: its instances leave the views
    chosen, (decision, _home), _ = Dispatcher._pick_dc(gw, req, [a0], 100.01)  # type: ignore[arg-type, misc]
    assert chosen == [a0] and decision.dc == "dc-a"
    chosen, _, _ = Dispatcher._pick_dc(gw, req, [a0, b0], 100.02)  # type: ignore[arg-type]
    assert chosen == [b0], "back up: home again at once"


def test_thread_cpu_counts_a_role_and_keeps_what_exited_threads_used() -> None:
    """``tokenfleet_api_thread_cpu_seconds_total``: a thread's CPU under its role
    (the name without its number), still counted after the thread exits."""

    from web.metrics import ThreadCpuCollector

    def cpu_of(collector: ThreadCpuCollector, role: str) -> float:
        (fam,) = list(collector.collect())
        return next((s.value for s in fam.samples if s.labels["thread"] == role), 0.0)

    collector = ThreadCpuCollector()
    go, done = threading.Event(), threading.Event()

    def burn() -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.15:
            pass
        go.set()
        done.wait(10)

    workers = [threading.Thread(target=burn, name=f"burner-{i}") for i in range(2)]
    workers[0].start()
    assert go.wait(10)
    go.clear()
    workers[1].start()
    assert go.wait(10)
    running = cpu_of(collector, "burner")
    assert running >= 0.25  # both threads' 0.15 s, under one role
    done.set()
    for w in workers:
        w.join(10)
    assert cpu_of(collector, "burner") >= running  # gone, still counted


def test_the_holding_pen_releases_in_the_policys_order_one_booked_dispatch_at_a_time() -> None:
    """The pen asks the policy over its own FIFOs and hands each request the
    action it got; a released request books its instance before the policy
    is asked again (two are never sent into one freed slot), and one whose
    client left, or whose time ran out, leaves the queue."""
    from tokenfleet.core.admission import DISPATCH, Action, TierQueue
    from tokenfleet.live.gateway.holding import HoldingPen

    free_slots = [0]
    asked: list[int] = []

    def release(queues: Any, now: float) -> Action | None:
        q: TierQueue | None = queues.get("interactive")
        head = q.head() if q is not None else None
        asked.append(free_slots[0])
        if head is None or free_slots[0] <= 0:
            return None
        free_slots[0] -= 1  # what the booking of the released request takes
        return Action(DISPATCH, "interactive", head.request.request_id, instance_ids=("i0",))

    pen = HoldingPen(release, tick_s=0.005, book_wait_s=30.0)
    infos = [RequestInfo(f"r{i}", 0.0, 10, 4, tier="interactive") for i in range(3)]
    holds = [pen.hold(i, 0.0) for i in infos]
    time.sleep(0.05)
    assert len(pen) == 3 and not any(h.decided.is_set() for h in holds)  # no room: all held
    free_slots[0] = 2
    first = pen.wait(holds[0], time.monotonic() + 2, None)
    assert first is not None and first.instance_ids == ("i0",)
    time.sleep(0.05)
    assert not holds[1].decided.is_set()  # the pen waits for r0's booking first
    holds[0].booked.set()
    assert pen.wait(holds[1], time.monotonic() + 2, None) is not None
    holds[1].booked.set()
    # r2: no slot left; its client leaves
    assert pen.wait(holds[2], time.monotonic() + 2, lambda: True) is None
    assert len(pen) == 0 and len(pen.queues["interactive"]) == 0
    late = pen.hold(RequestInfo("r3", 0.0, 10, 4, tier="interactive"), 0.0)
    assert pen.wait(late, time.monotonic() + 0.05, None) is None  # its time ran out
    assert len(pen) == 0
    pen.close()
