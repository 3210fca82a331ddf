"""Load scaling: replay a trace faster or slower, or at a target load.

This is the experiment harness describing offered work, not a policy, so it
may read true output lengths (``TraceRequest.output_tokens``).

Capacity estimate (docs/workloads.md): one request keeps one instance busy for

    busy_s = prefill_time_s(input_tokens)                      # no prefix reuse
           + output_tokens * decode_step_time_s(B, ctx) / B    # B = 32

where ``ctx`` is the decode-token-weighted mean context,
``sum(out * (in + out / 2)) / sum(out)``. Capacity is
``instances / mean(busy_s)`` requests per second. It ignores prefix reuse,
so a cache-aware router has headroom at load 1.0 on prefix-heavy traces and a
cache-oblivious one does not: load is a relative knob for comparing policies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from tokenfleet.errors import ConfigError
from tokenfleet.workloads.trace import TraceRequest

if TYPE_CHECKING:
    from tokenfleet.engine.profiles import EngineProfile

#: Reference decode batch for the capacity estimate: a moderately loaded
#: engine, well below max_num_seqs=256 because SLO-bound serving rarely runs
#: full batches.
REFERENCE_DECODE_BATCH = 32


def limit(reqs: Sequence[TraceRequest], n: int) -> list[TraceRequest]:
    """The first ``n`` requests by arrival."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"limit must be a non-negative integer, got {n!r}")
    return sorted(reqs, key=lambda r: r.info.arrival_s)[:n]


def offered_rps(reqs: Sequence[TraceRequest]) -> float:
    """Mean arrival rate: (n - 1) / (last arrival - first arrival)."""
    if len(reqs) < 2:
        raise ConfigError("need at least 2 requests to measure an arrival rate")
    arrivals = [r.info.arrival_s for r in reqs]
    span = max(arrivals) - min(arrivals)
    if span <= 0:
        raise ConfigError(
            "all requests arrive at the same instant, so the trace has no "
            "rate to scale; spread the arrivals or use a synthetic generator"
        )
    return (len(reqs) - 1) / span


def rate_scale(reqs: Sequence[TraceRequest], x: float) -> list[TraceRequest]:
    """Compress inter-arrival times by ``x`` (x=2: twice as fast).

    The first arrival stays put; each deadline keeps its slack after arrival.
    """
    if not x > 0 or x == float("inf"):
        raise ConfigError(f"rate scale factor must be a finite number > 0, got {x!r}")
    if not reqs:
        return []
    t0 = min(r.info.arrival_s for r in reqs)
    out: list[TraceRequest] = []
    for r in reqs:
        info = r.info
        arrival = t0 + (info.arrival_s - t0) / x
        deadline = None if info.deadline_s is None else arrival + (info.deadline_s - info.arrival_s)
        out.append(replace(r, info=replace(info, arrival_s=arrival, deadline_s=deadline)))
    out.sort(key=lambda r: r.info.arrival_s)
    return out


def busy_time_s(
    reqs: Sequence[TraceRequest], profile: EngineProfile, decode_batch: int = REFERENCE_DECODE_BATCH
) -> list[float]:
    """Per-request busy time on one instance (formula in the module docstring)."""
    if not reqs:
        return []
    total_out = sum(r.output_tokens for r in reqs)
    ctx = (
        (
            sum(r.output_tokens * (r.info.input_tokens + r.output_tokens / 2) for r in reqs)
            / total_out
        )
        if total_out
        else 0.0
    )
    per_token_s = profile.decode_step_time_s(decode_batch, ctx) / decode_batch
    prefill: dict[int, float] = {}
    out: list[float] = []
    for r in reqs:
        n = r.info.input_tokens
        p = prefill.get(n)
        if p is None:
            p = prefill[n] = profile.prefill_time_s(n)
        out.append(p + r.output_tokens * per_token_s)
    return out


def capacity_rps(
    reqs: Sequence[TraceRequest],
    profile: EngineProfile,
    instances: int,
    decode_batch: int = REFERENCE_DECODE_BATCH,
) -> float:
    """Requests/s that ``instances`` copies of ``profile`` can sustain for this mix."""
    if instances < 1:
        raise ConfigError(f"instances must be >= 1, got {instances}")
    if decode_batch < 1:
        raise ConfigError(f"decode_batch must be >= 1, got {decode_batch}")
    if not reqs:
        raise ConfigError("cannot estimate capacity for an empty workload")
    busy = busy_time_s(reqs, profile, decode_batch)
    return instances * len(busy) / sum(busy)


def scale_to_load(
    reqs: Sequence[TraceRequest], load: float, profile: EngineProfile, instances: int
) -> list[TraceRequest]:
    """Rescale arrivals so the offered rate is ``load`` x the estimated capacity."""
    if (
        isinstance(load, bool)
        or not isinstance(load, (int, float))
        or not load > 0
        or load == float("inf")
    ):
        raise ConfigError(
            f"load must be a finite number > 0 (1.0 = estimated capacity), got {load!r}"
        )
    target = load * capacity_rps(reqs, profile, instances)
    return rate_scale(reqs, target / offered_rps(reqs))
