"""FleetMind on the live request path: which datacenter serves a request.

The gateway calls :meth:`LiveDCSelector.select` before admission and routing, so
the in-DC router only ever sees the chosen DC's instances, as in the
simulator (``tokenfleet.sim.fleet``). The selector is the same ``FLEET``
policy object the simulator runs; this module only turns what a live API
replica knows into its :class:`~tokenfleet.core.fleet.FleetSnapshot`:

* per (DC, model, version) pool: ready instances and the aggregate of their
  last scrape (running, waiting, KV usage), from the worker registrations;
* the replica's own exact accounting of what it dispatched to each pool
  (pending prefill, drain clock, work rate), updated at dispatch and at the
  first token or end of each request;
* an approximate prefix index per pool (prompt blocks sent there);
* the static topology (regions, RTTs, load ceilings, tenants) from
  ``TOKENFLEET_TOPOLOGY``, the same YAML the simulator reads; without one,
  every DC is its own region, RTTs are zero and ceilings the defaults;
* tenant permissions, merged from the topology and the tenant's
  ``allowed_regions`` in the database;
* the long cycle's spill shares, written to Redis by beat.

No I/O and no clock reads here: the gateway passes ``now_s`` and the views.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenfleet.core.fleet import (
    FLEET,
    Datacenter,
    DCDecision,
    DCSelector,
    DCStats,
    DCView,
    FleetCompletion,
    FleetFirstToken,
    FleetSnapshot,
    PlannerInput,
    PoolCosts,
    PoolStats,
    PoolView,
    Tenant,
    Topology,
    compliant,
    select_dc,
)
from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.tokenpilot.estimators import OutputLengthModel
from tokenfleet.core.types import InstanceView, RequestInfo
from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.errors import NoCandidateError


class _ZeroRTT(dict[tuple[str, str], float]):
    """RTTs of the topology; pairs it does not know (no topology, or an API
    replica outside every DC) count as zero rather than failing a request."""

    def __missing__(self, key: tuple[str, str]) -> float:
        return 0.0


@dataclass(slots=True)
class DCTicket:
    """What the gateway keeps per dispatched request to settle the accounting."""

    pool: PoolView
    prefill_s: float
    predicted_dc_ttft_s: float | None
    first_token_seen: bool = False
    done: bool = False


class LiveDCSelector:
    """One API replica's datacenter selector and the fleet view it decides on."""

    def __init__(
        self,
        policy: str = "fleetmind",
        *,
        topology: Topology | None = None,
        slo: SLOConfig | None = None,
        entry_dc: str = "",
        policy_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        kwargs: dict[str, Any] = {"slo": slo or SLOConfig()}
        kwargs.update(policy_kwargs or {})
        self.selector: DCSelector = FLEET.create(policy, **kwargs)
        self.topology = topology or Topology(name="live", datacenters={}, rtt_s={}, tenants={})
        self.entry_dc = entry_dc
        self.prefix = PrefixIndex()
        self.outputs = OutputLengthModel()
        self.views: dict[str, DCView] = {}
        self.spill_share: dict[str, float] = {}
        self._costs: dict[str, PoolCosts] = {}
        rtt = _ZeroRTT(self.topology.rtt_s)
        self.snap = FleetSnapshot(
            now_s=0.0,
            dcs=self.views,
            topology=self.topology,
            rtt_s=rtt,
            prefix=self.prefix,
            outputs=self.outputs,
        )

    # -- the view ---------------------------------------------------------------------
    def _dc_view(self, name: str) -> DCView:
        v = self.views.get(name)
        if v is None:
            site = _site(self.topology, name)
            v = DCView(name, site.region, site.entry, site.load_ceiling, site.reserve_local)
            self.views[name] = v
        return v

    def _costs_for(self, profile: EngineProfile) -> PoolCosts:
        c = self._costs.get(profile.name)
        if c is None:
            c = self._costs[profile.name] = PoolCosts(profile)
        return c

    def refresh(self, views: Sequence[InstanceView], now_s: float) -> None:
        """Re-aggregate the pools from the instances' current views (the fleet's
        short cycle). Pools keep their accounting across refreshes; a pool with
        no ready instance left stays known with ``ready_instances == 0``."""
        self.snap.now_s = now_s
        groups: dict[tuple[str, str, str], list[InstanceView]] = {}
        for v in views:
            groups.setdefault((v.dc, v.model, v.model_version), []).append(v)
        seen: set[tuple[str, str, str]] = set()
        for (dc, model, version), members in groups.items():
            dv = self._dc_view(dc)
            pool = dv.pools.get((model, version))
            if pool is None:
                prof = members[0].profile
                pool = PoolView(
                    dc,
                    model,
                    version,
                    self._costs_for(prof),
                    kv_capacity_tokens=prof.kv_capacity_tokens,
                )
                dv.pools[(model, version)] = pool
            ready = [m for m in members if m.ready and m.metrics.healthy]
            pool.ready_instances = len(ready)
            pool.running = sum(m.metrics.num_running for m in ready)
            pool.waiting = sum(m.metrics.num_waiting for m in ready)
            pool.kv_usage = (sum(m.metrics.kv_usage for m in ready) / len(ready)) if ready else 0.0
            pool.scraped_at_s = max((m.metrics.scraped_at_s for m in ready), default=now_s)
            self.prefix.set_capacity(
                pool.prefix_id, sum(m.profile.kv_capacity_blocks for m in members)
            )
            seen.add((dc, model, version))
        for name, dv in self.views.items():
            dv.spill_share = self.spill_share.get(name, 1.0)
            for (model, version), pool in dv.pools.items():
                if (name, model, version) not in seen:
                    pool.ready_instances = 0

    # -- tenants ----------------------------------------------------------------------
    def tenant(self, name: str, allowed_regions: Sequence[str] = ()) -> Tenant:
        """The topology's tenant (home, sites, residency), narrowed by the regions
        the tenant's database record allows (empty: no restriction there)."""
        t = self.topology.tenant(name)
        if allowed_regions:
            regions = frozenset(allowed_regions)
            if t.allowed_regions is not None:
                regions = regions & t.allowed_regions
            t = replace(t, allowed_regions=regions)
        return t

    def home_of(self, tenant: Tenant) -> str | None:
        """The tenant's home DC, else the DC this API replica sits in."""
        if tenant.home:
            return tenant.home
        return self.entry_dc or None

    # -- deciding ---------------------------------------------------------------------
    def select(self, request: RequestInfo, tenant: Tenant) -> tuple[DCDecision, str | None]:
        """(decision, home). Raises NoCandidateError with the reason when no DC may
        serve (:meth:`permitted_anywhere` tells permission from capacity)."""
        home = self.home_of(tenant)
        snap = self.snap
        # the selector looks tenants up by name in the topology: give it the merged one
        if tenant != self.topology.tenant(request.tenant):
            snap = replace(snap, topology=_with_tenant(self.topology, tenant))
        origin = self.entry_dc or home or ""
        d = select_dc(self.selector, request, origin, home, snap)
        return d, home

    def permitted_anywhere(self, request: RequestInfo, tenant: Tenant) -> bool:
        """Whether some DC serving the model is allowed to this tenant, ready or not:
        False is a permission problem (403), True a capacity one (503)."""
        ok = self.compliant_dcs(request, tenant)
        return any(
            p.model == request.model or request.model == "default"
            for name in ok
            for p in self.views[name].pools.values()
        )

    def compliant_dcs(self, request: RequestInfo, tenant: Tenant) -> set[str]:
        """DCs this tenant's request may be served in at all (load and readiness aside)."""
        home = self.home_of(tenant)
        home_region = self.views[home].region if home in self.views else None
        return {
            name for name, dv in self.views.items() if compliant(request, tenant, dv, home_region)
        }

    def dispatched(self, request: RequestInfo, decision: DCDecision) -> DCTicket:
        """Account a request sent to ``decision.dc`` (before it leaves)."""
        dv = self.views[decision.dc]
        pool = dv.pool_for(request.model, request.model_version, exact=self.selector.exact_version)
        if pool is None:
            raise NoCandidateError(
                f"datacenter '{decision.dc}' lost its pool for '{request.model}' while routing"
            )
        _, prefill_s, work_s = self.snap.estimate(pool, request)
        pool.accounting.on_dispatch(self.snap.now_s, prefill_s, work_s, pool.ready_instances)
        self.prefix.insert(pool.prefix_id, request.block_hashes)
        return DCTicket(pool, prefill_s, decision.predicted_dc_ttft_s)

    def first_token(self, ticket: DCTicket, request: RequestInfo, dc_ttft_s: float) -> None:
        if ticket.first_token_seen or ticket.done:
            return
        ticket.first_token_seen = True
        pool = ticket.pool
        pool.accounting.on_first_token(ticket.prefill_s)
        self.selector.on_first_token(
            FleetFirstToken(
                request, pool.dc, pool.model, pool.version, dc_ttft_s, ticket.predicted_dc_ttft_s
            )
        )

    def finished(
        self, ticket: DCTicket, request: RequestInfo, status: str, output_tokens: int
    ) -> None:
        """The request ended (any status). Idempotent."""
        if ticket.done:
            return
        if not ticket.first_token_seen:
            ticket.pool.accounting.on_first_token(ticket.prefill_s)  # no longer pending
            ticket.first_token_seen = True
        ticket.done = True
        self.selector.on_complete(FleetCompletion(request, ticket.pool.dc, status, output_tokens))
        if status == "completed":
            self.outputs.observe(request.tenant, request.task_type, output_tokens)


@dataclass(frozen=True, slots=True)
class LivePool:
    """One (DC, model, version) pool as beat sees it at the long cycle."""

    dc: str
    model: str
    version: str
    profile: EngineProfile
    ready: int
    warming: int = 0


def planner_input(
    now_s: float,
    period_s: float,
    pools: Sequence[LivePool],
    work: Sequence[Any],
    spilled_in: Mapping[str, int],
    topology: Topology | None,
    *,
    typical_output_tokens: int = 256,
) -> PlannerInput:
    """The planner's view of the last long cycle, from what beat can read.

    ``work`` rows (``tokenfleet.service.queries.pool_work``) give each pool's
    served requests, their uncached prompt and completion tokens, and what
    admission refused while that DC was chosen; a pool's demand is the work
    it served plus the work it refused (estimated with a typical output), in
    work-seconds per second (1.0 keeps one replica busy), priced with the
    pool's engine profile as the simulator's planner input is. Free GPU
    slots, ceilings and targets come from the topology (no topology: no free
    slots, so the planner only moves spill shares).
    """
    period_s = max(1e-6, period_s)
    by_pool = {(w.dc, w.model, w.version): w for w in work if w.dc}
    stats: list[PoolStats] = []
    per_dc_served: dict[str, int] = {}
    per_dc_met: dict[str, int] = {}
    gpus_used: dict[str, int] = {}
    for p in pools:
        costs = PoolCosts(p.profile)
        w = by_pool.get((p.dc, p.model, p.version))
        served_s = refused_s = 0.0
        if w is not None and w.served:
            mean_uncached = w.uncached_prompt_tokens / w.served
            served_s = (
                w.served * costs.prefill.seconds(int(mean_uncached))
                + w.completion_tokens * costs.decode_token_s
            )
        if w is not None and w.rejected:
            mean_prompt = w.rejected_prompt_tokens / w.rejected
            refused_s = w.rejected * (
                costs.prefill.seconds(int(mean_prompt))
                + typical_output_tokens * costs.decode_token_s
            )
        replicas = p.ready + p.warming
        served_rate = served_s / period_s
        stats.append(
            PoolStats(
                dc=p.dc,
                model=p.model,
                version=p.version,
                tp=p.profile.tp,
                replicas=replicas,
                ready=p.ready,
                demand_work_s=served_rate + refused_s / period_s,
                served_work_s=served_rate,
                load=served_rate / p.ready if p.ready else 0.0,
            )
        )
        if w is not None:
            per_dc_served[p.dc] = per_dc_served.get(p.dc, 0) + w.served
            per_dc_met[p.dc] = per_dc_met.get(p.dc, 0) + w.slo_met
        gpus_used[p.dc] = gpus_used.get(p.dc, 0) + replicas * p.profile.tp
    dcs: dict[str, DCStats] = {}
    for dc in sorted({p.dc for p in pools}):
        site = _site(topology, dc)
        target = site.attainment_target
        if target is None:
            target = topology.settings.attainment_target if topology is not None else 0.95
        dcs[dc] = DCStats(
            dc=dc,
            served=per_dc_served.get(dc, 0),
            slo_met=per_dc_met.get(dc, 0),
            spilled_in=min(spilled_in.get(dc, 0), per_dc_served.get(dc, 0)),
            target=target,
            free_gpus=max(0, site.gpus - gpus_used.get(dc, 0)),
            load_ceiling=site.load_ceiling,
            spill_in_ceiling=site.spill_in_ceiling,
        )
    budget = topology.settings.gpu_budget if topology is not None else None
    return PlannerInput(
        now_s=now_s, pools=stats, dcs=dcs, gpu_budget=budget, gpus_used=sum(gpus_used.values())
    )


def _site(topology: Topology | None, name: str) -> Datacenter:
    """The topology's site, or one it does not describe (only the workers know it):
    its own region, no GPUs to plan with, the topology's default ceilings."""
    site = topology.datacenters.get(name) if topology is not None else None
    return site if site is not None else Datacenter(name=name, region=name)


def _with_tenant(topo: Topology, tenant: Tenant) -> Topology:
    tenants = dict(topo.tenants)
    tenants[tenant.name] = tenant
    return replace(topo, tenants=tenants)


def load_topology(path: str) -> Topology:
    """Parse a topology YAML (the simulator's format; its deployments are the
    intended ones, live readiness comes from the workers)."""
    import yaml

    from tokenfleet.core.fleet import parse_topology
    from tokenfleet.errors import ConfigError

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(
            f"cannot read the topology file {path} ({exc.strerror}); "
            "set TOKENFLEET_TOPOLOGY to a readable YAML file or unset it"
        ) from None
    # a simulator scenario file works too: its workload/events/slo sections are ignored
    return parse_topology(data, source=path, extra_keys=("workload", "events", "slo"))


__all__ = ["LiveDCSelector", "DCTicket", "LivePool", "planner_input", "load_topology"]
