"""SLOMax: classification, admission decisions, no preemption, controller
convergence, goodput accounting, workload mixing and the mixed-traffic scenario."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.cli.main import main
from tokenfleet.core.admission import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    QUEUE,
    REJECT,
    AdmissionSnapshot,
    InstanceLoad,
    QueuedRequest,
    TierQueue,
    TierWindow,
    WindowStats,
    kv_reservation_tokens,
)
from tokenfleet.core.admission.controller import ControllerConfig, SLOMaxController
from tokenfleet.core.admission.llmd_flow_control import LlmdFlowControlAdmission
from tokenfleet.core.admission.slomax import SLOMaxAdmission
from tokenfleet.core.admission.strict_priority import StrictPriorityAdmission
from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import TIERS, InstanceView, RequestInfo, ScrapedMetrics
from tokenfleet.engine.profiles import get_profile
from tokenfleet.errors import ConfigError, ValidationError
from tokenfleet.sim.admission import run_pool_with_admission
from tokenfleet.sim.cluster import PoolConfig, run_pool
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.mix import (
    build_at_load,
    build_mix,
    load_mix,
    missing_traces,
    offered_load,
    parse_mix,
)
from tokenfleet.workloads.trace import TraceRequest

PROFILE = get_profile("llama3-8b-h200")
SLO = SLOConfig()
REPO = Path(__file__).resolve().parents[1]
TRACES = REPO.parent / "shared" / "traces"


def req(
    rid: str,
    input_tokens: int = 1000,
    max_tokens: int = 512,
    tier: str = "",
    arrival_s: float = 0.0,
    **kw: Any,
) -> RequestInfo:
    return RequestInfo(
        request_id=rid,
        arrival_s=arrival_s,
        input_tokens=input_tokens,
        max_tokens=max_tokens,
        tier=tier,
        **kw,
    )


def instances(n: int, now_s: float = 0.0) -> list[InstanceLoad]:
    out = []
    for i in range(n):
        view = InstanceView(
            instance_id=f"i{i}",
            profile=PROFILE,
            kv_capacity_tokens=PROFILE.kv_capacity_tokens,
            max_model_len_tokens=PROFILE.model.max_model_len_tokens,
            metrics=ScrapedMetrics(scraped_at_s=now_s),
            index=i,
        )
        out.append(InstanceLoad(view=view))
    return out


def queues() -> dict[str, TierQueue]:
    return {t: TierQueue(t) for t in TIERS}


def book(inst: InstanceLoad, r: RequestInfo, prefilling: bool = True) -> None:
    """What the driver's accounting does on dispatch (and first token)."""
    tl = inst.tier(r.tier)
    tl.inflight += 1
    tl.reserved_kv_tokens += kv_reservation_tokens(r)
    if prefilling:
        tl.prefill_pending += 1
        tl.prefill_pending_tokens += r.input_tokens


# -- 1. classification ------------------------------------------------------------------
@pytest.mark.parametrize(
    "info,tier",
    [
        (req("a", 500), "interactive"),
        (req("b", 9000), "long_context"),  # >= 8192 input tokens
        (req("c", 500, task_type="batch"), "batch"),  # the batch endpoint
        (req("d", 30000, task_type="batch"), "batch"),  # batch wins over length
        (req("e", 500, slo_class="batch"), "batch"),  # tenant's declared class
        (req("f", 500, max_tokens=32768), "long_context"),  # huge output budget holds KV
        (req("g", 500, slo_class="long_context"), "long_context"),
        (req("h", 20000, slo_class="interactive"), "long_context"),  # no chat limit fits
        (req("i", 20000, tier="interactive"), "interactive"),  # explicit tier wins
    ],
)
def test_classification_rules(info: RequestInfo, tier: str) -> None:
    assert classify(info, SLO) == tier


def test_classification_threshold_is_configurable() -> None:
    slo = SLOConfig.from_mapping({"long_context_min_input_tokens": 2000})
    assert classify(req("a", 2500), slo) == "long_context"
    assert classify(req("a", 2500), SLO) == "interactive"


