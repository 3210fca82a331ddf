"""Where a run misses its SLO: per tier and cause, and for a P/D pool how the
TTFT misses were placed and when the roles changed (docs/benchmarks.md 13e).

    .venv/bin/python benchmarks/pd_misses.py --workload examples/scenarios/mixed.yaml \\
        --policy tokenpilot_pd --admission slomax

Runs one (router, admission) on a workload file at its own ``load:`` (8 x
llama3-8b-h200, as ``tokenfleet sim`` does) and prints, per tier, the
requests that met their SLO and those that did not, by cause: ``ttft``,
``tpot`` (both: ``ttft+tpot``), ``deadline`` or the final status
(``rejected``...). Misses are counted by 20 s of arrival time. For a P/D
pool: the TTFT misses by placement (disaggregated or aggregated, and the
role of the instance that prefilled them when they were dispatched), the
router's predicted TTFT for them, and the role changes.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from typing import Any

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.engine.profiles import get_profile
from tokenfleet.sim.admission import run_pool_with_admission
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.pd import PDPoolSim
from tokenfleet.sim.records import RequestRecord
from tokenfleet.sim.runner import SimSettings
from tokenfleet.workloads.mix import build_at_load, build_mix, load_mix


def cause(r: RequestRecord, slo: SLOConfig) -> str:
    if r.status != "completed":
        return r.status
    t = slo.slo_for(r.tier)
    limit = t.ttft_limit_s(r.input_tokens)
    why = []
    if limit is not None and (r.ttft_s is None or r.ttft_s > limit):
        why.append("ttft")
    if t.tpot_s is not None and r.tpot_s is not None and r.tpot_s > t.tpot_s:
        why.append("tpot")
    if not why and not r.slo_met:
        why.append("deadline")
    return "+".join(why) or "met"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--admission", default="fcfs")
    ap.add_argument("--instances", type=int, default=8)
    args = ap.parse_args()
    mix = load_mix(args.workload)
    profile = get_profile("llama3-8b-h200")
    slo = SLOConfig.from_mapping(mix.slo, source=args.workload) if mix.slo else SLOConfig()
    if mix.load is not None:
        reqs = build_at_load(mix, mix.load, profile, args.instances)[0]
    else:
        reqs = build_mix(mix)
    cfg = SimSettings(profile=profile, instances=args.instances, slo=slo).pool_config(args.policy)
    records, pool, _ = run_pool_with_admission(reqs, cfg, slo, args.admission)
    s: dict[str, Any] = summarize(records, slo, busy_s=pool.busy_s())
    print(
        f"{args.policy}+{args.admission}: SLO attainment {100 * s['slo_attainment']:.2f}%, "
        f"goodput {s['goodput_tok_s']:,.0f} tok/s"
    )
    causes = {r.request_id: cause(r, slo) for r in records}
    for tier in sorted({r.tier for r in records}):
        c = Counter(causes[r.request_id] for r in records if r.tier == tier)
        parts = ", ".join(f"{k} {v}" for k, v in c.most_common())
        print(f"  {tier}: {sum(c.values())} requests, {parts}")
    by_t = Counter(int(r.arrival_s // 20) * 20 for r in records if causes[r.request_id] != "met")
    print("  misses by arrival (20 s):", ", ".join(f"{t}s {n}" for t, n in sorted(by_t.items())))
    if not isinstance(pool, PDPoolSim):
        return
    pd = pool.pd
    index = {e.instance_id: i for i, e in enumerate(pool.engines)}

    def role(instance_id: str, t: float) -> str:
        roles = pd.roles[0][1]
        for at, rs in pd.roles:
            if at <= t:
                roles = rs
        return roles[index[instance_id]]

    ttft = [r for r in records if causes[r.request_id].startswith("ttft")]
    placed: Counter[tuple[str, str, str]] = Counter()
    for r in ttft:
        where = pd.placements.get(r.request_id)
        t = r.dispatched_s if r.dispatched_s is not None else r.arrival_s
        if where is not None:
            placed[(r.tier, "disaggregated, prefilled on", role(where[0], t))] += 1
        elif r.instance_id:
            placed[(r.tier, "aggregated on", role(r.instance_id, t))] += 1
    print(f"  disaggregated {pd.disaggregated}, aggregated {pd.aggregated}")
    for (tier, how, rl), n in placed.most_common():
        print(f"  TTFT misses, {tier}, {how} a {rl} instance: {n}")
    pred = [r.predicted_ttft_s for r in ttft if r.predicted_ttft_s is not None]
    if pred:
        print(f"  their predicted TTFT: median {statistics.median(pred):.2f} s")
    for at, rs in pd.roles:
        parts = ", ".join(f"{k} {v}" for k, v in sorted(Counter(rs).items()))
        print(f"  roles from t = {at:.0f} s: {parts}")


if __name__ == "__main__":
    main()
