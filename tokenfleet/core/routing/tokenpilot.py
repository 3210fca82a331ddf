"""TokenPilot: route each request to the instance with the lowest predicted TTFT.

Why seconds and not weighted scores: a cache hit and a queue are the same
currency (GPU prefill time), so comparing them in seconds needs no tuning.
For every candidate instance ``i``::

    cached_i  = reusable prefix we believe i holds (exact KV events, else the
                prefixes we saw prefilled there, else a speculative entry
                written when we routed a request with that prefix)
    own_i     = kappa * prefill(input - cached_i | cached_i)        [profile]
    queue_i   = max(own drain clock,
                    scraped work: prefill the engine admitted (scraped prefix
                    query/hit counters) + waiting requests, then our own
                    dispatches since the scrape, each from its send time)
    ttft_i    = (queue_i + own_i) * decode_inflation_i + half a decode step

and the request goes to the lowest ``ttft_i`` among instances whose KV
headroom holds the uncached prompt plus the output reserve (a learned p90
output length, capped by ``max_tokens``). ``kappa`` (one per engine profile)
starts at 1 and is learned from observed/predicted TTFT, so a wrong profile
corrects itself.

Near-ties (a window that widens by the work router replicas we cannot see
may have sent since the last scrape) are broken towards the prompt family's
rendezvous-hash instance when blind routing there has been finding caches
other replicas filled, and towards the instance with fewest of our own
requests in flight otherwise. A request that names its conversation in
OpenAI's ``prompt_cache_key`` (the field OpenAI asks clients to set so
requests sharing a prefix route together) is its own family, so replicas
agree on each conversation's instance instead of sending every conversation
that shares a system prompt to one instance.

Decision cost: one walk over ``prompt blocks / stride`` probe hashes plus a
few dozen bytecodes per instance; everything that changes only on a scrape
or a dispatch is precomputed then.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from collections.abc import Sequence

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.tokenpilot.cache import PrefixKnowledge
from tokenfleet.core.tokenpilot.estimators import (
    LogRatioCorrector,
    OutputLengthModel,
    PrefillModel,
    StepInflation,
)
from tokenfleet.core.tokenpilot.tiers import HostTierKnowledge
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

_MASK64 = (1 << 64) - 1
#: Prefix depth (engine blocks) that names a prompt "family" for rendezvous
#: hashing: 32 x 16 = 512 tokens, enough to tell system prompts apart while a
#: conversation's next turn keeps the same key.
_FAMILY_BLOCKS = 32


def _conversation_key(name: str) -> int:
    """A rendezvous key every replica computes alike (no per-process str salt)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 16


def _family_key(block_hashes: Sequence[int]) -> int:
    n = len(block_hashes)
    if n == 0:
        return 0
    # Fibonacci hashing: engine hashes need not be well mixed in the low bits.
    return ((block_hashes[min(n, _FAMILY_BLOCKS) - 1] * 0x9E3779B97F4A7C15) & _MASK64) >> 16


class _Flight:
    """One of our requests, from dispatch to completion."""

    __slots__ = (
        "request",
        "instance_id",
        "dispatch_s",
        "work_s",
        "base_pred_s",
        "cached_tokens",
        "kv_tokens",
        "probes",
        "prefilling",
        "blind",
        "ttft_s",
        "ticket",
    )

    def __init__(
        self,
        request: RequestInfo,
        instance_id: str,
        dispatch_s: float,
        work_s: float,
        base_pred_s: float,
        cached_tokens: int,
        kv_tokens: int,
        probes: tuple[int, ...],
        blind: bool,
    ) -> None:
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
        self.ticket = 0  # speculative cache entry, dropped at the first token


#: what ``_choose`` picked, the arguments of ``_dispatch``:
#: (request, now, state, predicted TTFT, cached tokens, probes, reserved output, blind)
_Choice = tuple[RequestInfo, float, "_InstState", float, int, tuple[int, ...], int, bool]