# -- 2. admission decisions on hand-built snapshots ---------------------------------------
def test_interactive_prefers_off_the_lane_unless_it_holds_part_of_the_prompt() -> None:
    """While long work is about, an interactive prompt goes off the lane or to
    a lane instance holding part of it (a lane instance holding nothing would
    only evict the long prompts' prefixes); a lane instance holding nothing
    is taken when nothing else is well inside the limit, one prefilling a
    long prompt is out by its predicted TTFT. With no long work about, every
    instance is as good (an idle lane held back saturates the rest)."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)  # lane: the last 2 of 4 instances
    insts = instances(4)
    qs = queues()
    snap = AdmissionSnapshot(0.0, insts, qs)
    d = pol.on_arrival(req("x", 800, tier="interactive"), snap)
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1", "i2", "i3"}
    book(insts[3], req("L", 40000, tier="long_context"))
    d = pol.on_arrival(req("y", 800, tier="interactive"), snap)
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1"}
    held = AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i2": 256, "i3": 256})
    d = pol.on_arrival(req("y2", 800, tier="interactive"), held)
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1", "i2"}
    # the others backed up past the TTFT limit: the lane instance not prefilling
    for inst in insts[:2]:
        book(inst, req(f"big{inst.instance_id}", 60000, tier="interactive"))
    d = pol.on_arrival(req("z", 800, tier="interactive"), snap)
    assert d.action == ADMIT and d.instance_ids == ("i2",)


def test_a_long_context_prompt_with_a_short_prefill_needs_no_lane_slot() -> None:
    """The lane is for prefills of seconds. A long-context prompt whose prefill
    fits the interactive tier's clean TTFT budget (half its 1 s limit: about
    14k tokens on an H200 8B) may go to any instance where the prefill queued
    ahead plus its own stays within that budget, lane slots busy or not."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)  # lane: the last 2 of 4 instances
    insts = instances(4)
    qs = queues()
    for k in (2, 3):  # both lane slots busy
        book(insts[k], req(f"L{k}", 40000, tier="long_context"))
    snap = AdmissionSnapshot(0.0, insts, qs)
    budget_s = 0.5 * (SLO.slo_for("interactive").ttft_s or 0.0)
    assert PROFILE.prefill_time_s(10000) < budget_s < PROFILE.prefill_time_s(16000)
    d = pol.on_arrival(req("mid", 10000, tier="long_context"), snap)
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1"}
    assert pol.on_arrival(req("long", 16000, tier="long_context"), snap).action == QUEUE
    # an instance with prefill queued ahead is out once the sum is over budget
    book(insts[0], req("chat", 6000, tier="interactive"))
    d = pol.on_arrival(req("mid2", 10000, tier="long_context"), snap)
    assert d.action == ADMIT and d.instance_ids == ("i1",)
    # and a queued head is dispatched the same way
    qs["long_context"].append(QueuedRequest(req("q", 10000, tier="long_context"), 0.0))
    a = pol.next_action(snap)
    assert a is not None and a.kind == DISPATCH and a.request_id == "q"
    assert a.instance_ids == ("i1",)


def test_long_context_capped_per_instance_then_queued_then_rejected_early() -> None:
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)  # long_share 0.5 of 2 -> 1 instance
    insts = instances(2)
    qs = queues()
    snap = AdmissionSnapshot(0.0, insts, qs)
    first = req("L1", 30000, tier="long_context")
    d1 = pol.on_arrival(first, snap)
    # the long-context lane is the last instance; the other stays free for chat
    assert d1.action == ADMIT and d1.instance_ids == ("i1",)
    book(insts[1], first)
    # One long prefill is allowed at a time on half the instances: the next waits.
    second = req("L2", 30000, tier="long_context")
    d2 = pol.on_arrival(second, snap)
    assert d2.action == QUEUE and d2.predicted_wait_s is not None and d2.predicted_wait_s > 0
    qs["long_context"].append(QueuedRequest(second, 0.0))
    # Enough queued work makes the next one hopeless: rejected at arrival, before
    # any prefill is spent, with Retry-After = predicted TTFT beyond the limit.
    for k in range(12):
        qs["long_context"].append(QueuedRequest(req(f"Q{k}", 30000, tier="long_context"), 0.0))
    late = req("L3", 30000, tier="long_context")
    d3 = pol.on_arrival(late, snap)
    assert d3.action == REJECT
    assert d3.retry_after_s is not None and d3.predicted_wait_s is not None
    limit = SLO.slo_for("long_context").ttft_limit_s(30000)
    assert limit is not None
    assert d3.retry_after_s == pytest.approx(
        d3.predicted_wait_s + pol._own_s(late, PROFILE) - limit, rel=1e-6
    )
    assert d3.retry_after_s > 0


