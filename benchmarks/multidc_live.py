"""FleetMind live across datacenters against the simulator's prediction (issue #20).

``python benchmarks/multidc_live.py [--scenario examples/scenarios/hotspot-live.yaml]``

The scenario's topology and requests (same generator, same seed) run twice:

* in the simulator (``tokenfleet.sim.fleet.FleetSim``, the fleet policy given),
* live, laid out as ``docs/deployment.md`` deploys several regions
  (``tests/support/multidc.py``): the API and the global Redis/PostgreSQL in
  the entry DC, a broker per DC with engines, every cross-region connection
  through a TCP link that delays each chunk by half the topology's RTT; one
  emulated engine (real time) and one Celery worker per replica, each engine
  its own process; the API a process of its own; one API key per tenant.

It prints goodput (output tokens/s of requests that met their SLO), SLO
attainment, the spill fraction (requests served outside their home DC) and
requests per DC, for both, with the live/sim ratio. Live numbers count what
clients saw (``tokenfleet.live.bench``) and where the ledger says each
request ran.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.support

from tests.support.multidc import multidc_stack  # noqa: E402
from tests.support.stack import InstanceSpec  # noqa: E402
from tests.support.stores import temp_data_dir  # noqa: E402
from tokenfleet.live.bench import replay, summary  # noqa: E402
from tokenfleet.sim.fleet import FleetSim, build_workload, load_scenario, residency_ok  # noqa: E402


def _sim(sc: Any, arrivals: list[Any], policy: str, seed: int) -> dict[str, Any]:
    run = FleetSim(sc, policy, seed=seed).run(arrivals)
    per_dc = {dc: int(v.get("requests", 0)) for dc, v in run.per_dc.items()}
    return {
        "goodput_tok_s": run.summary["goodput_tok_s"],
        "slo_attainment": run.summary["slo_attainment"],
        "spill_fraction": run.spill_fraction,
        "requests_per_dc": per_dc,
        "residency_violations": run.residency_violations,
    }


def _live(sc: Any, arrivals: list[Any], policy: str, scenario: Path, args: Any) -> dict[str, Any]:
    topo = sc.topology
    raw = yaml.safe_load(scenario.read_text())
    raw.pop("workload", None)
    raw.pop("events", None)
    specs: list[InstanceSpec] = []
    profiles = set()
    for d in topo.datacenters.values():
        for dep in d.deployments:
            profiles.add(dep.profile)
            for k in range(dep.instances):
                specs.append(InstanceSpec(d.name, f"{d.name.lower()}{k}", slots=args.slots))
    if len(profiles) != 1:
        raise SystemExit(f"the live run needs one engine profile in the scenario, got {profiles}")
    entry = next((d.name for d in topo.datacenters.values() if not d.deployments), specs[0].dc)
    tenants = sorted({a.trace.info.tenant for a in arrivals})
    keys = {t: f"tf-bench-{t}" for t in tenants}
    home = {a.trace.info.request_id: a.home for a in arrivals}
    with temp_data_dir("tokenfleet-multidc-bench-") as d:
        (d / "topology.yaml").write_text(yaml.safe_dump(raw))
        with multidc_stack(
            d,
            specs,
            entry_dc=entry,
            rtt_ms=lambda a, b: 1000.0 * topo.rtt(a, b),
            profile=profiles.pop(),
            router="tokenpilot",
            time_scale=1.0,
            engines_in_process=False,
            api_in_process=False,
            # engines publish KV events to TokenPilot, as `tokenfleet up` and the
            # simulator's shipped defaults have it
            engine_kv_events=True,
            live_overrides={
                "topology": str(d / "topology.yaml"),
                "fleet_policy": policy,
                "seed_api_keys": ",".join(f"{k}={t}" for t, k in keys.items()),
                "scrape_interval_s": topo.settings.scrape_interval_s,
                "stale_after_s": max(3.0, 4 * topo.settings.scrape_interval_s),
                "request_timeout_s": 300.0,
            },
        ) as md:
            stack = md.stack
            stack.wait_ready(timeout_s=120)
            model = stack.model
            traces = [a.trace for a in arrivals]
            t0 = time.monotonic()

            def progress(done: int, total: int) -> None:
                if done % 50 == 0 or done == total:
                    print(f"  live: {done}/{total} done, {time.monotonic() - t0:.0f} s", flush=True)

            outs, wall_s = replay(
                stack.url,
                keys[tenants[0]],
                traces,
                model=model,
                slo=sc.slo,
                progress=progress,
                tenant_keys=keys,
            )
            ids = {o.api_request_id: o.request.info.request_id for o in outs if o.api_request_id}
            rows = stack.ledger_rows(
                timeout_s=60,
                expect=lambda rows: (
                    set(ids) <= {r["request_id"] for r in rows if r["status"] != "in_flight"}
                ),
            )
    s = summary(outs, wall_s, sc.slo)
    ran = {r["request_id"]: r["dc"] for r in rows if r["request_id"] in ids and r["dc"]}
    per_dc: dict[str, int] = {name: 0 for name in topo.datacenters}
    spilled = violations = 0
    for api_id, dc in ran.items():
        per_dc[dc] = per_dc.get(dc, 0) + 1
        rid = ids[api_id]
        spilled += dc != home[rid]
    by_rid = {a.trace.info.request_id: a for a in arrivals}
    for api_id, dc in ran.items():
        a = by_rid[ids[api_id]]
        violations += not residency_ok(topo, a.trace.info, a.home, dc)
    return {
        "goodput_tok_s": s["goodput_tok_s"],
        "slo_attainment": s["slo_attainment"],
        "spill_fraction": spilled / max(1, len(ran)),
        "requests_per_dc": per_dc,
        "residency_violations": violations,
        "http_errors": sum(1 for o in outs if o.http_status != 200),
        "wall_s": wall_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "examples/scenarios/hotspot-live.yaml"))
    ap.add_argument("--fleet", default="fleetmind", help="fleet policy (tokenfleet sim --fleet)")
    ap.add_argument("--duration", type=float, default=None, help="seconds (default: scenario's)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=64, help="worker slots per engine")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    scenario = Path(args.scenario)
    sc = load_scenario(scenario)
    if args.duration:
        sc = sc.with_duration(args.duration)
    arrivals = build_workload(sc, seed=args.seed)
    print(f"{scenario.name}: {len(arrivals)} requests over {sc.duration_s:g} s, fleet {args.fleet}")
    sim = _sim(sc, arrivals, args.fleet, args.seed)
    print(f"  sim: goodput {sim['goodput_tok_s']:.0f} tok/s, spill {sim['spill_fraction']:.1%}")
    live = _live(sc, arrivals, args.fleet, scenario, args)
    print()
    print(f"{'':22} {'sim':>10} {'live':>10} {'live/sim':>9}")
    for key, fmt in [
        ("goodput_tok_s", "{:10.0f}"),
        ("slo_attainment", "{:10.1%}"),
        ("spill_fraction", "{:10.1%}"),
    ]:
        a, b = sim[key], live[key]
        ratio = f"{b / a:9.2f}" if a else "        -"
        print(f"{key:22} {fmt.format(a)} {fmt.format(b)} {ratio}")
    for dc in sorted(sim["requests_per_dc"]):
        a, b = sim["requests_per_dc"][dc], live["requests_per_dc"].get(dc, 0)
        print(f"{'requests in ' + dc:22} {a:10d} {b:10d}")
    viol = sim["residency_violations"], live["residency_violations"]
    print(f"{'residency violations':22} {viol[0]:10d} {viol[1]:10d}")
    print(f"live: {live['http_errors']} HTTP errors, wall {live['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"sim": sim, "live": live}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
