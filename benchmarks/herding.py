"""Per-instance queued prefill over time: do router replicas herd?

Runs one workload through a pool with 1 and N router replicas for each
policy, samples every instance's queued prefill work (uncached prompt tokens
waiting or still being prefilled, as seconds of lone prefill on the profile)
once a second, prints how unevenly it was spread, and plots one panel per
(policy, replicas). Herding shows as one or two instances carrying the queue
while the others sit near zero.

    .venv/bin/python benchmarks/herding.py                                  # conversations
    .venv/bin/python benchmarks/herding.py --trace ../shared/traces/mooncake_synthetic.jsonl
    .venv/bin/python benchmarks/herding.py --shared-state-ms 20   # replicas share accounting
    .venv/bin/python benchmarks/herding.py --param mean_turns=20 --kv-events off
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.engine.profiles import get_profile
from tokenfleet.sim.cluster import PoolConfig, PoolSim
from tokenfleet.sim.core import Environment
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.sim.runner import engines_publish_kv_events
from tokenfleet.workloads.loader import load_workload
from tokenfleet.workloads.scaling import scale_to_load
from tokenfleet.workloads.synthetic import generate
from tokenfleet.workloads.trace import TraceRequest


def queued_s(pool: PoolSim) -> list[float]:
    """Each instance's uncached prompt tokens not yet prefilled, in seconds."""
    out = []
    for eng in pool.engines:
        tokens = sum(r.prompt_tokens - r.computed_tokens for r in eng.waiting)
        tokens += sum(max(0, r.prompt_tokens - r.computed_tokens) for r in eng.running)
        out.append(eng.profile.prefill_time_s(tokens) if tokens else 0.0)
    return out


def run(reqs: list[TraceRequest], cfg: PoolConfig) -> tuple[dict[str, Any], list[list[float]]]:
    env = Environment()
    records: list[RequestRecord] = []
    pool = PoolSim(env, cfg, SLOConfig(), on_done=records.append)
    for tr in reqs:
        env.schedule_at(tr.info.arrival_s, pool.submit, tr)
    end_s = max(tr.info.arrival_s for tr in reqs)
    samples: list[list[float]] = []

    def sample() -> None:
        samples.append(queued_s(pool))
        if env.now < end_s:
            env.schedule(1.0, sample)

    env.schedule_at(0.0, sample)
    env.run()
    return summarize(records, SLOConfig(), busy_s=pool.busy_s()), samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--trace", help="trace file (default: a synthetic workload)")
    ap.add_argument("--synthetic", default="conversations", help="generator (conversations)")
    ap.add_argument(
        "--param", action="append", default=[], metavar="KEY=VALUE", help="generator option"
    )
    ap.add_argument("--requests", type=int, default=6000, help="synthetic requests (default 6000)")
    ap.add_argument("--seed", type=int, default=0, help="workload and router seed")
    ap.add_argument(
        "--kv-events",
        choices=("shipped", "on", "off"),
        default="shipped",
        help="engine KV events: each policy's shipped deployment (default), all, none",
    )
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--routers", type=int, default=4, help="replicas to compare with 1")
    ap.add_argument("--shared-state-ms", type=float, default=None)
    ap.add_argument("--policy", action="append", help="default: tokenpilot and dynamo_kv")
    ap.add_argument("--plot", default="out/bench/herding.png")
    args = ap.parse_args(argv)
    profile = get_profile("llama3-8b-h200")
    options: dict[str, object] = {}
    for kv in args.param:
        key, _, value = kv.partition("=")
        options[key] = float(value) if "." in value or "e" in value else int(value)
    base = (
        load_workload(args.trace)
        if args.trace
        else generate(args.synthetic, args.requests, args.seed, 10.0, **options)
    )
    reqs = list(scale_to_load(base, args.load, profile, args.instances))
    policies = args.policy or ["tokenpilot", "dynamo_kv"]
    shared = None if args.shared_state_ms is None else args.shared_state_ms / 1000.0
    results: dict[tuple[str, int], list[list[float]]] = {}
    print(
        f"{'policy':12} {'routers':>7} {'TTFT p50':>9} {'p95':>7} {'TPOT p50':>9} "
        f"{'goodput':>8} {'SLO att.':>8} {'util':>5} {'busiest share':>13} {'queue max/mean':>14}"
    )
    for pol in policies:
        for n in (1, args.routers):
            cfg = PoolConfig(
                profile=profile,
                n_instances=args.instances,
                router=pol,
                n_routers=n,
                kv_events=engines_publish_kv_events(pol)
                if args.kv_events == "shipped"
                else args.kv_events == "on",
                seed=args.seed,
                shared_state_s=shared if n > 1 else None,
            )
            summary, samples = run(reqs, cfg)
            results[(pol, n)] = samples
            totals = [sum(col) for col in zip(*samples, strict=False)]
            mean_q = statistics.mean(totals) or 1e-9
            print(
                f"{pol:12} {n:>7} {summary['ttft_p50_s']:9.3f} {summary['ttft_p95_s']:7.3f} "
                f"{summary['tpot_p50_s'] * 1e3:7.1f}ms {summary['goodput_tok_s']:8.0f} "
                f"{summary['slo_attainment']:8.1%} {summary['utilization']:5.0%} "
                f"{max(totals) / sum(totals) if sum(totals) else 0:13.1%} "
                f"{max(totals) / mean_q:14.2f}",
                flush=True,
            )
    plot(
        results,
        policies,
        args.routers,
        Path(args.plot),
        f"{Path(args.trace).name if args.trace else args.synthetic}, load {args.load}"
        + ("" if shared is None else f", shared state {args.shared_state_ms:g} ms"),
    )
    print(f"plot: {args.plot}")
    return 0


def plot(
    results: dict[tuple[str, int], list[list[float]]],
    policies: list[str],
    n: int,
    path: Path,
    title: str,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(
        len(policies), 2, figsize=(11, 3.2 * len(policies)), sharex=True, sharey=True, squeeze=False
    )
    for row, pol in enumerate(policies):
        for col, routers in enumerate((1, n)):
            ax = axes[row][col]
            samples = results[(pol, routers)]
            for i, series in enumerate(zip(*samples, strict=False)):
                # 10 s means: single long prompts spike for a second; herding
                # is an instance that stays loaded while others idle.
                w = 10
                smooth = [sum(series[k : k + w]) / w for k in range(0, len(series) - w + 1, w)]
                ax.plot([k * w for k in range(len(smooth))], smooth, linewidth=0.9, label=f"i{i}")
            ax.set_title(f"{pol}, {routers} router{'s' if routers > 1 else ''}", fontsize=10)
            ax.grid(True, alpha=0.3)
            if col == 0:
                ax.set_ylabel("queued prefill (s), 10 s mean")
    for ax in axes[-1]:
        ax.set_xlabel("time (s)")
    axes[0][1].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(f"Per-instance queued prefill: {title}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
