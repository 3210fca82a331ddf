"""TokenPilot: route each request to the instance with the lowest predicted TTFT.

Why seconds and not weighted scores: a cache hit and a queue are the same
currency (GPU prefill time), so comparing them in seconds needs no tuning.
For every candidate instance ``i``::

    cached_i  = reusable prefix we believe i holds (exact KV events, else the
                prefixes we saw prefilled there, else a speculative entry
                written when we routed a request with that prefix)
    own_i     = kappa * prefill(input - cached_i | cached_i)         [profile]
    queue_i   = max(own drain clock, scraped num_waiting * work/request
                    - time since scrape + own work dispatched since scrape)
    ttft_i    = (queue_i + own_i) * decode_inflation_i + half a decode step

and the request goes to the lowest ``ttft_i`` among instances whose KV
headroom holds the prompt plus the output reserve (a learned p90 output
length, capped by ``max_tokens``). ``kappa`` (one per engine profile) starts at 1 (the engine
profile) and is learned from observed/predicted TTFT, so a wrong profile
corrects itself. Near-ties (within a window that widens when scraped metrics
show other router replicas we cannot see) are broken at random, which is
what keeps N independent replicas from herding onto the same instance.

Decision cost: one walk over ``prompt blocks / stride`` probe hashes plus
O(1) work per instance.
"""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict, deque
from typing import Sequence

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.tokenpilot.cache import PrefixKnowledge
from tokenfleet.core.tokenpilot.estimators import (
    LogRatioCorrector,
    OutputLengthModel,
    PrefillModel,
    StepInflation,
)
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
    ScrapedMetrics,
)
from tokenfleet.engine.profiles import EngineProfile


class _Flight:
    """One of our requests, from dispatch to completion."""

    __slots__ = ("request", "instance_id", "dispatch_s", "work_s", "base_pred_s",
                 "cached_tokens", "kv_tokens", "probes", "prefilling", "blind", "ttft_s")

    def __init__(self, request: RequestInfo, instance_id: str, dispatch_s: float,
                 work_s: float, base_pred_s: float, cached_tokens: int,
                 kv_tokens: int, probes: tuple[int, ...], blind: bool) -> None:
        self.request = request
        self.instance_id = instance_id
        self.dispatch_s = dispatch_s
        self.work_s = work_s  # kappa-corrected prefill seconds of this request
        self.base_pred_s = base_pred_s  # predicted TTFT before kappa
        self.cached_tokens = cached_tokens
        self.kv_tokens = kv_tokens
        self.probes = probes
        self.prefilling = True
        # sent to the family's rendezvous instance without knowing its cache
        self.blind = blind
        self.ttft_s = 0.0


class _InstState:
    """This replica's model of one instance."""

    __slots__ = ("profile", "prefill", "inflation", "kappa", "drain_at_s", "pending",
                 "inflight", "mean_work_base_s", "since_scrape_s", "since_scrape_kv",
                 "scrape_seen_s", "cap_tokens", "spec_discount_tokens", "infl_factor",
                 "infl_wait_base_s", "decode_step_base_s", "rhash", "others_base_s",
                 "done_recent", "eng_busy_until_s", "last_queries", "last_hits",
                 "scrape_prev_s")

    def __init__(self, inst: InstanceView, prefill: PrefillModel,
                 inflation: StepInflation, kappa: LogRatioCorrector,
                 mean_work_base_s: float) -> None:
        self.profile = inst.profile
        self.prefill = prefill
        self.inflation = inflation
        self.kappa = kappa  # shared by every instance of the same profile
        self.drain_at_s = float("-inf")
        self.pending: OrderedDict[str, _Flight] = OrderedDict()  # no first token yet
        self.inflight: dict[str, _Flight] = {}
        self.mean_work_base_s = mean_work_base_s
        self.since_scrape_s = 0.0  # own prefill work dispatched after the last scrape
        self.since_scrape_kv = 0  # own KV tokens dispatched after the last scrape
        # other replicas' prefill work queued at the last scrape (profile seconds)
        self.others_base_s = 0.0
        self.done_recent: deque[tuple[float, float]] = deque()  # own (dispatch, finish)
        # When the prefill work the engine has admitted (all replicas) should be
        # done, from scraped prefix-cache query/hit counters: their difference
        # is the uncached prompt tokens admitted between scrapes.
        self.eng_busy_until_s = float("-inf")
        self.last_queries = -1
        self.last_hits = 0
        self.scrape_prev_s = float("-inf")
        self.scrape_seen_s = float("nan")
        self.cap_tokens = inst.kv_capacity_tokens or inst.profile.kv_capacity_tokens
        # A speculative holder is still prefilling: we get admitted alongside its
        # last chunk, so that chunk is not reusable yet (vLLM hashes full blocks
        # only once computed).
        self.spec_discount_tokens = inst.profile.max_num_batched_tokens // 2
        self.infl_factor = 1.0
        self.infl_wait_base_s = 0.0
        self.decode_step_base_s = 0.0
        # Stable across processes (str hashes are salted), so every replica ranks
        # instances for a prefix the same way.
        self.rhash = zlib.crc32(inst.instance_id.encode()) * 0x9E3779B97F4A7C15 & _MASK64


