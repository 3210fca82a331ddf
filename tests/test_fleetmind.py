"""FleetMind: topology validation, residency by construction (property test),
DC selection, the long-cycle planner with rollback, and the multi-DC simulator."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.cli.main import main
from tokenfleet.core.fleet import (
    FLEET,
    BaseSelector,
    DCDecision,
    DCStats,
    DCView,
    FleetSnapshot,
    Plan,
    Planner,
    PlannerInput,
    PolicyContractError,
    PoolCosts,
    PoolStats,
    PoolView,
    Topology,
    parse_topology,
    select_dc,
)
from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.tokenpilot.estimators import OutputLengthModel
from tokenfleet.core.types import RequestInfo
from tokenfleet.engine.profiles import PROFILES, get_profile
from tokenfleet.errors import NoCandidateError, ValidationError
from tokenfleet.sim.fleet import (
    build_workload,
    load_scenario,
    residency_ok,
    run_fleets,
    scenario_from_mapping,
)

ROOT = Path(__file__).resolve().parents[1]
HOTSPOT = ROOT / "examples" / "scenarios" / "hotspot.yaml"
DEGRADED = ROOT / "examples" / "scenarios" / "hotspot-degraded.yaml"
PROFILE_70B = "llama3-70b-h200-tp4"
TP = {n: get_profile(n).tp for n in PROFILES.names()}
COSTS = PoolCosts(get_profile(PROFILE_70B))


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def dep(version: str, n: int = 1, ready: bool = True) -> dict[str, Any]:
    return {
        "model": "m",
        "version": version,
        "profile": PROFILE_70B,
        "instances": n,
        "ready": ready,
    }


def base_topology() -> dict[str, Any]:
    """A: entry; B: hotspot (r1); C: expansion (r2); D: old version (r3)."""
    return {
        "name": "t",
        # a peer router inside each DC keeps these tests independent of TokenPilot tuning
        "settings": {
            "long_cycle_s": 20,
            "prewarm_s": 10,
            "scrape_interval_s": 0.5,
            "gpu_budget": 20,
            "default_router": "sglang_cache_aware",
        },
        "datacenters": {
            "A": {"region": "r1", "entry": True},
            "B": {"region": "r1", "gpus": 4, "load_ceiling": 0.7, "deployments": [dep("2")]},
            "C": {"region": "r2", "gpus": 8, "load_ceiling": 0.7, "deployments": [dep("2")]},
            "D": {"region": "r3", "gpus": 8, "load_ceiling": 0.7, "deployments": [dep("1", 2)]},
        },
        "rtt_ms": {"A": {"B": 4, "C": 30, "D": 75}, "B": {"C": 30, "D": 75}, "C": {"D": 80}},
        "tenants": {
            "acme": {"home": "B"},
            "bank": {"home": "B", "allowed_regions": ["r1"], "allow_cross_region": False},
            "local": {"home": "D"},
        },
    }


def docs(
    name: str, tenant: str, load: float, version: str, seed: int, **extra: Any
) -> dict[str, Any]:
    """Document QA at ``load`` x the home deployment's capacity estimate."""
    s = {
        "name": name,
        "tenant": tenant,
        "generator": "longdoc",
        "load": load,
        "seed": seed,
        "model": "m",
        "version": version,
        "options": {
            "max_tokens": 48,
            "min_doc_tokens": 1000,
            "max_doc_tokens": 4000,
            "question_gap_s": 10.0,
        },
    }
    s.update(extra)
    return s


def scenario(
    duration_s: float,
    streams: list[dict[str, Any]],
    events: list[dict[str, Any]] | None = None,
    mutate: Any = None,
) -> Any:
    data = base_topology()
    data["workload"] = {"duration_s": duration_s, "streams": streams}
    if events:
        data["events"] = events
    if mutate is not None:
        mutate(data)
    return scenario_from_mapping(data, "<test>")


def topo(data: dict[str, Any] | None = None) -> Topology:
    return parse_topology(data or base_topology(), "<test>", profile_tp=TP)


def views(t: Topology, ready: dict[str, int] | None = None) -> dict[str, DCView]:
    out = {}
    for d in t.datacenters.values():
        v = DCView(d.name, d.region, d.entry, d.load_ceiling, d.reserve_local)
        for dp in d.deployments:
            n = dp.instances if dp.ready else 0
            if ready is not None and d.name in ready:
                n = ready[d.name]
            v.pools[dp.key] = PoolView(d.name, dp.model, dp.version, COSTS, ready_instances=n)
        out[d.name] = v
    return out


def snapshot(t: Topology, vs: dict[str, DCView], now_s: float = 100.0) -> FleetSnapshot:
    return FleetSnapshot(
        now_s=now_s,
        dcs=vs,
        topology=t,
        rtt_s=dict(t.rtt_s),
        prefix=PrefixIndex(),
        outputs=OutputLengthModel(),
    )


def req(
    rid: str = "r1",
    tenant: str = "acme",
    version: str = "2",
    tokens: int = 4000,
    region: str | None = None,
    cross: bool = True,
) -> RequestInfo:
    return RequestInfo(
        request_id=rid,
        arrival_s=100.0,
        input_tokens=tokens,
        max_tokens=64,
        tenant=tenant,
        model="m",
        model_version=version,
        region=region,
        allow_cross_region=cross,
        tier="interactive",
    )


