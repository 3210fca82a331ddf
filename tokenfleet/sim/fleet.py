"""Multi-datacenter simulator: one :class:`PoolSim` per (DC, model version),
a FleetMind-style gateway in front, WAN round trips, a timeline of incidents.

The driver plays the live system. Per request it asks a DC selector (from
``tokenfleet.core.fleet.FLEET``) for a datacenter, ships the request there
(half an RTT plus the prompt's transfer time), lets that DC's own router
place it, and ships the first token and the end of the stream back (the
other half RTT), so TTFT at the client includes one full WAN round trip.

Two control loops run beside the traffic:

* the **short cycle** (every ``settings.scrape_interval_s``): the gateway
  refreshes each pool's aggregate from the engines' last ``/metrics`` scrape,
  the readiness of its endpoints and the probed RTTs, and notices first
  tokens. Spill decisions for new requests use it from the next request on;
* the **long cycle** (every ``settings.long_cycle_s``, default 60 s), for
  selectors that plan (``fleetmind``): the planner reads the last cycle's
  demand, load and attainment and returns a plan; the driver enacts it
  (replica moves, prewarming with a ``prewarm_s`` delay, spill shares) and
  records every plan and rollback as an event.

The simulator checks the policies independently: it re-derives data
residency from the topology with its own code (:func:`residency_ok`, not
the filter the policies use) and compares the served version with the
requested one, counting ``residency_violations`` and ``version_mismatches``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenfleet.core.fleet import (
    FLEET,
    DCSelector,
    DCStats,
    DCView,
    FleetCompletion,
    FleetFirstToken,
    FleetSnapshot,
    Plan,
    Planner,
    PlannerInput,
    PoolCosts,
    PoolStats,
    PoolView,
    RollbackEvent,
    Topology,
    parse_topology,
    select_dc,
)
from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.tokenpilot.estimators import OutputLengthModel
from tokenfleet.core.types import RequestInfo
from tokenfleet.engine.profiles import PROFILES, EngineProfile, get_profile
from tokenfleet.errors import ConfigError, NoCandidateError, ValidationError
from tokenfleet.sim.cluster import PoolConfig, PoolSim, new_record
from tokenfleet.sim.core import Environment
from tokenfleet.sim.metrics import judge, summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.sim.runner import engines_publish_kv_events
from tokenfleet.workloads.trace import TraceRequest

#: Sections of a scenario file that the simulator (not the topology) owns.
SCENARIO_KEYS = ("workload", "events", "slo")
EVENT_KINDS = ("endpoints_unready", "endpoints_ready", "rollout", "latency_spike", "slowdown")
SAMPLE_S = 1.0  # time-series resolution of per-DC load
BIN_S = 5.0  # time-series resolution of spill shares (by arrival time)


# ---------------------------------------------------------------------------
# scenario: topology + workload + timeline
# ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StreamSpec:
    """One seeded synthetic request stream, entering at ``origin``.

    Its rate is either ``rate_rps`` or ``load`` x the capacity estimate of the
    home DC's deployment for this stream's own request mix
    (``workloads.scaling.capacity_rps``, the same definition ``sim --load``
    uses), so a scenario keeps its meaning when the engine model is recalibrated.
    """

    name: str
    tenant: str
    generator: str
    rate_rps: float | None
    seed: int
    origin: str
    home: str
    model: str
    version: str
    region: str | None = None
    allow_cross_region: bool = True
    start_s: float = 0.0
    end_s: float | None = None  # default: the workload's duration
    options: Mapping[str, Any] = field(default_factory=dict)
    load: float | None = None


@dataclass(frozen=True, slots=True)
class TimelineEvent:
    at_s: float
    kind: str  # one of EVENT_KINDS
    dc: str
    model: str = ""
    version: str = ""
    to_version: str = ""
    profile: str = ""
    instances: int | None = None  # None: all matching
    batch: int = 1
    duration_s: float | None = None
    extra_ms: float = 0.0
    factor: float = 1.0


@dataclass(frozen=True)
class Scenario:
    topology: Topology
    slo: SLOConfig
    duration_s: float
    streams: tuple[StreamSpec, ...]
    events: tuple[TimelineEvent, ...] = ()
    source: str = "<scenario>"

    def with_duration(self, duration_s: float) -> Scenario:
        """The same scenario cut short (tests); events after the end are dropped."""
        return replace(
            self, duration_s=duration_s, events=tuple(e for e in self.events if e.at_s < duration_s)
        )


def load_scenario(path: str | Path) -> Scenario:
    """Read a topology/scenario YAML file (the simulator's only file I/O here)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"topology file {p} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValidationError(str(p), "(top level)", "must be a mapping")
    return scenario_from_mapping(data, str(p))


def _profile_tp() -> dict[str, int]:
    return {n: get_profile(n).tp for n in PROFILES.names()}


def scenario_from_mapping(data: Mapping[str, Any], source: str = "<scenario>") -> Scenario:
    topo = parse_topology(
        data, source, extra_keys=SCENARIO_KEYS, profile_tp=_profile_tp(), routers=ROUTERS.names()
    )
    slo = SLOConfig()
    if data.get("slo") is not None:
        if not isinstance(data["slo"], Mapping):
            raise ValidationError(source, "slo", "must be a mapping (same form as --slo)")
        slo = SLOConfig.from_mapping(data["slo"], source=f"{source}: slo")
    wl = data.get("workload")
    if not isinstance(wl, Mapping):
        raise ValidationError(
            source,
            "workload",
            "missing; a scenario needs a workload section with duration_s and streams",
        )
    duration = _num(source, "workload.duration_s", wl.get("duration_s"), positive=True)
    unknown = set(wl) - {"duration_s", "streams"}
    if unknown:
        raise ValidationError(
            source, f"workload.{sorted(unknown)[0]}", "unknown field; use duration_s and streams"
        )
    raw_streams = wl.get("streams")
    if not isinstance(raw_streams, list) or not raw_streams:
        raise ValidationError(source, "workload.streams", "must be a non-empty list")
    streams = tuple(_stream(source, topo, i, s, duration) for i, s in enumerate(raw_streams))
    names = [s.name for s in streams]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise ValidationError(
                source, f"workload.streams[{i}].name", f"duplicate stream name '{n}'"
            )
    raw_events = data.get("events") or []
    if not isinstance(raw_events, list):
        raise ValidationError(source, "events", "must be a list of timeline events")
    events = tuple(
        sorted((_event(source, topo, i, e) for i, e in enumerate(raw_events)), key=lambda e: e.at_s)
    )
    return Scenario(
        topology=topo, slo=slo, duration_s=duration, streams=streams, events=events, source=source
    )


def _num(source: str, fld: str, v: Any, positive: bool = False) -> float:
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or v < 0
        or (positive and v == 0)
    ):
        raise ValidationError(
            source, fld, f"must be a {'positive' if positive else 'non-negative'} number, got {v!r}"
        )
    return float(v)


