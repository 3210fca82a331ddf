"""``slomax``: tiered admission over pooled queues, steered by goodput feedback.

Mixed traffic hurts itself in one FIFO: a batch job floods the engines'
waiting queues, long prefills hold a whole step budget for seconds, and every
tier misses. SLOMax keeps the engines' own queues short and decides at the
gateway, per tier (rules and rationale in docs/slomax.md):

long-context lane
    Long prefills (long_context requests, and long batch prompts) run only on
    a lane: the last ``long_share`` of the instances, one long prefill per
    instance at a time, counted in uncached prompt tokens still to prefill (a
    long conversation turn mostly cached there is not a long prefill). The
    other instances never see a multi-second prefill, so interactive TTFT and
    TPOT hold there. A long-context prompt whose prefill takes less than the
    interactive tier's clean TTFT budget where it goes is not a long prefill
    either: it may go to any instance where the queued prefill plus its own
    stays within that budget.
interactive
    dispatched at once, to instances whose predicted TTFT is well inside the
    limit (while long work is about, off the lane or holding part of the
    prompt first), else within it; rejected at arrival only when no instance
    could plausibly meet the limit.
long_context
    waits in a FIFO for a free lane slot (unless mostly held, or short, as
    above); a request whose predicted TTFT
    (queue wait + prefill) exceeds ``reject_factor`` x its limit is rejected
    at arrival, with ``Retry-After`` = how far past the limit it would be
    served, instead of wasting prefill on a sure miss.
batch
    always queued; a short prompt is dispatched only to an instance with no
    interactive request waiting for its first token, whose recent
    interactive TPOT is comfortably inside the limit, within ``batch_share``
    of its seats and of its prefill budget (prefill of all tiers may take at
    most ``batch_share * prefill_fraction`` of an instance's time, the rest of
    the steps stay short). A long batch prompt takes a free lane slot once
    no long-context request waits. When interactive load returns, batch
    yields by not being dispatched: nothing running is ever preempted.

Every dispatch keeps KV headroom for prompt + reserved output (``max_tokens``
by default), so the engine never has to evict; batch and long-context also
leave ``interactive_kv_reserve`` of each instance's KV and
``interactive_seat_reserve`` seats for interactive work.

The knobs ``batch_share``, ``long_share`` and ``reject_factor`` move once per
control period under ``controller.SLOMaxController`` (``adaptive=False``
freezes them at their initial values). Before a window has measured the
work mix, the lane is sized from the prompts that arrived, one instance
spared. TTFT predictions use the engine profile (operator-configured, so a
live gateway knows it) corrected online by the observed/predicted ratio per
tier, and a learned prefix-hit ratio.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from tokenfleet.core.admission.base import (
    ADMISSION,
    ADMIT,
    DISPATCH,
    DROP,
    QUEUE,
    REJECT,
    Action,
    AdmissionDecision,
    AdmissionSnapshot,
    BaseAdmission,
    InstanceLoad,
    QueueTotals,
    TierQueue,
    WindowStats,
    kv_reservation_tokens,
)
from tokenfleet.core.admission.controller import ControllerConfig, SLOMaxController
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import CompletionEvent, FirstTokenEvent, RequestInfo
from tokenfleet.engine.profiles import EngineProfile

INTERACTIVE = "interactive"
LONG = "long_context"
BATCH = "batch"
#: a long-context prompt this much of which an instance holds may go there
#: without a lane slot, if what is left to prefill is below the threshold
HOLDER_MIN_FRACTION = 0.5


class _Quantile:
    """Sliding-window quantile of observed output lengths (for the KV reserve)."""

    def __init__(self, window: int = 1000) -> None:
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []
        self._window = window

    def add(self, x: int) -> None:
        self._fifo.append(x)
        bisect.insort(self._sorted, x)
        if len(self._fifo) > self._window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def get(self, q: float) -> int | None:
        if len(self._sorted) < 50:
            return None
        return self._sorted[min(len(self._sorted) - 1, int(q * len(self._sorted)))]


class _Costs:
    """Prefill-time estimates from the engine profile, memoised."""

    def __init__(self) -> None:
        self._prefill: dict[tuple[str, int], float] = {}
        self._per_token: dict[str, float] = {}
        self._decode: dict[str, float] = {}

    def prefill_s(self, profile: EngineProfile, uncached_tokens: int) -> float:
        bucket = max(0, uncached_tokens) // 64
        key = (profile.name, bucket)
        v = self._prefill.get(key)
        if v is None:
            v = self._prefill[key] = profile.prefill_time_s(bucket * 64 + 32)
        return v

    def per_token_s(self, profile: EngineProfile) -> float:
        """Marginal prefill cost of short prompts sharing a full step budget."""
        v = self._per_token.get(profile.name)
        if v is None:
            n = profile.max_num_batched_tokens
            v = self._per_token[profile.name] = profile.prefill_time_s(n) / n
        return v

    def decode_step_s(self, profile: EngineProfile) -> float:
        v = self._decode.get(profile.name)
        if v is None:
            v = self._decode[profile.name] = profile.decode_step_time_s(64, 2048)
        return v


@ADMISSION.register("slomax")
class SLOMaxAdmission(BaseAdmission):
    name = "slomax"

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        controller: ControllerConfig | Mapping[str, Any] | None = None,
        adaptive: bool = True,
        lane_measured: bool | None = None,
        long_prefill_per_instance: int = 1,
        long_inflight_per_instance: int = 8,
        batch_max_seats: int | None = None,
        interactive_seat_reserve: int = 32,
        interactive_kv_reserve: float = 0.10,
        kv_budget: float = 0.95,
        clean_ttft_fraction: float = 0.5,
        interactive_reject_factor: float = 3.0,
        prefill_fraction: float = 0.7,
        tpot_guard: float = 0.6,
        output_reserve: str = "max_tokens",
    ) -> None:
        if long_prefill_per_instance < 1 or long_inflight_per_instance < 1:
            raise ValueError("long-context caps must be >= 1")
        if not 0 < kv_budget <= 1 or not 0 <= interactive_kv_reserve < kv_budget:
            raise ValueError("need 0 <= interactive_kv_reserve < kv_budget <= 1")
        if output_reserve != "max_tokens" and not output_reserve.startswith("p"):
            raise ValueError("output_reserve must be 'max_tokens' or a quantile like 'p99'")
        self.slo = slo or SLOConfig()
        cfg = (
            controller
            if isinstance(controller, ControllerConfig)
            else ControllerConfig(**dict(controller or {}))
        )
        self.ctrl = SLOMaxController(cfg)
        self.adaptive = adaptive
        self.long_prefill_cap = long_prefill_per_instance
        self.long_inflight_cap = long_inflight_per_instance
        self.batch_max_seats = batch_max_seats
        self.seat_reserve = interactive_seat_reserve
        self.kv_reserve = interactive_kv_reserve
        self.kv_budget = kv_budget
        self.clean_fraction = clean_ttft_fraction
        self.interactive_reject_factor = interactive_reject_factor
        self.reserve_q = (
            None if output_reserve == "max_tokens" else float(output_reserve[1:]) / 100.0
        )
        st = self.ctrl.state
        self.batch_share = st.batch_share
        self.long_share = st.long_share
        self.reject_factor = st.reject_factor
        # Until a window has measured the work mix, the lane follows the mix
        # of the prompts that arrived here (_observe_cold_mix). Frozen knobs
        # count as measured (None: the lane is what was configured); the live
        # API runs this object frozen with False, for beat's controller adapts
        # its knobs (the refresh copies the flag beat writes).
        if lane_measured is None:
            lane_measured = st.lane_measured or not adaptive
        self.lane_measured = lane_measured
        self._cold_lane_tokens = 0
        self._cold_interactive_tokens = 0
        self._cold_share: float | None = None
        self.prefill_fraction = prefill_fraction
        self.bucket_s = 0.5  # burst allowance, seconds of prefill
        self.tpot_guard = tpot_guard
        # instance -> (budget level s, at s, cumulative uncached tokens seen)
        self._buckets: dict[str, tuple[float, float, int]] = {}
        # (instance, tier) -> (EWMA of observed TPOT, when last observed)
        self._tpot: dict[tuple[str, str], tuple[float, float]] = {}
        self._costs = _Costs()
        self._kappa: dict[str, float] = {}  # observed / predicted TTFT, per tier
        self._hit: dict[str, float] = {}  # learned prefix-hit ratio, per tier
        self._outputs: dict[str, _Quantile] = {}
        self._pred: dict[str, dict[str, float]] = {}  # rid -> instance -> predicted s

    # -- small helpers ---------------------------------------------------------------
    def _limit(self, req: RequestInfo) -> float:
        lim = self.slo.slo_for(req.tier).ttft_limit_s(req.input_tokens)
        return math.inf if lim is None else lim

    def _own_s(self, req: RequestInfo, profile: EngineProfile) -> float:
        hit = self._hit.get(req.tier, 0.0)
        uncached = int(req.input_tokens * (1.0 - hit))
        return self._costs.prefill_s(profile, uncached)

    def _ahead_s(self, inst: InstanceLoad) -> float:
        """Prefill work already waiting on this instance, in seconds."""
        prof = inst.view.profile
        short_tokens = 0
        long_s = 0.0
        for name, load in inst.tiers.items():
            if load.prefill_pending == 0:
                continue
            if name == LONG:
                per = load.prefill_pending_tokens // load.prefill_pending
                long_s += load.prefill_pending * self._costs.prefill_s(prof, per)
            else:
                short_tokens += load.prefill_pending_tokens
        return short_tokens * self._costs.per_token_s(prof) + long_s

    def _reserve(self, req: RequestInfo) -> int:
        out = None
        if self.reserve_q is not None:
            q = self._outputs.get(req.tier)
            learned = q.get(self.reserve_q) if q is not None else None
            if learned is not None:
                out = min(req.max_tokens, learned)
        return kv_reservation_tokens(req, out)

    def kv_reserve_tokens(self, request: RequestInfo) -> int:
        return self._reserve(request)

    def _room(self, inst: InstanceLoad, req: RequestInfo) -> bool:
        view = inst.view
        if not (view.ready and view.metrics.healthy):
            return False
        if view.max_model_len_tokens and req.input_tokens + 1 > view.max_model_len_tokens:
            return False
        seats = view.profile.max_num_seqs
        kv_free = inst.kv_free_tokens(self.kv_budget)
        if req.tier != INTERACTIVE:
            seats -= self.seat_reserve
            kv_free -= int(self.kv_reserve * view.kv_capacity_tokens)
        return inst.inflight < seats and kv_free >= self._reserve(req)

    def _predicted(
        self,
        req: RequestInfo,
        insts: Sequence[InstanceLoad],
        cached: Mapping[str, int] | None = None,
    ) -> dict[str, float]:
        """Predicted TTFT per instance: the prefill queued there, then this
        prompt's own (its uncached part where ``cached`` says what the
        instance holds, else the tier's learned hit ratio)."""
        kappa = self._kappa.get(req.tier, 1.0)
        out = {}
        for inst in insts:
            prof = inst.view.profile
            held = cached.get(inst.instance_id) if cached else None
            own = (
                self._own_s(req, prof)
                if held is None
                else self._costs.prefill_s(prof, max(0, req.input_tokens - held))
            )
            out[inst.instance_id] = kappa * (self._ahead_s(inst) + own) + self._costs.decode_step_s(
                prof
            )
        return out

    def _holders(
        self, req: RequestInfo, snap: AdmissionSnapshot, min_fraction: float
    ) -> list[InstanceLoad]:
        """Instances with room that hold at least ``min_fraction`` of the prompt:
        elsewhere it would be prefilled again, and the lane split, which knows
        nothing of caches, would otherwise send a returning conversation away
        from its KV."""
        if not snap.cached_tokens:
            return []
        need = max(1, int(min_fraction * req.input_tokens))
        return [
            i
            for i in snap.instances
            if snap.cached_tokens.get(i.instance_id, 0) >= need and self._room(i, req)
        ]

    def _remember(self, req: RequestInfo, pred: Mapping[str, float], ids: Sequence[str]) -> None:
        self._pred[req.request_id] = {i: pred[i] for i in ids if i in pred}

    # -- interactive -----------------------------------------------------------------
    def _interactive(
        self, req: RequestInfo, snap: AdmissionSnapshot, waited_s: float
    ) -> tuple[tuple[str, ...] | None, float]:
        """Allowed instances (None: no room anywhere) and the best predicted TTFT.

        Preference: well inside the limit, off the lane or holding part of
        the prompt; well inside the limit anywhere; within the limit; else
        the best prediction. While long work is about, a lane instance that
        holds nothing of the prompt is taken only when nothing else is well
        inside the limit: there the prompt would only evict the long prompts'
        prefixes the lane keeps together. Kept off the lane more strictly
        (until 2026-12-05: unless the instance held half the prompt, and
        before a lane instance within the limit), interactive work crowded
        the other instances and queued behind their prefills
        (docs/benchmarks.md, section 19)."""
        room = [i for i in snap.instances if self._room(i, req)]
        if not room:
            return None, math.inf
        pred = self._predicted(req, room, snap.cached_tokens)
        limit = self._limit(req) - waited_s
        lane = self._long_lane(snap) if self._lane_in_use(snap) else set()
        held = snap.cached_tokens or {}
        best = min(pred.values())
        clean = self.clean_fraction * limit
        tiers = (
            [
                i
                for i in room
                if pred[i.instance_id] <= clean
                and (i.instance_id not in lane or held.get(i.instance_id, 0) > 0)
            ],
            [i for i in room if pred[i.instance_id] <= clean],
            [i for i in room if pred[i.instance_id] <= limit],
        )
        pick = next((t for t in tiers if t), None)
        if pick is not None:
            ids = tuple(i.instance_id for i in pick)
        else:
            ids = tuple(i for i, v in pred.items() if v <= best * 1.05)
        self._remember(req, pred, ids)
        return ids, best

    # -- long context ----------------------------------------------------------------
    def _long_lane(self, snap: AdmissionSnapshot) -> set[str]:
        """The instances long prefills may use: the last ``long_share`` of the
        ready ones, by pool position. A stable set keeps long prompts' prefix
        cache together and the other instances free of multi-second prefills
        that would stall interactive streams."""
        ready = sorted(
            (i for i in snap.instances if i.view.ready and i.view.metrics.healthy),
            key=lambda i: i.view.index,
        )
        n = self._lane_size(len(ready))
        return {i.instance_id for i in ready[len(ready) - n :]}

    def _lane_size(self, ready: int) -> int:
        """Lane instances among ``ready``. Before a window has measured the
        work mix, the share is the arrivals' mix (a few prompts' worth of
        evidence), and one instance stays off the lane whatever it says, so
        the first interactive request finds one without a long prefill."""
        if not self.lane_measured:
            share = self.long_share if self._cold_share is None else self._cold_share
            n = max(1, round(share * ready))
            return min(n, ready - 1) if ready > 1 else n
        return max(1, round(self.long_share * ready))

    def _observe_cold_mix(self, req: RequestInfo, snap: AdmissionSnapshot) -> None:
        """Count an arrival's prefill work into the mix that sizes the lane
        until the controller's first measured window. The lane's initial half
        of the pool made a trace that opens with a burst of long prompts (the
        Mooncake slice: 7 of its first 10 requests long-context) queue them
        for up to 1.9 s behind two lane slots while the rest of the pool
        idled: TTFT p95 2.16 s against 1.99 s once the lane follows the mix
        (docs/benchmarks.md, section 34)."""
        uncached = max(0, req.input_tokens - max(snap.cached_tokens.values(), default=0))
        if req.tier == LONG or (
            req.tier == BATCH and req.input_tokens >= self.slo.long_context_min_input_tokens
        ):
            self._cold_lane_tokens += uncached
        elif req.tier == INTERACTIVE:
            self._cold_interactive_tokens += uncached
        else:
            return
        self._cold_share = self.ctrl.share_from_mix(
            self._cold_lane_tokens, self._cold_interactive_tokens
        )

    def _lane_in_use(self, snap: AdmissionSnapshot) -> bool:
        """Long work is queued or in flight. Only then does the lane matter to
        interactive work: an idle lane reserved on all-interactive traffic
        takes 1/8 of the pool out of play and saturates the rest (prefill-heavy
        scenario: TPOT p50 230 ms, docs/benchmarks.md section 13)."""
        if snap.queued(LONG) or snap.queued(BATCH):
            return True
        return any(
            i.tier(LONG).inflight or i.tier(BATCH).inflight or self._long_batch_pending(i)
            for i in snap.instances
        )

    def _long_batch_pending(self, inst: InstanceLoad) -> bool:
        tb = inst.tier(BATCH)
        return tb.prefill_pending_tokens >= self.slo.long_context_min_input_tokens

    def _long_slots(self, req: RequestInfo, snap: AdmissionSnapshot) -> list[InstanceLoad]:
        lane = self._long_lane(snap)
        out = []
        for inst in snap.instances:
            if inst.instance_id not in lane:
                continue
            tl = inst.tier(LONG)
            if (
                tl.prefill_pending_tokens
                >= self.long_prefill_cap * self.slo.long_context_min_input_tokens
                or tl.inflight >= self.long_inflight_cap
            ):
                continue
            if self._long_batch_pending(inst):
                continue
            if self._room(inst, req):
                out.append(inst)
        return out

    def _short_prefills(
        self, req: RequestInfo, snap: AdmissionSnapshot, waited_s: float = 0.0
    ) -> list[InstanceLoad]:
        """Instances where a long-context prompt is not a long prefill: all the
        prefill queued there plus what is left of this prompt to prefill (the
        part the instance does not hold) fits in the interactive tier's clean
        TTFT budget (``clean_ttft_fraction`` of its limit), and the prompt's
        own limit still holds. An interactive request arriving behind it then
        waits no longer than the interactive rule already accepts off the
        lane, so the lane protects nothing by taking it. The lane exists for
        prefills of seconds; measured in tokens alone it also took the 8-15k
        token turns that a fast engine prefills in 0.25-0.5 s, and sent them to
        one instance (docs/benchmarks.md, section 19)."""
        lim = self.slo.slo_for(INTERACTIVE).ttft_limit_s(0)
        if lim is None or not snap.instances:
            return []
        budget = self.clean_fraction * lim
        limit = self._limit(req) - waited_s
        room = [i for i in snap.instances if self._room(i, req) and not self._long_batch_pending(i)]
        pred = self._predicted(req, room, snap.cached_tokens)
        return [
            i
            for i in room
            if pred[i.instance_id] <= limit
            # the prediction less its decode step: the prefill queued plus this one
            and pred[i.instance_id] - self._costs.decode_step_s(i.view.profile) <= budget
        ]

    def _long_wait_s(self, snap: AdmissionSnapshot, queue: TierQueue | QueueTotals | None) -> float:
        """Predicted gateway wait for a long request joining the back of the queue."""
        ready = [i for i in snap.instances if i.view.ready]
        if not ready:
            return math.inf
        slots = self._lane_size(len(ready)) * self.long_prefill_cap
        prof = ready[0].view.profile
        hit = self._hit.get(LONG, 0.0)
        kappa = self._kappa.get(LONG, 1.0)
        busy_s = 0.0
        free_slots = slots
        for inst in ready:
            tl = inst.tier(LONG)
            if tl.prefill_pending:
                per = tl.prefill_pending_tokens // tl.prefill_pending
                # on average half of an in-flight prefill is still to do
                busy_s += 0.5 * tl.prefill_pending * self._costs.prefill_s(prof, per)
                free_slots -= tl.prefill_pending
        if queue is None or len(queue) == 0:
            if free_slots > 0:
                return 0.0
            return kappa * busy_s / slots
        n = len(queue)
        tokens = queue.input_tokens
        per = int(tokens * (1.0 - hit) / max(1, n))
        queued_s = n * self._costs.prefill_s(prof, per)
        return kappa * (busy_s + queued_s) / slots

    # -- the Admission interface ------------------------------------------------------
    def _never_fits(self, req: RequestInfo, snap: AdmissionSnapshot) -> bool:
        """No instance could ever hold it (context length or whole KV budget)."""
        need = self._reserve(req)
        for inst in snap.instances:
            v = inst.view
            if v.max_model_len_tokens and req.input_tokens + 1 > v.max_model_len_tokens:
                continue
            if need <= int(v.kv_capacity_tokens * self.kv_budget):
                return False
        return bool(snap.instances)

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        tier = request.tier
        if not self.lane_measured:
            self._observe_cold_mix(request, snap)
        if self._never_fits(request, snap):
            return AdmissionDecision(REJECT, reason="larger than any instance's context or KV")
        if tier == BATCH:
            return self._batch_arrival(request, snap)
        if tier == LONG:
            return self._long_arrival(request, snap)
        # interactive (and any custom tier is treated like it)
        if snap.queued(tier):
            return AdmissionDecision(QUEUE, reason="interactive queue not empty")
        ids, best = self._interactive(request, snap, 0.0)
        if ids is None:
            return AdmissionDecision(QUEUE, reason="no KV/seat room on any instance")
        limit = self._limit(request)
        if best > self.interactive_reject_factor * limit:
            self._pred.pop(request.request_id, None)
            retry = best - limit
            return AdmissionDecision(
                REJECT,
                retry_after_s=retry,
                predicted_wait_s=best,
                reason=f"predicted TTFT {best:.2f}s >> limit {limit:.2f}s",
            )
        return AdmissionDecision(
            ADMIT, instance_ids=ids, predicted_wait_s=0.0, reason=f"predicted TTFT {best:.2f}s"
        )

    def _long_arrival(self, req: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        limit = self._limit(req)
        queue = snap.queues.get(LONG)
        # Mostly cached where it is held (at least half of it, and what is left
        # to prefill there is below the long-context threshold): no long
        # prefill there, so it takes no lane slot and waits for none. The
        # router picks among the holders and, while one is free, the lane's
        # slots (which would prefill it all).
        thr = self.slo.long_context_min_input_tokens
        cheap = [
            i
            for i in self._holders(req, snap, HOLDER_MIN_FRACTION)
            if req.input_tokens - snap.cached_tokens[i.instance_id] < thr
        ]
        # Not a long prefill where it would take little time (below): no lane
        # slot either, wherever that is.
        short = self._short_prefills(req, snap)
        if cheap or short:
            slots = self._long_slots(req, snap) if queue is None or len(queue) == 0 else []
            cands = _union(cheap, short, slots)
            pred = self._predicted(req, cands, snap.cached_tokens)
            ids = tuple(i.instance_id for i in cands)
            self._remember(req, pred, ids)
            return AdmissionDecision(
                ADMIT,
                instance_ids=ids,
                predicted_wait_s=0.0,
                reason=(
                    "long context, mostly cached where it is held"
                    if cheap
                    else "long context, a short prefill where it goes"
                ),
            )
        prof = snap.instances[0].view.profile if snap.instances else None
        own = 0.0 if prof is None else self._kappa.get(LONG, 1.0) * self._own_s(req, prof)
        if queue is None or len(queue) == 0:
            slots = self._long_slots(req, snap)
            if slots:
                pred = self._predicted(req, slots)
                ok = [i.instance_id for i in slots if pred[i.instance_id] <= limit]
                ids = tuple(ok) if ok else tuple(pred)
                self._remember(req, pred, ids)
                return AdmissionDecision(
                    ADMIT, instance_ids=ids, predicted_wait_s=0.0, reason="long-context slot free"
                )
        wait = self._long_wait_s(snap, queue)
        if wait + own > self.reject_factor * limit:
            retry = max(0.0, wait + own - limit)
            return AdmissionDecision(
                REJECT,
                retry_after_s=retry,
                predicted_wait_s=wait,
                reason=(
                    f"predicted TTFT {wait + own:.1f}s > {self.reject_factor:.2f} x {limit:.1f}s"
                ),
            )
        return AdmissionDecision(
            QUEUE, predicted_wait_s=wait, reason=f"waiting for a long-context slot (~{wait:.1f}s)"
        )

    def _batch_arrival(self, req: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        if req.deadline_s is not None and snap.instances:
            prof = snap.instances[0].view.profile
            # Fastest possible finish: prefill plus max_tokens decode steps.
            floor_s = self._own_s(req, prof) + min(req.max_tokens, 16) * self._costs.decode_step_s(
                prof
            )
            if snap.now_s + floor_s > req.deadline_s:
                return AdmissionDecision(REJECT, reason="deadline cannot be met")
        return AdmissionDecision(QUEUE, reason="batch fills idle capacity")

    def next_action(self, snap: AdmissionSnapshot) -> Action | None:
        a = self._next_interactive(snap)
        if a is not None:
            return a
        a = self._next_long(snap)
        if a is not None:
            return a
        return self._next_batch(snap)

    def _next_interactive(self, snap: AdmissionSnapshot) -> Action | None:
        for tier, q in snap.queues.items():
            if tier in (LONG, BATCH) or len(q) == 0:
                continue
            head = q.head()
            assert head is not None
            req = head.request
            waited = snap.now_s - req.arrival_s
            if waited > self.interactive_reject_factor * self._limit(req):
                return Action(
                    DROP,
                    tier,
                    req.request_id,
                    status="rejected",
                    reason="waited far past its TTFT limit",
                )
            ids, _ = self._interactive(req, snap, waited)
            if ids is not None:
                return Action(DISPATCH, tier, req.request_id, instance_ids=ids)
        return None

    def _next_long(self, snap: AdmissionSnapshot) -> Action | None:
        q = snap.queues.get(LONG)
        if q is None or len(q) == 0:
            return None
        head = q.head()
        assert head is not None
        req = head.request
        limit = self._limit(req)
        waited = snap.now_s - req.arrival_s
        prof = snap.instances[0].view.profile
        own = self._kappa.get(LONG, 1.0) * self._own_s(req, prof)
        if waited + own > self.reject_factor * limit:
            return Action(
                DROP,
                LONG,
                req.request_id,
                status="rejected",
                reason="can no longer meet its TTFT limit; dropped before prefill",
            )
        slots = _union(self._long_slots(req, snap), self._short_prefills(req, snap, waited))
        if not slots:
            return None
        pred = self._predicted(req, slots, snap.cached_tokens)
        ok = [i.instance_id for i in slots if waited + pred[i.instance_id] <= limit]
        ids = tuple(ok) if ok else tuple(pred)
        self._remember(req, pred, ids)
        return Action(DISPATCH, LONG, req.request_id, instance_ids=ids)

    def _next_batch(self, snap: AdmissionSnapshot) -> Action | None:
        q = snap.queues.get(BATCH)
        if q is None or len(q) == 0:
            return None
        head = q.head()
        assert head is not None
        req = head.request
        now = snap.now_s
        if req.deadline_s is not None and now >= req.deadline_s:
            return Action(
                DROP,
                BATCH,
                req.request_id,
                status="timed_out",
                reason="deadline passed while queued",
            )
        share = self.batch_share
        if req.input_tokens >= self.slo.long_context_min_input_tokens:
            return self._next_long_batch(snap, req)
        ids = []
        for inst in snap.instances:
            prof = inst.view.profile
            if inst.tier(INTERACTIVE).prefill_pending > 0:
                continue  # interactive first: never add prefill work ahead of it
            if self._slow_decode(inst, now):
                continue  # streams here are near their TPOT limit: add no prefill
            tb = inst.tier(BATCH)
            seats = self.batch_max_seats or prof.max_num_seqs // 2
            if tb.inflight >= max(1, math.ceil(share * seats)):
                continue
            if (
                tb.prefill_pending
                and tb.prefill_pending_tokens + req.input_tokens
                > share * prof.max_num_batched_tokens
            ):
                continue
            if self._bucket_level(inst, now, share) <= 0.0 or not self._room(inst, req):
                continue
            ids.append(inst.instance_id)
        if not ids:
            return None
        # the router picks among them (prefix affinity); the budget of whichever
        # it picks is charged from the driver's dispatch counters
        return Action(DISPATCH, BATCH, req.request_id, instance_ids=tuple(ids))

    def _next_long_batch(self, snap: AdmissionSnapshot, req: RequestInfo) -> Action | None:
        """A long batch prompt holds a step budget for a second or more, like a
        long-context prefill: it takes a free long-context lane slot once no
        long-context request waits, and leaves one slot free for the next."""
        q = snap.queues.get(LONG)
        if q is not None and len(q) > 0:
            return None
        now = snap.now_s
        lane = self._long_lane(snap)

        def fits(i: InstanceLoad) -> bool:
            seats = self.batch_max_seats or i.view.profile.max_num_seqs // 2
            return (
                i.tier(LONG).prefill_pending == 0
                and not self._long_batch_pending(i)
                and i.tier(BATCH).inflight < max(1, math.ceil(self.batch_share * seats))
                and not self._slow_decode(i, now)
                and self._room(i, req)
            )

        free = [i for i in snap.instances if i.instance_id in lane and fits(i)]
        if len(free) > (1 if len(lane) > 1 else 0):
            # any free slot: the router picks by prefix-cache affinity
            return Action(
                DISPATCH, BATCH, req.request_id, instance_ids=tuple(i.instance_id for i in free)
            )
        return None

    def _bucket_level(self, inst: InstanceLoad, now_s: float, share: float) -> float:
        """Prefill budget of one instance, in seconds of prefill.

        It refills at ``share * prefill_fraction`` seconds per second and every
        prefill dispatched there (any tier, from the driver's cumulative
        counter) drains it, so batch is dispatched only while all prefill work
        stays under that fraction of the instance's time: the rest of the steps
        stay short, which is what keeps streaming TPOT in bounds."""
        rate = share * self.prefill_fraction
        total = sum(t.dispatched_uncached_tokens for t in inst.tiers.values())
        state = self._buckets.get(inst.instance_id)
        if state is None:
            lvl, t, seen = self.bucket_s, now_s, total
        else:
            lvl, t, seen = state
        per_token = self._costs.per_token_s(inst.view.profile)
        lvl += rate * max(0.0, now_s - t) - per_token * (total - seen)
        lvl = min(self.bucket_s, max(-self.bucket_s, lvl))
        self._buckets[inst.instance_id] = (lvl, now_s, total)
        return lvl

    def _slow_decode(self, inst: InstanceLoad, now_s: float) -> bool:
        """Recent streams on this instance (interactive or long-context) ran
        near their TPOT limit: adding prefill there would push them over."""
        for tier in (INTERACTIVE, LONG):
            obs = self._tpot.get((inst.instance_id, tier))
            if obs is None or now_s - obs[1] > 10.0:  # none, or stale evidence
                continue
            limit = self.slo.slo_for(tier).tpot_s
            if limit is not None and obs[0] > self.tpot_guard * limit:
                return True
        return False

    # -- learning from what a live gateway observes -----------------------------------
    def on_first_token(self, event: FirstTokenEvent) -> None:
        preds = self._pred.pop(event.request.request_id, None)
        if not preds:
            return
        pred = preds.get(event.instance_id)
        if pred is None or pred <= 0 or event.ttft_s <= 0:
            return
        tier = event.request.tier
        ratio = min(4.0, max(0.25, event.ttft_s / pred))
        old = self._kappa.get(tier, 1.0)
        # log-space EWMA: a ratio of 2 and of 0.5 pull equally hard
        self._kappa[tier] = min(
            3.0, max(0.5, math.exp(0.9 * math.log(old) + 0.1 * math.log(old * ratio)))
        )

    def on_complete(self, event: CompletionEvent) -> None:
        self._pred.pop(event.request.request_id, None)
        if event.status != "completed":
            return
        req = event.request
        if req.tier in (INTERACTIVE, LONG) and event.ttft_s is not None and event.output_tokens > 1:
            tpot = (event.e2e_s - event.ttft_s) / (event.output_tokens - 1)
            key = (event.instance_id, req.tier)
            prev = self._tpot.get(key)
            ew = tpot if prev is None else 0.8 * prev[0] + 0.2 * tpot
            self._tpot[key] = (ew, event.now_s)
        if req.input_tokens > 0:
            h = min(1.0, event.cached_tokens / req.input_tokens)
            old = self._hit.get(req.tier)
            self._hit[req.tier] = h if old is None else 0.98 * old + 0.02 * h
        if self.reserve_q is not None:
            self._outputs.setdefault(req.tier, _Quantile()).add(event.output_tokens)

    def on_window(self, stats: WindowStats, now_s: float) -> dict[str, float]:
        if self.adaptive:
            st = self.ctrl.update(stats, now_s)
            self.batch_share = st.batch_share
            self.long_share = st.long_share
            self.reject_factor = st.reject_factor
            self.lane_measured = st.lane_measured
        out = {
            "batch_share": self.batch_share,
            "long_share": self.long_share,
            "reject_factor": self.reject_factor,
        }
        for tier, k in self._kappa.items():
            out[f"kappa_{tier}"] = k
        return out


def _union(*groups: Sequence[InstanceLoad]) -> list[InstanceLoad]:
    """Instances of every group, each once, in order of first appearance."""
    seen: set[str] = set()
    out = []
    for group in groups:
        for inst in group:
            if inst.instance_id not in seen:
                seen.add(inst.instance_id)
                out.append(inst)
    return out