def overload(pool: PoolView, now_s: float, queue_s: float) -> None:
    """Give a pool a standing queue and a busy dispatch history."""
    acc = pool.accounting
    for k in range(40):
        acc.on_dispatch(now_s - 5.0 + k * 0.125, 0.3, 0.35, pool.ready_instances)
    acc.drain_at_s = now_s + queue_s


# ---------------------------------------------------------------------------
# topology validation
# ---------------------------------------------------------------------------
def test_topology_parses_and_knows_rtts_and_entry() -> None:
    t = topo()
    assert t.entry == "A"
    assert t.rtt("A", "C") == pytest.approx(0.030) and t.rtt("C", "A") == t.rtt("A", "C")
    assert t.rtt("B", "B") == 0.0
    assert t.datacenters["D"].deployments[0].version == "1"
    assert t.tenants["bank"].allowed_regions == frozenset({"r1"})
    assert t.datacenters["C"].spill_in_ceiling == pytest.approx(0.7)


def _set(path: str, value: Any) -> Any:
    def mutate(d: dict[str, Any]) -> None:
        keys = path.split(".")
        cur: Any = d
        for k in keys[:-1]:
            cur = cur[int(k)] if isinstance(cur, list) else cur[k]
        if value is _DELETE:
            del cur[keys[-1]]
        else:
            cur[keys[-1]] = value

    return mutate


_DELETE = object()


@pytest.mark.parametrize(
    "mutate, field",
    [
        (
            _set("datacenters.B.deployments.0.instances", -1),
            "datacenters.B.deployments[0].instances",
        ),
        (
            _set("datacenters.B.deployments.0.profile", "gpt-9"),
            "datacenters.B.deployments[0].profile",
        ),
        (_set("datacenters.B.region", _DELETE), "datacenters.B.region"),
        (_set("datacenters.B.colour", "blue"), "datacenters.B.colour"),
        (_set("datacenters.B.load_ceiling", -0.5), "datacenters.B.load_ceiling"),
        (_set("datacenters.B.gpus", 2), "datacenters.B.gpus"),
        (_set("datacenters.A.deployments", [dep("2")]), "datacenters.A.deployments"),
        (_set("rtt_ms.C", {}), "rtt_ms.C.D"),
        (_set("rtt_ms.B.C", -3), "rtt_ms.B.C"),
        (_set("rtt_ms.C", {"D": 80, "B": 31}), "rtt_ms.C.B"),
        (_set("tenants.acme.home", "Z"), "tenants.acme.home"),
        (_set("tenants.bank.allowed_regions", ["r1", "mars"]), "tenants.bank.allowed_regions[1]"),
        (_set("tenants.bank.allowed_regions", ["r2"]), "tenants.bank.allowed_regions"),
        (_set("settings.gpu_budget", 12), "settings.gpu_budget"),
        (_set("settings.long_cycle_s", 0), "settings.long_cycle_s"),
    ],
)
def test_topology_errors_name_the_bad_field(mutate: Any, field: str) -> None:
    data = copy.deepcopy(base_topology())
    mutate(data)
    with pytest.raises(ValidationError) as exc:
        parse_topology(data, "topo.yaml", profile_tp=TP)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"topo.yaml: field '{field}'")


def test_scenario_errors_name_the_bad_field() -> None:
    with pytest.raises(ValidationError) as exc:
        scenario(30, [docs("s", "acme", 1.0, "2", 1, generator="nope")])
    assert exc.value.field == "workload.streams[0].generator"
    with pytest.raises(ValidationError) as exc:
        scenario(
            30, [docs("s", "acme", 1.0, "2", 1)], events=[{"at_s": 5, "kind": "meteor", "dc": "C"}]
        )
    assert exc.value.field == "events[0].kind"
    with pytest.raises(ValidationError) as exc:
        scenario(
            30,
            [docs("s", "acme", 1.0, "2", 1)],
            events=[{"at_s": 5, "kind": "rollout", "dc": "D", "model": "m", "to_version": "1"}],
        )
    assert exc.value.field == "events[0].to_version"


# ---------------------------------------------------------------------------
# residency: impossible by construction (property test)
# ---------------------------------------------------------------------------
REGIONS = ["r0", "r1", "r2"]


