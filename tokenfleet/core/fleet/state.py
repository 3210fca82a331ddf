"""What a DC selector may know about the fleet, and the fleet's own accounting.

A live FleetMind gateway sees two kinds of signal per (datacenter, model
version) pool, and nothing else:

* the pool aggregate of the engines' ``/metrics`` (running, waiting, KV
  usage), refreshed once per fleet scrape interval, so stale by up to one;
* its own accounting of what it dispatched there: requests still waiting for
  a first token, their estimated prefill seconds, a drain clock, and a
  decaying rate of dispatched work. This is exact and live: the gateway
  proxies every stream, so it sees each first token and each end.

Work estimates use the same closed-form prefill model TokenPilot uses
(``tokenfleet.core.tokenpilot.estimators.PrefillModel``) on the pool's
engine profile, and a learned output length, never the true one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tokenfleet.core.fleet.topology import Tenant, Topology
from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.tokenpilot.estimators import OutputLengthModel, PrefillModel
from tokenfleet.core.types import BLOCK_SIZE_TOKENS, RequestInfo
from tokenfleet.engine.profiles import EngineProfile

#: Time constant of the dispatched-work rate (seconds). Long enough to smooth
#: Poisson noise at a few requests per second, short enough that a DC filling
#: up with spilled work shows it within a few seconds.
WORK_TAU_S = 5.0

#: Decode batch used to price one output token (as ``workloads.scaling``).
REFERENCE_DECODE_BATCH = 32


class PoolCosts:
    """Per-profile cost model: prefill seconds, the price of a decode token, and
    the two step times that bound TPOT (a full prefill chunk, a decode step)."""

    __slots__ = (
        "profile",
        "prefill",
        "decode_token_s",
        "chunk_step_s",
        "decode_step_s",
        "_ctx_memo",
    )

    def __init__(self, profile: EngineProfile) -> None:
        self.profile = profile
        self.prefill = PrefillModel(profile)
        self._ctx_memo: dict[int, float] = {}
        self.decode_token_s = self.decode_cost_s(4096)
        self.chunk_step_s = self.prefill.seconds(profile.max_num_batched_tokens)
        self.decode_step_s = profile.decode_step_time_s(REFERENCE_DECODE_BATCH, 4096)

    def tpot_s(self, prefill_busy: float) -> float:
        """Mean time per output token when a fraction ``prefill_busy`` of the time
        goes to steps that carry a prefill chunk (vLLM chunked prefill puts the
        running decodes in the same step, so each such step yields one token per
        sequence but lasts a whole chunk): ``1 / (f / T_chunk + (1 - f) / T_decode)``.
        """
        f = min(0.99, max(0.0, prefill_busy))
        return 1.0 / (f / self.chunk_step_s + (1.0 - f) / self.decode_step_s)

    def decode_cost_s(self, ctx_tokens: float) -> float:
        bucket = int(ctx_tokens) // 2048
        hit = self._ctx_memo.get(bucket)
        if hit is None:
            b = REFERENCE_DECODE_BATCH
            hit = self.profile.decode_step_time_s(b, (bucket + 0.5) * 2048) / b
            self._ctx_memo[bucket] = hit
        return hit


@dataclass(slots=True)
class PoolAccounting:
    """The gateway's exact view of the work it sent to one pool."""

    pending_requests: int = 0  # dispatched, no first token yet
    pending_prefill_s: float = 0.0  # their estimated prefill seconds
    drain_at_s: float = -math.inf  # when that prefill work is done, at nominal speed
    mean_prefill_s: float = 0.0  # EWMA of estimated prefill seconds per request
    dispatched_total: int = 0
    _work_acc_s: float = 0.0
    _prefill_acc_s: float = 0.0
    _work_t_s: float = 0.0

    def on_dispatch(
        self, now_s: float, prefill_s: float, work_s: float, ready_instances: int
    ) -> None:
        self.pending_requests += 1
        self.pending_prefill_s += prefill_s
        self.drain_at_s = max(self.drain_at_s, now_s) + prefill_s / max(1, ready_instances)
        self.mean_prefill_s += (
            0.05 * (prefill_s - self.mean_prefill_s) if self.dispatched_total else prefill_s
        )
        decay = self._decay(now_s)
        self._work_acc_s = self._work_acc_s * decay + work_s
        self._prefill_acc_s = self._prefill_acc_s * decay + prefill_s
        self._work_t_s = now_s
        self.dispatched_total += 1

    def on_first_token(self, prefill_s: float) -> None:
        self.pending_requests -= 1
        self.pending_prefill_s = max(0.0, self.pending_prefill_s - prefill_s)

    def _decay(self, now_s: float) -> float:
        dt = now_s - self._work_t_s
        return 1.0 if dt <= 0.0 else math.exp(-dt / WORK_TAU_S)

    def work_rate(self, now_s: float) -> float:
        """Work-seconds dispatched per second, exponentially weighted."""
        return self._work_acc_s * self._decay(now_s) / WORK_TAU_S

    def prefill_rate(self, now_s: float) -> float:
        """Prefill-seconds dispatched per second, exponentially weighted."""
        return self._prefill_acc_s * self._decay(now_s) / WORK_TAU_S