_MASK64 = (1 << 64) - 1
#: Prefix depth (engine blocks) that names a prompt "family" for rendezvous
#: hashing: 32 x 16 = 512 tokens, enough to tell system prompts apart while a
#: conversation's next turn keeps the same key.
_FAMILY_BLOCKS = 32


def _family_key(block_hashes: Sequence[int]) -> int:
    n = len(block_hashes)
    if n == 0:
        return 0
    return block_hashes[min(n, _FAMILY_BLOCKS) - 1] & _MASK64


@ROUTERS.register("tokenpilot")
class TokenPilotRouter(BaseRouter):
    """Predicted-TTFT router; see the module docstring for the cost model."""

    name = "tokenpilot"

    def __init__(
        self,
        seed: int = 0,
        *,
        stride_blocks: int = 16,
        speculative_ttl_s: float = 30.0,
        tie_abs_s: float = 0.002,
        tie_rel: float = 0.02,
        herd_window: float = 1.0,
        max_margin_s: float = 0.5,
        scraped_weight: float = 1.0,
        work_weight: float = 0.0,
        correction_step: float = 0.02,
        output_prior_tokens: int = 256,
        kv_safety: float = 0.95,
        ghost_threshold: float = 0.05,
        **_shared: object,
    ) -> None:
        # ``**_shared``: the simulator passes one kwargs dict to every policy.
        self._rng = random.Random(seed)
        self.knowledge = PrefixKnowledge(stride_blocks, speculative_ttl_s)
        self.outputs = OutputLengthModel(prior_tokens=output_prior_tokens)
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self.herd_window = herd_window
        self.max_margin_s = max_margin_s
        self.scraped_weight = scraped_weight
        self.work_weight = work_weight
        self.correction_step = correction_step
        self.kv_safety = kv_safety
        self.ghost_threshold = ghost_threshold
        self._states: dict[str, _InstState] = {}
        self._flights: dict[str, _Flight] = {}
        self._models: dict[int, tuple[EngineProfile, PrefillModel, StepInflation,
                                      LogRatioCorrector]] = {}
        self._mean_work_s = 0.3  # kappa-corrected, pool-wide, for the herd window
        self._mean_base_work_s = 0.3  # profile seconds of prefill per request
        self._f_prefill = 0.5  # share of in-flight requests still in prefill
        self._mean_input_tokens = 4096.0
        self.replicas_est = 1.0  # scraped load / own load: how many of us there are
        self.hit_realization = 1.0  # engine-reported cached / our expected cached
        # Hit fraction seen when routing blind to a family's rendezvous instance:
        # near 0 for a lone router, large when other replicas feed those caches.
        self.ghost_hit_frac = 0.0
        self._routed = 0

    # -- per-instance state ---------------------------------------------------
    def _state(self, inst: InstanceView) -> _InstState:
        st = self._states.get(inst.instance_id)
        if st is not None and st.profile is inst.profile:
            return st
        key = id(inst.profile)
        models = self._models.get(key)
        if models is None or models[0] is not inst.profile:
            models = (inst.profile, PrefillModel(inst.profile), StepInflation(inst.profile),
                      LogRatioCorrector(1.0, self.correction_step))
            self._models[key] = models
        base = models[1].seconds(4096)
        new = _InstState(inst, models[1], models[2], models[3], base)
        if st is not None:  # profile changed (redeploy): keep what we know in flight
            new.pending, new.inflight, new.drain_at_s = st.pending, st.inflight, st.drain_at_s
        self._states[inst.instance_id] = new
        self.knowledge.set_capacity(inst.instance_id, new.cap_tokens // BLOCK_SIZE_TOKENS)
        return new

    def _refresh_scrape(self, st: _InstState, m: ScrapedMetrics, mean_ctx: float) -> None:
        """New scrape: recount own work it cannot include, re-derive inflation."""
        at = m.scraped_at_s
        st.scrape_seen_s = at
        st.since_scrape_s = sum(f.work_s for f in st.pending.values() if f.dispatch_s > at)
        st.since_scrape_kv = sum(f.kv_tokens for f in st.inflight.values()
                                 if f.dispatch_s > at)
        if st.last_queries >= 0 and m.prefix_queries_total >= st.last_queries:
            du = (m.prefix_queries_total - st.last_queries) - (m.prefix_hits_total - st.last_hits)
            if du > 0:
                pm = st.prefill
                base = du * (pm.per_token_s + pm.per_pair_s * 0.5 * self._mean_input_tokens
                             + pm.overhead_s / pm.chunk_tokens)
                prev = st.scrape_prev_s
                start = st.eng_busy_until_s if st.eng_busy_until_s > prev else prev
                st.eng_busy_until_s = start + st.kappa.value * base
        st.last_queries = m.prefix_queries_total
        st.last_hits = m.prefix_hits_total
        st.scrape_prev_s = at
        # What the scrape counts that we did not send: other replicas' requests.
        done = st.done_recent
        while done and done[0][1] <= at:
            done.popleft()
        own_at = (sum(1 for f in st.inflight.values() if f.dispatch_s <= at)
                  + sum(1 for d, _ in done if d <= at))
        others = m.num_running + m.num_waiting - own_at
        st.others_base_s = (others * self._f_prefill * self._mean_base_work_s
                            if others > 0 else 0.0)
        decodes = max(0, m.num_running)
        st.infl_factor, st.infl_wait_base_s = st.inflation.get(decodes, mean_ctx)
        st.decode_step_base_s = 2.0 * st.infl_wait_base_s

    # -- routing ----------------------------------------------------------------
    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        now = pool.now_s
        know = self.knowledge
        know.expire(now)
        hashes = request.block_hashes
        probes = know.probes(hashes)
        confirmed, spec = know.match(hashes, probes)
        typical_out, reserve_out = self.outputs.estimate(request)
        n_in = request.input_tokens
        max_cached = max(0, (n_in - 1) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS)
        mean_ctx = n_in + 0.5 * typical_out
        realize = self.hit_realization
        model = request.model
        version = request.model_version
        sw = self.scraped_weight
        key = _family_key(hashes)

        ids: list[str] = []
        states: list[_InstState] = []
        metrics: list[ScrapedMetrics] = []
        queues: list[float] = []
        cached_l: list[int] = []
        scores: list[int] = []
        sum_scraped = 0
        sum_own = 0
        sum_pending = 0
        top = -1
        top_score = -1
        for inst in pool.instances:
            m = inst.metrics
            if (not inst.ready or not m.healthy
                    or (model != "default" and inst.model != model)
                    or (version and inst.model_version != version)
                    or (inst.max_model_len_tokens and n_in + 1 > inst.max_model_len_tokens)):
                continue
            iid = inst.instance_id
            st = self._states.get(iid)
            if st is None or st.profile is not inst.profile:
                st = self._state(inst)
            if m.scraped_at_s != st.scrape_seen_s:
                self._refresh_scrape(st, m, mean_ctx)
            # cache: exact/approximate beats speculative, which loses its last chunk
            c = confirmed.get(iid, 0) * BLOCK_SIZE_TOKENS if confirmed else 0
            if spec:
                cs = spec.get(iid, 0) * BLOCK_SIZE_TOKENS - st.spec_discount_tokens
                if cs > c:
                    c = cs
            if c > 0:
                c = int(c * realize)
                if c > max_cached:
                    c = max_cached
            else:
                c = 0
            # queue ahead, in seconds: own drain clock vs the scrape plus our
            # dispatches since (other replicas' work shows up only in the scrape)
            q = st.drain_at_s - now
            if q < 0.0:
                q = 0.0
            waiting = m.num_waiting
            if st.others_base_s:
                qo = st.others_base_s * st.kappa.value - (now - m.scraped_at_s)
                if qo > 0.0:
                    q += sw * qo
            eng = st.eng_busy_until_s
            if waiting or eng > now:
                # admitted prefill (every replica's) finishes, then the waiting ones
                start = eng if eng > m.scraped_at_s else m.scraped_at_s
                qs = start + waiting * st.mean_work_base_s * st.kappa.value - now
                if qs < 0.0:
                    qs = 0.0
                qs = sw * (qs + st.since_scrape_s)
                if qs > q:
                    q = qs
            score = ((key ^ st.rhash) * 0xBF58476D1CE4E5B9) & _MASK64
            if score > top_score:
                top_score = score
                top = len(ids)
            ids.append(iid)
            states.append(st)
            metrics.append(m)
            queues.append(q)
            cached_l.append(c)
            scores.append(score)
            sum_scraped += m.num_running + waiting
            acc = inst.accounting
            sum_own += acc.inflight_requests
            sum_pending += acc.prefill_pending_requests
        if not ids:
            eligible(request, pool)  # raises NoCandidateError with a helpful message
            raise AssertionError("unreachable")  # pragma: no cover
        # Replica estimate: scraped load counts every router, our accounting only us.
        if sum_own >= 4:
            ratio = sum_scraped / sum_own
            ratio = 1.0 if ratio < 1.0 else (64.0 if ratio > 64.0 else ratio)
            self.replicas_est += 0.05 * (ratio - self.replicas_est)
        if sum_own:
            self._f_prefill += 0.02 * (sum_pending / sum_own - self._f_prefill)
        # Another replica may have sent this prompt family to its rendezvous
        # instance: expect the hit fraction we have observed there before.
        blind = cached_l[top] == 0
        if blind and self.ghost_hit_frac > 0.01:
            cached_l[top] = (int(self.ghost_hit_frac * max_cached)
                             // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS)

        n = len(ids)
        costs = [0.0] * n
        preds = [0.0] * n
        fits_l = [True] * n
        best_fit = float("inf")
        any_fit = False
        ww = self.work_weight
        safety = self.kv_safety
        for j in range(n):
            st = states[j]
            c = cached_l[j]
            u = n_in - c
            kappa = st.kappa.value
            own = kappa * st.prefill.seconds(u, c)
            pred = (queues[j] + own) * st.infl_factor + kappa * st.infl_wait_base_s
            # KV headroom: prompt (uncached part) + reserved output must fit now,
            # after what we sent since the scrape and the decodes' expected growth.
            m = metrics[j]
            free = (st.cap_tokens * (1.0 - m.kv_usage) * safety - st.since_scrape_kv
                    - m.num_running * 0.5 * typical_out)
            need = u + reserve_out
            if need > free:
                fits_l[j] = False
                # If nobody fits, rank by how long the deficit takes to drain.
                deficit = (need - free) / max(1.0, need)
                pred += kappa * deficit * typical_out * max(st.decode_step_base_s, 0.01)
            cost = pred + ww * own if ww else pred
            costs[j] = cost
            preds[j] = pred
            if fits_l[j]:
                any_fit = True
                if cost < best_fit:
                    best_fit = cost
        if not any_fit:
            best_fit = min(costs)
        herd = self.herd_window * (1.0 - 1.0 / self.replicas_est) * self._mean_work_s
        window = self.tie_abs_s + self.tie_rel * best_fit + herd
        if window > self.max_margin_s:
            window = self.max_margin_s
        limit = best_fit + window
        # Tie-break among the near-best. Rendezvous order makes replicas agree
        # on a prompt family's instance without talking (and spreads distinct
        # families), but for one-off prompts it balances no better than random.
        # Fewest own requests in flight keeps each replica's stream even, so
        # the sum over replicas is smooth. Use rendezvous when blind routing to
        # it has been paying off (another replica's cache was there), and for a
        # fixed quarter of families always, so that payoff keeps being measured.
        rendezvous = self.ghost_hit_frac > self.ghost_threshold or (key >> 7) & 3 == 0
        j = -1
        if rendezvous:
            js = -1
            for k in range(n):
                if costs[k] <= limit and (fits_l[k] or not any_fit) and scores[k] > js:
                    j, js = k, scores[k]
        else:
            best_key = (1 << 62, 0)
            for k in range(n):
                if costs[k] <= limit and (fits_l[k] or not any_fit):
                    key_k = (len(states[k].inflight), -scores[k])
                    if key_k < best_key:
                        j, best_key = k, key_k
        return self._dispatch(request, pool, ids[j], states[j], preds[j], cached_l[j],
                              probes, reserve_out, blind and j == top)

    def _dispatch(self, request: RequestInfo, pool: PoolSnapshot, iid: str,
                  st: _InstState, pred: float, cached: int, probes: tuple[int, ...],
                  reserve_out: int, blind: bool) -> RouteDecision:
        now = pool.now_s
        kappa = st.kappa.value
        base_own = st.prefill.seconds(request.input_tokens - cached, cached)
        work = kappa * base_own
        kv = request.input_tokens - cached + reserve_out
        flight = _Flight(request, iid, now, work, pred / kappa, cached, kv, probes, blind)
        rid = request.request_id
        self._flights[rid] = flight
        st.pending[rid] = flight
        st.inflight[rid] = flight
        st.drain_at_s = (st.drain_at_s if st.drain_at_s > now else now) + work
        if now > st.scrape_seen_s or st.scrape_seen_s != st.scrape_seen_s:
            st.since_scrape_s += work
            st.since_scrape_kv += kv
        st.mean_work_base_s += 0.1 * (base_own - st.mean_work_base_s)
        self._mean_work_s += 0.05 * (work - self._mean_work_s)
        self._mean_base_work_s += 0.05 * (base_own - self._mean_base_work_s)
        self._mean_input_tokens += 0.05 * (request.input_tokens - self._mean_input_tokens)
        self.knowledge.speculate(iid, probes, now)
        self._routed += 1
        return RouteDecision(
            instance_id=iid,
            expected_cached_tokens=cached,
            predicted_ttft_s=pred,
            reason=f"tokenpilot ttft={pred:.3f}s cached={cached}",
        )

    # -- learning from what a live router observes --------------------------------
    def _end_prefill(self, flight: _Flight, now_s: float, st: _InstState) -> None:
        """Drop a request from the instance's prefill queue and re-anchor the clock."""
        rid = flight.request.request_id
        flight.prefilling = False
        after = 0.0
        seen = False
        for other_id, other in st.pending.items():
            if seen:
                after += other.work_s
            elif other_id == rid:
                seen = True
        st.pending.pop(rid, None)
        if seen:
            # FCFS: whatever we sent after it is all that is left of our queue.
            st.drain_at_s = now_s + after
        if flight.dispatch_s > st.scrape_seen_s or st.scrape_seen_s != st.scrape_seen_s:
            st.since_scrape_s = max(0.0, st.since_scrape_s - flight.work_s)

    def on_first_token(self, event: FirstTokenEvent) -> None:
        flight = self._flights.get(event.request.request_id)
        if flight is None or not flight.prefilling:
            return
        st = self._states.get(flight.instance_id)
        if st is None:
            return
        self._end_prefill(flight, event.now_s, st)
        flight.ttft_s = event.ttft_s  # kappa learns at completion, see on_complete
        self.knowledge.unspeculate(flight.instance_id, flight.probes)
        self.knowledge.confirm(flight.instance_id, flight.request.block_hashes)

    def on_complete(self, event: CompletionEvent) -> None:
        rid = event.request.request_id
        flight = self._flights.pop(rid, None)
        if event.status == "completed":
            self.outputs.observe(event.request.tenant, event.request.task_type,
                                 event.output_tokens)
        if flight is None:
            return
        st = self._states.get(flight.instance_id)
        if st is not None:
            if flight.prefilling:
                self._end_prefill(flight, event.now_s, st)
                self.knowledge.unspeculate(flight.instance_id, flight.probes)
            st.inflight.pop(rid, None)
            st.done_recent.append((flight.dispatch_s, event.now_s))
            # Learn the rate only when our cache guess was right: a surprise hit
            # or miss is a cache-knowledge error, not a wrong profile.
            miss = abs(event.cached_tokens - flight.cached_tokens)
            if (event.status == "completed" and flight.ttft_s > 0.0 and flight.base_pred_s > 0.0
                    and miss <= 0.1 * flight.request.input_tokens + 2 * BLOCK_SIZE_TOKENS):
                st.kappa.update(flight.ttft_s / flight.base_pred_s)
            if flight.dispatch_s > st.scrape_seen_s:
                st.since_scrape_kv = max(0, st.since_scrape_kv - flight.kv_tokens)
        if flight.blind and event.status == "completed":
            n_in = max(1, flight.request.input_tokens - 1)
            self.ghost_hit_frac += 0.05 * (min(1.0, event.cached_tokens / n_in)
                                           - self.ghost_hit_frac)
        elif flight.cached_tokens >= BLOCK_SIZE_TOKENS and event.status == "completed":
            got = min(1.0, event.cached_tokens / flight.cached_tokens)
            self.hit_realization += 0.02 * (got - self.hit_realization)
            if self.hit_realization < 0.3:
                self.hit_realization = 0.3

    def on_kv_event(self, event: KVEvent) -> None:
        if event.kind == "stored":
            self.knowledge.stored(event.instance_id, event.block_hashes)
        elif event.kind == "removed":
            self.knowledge.removed(event.instance_id, event.block_hashes)
        elif event.kind == "cleared":
            self.knowledge.cleared(event.instance_id)

    # -- introspection for tests and dashboards -----------------------------------
    def kappa(self, instance_id: str) -> float:
        st = self._states.get(instance_id)
        return st.kappa.value if st is not None else 1.0

    def queue_s(self, instance_id: str, now_s: float) -> float:
        st = self._states.get(instance_id)
        return max(0.0, st.drain_at_s - now_s) if st is not None else 0.0

    def states(self) -> Sequence[str]:
        return list(self._states)