@st.composite
def fleet_case(draw: Any) -> tuple[dict[str, Any], RequestInfo, str | None, dict[str, Any]]:
    n = draw(st.integers(2, 5))
    names = [f"S{i}" for i in range(n)]
    entry = draw(st.booleans())
    dcs: dict[str, Any] = {}
    for i, name in enumerate(names):
        region = draw(st.sampled_from(REGIONS))
        if entry and i == 0:
            dcs[name] = {"region": region, "entry": True}
            continue
        versions = draw(st.lists(st.sampled_from(["1", "2"]), unique=True, max_size=2))
        deps = [
            {
                "model": "m",
                "version": v,
                "profile": PROFILE_70B,
                "instances": draw(st.integers(0, 2)),
                "ready": draw(st.booleans()),
            }
            for v in versions
        ]
        dcs[name] = {
            "region": region,
            "gpus": 16,
            "deployments": deps,
            "load_ceiling": draw(st.floats(0.1, 1.5)),
            "reserve_local": draw(st.floats(0.0, 0.5)),
        }
    servable = [k for k, v in dcs.items() if v.get("deployments")]
    if not servable:
        first = names[-1]
        dcs[first] = {"region": dcs[first]["region"], "gpus": 4, "deployments": [dep("2")]}
        servable = [first]
    rtt = {
        a: {b: draw(st.integers(0, 150)) for b in names[i + 1 :]} for i, a in enumerate(names[:-1])
    }
    home = draw(st.one_of(st.none(), st.sampled_from(servable)))
    allowed_dcs = draw(st.one_of(st.none(), st.lists(st.sampled_from(names), unique=True)))
    present = sorted({v["region"] for v in dcs.values()})
    allowed_regions = draw(st.one_of(st.none(), st.lists(st.sampled_from(present), unique=True)))
    if home is not None:
        if allowed_dcs is not None and home not in allowed_dcs:
            allowed_dcs.append(home)
        if allowed_regions is not None and dcs[home]["region"] not in allowed_regions:
            allowed_regions.append(dcs[home]["region"])
    tenant: dict[str, Any] = {"allow_cross_region": draw(st.booleans())}
    if home is not None:
        tenant["home"] = home
    if allowed_dcs is not None:
        tenant["allowed_dcs"] = allowed_dcs
    if allowed_regions is not None:
        tenant["allowed_regions"] = allowed_regions
    data = {"name": "prop", "datacenters": dcs, "rtt_ms": rtt, "tenants": {"t": tenant}}
    request = RequestInfo(
        request_id=f"q{draw(st.integers(0, 10_000))}",
        arrival_s=50.0,
        input_tokens=draw(st.integers(16, 20_000)),
        max_tokens=64,
        tenant="t",
        model="m",
        model_version=draw(st.sampled_from(["", "1", "2"])),
        region=draw(st.one_of(st.none(), st.sampled_from(REGIONS))),
        allow_cross_region=draw(st.booleans()),
        tier="interactive",
    )
    origin = draw(st.sampled_from(names))
    signals = {
        name: {
            "queue_s": draw(st.floats(0.0, 30.0)),
            "work": draw(st.floats(0.0, 5.0)),
            "waiting": draw(st.integers(0, 50)),
            "share": draw(st.floats(0.0, 1.0)),
        }
        for name in names
    }
    return data, request, home, {"origin": origin, "signals": signals}


def oracle_may_serve(data: dict[str, Any], request: RequestInfo, home: str | None, dc: str) -> bool:
    """A third, independent statement of the residency rule (the tests' own)."""
    site = data["datacenters"][dc]
    if site.get("entry"):
        return False
    tenant = data["tenants"]["t"]
    if "allowed_dcs" in tenant and dc not in tenant["allowed_dcs"]:
        return False
    if "allowed_regions" in tenant and site["region"] not in tenant["allowed_regions"]:
        return False
    if not (tenant["allow_cross_region"] and request.allow_cross_region):
        data_region = request.region or (data["datacenters"][home]["region"] if home else None)
        if data_region is None or site["region"] != data_region:
            return False
    return True


@settings(max_examples=200, deadline=None, database=None)
@given(fleet_case())
def test_no_policy_can_violate_residency(case: Any) -> None:
    data, request, home, extra = case
    t = parse_topology(data, "<prop>", profile_tp=TP)
    vs = views(t)
    now = 50.0
    for name, sig in extra["signals"].items():
        v = vs[name]
        v.spill_share = sig["share"]
        for pool in v.pools.values():
            pool.waiting = sig["waiting"]
            pool.scraped_at_s = now - 0.2
            if pool.ready_instances:
                pool.accounting.on_dispatch(
                    now - 1.0, sig["work"], sig["work"] * 1.2, pool.ready_instances
                )
                pool.accounting.drain_at_s = now + sig["queue_s"]
    snap = snapshot(t, vs, now)
    for policy in FLEET.names():
        selector = FLEET.create(policy, slo=SLOConfig())
        try:
            d = select_dc(selector, request, extra["origin"], home, snap)
        except NoCandidateError:
            continue
        assert oracle_may_serve(data, request, home, d.dc), (policy, d)
        # the simulator's referee agrees
        if home is not None:
            assert residency_ok(t, request, home, d.dc)
        pool = vs[d.dc].pool_for("m", request.model_version, exact=selector.exact_version)
        assert pool is not None and pool.ready_instances > 0
        if selector.exact_version and request.model_version:
            assert pool.version == request.model_version
        tenant = data["tenants"]["t"]
        pinned = not (tenant["allow_cross_region"] and request.allow_cross_region)
        if (
            policy == "fleetmind"
            and pinned
            and home is not None
            and oracle_may_serve(data, request, home, home)
            and vs[home].pool_for("m", request.model_version) is not None
        ):
            assert d.dc == home, "pinned requests never spill"