_STREAM_KEYS = {
    "name",
    "tenant",
    "generator",
    "rate_rps",
    "load",
    "seed",
    "origin",
    "home",
    "model",
    "version",
    "region",
    "allow_cross_region",
    "start_s",
    "end_s",
    "options",
}


def _stream(source: str, topo: Topology, i: int, raw: Any, duration: float) -> StreamSpec:
    from tokenfleet.workloads.synthetic import SYNTHETIC

    base = f"workload.streams[{i}]"
    if not isinstance(raw, Mapping):
        raise ValidationError(source, base, "must be a mapping")
    for k in raw:
        if k not in _STREAM_KEYS:
            raise ValidationError(
                source, f"{base}.{k}", f"unknown field; use one of {sorted(_STREAM_KEYS)}"
            )
    for req in ("tenant", "generator", "model"):
        if req not in raw:
            raise ValidationError(source, f"{base}.{req}", "missing")
    if ("rate_rps" in raw) == ("load" in raw):
        raise ValidationError(
            source,
            f"{base}.rate_rps",
            "give exactly one of rate_rps (requests/s) or load (x the home deployment's capacity)",
        )
    gen = str(raw["generator"])
    if gen not in SYNTHETIC:
        raise ValidationError(
            source,
            f"{base}.generator",
            f"unknown generator '{gen}'; choose one of {', '.join(SYNTHETIC.names())}",
        )
    tenant = str(raw["tenant"])
    model = str(raw["model"])
    version = "" if raw.get("version") is None else str(raw["version"])
    dcs = topo.datacenters
    origin = raw.get("origin") or topo.entry
    home = raw.get("home") or topo.tenant(tenant).home
    if home is not None and str(home) not in dcs:
        raise ValidationError(source, f"{base}.home", f"unknown site '{home}'")
    if origin is None:
        origin = home
    if origin is None:
        raise ValidationError(
            source,
            f"{base}.origin",
            "no origin: name one, give the tenant a home, or mark a site 'entry: true'",
        )
    origin = str(origin)
    if origin not in dcs:
        raise ValidationError(source, f"{base}.origin", f"unknown site '{origin}'")
    if home is None:
        serving = [d.name for d in dcs.values() if any(dep.model == model for dep in d.deployments)]
        if not serving:
            raise ValidationError(source, f"{base}.model", f"no site deploys '{model}'")
        home = min(serving, key=lambda n: (topo.rtt(origin, n), n))
    home = str(home)
    if dcs[home].entry:
        raise ValidationError(
            source, f"{base}.home", f"'{home}' is an entry site and holds no GPUs"
        )
    region = raw.get("region")
    if region is not None:
        region = str(region)
        if region not in {d.region for d in dcs.values()}:
            raise ValidationError(source, f"{base}.region", f"unknown region '{region}'")
    cross = raw.get("allow_cross_region", True)
    if not isinstance(cross, bool):
        raise ValidationError(source, f"{base}.allow_cross_region", "must be true or false")
    seed = raw.get("seed", i)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValidationError(source, f"{base}.seed", "must be an integer")
    start = _num(source, f"{base}.start_s", raw.get("start_s", 0.0))
    end = None if raw.get("end_s") is None else _num(source, f"{base}.end_s", raw["end_s"])
    if end is not None and end <= start:
        raise ValidationError(source, f"{base}.end_s", "must be after start_s")
    if start >= duration:
        raise ValidationError(source, f"{base}.start_s", "is after the workload's end")
    opts = raw.get("options") or {}
    if not isinstance(opts, Mapping):
        raise ValidationError(
            source, f"{base}.options", "must be a mapping of generator keyword arguments"
        )
    load = None
    rate = None
    if "load" in raw:
        load = _num(source, f"{base}.load", raw["load"], positive=True)
        if not any(
            d.model == model and d.version == version and d.instances > 0
            for d in dcs[home].deployments
        ):
            raise ValidationError(
                source,
                f"{base}.load",
                f"is relative to the home site's "
                f"capacity, but {home} deploys no {model}@{version}; give "
                "rate_rps instead",
            )
    else:
        rate = _num(source, f"{base}.rate_rps", raw["rate_rps"], positive=True)
    return StreamSpec(
        name=str(raw.get("name", f"s{i}")),
        tenant=tenant,
        generator=gen,
        rate_rps=rate,
        seed=seed,
        origin=origin,
        home=home,
        model=model,
        version=version,
        region=region,
        allow_cross_region=cross,
        start_s=start,
        end_s=end,
        options=dict(opts),
        load=load,
    )


_EVENT_KEYS = {
    "at_s",
    "kind",
    "dc",
    "model",
    "version",
    "to_version",
    "profile",
    "instances",
    "batch",
    "duration_s",
    "extra_ms",
    "factor",
}


