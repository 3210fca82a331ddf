"""The admission interface: one Protocol, one base class with no-op hooks.

Admission sits between arrival and routing. It answers two questions, both
as pure functions of a snapshot (no I/O, no clock: ``now_s`` is passed in):

1. ``on_arrival``: admit now (optionally restricted to some instances),
   queue in the gateway's per-tier queue, or reject with an honest
   ``Retry-After``.
2. ``next_action``: whenever capacity may have freed (a first token, a
   completion, a periodic tick), which queued request to dispatch next, or
   which hopeless one to drop. The driver calls it until it returns None.

The driver (simulator now, live service later) owns the queues and the
per-instance, per-tier accounting of what it dispatched; a policy only reads
them. Policies never see a request's true output length: they get
``RequestInfo`` with the ``max_tokens`` budget.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tokenfleet.core.registry import Registry
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    TIERS,
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    RequestInfo,
)

ADMIT = "admit"
QUEUE = "queue"
REJECT = "reject"

DISPATCH = "dispatch"
DROP = "drop"


def kv_reservation_tokens(
    request: RequestInfo,
    output_reserve_tokens: int | None = None,
    block_size_tokens: int = BLOCK_SIZE_TOKENS,
) -> int:
    """KV the engine may need for this request, rounded up to whole blocks.

    Reserving prompt + ``max_tokens`` (the default) is what makes "the engine
    never preempts" a guarantee: a request can never hold more blocks than
    that. A smaller learned reserve trades that guarantee for concurrency.
    """
    out = request.max_tokens if output_reserve_tokens is None else output_reserve_tokens
    tokens = request.input_tokens + max(0, out)
    return -(-tokens // block_size_tokens) * block_size_tokens


@dataclass(slots=True)
class TierLoad:
    """The driver's exact accounting of one tier's work on one instance."""

    inflight: int = 0
    prefill_pending: int = 0  # dispatched, no first token yet
    prefill_pending_tokens: int = 0  # their uncached input (router's estimate)
    reserved_kv_tokens: int = 0  # prompt + output reserve, while in flight
    dispatched_uncached_tokens: int = 0  # cumulative: prefill work sent so far


@dataclass(slots=True)
class InstanceLoad:
    """One instance as admission sees it: view (scraped metrics) + tier loads."""

    view: InstanceView
    tiers: dict[str, TierLoad] = field(default_factory=lambda: {t: TierLoad() for t in TIERS})
    #: KV reserved by in-flight work that the driver knows per instance only
    #: (the live gateway: prompt + output budget, from the shared accounting)
    untiered_reserved_kv_tokens: int = 0

    def tier(self, name: str) -> TierLoad:
        load = self.tiers.get(name)
        if load is None:
            load = self.tiers[name] = TierLoad()
        return load

    @property
    def instance_id(self) -> str:
        return self.view.instance_id

    @property
    def inflight(self) -> int:
        return sum(t.inflight for t in self.tiers.values())

    @property
    def prefill_pending(self) -> int:
        return sum(t.prefill_pending for t in self.tiers.values())

    @property
    def prefill_pending_tokens(self) -> int:
        return sum(t.prefill_pending_tokens for t in self.tiers.values())

    @property
    def reserved_kv_tokens(self) -> int:
        return self.untiered_reserved_kv_tokens + sum(
            t.reserved_kv_tokens for t in self.tiers.values()
        )

    def kv_free_tokens(self, budget: float = 1.0) -> int:
        """KV capacity (times ``budget``) not yet reserved by in-flight work."""
        cap = self.view.kv_capacity_tokens
        return int(cap * budget) - self.reserved_kv_tokens


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    request: RequestInfo
    enqueued_s: float


class TierQueue:
    """FIFO of one tier's waiting requests, with O(1) head, append and removal.

    Keeps running totals so a policy can predict waits without walking the
    queue (a batch job may put thousands of requests here at once).
    """

    __slots__ = ("tier", "_items", "input_tokens", "reserved_tokens")

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._items: OrderedDict[str, QueuedRequest] = OrderedDict()
        self.input_tokens = 0
        self.reserved_tokens = 0  # prompt + max_tokens of everything queued

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(self._items.values())

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._items

    def head(self) -> QueuedRequest | None:
        if not self._items:
            return None
        return next(iter(self._items.values()))

    def append(self, item: QueuedRequest) -> None:
        rid = item.request.request_id
        if rid in self._items:
            raise ValueError(f"request {rid} is already queued")
        self._items[rid] = item
        self.input_tokens += item.request.input_tokens
        self.reserved_tokens += item.request.input_tokens + item.request.max_tokens

    def remove(self, request_id: str) -> QueuedRequest | None:
        item = self._items.pop(request_id, None)
        if item is not None:
            self.input_tokens -= item.request.input_tokens
            self.reserved_tokens -= item.request.input_tokens + item.request.max_tokens
        return item


class QueueTotals:
    """A tier queue known only by its totals: the live service's broker queues.

    The live gateway publishes queued work to Celery and cannot enumerate it,
    but it counts what waits there (per queue, in Redis) and knows the mean
    prompt of what it published, so arrival decisions (``on_arrival``) see
    the same queue length and token totals as in the simulator. It has no
    head: a driver with QueueTotals never calls ``next_action``.
    """

    __slots__ = ("tier", "n", "input_tokens", "reserved_tokens")

    def __init__(self, tier: str, n: int, input_tokens: int = 0, reserved_tokens: int = 0) -> None:
        self.tier = tier
        self.n = max(0, n)
        self.input_tokens = input_tokens
        self.reserved_tokens = reserved_tokens

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[QueuedRequest]:
        return iter(())

    def head(self) -> QueuedRequest | None:
        return None


@dataclass(slots=True)
class AdmissionSnapshot:
    """What admission may know at decision time. Policies must only read it."""

    now_s: float
    instances: Sequence[InstanceLoad]
    queues: Mapping[str, TierQueue | QueueTotals]
    #: at arrival: the request's prompt tokens each instance is believed to hold
    #: (from the engines' KV events, as the gateway's prefix index has them;
    #: instances holding nothing are left out; empty when nobody knows)
    cached_tokens: Mapping[str, int] = field(default_factory=dict)

    def queued(self, tier: str) -> int:
        q = self.queues.get(tier)
        return len(q) if q is not None else 0


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    """Answer at arrival. ``instance_ids`` restricts where the router may place
    an admitted request (None: anywhere)."""

    action: str  # ADMIT | QUEUE | REJECT
    instance_ids: tuple[str, ...] | None = None
    retry_after_s: float | None = None
    predicted_wait_s: float | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Action:
    """Answer to "capacity may have freed": dispatch or drop a queued request."""

    kind: str  # DISPATCH | DROP
    tier: str
    request_id: str
    instance_ids: tuple[str, ...] | None = None
    status: str = "rejected"  # for DROP: "rejected" | "timed_out"
    retry_after_s: float | None = None
    reason: str = ""


@dataclass(slots=True)
class TierWindow:
    """One tier's outcomes over one control period (the controller's input)."""

    arrivals: int = 0
    finished: int = 0  # reached a final status in the window
    met: int = 0  # completed within every SLO limit
    completed: int = 0
    rejected: int = 0
    cancelled: int = 0
    timed_out: int = 0
    failed: int = 0
    duplicates: int = 0
    first_tokens: int = 0
    ttft_met: int = 0  # first tokens within the TTFT limit (a faster signal)
    output_tokens: int = 0
    good_tokens: int = 0
    wasted_gpu_s: float = 0.0
    queued: int = 0  # queue length at the end of the window
    inflight: int = 0  # dispatched, not finished, at the end of the window
    dispatched: int = 0
    prefill_tokens: int = 0  # uncached prompt tokens dispatched in the window

    @property
    def attainment(self) -> float | None:
        return self.met / self.finished if self.finished else None

    @property
    def ttft_attainment(self) -> float | None:
        return self.ttft_met / self.first_tokens if self.first_tokens else None

    @property
    def misses(self) -> int:
        return self.finished - self.met


@dataclass(slots=True)
class WindowStats:
    """Per-tier outcomes of one control period plus batch deadline progress."""

    period_s: float
    tiers: dict[str, TierWindow] = field(default_factory=dict)
    #: the earliest absolute deadline among unfinished batch work, if any
    batch_deadline_s: float | None = None
    #: batch requests not yet finished (queued + in flight)
    batch_remaining: int = 0
    #: batch requests finished (any status) in this window
    batch_finished: int = 0
    #: queued batch requests with long prompts (they need long-context lane slots)
    batch_long_queued: int = 0
    #: uncached prompt tokens of long batch prompts dispatched in the window
    batch_long_tokens: int = 0
    #: prompt tokens of the long batch prompts still queued
    batch_long_queued_tokens: int = 0

    def tier(self, name: str) -> TierWindow:
        w = self.tiers.get(name)
        if w is None:
            w = self.tiers[name] = TierWindow()
        return w


@runtime_checkable
class Admission(Protocol):
    name: str

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision: ...

    def next_action(self, snap: AdmissionSnapshot) -> Action | None: ...

    def on_first_token(self, event: FirstTokenEvent) -> None: ...

    def on_complete(self, event: CompletionEvent) -> None: ...

    def on_window(self, stats: WindowStats, now_s: float) -> dict[str, float]: ...

    def uses_queues(self) -> bool: ...

    def kv_reserve_tokens(self, request: RequestInfo) -> int: ...


class BaseAdmission:
    """Convenience base: admit everything, hold nothing, learn nothing."""

    name = "base"

    def on_arrival(self, request: RequestInfo, snap: AdmissionSnapshot) -> AdmissionDecision:
        return AdmissionDecision(ADMIT)

    def next_action(self, snap: AdmissionSnapshot) -> Action | None:
        return None

    def on_first_token(self, event: FirstTokenEvent) -> None:
        return None

    def on_complete(self, event: CompletionEvent) -> None:
        return None

    def on_window(self, stats: WindowStats, now_s: float) -> dict[str, float]:
        """Called once per control period; returns the knobs now in force
        (for the timeline and plots). Policies without a controller return {}."""
        return {}

    def uses_queues(self) -> bool:
        """False lets the driver skip dispatch polling entirely."""
        return True

    def kv_reserve_tokens(self, request: RequestInfo) -> int:
        """KV the driver books for this request while it is in flight."""
        return kv_reservation_tokens(request)


ADMISSION: Registry[Admission] = Registry("admission policy")