def test_a_selector_cannot_escape_the_filter() -> None:
    class Rogue(BaseSelector):
        name = "rogue_test"

        def __init__(self, **_: object) -> None:
            pass

        def select(
            self,
            request: RequestInfo,
            origin: str,
            home: str | None,
            fleet: FleetSnapshot,
            candidates: Any,
        ) -> DCDecision:
            return DCDecision(dc="C")  # outside the bank tenant's region

    FLEET.add("rogue_test", Rogue)
    try:
        t = topo()
        with pytest.raises(PolicyContractError, match="not among the compliant"):
            select_dc(
                FLEET.create("rogue_test"), req(tenant="bank"), "A", "B", snapshot(t, views(t))
            )
    finally:
        FLEET.remove("rogue_test")


def test_referee_residency_check() -> None:
    t = topo()
    assert residency_ok(t, req(tenant="acme"), "B", "D")
    assert not residency_ok(t, req(tenant="bank"), "B", "C")
    assert not residency_ok(t, req(tenant="acme", region="r1", cross=False), "B", "C")
    assert residency_ok(t, req(tenant="acme", region="r2", cross=False), "B", "C")
    assert not residency_ok(t, req(tenant="acme"), "B", "A")  # entry: no GPUs


# ---------------------------------------------------------------------------
# DC selection
# ---------------------------------------------------------------------------
def fleetmind() -> Any:
    return FLEET.create("fleetmind", slo=SLOConfig())


def test_fleetmind_stays_home_when_home_is_fine() -> None:
    t = topo()
    d = select_dc(fleetmind(), req(), "A", "B", snapshot(t, views(t)))
    assert (d.dc, d.spilled, d.reason) == ("B", False, "home")
    assert d.predicted_ttft_s is not None and d.predicted_ttft_s >= 0.004


def test_fleetmind_spills_when_home_queues_and_remote_meets_slo() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=3.0)
    d = select_dc(fleetmind(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.spilled) == ("C", True)
    # never to D: it serves version 1 only
    assert all(
        select_dc(fleetmind(), req(f"r{i}"), "A", "B", snapshot(t, vs)).dc != "D" for i in range(50)
    )


def test_fleetmind_does_not_spill_into_a_dc_above_its_ceiling() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=3.0)
    c = vs["C"].pools[("m", "2")]
    for k in range(60):  # C busy (load ~1.2) but no queue yet
        c.accounting.on_dispatch(95.0 + k * 0.08, 0.05, 0.5, 1)
    assert c.load(100.0) > vs["C"].spill_in_ceiling
    d = select_dc(fleetmind(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.reason) == ("B", "home:no-better")


def test_fleetmind_respects_spill_share_and_rtt() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=3.0)
    vs["C"].spill_share = 0.0  # the plan closed C
    d = select_dc(fleetmind(), req(), "A", "B", snapshot(t, vs))
    assert d.dc == "B"
    vs["C"].spill_share = 1.0
    snap = snapshot(t, vs)
    snap.rtt_s = {k: (v + 2.0 if "C" in k else v) for k, v in snap.rtt_s.items()}
    d = select_dc(fleetmind(), req(), "A", "B", snap)  # a 2 s RTT cannot meet the SLO
    assert d.dc == "B"


def test_fleetmind_never_spills_pinned_requests() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=10.0)
    for r in (req(tenant="bank"), req(tenant="acme", region="r1", cross=False)):
        d = select_dc(fleetmind(), r, "A", "B", snapshot(t, vs))
        assert (d.dc, d.spilled, d.reason) == ("B", False, "home:pinned")


def test_baselines() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=3.0)
    snap = snapshot(t, vs)
    assert select_dc(FLEET.create("none"), req(), "A", "B", snap).dc == "B"
    assert select_dc(FLEET.create("nearest"), req(), "A", "B", snap).dc == "B"
    assert select_dc(FLEET.create("nearest"), req(), "C", "B", snap).dc == "C"
    assert select_dc(FLEET.create("nearest"), req(), "D", "B", snap).dc == "B"  # D: v1 only
    # least_loaded ignores the version: the idle v1 site D looks best
    assert select_dc(FLEET.create("least_loaded"), req(), "A", "B", snap).dc in ("C", "D")
    vs["B"].pools[("m", "2")].ready_instances = 0  # B's endpoints unready
    with pytest.raises(NoCandidateError):
        select_dc(FLEET.create("none"), req(), "A", "B", snapshot(t, vs))
    assert select_dc(fleetmind(), req(), "A", "B", snapshot(t, vs)).reason == "failover"


def skylb() -> Any:
    return FLEET.create("skylb", slo=SLOConfig())


def busy(pool: PoolView, now_s: float, load: float) -> None:
    """Dispatch history giving ``pool`` roughly ``load`` (no standing queue)."""
    acc = pool.accounting
    n = 50
    for k in range(n):
        acc.on_dispatch(
            now_s - 5.0 + k * 5.0 / n,
            0.01,
            load * 5.0 * pool.ready_instances / n,
            pool.ready_instances,
        )
    acc.drain_at_s = now_s


