"""Simulator speed: the whole Mooncake trace on 8 instances at load 0.8, per policy.

Prints wall seconds and simulated requests per wall-second for each policy.
Pin it to one core for the documented number:

    taskset -c 0 .venv/bin/python benchmarks/sim_speed.py [--trace PATH] [--policy NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.engine.profiles import get_profile
from tokenfleet.sim.cluster import PoolConfig, run_pool
from tokenfleet.sim.runner import engines_publish_kv_events
from tokenfleet.workloads.loader import load_workload
from tokenfleet.workloads.scaling import scale_to_load

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic.jsonl"
)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--policy", action="append")
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--instances", type=int, default=8)
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"trace {args.trace} not found (needs ../shared/traces)", file=sys.stderr)
        return 2
    profile = get_profile("llama3-8b-h200")
    t0 = time.perf_counter()
    reqs = load_workload(args.trace, "mooncake", use_cache=False)
    load_s = time.perf_counter() - t0
    reqs = scale_to_load(reqs, args.load, profile, args.instances)
    print(f"trace: {len(reqs)} requests, loaded in {load_s:.2f} s")
    print(
        f"{'policy':<20} {'kv_events':>9} {'wall_s':>8} {'sim_req_per_wall_s':>20} "
        f"{'engine_steps':>12}"
    )
    for name in args.policy or ROUTERS.names():
        if name.startswith("_"):
            continue
        # each peer as it ships (engine KV events for dynamo_kv), as `tokenfleet sim` runs it
        events = engines_publish_kv_events(name)
        cfg = PoolConfig(profile=profile, n_instances=args.instances, router=name, kv_events=events)
        t0 = time.perf_counter()
        records, pool = run_pool(reqs, cfg, SLOConfig())
        wall = time.perf_counter() - t0
        print(
            f"{name:<20} {'on' if events else 'off':>9} {wall:>8.2f} {len(records) / wall:>20.0f} "
            f"{sum(e.counters.steps for e in pool.engines):>12}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