def _event(source: str, topo: Topology, i: int, raw: Any) -> TimelineEvent:
    base = f"events[{i}]"
    if not isinstance(raw, Mapping):
        raise ValidationError(source, base, "must be a mapping")
    for k in raw:
        if k not in _EVENT_KEYS:
            raise ValidationError(
                source, f"{base}.{k}", f"unknown field; use one of {sorted(_EVENT_KEYS)}"
            )
    kind = raw.get("kind")
    if kind not in EVENT_KINDS:
        raise ValidationError(
            source, f"{base}.kind", f"must be one of {', '.join(EVENT_KINDS)}, got {kind!r}"
        )
    dc = str(raw.get("dc", ""))
    if dc not in topo.datacenters:
        raise ValidationError(source, f"{base}.dc", f"unknown site '{dc}'")
    if kind != "latency_spike" and topo.datacenters[dc].entry:
        raise ValidationError(source, f"{base}.dc", f"'{dc}' is an entry site with no GPUs")
    model = "" if raw.get("model") is None else str(raw["model"])
    version = "" if raw.get("version") is None else str(raw["version"])
    to_version = "" if raw.get("to_version") is None else str(raw["to_version"])
    profile = "" if raw.get("profile") is None else str(raw["profile"])
    if profile and profile not in PROFILES:
        raise ValidationError(source, f"{base}.profile", f"unknown engine profile '{profile}'")
    deployed = topo.datacenters[dc].deployments
    if kind == "rollout":
        if not model or not to_version:
            raise ValidationError(
                source,
                f"{base}.to_version" if model else f"{base}.model",
                "a rollout needs model and to_version",
            )
        olds = [d for d in deployed if d.model == model and (not version or d.version == version)]
        if not olds:
            raise ValidationError(
                source,
                f"{base}.model",
                f"{dc} does not deploy '{model}'{' version ' + version if version else ''}",
            )
        if len(olds) > 1:
            raise ValidationError(
                source,
                f"{base}.version",
                f"{dc} deploys several versions of '{model}'; name the one to replace",
            )
        version = olds[0].version
        if to_version == version:
            raise ValidationError(source, f"{base}.to_version", "equals the current version")
    instances = raw.get("instances")
    if instances is not None and (
        isinstance(instances, bool) or not isinstance(instances, int) or instances < 1
    ):
        raise ValidationError(source, f"{base}.instances", "must be an integer >= 1")
    batch = raw.get("batch", 1)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValidationError(source, f"{base}.batch", "must be an integer >= 1")
    dur = (
        None
        if raw.get("duration_s") is None
        else _num(source, f"{base}.duration_s", raw["duration_s"], positive=True)
    )
    extra = _num(source, f"{base}.extra_ms", raw.get("extra_ms", 0.0))
    factor = _num(source, f"{base}.factor", raw.get("factor", 1.0), positive=True)
    if kind == "latency_spike" and extra <= 0:
        raise ValidationError(source, f"{base}.extra_ms", "a latency spike needs extra_ms > 0")
    if kind == "slowdown" and factor <= 1.0:
        raise ValidationError(source, f"{base}.factor", "a slowdown needs factor > 1")
    return TimelineEvent(
        at_s=_num(source, f"{base}.at_s", raw.get("at_s")),
        kind=str(kind),
        dc=dc,
        model=model,
        version=version,
        to_version=to_version,
        profile=profile,
        instances=instances,
        batch=batch,
        duration_s=dur,
        extra_ms=extra,
        factor=factor,
    )


@dataclass(slots=True)
class Arrival:
    trace: TraceRequest
    origin: str
    home: str


def build_workload(
    sc: Scenario, seed: int = 0, rates_out: dict[str, float] | None = None
) -> list[Arrival]:
    """Generate every stream (seeded), place it in its window, tag it, classify it.
    ``rates_out`` receives each stream's arrival rate (requests/s)."""
    from tokenfleet.workloads.synthetic import SYNTHETIC

    out: list[Arrival] = []
    for st in sc.streams:
        end = min(st.end_s if st.end_s is not None else sc.duration_s, sc.duration_s)
        span = end - st.start_s
        if span <= 0:
            continue
        gen = SYNTHETIC.get(st.generator)
        rate = stream_rate_rps(sc, st)
        if rates_out is not None:
            rates_out[st.name] = rate
        n = int(rate * span * 1.3) + 20
        while True:
            reqs = gen(n, st.seed + 7919 * seed, rate, **dict(st.options))
            if not reqs or reqs[-1].info.arrival_s >= span or len(reqs) < n:
                break
            n *= 2
        for tr in reqs:
            info = tr.info
            if info.arrival_s >= span:
                break
            at = st.start_s + info.arrival_s
            new = replace(
                info,
                request_id=f"{st.name}/{info.request_id}",
                arrival_s=at,
                tenant=st.tenant,
                model=st.model,
                model_version=st.version,
                region=st.region,
                allow_cross_region=st.allow_cross_region,
                deadline_s=(None if info.deadline_s is None else info.deadline_s + st.start_s),
            )
            new = replace(new, tier=classify(new, sc.slo))
            out.append(Arrival(replace(tr, info=new), st.origin, st.home))
    out.sort(key=lambda a: (a.trace.info.arrival_s, a.trace.info.request_id))
    return out


def stream_rate_rps(sc: Scenario, st: StreamSpec) -> float:
    """The stream's arrival rate: given, or ``load`` x its home deployment's capacity."""
    if st.rate_rps is not None:
        return st.rate_rps
    from tokenfleet.workloads.scaling import capacity_rps
    from tokenfleet.workloads.synthetic import SYNTHETIC

    assert st.load is not None
    dep = next(
        d
        for d in sc.topology.datacenters[st.home].deployments
        if d.model == st.model and d.version == st.version
    )
    sample = SYNTHETIC.get(st.generator)(1500, st.seed, 5.0, **dict(st.options))
    return st.load * capacity_rps(sample, get_profile(dep.profile), dep.instances)


def residency_ok(topo: Topology, info: RequestInfo, home: str, dc: str) -> bool:
    """The simulator's own residency check, written apart from the policies'
    filter on purpose: it is the referee, not the player."""
    site = topo.datacenters.get(dc)
    if site is None or site.entry:
        return False
    t = topo.tenants.get(info.tenant)
    if t is not None:
        if t.allowed_dcs is not None and dc not in t.allowed_dcs:
            return False
        if t.allowed_regions is not None and site.region not in t.allowed_regions:
            return False
    crossing_allowed = info.allow_cross_region and (t is None or t.allow_cross_region)
    if not crossing_allowed:
        origin_region = info.region or topo.datacenters[home].region
        if site.region != origin_region:
            return False
    return True


# ---------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------
OFF, WARMING, READY, DOWN = "off", "warming", "ready", "down"