def test_skylb_keeps_local_until_the_load_threshold() -> None:
    t = topo()
    vs = views(t)
    b = vs["B"].pools[("m", "2")]
    busy(b, 100.0, 0.5)  # under B's 0.7 ceiling
    assert b.load(100.0) < 0.7
    d = select_dc(skylb(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.spilled) == ("B", False)
    # C is idle and would win any load comparison; skylb still stays local
    assert vs["C"].pools[("m", "2")].load(100.0) < b.load(100.0)
    busy(b, 100.0, 0.9)  # now over the threshold: spill
    d = select_dc(skylb(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.spilled) == ("C", True)
    # an explicit threshold overrides the DC's ceiling
    d = select_dc(FLEET.create("skylb", load_threshold=5.0), req(), "A", "B", snapshot(t, vs))
    assert d.dc == "B"


def test_skylb_spills_only_to_the_exact_version_nearest_first() -> None:
    data = base_topology()
    # E: a second version-2 site, farther from A than C
    data["datacenters"]["E"] = {
        "region": "r4",
        "gpus": 8,
        "load_ceiling": 0.7,
        "deployments": [dep("2")],
    }
    data["rtt_ms"]["A"]["E"] = 60
    data["rtt_ms"]["B"]["E"] = 55
    data["rtt_ms"]["C"]["E"] = 40
    data["rtt_ms"]["D"] = {"E": 20}
    t = topo(data)
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=3.0)
    picks = {select_dc(skylb(), req(f"r{i}"), "A", "B", snapshot(t, vs)).dc for i in range(30)}
    assert picks == {"C"}  # nearest version-2 site; never D (version 1 only)
    # C full: the next nearest exact-version site, still never D
    busy(vs["C"].pools[("m", "2")], 100.0, 1.5)
    d = select_dc(skylb(), req(), "A", "B", snapshot(t, vs))
    assert d.dc == "E"
    # every remote full: stay local rather than travel to a full region
    busy(vs["E"].pools[("m", "2")], 100.0, 1.5)
    d = select_dc(skylb(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.spilled) == ("B", False)
    # D (version 1, idle) is the obvious least-loaded site, and skylb never uses it
    assert select_dc(FLEET.create("least_loaded"), req(), "A", "B", snapshot(t, vs)).dc == "D"


def test_skylb_respects_residency() -> None:
    t = topo()
    vs = views(t)
    overload(vs["B"].pools[("m", "2")], 100.0, queue_s=10.0)
    for r in (req(tenant="bank"), req(tenant="acme", region="r1", cross=False)):
        d = select_dc(skylb(), r, "A", "B", snapshot(t, vs))
        assert (d.dc, d.spilled) == ("B", False)
    # home unready: fails over to the nearest compliant exact-version site
    vs["B"].pools[("m", "2")].ready_instances = 0
    d = select_dc(skylb(), req(), "A", "B", snapshot(t, vs))
    assert (d.dc, d.reason) == ("C", "failover")
    with pytest.raises(NoCandidateError):
        select_dc(skylb(), req(tenant="bank"), "A", "B", snapshot(t, vs))


def test_skylb_on_a_small_hotspot_spills_without_violations() -> None:
    sc = scenario(60, hot_streams())
    runs = {r.policy: r for r in run_fleets(sc, ["none", "skylb"])}
    sky = runs["skylb"]
    assert sky.residency_violations == 0 and sky.version_mismatches == 0
    assert all(r.dc == "B" for r in sky.records if r.tenant == "bank")
    assert not any(r.dc == "D" for r in sky.records if r.tenant != "local")
    assert 0.0 < sky.spill_fraction < 1.0
    assert sky.summary["goodput_tok_s"] > runs["none"].summary["goodput_tok_s"]
    assert not sky.plans  # no planner


def test_cli_help_lists_the_peers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in (
        "skylb",
        "fleetmind",
        "least_loaded",
        "llmd",
        "llmd_flow_control",
        "--no-kv-events",
    ):
        assert name in out


# ---------------------------------------------------------------------------
# planner
# ---------------------------------------------------------------------------
def planner(budget_used: int = 16) -> tuple[Planner, dict[tuple[str, str, str], int]]:
    replicas = {("B", "m", "2"): 1, ("C", "m", "2"): 2, ("D", "m", "1"): 2}
    p = Planner(initial=Plan(0, 0.0, replicas, {"B": 1.0, "C": 1.0, "D": 1.0}), rtt_s=topo().rtt)
    return p, replicas


def pools(
    b_demand: float,
    c_demand: float,
    d_load: float = 0.1,
    replicas: dict[tuple[str, str, str], int] | None = None,
) -> list[PoolStats]:
    r = replicas or {("B", "m", "2"): 1, ("C", "m", "2"): 2, ("D", "m", "1"): 2}
    return [
        PoolStats("B", "m", "2", 4, r[("B", "m", "2")], r[("B", "m", "2")], b_demand, 0.9, 1.2),
        PoolStats(
            "C", "m", "2", 4, r[("C", "m", "2")], r[("C", "m", "2")], c_demand, c_demand, 0.5
        ),
        PoolStats(
            "D",
            "m",
            "1",
            4,
            r.get(("D", "m", "1"), 0),
            r.get(("D", "m", "1"), 0),
            0.05,
            0.05,
            d_load,
        ),
    ]


def dcs(c_att: float = 1.0, c_spilled: int = 0, free: int = 0) -> dict[str, DCStats]:
    return {
        "B": DCStats("B", 100, 95, 0, 0.9, 0, 0.7, 0.7),
        "C": DCStats("C", 100, int(round(100 * c_att)), c_spilled, 0.9, free, 0.7, 0.7),
        "D": DCStats("D", 50, 50, 0, 0.9, 0, 0.7, 0.7),
    }


def test_planner_does_nothing_when_spill_room_suffices() -> None:
    p, _ = planner()
    plan, rb = p.step(PlannerInput(60.0, pools(1.0, 0.3), dcs(), 20, 20))
    assert plan.plan_id == 0 and rb == []


def test_planner_moves_an_underused_replica_within_the_budget() -> None:
    p, _ = planner()
    plan, rb = p.step(PlannerInput(60.0, pools(2.2, 0.9), dcs(), 20, 20))
    assert rb == [] and plan.kind == "plan"
    kinds = {(a.kind, a.dc, a.version) for a in plan.actions}
    assert kinds == {("remove", "D", "1"), ("add", "D", "2")}
    # D keeps one replica for its own version-1 demand
    assert plan.replicas[("D", "m", "2")] == 1 and plan.replicas[("D", "m", "1")] == 1
    assert sum(plan.replicas.values()) * 4 <= 20  # the budget holds


def test_planner_prewarms_into_free_slots_only_within_the_budget() -> None:
    p, _ = planner()
    plan, _ = p.step(PlannerInput(60.0, pools(2.2, 0.9, d_load=0.9), dcs(free=4), 24, 20))
    assert [(a.kind, a.dc, a.count) for a in plan.actions] == [("add", "C", 1)]
    p2, _ = planner()
    plan2, _ = p2.step(PlannerInput(60.0, pools(2.2, 0.9, d_load=0.9), dcs(free=4), 20, 20))
    assert plan2.plan_id == 0  # no budget left and no donor: nothing to do


def test_rollback_cuts_spill_and_restores_the_previous_plan() -> None:
    p, _ = planner()
    moved, _ = p.step(PlannerInput(60.0, pools(2.2, 0.9), dcs(), 20, 20))
    assert moved.replicas[("D", "m", "2")] == 1
    # later, D (now serving spill) misses its target because of it
    after = {("B", "m", "2"): 1, ("C", "m", "2"): 2, ("D", "m", "1"): 1, ("D", "m", "2"): 1}
    ps = pools(1.0, 0.3, replicas=after)
    ps.append(PoolStats("D", "m", "2", 4, 1, 1, 0.0, 0.8, 0.9))
    bad_d = dcs()
    bad_d["D"] = DCStats("D", 100, 60, 70, 0.9, 0, 0.7, 0.7)
    plan, rb = p.step(PlannerInput(120.0, ps, bad_d, 20, 20))
    assert plan.kind == "rollback" and len(rb) == 1
    ev = rb[0]
    assert (ev.dc, ev.spill_share_before, ev.spill_share_after) == ("D", 1.0, 0.0)
    assert ev.restored_plan_id == 0 and ev.attainment == pytest.approx(0.6)
    assert plan.spill_share["D"] == 0.0
    assert plan.replicas[("D", "m", "1")] == 2 and plan.replicas[("D", "m", "2")] == 0
    # a healthy cycle later, the share comes back step by step
    ok = dcs()
    plan3, rb3 = p.step(PlannerInput(180.0, pools(1.0, 0.3), ok, 20, 20))
    assert rb3 == [] and plan3.spill_share["D"] == 0.5


def test_no_rollback_without_spilled_in_traffic() -> None:
    p, _ = planner()
    plan, rb = p.step(PlannerInput(60.0, pools(1.0, 0.3), dcs(c_att=0.5, c_spilled=2), 20, 20))
    assert rb == [] and plan.plan_id == 0


# ---------------------------------------------------------------------------
# the simulator
# ---------------------------------------------------------------------------
def test_wan_rtt_is_added_to_ttft() -> None:
    def only_c(origin: str) -> Any:
        return scenario(
            40,
            [docs("s", "far", 0.35, "2", 3, origin=origin)],
            mutate=lambda d: d["tenants"].update({"far": {"home": "C"}}),
        )

    near = run_fleets(only_c("C"), ["none"])[0]
    far = run_fleets(only_c("A"), ["none"])[0]
    assert len(near.records) == len(far.records) > 20
    diffs = sorted(
        (f.ttft_s or 0) - (n.ttft_s or 0) for n, f in zip(near.records, far.records, strict=False)
    )
    med = diffs[len(diffs) // 2]
    assert med == pytest.approx(0.030, abs=0.002)  # one round trip A<->C
    assert all(r.dc == "C" for r in far.records)


def hot_streams(load_b: float = 2.6) -> list[dict[str, Any]]:
    """B (one replica) offered ~1.5x its SLO capacity; D's local demand is light.

    ``load`` is relative to the capacity estimate; with the vLLM-V1-calibrated
    engine (faster prefill) a replica alone meets its SLO for 78% of requests
    at 2.2 and 54% at 2.6, so 2.6 is the hotspot (2.2 was, before)."""
    return [
        docs("acme", "acme", load_b, "2", 21),
        docs("bank", "bank", 0.3, "2", 22),
        docs("local", "local", 0.3, "1", 23, origin="D"),
    ]


def test_fleet_policies_on_a_small_hotspot() -> None:
    sc = scenario(90, hot_streams())
    runs = {r.policy: r for r in run_fleets(sc, ["none", "least_loaded", "fleetmind"])}
    none, naive, fm = runs["none"], runs["least_loaded"], runs["fleetmind"]
    # the referee's counters
    assert fm.residency_violations == 0 and fm.version_mismatches == 0
    assert none.version_mismatches == 0 and none.spill_fraction == 0.0
    assert naive.version_mismatches > 0  # version-2 work to D, version-1 work to B/C
    wrong = [
        r
        for r in naive.records
        if (r.dc == "D") != (r.tenant == "local") and r.dc in ("B", "C", "D")
    ]
    assert len(wrong) == naive.version_mismatches
    assert all(r.status == "rejected" for r in wrong)  # the endpoints refuse the version
    # bank never leaves its region, whatever the policy
    for run in runs.values():
        assert all(r.dc == "B" for r in run.records if r.tenant == "bank")
        assert run.residency_violations == 0
    # FleetMind beats staying home
    g = {k: v.summary["goodput_tok_s"] for k, v in runs.items()}
    assert g["fleetmind"] > 1.3 * g["none"]
    assert fm.summary["slo_attainment"] > naive.summary["slo_attainment"]
    assert 0.0 < fm.spill_fraction < 1.0
    assert set(fm.per_dc) == {"B", "C", "D"}
    assert fm.per_dc["C"]["spilled_in"] > 0


def test_plans_prewarm_with_a_delay() -> None:
    # C serves nothing, so B's excess has nowhere to go until the planner moves
    # one of D's two under-used version-1 replicas to version 2
    sc = scenario(
        70, hot_streams(2.4), mutate=lambda d: d["datacenters"]["C"].update(gpus=0, deployments=[])
    )
    fm = run_fleets(sc, ["fleetmind"])[0]
    assert fm.plans, "the planner should act"
    first = fm.plans[0]
    assert first["at_s"] == 20.0 and first["kind"] == "plan"
    assert {(a["kind"], a["dc"], a["version"]) for a in first["actions"]} >= {
        ("remove", "D", "1"),
        ("add", "D", "2"),
    }
    ts = fm.timeseries
    ready_d = dict(zip(ts["t"], ts["ready"]["D"], strict=False))
    # the new replica prewarms for 10 s: D has one ready replica less until then
    assert ready_d[15.0] == 2 and ready_d[25.0] == 1 and ready_d[35.0] == 2
    v2_at_d = [r for r in fm.records if r.dc == "D" and r.request_id.startswith("acme")]
    assert v2_at_d and min(r.arrival_s for r in v2_at_d) >= 30.0
    assert fm.version_mismatches == 0


def test_timeline_events_unready_rollout_and_spike() -> None:
    events = [
        {"at_s": 10, "kind": "endpoints_unready", "dc": "B", "duration_s": 10},
        {"at_s": 5, "kind": "rollout", "dc": "D", "model": "m", "to_version": "2"},
        {"at_s": 25, "kind": "latency_spike", "dc": "C", "extra_ms": 3000, "duration_s": 10},
    ]
    sc = scenario(40, [docs("acme", "acme", 0.7, "2", 31)], events)
    none, fm = run_fleets(sc, ["none", "fleetmind"])
    kinds = [e["kind"] for e in fm.timeline]
    assert kinds == ["rollout", "endpoints_unready", "endpoints_ready", "latency_spike"]
    # none: B unready means rejected; fleetmind fails over
    gap = [r for r in none.records if 10.0 <= r.arrival_s < 20.0]
    assert gap and all(r.status == "rejected" for r in gap)
    assert none.no_candidate == len(gap)
    moved = [r for r in fm.records if 10.5 <= r.arrival_s < 20.0]
    assert moved and all(r.dc in ("C", "D") and r.status == "completed" for r in moved)
    # after the rollout (5 s + 10 s prewarm) D serves version 2
    assert any(r.dc == "D" for r in moved)
    assert fm.per_dc["D"]["replicas_end"] == {"m@2": 2}
    # during the spike nothing goes to C (its RTT alone breaks the SLO)
    spike = [r for r in fm.records if 26.0 <= r.arrival_s < 35.0]
    assert spike and not any(r.dc == "C" for r in spike)
    assert fm.version_mismatches == 0 and fm.residency_violations == 0


def test_degraded_remote_is_rolled_back_within_one_long_cycle() -> None:
    events = [{"at_s": 30, "kind": "slowdown", "dc": "C", "factor": 4.0}]
    sc = scenario(
        80,
        hot_streams() + [docs("c", "cl", 0.5, "2", 24, origin="C")],
        events,
        mutate=lambda d: d["tenants"].update({"cl": {"home": "C"}}),
    )
    fm = run_fleets(sc, ["fleetmind"])[0]
    assert fm.rollbacks, "a rollback event must be recorded"
    rb = fm.rollbacks[0]
    assert rb["dc"] == "C" and rb["at_s"] <= 30 + 20  # long cycle is 20 s here
    assert rb["spill_share_after"] == 0.0
    assert any(p["kind"] == "rollback" for p in fm.plans)
    spilled_to_c = [r for r in fm.records if r.dc == "C" and r.tenant != "cl"]
    before = sum(1 for r in spilled_to_c if 10 <= r.arrival_s < 30)
    after = sum(1 for r in spilled_to_c if rb["at_s"] <= r.arrival_s < rb["at_s"] + 20)
    assert before > 0 and after == 0


def test_cli_topology_writes_fleet_json(tmp_path: Path) -> None:
    import yaml

    data = base_topology()
    data["workload"] = {"duration_s": 20, "streams": [docs("acme", "acme", 0.7, "2", 41)]}
    f = tmp_path / "topo.yaml"
    f.write_text(yaml.safe_dump(data))
    out = tmp_path / "out.json"
    rc = main(
        [
            "sim",
            "--topology",
            str(f),
            "--fleet",
            "none",
            "--fleet",
            "fleetmind",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "plots"),
            "--quiet",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert [r["fleet"] for r in res["runs"]] == ["none", "fleetmind"]
    for r in res["runs"]:
        assert {
            "per_dc",
            "spill_fraction",
            "residency_violations",
            "version_mismatches",
            "plans",
            "rollbacks",
            "timeline",
            "timeseries",
        } <= set(r)
        assert set(r["per_dc"]["B"]) >= {"goodput_tok_s", "slo_attainment"}
    assert (tmp_path / "plots" / "fleet_load.png").exists()
    assert (tmp_path / "plots" / "fleet_spill.png").exists()
    assert main(["sim", "--topology", str(f), "--fleet", "nope"]) == 2
    assert main(["sim", "--fleet", "none"]) == 2
    assert main(["sim", "--topology", str(tmp_path / "missing.yaml")]) == 2


# ---------------------------------------------------------------------------
# the shipped scenarios
# ---------------------------------------------------------------------------
def test_shipped_scenarios_describe_the_hotspot() -> None:
    for path in (HOTSPOT, DEGRADED):
        sc = load_scenario(path)
        t = sc.topology
        assert sorted(t.datacenters) == ["A", "B", "C", "D"] and t.entry == "A"
        assert not t.datacenters["A"].deployments
        for far in ("C", "D"):
            assert all(0.030 <= t.rtt(x, far) <= 0.080 for x in ("A", "B"))
        versions = {n: {d.version for d in dc.deployments} for n, dc in t.datacenters.items()}
        assert versions["D"] == {"1.0"} and versions["B"] == versions["C"] == {"2.0"}
        bank = t.tenants["bank"]
        assert bank.allowed_regions == {t.datacenters["B"].region}
        assert t.settings.long_cycle_s == 60
        assert build_workload(sc.with_duration(5.0))
    assert any(e.dc == "C" for e in load_scenario(DEGRADED).events)


def test_hotspot_short_run_meets_the_goodput_bar() -> None:
    sc = load_scenario(HOTSPOT).with_duration(120.0)
    runs = {r.policy: r for r in run_fleets(sc, ["none", "fleetmind"])}
    assert runs["fleetmind"].summary["goodput_tok_s"] >= 1.3 * runs["none"].summary["goodput_tok_s"]
    assert runs["fleetmind"].residency_violations == runs["fleetmind"].version_mismatches == 0


@pytest.mark.slow
def test_acceptance_hotspot_and_degraded() -> None:
    runs = {
        r.policy: r
        for r in run_fleets(load_scenario(HOTSPOT), ["none", "least_loaded", "fleetmind"])
    }
    fm, none, naive = runs["fleetmind"], runs["none"], runs["least_loaded"]
    assert fm.summary["goodput_tok_s"] >= 1.3 * none.summary["goodput_tok_s"]
    assert fm.summary["slo_attainment"] >= naive.summary["slo_attainment"] + 0.10
    assert fm.residency_violations == 0 and fm.version_mismatches == 0
    deg = run_fleets(load_scenario(DEGRADED), ["fleetmind"])[0]
    assert deg.rollbacks and deg.rollbacks[0]["dc"] == "C"
    assert deg.rollbacks[0]["at_s"] <= 150 + 60
    sp = deg.timeseries["spill"]
    to_c = dict(zip(sp["t"], sp["to"]["C"], strict=False))
    before = [v for t, v in to_c.items() if 90 <= t < 150]
    after = [v for t, v in to_c.items() if 210 <= t < 270]
    assert sum(after) / len(after) < 0.25 * sum(before) / len(before)
    assert deg.residency_violations == 0 and deg.version_mismatches == 0
    assert not math.isnan(deg.summary["goodput_tok_s"])
