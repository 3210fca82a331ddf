"""Snapshot and decision types shared by every policy and both drivers.

These types are the *whole* interface between policies and the world. A
policy gets a :class:`RequestInfo` and a :class:`PoolSnapshot`; it returns a
decision. Nothing here carries a request's true output length: only the
simulated engine knows it (see ``tokenfleet.workloads.trace.TraceRequest``),
which is how we keep the simulator honest by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.engine.profiles import EngineProfile

#: Engine KV block size, in tokens (vLLM's default).
BLOCK_SIZE_TOKENS = 16

TIERS = ("interactive", "long_context", "batch")
_INTERACTIVE, _LONG_CONTEXT, _BATCH = TIERS


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a live router can know about a request at arrival.

    ``max_tokens`` is the client's output *budget*, not the real length.
    ``block_hashes`` are chained hashes of full 16-token prompt blocks: a live
    router computes them from the prompt's token ids, the simulator derives
    them from the trace.
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    max_tokens: int
    block_hashes: tuple[int, ...] = ()
    tenant: str = "default"
    task_type: str = "chat"  # "chat" | "completion" | "batch"
    tier: str = ""  # filled in by the classifier
    model: str = "default"
    model_version: str = ""
    region: str | None = None
    deadline_s: float | None = None  # absolute, for batch work
    session: str | None = None
    prompt_cache_key: str | None = None
    slo_class: str | None = None  # tenant's declared SLO class, if any
    allow_cross_region: bool = True


@dataclass(slots=True)
class ScrapedMetrics:
    """Engine metrics as last scraped from ``/metrics`` (vLLM names in comments).

    They are stale by up to one scrape interval; ``scraped_at_s`` says when.
    """

    scraped_at_s: float = float("-inf")
    num_running: int = 0  # vllm:num_requests_running
    num_waiting: int = 0  # vllm:num_requests_waiting
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1
    prefix_queries_total: int = 0  # vllm:prefix_cache_queries_total (tokens)
    prefix_hits_total: int = 0  # vllm:prefix_cache_hits_total (tokens)
    #: vllm:external_prefix_cache_hits_total (tokens): KV a connector loaded
    #: (the CPU offloading tier), counted as queried but not hit above
    external_hits_total: int = 0
    healthy: bool = True  # scrape succeeded and /health answered


@dataclass(slots=True)
class DispatchAccounting:
    """One router's own view of what it sent to one instance.

    A live router knows this exactly: it dispatched the requests and it sees
    the first token and the end of each stream. It does not see requests that
    other router replicas sent.
    """

    inflight_requests: int = 0
    prefill_pending_requests: int = 0  # dispatched, no first token yet
    prefill_pending_tokens: int = 0  # their input tokens
    prefill_pending_uncached_tokens: int = 0  # minus the router's cache estimate
    decoding_requests: int = 0
    inflight_input_tokens: int = 0
    inflight_max_tokens: int = 0  # sum of output budgets still reserved
    dispatched_total: int = 0
    # the long-context and batch tiers' part of the pending prefill (the rest is
    # interactive): admission prices a long prefill apart from short ones, and
    # a live gateway's admission snapshot has no other source for it
    long_prefill_pending_requests: int = 0
    long_prefill_pending_uncached_tokens: int = 0
    batch_prefill_pending_requests: int = 0
    batch_prefill_pending_uncached_tokens: int = 0

    def on_dispatch(self, request: RequestInfo, expected_cached_tokens: int) -> None:
        uncached = max(0, request.input_tokens - expected_cached_tokens)
        self.inflight_requests += 1
        self.prefill_pending_requests += 1
        self.prefill_pending_tokens += request.input_tokens
        self.prefill_pending_uncached_tokens += uncached
        self._tier_pending(request.tier, 1, uncached)
        self.inflight_input_tokens += request.input_tokens
        self.inflight_max_tokens += request.max_tokens
        self.dispatched_total += 1

    def on_first_token(self, request: RequestInfo, expected_cached_tokens: int) -> None:
        uncached = max(0, request.input_tokens - expected_cached_tokens)
        self.prefill_pending_requests -= 1
        self.prefill_pending_tokens -= request.input_tokens
        self.prefill_pending_uncached_tokens -= uncached
        self._tier_pending(request.tier, -1, -uncached)
        self.decoding_requests += 1

    def _tier_pending(self, tier: str, requests: int, uncached_tokens: int) -> None:
        if tier == _LONG_CONTEXT:
            self.long_prefill_pending_requests += requests
            self.long_prefill_pending_uncached_tokens += uncached_tokens
        elif tier == _BATCH:
            self.batch_prefill_pending_requests += requests
            self.batch_prefill_pending_uncached_tokens += uncached_tokens

    def tier_prefill_pending(self) -> dict[str, tuple[int, int]]:
        """Pending prefill per tier: (requests, uncached tokens)."""
        long_ = (self.long_prefill_pending_requests, self.long_prefill_pending_uncached_tokens)
        batch = (self.batch_prefill_pending_requests, self.batch_prefill_pending_uncached_tokens)
        return {
            _INTERACTIVE: (
                max(0, self.prefill_pending_requests - long_[0] - batch[0]),
                max(0, self.prefill_pending_uncached_tokens - long_[1] - batch[1]),
            ),
            _LONG_CONTEXT: long_,
            _BATCH: batch,
        }

    def on_finish(
        self, request: RequestInfo, got_first_token: bool, expected_cached_tokens: int
    ) -> None:
        if not got_first_token:
            # Failed or cancelled before prefill finished.
            self.on_first_token(request, expected_cached_tokens)
        self.decoding_requests -= 1
        self.inflight_requests -= 1
        self.inflight_input_tokens -= request.input_tokens
        self.inflight_max_tokens -= request.max_tokens


@dataclass(slots=True)
class InstanceView:
    """Everything a router may know about one engine instance.

    Static facts (model, version, capacity, profile) come from configuration;
    ``metrics`` from the last scrape; ``accounting`` from this router's own
    dispatches. Drivers update views in place; policies must only read them.
    """

    instance_id: str
    profile: EngineProfile
    dc: str = "local"
    model: str = "default"
    model_version: str = ""
    ready: bool = True
    kv_capacity_tokens: int = 0
    max_model_len_tokens: int = 0
    metrics: ScrapedMetrics = field(default_factory=ScrapedMetrics)
    accounting: DispatchAccounting = field(default_factory=DispatchAccounting)
    index: int = 0  # position in the pool, for cheap array-based policies
    #: P/D disaggregation role: "mixed" (prefill and decode, the default),
    #: "prefill" (vLLM kv_producer) or "decode" (kv_consumer)
    role: str = "mixed"
    #: the node the instance runs on: KV moves over NVLink inside a node, RDMA across
    node: int = 0


@dataclass(slots=True)
class PoolSnapshot:
    """The pool as one router sees it at decision time.

    ``now_s`` is passed in so policies never read a clock.
    """

    now_s: float
    instances: Sequence[InstanceView]
    router_id: int = 0


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where to send a request, and what the router expected of it."""

    instance_id: str
    expected_cached_tokens: int = 0
    predicted_ttft_s: float | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class FirstTokenEvent:
    """Observed by the router when the stream's first token arrives."""

    request: RequestInfo
    instance_id: str
    now_s: float
    ttft_s: float  # from dispatch at the router to first token
    predicted_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class CompletionEvent:
    """Observed when a stream ends: usage is known only now."""

    request: RequestInfo
    instance_id: str
    now_s: float
    status: str  # "completed" | "failed" | "cancelled" | "rejected" | "timed_out"
    output_tokens: int  # usage.completion_tokens, learnable only after the fact
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    ttft_s: float | None
    e2e_s: float


@dataclass(frozen=True, slots=True)
class KVEvent:
    """vLLM KV-cache event (``BlockStored`` / ``BlockRemoved``) for exact indexes.

    ``exact=False`` marks an inferred event, not one the engine reported: the
    service's guess that a prompt's blocks are cached once its first token
    came back, or a late-binding correction. Such hints never carry
    evictions, so a router must not switch to its exact-cache mode on them;
    it folds them into its own approximate beliefs instead.
    """

    instance_id: str
    kind: str  # "stored" | "removed" | "cleared"
    block_hashes: tuple[int, ...]
    exact: bool = True
    #: where the blocks are, as vLLM's ``medium`` field says: "GPU" (the block
    #: pool) or "CPU" (the OffloadingConnector's host tier)
    medium: str = "GPU"

    @property
    def on_gpu(self) -> bool:
        return self.medium == "GPU"