class _InstState:
    """This replica's model of one instance; scrape-derived parts are absolute times."""

    __slots__ = (
        "instance_id",
        "profile",
        "prefill",
        "inflation",
        "kappa",
        "drain_at_s",
        "pending",
        "inflight",
        "mean_work_base_s",
        "since_done_at_s",
        "since_scrape_kv",
        "scrape_seen_s",
        "scrape_prev_s",
        "scraped_done_at_s",
        "eng_busy_until_s",
        "last_queries",
        "last_hits",
        "last_external_hits",
        "scraped_load",
        "free_kv_tokens",
        "cap_tokens",
        "own_uncached_tokens",
        "pending_token_s",
        "dispatched",
        "infl_factor",
        "infl_wait_s",
        "decode_step_s",
        "last_dispatch_s",
        "stamp",
        "slot",
        "pos",
        "last_running",
        "last_kappa",
        "ties_load",
    )

    def __init__(
        self,
        inst: InstanceView,
        prefill: PrefillModel,
        inflation: StepInflation,
        kappa: LogRatioCorrector,
    ) -> None:
        self.instance_id = inst.instance_id
        self.profile = inst.profile
        self.prefill = prefill
        self.inflation = inflation
        self.kappa = kappa  # shared by every instance of the same profile
        self.drain_at_s = float("-inf")  # when our own queued prefill should be done
        self.pending: OrderedDict[str, _Flight] = OrderedDict()  # no first token yet
        self.inflight: dict[str, _Flight] = {}
        self.mean_work_base_s = prefill.seconds(4096)
        # when the work the last scrape showed, then our own prefills dispatched
        # after it (each starting no earlier than its dispatch), should be done
        self.since_done_at_s = float("-inf")
        self.since_scrape_kv = 0  # own KV tokens dispatched after the last scrape
        self.scrape_seen_s = float("nan")
        self.scrape_prev_s = float("-inf")
        # When the work the last scrape showed (every replica's) should be done:
        # the prefill the engine admitted (prefix-cache query minus hit counters
        # between scrapes: the uncached prompt tokens admitted), then the waiting.
        self.scraped_done_at_s = float("-inf")
        self.eng_busy_until_s = float("-inf")
        self.last_queries = -1
        self.last_hits = 0
        self.last_external_hits = 0
        self.scraped_load = 0  # running + waiting at the last scrape
        # uncached prompt tokens of our requests with no first token yet: what
        # our share of the dispatch accounting's prefill_pending_uncached_tokens is
        self.own_uncached_tokens = 0
        self.dispatched = 0  # requests we sent here: the accounting shows more if shared
        # prefill seconds per uncached token of a typical queued prompt
        self.pending_token_s = prefill.per_token_s + prefill.overhead_s / prefill.chunk_tokens
        self.free_kv_tokens = 0.0
        self.cap_tokens = inst.kv_capacity_tokens or inst.profile.kv_capacity_tokens
        self.infl_factor = 1.0
        self.infl_wait_s = 0.0
        self.decode_step_s = 0.01
        self.last_dispatch_s = float("-inf")
        self.stamp = 0  # route() call that last listed this instance as a candidate
        self.slot = 0  # its index in that call's candidate lists
        self.pos = inst.index  # position in the pool, for rendezvous order
        self.last_running = -1
        self.last_kappa = 0.0
        self.ties_load = 0


