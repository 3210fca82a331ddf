"""Aggregate per-request records into the numbers the CLI and JSON report.

Goodput follows the strict rule: output tokens of requests that completed
*and* met every limit of their tier's SLO, per second of the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tokenfleet.core.tiers import SLOConfig, meets_slo
from tokenfleet.sim.records import RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None when empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def judge(records: Iterable[RequestRecord], slo: SLOConfig) -> None:
    """Set ``slo_met`` on every record (idempotent)."""
    for r in records:
        dl = None if r.deadline_s is None else r.deadline_s - r.arrival_s
        r.slo_met = meets_slo(
            slo.slo_for(r.tier),
            status=r.status,
            input_tokens=r.input_tokens,
            ttft_s=r.ttft_s,
            tpot_s=r.tpot_s,
            e2e_s=r.e2e_s,
            deadline_in_s=dl,
        )


def summarize(
    records: Sequence[RequestRecord],
    slo: SLOConfig,
    *,
    duration_s: float | None = None,
    busy_s: Sequence[float] = (),
) -> dict[str, Any]:
    """Metrics for one run; ``per_tier`` repeats them for each tier present."""
    judge(records, slo)
    if duration_s is None:
        duration_s = _span(records)
    out = _metrics(records, duration_s)
    out["utilization"] = (
        sum(busy_s) / (len(busy_s) * duration_s) if busy_s and duration_s > 0 else None
    )
    tiers = sorted({r.tier for r in records})
    out["per_tier"] = {t: _metrics([r for r in records if r.tier == t], duration_s) for t in tiers}
    return out


def _span(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max((r.finish_s for r in records if r.finish_s is not None), default=start)
    return max(end - start, 1e-9)


def _metrics(records: Sequence[RequestRecord], duration_s: float) -> dict[str, Any]:
    completed = [r for r in records if r.status == "completed"]
    ttft = [r.ttft_s for r in completed if r.ttft_s is not None]
    tpot = [r.tpot_s for r in completed if r.tpot_s is not None]
    e2e = [r.e2e_s for r in completed if r.e2e_s is not None]
    out_tokens = sum(r.output_tokens for r in completed)
    good_tokens = sum(r.output_tokens for r in completed if r.slo_met)
    served = [r for r in records if r.dispatched_s is not None]
    in_tokens = sum(r.input_tokens for r in served)
    cached = sum(r.cached_tokens for r in served)
    host_cached = sum(r.host_hit_tokens for r in served)
    n = len(records)
    count = {
        s: sum(1 for r in records if r.status == s)
        for s in ("rejected", "failed", "cancelled", "timed_out", "duplicate")
    }
    return {
        "requests": n,
        "completed": len(completed),
        "rejected": count["rejected"],
        "failed": count["failed"],
        "cancelled": count["cancelled"],
        "timed_out": count["timed_out"],
        "duplicates": count["duplicate"],
        "duration_s": duration_s,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p95_s": percentile(ttft, 95),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p95_s": percentile(tpot, 95),
        "e2e_p50_s": percentile(e2e, 50),
        "throughput_tok_s": out_tokens / duration_s if duration_s > 0 else 0.0,
        "goodput_tok_s": good_tokens / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": (sum(1 for r in records if r.slo_met) / n) if n else None,
        "prefix_hit_ratio": cached / in_tokens if in_tokens else 0.0,
        # by tier: the GPU's own prefix cache, and KV loaded from host memory
        "gpu_hit_ratio": (cached - host_cached) / in_tokens if in_tokens else 0.0,
        "host_hit_ratio": host_cached / in_tokens if in_tokens else 0.0,
        "wasted_gpu_s": sum(r.wasted_gpu_s for r in records),
    }