def test_the_lane_cap_counts_prefill_left_not_requests() -> None:
    """A lane instance is busy with a long prefill by the uncached prompt it
    still has to prefill, not by how many long requests it holds: a 20k-token
    turn with all but 2k cached leaves room for the next long prompt, 30k
    uncached does not (the driver books each request's uncached estimate)."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)  # long_share 0.5 of 2 -> the last
    insts = instances(2)
    snap = AdmissionSnapshot(0.0, insts, queues())
    tl = insts[1].tier("long_context")
    tl.inflight, tl.prefill_pending, tl.prefill_pending_tokens = 1, 1, 2000
    d = pol.on_arrival(req("L1", 30000, tier="long_context"), snap)
    assert d.action == ADMIT and d.instance_ids == ("i1",)
    tl.prefill_pending_tokens = 30000
    assert pol.on_arrival(req("L2", 30000, tier="long_context"), snap).action == QUEUE


def test_a_returning_conversation_goes_where_its_kv_is_lane_or_not() -> None:
    """The lane split knows nothing of caches. A long-context prompt that an
    instance holds all but a short tail of needs no lane slot there (and must
    not queue for one); an interactive prompt mostly held on a lane instance
    may go there. Only with the holder known from KV events (the snapshot's
    ``cached_tokens``); without it, the lane rules as before."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)  # lane: the last 2 of 4 instances
    insts = instances(4)
    qs = queues()
    for k in (2, 3):  # both lane slots busy: a long prompt queues for one
        book(insts[k], req(f"L{k}", 40000, tier="long_context"))
    turn = req("turn", 21000, tier="long_context")
    assert pol.on_arrival(turn, AdmissionSnapshot(0.0, insts, qs)).action == QUEUE
    held = AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i0": 20448, "i3": 4000})
    d = pol.on_arrival(turn, held)
    assert d.action == ADMIT and d.instance_ids == ("i0",)  # i3 would prefill 17k
    # holding part of it: a short prefill left there (8k tokens, 0.25 s) needs
    # no lane slot either, a long one (16k, 0.55 s) does
    part = AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i0": 21000 - 8192})
    d = pol.on_arrival(turn, part)
    assert d.action == ADMIT and d.instance_ids == ("i0",)
    less = AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i0": 21000 - 16000})
    assert pol.on_arrival(turn, less).action == QUEUE
    # interactive: a lane instance holding part of the prompt is as good as
    # off the lane; one prefilling a long prompt stays out whatever it holds
    insts = instances(4)
    book(insts[2], req("L2", 40000, tier="long_context"), prefilling=False)  # decoding
    book(insts[3], req("L3", 40000, tier="long_context"))  # prefilling
    chat = req("chat", 4000, tier="interactive")
    d = pol.on_arrival(chat, AdmissionSnapshot(0.0, insts, qs))
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1"}
    d = pol.on_arrival(chat, AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i2": 1000}))
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1", "i2"}
    d = pol.on_arrival(chat, AdmissionSnapshot(0.0, insts, qs, cached_tokens={"i3": 3900}))
    assert d.action == ADMIT and set(d.instance_ids or ()) == {"i0", "i1"}


def test_retry_after_is_honest_about_the_predicted_wait() -> None:
    """More queued work ahead => proportionally longer Retry-After."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)
    waits = []
    for n in (10, 20, 40):
        insts = instances(2)
        book(insts[1], req("busy", 30000, tier="long_context"))
        qs = queues()
        for k in range(n):
            qs["long_context"].append(QueuedRequest(req(f"q{k}", 20000, tier="long_context"), 0))
        d = pol.on_arrival(req("new", 20000, tier="long_context"), AdmissionSnapshot(0, insts, qs))
        assert d.action == REJECT and d.retry_after_s is not None
        waits.append(d.predicted_wait_s or 0.0)
    assert waits[0] < waits[1] < waits[2]
    assert waits[2] / waits[1] == pytest.approx(2.0, rel=0.15)


def test_batch_queues_and_yields_to_interactive() -> None:
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)
    insts = instances(2)
    qs = queues()
    b = req("b1", 1000, tier="batch", deadline_s=600.0)
    assert pol.on_arrival(b, AdmissionSnapshot(0, insts, qs)).action == QUEUE
    qs["batch"].append(QueuedRequest(b, 0.0))
    # Interactive requests waiting for their first token on both instances:
    # batch is not dispatched (it yields by not dispatching, nothing is preempted).
    for i, inst in enumerate(insts):
        book(inst, req(f"x{i}", 800, tier="interactive"))
    assert pol.next_action(AdmissionSnapshot(1.0, insts, qs)) is None
    # One instance's interactive work got its first token: batch may go there only.
    tl = insts[1].tier("interactive")
    tl.prefill_pending, tl.prefill_pending_tokens = 0, 0
    act = pol.next_action(AdmissionSnapshot(1.0, insts, qs))
    assert act is not None and act.kind == DISPATCH and act.instance_ids == ("i1",)


def test_batch_share_caps_batch_seats_per_instance() -> None:
    pol = SLOMaxAdmission(slo=SLO, adaptive=False, batch_max_seats=10)
    pol.batch_share = 0.3  # ceil(0.3 * 10) = 3 batch requests per instance
    insts = instances(1)
    qs = queues()
    for k in range(3):
        book(insts[0], req(f"run{k}", 1000, tier="batch"), prefilling=False)
    qs["batch"].append(QueuedRequest(req("b", 1000, tier="batch", deadline_s=900.0), 0))
    assert pol.next_action(AdmissionSnapshot(0, insts, qs)) is None
    pol.batch_share = 0.4  # 4 seats
    act = pol.next_action(AdmissionSnapshot(0, insts, qs))
    assert act is not None and act.kind == DISPATCH


def test_kv_headroom_for_prompt_plus_max_tokens() -> None:
    """No dispatch unless prompt + max_tokens fits the unreserved KV."""
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)
    insts = instances(1)
    cap = insts[0].view.kv_capacity_tokens
    # Reserve all but 5,000 tokens of the interactive KV budget.
    insts[0].tier("interactive").reserved_kv_tokens = int(cap * 0.95) - 5000
    qs = queues()
    fits = req("a", 3000, max_tokens=1024, tier="interactive")
    too_big = req("b", 3000, max_tokens=4096, tier="interactive")
    assert pol.on_arrival(fits, AdmissionSnapshot(0, insts, qs)).action == ADMIT
    assert pol.on_arrival(too_big, AdmissionSnapshot(0, insts, qs)).action == QUEUE


def test_batch_past_its_deadline_is_dropped_as_timed_out() -> None:
    pol = SLOMaxAdmission(slo=SLO, adaptive=False)
    qs = queues()
    qs["batch"].append(QueuedRequest(req("b", 1000, tier="batch", deadline_s=10.0), 0))
    act = pol.next_action(AdmissionSnapshot(11.0, instances(1), qs))
    assert act is not None and act.status == "timed_out"


def test_llmd_saturation_is_mean_of_max_queue_over_5_kv_over_08() -> None:
    pol = LlmdFlowControlAdmission(slo=SLO)
    insts = instances(2, now_s=10.0)
    insts[0].view.metrics.num_waiting, insts[0].view.metrics.kv_usage = 10, 0.4  # 2.0
    insts[1].view.metrics.num_waiting, insts[1].view.metrics.kv_usage = 1, 0.4  # 0.5
    snap = AdmissionSnapshot(10.05, insts, queues())
    assert pol.saturation(snap) == pytest.approx((2.0 + 0.5) / 2)
    # saturated: only the lowest (sheddable) band is shed, others wait
    assert pol.on_arrival(req("b", tier="batch"), snap).action == REJECT
    assert pol.on_arrival(req("x", tier="interactive"), snap).action == QUEUE
    # stale metrics count as saturated (1.0 per endpoint)
    stale = AdmissionSnapshot(11.0, instances(2, now_s=10.0), queues())
    assert pol.saturation(stale) == pytest.approx(1.0)
    # unsaturated: admitted to any endpoint. Upstream registers the detector as
    # a flow-control detector, not as a filter of the default scheduling
    # profile, so an endpoint over the thresholds stays a candidate.
    insts[0].view.metrics.num_waiting = 6  # endpoint score 1.2; mean 0.85 < 1
    d = pol.on_arrival(req("y", tier="interactive"), snap)
    assert d.action == ADMIT and d.instance_ids is None
    qs = queues()
    qs["interactive"].append(QueuedRequest(req("z", tier="interactive"), 10.0))
    act = pol.next_action(AdmissionSnapshot(10.05, insts, qs))
    assert act is not None and act.request_id == "z" and act.instance_ids is None


def test_llmd_legacy_admission_sheds_only_sheddable_requests_while_saturated() -> None:
    """llm-d's default (LegacyAdmissionController): non-sheddable requests bypass
    the saturation check, sheddable ones (batch, priority < 0) are rejected at
    Saturation >= 1.0; nothing is ever queued at the gateway."""
    pol = ADMISSION.create("llmd", slo=SLO)
    assert not pol.uses_queues()
    insts = instances(2, now_s=10.0)
    for i in insts:
        i.view.metrics.num_waiting, i.view.metrics.kv_usage = 12, 0.95  # score 2.4
    saturated = AdmissionSnapshot(10.05, insts, queues())
    assert pol.saturation(saturated) == pytest.approx(2.4)  # type: ignore[attr-defined]
    for tier in ("interactive", "long_context"):
        d = pol.on_arrival(req(f"n-{tier}", tier=tier), saturated)
        assert d.action == ADMIT and d.instance_ids is None  # no queue, no filter
    assert pol.on_arrival(req("b1", tier="batch"), saturated).action == REJECT
    # stale scrapes count as saturated for the sheddable check
    stale = AdmissionSnapshot(11.0, instances(2, now_s=10.0), queues())
    assert pol.on_arrival(req("b2", tier="batch"), stale).action == REJECT
    assert pol.on_arrival(req("i2", tier="interactive"), stale).action == ADMIT
    # below saturation sheddable work is admitted too, to any endpoint
    insts[0].view.metrics.num_waiting, insts[0].view.metrics.kv_usage = 7, 0.2  # 1.4
    insts[1].view.metrics.num_waiting, insts[1].view.metrics.kv_usage = 0, 0.1  # 0.125
    calm = AdmissionSnapshot(10.05, insts, queues())
    d = pol.on_arrival(req("b3", tier="batch"), calm)
    assert d.action == ADMIT and d.instance_ids is None


def test_strict_priority_serves_higher_tiers_first() -> None:
    pol = StrictPriorityAdmission(slo=SLO)
    qs = queues()
    qs["batch"].append(QueuedRequest(req("b", tier="batch"), 0))
    qs["long_context"].append(QueuedRequest(req("l", 9000, tier="long_context"), 0))
    qs["interactive"].append(QueuedRequest(req("i", tier="interactive"), 0))
    act = pol.next_action(AdmissionSnapshot(0, instances(1), qs))
    assert act is not None and act.request_id == "i"


def test_registry_names_and_duplicates() -> None:
    assert {"fcfs", "strict_priority", "llmd", "llmd_flow_control", "slomax"} <= set(
        ADMISSION.names()
    )
    from tokenfleet.errors import DuplicateNameError

    with pytest.raises(DuplicateNameError):
        ADMISSION.add("slomax", SLOMaxAdmission)


# -- 3. no preemption, ever ---------------------------------------------------------------
def _kv_pressure_workload(n: int = 160, seed: int = 3) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tier_roll = rng.random()
        if tier_roll < 0.5:
            info = req(f"x{i}", rng.randint(300, 3000), 1024, arrival_s=i * 0.02)
        elif tier_roll < 0.7:
            info = req(f"l{i}", rng.randint(9000, 20000), 1024, arrival_s=i * 0.02)
        else:
            info = req(
                f"b{i}",
                rng.randint(500, 4000),
                1024,
                arrival_s=0.0,
                task_type="batch",
                deadline_s=600.0,
            )
        out.append(TraceRequest(info, rng.randint(200, 1024)))
    out.sort(key=lambda r: r.info.arrival_s)
    return out


def test_no_preemption_over_a_whole_run_even_where_fcfs_preempts() -> None:
    reqs = _kv_pressure_workload()
    cfg = PoolConfig(
        profile=PROFILE, n_instances=2, router="round_robin", kv_capacity_blocks=4000
    )  # 64k tokens of KV per instance
    fcfs, pool_fcfs, _ = run_pool_with_admission(reqs, cfg, SLO, "fcfs")
    assert pool_fcfs.preemptions() > 0, "scenario must put the KV cache under pressure"
    recs, pool, _ = run_pool_with_admission(reqs, cfg, SLO, "slomax")
    assert pool.preemptions() == 0
    assert all(e.counters.preemptions == 0 for e in pool.engines)
    # ... and avoiding eviction is not bought with less goodput
    assert summarize(recs, SLO)["slo_attainment"] > summarize(fcfs, SLO)["slo_attainment"]


# -- 4. controller convergence --------------------------------------------------------------
def _plant(share: float, load: float) -> float:
    """Interactive attainment falls steeply once batch + interactive exceed capacity."""
    over = max(0.0, load + 0.5 * share - 1.0)
    return max(0.0, min(1.0, 1.0 - 3.0 * over))


def _window(att: float, share: float = 0.5) -> WindowStats:
    w = WindowStats(
        period_s=5.0, batch_remaining=1000, batch_deadline_s=1e9, batch_finished=round(40 * share)
    )
    w.tiers["interactive"] = TierWindow(finished=1000, met=round(1000 * att), completed=1000)
    return w


def test_controller_converges_after_a_load_step_without_oscillating() -> None:
    ctl = SLOMaxController(ControllerConfig(batch_share=0.5))
    shares: list[float] = []
    for k in range(120):
        load = 0.6 if k < 60 else 0.85
        shares.append(ctl.batch.value)
        ctl.update(_window(_plant(ctl.batch.value, load), ctl.batch.value), now_s=5.0 * k)
    target = ctl.cfg.targets["interactive"]

    def settled(seg: list[float], load: float) -> None:
        tail = seg[-20:]
        assert max(tail) - min(tail) < 0.04, f"still moving: {tail}"
        att = _plant(tail[-1], load)
        assert target - ctl.cfg.band - 0.01 <= att <= 1.0, att
        moves = [b - a for a, b in zip(tail, tail[1:], strict=False) if abs(b - a) > 1e-12]
        reversals = sum(1 for a, b in zip(moves, moves[1:], strict=False) if (a > 0) != (b > 0))
        assert reversals <= 1, f"sustained oscillation: {tail}"

    settled(shares[:60], 0.6)
    settled(shares[60:], 0.85)
    assert shares[59] > shares[-1] + 0.3  # batch yielded to the heavier interactive load
    # ... and it got there within 20 control periods of the step
    assert abs(shares[80] - shares[-1]) < 0.05


def test_controller_state_round_trips_for_the_beat_task() -> None:
    a = SLOMaxController()
    for k in range(7):
        a.update(_window(_plant(a.batch.value, 0.9)), now_s=5.0 * k)
    b = SLOMaxController()
    b.load_state(json.loads(json.dumps(a.state_dict())))
    for k in range(7, 12):
        w = _window(_plant(a.batch.value, 0.9))
        assert a.update(w, 5.0 * k) == b.update(w, 5.0 * k)


def test_controller_protects_the_batch_deadline() -> None:
    """Behind schedule, batch grows even while interactive is slightly short."""
    ctl = SLOMaxController(ControllerConfig(batch_share=0.3))
    w = WindowStats(period_s=5.0, batch_remaining=5000, batch_deadline_s=100.0, batch_finished=10)
    w.tiers["interactive"] = TierWindow(finished=100, met=94, completed=100)
    before = ctl.batch.value
    ctl.update(w, now_s=0.0)
    assert ctl.batch.value > before


# -- 5. goodput accounting ---------------------------------------------------------------------
def rec(
    rid: str,
    tier: str,
    status: str,
    *,
    arrival: float = 0.0,
    first: float | None = None,
    finish: float | None = None,
    out: int = 0,
    inp: int = 100,
    waste: float = 0.0,
    deadline: float | None = None,
) -> RequestRecord:
    r = RequestRecord(
        request_id=rid,
        tenant="t",
        tier=tier,
        arrival_s=arrival,
        input_tokens=inp,
        max_tokens=1024,
        deadline_s=deadline,
    )
    r.status, r.first_token_s, r.finish_s, r.output_tokens = status, first, finish, out
    r.dispatched_s = arrival if status != "rejected" else None
    r.wasted_gpu_s = waste
    return r


def test_goodput_strict_rule_on_a_hand_computed_example() -> None:
    records = [
        # interactive limits: TTFT 1.0 s, TPOT 0.10 s
        rec("ok", "interactive", "completed", first=0.5, finish=5.5, out=101),  # TPOT 0.05
        rec("slow_ttft", "interactive", "completed", first=1.5, finish=3.5, out=41),
        rec("slow_tpot", "interactive", "completed", first=0.2, finish=20.2, out=101),  # 0.2
        rec("gave_up", "interactive", "cancelled", finish=20.0, waste=1.5),
        rec("shed", "interactive", "rejected", finish=0.0),
        rec("dup", "interactive", "duplicate", first=0.3, finish=4.3, out=50, waste=0.8),
        # batch: only the deadline counts
        rec("b_ok", "batch", "completed", first=30.0, finish=90.0, out=200, deadline=100.0),
        rec("b_late", "batch", "completed", first=30.0, finish=110.0, out=300, deadline=100.0),
        rec("b_timeout", "batch", "timed_out", finish=100.0, deadline=100.0),
    ]
    s = summarize(records, SLO, duration_s=100.0)
    assert [r.slo_met for r in records] == [
        True,
        False,
        False,
        False,
        False,
        False,
        True,
        False,
        False,
    ]
    assert s["goodput_tok_s"] == pytest.approx((101 + 200) / 100.0)
    assert s["throughput_tok_s"] == pytest.approx((101 + 41 + 101 + 200 + 300) / 100.0)
    assert s["slo_attainment"] == pytest.approx(2 / 9)
    it = s["per_tier"]["interactive"]
    assert (it["requests"], it["rejected"], it["cancelled"], it["duplicates"]) == (6, 1, 1, 1)
    assert it["wasted_gpu_s"] == pytest.approx(2.3)
    assert it["slo_attainment"] == pytest.approx(1 / 6)
    bt = s["per_tier"]["batch"]
    assert (bt["timed_out"], bt["slo_attainment"]) == (1, pytest.approx(1 / 3))


# -- 6. the driver: equivalence, timeouts, waste ------------------------------------------------
def _chat(n: int, seed: int = 1, spacing_s: float = 0.01) -> list[TraceRequest]:
    rng = random.Random(seed)
    return [
        TraceRequest(
            req(
                f"r{i}",
                rng.randint(100, 3000),
                1024,
                arrival_s=i * spacing_s,
                block_hashes=tuple(range(i * 1000, i * 1000 + 20)),
            ),
            rng.randint(20, 400),
        )
        for i in range(n)
    ]


def test_fcfs_admission_is_exactly_todays_behaviour() -> None:
    reqs = _chat(200)
    cfg = PoolConfig(profile=PROFILE, n_instances=3, router="round_robin")
    a, _ = run_pool(reqs, cfg, SLO)
    b, _, _ = run_pool_with_admission(reqs, cfg, SLO, "fcfs")
    key = [(r.request_id, r.instance_id, r.first_token_s, r.finish_s, r.status) for r in a]
    assert key == [(r.request_id, r.instance_id, r.first_token_s, r.finish_s, r.status) for r in b]


def test_client_timeouts_cancel_and_count_spent_work_as_waste() -> None:
    # A batch job floods one instance; chat clients give up after 0.5 s without
    # a first token. FCFS leaves them behind the job; strict priority serves them.
    jobs = [
        TraceRequest(req(f"b{i}", 2000, 1024, task_type="batch", deadline_s=1e4), 800)
        for i in range(60)
    ]
    chats = [
        TraceRequest(req(f"c{i}", 500, 1024, arrival_s=0.01 + 0.001 * i), 100, 0.5)
        for i in range(10)
    ]
    cfg = PoolConfig(profile=PROFILE, n_instances=1, router="round_robin")
    recs, _, _ = run_pool_with_admission(jobs + chats, cfg, SLO, "fcfs")
    cancelled = [r for r in recs if r.status == "cancelled"]
    assert len(cancelled) == 10 and all(r.tier == "interactive" for r in cancelled)
    recs2, _, _ = run_pool_with_admission(jobs + chats, cfg, SLO, "strict_priority")
    assert not [r for r in recs2 if r.status == "cancelled"]
    # A client that gives up mid-prefill leaves the spent prefill as waste.
    big = TraceRequest(req("big", 60000, 64), 10, 0.5)
    recs3, _, _ = run_pool_with_admission([big], cfg, SLO, "fcfs")
    assert recs3[0].status == "cancelled"
    assert 0.2 < recs3[0].wasted_gpu_s < 0.6  # about the 0.5 s of prefill it got


def test_gateway_queue_cancellation_spends_nothing() -> None:
    # One long-context slot; the second long request waits in the gateway queue
    # and its client gives up there: no waste, no dispatch.
    slo = SLOConfig.from_mapping(
        {"tiers": {"long_context": {"ttft_s": 30.0, "ttft_per_1k_input_s": 0.1}}}
    )
    a = TraceRequest(req("L1", 60000, 64), 10)
    b = TraceRequest(req("L2", 60000, 64, arrival_s=0.001), 10, 0.2)
    cfg = PoolConfig(profile=PROFILE, n_instances=1, router="round_robin")
    recs, _, _ = run_pool_with_admission([a, b], cfg, slo, "slomax")
    r2 = next(r for r in recs if r.request_id == "L2")
    assert r2.status == "cancelled" and r2.dispatched_s is None and r2.wasted_gpu_s == 0.0


def test_before_its_first_window_the_lane_follows_the_arrivals_mix_and_spares_one() -> None:
    """A run that opens with a burst of long prompts: before the controller
    has measured a window, the lane is sized from the prompts that arrived
    (here all long, so all but one instance) instead of the initial half of
    the pool, so three long prefills start at once; one instance stays off
    the lane, so the chat request behind them is served in milliseconds."""
    longs = [
        TraceRequest(req(f"L{i}", 30000, 64, arrival_s=0.05 * i, block_hashes=(900 + i,)), 16)
        for i in range(3)
    ]
    chat = TraceRequest(req("c", 800, 64, arrival_s=0.3, block_hashes=(1,)), 16)
    cfg = PoolConfig(profile=PROFILE, n_instances=4, router="tokenpilot")
    recs, _, driver = run_pool_with_admission(longs + [chat], cfg, SLO, "slomax")
    by_id = {r.request_id: r for r in recs}
    waits = [by_id[f"L{i}"].dispatched_s - by_id[f"L{i}"].arrival_s for i in range(3)]  # type: ignore[operator]
    assert max(waits) < 0.01, waits  # the initial half-pool lane held the third 1.1 s
    lane = {by_id[f"L{i}"].instance_id for i in range(3)}
    assert len(lane) == 3
    assert by_id["c"].instance_id not in lane
    assert by_id["c"].ttft_s is not None and by_id["c"].ttft_s < 0.1
    assert driver.policy.lane_measured  # the run's first window measured the mix
    # the rule alone: half the pool before any arrival, all but one after long
    # prompts only, and the controller's share once a window has measured it
    pol = SLOMaxAdmission(slo=SLO)
    assert pol._lane_size(4) == 2
    pol.on_arrival(
        req("L", 30000, tier="long_context"), AdmissionSnapshot(0.0, instances(4), queues())
    )
    assert not pol.lane_measured and pol._lane_size(4) == 3
    pol.on_window(_mix_window(long_tokens=90000, interactive_tokens=800), 5.0)
    assert pol.lane_measured and pol._lane_size(4) == 4  # round(0.875 x 4)


def _mix_window(long_tokens: int, interactive_tokens: int) -> WindowStats:
    w = WindowStats(period_s=5.0)
    w.tier("long_context").prefill_tokens = long_tokens
    w.tier("interactive").prefill_tokens = interactive_tokens
    return w


# -- 7. workload mixing ---------------------------------------------------------------------------
def _write_traces(d: Path) -> tuple[Path, Path]:
    az = d / "chat.csv"
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(400):
        lines.append(
            f"2023-11-16 18:{i // 60:02d}:{i % 60:02d}.5000000,{200 + (i * 37) % 1500},"
            f"{20 + (i * 13) % 200}"
        )
    az.write_text("\n".join(lines) + "\n")
    mc = d / "docs.jsonl"
    rows = []
    for i in range(60):
        n_in = 9000 + (i * 977) % 12000
        nb = -(-n_in // 512)
        base = (i % 4) * 100
        rows.append(
            json.dumps(
                {
                    "timestamp": i * 2000,
                    "input_length": n_in,
                    "output_length": 30 + i % 50,
                    "hash_ids": [base + k for k in range(nb)],
                }
            )
        )
    mc.write_text("\n".join(rows) + "\n")
    return az, mc


def _write_mix(d: Path, az: Path, mc: Path, count: int = 120) -> Path:
    y = d / "mix.yaml"
    y.write_text(f"""
name: tiny
duration_s: 60
router: round_robin
slo:
  tiers:
    interactive: {{ttft_s: 1.0, tpot_s: 0.10, client_timeout_s: 30}}
classes:
  - {{name: chat, trace: {az}, tenant: chat, max_tokens: 512, rate_rps: 3}}
  - {{name: docs, trace: {mc}, tenant: docs, rate_rps: 0.5, client_timeout_s: 60}}
  - name: job
    trace: {az}
    tenant: analytics
    task_type: batch
    skip: 200
    count: {count}
    at_s: 0
    deadline_s: 50
""")
    return y


def test_mix_composes_classes_with_their_own_rules(tmp_path: Path) -> None:
    az, mc = _write_traces(tmp_path)
    spec = load_mix(_write_mix(tmp_path, az, mc))
    reqs = build_mix(spec)
    by = {
        c: [r for r in reqs if r.info.request_id.startswith(c + "/")]
        for c in ("chat", "docs", "job")
    }
    assert len(by["job"]) == 120
    assert all(
        r.info.arrival_s == 0.0 and r.info.deadline_s == 50.0 and r.info.task_type == "batch"
        for r in by["job"]
    )
    assert all(r.info.max_tokens == 512 and r.info.tenant == "chat" for r in by["chat"])
    rate = (len(by["chat"]) - 1) / (by["chat"][-1].info.arrival_s - by["chat"][0].info.arrival_s)
    assert rate == pytest.approx(3.0, rel=0.05)
    assert max(r.info.arrival_s for r in reqs) <= 60.0
    assert all(r.client_timeout_s == 60.0 for r in by["docs"])
    assert [classify(r.info, SLO) for r in by["docs"]] == ["long_context"] * len(by["docs"])
    assert [r.info.arrival_s for r in reqs] == sorted(r.info.arrival_s for r in reqs)
    # rate multiplier scales streams, never the job
    more = build_mix(spec, 2.0)
    assert sum(r.info.request_id.startswith("job/") for r in more) == 120
    assert sum(r.info.request_id.startswith("chat/") for r in more) > 1.8 * len(by["chat"])


def test_a_mix_scaled_to_a_load_offers_that_load(tmp_path: Path) -> None:
    az, mc = _write_traces(tmp_path)
    spec = load_mix(_write_mix(tmp_path, az, mc))
    for target in (0.3, 0.4):
        reqs, _ = build_at_load(spec, target, PROFILE, 2)
        assert offered_load(reqs, PROFILE, 2, spec.duration_s) == pytest.approx(target, rel=0.005)
        assert sum(r.info.request_id.startswith("job/") for r in reqs) == 120  # jobs stay
    with pytest.raises(ConfigError, match="runs out"):  # the small traces cap it near 0.46
        build_at_load(spec, 0.8, PROFILE, 2)


@pytest.mark.parametrize(
    "bad,field",
    [
        ({"classes": []}, "classes"),
        ({"classes": [{"name": "a"}]}, "classes[0]"),
        ({"classes": [{"name": "a", "trace": "x.csv", "colour": 1}]}, "classes[0].colour"),
        ({"classes": [{"name": "a", "trace": "x.csv", "tier": "vip"}]}, "classes[0].tier"),
        ({"classes": [{"name": "a", "trace": "x.csv", "at_s": 0, "rate_rps": 3}]}, "classes[0]"),
        ({"duration_s": -1, "classes": [{"name": "a", "trace": "x.csv"}]}, "duration_s"),
    ],
)
def test_mix_validation_names_the_field(bad: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse_mix(bad, source="m.yaml")
    assert e.value.field == field


def test_cli_workload_admission_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    az, mc = _write_traces(tmp_path)
    y = _write_mix(tmp_path, az, mc)
    out = tmp_path / "out.json"
    rc = main(
        [
            "sim",
            "--workload",
            str(y),
            "--instances",
            "2",
            "--admission",
            "fcfs",
            "--admission",
            "slomax",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    runs = {r["admission"]: r for r in data["runs"]}
    assert set(runs) == {"fcfs", "slomax"}
    for r in runs.values():
        assert r["policy"] == "round_robin"
        for tier in ("interactive", "long_context", "batch"):
            m = r["per_tier"][tier]
            for k in (
                "goodput_tok_s",
                "slo_attainment",
                "rejected",
                "cancelled",
                "wasted_gpu_s",
                "duplicates",
            ):
                assert k in m
        assert r["admission_report"]["batch_deadline_met"] in (True, False)
        assert r["admission_report"]["timeline"]
    assert runs["slomax"]["preemptions"] == 0
    assert data["workload"]["requests_per_class"]["job"] == 120


def test_cli_workload_missing_trace_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    y = tmp_path / "m.yaml"
    y.write_text("classes:\n  - {name: a, trace: nowhere/x.csv, rate_rps: 1}\n")
    rc = main(["sim", "--workload", str(y), "--admission", "fcfs", "--quiet"])
    assert rc == 2
    assert "not found" in capsys.readouterr().err


# -- 8. the documented mixed scenario (needs ../shared/traces) ----------------------------------
MIXED = REPO / "examples" / "scenarios" / "mixed.yaml"


def test_mixed_yaml_parses_and_points_at_the_shared_traces() -> None:
    spec = load_mix(MIXED)
    assert {c.name for c in spec.classes} == {"chat", "docs", "nightly"}
    assert spec.load == 0.93  # scaled to its design load unless --load says otherwise
    with pytest.raises(ValidationError, match="load"):
        parse_mix({"load": -1, "classes": [{"name": "c", "synthetic": "chat", "rate_rps": 1}]})
    assert all(
        c.trace is not None and c.trace.name in ("azure_conv_2023.csv", "mooncake_synthetic.jsonl")
        for c in spec.classes
    )


@pytest.mark.slow
@pytest.mark.traces
def test_mixed_scenario_acceptance(tmp_path: Path) -> None:
    spec = load_mix(MIXED)
    missing = missing_traces(spec)
    if missing:
        pytest.skip(
            f"shared traces absent ({', '.join(str(m) for m in missing)}); "
            "the mixed scenario needs ../shared/traces"
        )
    out = tmp_path / "mixed.json"
    rc = main(
        [
            "sim",
            "--workload",
            str(MIXED),
            "--admission",
            "fcfs",
            "--admission",
            "llmd",
            "--admission",
            "slomax",
            "--admission",
            "llmd_flow_control",
            "--json",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    runs = {r["admission"]: r for r in json.loads(out.read_text())["runs"]}
    fc, ld, sm, fl = (runs["fcfs"], runs["llmd"], runs["slomax"], runs["llmd_flow_control"])
    # the mix's own load 0.93: fcfs 80.5% after the engine recalibration (73.4%
    # before); SLOMax 1.299x fcfs, a hair under the 1.30x aim (docs/slomax.md)
    assert 0.70 <= fc["slo_attainment"] <= 0.90
    assert sm["goodput_tok_s"] >= 1.25 * fc["goodput_tok_s"]
    assert sm["goodput_tok_s"] >= 1.25 * ld["goodput_tok_s"]  # llm-d as shipped
    assert sm["slo_attainment"] >= 0.90
    assert sm["throughput_tok_s"] >= 0.98 * fc["throughput_tok_s"]
    assert sm["per_tier"]["interactive"]["slo_attainment"] >= 0.95
    assert sm["admission_report"]["batch_deadline_met"] is True
    assert sm["goodput_tok_s"] > fl["goodput_tok_s"]
    assert sm["preemptions"] == 0


def test_the_live_controller_runs_at_the_simulators_period() -> None:
    """The controller smooths its signals and moves its knobs once per window,
    so its dynamics depend on the period: run live at another one than the
    simulator, it is not the policy that was simulated (at 1 s the live lane
    swung between 1 and 4 of 4 instances from one second to the next)."""
    from tokenfleet.live.config import LiveConfig
    from tokenfleet.sim.runner import SimSettings

    sim = SimSettings(profile=get_profile("llama3-8b-h200")).control_period_s
    assert LiveConfig().control_period_s == sim == ControllerConfig().period_s
