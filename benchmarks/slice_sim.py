"""The live head-to-head's slices in the simulator, with an admission policy in front.

``benchmarks/live_routers.py --sim`` predicts each live run (TokenFleet's
front with SLOMax since 2026-12-05, the router alone before), with the path
latency measured in that run; this runs the same slices without a live run
(its ``load_slice``: the prefix-heavy conversations or the Mooncake trace's
first seconds) on 4 simulated engines with 0.5 s scrapes, the live path's
latency taken as a few milliseconds, over several seeds, and
prints TTFT p50/p95, SLO attainment and prefix hit ratio per seed and their
mean (``--no-path-latency``: the engines' time alone, to tell what placement
wins from what the path costs). It is how the SLOMax change of
docs/benchmarks.md section 19 was measured before and after::

    .venv/bin/python benchmarks/slice_sim.py --slice prefix-heavy --admission slomax
    .venv/bin/python benchmarks/slice_sim.py --slice mooncake --admission slomax
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import live_routers  # noqa: E402

from tokenfleet.engine.profiles import get_profile  # noqa: E402
from tokenfleet.sim.cluster import PathLatency  # noqa: E402
from tokenfleet.sim.runner import SimSettings, run_policies  # noqa: E402

#: the live path as the simulator sees it: dispatch 4 ms + 2 ms tail, return 1 + 0.5
PATH = PathLatency(0.004, 0.002, 0.001, 0.0005)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slice", choices=("prefix-heavy", "mooncake"), default="prefix-heavy")
    ap.add_argument("--policy", default="tokenpilot")
    ap.add_argument("--admission", default="slomax", help="'none' for the router alone")
    ap.add_argument("--seeds", type=int, default=3, help="workload and simulator seeds 7, 8, ...")
    ap.add_argument("--rate", type=float, default=6.5, help="prefix-heavy slice, requests/s")
    ap.add_argument("--rate-scale", type=float, default=0.5, help="mooncake slice")
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--duration", type=float, default=None, help="seconds of the slice")
    ap.add_argument(
        "--no-path-latency",
        action="store_true",
        help="no time between client and engine: what the policies' placement alone gives",
    )
    args = ap.parse_args(argv)
    path = PathLatency(0.0, 0.0, 0.0, 0.0) if args.no_path_latency else PATH
    duration = args.duration or (160.0 if args.slice == "mooncake" else 120.0)
    admissions = [] if args.admission == "none" else [args.admission]
    rows = []
    for k in range(args.seeds):
        seed = 7 + k
        sl = argparse.Namespace(
            slice=args.slice,
            rate=args.rate,
            rate_scale=args.rate_scale,
            duration=duration,
            seed=seed,
        )
        reqs = live_routers.sim_requests(live_routers.load_slice(sl, "default"))
        settings = SimSettings(
            profile=get_profile(live_routers.PROFILE),
            instances=args.engines,
            scrape_interval_s=0.5,
            kv_events=True,
            path_latency=path,
            seed=k,
        )
        s = run_policies(reqs, [args.policy], settings, admissions=admissions)[0].summary
        row = (s["ttft_p50_s"], s["ttft_p95_s"], s["slo_attainment"], s["prefix_hit_ratio"])
        rows.append(row)
        print(
            f"seed {seed}: {len(reqs)} requests, TTFT p50 {row[0]:.4f} s, p95 {row[1]:.4f} s, "
            f"SLO {row[2]:.1%}, hit {row[3]:.1%}",
            flush=True,
        )
    mean = [statistics.fmean(r[i] for r in rows) for i in range(4)]
    label = args.policy + ("" if args.admission == "none" else "+" + args.admission)
    label += ", no path latency" if args.no_path_latency else ""
    print(
        f"{args.slice} {label}, mean of {len(rows)}: TTFT p50 {mean[0]:.4f} s, "
        f"p95 {mean[1]:.4f} s, SLO {mean[2]:.1%}, hit {mean[3]:.1%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