@ROUTERS.register("tokenpilot")
class TokenPilotRouter(BaseRouter):
    """Predicted-TTFT router; see the module docstring for the cost model."""

    name = "tokenpilot"
    #: TokenFleet's own deployment relays engine KV events to every API
    #: replica's TokenPilot: ``tokenfleet up`` starts each engine with a KV
    #: event endpoint and its worker with ``--kv-events`` (``cli/commands/up.py``),
    #: and ``--engine URL,kv=ENDPOINT`` does the same for real vLLM engines. So
    #: the simulator's shipped defaults give TokenPilot engine events too.
    engines_publish_kv_events = True

    def __init__(
        self,
        seed: int = 0,
        *,
        stride_blocks: int = 32,
        speculative_ttl_s: float = 30.0,
        tie_abs_s: float = 0.002,
        tie_rel: float = 0.02,
        herd_window: float = 0.5,
        max_margin_s: float = 0.5,
        correction_step: float = 0.02,
        output_prior_tokens: int = 256,
        kv_safety: float = 0.95,
        ghost_threshold: float = 0.05,
        rendezvous_share: float = 0.25,
        conversation_keys: bool = True,
        full_scan_max: int = 256,
        refresh_per_call: int = 16,
        sample_size: int = 64,
        **_shared: object,
    ) -> None:
        # ``**_shared``: the simulator passes one kwargs dict to every policy.
        self._rng = random.Random(seed)
        self.knowledge = PrefixKnowledge(stride_blocks, speculative_ttl_s)
        self.host_tier = HostTierKnowledge(stride_blocks)  # priced hits: tiers.py
        self.outputs = OutputLengthModel(prior_tokens=output_prior_tokens)
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self.herd_window = herd_window
        self.max_margin_s = max_margin_s
        self.correction_step = correction_step
        self.kv_safety = kv_safety
        self.ghost_threshold = ghost_threshold
        self._rendezvous_cut = int(round(64 * rendezvous_share))
        self.conversation_keys = conversation_keys
        self.full_scan_max = full_scan_max
        self.refresh_per_call = max(1, refresh_per_call)
        self.sample_size = sample_size
        # last blocks of the engine's newest BlockStored runs, per instance: the
        # tips of prefills (and decodes) under way there
        self._tips: dict[str, tuple[int, ...]] = {}
        self._by_id: dict[str, InstanceView] = {}
        self._stamp = 0
        self._states: dict[str, _InstState] = {}
        self._flights: dict[str, _Flight] = {}
        self._models: dict[
            int, tuple[EngineProfile, PrefillModel, StepInflation, LogRatioCorrector]
        ] = {}
        self._mean_work_s = 0.3  # kappa-corrected, pool-wide, for the herd window
        self._gap_s = 1.0  # mean seconds between our dispatches (EWMA)
        self._last_route_s = math.nan
        self._scrape_at_s = -math.inf  # newest scrape absorbed
        self._mean_input_tokens = 4096.0
        self._typical_out = float(output_prior_tokens)
        self._scraped_total = 0  # sum of scraped_load over instances
        self.replicas_est = 1.0  # scraped load / own load: how many of us there are
        self._proposed: tuple[str, _Choice] | None = None
        self.hit_realization = 1.0  # engine-reported cached / our expected cached
        # Hit fraction seen when routing blind to a family's rendezvous instance:
        # near 0 for a lone router, large when other replicas feed those caches.
        self.ghost_hit_frac = 0.0

    # -- per-instance state ---------------------------------------------------
    def _sync(self, inst: InstanceView) -> _InstState:
        """Slow path: first sight of an instance, a new profile, or a new scrape."""
        iid = inst.instance_id
        st = self._states.get(iid)
        if st is None or st.profile is not inst.profile:
            key = id(inst.profile)
            models = self._models.get(key)
            if models is None or models[0] is not inst.profile:
                models = (
                    inst.profile,
                    PrefillModel(inst.profile),
                    StepInflation(inst.profile),
                    LogRatioCorrector(1.0, self.correction_step),
                )
                self._models[key] = models
            new = _InstState(inst, models[1], models[2], models[3])
            if st is not None:  # profile changed (redeploy): keep what is in flight
                new.pending, new.inflight, new.drain_at_s = st.pending, st.inflight, st.drain_at_s
                new.own_uncached_tokens = st.own_uncached_tokens
                new.dispatched = st.dispatched
                self._scraped_total -= st.scraped_load
            self._states[iid] = new
            self.knowledge.set_capacity(iid, new.cap_tokens // BLOCK_SIZE_TOKENS)
            self.host_tier.set_instance(iid, inst.profile)
            st = new
        m = inst.metrics
        if m.scraped_at_s != st.scrape_seen_s:
            self._refresh_scrape(st, m)
        return st

    def _refresh_scrape(self, st: _InstState, m: ScrapedMetrics) -> None:
        """New scrape: recount own work it cannot include, re-derive the rest."""
        at = m.scraped_at_s
        st.scrape_seen_s = at
        if at > self._scrape_at_s:
            self._scrape_at_s = at
        if st.last_dispatch_s > at:
            st.since_scrape_kv = sum(f.kv_tokens for f in st.inflight.values() if f.dispatch_s > at)
        else:  # the common case: nothing sent since this scrape was taken
            st.since_scrape_kv = 0
        kappa = st.kappa.value
        queries = m.prefix_queries_total
        if queries != st.last_queries and st.last_queries >= 0 and queries > st.last_queries:
            # prompt tokens the engine admitted less what it did not compute:
            # GPU prefix hits and KV a connector loaded (the host tier), which
            # vLLM counts as queried but not hit; without the latter a
            # returning conversation's host hit looked like its whole prefill
            du = (
                (queries - st.last_queries)
                - (m.prefix_hits_total - st.last_hits)
                - (m.external_hits_total - st.last_external_hits)
            )
            if du > 0:
                pm = st.prefill
                base = du * (
                    pm.per_token_s
                    + pm.per_pair_s * 0.5 * self._mean_input_tokens
                    + pm.overhead_s / pm.chunk_tokens
                )
                prev = st.scrape_prev_s
                start = st.eng_busy_until_s if st.eng_busy_until_s > prev else prev
                st.eng_busy_until_s = start + kappa * base
        st.last_queries = m.prefix_queries_total
        st.last_hits = m.prefix_hits_total
        st.last_external_hits = m.external_hits_total
        st.scrape_prev_s = at
        start = st.eng_busy_until_s if st.eng_busy_until_s > at else at
        st.scraped_done_at_s = start + m.num_waiting * st.mean_work_base_s * kappa
        self._chain_since_scrape(st)
        load = m.num_running + m.num_waiting
        self._scraped_total += load - st.scraped_load
        st.scraped_load = load
        st.free_kv_tokens = (
            st.cap_tokens * (1.0 - m.kv_usage) * self.kv_safety
            - st.since_scrape_kv
            - m.num_running * 0.5 * self._typical_out
        )
        running = m.num_running
        if running != st.last_running or kappa != st.last_kappa:
            st.last_running = running
            st.last_kappa = kappa
            ctx = self._mean_input_tokens + 0.5 * self._typical_out
            factor, wait = st.inflation.get(max(0, running), ctx)
            st.infl_factor = factor
            st.infl_wait_s = kappa * wait
            st.decode_step_s = max(0.01, 2.0 * kappa * wait)

    @staticmethod
    def _chain_since_scrape(st: _InstState) -> None:
        """Our prefills sent after the last scrape, queued behind the work it
        showed, each from its own send time on (``pending`` is in send order)."""
        at = st.scrape_seen_s
        done = st.scraped_done_at_s
        if st.last_dispatch_s > at:
            for f in st.pending.values():
                if f.dispatch_s > at:
                    done = (done if done > f.dispatch_s else f.dispatch_s) + f.work_s
        st.since_done_at_s = done

    # -- routing ----------------------------------------------------------------
    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        return self._dispatch(*self._choose(request, pool))

    def propose(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        """The decision ``route`` would make, not yet taken: the driver may
        book it, learn the chosen instance's current shared accounting from
        the booking's reply, and propose again on a snapshot that has it
        (``TwoPhaseRouter``). ``commit`` takes the last proposal."""
        choice = self._choose(request, pool)
        self._proposed = (request.request_id, choice)
        st, pred, cached = choice[2], choice[3], choice[4]
        return RouteDecision(st.instance_id, cached, pred, "proposed")

    def commit(self, request: RequestInfo) -> RouteDecision:
        proposed = self._proposed
        if proposed is None or proposed[0] != request.request_id:
            raise RuntimeError(f"commit({request.request_id!r}) without its propose()")
        self._proposed = None
        return self._dispatch(*proposed[1])

    def _choose(self, request: RequestInfo, pool: PoolSnapshot) -> _Choice:
        """Score every candidate and pick one; changes only learned estimates
        (the replica count, absorbed scrapes), never the booked state."""
        now = pool.now_s
        know = self.knowledge
        know.expire(now)
        hashes = request.block_hashes
        probes = know.probes(hashes)
        confirmed, spec = know.match(probes)
        typical_out, reserve_out = self.outputs.estimate(request)
        n_in = request.input_tokens
        max_cached = max(0, (n_in - 1) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS)
        key = _family_key(hashes)
        if request.prompt_cache_key and self.conversation_keys:
            key = _conversation_key(request.prompt_cache_key)
        if confirmed and self._tips:
            confirmed = self._growing(confirmed, hashes, spec)
        hits = self._expected_hits(confirmed, spec, max_cached) if confirmed or spec else None
        loads = None  # host-tier hits: seconds of transfer per instance
        if self.host_tier.enabled:
            hits, loads = self.host_tier.price(probes, hits, max_cached)
        model = request.model
        version = request.model_version
        check_model = model != "default" or bool(version)
        need0 = n_in + reserve_out
        states_get = self._states.get

        states: list[_InstState] = []
        costs: list[float] = []
        fits: list[bool] = []
        queues: list[float] = []
        p0: PrefillModel | None = None
        k0: LogRatioCorrector | None = None
        own0 = 0.0
        best = math.inf
        any_fit = False
        # Rendezvous order of this prompt family: pool positions starting at
        # key mod N. Replicas see the same pool, so they agree on it; O(1).
        instances = pool.instances
        n_pool = len(instances)
        home = key % n_pool if n_pool else 0
        if n_pool > self.full_scan_max:
            instances = self._sample(instances, hits, home)
        stamp = self._stamp = self._stamp + 1
        refresh_budget = self.refresh_per_call
        seen_elsewhere = 0  # other replicas' requests the shared accounting shows us
        for inst in instances:
            m = inst.metrics
            if not inst.ready or not m.healthy:
                continue
            if check_model and (
                (model != "default" and inst.model != model)
                or (version and inst.model_version != version)
            ):
                continue
            ml = inst.max_model_len_tokens
            if ml and n_in >= ml:
                continue
            st = states_get(inst.instance_id)
            if st is None or st.profile is not inst.profile:
                st = self._sync(inst)
            elif m.scraped_at_s != st.scrape_seen_s and refresh_budget:
                # A new scrape is absorbed over a few decisions, so no single
                # decision pays for the whole pool; the rest wait one call.
                refresh_budget -= 1
                self._refresh_scrape(st, m)
            # Queue ahead, in seconds: our own drain clock, or what the scrape
            # showed (every replica's work) followed by our dispatches since.
            # Those started at their dispatch at the earliest, not now: counted
            # from now, a prefill sent 0.3 s after a scrape still looked queued
            # in full until the next scrape (up to its 0.5 s period live), and
            # requests left the instance holding their prefix for nothing.
            x = st.since_done_at_s
            if x < now:
                x = now
            d = st.drain_at_s
            acc = inst.accounting
            if acc.dispatched_total > st.dispatched:
                # Replicas share dispatch accounting (the live API replicas'
                # Redis view): the others' queued prefill runs before ours too
                # (FCFS), known as of the last refresh.
                seen_elsewhere += acc.inflight_requests - len(st.inflight)
                others = acc.prefill_pending_uncached_tokens - st.own_uncached_tokens
                if others > 0:
                    d = (d if d > now else now) + st.kappa.value * others * st.pending_token_s
                # ties break by every replica's requests in flight, as one router's do
                st.ties_load = acc.inflight_requests
            else:
                st.ties_load = len(st.inflight)
            q = (d if d > x else x) - now
            c = hits.get(inst.instance_id, 0) if hits else 0
            if c:
                own = st.kappa.value * st.prefill.seconds(n_in - c, c)
                if loads:
                    own += loads.get(inst.instance_id, 0.0)
            else:
                if st.prefill is not p0 or st.kappa is not k0:
                    p0, k0 = st.prefill, st.kappa
                    own0 = k0.value * p0.seconds(n_in, 0)
                own = own0
            cost = (q + own) * st.infl_factor + st.infl_wait_s
            if need0 - c > st.free_kv_tokens:
                cost += self._kv_wait_s(st, need0 - c, typical_out)
                fits.append(False)
            else:
                fits.append(True)
                any_fit = True
                if cost < best:
                    best = cost
            st.stamp = stamp
            st.slot = len(states)
            states.append(st)
            costs.append(cost)
            queues.append(q)
        n = len(states)
        if n == 0:
            eligible(request, pool)  # raises NoCandidateError with a helpful message
            raise AssertionError("unreachable")  # pragma: no cover
        if not any_fit:  # nobody has KV headroom: rank by cost plus the KV wait
            best = min(costs)
            fits = [True] * n
        # Replica estimate: scraped load counts every router, our flights (plus
        # what shared accounting shows of the others') only what we can see.
        own_total = len(self._flights) + (seen_elsewhere if seen_elsewhere > 0 else 0)
        if own_total >= 4:
            ratio = self._scraped_total / own_total
            # Clamped only above: clamping each sample at 1 biased a lone
            # router's estimate to ~1.02-1.05, a herd window with nobody unseen.
            ratio = 64.0 if ratio > 64.0 else ratio
            self.replicas_est += 0.05 * (ratio - self.replicas_est)
        # The family's rendezvous instance: the first candidate at or after
        # position key mod N. Another replica may have sent this family there:
        # expect the hit fraction we have observed when routing blind to it.
        top = self._home_slot(pool.instances, home, stamp)
        if hits:
            hits = dict(hits)
        else:
            hits = {}
        blind = hits.get(states[top].instance_id, 0) == 0
        if blind and self.ghost_hit_frac > 0.01:
            st = states[top]
            c = int(self.ghost_hit_frac * max_cached) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
            own = st.kappa.value * st.prefill.seconds(n_in - c, c)
            cost = (queues[top] + own) * st.infl_factor + st.infl_wait_s
            if fits[top] or not any_fit:
                hits[st.instance_id] = c
                costs[top] = cost
                if cost < best:
                    best = cost
        # Herd term: the work other replicas (that we cannot see) are expected
        # to have sent since the scrape, (R - 1) x our dispatch rate x the
        # scrape's age, is what might sit unseen on the instance that looks
        # best to all of us; candidates within that much of it are as good.
        # Only part of it lands there (the others spread theirs too), and
        # every instance taken as a tie throws away a known hit or a shorter
        # queue, so independent replicas (R >= 1.5) count ``herd_window`` of
        # it. Below that R is a lone router's estimate (0.93-1.05), or that
        # of replicas that see each other's dispatches through shared
        # accounting: their small window keeps full weight, as before
        # (docs/benchmarks.md section 8, *Fifth round*).
        age = now - self._scrape_at_s
        rr = self.replicas_est if self.replicas_est > 1.0 else 1.0
        unseen = (rr - 1.0) * age / self._gap_s if age > 0.0 else 0.0
        cap = 1.0 - 1.0 / rr  # the old, fixed herd term's share
        if unseen > cap:
            unseen = cap
        herd = (self.herd_window if rr >= 1.5 else 1.0) * unseen * self._mean_work_s
        window = self.tie_abs_s + self.tie_rel * best + herd
        if window > self.max_margin_s:
            window = self.max_margin_s
        limit = best + window
        # Tie-break among the near-best. Rendezvous order makes replicas agree
        # on a prompt family's instance without talking (and spreads distinct
        # families), but for one-off prompts it balances no better than random.
        # Fewest own requests in flight keeps each replica's stream even, so
        # the sum over replicas is smooth. Use rendezvous when blind routing to
        # it has been paying off (another replica's cache was there), and for a
        # fixed share of families always, so that payoff keeps being measured.
        rendezvous = (
            self.ghost_hit_frac > self.ghost_threshold or ((key >> 7) & 63) < self._rendezvous_cut
        )
        j = -1
        jr = n_pool
        if rendezvous:
            for k in range(n):
                if fits[k] and costs[k] <= limit:
                    rank = (states[k].pos - home) % n_pool
                    if rank < jr:
                        j, jr = k, rank
        else:
            jl = 1 << 62
            for k in range(n):
                if fits[k] and costs[k] <= limit:
                    load = states[k].ties_load
                    if load <= jl:
                        rank = (states[k].pos - home) % n_pool
                        if load < jl or rank < jr:
                            j, jl, jr = k, load, rank
        st = states[j]
        c = hits.get(st.instance_id, 0)
        load_s = loads.get(st.instance_id, 0.0) if loads else 0.0
        pred = (
            queues[j] + st.kappa.value * st.prefill.seconds(n_in - c, c) + load_s
        ) * st.infl_factor + st.infl_wait_s
        return (request, now, st, pred, c, probes, reserve_out, blind and j == top)

    def _growing(
        self, confirmed: dict[str, int], hashes: Sequence[int], spec: dict[str, int]
    ) -> dict[str, int]:
        """An instance whose newest stored blocks are where our visible prefix
        ends is computing this prefix now (another replica's request, as our
        own speculative entry would say): expect all of it, as for our own."""
        s = self.knowledge.stride_blocks
        n = len(hashes)
        out = confirmed
        for iid, blocks in confirmed.items():
            if blocks + s >= n or spec.get(iid, 0) > blocks:
                continue
            tips = self._tips.get(iid)
            if not tips:
                continue
            window = hashes[blocks - s if blocks > s else 0 : blocks + s]
            for t in tips:
                if t in window:
                    if out is confirmed:
                        out = dict(confirmed)
                    out[iid] = n
                    break
        return out

    def _home_slot(self, instances: Sequence[InstanceView], home: int, stamp: int) -> int:
        """Slot of the first candidate at or after pool position ``home``."""
        n = len(instances)
        get = self._states.get
        for k in range(n):
            st = get(instances[(home + k) % n].instance_id)
            if st is not None and st.stamp == stamp:
                return st.slot
        raise AssertionError("no candidate")  # pragma: no cover

    def _sample(
        self, instances: Sequence[InstanceView], hits: dict[str, int] | None, home: int
    ) -> list[InstanceView]:
        """Power-of-d for big pools: instances with a cache hit, the family's
        rendezvous instances, and ``sample_size`` random others."""
        n = len(instances)
        picked: dict[int, InstanceView] = {}
        if hits:
            by_id = self._by_id
            if len(by_id) != n or by_id.get(instances[0].instance_id) is not instances[0]:
                by_id.clear()
                by_id.update((v.instance_id, v) for v in instances)
            for iid in hits:
                v = by_id.get(iid)
                if v is not None:
                    picked[id(v)] = v
        for k in range(4):
            v = instances[(home + k) % n]
            picked[id(v)] = v
        for k in self._rng.sample(range(n), min(n, self.sample_size)):
            v = instances[k]
            picked[id(v)] = v
        return list(picked.values())

    def _expected_hits(
        self, confirmed: dict[str, int], spec: dict[str, int], max_cached: int
    ) -> dict[str, int]:
        """Instance id -> cached tokens we expect, from confirmed or speculative entries."""
        out: dict[str, int] = {}
        realize = self.hit_realization
        for iid, blocks in confirmed.items():
            out[iid] = blocks * BLOCK_SIZE_TOKENS
        # A speculative holder may still be prefilling; vLLM V1 caches blocks as
        # they are scheduled, so a request admitted after the holder's chunks
        # reuses them all (docs/engine-model.md, section 5): no discount.
        for iid, blocks in spec.items():
            c = blocks * BLOCK_SIZE_TOKENS
            if c > out.get(iid, 0):
                out[iid] = c
        for iid, c in out.items():
            c = int(c * realize) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
            out[iid] = max(0, min(c, max_cached))
        return out

    @staticmethod
    def _kv_wait_s(st: _InstState, need_tokens: int, typical_out: int) -> float:
        """Rough wait for KV to free up: the deficit's share of a decode lifetime."""
        deficit = (need_tokens - st.free_kv_tokens) / max(1.0, float(need_tokens))
        return min(1.0, deficit) * typical_out * st.decode_step_s

    def _dispatch(
        self,
        request: RequestInfo,
        now: float,
        st: _InstState,
        pred: float,
        cached: int,
        probes: tuple[int, ...],
        reserve_out: int,
        blind: bool,
    ) -> RouteDecision:
        kappa = st.kappa.value
        base_own = st.prefill.seconds(request.input_tokens - cached, cached)
        work = kappa * base_own
        kv = request.input_tokens - cached + reserve_out
        iid = st.instance_id
        flight = _Flight(request, iid, now, work, pred / kappa, cached, kv, probes, blind)
        rid = request.request_id
        self._flights[rid] = flight
        st.pending[rid] = flight
        st.inflight[rid] = flight
        st.drain_at_s = (st.drain_at_s if st.drain_at_s > now else now) + work
        st.own_uncached_tokens += max(0, request.input_tokens - cached)
        st.dispatched += 1
        st.last_dispatch_s = now
        if now > st.scrape_seen_s:  # same predicate as the recount in _refresh_scrape
            done = st.since_done_at_s
            st.since_done_at_s = (done if done > now else now) + work
            st.since_scrape_kv += kv
            st.free_kv_tokens -= kv
        st.mean_work_base_s += 0.1 * (base_own - st.mean_work_base_s)
        last = self._last_route_s
        if last == last:  # not NaN
            self._gap_s += 0.05 * ((now - last) - self._gap_s)
        self._last_route_s = now
        self._mean_work_s += 0.05 * (work - self._mean_work_s)
        self._mean_input_tokens += 0.05 * (request.input_tokens - self._mean_input_tokens)
        flight.ticket = self.knowledge.speculate(iid, probes, now)
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
        st.own_uncached_tokens -= max(0, flight.request.input_tokens - flight.cached_tokens)
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
        if flight.dispatch_s > st.scrape_seen_s:
            self._chain_since_scrape(st)

    def on_first_token(self, event: FirstTokenEvent) -> None:
        flight = self._flights.get(event.request.request_id)
        if flight is None or not flight.prefilling:
            return
        st = self._states.get(flight.instance_id)
        if st is None:
            return
        self._end_prefill(flight, event.now_s, st)
        flight.ttft_s = event.ttft_s  # kappa learns at completion, see on_complete
        self.knowledge.release(flight.ticket, event.instance_id or flight.instance_id, event.now_s)
        # the prompt is cached where it was prefilled: with late binding (live pool
        # queues) that can be another instance than the one this router chose
        self.knowledge.confirm(event.instance_id or flight.instance_id, flight.probes)
        self.host_tier.confirm(event.instance_id or flight.instance_id, flight.probes)

    def on_complete(self, event: CompletionEvent) -> None:
        rid = event.request.request_id
        flight = self._flights.pop(rid, None)
        completed = event.status == "completed"
        if completed:
            self.outputs.observe(event.request.tenant, event.request.task_type, event.output_tokens)
            self._typical_out += 0.02 * (event.output_tokens - self._typical_out)
        if flight is None:
            return
        st = self._states.get(flight.instance_id)
        if st is not None:
            if flight.prefilling:
                self._end_prefill(flight, event.now_s, st)
                self.knowledge.unspeculate(flight.ticket)
            st.inflight.pop(rid, None)
            if flight.dispatch_s > st.scrape_seen_s:
                st.since_scrape_kv = max(0, st.since_scrape_kv - flight.kv_tokens)
                st.free_kv_tokens += flight.kv_tokens
            # Learn the rate only when our cache guess was right: a surprise hit
            # or miss is a cache-knowledge error, not a wrong profile.
            miss = abs(event.cached_tokens - flight.cached_tokens)
            if (
                completed
                and flight.ttft_s > 0.0
                and flight.base_pred_s > 0.0
                and miss <= 0.1 * flight.request.input_tokens + 2 * BLOCK_SIZE_TOKENS
            ):
                st.kappa.update(flight.ttft_s / flight.base_pred_s)
        if not completed:
            return
        if flight.blind:
            n_in = max(1, flight.request.input_tokens - 1)
            self.ghost_hit_frac += 0.05 * (
                min(1.0, event.cached_tokens / n_in) - self.ghost_hit_frac
            )
        elif flight.cached_tokens >= BLOCK_SIZE_TOKENS:
            got = min(1.0, event.cached_tokens / flight.cached_tokens)
            self.hit_realization += 0.02 * (got - self.hit_realization)
            if self.hit_realization < 0.3:
                self.hit_realization = 0.3

    def on_kv_event(self, event: KVEvent) -> None:
        if not event.on_gpu:  # the host tier's own events (vLLM offloading: "CPU")
            self.host_tier.on_event(event)
            return
        k = self.knowledge
        if not event.exact:  # a hint: the approximate tier, which LRU-ages its entries
            if event.instance_id in k.exact_instances:
                return
            if event.kind == "stored":
                k.confirm(event.instance_id, k.probes(event.block_hashes))
            elif event.kind == "removed":
                k.routed.remove(event.instance_id, k.probes(event.block_hashes))
            elif event.kind == "cleared":
                k.routed.clear(event.instance_id)
            return
        self.knowledge.apply(event)
        if event.kind == "stored" and event.block_hashes:
            tips = self._tips.get(event.instance_id, ())
            self._tips[event.instance_id] = (*tips[-3:], event.block_hashes[-1])

    # -- introspection for tests and dashboards -----------------------------------
    def kappa(self, instance_id: str) -> float:
        st = self._states.get(instance_id)
        return st.kappa.value if st is not None else 1.0

    def queue_s(self, instance_id: str, now_s: float) -> float:
        st = self._states.get(instance_id)
        return max(0.0, st.drain_at_s - now_s) if st is not None else 0.0

    def states(self) -> Sequence[str]:
        return list(self._states)