@dataclass(slots=True)
class PoolView:
    """One (DC, model, version) pool as the fleet sees it at decision time."""

    dc: str
    model: str
    version: str
    costs: PoolCosts
    accounting: PoolAccounting = field(default_factory=PoolAccounting)
    ready_instances: int = 0
    warming_instances: int = 0  # planned replicas still prewarming
    kv_capacity_tokens: int = 0  # per instance
    # last fleet scrape of the engines (aggregated over ready instances)
    scraped_at_s: float = -math.inf
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0

    @property
    def key(self) -> tuple[str, str]:
        return (self.model, self.version)

    @property
    def prefix_id(self) -> str:
        """This pool's name in the fleet prefix index (caches are per pool)."""
        return f"{self.dc}/{self.model}@{self.version}"

    def queue_s(self, now_s: float) -> float:
        """Predicted wait before a new request's prefill starts, per instance.

        The larger of the gateway's own drain clock and the scraped queue
        (waiting requests times the mean prefill, aged by the time since the
        scrape): the scrape catches work the gateway did not send.
        """
        if self.ready_instances <= 0:
            return math.inf
        own = max(0.0, self.accounting.drain_at_s - now_s)
        scraped = self.waiting * self.accounting.mean_prefill_s / self.ready_instances - max(
            0.0, now_s - self.scraped_at_s
        )
        return own if own >= scraped else scraped

    def load(self, now_s: float, extra_work_s: float = 0.0) -> float:
        """Fraction of the pool's capacity in use: dispatched work per second per
        ready instance, plus the standing queue spread over the rate's window.
        ``extra_work_s``: as if one more request of that much work arrived now."""
        n = self.ready_instances
        if n <= 0:
            return math.inf
        rate = (self.accounting.work_rate(now_s) + extra_work_s / WORK_TAU_S) / n
        return rate + self.queue_s(now_s) / WORK_TAU_S

    def tpot_s(self, now_s: float, extra_prefill_s: float = 0.0) -> float:
        """Predicted TPOT from the share of time the pool spends prefilling."""
        n = self.ready_instances
        if n <= 0:
            return math.inf
        busy = (self.accounting.prefill_rate(now_s) + extra_prefill_s / WORK_TAU_S) / n
        return self.costs.tpot_s(busy + self.queue_s(now_s) / WORK_TAU_S)


@dataclass(slots=True)
class DCView:
    name: str
    region: str
    entry: bool
    load_ceiling: float
    reserve_local: float
    pools: dict[tuple[str, str], PoolView] = field(default_factory=dict)
    spill_share: float = 1.0  # the plan's cap on spill into this DC (0..1)

    @property
    def spill_in_ceiling(self) -> float:
        return min(self.load_ceiling, 1.0 - self.reserve_local)

    def pool_for(self, model: str, version: str, *, exact: bool = True) -> PoolView | None:
        """The ready pool serving ``model`` here, or None.

        ``exact``: only the requested version (an empty version or the model
        "default" is a wildcard). Otherwise any version of the model, the
        requested one first, as a gateway routing by model name would.
        """
        best: PoolView | None = None
        for p in self.pools.values():
            if p.ready_instances <= 0 or (model != "default" and p.model != model):
                continue
            if not version or p.version == version:
                return p
            if exact:
                continue
            if best is None or p.ready_instances > best.ready_instances:
                best = p
        return best


@dataclass(slots=True)
class FleetSnapshot:
    """The fleet at decision time. ``now_s`` is passed in: no policy reads a clock."""

    now_s: float
    dcs: Mapping[str, DCView]
    topology: Topology
    rtt_s: Mapping[tuple[str, str], float]  # as measured by probes this cycle
    prefix: PrefixIndex  # approximate: prompt blocks sent to each pool
    outputs: OutputLengthModel

    def rtt(self, a: str, b: str) -> float:
        if a == b:
            return 0.0
        return self.rtt_s[(a, b)]

    def tenant(self, name: str) -> Tenant:
        return self.topology.tenant(name)

    def cached_tokens(self, pool: PoolView, request: RequestInfo) -> int:
        """Prompt tokens we believe ``pool`` holds in some engine's prefix cache."""
        if not request.block_hashes:
            return 0
        blocks = self.prefix.match_instance(pool.prefix_id, request.block_hashes)
        cached = min(blocks, len(request.block_hashes)) * BLOCK_SIZE_TOKENS
        return min(cached, max(0, request.input_tokens - 1))

    def transfer_s(self, origin: str, dc: str, request: RequestInfo) -> float:
        """Shipping the prompt over the WAN (zero when served where it entered)."""
        if origin == dc:
            return 0.0
        s = self.topology.settings
        return request.input_tokens * s.prompt_bytes_per_token / s.wan_bytes_per_s

    def estimate(self, pool: PoolView, request: RequestInfo) -> tuple[int, float, float]:
        """(expected cached tokens, prefill seconds, total work seconds)."""
        cached = self.cached_tokens(pool, request)
        costs = pool.costs
        prefill = costs.prefill.seconds(request.input_tokens - cached, cached)
        typical_out, _ = self.outputs.estimate(request)
        decode = typical_out * costs.decode_cost_s(request.input_tokens + typical_out / 2)
        return cached, prefill, prefill + decode


@dataclass(frozen=True, slots=True)
class DCDecision:
    """Which datacenter serves a request, and why."""

    dc: str
    predicted_ttft_s: float | None = None  # at the client, RTT included
    predicted_dc_ttft_s: float | None = None  # inside the DC, before correction
    spilled: bool = False
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FleetFirstToken:
    """Seen by the gateway when a stream's first token comes back."""

    request: RequestInfo
    dc: str
    model: str  # the pool that served it
    version: str
    dc_ttft_s: float  # from arrival at the DC to the first token there
    predicted_dc_ttft_s: float | None


@dataclass(frozen=True, slots=True)
class FleetCompletion:
    request: RequestInfo
    dc: str
    status: str
    output_tokens: int


def candidate_names(views: Sequence[DCView]) -> list[str]:
    return [v.name for v in views]
