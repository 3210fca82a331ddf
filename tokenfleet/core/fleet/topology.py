"""The fleet topology: datacenters, model deployments, WAN RTTs and tenants.

A topology is configuration an operator really has: where the sites are,
which model *and version* each one serves, how far apart they are, and which
tenants may use which sites and regions (data residency). Parsing is pure
(a mapping in, frozen dataclasses out); reading the YAML file is the
caller's job, so this module stays free of I/O like the rest of the core.

Every validation error names the offending field with a dotted path, e.g.
``datacenters.B.deployments[0].instances``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.errors import ValidationError


@dataclass(frozen=True, slots=True)
class Deployment:
    """``instances`` replicas of one model version at one datacenter."""

    model: str
    version: str
    profile: str  # engine profile name (tokenfleet.engine.profiles.PROFILES)
    instances: int
    ready: bool = True  # endpoints pass readiness checks at start
    router: str = ""  # in-DC router; "" = the fleet default

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.version)


@dataclass(frozen=True, slots=True)
class Datacenter:
    name: str
    region: str
    entry: bool = False  # takes requests, holds no GPUs
    gpus: int = 0  # GPU slots on site; deployments use instances x tp
    load_ceiling: float = 0.85  # above it, no spilled-in work is accepted
    reserve_local: float = 0.0  # capacity fraction held back for local demand
    attainment_target: float | None = None  # None: the fleet default
    deployments: tuple[Deployment, ...] = ()

    @property
    def spill_in_ceiling(self) -> float:
        """Load above which this DC refuses spilled-in work."""
        return min(self.load_ceiling, 1.0 - self.reserve_local)


@dataclass(frozen=True, slots=True)
class Tenant:
    """Permissions and residency of one tenant.

    ``allowed_dcs`` / ``allowed_regions`` of ``None`` mean "no restriction".
    ``allow_cross_region=False`` pins the tenant's requests to their data
    region (and FleetMind never spills them away from home).
    """

    name: str
    home: str | None = None
    allowed_dcs: frozenset[str] | None = None
    allowed_regions: frozenset[str] | None = None
    allow_cross_region: bool = True


@dataclass(frozen=True, slots=True)
class FleetSettings:
    scrape_interval_s: float = 0.5  # short cycle: DC aggregates refresh
    pool_scrape_interval_s: float = 0.1  # engine /metrics scrape inside a DC
    long_cycle_s: float = 60.0  # planner period
    prewarm_s: float = 30.0  # a new replica is ready this long after the plan
    gpu_budget: int | None = None  # fleet-wide GPU cap for the planner
    attainment_target: float = 0.9
    wan_bytes_per_s: float = 1.25e9  # 10 Gb/s per request stream
    prompt_bytes_per_token: float = 4.0  # prompt text on the wire
    default_router: str = ""  # "" = tokenpilot when registered, else round_robin


@dataclass(frozen=True)
class Topology:
    name: str
    datacenters: Mapping[str, Datacenter]
    rtt_s: Mapping[tuple[str, str], float]
    tenants: Mapping[str, Tenant]
    settings: FleetSettings = field(default_factory=FleetSettings)
    description: str = ""

    def rtt(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.rtt_s[(a, b)]

    @property
    def entry(self) -> str | None:
        for dc in self.datacenters.values():
            if dc.entry:
                return dc.name
        return None

    def tenant(self, name: str) -> Tenant:
        """Unknown tenants get no restrictions and no home."""
        return self.tenants.get(name) or Tenant(name)

    def gpus_in_use(self, tp_of: Mapping[str, int]) -> int:
        return sum(
            d.instances * tp_of[d.profile]
            for dc in self.datacenters.values()
            for d in dc.deployments
        )


# ---------------------------------------------------------------------------
# parsing and validation
# ---------------------------------------------------------------------------
_TOP_KEYS = {"name", "description", "settings", "datacenters", "rtt_ms", "tenants"}
_DC_KEYS = {
    "region",
    "entry",
    "gpus",
    "load_ceiling",
    "reserve_local",
    "attainment_target",
    "deployments",
}
_DEP_KEYS = {"model", "version", "profile", "instances", "ready", "router"}
_TENANT_KEYS = {"home", "allowed_dcs", "allowed_regions", "allow_cross_region"}


class _Ctx:
    """Validation helpers that know the source name."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, fld: str, problem: str) -> ValidationError:
        return ValidationError(self.source, fld, problem)

    def mapping(self, v: Any, fld: str) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.fail(fld, f"must be a mapping, got {type(v).__name__}")
        return v

    def keys(self, m: Mapping[str, Any], allowed: set[str], fld: str) -> None:
        for k in m:
            if k not in allowed:
                where = f"{fld}.{k}" if fld else str(k)
                raise self.fail(where, f"unknown field; use one of {sorted(allowed)}")

    def string(self, v: Any, fld: str) -> str:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            v = str(v)  # versions like 2 or 1.5 written without quotes
        if not isinstance(v, str) or not v.strip():
            raise self.fail(fld, "must be a non-empty string")
        return v.strip()

    def number(
        self, v: Any, fld: str, lo: float = 0.0, hi: float = math.inf, lo_open: bool = False
    ) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.fail(fld, f"must be a finite number, got {v!r}")
        f = float(v)
        if f < lo or (lo_open and f == lo) or f > hi:
            rng = f"{'>' if lo_open else '>='} {lo:g}" + (
                "" if hi == math.inf else f" and <= {hi:g}"
            )
            raise self.fail(fld, f"must be {rng}, got {v!r}")
        return f

    def integer(self, v: Any, fld: str, lo: int = 0) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(fld, f"must be an integer, got {v!r}")
        if v < lo:
            raise self.fail(fld, f"must be >= {lo}, got {v}")
        return v

    def boolean(self, v: Any, fld: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(fld, f"must be true or false, got {v!r}")
        return v

    def names(self, v: Any, fld: str, known: Sequence[str], what: str) -> frozenset[str]:
        if not isinstance(v, (list, tuple)):
            raise self.fail(fld, f"must be a list of {what} names")
        out = set()
        for i, x in enumerate(v):
            s = self.string(x, f"{fld}[{i}]")
            if s not in known:
                raise self.fail(
                    f"{fld}[{i}]", f"unknown {what} '{s}'; known: {', '.join(sorted(known))}"
                )
            out.add(s)
        return frozenset(out)


def parse_topology(
    data: Mapping[str, Any],
    source: str = "<topology>",
    *,
    extra_keys: Sequence[str] = (),
    profile_tp: Mapping[str, int] | None = None,
    routers: Sequence[str] | None = None,
) -> Topology:
    """Build and validate a :class:`Topology` from a parsed YAML mapping.

    ``extra_keys`` are top-level sections another layer owns (the simulator's
    ``workload`` and ``events``). ``profile_tp`` maps known engine profiles to
    their GPUs per replica, ``routers`` lists known in-DC routers; when given,
    deployments are checked against them.
    """
    c = _Ctx(source)
    data = c.mapping(data, "(top level)")
    c.keys(data, _TOP_KEYS | set(extra_keys), "")
    name = c.string(data.get("name", "topology"), "name")
    settings = _settings(c, data.get("settings", {}) or {})

    raw_dcs = c.mapping(data.get("datacenters"), "datacenters") if "datacenters" in data else None
    if not raw_dcs:
        raise c.fail("datacenters", "must list at least one datacenter")
    dcs: dict[str, Datacenter] = {}
    for dc_name, raw in raw_dcs.items():
        dname = c.string(dc_name, "datacenters")
        dcs[dname] = _datacenter(c, dname, raw, settings, profile_tp, routers)
    entries = [d.name for d in dcs.values() if d.entry]
    if len(entries) > 1:
        raise c.fail(
            f"datacenters.{entries[1]}.entry",
            f"only one entry site is supported, '{entries[0]}' is already one",
        )
    if not any(d.deployments for d in dcs.values()):
        raise c.fail("datacenters", "no datacenter deploys a model; add deployments")

    rtt = _rtt(c, data.get("rtt_ms"), list(dcs))
    tenants = _tenants(c, data.get("tenants", {}) or {}, dcs)

    if settings.gpu_budget is not None and profile_tp is not None:
        used = sum(
            d.instances * profile_tp[d.profile] for dc in dcs.values() for d in dc.deployments
        )
        if used > settings.gpu_budget:
            raise c.fail(
                "settings.gpu_budget",
                f"the deployments already use {used} GPUs, more than the budget "
                f"of {settings.gpu_budget}; raise the budget or deploy fewer replicas",
            )
    desc = data.get("description", "")
    return Topology(
        name=name,
        datacenters=dcs,
        rtt_s=rtt,
        tenants=tenants,
        settings=settings,
        description=str(desc or ""),
    )


def _settings(c: _Ctx, raw: Any) -> FleetSettings:
    m = c.mapping(raw, "settings")
    allowed = set(FleetSettings.__slots__)
    c.keys(m, allowed, "settings")
    kw: dict[str, Any] = {}
    for k, v in m.items():
        fld = f"settings.{k}"
        if k == "gpu_budget":
            kw[k] = None if v is None else c.integer(v, fld, 0)
        elif k == "default_router":
            kw[k] = "" if v in (None, "") else c.string(v, fld)
        elif k == "attainment_target":
            kw[k] = c.number(v, fld, 0.0, 1.0)
        elif k in (
            "scrape_interval_s",
            "pool_scrape_interval_s",
            "long_cycle_s",
            "wan_bytes_per_s",
        ):
            kw[k] = c.number(v, fld, 0.0, lo_open=True)
        else:
            kw[k] = c.number(v, fld, 0.0)
    s = FleetSettings(**kw)
    if s.long_cycle_s < s.scrape_interval_s:
        raise c.fail("settings.long_cycle_s", "must be at least settings.scrape_interval_s")
    return s


def _datacenter(
    c: _Ctx,
    name: str,
    raw: Any,
    settings: FleetSettings,
    profile_tp: Mapping[str, int] | None,
    routers: Sequence[str] | None,
) -> Datacenter:
    base = f"datacenters.{name}"
    m = c.mapping(raw, base)
    c.keys(m, _DC_KEYS, base)
    if "region" not in m:
        raise c.fail(f"{base}.region", "missing; every site needs a region (data residency)")
    region = c.string(m["region"], f"{base}.region")
    entry = c.boolean(m.get("entry", False), f"{base}.entry")
    ceiling = c.number(m.get("load_ceiling", 0.85), f"{base}.load_ceiling", 0.0, 2.0)
    reserve = c.number(m.get("reserve_local", 0.0), f"{base}.reserve_local", 0.0, 1.0)
    target = m.get("attainment_target")
    target_f = None if target is None else c.number(target, f"{base}.attainment_target", 0.0, 1.0)
    raw_deps = m.get("deployments", []) or []
    if not isinstance(raw_deps, list):
        raise c.fail(f"{base}.deployments", "must be a list of deployments")
    if entry and raw_deps:
        raise c.fail(
            f"{base}.deployments",
            "an entry site holds no GPUs; move the "
            "deployments to another site or drop 'entry: true'",
        )
    deps: list[Deployment] = []
    seen: set[tuple[str, str]] = set()
    gpus_needed = 0
    for i, rd in enumerate(raw_deps):
        fld = f"{base}.deployments[{i}]"
        dm = c.mapping(rd, fld)
        c.keys(dm, _DEP_KEYS, fld)
        for req in ("model", "version", "profile"):
            if req not in dm:
                raise c.fail(f"{fld}.{req}", "missing")
        dep = Deployment(
            model=c.string(dm["model"], f"{fld}.model"),
            version=c.string(dm["version"], f"{fld}.version"),
            profile=c.string(dm["profile"], f"{fld}.profile"),
            instances=c.integer(dm.get("instances", 1), f"{fld}.instances", 0),
            ready=c.boolean(dm.get("ready", True), f"{fld}.ready"),
            router=(
                "" if dm.get("router") in (None, "") else c.string(dm["router"], f"{fld}.router")
            ),
        )
        if profile_tp is not None and dep.profile not in profile_tp:
            raise c.fail(
                f"{fld}.profile",
                f"unknown engine profile '{dep.profile}'; "
                f"choose one of {', '.join(sorted(profile_tp))}",
            )
        if routers is not None and dep.router and dep.router not in routers:
            raise c.fail(
                f"{fld}.router",
                f"unknown router '{dep.router}'; choose one of {', '.join(sorted(routers))}",
            )
        if dep.key in seen:
            raise c.fail(
                f"{fld}.version",
                f"{dep.model} version {dep.version} is deployed "
                f"twice at {name}; merge the two entries",
            )
        seen.add(dep.key)
        if profile_tp is not None:
            gpus_needed += dep.instances * profile_tp[dep.profile]
        deps.append(dep)
    gpus_default = gpus_needed
    gpus = c.integer(m.get("gpus", gpus_default), f"{base}.gpus", 0)
    if entry and gpus:
        raise c.fail(f"{base}.gpus", "an entry site holds no GPUs; set it to 0")
    if gpus < gpus_needed:
        raise c.fail(
            f"{base}.gpus",
            f"the deployments need {gpus_needed} GPUs but the "
            f"site has {gpus}; raise gpus or deploy fewer instances",
        )
    return Datacenter(
        name=name,
        region=region,
        entry=entry,
        gpus=gpus,
        load_ceiling=ceiling,
        reserve_local=reserve,
        attainment_target=target_f,
        deployments=tuple(deps),
    )


def _rtt(c: _Ctx, raw: Any, names: list[str]) -> dict[tuple[str, str], float]:
    """Symmetric RTT matrix from ``rtt_ms: {A: {B: 5}}``; each pair given once
    (either direction) or twice with the same value."""
    out: dict[tuple[str, str], float] = {}
    if len(names) == 1:
        return out
    if raw is None:
        raise c.fail("rtt_ms", "missing; give the round trip in ms between every pair of sites")
    m = c.mapping(raw, "rtt_ms")
    for a, row in m.items():
        a = c.string(a, "rtt_ms")
        if a not in names:
            raise c.fail(f"rtt_ms.{a}", f"unknown site '{a}'; known: {', '.join(names)}")
        rm = c.mapping(row, f"rtt_ms.{a}")
        for b, v in rm.items():
            b = c.string(b, f"rtt_ms.{a}")
            fld = f"rtt_ms.{a}.{b}"
            if b not in names:
                raise c.fail(fld, f"unknown site '{b}'; known: {', '.join(names)}")
            if a == b:
                raise c.fail(fld, "a site's RTT to itself is 0 by definition; remove it")
            ms = c.number(v, fld, 0.0)
            s = ms / 1000.0
            prev = out.get((a, b))
            if prev is not None and abs(prev - s) > 1e-12:
                raise c.fail(
                    fld,
                    f"conflicts with rtt_ms.{b}.{a} ({prev * 1000:g} ms); "
                    "RTTs are symmetric, give one value",
                )
            out[(a, b)] = out[(b, a)] = s
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if (a, b) not in out:
                raise c.fail(f"rtt_ms.{a}.{b}", "missing; every pair of sites needs an RTT")
    return out


def _tenants(c: _Ctx, raw: Any, dcs: Mapping[str, Datacenter]) -> dict[str, Tenant]:
    m = c.mapping(raw, "tenants")
    names = list(dcs)
    regions = sorted({d.region for d in dcs.values()})
    out: dict[str, Tenant] = {}
    for tname, traw in m.items():
        t = c.string(tname, "tenants")
        base = f"tenants.{t}"
        tm = c.mapping(traw or {}, base)
        c.keys(tm, _TENANT_KEYS, base)
        home = tm.get("home")
        if home is not None:
            home = c.string(home, f"{base}.home")
            if home not in dcs:
                raise c.fail(f"{base}.home", f"unknown site '{home}'; known: {', '.join(names)}")
            if not dcs[home].deployments:
                raise c.fail(
                    f"{base}.home", f"site '{home}' deploys no model; a home must serve requests"
                )
        adcs = (
            None
            if tm.get("allowed_dcs") is None
            else c.names(tm["allowed_dcs"], f"{base}.allowed_dcs", names, "site")
        )
        aregs = (
            None
            if tm.get("allowed_regions") is None
            else c.names(tm["allowed_regions"], f"{base}.allowed_regions", regions, "region")
        )
        cross = c.boolean(tm.get("allow_cross_region", True), f"{base}.allow_cross_region")
        if home is not None:
            if adcs is not None and home not in adcs:
                raise c.fail(f"{base}.allowed_dcs", f"does not include the home site '{home}'")
            if aregs is not None and dcs[home].region not in aregs:
                raise c.fail(
                    f"{base}.allowed_regions",
                    f"does not include the home region '{dcs[home].region}'",
                )
        out[t] = Tenant(
            name=t, home=home, allowed_dcs=adcs, allowed_regions=aregs, allow_cross_region=cross
        )
    return out
