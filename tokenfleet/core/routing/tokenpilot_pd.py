"""TokenPilot-PD: aggregated or disaggregated per request, in predicted seconds.

For every request it predicts, from its own dispatch accounting and the
profile, the TTFT and TPOT of each way to serve it: aggregated on one
instance (prefill queue + own prefill, then decodes that ride with that
instance's coming prefill chunks) or disaggregated (prefill queue on P +
own prefill + KV transfer P->D + D's first step, then D's decode steps),
and takes the option with the smallest SLO-normalised worst of the two.
Why: on prefill-heavy traffic a decode that shares an instance with 8k-token
chunks runs at the chunk's step time, so TPOT is what disaggregation buys,
while TTFT pays the transfer; only a prediction in seconds can weigh them.

Pools: ``plan_roles`` splits the pool only when aggregation is predicted to
lose the decodes' TPOT: the prefill seconds per second the router sent for
requests with a TPOT limit, spread over every instance as an aggregated pool
would run them, give each instance a share ``u`` of its time in chunk steps;
a decode's mean step is then ``1 / (u / t_chunk + (1 - u) / t_decode)``, and
while that is within the decode budget (``decode_budget_frac`` x the
tightest TPOT limit seen) every instance stays mixed; a split pool goes
back to mixed only once that step is within half the budget. Otherwise a
split only takes options away: a medium prompt barred from the decode side
queues (FIFO) on the prefill pool behind long
documents whose TTFT limits are seconds or none (docs/benchmarks.md 13e:
mixed.yaml lost 1.1 points that way). When it pays,
it sizes the prefill pool from the prefill seconds per second the router
itself sent as "long" (a chunk step over the decode budget), at a target
utilisation, leaves the decode pool enough instances for the short prompts
it prefills locally (same utilisation), and keeps every instance mixed
while the long demand is under half an instance. It moves one instance per
cycle and only after two cycles agree (hysteresis), so roles do not flap.

The per-request choice above applies once the pool is split. While it is
all mixed, requests are routed exactly as TokenPilot routes them (its cost
model, under the admission layer's instance subset, SLOMax's lane
included): an unsplit pool is an aggregated one, and the P/D router must
not serve it worse than the aggregated router (it did: on mixed.yaml its
own scoring, blind to SLOMax's lane, lost 0.5 points to TokenPilot,
docs/benchmarks.md section 31).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from typing import Any

from tokenfleet.core.routing.base import ROUTERS, eligible
from tokenfleet.core.routing.pd_base import (
    DECODE,
    MIXED,
    PREFILL,
    PDDecision,
    PDRouter,
    split,
)
from tokenfleet.core.routing.tokenpilot import TokenPilotRouter
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
)
from tokenfleet.engine.kv_link import KVLink
from tokenfleet.errors import NoCandidateError


class _Prefixes:
    """Blocks this router sent to each instance, LRU-bounded (approximate)."""

    def __init__(self, capacity_blocks: int = 40_000) -> None:
        self.capacity = capacity_blocks
        self.held: dict[str, OrderedDict[int, None]] = {}

    def hit_tokens(self, inst: str, hashes: Sequence[int]) -> int:
        held = self.held.get(inst)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n * BLOCK_SIZE_TOKENS

    def add(self, inst: str, hashes: Sequence[int]) -> None:
        held = self.held.setdefault(inst, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)


#: the TPOT limit assumed for a tier that sets none (seconds)
DEFAULT_TPOT_S = 0.5


@ROUTERS.register("tokenpilot_pd")
class TokenPilotPDRouter(PDRouter):
    name = "tokenpilot_pd"
    #: its mixed pool is routed by TokenPilot, which reads the engines' KV events
    engines_publish_kv_events = True

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        link: KVLink | None = None,
        prefill_share: float = 0.0,
        role_period_s: float = 15.0,
        target_prefill_util: float = 0.8,
        decode_budget_frac: float = 0.5,
        shed_ttft_factor: float | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(link=link, prefill_share=prefill_share)
        self.slo = slo or SLOConfig()
        self.role_period_s = role_period_s
        self.target_prefill_util = target_prefill_util
        self.decode_budget_frac = decode_budget_frac
        #: reject (NoCandidateError: 503 at once) a request whose best predicted
        #: TTFT exceeds this many times its tier's limit; None: never
        self.shed_ttft_factor = shed_ttft_factor
        self._prefixes = _Prefixes()
        self._out_tokens: dict[str, float] = {}  # tier -> EWMA of observed outputs
        #: (t, prefill s, the tier's TPOT limit or None), of requests sent as
        #: long / short (a chunk step over / within the decode budget)
        self._long_log: deque[tuple[float, float, float | None]] = deque()
        self._short_log: deque[tuple[float, float, float | None]] = deque()
        self._next_plan_s = role_period_s
        self._pending_target: int | None = None
        #: routes while the pool is all mixed (see the module docstring)
        self.aggregated = TokenPilotRouter(seed)

    # -- predictions -------------------------------------------------------------
    def _expected_out(self, request: RequestInfo) -> float:
        return min(float(request.max_tokens), self._out_tokens.get(request.tier, 64.0))

    @staticmethod
    def _queue_s(inst: InstanceView) -> float:
        return inst.profile.prefill_time_s(max(0, inst.accounting.prefill_pending_uncached_tokens))

    def _tpot_s(self, inst: InstanceView, out_tokens: float, extra_prefill_tokens: int) -> float:
        """Mean step time over ``out_tokens`` decode steps: decode-only steps at
        the instance's batch, plus the chunk steps its pending prefills take."""
        acc = inst.accounting
        prof = inst.profile
        batch = acc.decoding_requests + acc.prefill_pending_requests + 1
        ctx = (acc.inflight_input_tokens / max(1, acc.inflight_requests)) + out_tokens / 2
        t_d = prof.decode_step_time_s(batch, ctx)
        pending = max(0, acc.prefill_pending_uncached_tokens) + extra_prefill_tokens
        if pending <= 0 or out_tokens <= 0:
            return t_d
        chunk = prof.max_num_batched_tokens
        k = min(out_tokens, math.ceil(pending / chunk))
        w = prof.prefill_time_s(pending)
        n = max(1.0, out_tokens)
        return (w + max(0.0, n - k) * t_d) / n

    # -- routing -----------------------------------------------------------------
    def route_pd(self, request: RequestInfo, pool: PoolSnapshot) -> PDDecision:
        if not split(pool.instances):
            return self._route_mixed(request, pool)
        insts = eligible(request, pool)
        tier_slo = self.slo.slo_for(request.tier)
        ttft_lim = tier_slo.ttft_limit_s(request.input_tokens) or 10.0
        tpot_lim = tier_slo.tpot_s or DEFAULT_TPOT_S
        out = self._expected_out(request)
        hashes = request.block_hashes
        prof = insts[0].profile
        budget_s = self._decode_budget_s(tpot_lim)
        best: tuple[float, float, PDDecision] | None = None

        hit = {i.instance_id: self._prefixes.hit_tokens(i.instance_id, hashes) for i in insts}
        pre = {}
        for i in insts:
            if i.role == DECODE:
                continue
            c = min(hit[i.instance_id], request.input_tokens - 1)
            pre[i.instance_id] = self._queue_s(i) + prof.prefill_time_s(request.input_tokens - c, c)
        for i in insts:  # aggregated
            if i.role == PREFILL:
                continue
            c = min(hit[i.instance_id], request.input_tokens - 1)
            own = request.input_tokens - c
            step = prof.prefill_time_s(min(own, prof.max_num_batched_tokens), c)
            if i.role == DECODE and step > budget_s:
                continue  # a long local prefill would stall the pool's decodes
            ttft = self._queue_s(i) + prof.prefill_time_s(own, c)
            tpot = self._tpot_s(i, out, 0)
            score = max(ttft / ttft_lim, tpot / tpot_lim)
            d = PDDecision(i.instance_id, None, c, ttft, tpot, "aggregated")
            if best is None or (score, ttft) < best[:2]:
                best = (score, ttft, d)
        dec = [i for i in insts if i.role in (DECODE, MIXED)]
        tpot_d = {i.instance_id: self._tpot_s(i, out, 0) for i in dec}
        for p in insts:  # disaggregated
            if p.role == DECODE:
                continue
            for d_inst in dec:
                if d_inst.instance_id == p.instance_id:
                    continue
                same = p.node == d_inst.node
                xfer = self.link.transfer_s(p.profile, request.input_tokens, same)
                tpot = tpot_d[d_inst.instance_id]
                ttft = pre[p.instance_id] + xfer + tpot
                score = max(ttft / ttft_lim, tpot / tpot_lim)
                if best is None or (score, ttft) < best[:2]:
                    c = min(hit[p.instance_id], request.input_tokens - 1)
                    best = (
                        score,
                        ttft,
                        PDDecision(
                            p.instance_id, d_inst.instance_id, c, ttft, tpot, "disaggregated"
                        ),
                    )
        if best is None:
            # roles leave no option among the instances shown (admission may show
            # a subset): the least-loaded one serves it aggregated
            i = min(insts, key=lambda v: (self._queue_s(v), v.accounting.inflight_requests))
            c = min(hit[i.instance_id], request.input_tokens - 1)
            best = (0.0, 0.0, PDDecision(i.instance_id, None, c, reason="aggregated: fallback"))
        decision = best[2]
        self._shed(request, decision.predicted_ttft_s)
        self._taken(request, pool, decision)
        return decision

    def _decode_budget_s(self, tpot_limit_s: float) -> float:
        """The chunk step a decode may ride with under ``tpot_limit_s``: a prompt
        whose own chunk step is longer is "long" (prefilled off the decode side)."""
        return self.decode_budget_frac * tpot_limit_s

    def _shed(self, request: RequestInfo, predicted_ttft_s: float | None) -> None:
        limit = self.slo.slo_for(request.tier).ttft_limit_s(request.input_tokens)
        if (
            self.shed_ttft_factor is not None
            and limit is not None
            and predicted_ttft_s is not None
            and predicted_ttft_s > self.shed_ttft_factor * limit
        ):
            raise NoCandidateError(
                f"predicted TTFT {predicted_ttft_s:.2f}s > "
                f"{self.shed_ttft_factor:g} x {limit:.2f}s on every instance; retry later"
            )

    def _taken(self, request: RequestInfo, pool: PoolSnapshot, decision: PDDecision) -> None:
        """What the role planner and the split pool's choices learn from a dispatch."""
        hashes = request.block_hashes
        self._prefixes.add(decision.prefill_instance_id, hashes)
        if decision.disaggregated:
            self._prefixes.add(str(decision.decode_instance_id), hashes)
        prof = pool.instances[0].profile
        tpot_lim = self.slo.slo_for(request.tier).tpot_s
        budget_s = self._decode_budget_s(tpot_lim or DEFAULT_TPOT_S)
        own_step = prof.prefill_time_s(min(request.input_tokens, prof.max_num_batched_tokens))
        log = self._long_log if own_step > budget_s else self._short_log
        log.append((pool.now_s, prof.prefill_time_s(request.input_tokens), tpot_lim))

    def _route_mixed(self, request: RequestInfo, pool: PoolSnapshot) -> PDDecision:
        """An all-mixed pool: TokenPilot's own choice (proposed, shed on its
        predicted TTFT like a split pool's, then taken)."""
        proposal = self.aggregated.propose(request, pool)
        self._shed(request, proposal.predicted_ttft_s)
        d = self.aggregated.commit(request)
        decision = PDDecision(
            d.instance_id,
            None,
            d.expected_cached_tokens,
            d.predicted_ttft_s,
            None,
            f"aggregated (mixed pool): {d.reason}",
        )
        self._taken(request, pool, decision)
        return decision

    def on_first_token(self, event: FirstTokenEvent) -> None:
        self.aggregated.on_first_token(event)

    def on_kv_event(self, event: KVEvent) -> None:
        self.aggregated.on_kv_event(event)

    # -- pools -------------------------------------------------------------------
    def initial_roles(self, n_instances: int) -> list[str]:
        if self.prefill_share > 0:
            return super().initial_roles(n_instances)
        return [MIXED] * n_instances

    def plan_roles(self, pool: PoolSnapshot) -> list[str] | None:
        now = pool.now_s
        if now < self._next_plan_s:
            return None
        self._next_plan_s = now + self.role_period_s
        window = self.role_period_s
        for log in (self._long_log, self._short_log):
            while log and log[0][0] < now - window:
                log.popleft()
        n = len(pool.instances)
        if n < 2:
            return None
        demand = sum(s for _, s, _ in self._long_log) / window  # instances busy prefilling
        # the short prompts stay on the decode side (local prefills): it keeps
        # room for them, or a split starves them of instances
        short = sum(s for _, s, _ in self._short_log) / window
        n_decode = max(1, math.ceil(short / self.target_prefill_util))
        # the prefill that TPOT-limited decodes would share instances with when
        # aggregated: work with no TPOT limit (batch) can keep to instances of
        # its own, as the per-request choice places it
        limited = [
            (s, lim)
            for log in (self._long_log, self._short_log)
            for _, s, lim in log
            if lim is not None
        ]
        load = sum(s for s, _ in limited) / window
        budget_s = self.decode_budget_frac * min((lim for _, lim in limited), default=0.5)
        current = sum(1 for i in pool.instances if i.role == PREFILL)
        if current > 0:
            budget_s /= 2  # a split pool goes back to mixed only well within budget
        if demand < 0.5 or self.aggregated_step_s(pool, load) <= budget_s:
            target = 0  # aggregation keeps the decodes within budget: no split
        else:
            target = max(1, min(n - n_decode, math.ceil(demand / self.target_prefill_util)))
        if target == current:
            self._pending_target = None
            return None
        if self._pending_target != target:  # hysteresis: wait for a second cycle
            self._pending_target = target
            return None
        step = 1 if target > current else -1
        if current == 0 and target > 0:
            step = target  # first split: all at once, from the measured demand
        new_p = current + step
        if new_p == 0:
            return [MIXED] * n
        return [PREFILL] * new_p + [DECODE] * (n - new_p)

    @staticmethod
    def aggregated_step_s(pool: PoolSnapshot, prefill_load: float) -> float:
        """A decode's mean step time if ``prefill_load`` instances' worth of
        prefill (seconds per second) were spread evenly over every instance of
        ``pool``, as an all-mixed pool runs it: each instance spends a share
        ``u`` of its time in chunk steps (a full chunk, ``t_c``) and the rest
        in decode-only steps (``t_d`` at the pool's mean decode batch), so a
        decode advances ``u / t_c + (1 - u) / t_d`` tokens per second."""
        insts = pool.instances
        n = len(insts)
        prof = insts[0].profile
        t_c = prof.prefill_time_s(prof.max_num_batched_tokens)
        u = prefill_load / n
        if u >= 1.0:
            return t_c
        decoding = sum(i.accounting.decoding_requests for i in insts)
        inflight = sum(i.accounting.inflight_requests for i in insts)
        ctx = sum(i.accounting.inflight_input_tokens for i in insts) / max(1, inflight)
        t_d = prof.decode_step_time_s(max(1, round(decoding / n)), ctx)
        return 1.0 / (u / t_c + (1.0 - u) / t_d)

    def on_complete(self, event: CompletionEvent) -> None:
        self.aggregated.on_complete(event)
        if event.status != "completed":
            return
        tier = event.request.tier
        old = self._out_tokens.get(tier)
        x = float(event.output_tokens)
        self._out_tokens[tier] = x if old is None else 0.95 * old + 0.05 * x


@ROUTERS.register("tokenpilot_pd_shed")
class TokenPilotPDShedRouter(TokenPilotPDRouter):
    """``tokenpilot_pd`` that sheds load: a request predicted to miss its TTFT
    limit on every option is refused at arrival (the client can retry or go
    elsewhere) instead of queueing and delaying the requests behind it."""

    name = "tokenpilot_pd_shed"

    def __init__(self, *, shed_ttft_factor: float | None = 1.0, **kwargs: Any) -> None:
        super().__init__(shed_ttft_factor=shed_ttft_factor, **kwargs)