class _Pool:
    """One PoolSim plus the state of its replica slots (the GPUs it may use)."""

    def __init__(
        self, key: tuple[str, str, str], sim: PoolSim, view: PoolView, profile: EngineProfile
    ) -> None:
        self.key = key
        self.sim = sim
        self.view = view
        self.profile = profile
        self.tp = profile.tp
        self.slots = [OFF] * len(sim.engines)
        self.gen = [0] * len(sim.engines)  # invalidates stale warm-up callbacks
        self.pending: list[_Flight] = []  # dispatched, first token not yet seen
        self.load_sum = 0.0
        self.load_n = 0
        for i in range(len(self.slots)):
            self.set(i, OFF)

    def set(self, i: int, state: str) -> None:
        self.slots[i] = state
        self.gen[i] += 1
        for views in self.sim.views:
            views[i].ready = state == READY

    def count(self, *states: str) -> int:
        return sum(1 for s in self.slots if s in states)

    @property
    def active(self) -> int:
        """Replicas holding GPUs: ready, warming or down (failed, still placed)."""
        return self.count(READY, WARMING, DOWN)


@dataclass(slots=True)
class _Flight:
    arrival: Arrival
    record: RequestRecord
    pool: _Pool
    prefill_s: float
    predicted_dc_s: float | None
    back_s: float
    at_dc_s: float
    spilled: bool
    ttft_limit_s: float
    ft_seen: bool = False
    counted: bool = False  # its SLO miss already reported to the planner


@dataclass
class FleetRun:
    """One fleet policy's run over one scenario."""

    policy: str
    records: list[RequestRecord]
    summary: dict[str, Any]
    per_dc: dict[str, dict[str, Any]]
    spill_fraction: float
    residency_violations: int
    version_mismatches: int
    no_candidate: int
    plans: list[dict[str, Any]]
    rollbacks: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    timeseries: dict[str, Any]
    wall_s: float
    preemptions: int
    stream_rates_rps: dict[str, float] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"policy": self.policy, "fleet": self.policy}
        out.update(self.summary)
        out.update(
            {
                "per_dc": self.per_dc,
                "spill_fraction": self.spill_fraction,
                "residency_violations": self.residency_violations,
                "version_mismatches": self.version_mismatches,
                "rejected_no_candidate": self.no_candidate,
                "plans": self.plans,
                "rollbacks": self.rollbacks,
                "timeline": self.timeline,
                "timeseries": self.timeseries,
                "stream_rates_rps": self.stream_rates_rps,
                "preemptions": self.preemptions,
                "wall_s": self.wall_s,
            }
        )
        return out


def _default_router() -> str:
    return "tokenpilot" if "tokenpilot" in ROUTERS else "round_robin"


def _slowed(p: EngineProfile, factor: float) -> EngineProfile:
    """An engine ``factor`` times slower (power capping, a noisy neighbour, a bad link)."""
    return p.with_overrides(
        mfu=p.mfu / factor,
        attn_eff=p.attn_eff / factor,
        mbu=p.mbu / factor,
        step_overhead_s=p.step_overhead_s * factor,
        per_seq_overhead_s=p.per_seq_overhead_s * factor,
    )


