"""DC selection: which datacenter serves a request. Found by name in ``FLEET``.

The datacenter is chosen first; that DC's own router (TokenPilot or a peer)
then picks the instance. Selectors are pure: a request, its origin and home,
a :class:`FleetSnapshot` and the pre-filtered candidates in, a
:class:`DCDecision` out.

``none``          home DC only (no cross-DC coordination at all).
``nearest``       lowest RTT from the origin among compliant, ready DCs that
                  serve the exact version.
``least_loaded``  naive spill: the least-loaded DC serving the model *name*,
                  ignoring RTT, version and home. Residency is still enforced:
                  no selector can opt out of it (see ``select_dc``). A
                  strawman, kept for reference.
``skylb``         the best peer: local first, and only when the local pool is
                  over its load threshold, spill to the nearest DC that serves
                  the exact version and has room (SkyLB / SkyServe; see
                  :class:`SkyLB`).
``fleetmind``     predicted-TTFT spill with load ceilings and the plan's spill
                  shares (see :class:`FleetMind`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tokenfleet.core.fleet.residency import compliant, may_cross_region
from tokenfleet.core.fleet.state import (
    DCDecision,
    DCView,
    FleetCompletion,
    FleetFirstToken,
    FleetSnapshot,
    PoolView,
)
from tokenfleet.core.registry import Registry
from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.tokenpilot.estimators import LogRatioCorrector
from tokenfleet.core.types import RequestInfo
from tokenfleet.errors import NoCandidateError, TokenFleetError


class PolicyContractError(TokenFleetError):
    """A selector returned a datacenter outside its filtered candidates (a bug)."""


@runtime_checkable
class DCSelector(Protocol):
    name: str
    #: True: candidates must serve the exact model version (every real policy).
    exact_version: bool
    #: True: the driver runs the long-cycle planner and enacts its plans.
    uses_planner: bool

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision: ...

    def on_first_token(self, event: FleetFirstToken) -> None: ...

    def on_complete(self, event: FleetCompletion) -> None: ...


class BaseSelector:
    name = "base"
    exact_version = True
    uses_planner = False

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        raise NotImplementedError

    def on_first_token(self, event: FleetFirstToken) -> None:
        return None

    def on_complete(self, event: FleetCompletion) -> None:
        return None


FLEET: Registry[DCSelector] = Registry("fleet policy")


def candidates_for(
    request: RequestInfo, home: str | None, fleet: FleetSnapshot, exact_version: bool = True
) -> list[DCView]:
    """DCs that pass every hard filter: residency and permissions (always),
    then a ready pool serving the model (at the exact version if asked)."""
    tenant = fleet.tenant(request.tenant)
    home_view = fleet.dcs.get(home) if home is not None else None
    home_region = home_view.region if home_view is not None else None
    out = []
    for v in fleet.dcs.values():
        if not compliant(request, tenant, v, home_region):
            continue
        if v.pool_for(request.model, request.model_version, exact=exact_version) is None:
            continue
        out.append(v)
    return out


def select_dc(
    selector: DCSelector, request: RequestInfo, origin: str, home: str | None, fleet: FleetSnapshot
) -> DCDecision:
    """Filter, let the selector choose among the survivors, check the choice.

    Raises NoCandidateError when no DC may serve the request (the caller
    rejects it) and PolicyContractError if a selector escapes the filter.
    """
    cands = candidates_for(request, home, fleet, selector.exact_version)
    if not cands:
        raise NoCandidateError(
            f"no datacenter may serve tenant '{request.tenant}' model '{request.model}'"
            f"{' version ' + request.model_version if request.model_version else ''}: "
            "check the tenant's allowed sites and regions and the deployments' readiness"
        )
    decision = selector.select(request, origin, home, fleet, cands)
    if decision.dc not in {c.name for c in cands}:
        raise PolicyContractError(
            f"fleet policy '{selector.name}' chose '{decision.dc}', which is not among the "
            f"compliant candidates {[c.name for c in cands]}; this is a bug in the policy"
        )
    return decision


def _unit_hash(request_id: str, dc: str) -> float:
    """Stable pseudo-random number in [0, 1) per (request, DC): spill-share sampling
    that is deterministic across runs and replicas (crc32, not ``hash``)."""
    return zlib.crc32(f"{request_id}|{dc}".encode()) / 2**32


# ---------------------------------------------------------------------------
@FLEET.register("none")
class HomeOnly(BaseSelector):
    """Every request is served at its home DC: the no-coordination baseline."""

    name = "none"

    def __init__(self, **_shared: object) -> None:
        pass

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        for c in candidates:
            if c.name == home:
                return DCDecision(dc=c.name, reason="home")
        raise NoCandidateError(
            f"home site '{home}' cannot serve the request and "
            "policy 'none' never sends it elsewhere"
        )


@FLEET.register("nearest")
class Nearest(BaseSelector):
    """Lowest RTT from where the request entered; load-blind."""

    name = "nearest"

    def __init__(self, **_shared: object) -> None:
        pass

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        best = min(candidates, key=lambda c: (fleet.rtt(origin, c.name), c.name))
        return DCDecision(dc=best.name, spilled=best.name != home, reason="nearest")


@FLEET.register("least_loaded")
class LeastLoaded(BaseSelector):
    """Naive global balancing: the DC whose pool for the model name has the
    lowest load. Blind to RTT, to the model version and to home affinity."""

    name = "least_loaded"
    exact_version = False

    def __init__(self, **_shared: object) -> None:
        pass

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        now = fleet.now_s
        best: DCView | None = None
        best_load = math.inf
        for c in candidates:
            pool = c.pool_for(request.model, request.model_version, exact=False)
            if pool is None:
                continue
            load = pool.load(now)
            if best is None or load < best_load:
                best, best_load = c, load
        assert best is not None  # candidates all have a pool for the model
        return DCDecision(
            dc=best.name, spilled=best.name != home, reason=f"least_loaded:{best_load:.2f}"
        )


# ---------------------------------------------------------------------------
@FLEET.register("skylb")
class SkyLB(BaseSelector):
    """Locality-first cross-region spill, as SkyLB and SkyServe do it.

    Sources: SkyLB (Xia et al., "SkyLB: A Locality-Aware Cross-Region Load
    Balancer for LLM Inference", arXiv:2505.24095): one load balancer per
    region serves its own region's traffic on local replicas and forwards a
    request to another region's load balancer only when the local replicas
    are saturated (its "selective pushing" checks pending requests before
    pushing more), so traffic stays local until local capacity runs out.
    SkyServe (skypilot-org/skypilot ``sky/serve/load_balancing_policies.py``,
    default ``least_load``) picks by the load balancer's own in-flight
    accounting. Here, per request:

    * *local* is the request's home DC (where its region's balancer sits),
      else the candidate nearest to where it entered;
    * the local pool is *over threshold* when its load with this request
      added (``PoolView.load``: the gateway's own dispatched work per
      instance plus its standing queue, the same signal FleetMind reads)
      exceeds ``load_threshold`` (default: that DC's configured
      ``load_ceiling``);
    * only then does it spill, to the *nearest* (RTT from the origin)
      candidate that serves the exact model version and stays under its
      spill-in ceiling with this request added; if none has room the request
      stays local (it waits in the local queue rather than travelling to a
      full region).

    Residency and permissions come from ``select_dc``'s filter like every
    selector's. What it does not do, compared with FleetMind: price queues,
    prefix-cache reuse and RTT in predicted seconds against the SLO, learn a
    per-pool correction, or move replicas (no planner).
    """

    name = "skylb"
    exact_version = True

    def __init__(self, *, load_threshold: float | None = None, **_shared: object) -> None:
        if load_threshold is not None and not load_threshold > 0:
            raise ValueError("load_threshold must be > 0")
        self.load_threshold = load_threshold

    def threshold(self, dc: DCView) -> float:
        return dc.load_ceiling if self.load_threshold is None else self.load_threshold

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        now = fleet.now_s
        by_rtt = sorted(candidates, key=lambda c: (fleet.rtt(origin, c.name), c.name))
        local = next((c for c in candidates if c.name == home), None)

        def load_with(c: DCView) -> float:
            pool = c.pool_for(request.model, request.model_version)
            assert pool is not None  # candidates serve the exact version
            _, _, work_s = fleet.estimate(pool, request)
            return pool.load(now, work_s)

        if local is not None:
            local_load = load_with(local)
            if local_load <= self.threshold(local):
                return DCDecision(local.name, spilled=False, reason=f"local:{local_load:.2f}")
        for c in by_rtt:
            if c is local:
                continue
            remote = load_with(c)
            if remote <= min(self.threshold(c), c.spill_in_ceiling):
                return DCDecision(
                    c.name,
                    spilled=c.name != home,
                    reason=f"spill:{remote:.2f}"
                    if local is not None
                    else ("failover" if home is not None else "nearest"),
                )
        if local is not None:
            return DCDecision(local.name, spilled=False, reason="local:no-room-elsewhere")
        # no home here at all and every candidate is full: the nearest one
        why = "failover:full" if home is not None else "nearest:full"
        return DCDecision(by_rtt[0].name, spilled=by_rtt[0].name != home, reason=why)


# ---------------------------------------------------------------------------
@FLEET.register("fleetmind")
class FleetMind(BaseSelector):
    """Spill to another DC only when it is predicted to meet the SLO and beat home.

    For each candidate DC ``d`` (hard filters already applied)::

        ttft_d = rtt(origin, d) + transfer_d
               + kappa_d * (queue_d + prefill(input - cached_d | cached_d))
        tpot_d = 1 / (f_d / T_chunk + (1 - f_d) / T_decode)

    ``queue_d`` is the pool's predicted wait (the gateway's drain clock or the
    scraped queue, whichever is larger); ``cached_d`` the prefix we believe
    ``d`` holds, so the cache benefit is priced in seconds of prefill saved;
    ``kappa_d`` a ratio learned from observed/predicted TTFT per pool, as
    TokenPilot learns per instance (``tokenfleet/core/routing/tokenpilot.py``);
    ``f_d`` the share of time the pool spends on prefill chunks, which is
    what stretches TPOT under chunked prefill.

    Home is *under pressure* when its predicted TTFT passes ``pressure`` x
    the request's TTFT limit, its predicted TPOT passes ``pressure`` x the
    TPOT limit, or its load passes its ``load_ceiling``. Only then may the
    request spill, to the remote DC with the lowest predicted TTFT among
    those that (a) are predicted to meet ``slo_margin`` x both limits with
    this request added, (b) beat home: a TTFT lower by ``spill_margin_s``,
    or home predicted to miss TPOT or over its ceiling where the remote is
    not, (c) stay under their spill-in ceiling ``min(load_ceiling,
    1 - reserve_local)`` after taking it, and (d) fall inside the plan's
    spill share for that DC. Requests whose tenant or flags forbid crossing
    regions never spill.
    """

    name = "fleetmind"
    uses_planner = True

    def __init__(
        self,
        *,
        slo: SLOConfig | None = None,
        pressure: float = 0.5,
        slo_margin: float = 0.9,
        spill_margin_s: float = 0.05,
        batch_ttft_s: float = 30.0,
        correction_rate: float = 0.1,
        tie_s: float = 0.002,
        **_shared: object,
    ) -> None:
        self.slo = slo if slo is not None else SLOConfig()
        self.pressure = pressure
        self.slo_margin = slo_margin
        self.spill_margin_s = spill_margin_s
        self.batch_ttft_s = batch_ttft_s
        self.correction_rate = correction_rate
        self.tie_s = tie_s
        self._kappa: dict[tuple[str, str, str], LogRatioCorrector] = {}

    def kappa(self, dc: str, pool: PoolView) -> LogRatioCorrector:
        key = (dc, pool.model, pool.version)
        k = self._kappa.get(key)
        if k is None:
            k = self._kappa[key] = LogRatioCorrector(1.0, self.correction_rate)
        return k

    def limits_s(self, request: RequestInfo) -> tuple[float, float]:
        """(TTFT limit, TPOT limit) of the request's tier; inf where none."""
        tier = request.tier or classify(request, self.slo)
        slo = self.slo.slo_for(tier)
        ttft = slo.ttft_limit_s(request.input_tokens)
        return (
            ttft if ttft is not None else self.batch_ttft_s,
            slo.tpot_s if slo.tpot_s is not None else math.inf,
        )

    def predict(
        self, request: RequestInfo, origin: str, dc: DCView, pool: PoolView, fleet: FleetSnapshot
    ) -> _Prediction:
        now = fleet.now_s
        _, prefill_s, work_s = fleet.estimate(pool, request)
        raw = pool.queue_s(now) + prefill_s
        ttft = (
            fleet.rtt(origin, dc.name)
            + fleet.transfer_s(origin, dc.name, request)
            + self.kappa(dc.name, pool).value * raw
        )
        return _Prediction(dc, pool, ttft, raw, pool.tpot_s(now, prefill_s), pool.load(now, work_s))

    def select(
        self,
        request: RequestInfo,
        origin: str,
        home: str | None,
        fleet: FleetSnapshot,
        candidates: Sequence[DCView],
    ) -> DCDecision:
        ttft_lim, tpot_lim = self.limits_s(request)
        preds: dict[str, _Prediction] = {}
        for c in candidates:
            pool = c.pool_for(request.model, request.model_version)
            if pool is not None:
                preds[c.name] = self.predict(request, origin, c, pool, fleet)
        hp = preds.get(home) if home is not None else None
        pinned = not may_cross_region(request, fleet.tenant(request.tenant))
        if hp is not None:
            if pinned:
                return DCDecision(home or "", hp.ttft_s, hp.raw_s, False, "home:pinned")
            home_hot = hp.load > hp.dc.load_ceiling or hp.tpot_s > tpot_lim
            if (
                not home_hot
                and hp.ttft_s <= self.pressure * ttft_lim
                and hp.tpot_s <= self.pressure * tpot_lim
            ):
                return DCDecision(hp.dc.name, hp.ttft_s, hp.raw_s, False, "home")
        else:
            home_hot = True

        best: _Prediction | None = None
        for name, p in preds.items():
            if name == home:
                continue
            if p.ttft_s > self.slo_margin * ttft_lim or p.tpot_s > self.slo_margin * tpot_lim:
                continue
            if hp is not None:
                beats = p.ttft_s + self.spill_margin_s < hp.ttft_s or home_hot
                if not beats:
                    continue
                if p.load > p.dc.spill_in_ceiling:
                    continue
                if _unit_hash(request.request_id, name) >= p.dc.spill_share:
                    continue
            if best is None or _better(p, best, self.tie_s):
                best = p
        if best is not None:
            return DCDecision(
                best.dc.name,
                best.ttft_s,
                best.raw_s,
                home is not None,
                # no home DC at all (a tenant without one, an API outside every DC)
                # is not a failover: there was nothing to fail over from
                "spill" if hp is not None else ("failover" if home is not None else "best"),
            )
        if hp is not None:
            return DCDecision(hp.dc.name, hp.ttft_s, hp.raw_s, False, "home:no-better")
        # home cannot serve at all: the best-predicted candidate (failover)
        p = min(preds.values(), key=lambda x: (x.ttft_s, x.dc.name))
        for q in preds.values():
            if _better(q, p, self.tie_s):
                p = q
        why = "failover:over-slo" if home is not None else "best:over-slo"
        return DCDecision(p.dc.name, p.ttft_s, p.raw_s, home is not None, why)

    def on_first_token(self, event: FleetFirstToken) -> None:
        pred = event.predicted_dc_ttft_s
        if pred is None or pred <= 0.0:
            return
        k = self._kappa.get((event.dc, event.model, event.version))
        if k is not None:
            k.update(event.dc_ttft_s / pred)


def _better(p: _Prediction, best: _Prediction, tie_s: float) -> bool:
    """Lower predicted TTFT wins; within ``tie_s`` the pool this gateway sent
    fewer requests to wins, so equal DCs share the work instead of the first
    one taking all of it (a fleet with no home DC, or a fresh start)."""
    if p.ttft_s < best.ttft_s - tie_s:
        return True
    if p.ttft_s > best.ttft_s + tie_s:
        return False
    a, b = p.pool.accounting.dispatched_total, best.pool.accounting.dispatched_total
    return a < b or (a == b and p.dc.name < best.dc.name)


class _Prediction:
    __slots__ = ("dc", "pool", "ttft_s", "raw_s", "tpot_s", "load")

    def __init__(
        self, dc: DCView, pool: PoolView, ttft_s: float, raw_s: float, tpot_s: float, load: float
    ) -> None:
        self.dc = dc
        self.pool = pool
        self.ttft_s = ttft_s  # at the client, RTT included, corrected
        self.raw_s = raw_s  # in-DC queue + prefill, before correction
        self.tpot_s = tpot_s  # with this request's prefill added
        self.load = load  # with this request's work added