class FleetSim:
    """Drives one fleet policy over one scenario. ``run()`` returns a FleetRun."""

    def __init__(
        self,
        sc: Scenario,
        policy: str,
        seed: int = 0,
        policy_kwargs: Mapping[str, object] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self.sc = sc
        self.topo = topo = sc.topology
        self.settings = topo.settings
        self.seed = seed
        self.env = Environment()
        kwargs: dict[str, object] = {"slo": sc.slo}
        kwargs.update(policy_kwargs or {})
        self.policy = policy
        self.selector: DCSelector = FLEET.create(policy, **kwargs)
        self.progress = progress
        self.prefix = PrefixIndex()
        self.outputs = OutputLengthModel()
        self.views: dict[str, DCView] = {
            d.name: DCView(d.name, d.region, d.entry, d.load_ceiling, d.reserve_local)
            for d in topo.datacenters.values()
        }
        self.snap = FleetSnapshot(
            now_s=0.0,
            dcs=self.views,
            topology=topo,
            rtt_s=dict(topo.rtt_s),
            prefix=self.prefix,
            outputs=self.outputs,
        )
        self.pools: dict[tuple[str, str, str], _Pool] = {}
        self._costs: dict[str, PoolCosts] = {}
        self.profile_of: dict[tuple[str, str], str] = {}
        self.router_of: dict[tuple[str, str], str] = {}
        for d in topo.datacenters.values():
            for dep in d.deployments:
                self.profile_of.setdefault(dep.key, dep.profile)
                self.router_of.setdefault(dep.key, dep.router)
        for ev in sc.events:
            if ev.kind == "rollout":
                self.profile_of.setdefault(
                    (ev.model, ev.to_version), ev.profile or self.profile_of[(ev.model, ev.version)]
                )
        self._slow: dict[str, float] = {}
        for d in topo.datacenters.values():
            for dep in d.deployments:
                pool = self._pool(d.name, dep.model, dep.version)
                for i in range(min(dep.instances, len(pool.slots))):
                    pool.set(i, READY if dep.ready else DOWN)
        self.flights: dict[str, _Flight] = {}
        self.records: list[RequestRecord] = []
        self.residency_violations = 0
        self.version_mismatches = 0
        self.no_candidate = 0
        self.spilled = 0
        self.timeline: list[dict[str, Any]] = []
        self._spikes: list[tuple[float, float, str, float]] = []  # start, end, dc, extra_s
        # planner
        self.planner: Planner | None = None
        if self.selector.uses_planner:
            initial = Plan(
                plan_id=0,
                at_s=0.0,
                replicas={k: p.active for k, p in self.pools.items()},
                spill_share={n: 1.0 for n in self.views},
                kind="initial",
                reason="the topology as deployed",
            )
            self.planner = Planner(initial=initial, rtt_s=topo.rtt)
        self.plans: list[dict[str, Any]] = []
        self.rollbacks: list[dict[str, Any]] = []
        # per-long-cycle counters
        self._cyc_start = 0.0
        self._cyc_demand: dict[tuple[str, str, str], float] = {}
        self._cyc_served_work: dict[tuple[str, str, str], float] = {}
        # dc -> [(time, slo met, spilled in)] outcomes known in this cycle
        self._cyc_dc: dict[str, list[tuple[float, bool, bool]]] = {}
        # time series
        self._ts_t: list[float] = []
        self._ts_load: dict[str, list[float]] = {
            n: [] for n, v in self.views.items() if not v.entry
        }
        self._ts_ready: dict[str, list[int]] = {n: [] for n in self._ts_load}
        self._ts_share: dict[str, list[float]] = {n: [] for n in self._ts_load}
        self._bins: dict[int, list[int]] = {}  # bin -> [arrivals, spilled]
        self._bins_to: dict[int, dict[str, int]] = {}
        self._next_sample = 0.0
        self._arrivals_left = 0
        self._done = 0
        self._total = 0

    # -- pools ------------------------------------------------------------------
    def _pool(self, dc: str, model: str, version: str) -> _Pool:
        key = (dc, model, version)
        pool = self.pools.get(key)
        if pool is not None:
            return pool
        pname = self.profile_of.get((model, version))
        if pname is None:
            raise ConfigError(
                f"no engine profile known for {model}@{version}; deploy it "
                "somewhere in the topology first"
            )
        prof = get_profile(pname)
        site = self.topo.datacenters[dc]
        n = max(1, site.gpus // prof.tp)
        router = (
            self.router_of.get((model, version))
            or self.settings.default_router
            or _default_router()
        )
        # a DC whose router ships with KV events (Dynamo) has engines that publish them
        cfg = PoolConfig(
            profile=prof,
            n_instances=n,
            router=router,
            scrape_interval_s=self.settings.pool_scrape_interval_s,
            seed=self.seed * 7919 + len(self.pools) * 131 + 1,
            dc=dc,
            model=model,
            model_version=version,
            kv_events=engines_publish_kv_events(router),
        )
        sim = PoolSim(self.env, cfg, self.sc.slo, on_done=self._done_for(key))
        costs = self._costs.get(pname)
        if costs is None:
            costs = self._costs[pname] = PoolCosts(prof)
        view = PoolView(dc, model, version, costs, kv_capacity_tokens=prof.kv_capacity_tokens)
        pool = _Pool(key, sim, view, prof)
        self.pools[key] = pool
        self.views[dc].pools[(model, version)] = view
        self.prefix.set_capacity(view.prefix_id, n * prof.kv_capacity_blocks)
        if dc in self._slow:
            for e in sim.engines:
                e.profile = _slowed(prof, self._slow[dc])
        return pool

    def _done_for(self, key: tuple[str, str, str]) -> Callable[[RequestRecord], None]:
        def done(rec: RequestRecord) -> None:
            self._on_done(key, rec)

        return done

    def _gpus_used(self, dc: str | None = None) -> int:
        return sum(p.active * p.tp for k, p in self.pools.items() if dc is None or k[0] == dc)

    # -- running ------------------------------------------------------------------
    def run(self, arrivals: Sequence[Arrival]) -> FleetRun:
        t0 = time.perf_counter()
        env = self.env
        self._arrivals_left = len(arrivals)
        self._total = len(arrivals)
        for a in arrivals:
            env.schedule_at(a.trace.info.arrival_s, self._arrive, a)
        for ev in self.sc.events:
            env.schedule_at(ev.at_s, self._apply_event, ev)
        env.schedule(0.0, self._short_cycle)
        if self.planner is not None:
            env.schedule(self.settings.long_cycle_s, self._long_cycle)
        env.run()
        return self._result(time.perf_counter() - t0)

    def _finished(self) -> bool:
        return self._arrivals_left == 0 and not self.flights

    def _arrive(self, a: Arrival) -> None:
        env = self.env
        now = env.now
        self._arrivals_left -= 1
        snap = self.snap
        snap.now_s = now
        info = a.trace.info
        rec = new_record(info, "")
        b = int(now // BIN_S)
        bin_ = self._bins.setdefault(b, [0, 0])
        bin_[0] += 1
        try:
            d = select_dc(self.selector, info, a.origin, a.home, snap)
        except NoCandidateError:
            self.no_candidate += 1
            rec.status = "rejected"
            rec.finish_s = now
            self._finalize(rec, None)
            return
        view = self.views[d.dc]
        pv = view.pool_for(info.model, info.model_version, exact=self.selector.exact_version)
        assert pv is not None  # select_dc only returns DCs with a serving pool
        pool = self.pools[(d.dc, pv.model, pv.version)]
        # the referee's own checks
        if not residency_ok(self.topo, info, a.home, d.dc):
            self.residency_violations += 1
        if info.model_version and pv.version != info.model_version:
            self.version_mismatches += 1
        _, prefill_s, work_s = snap.estimate(pv, info)
        # planner input: the demand where the request belongs (estimated before
        # this dispatch is recorded, so its own prompt does not count as cached)
        home_pv = self.views[a.home].pool_for(info.model, info.model_version)
        home_work = work_s if home_pv is pv or home_pv is None else snap.estimate(home_pv, info)[2]
        pv.accounting.on_dispatch(now, prefill_s, work_s, pv.ready_instances)
        self.prefix.insert(pv.prefix_id, info.block_hashes)
        spilled = d.dc != a.home
        if spilled:
            self.spilled += 1
            bin_[1] += 1
            to = self._bins_to.setdefault(b, {})
            to[d.dc] = to.get(d.dc, 0) + 1
        hkey = (a.home, info.model, info.model_version or pv.version)
        self._cyc_demand[hkey] = self._cyc_demand.get(hkey, 0.0) + home_work
        self._cyc_served_work[pool.key] = self._cyc_served_work.get(pool.key, 0.0) + work_s
        one_way = snap.rtt(a.origin, d.dc) / 2.0
        out_s = one_way + snap.transfer_s(a.origin, d.dc, info)
        limit = self.sc.slo.slo_for(info.tier).ttft_limit_s(info.input_tokens)
        fl = _Flight(
            a,
            rec,
            pool,
            prefill_s,
            d.predicted_dc_ttft_s,
            one_way,
            now + out_s,
            spilled,
            limit if limit is not None else math.inf,
        )
        self.flights[info.request_id] = fl
        pool.pending.append(fl)
        rec.dc = d.dc
        env.schedule(out_s, pool.sim.submit, a.trace, rec)
        if a.trace.client_timeout_s is not None:
            env.schedule_at(
                info.arrival_s + a.trace.client_timeout_s + one_way,
                pool.sim.cancel,
                info.request_id,
            )

    def _first_token(self, fl: _Flight) -> None:
        fl.ft_seen = True
        pv = fl.pool.view
        pv.accounting.on_first_token(fl.prefill_s)
        ft = fl.record.first_token_s
        if ft is not None:
            if not fl.counted and ft + fl.back_s - fl.record.arrival_s > fl.ttft_limit_s:
                # the TTFT miss is known now; report it without waiting for the end
                fl.counted = True
                self._cyc_dc.setdefault(pv.dc, []).append((self.env.now, False, fl.spilled))
            self.selector.on_first_token(
                FleetFirstToken(
                    fl.arrival.trace.info,
                    pv.dc,
                    pv.model,
                    pv.version,
                    ft - fl.at_dc_s,
                    fl.predicted_dc_s,
                )
            )

    def _on_done(self, key: tuple[str, str, str], rec: RequestRecord) -> None:
        fl = self.flights.pop(rec.request_id, None)
        if fl is None:
            return
        if not fl.ft_seen:
            self._first_token(fl)
        if rec.first_token_s is not None:
            rec.first_token_s += fl.back_s
        if rec.finish_s is not None:
            rec.finish_s += fl.back_s
        info = fl.arrival.trace.info
        self.selector.on_complete(FleetCompletion(info, key[0], rec.status, rec.output_tokens))
        if rec.status == "completed":
            self.outputs.observe(info.tenant, info.task_type, rec.output_tokens)
        self._finalize(rec, fl)

    def _finalize(self, rec: RequestRecord, fl: _Flight | None) -> None:
        judge([rec], self.sc.slo)
        self.records.append(rec)
        if fl is not None and not fl.counted:
            self._cyc_dc.setdefault(rec.dc, []).append((self.env.now, rec.slo_met, fl.spilled))
        self._done += 1
        if self.progress is not None and (self._done % 500 == 0 or self._done == self._total):
            self.progress(self._done, self._total)

    # -- short cycle ----------------------------------------------------------------
    def _short_cycle(self) -> None:
        now = self.env.now
        snap = self.snap
        snap.now_s = now
        for pool in self.pools.values():
            pv = pool.view
            ready = [i for i, s in enumerate(pool.slots) if s == READY]
            pv.ready_instances = len(ready)
            pv.warming_instances = pool.count(WARMING)
            ms = pool.sim.metrics
            pv.running = sum(ms[i].num_running for i in ready)
            pv.waiting = sum(ms[i].num_waiting for i in ready)
            pv.kv_usage = (sum(ms[i].kv_usage for i in ready) / len(ready)) if ready else 0.0
            pv.scraped_at_s = max((ms[i].scraped_at_s for i in ready), default=now)
            if pool.pending:
                keep = []
                for fl in pool.pending:
                    if fl.ft_seen:
                        continue
                    if fl.record.first_token_s is not None:
                        self._first_token(fl)
                    else:
                        keep.append(fl)
                pool.pending = keep
            if pv.ready_instances:
                pool.load_sum += pv.load(now)
                pool.load_n += 1
        # probed RTTs, including active latency spikes
        rtt = dict(self.topo.rtt_s)
        self._spikes = [s for s in self._spikes if s[1] > now]
        for start, _, dc, extra in self._spikes:
            if start <= now:
                for a, b in rtt:
                    if a == dc or b == dc:
                        rtt[(a, b)] += extra
        snap.rtt_s = rtt
        if self.planner is not None:
            shares = self.planner.current.spill_share
            for n, v in self.views.items():
                v.spill_share = shares.get(n, 1.0)
        if now >= self._next_sample:
            self._sample(now)
            self._next_sample = now + SAMPLE_S
        if not self._finished():
            self.env.schedule(self.settings.scrape_interval_s, self._short_cycle)

    def _sample(self, now: float) -> None:
        self._ts_t.append(round(now, 3))
        by_dc: dict[str, list[float]] = {}
        for (dc, _, _), pool in self.pools.items():
            pv = pool.view
            acc = by_dc.setdefault(dc, [0.0, 0.0])
            if pv.ready_instances:
                acc[0] += pv.load(now) * pv.ready_instances
                acc[1] += pv.ready_instances
        for dc in self._ts_load:
            acc = by_dc.get(dc, [0.0, 0.0])
            self._ts_load[dc].append(round(acc[0] / acc[1], 4) if acc[1] else 0.0)
            self._ts_ready[dc].append(int(acc[1]))
            self._ts_share[dc].append(self.views[dc].spill_share)

    # -- long cycle -------------------------------------------------------------------
    def _long_cycle(self) -> None:
        assert self.planner is not None
        now = self.env.now
        span = max(1e-9, now - self._cyc_start)
        target_default = self.settings.attainment_target
        # A request still waiting for its first token past its TTFT limit has
        # already missed: report it now, as a live gateway would, instead of
        # whenever it finally completes.
        for fl in self.flights.values():
            if (
                not fl.counted
                and fl.record.first_token_s is None
                and now - fl.record.arrival_s > fl.ttft_limit_s
            ):
                fl.counted = True
                self._cyc_dc.setdefault(fl.record.dc, []).append((now, False, fl.spilled))
        keys = set(self.pools) | set(self._cyc_demand)
        stats = []
        for key in sorted(keys):
            dc, model, version = key
            pool = self.pools.get(key)
            prof_name = self.profile_of.get((model, version))
            if prof_name is None:
                continue
            tp = pool.tp if pool is not None else get_profile(prof_name).tp
            stats.append(
                PoolStats(
                    dc=dc,
                    model=model,
                    version=version,
                    tp=tp,
                    replicas=pool.active if pool is not None else 0,
                    ready=pool.count(READY) if pool is not None else 0,
                    demand_work_s=self._cyc_demand.get(key, 0.0) / span,
                    served_work_s=self._cyc_served_work.get(key, 0.0) / span,
                    load=(pool.load_sum / pool.load_n) if pool is not None and pool.load_n else 0.0,
                )
            )
        dcs = {}
        for name, site in self.topo.datacenters.items():
            if site.entry:
                continue
            outcomes = self._cyc_dc.get(name, [])
            recent = [o for o in outcomes if o[0] >= now - self.settings.long_cycle_s / 2]
            dcs[name] = DCStats(
                dc=name,
                served=len(outcomes),
                slo_met=sum(1 for o in outcomes if o[1]),
                spilled_in=sum(1 for o in outcomes if o[2]),
                recent_served=len(recent),
                recent_slo_met=sum(1 for o in recent if o[1]),
                recent_spilled_in=sum(1 for o in recent if o[2]),
                target=(
                    site.attainment_target if site.attainment_target is not None else target_default
                ),
                free_gpus=site.gpus - self._gpus_used(name),
                load_ceiling=site.load_ceiling,
                spill_in_ceiling=site.spill_in_ceiling,
            )
        inp = PlannerInput(
            now_s=now,
            pools=stats,
            dcs=dcs,
            gpu_budget=self.settings.gpu_budget,
            gpus_used=self._gpus_used(),
        )
        before = self.planner.current
        plan, rollbacks = self.planner.step(inp)
        if plan is not before:
            self._enact(plan)
            self.plans.append(_plan_json(plan, dcs))
        for rb in rollbacks:
            self.rollbacks.append(_rollback_json(rb))
        # next cycle
        self._cyc_start = now
        self._cyc_demand.clear()
        self._cyc_served_work.clear()
        self._cyc_dc.clear()
        for pool in self.pools.values():
            pool.load_sum = 0.0
            pool.load_n = 0
        if self._arrivals_left > 0:  # nothing left to plan for once traffic ends
            self.env.schedule(self.settings.long_cycle_s, self._long_cycle)

    def _enact(self, plan: Plan) -> None:
        """Make replica counts match the plan: new replicas prewarm, extra ones drain."""
        # removals first, so that moves free their GPUs before the adds claim them
        for key, want in sorted(plan.replicas.items()):
            pool = self.pools.get(key)
            if pool is None or pool.active <= want:
                continue
            for state in (WARMING, DOWN, READY):
                for i in reversed(range(len(pool.slots))):
                    if pool.active <= want:
                        break
                    if pool.slots[i] == state:
                        pool.set(i, OFF)
        for key, want in sorted(plan.replicas.items()):
            pool = self.pools.get(key)
            if want <= (pool.active if pool is not None else 0):
                continue
            pool = self._pool(*key)
            site = self.topo.datacenters[key[0]]
            for i in range(len(pool.slots)):
                if pool.active >= want:
                    break
                if pool.slots[i] != OFF:
                    continue
                if self._gpus_used(key[0]) + pool.tp > site.gpus:
                    break  # the planner respects slots; never overfill a site
                budget = self.settings.gpu_budget
                if budget is not None and self._gpus_used() + pool.tp > budget:
                    break
                pool.set(i, WARMING)
                self.env.schedule(self.settings.prewarm_s, self._warm_done, pool, i, pool.gen[i])

    def _warm_done(self, pool: _Pool, i: int, gen: int) -> None:
        if pool.gen[i] == gen and pool.slots[i] == WARMING:
            pool.set(i, READY)

    # -- timeline events ---------------------------------------------------------------
    def _note(self, ev: TimelineEvent, **details: Any) -> None:
        d: dict[str, Any] = {"at_s": round(self.env.now, 3), "kind": ev.kind, "dc": ev.dc}
        d.update(details)
        self.timeline.append(d)

    def _matching(self, ev: TimelineEvent) -> list[_Pool]:
        return [
            p
            for k, p in sorted(self.pools.items())
            if k[0] == ev.dc
            and (not ev.model or k[1] == ev.model)
            and (not ev.version or k[2] == ev.version)
        ]

    def _apply_event(self, ev: TimelineEvent) -> None:
        if ev.kind == "endpoints_unready":
            n = 0
            limit = ev.instances if ev.instances is not None else 1 << 30
            downed: list[tuple[_Pool, int]] = []
            for pool in self._matching(ev):
                for i in reversed(range(len(pool.slots))):
                    if n < limit and pool.slots[i] == READY:
                        pool.set(i, DOWN)
                        downed.append((pool, i))
                        n += 1
            self._note(ev, instances=n, duration_s=ev.duration_s)
            if ev.duration_s is not None:
                self.env.schedule(ev.duration_s, self._recover, ev, downed)
        elif ev.kind == "endpoints_ready":
            n = 0
            for pool in self._matching(ev):
                for i, s in enumerate(pool.slots):
                    if s == DOWN:
                        pool.set(i, READY)
                        n += 1
            self._note(ev, instances=n)
        elif ev.kind == "latency_spike":
            now = self.env.now
            end = now + (ev.duration_s if ev.duration_s is not None else math.inf)
            self._spikes.append((now, end, ev.dc, ev.extra_ms / 1000.0))
            self._note(ev, extra_ms=ev.extra_ms, duration_s=ev.duration_s)
        elif ev.kind == "slowdown":
            self._slow[ev.dc] = ev.factor
            for (dc, _, _), pool in self.pools.items():
                if dc == ev.dc:
                    for e in pool.sim.engines:
                        e.profile = _slowed(pool.profile, ev.factor)
            self._note(ev, factor=ev.factor, duration_s=ev.duration_s)
            if ev.duration_s is not None:
                self.env.schedule(ev.duration_s, self._unslow, ev)
        elif ev.kind == "rollout":
            old = self.pools.get((ev.dc, ev.model, ev.version))
            total = ev.instances if ev.instances is not None else (old.active if old else 0)
            self._note(ev, version=ev.version, to_version=ev.to_version, instances=total)
            self._rollout_step(ev, total)

    def _recover(self, ev: TimelineEvent, downed: list[tuple[_Pool, int]]) -> None:
        n = 0
        for pool, i in downed:
            if pool.slots[i] == DOWN:
                pool.set(i, READY)
                n += 1
        self.timeline.append(
            {"at_s": round(self.env.now, 3), "kind": "endpoints_ready", "dc": ev.dc, "instances": n}
        )

    def _unslow(self, ev: TimelineEvent) -> None:
        self._slow.pop(ev.dc, None)
        for (dc, _, _), pool in self.pools.items():
            if dc == ev.dc:
                for e in pool.sim.engines:
                    e.profile = pool.profile
        self.timeline.append({"at_s": round(self.env.now, 3), "kind": "slowdown_end", "dc": ev.dc})

    def _rollout_step(self, ev: TimelineEvent, left: int) -> None:
        """Rolling update: ``batch`` old replicas drain, as many new ones prewarm; the
        next batch starts when these are ready (maxSurge 0, maxUnavailable batch)."""
        old = self.pools.get((ev.dc, ev.model, ev.version))
        if old is None or left <= 0:
            return
        new = self._pool(ev.dc, ev.model, ev.to_version)
        moved = 0
        for i in reversed(range(len(old.slots))):
            if moved >= min(ev.batch, left):
                break
            if old.slots[i] in (READY, DOWN, WARMING):
                old.set(i, OFF)
                moved += 1
        for _ in range(moved):
            for j, s in enumerate(new.slots):
                if s == OFF:
                    new.set(j, WARMING)
                    self.env.schedule(self.settings.prewarm_s, self._warm_done, new, j, new.gen[j])
                    break
        if moved and left - moved > 0:
            self.env.schedule(self.settings.prewarm_s, self._rollout_step, ev, left - moved)

    # -- results --------------------------------------------------------------------------
    def _result(self, wall_s: float) -> FleetRun:
        recs = sorted(self.records, key=lambda r: (r.arrival_s, r.request_id))
        slo = self.sc.slo
        duration = self.sc.duration_s
        busy = [
            b
            for p in self.pools.values()
            for b, s in zip(p.sim.busy_s(), p.slots, strict=False)
            if s != OFF or b > 0
        ]
        summary = summarize(recs, slo, duration_s=duration, busy_s=busy)
        home_of = _homes(self.sc)
        per_dc: dict[str, dict[str, Any]] = {}
        for name, site in self.topo.datacenters.items():
            if site.entry:
                continue
            mine = [r for r in recs if r.dc == name]
            s = summarize(mine, slo, duration_s=duration) if mine else None
            loads = self._ts_load.get(name, [])
            per_dc[name] = {
                "region": site.region,
                "requests": len(mine),
                "spilled_in": sum(1 for r in mine if home_of(r.request_id) != name),
                "home_requests": sum(1 for r in recs if home_of(r.request_id) == name),
                "goodput_tok_s": s["goodput_tok_s"] if s else 0.0,
                "throughput_tok_s": s["throughput_tok_s"] if s else 0.0,
                "slo_attainment": s["slo_attainment"] if s else None,
                "ttft_p50_s": s["ttft_p50_s"] if s else None,
                "ttft_p95_s": s["ttft_p95_s"] if s else None,
                "load_mean": sum(loads) / len(loads) if loads else 0.0,
                "replicas_end": {
                    f"{k[1]}@{k[2]}": p.active
                    for k, p in self.pools.items()
                    if k[0] == name and p.active
                },
            }
        n = len(recs)
        bins = sorted(self._bins)
        spill_ts = {
            "bin_s": BIN_S,
            "t": [b * BIN_S for b in bins],
            "arrivals": [self._bins[b][0] for b in bins],
            "spill_share": [
                self._bins[b][1] / self._bins[b][0] if self._bins[b][0] else 0.0 for b in bins
            ],
            "to": {
                dc: [
                    self._bins_to.get(b, {}).get(dc, 0) / self._bins[b][0]
                    if self._bins[b][0]
                    else 0.0
                    for b in bins
                ]
                for dc in self._ts_load
            },
        }
        return FleetRun(
            policy=self.policy,
            records=recs,
            summary=summary,
            per_dc=per_dc,
            spill_fraction=self.spilled / n if n else 0.0,
            residency_violations=self.residency_violations,
            version_mismatches=self.version_mismatches,
            no_candidate=self.no_candidate,
            plans=self.plans,
            rollbacks=self.rollbacks,
            timeline=self.timeline,
            timeseries={
                "t": self._ts_t,
                "load": self._ts_load,
                "ready": self._ts_ready,
                "plan_spill_share": self._ts_share,
                "spill": spill_ts,
            },
            wall_s=wall_s,
            preemptions=sum(p.sim.preemptions() for p in self.pools.values()),
        )


def _homes(sc: Scenario) -> Callable[[str], str]:
    by_stream = {s.name: s.home for s in sc.streams}

    def home(request_id: str) -> str:
        return by_stream.get(request_id.split("/", 1)[0], "")

    return home


def _plan_json(plan: Plan, dcs: Mapping[str, DCStats]) -> dict[str, Any]:
    return {
        "plan_id": plan.plan_id,
        "at_s": round(plan.at_s, 3),
        "kind": plan.kind,
        "reason": plan.reason,
        "actions": [
            {
                "kind": a.kind,
                "dc": a.dc,
                "model": a.model,
                "version": a.version,
                "count": a.count,
                "value": a.value,
                "reason": a.reason,
            }
            for a in plan.actions
        ],
        "spill_share": dict(plan.spill_share),
        "attainment_last_cycle": {n: s.attainment for n, s in dcs.items()},
    }


def _rollback_json(rb: RollbackEvent) -> dict[str, Any]:
    return {
        "at_s": round(rb.at_s, 3),
        "dc": rb.dc,
        "attainment": rb.attainment,
        "recent_attainment": rb.recent_attainment,
        "target": rb.target,
        "spilled_in_share": rb.spilled_in_share,
        "spill_share_before": rb.spill_share_before,
        "spill_share_after": rb.spill_share_after,
        "restored_plan_id": rb.restored_plan_id,
        "plan_id": rb.plan_id,
    }


def run_fleets(
    sc: Scenario,
    policies: Sequence[str],
    seed: int = 0,
    progress: Callable[[str, int], Callable[[int, int], None]] | None = None,
) -> list[FleetRun]:
    """Replay the scenario's workload under each fleet policy (same arrivals)."""
    for p in policies:
        FLEET.get(p)  # fail fast on a typo
    rates: dict[str, float] = {}
    arrivals = build_workload(sc, seed, rates)
    if not arrivals:
        raise ConfigError("the scenario's workload has no requests")
    runs = []
    for p in policies:
        cb = progress(p, len(arrivals)) if progress is not None else None
        run = FleetSim(sc, p, seed=seed, progress=cb).run(arrivals)
        run.stream_rates_rps = dict(rates)
        runs.append(run)
    return runs
