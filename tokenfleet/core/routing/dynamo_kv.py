"""NVIDIA Dynamo's KV router: min over workers of prefill cost + decode load."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)


def held_prefix_blocks(held: Container[int], hashes: Sequence[int]) -> int:
    """Leading blocks of ``hashes`` in ``held``, for a prefix-closed ``held``.

    A set built from whole chains of chained hashes holds block k only with
    blocks 0..k-1, so membership along a prompt is monotone and a binary
    search gives the depth in O(log n) lookups.
    """
    lo, hi = 0, len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        if hashes[mid] in held:
            lo = mid + 1
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class _ActiveRequest:
    worker: str
    block_hashes: tuple[int, ...]
    prefill_tokens: int
    prefill_done: bool = False


class _ActiveSequences:
    """Dynamo's per-worker ``ActiveSequences``: what the router has in flight.

    Active blocks are the *distinct* prompt blocks of a worker's in-flight
    requests (shared prefixes count once); active tokens are the uncached
    prompt tokens of requests still in prefill. Both come from the router's
    own dispatches and stream events, never from engine metrics.
    """

    def __init__(self) -> None:
        self.requests: dict[str, _ActiveRequest] = {}
        self.blocks: dict[str, dict[int, int]] = {}  # worker -> hash -> refcount
        self.prefill_tokens: dict[str, int] = {}

    def active_blocks(self, worker: str) -> int:
        return len(self.blocks.get(worker, ()))

    def new_blocks(self, worker: str, hashes: tuple[int, ...]) -> int:
        held = self.blocks.get(worker)
        if not held:
            return len(hashes)
        # In-flight prompts are whole chains, so the held set is prefix-closed.
        return len(hashes) - held_prefix_blocks(held, hashes)

    def add(self, request_id: str, req: _ActiveRequest) -> None:
        if request_id in self.requests:  # re-dispatch of the same id
            self.free(request_id)
        self.requests[request_id] = req
        held = self.blocks.setdefault(req.worker, {})
        for h in req.block_hashes:
            held[h] = held.get(h, 0) + 1
        self.prefill_tokens[req.worker] = (
            self.prefill_tokens.get(req.worker, 0) + req.prefill_tokens
        )

    def mark_prefill_completed(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.prefill_done:
            return
        req.prefill_done = True
        self.prefill_tokens[req.worker] -= req.prefill_tokens

    def free(self, request_id: str) -> None:
        self.mark_prefill_completed(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        held = self.blocks[req.worker]
        for h in req.block_hashes:
            left = held[h] - 1
            if left:
                held[h] = left
            else:
                del held[h]


@ROUTERS.register("dynamo_kv")
class DynamoKVRouter(BaseRouter):
    """Dynamo's KV-aware router (``--router-mode kv``).

    Sources (ai-dynamo/dynamo): ``lib/llm/src/kv_router/scheduler.rs``
    (``DefaultWorkerSelector``, ``softmax_sample``), ``sequence.rs`` /
    ``ActiveSequences`` (load tracking), ``indexer.rs`` (radix tree fed by
    engine KV events) and ``approx.rs`` (``ApproxKvIndexer``, used with
    ``--no-kv-events``). For each eligible worker::

        overlap        = leading request blocks the worker holds (index)
        prefill_blocks = (worker's active prefill tokens
                          + input_tokens - overlap * block_size) / block_size
        decode_blocks  = worker's active blocks + request blocks not among them
        cost           = overlap_score_weight * prefill_blocks + decode_blocks

    With ``router_temperature`` 0 the cheapest worker wins; ties go to the
    smallest index tree, then at random (Dynamo: hash-map order). Above 0 it
    samples a softmax of ``-cost / (max - min) / temperature``.

    The index follows engine KV events (``on_kv_event``) when they arrive;
    until then, or with ``use_kv_events=False``, it is the approximate one:
    each routed prompt is inserted for the chosen worker and expires
    ``approx_ttl_s`` later (Dynamo's default: 120 s), bounded by the
    worker's KV capacity. ``use_kv_events=None`` (default) switches to exact
    mode on the first event and discards the approximate entries.

    Active load depends on the stream hooks: the driver must deliver
    ``on_first_token`` (prefill done) and ``on_complete`` (free), as
    Dynamo's frontend does for the requests it routed.
    """

    name = "dynamo_kv"
    #: Dynamo's shipped deployment has the engines publish KV events: the
    #: router's ``KvRouterConfig::default`` has ``use_kv_events: true``
    #: (``lib/llm/src/kv_router/config.rs``) and the vLLM worker creates a
    #: ZMQ ``kv_events_config`` whenever prefix caching is on
    #: (``create_kv_events_config`` in ``components/src/dynamo/vllm/args.py``).
    #: The simulator turns engine events on for it unless told otherwise.
    engines_publish_kv_events = True

    def __init__(
        self,
        *,
        overlap_score_weight: float = 1.0,
        router_temperature: float = 0.0,
        use_kv_events: bool | None = None,
        approx_ttl_s: float = 120.0,
        block_size_tokens: int = BLOCK_SIZE_TOKENS,
        seed: int = 0,
    ) -> None:
        if router_temperature < 0:
            raise ValueError("router_temperature must be >= 0")
        self.overlap_score_weight = overlap_score_weight
        self.router_temperature = router_temperature
        self.block_size_tokens = block_size_tokens
        self.approx_ttl_s = approx_ttl_s
        self._use_kv_events = use_kv_events
        self._events_seen = False
        self._index = PrefixIndex(stride_blocks=1)
        self._active = _ActiveSequences()
        self._rng = random.Random(seed)
        # approximate mode: per worker, hash -> expiry in refresh order (the
        # TTL is constant and time only moves forward, so oldest is first)
        self._expiry: dict[str, OrderedDict[int, float]] = {}
        self._capacity_set: set[str] = set()

    # -- mode -----------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """True once the index is driven by engine KV events."""
        if self._use_kv_events is None:
            return self._events_seen
        return self._use_kv_events

    # -- introspection ---------------------------------------------------------
    def active_blocks(self, instance_id: str) -> int:
        return self._active.active_blocks(instance_id)

    def active_prefill_tokens(self, instance_id: str) -> int:
        return self._active.prefill_tokens.get(instance_id, 0)

    def costs(
        self, request: RequestInfo, candidates: list[InstanceView]
    ) -> dict[str, tuple[float, int]]:
        """(cost, overlap blocks) per candidate."""
        bs = self.block_size_tokens
        overlaps = self._index.match(request.block_hashes)
        hashes = tuple(request.block_hashes)
        out: dict[str, tuple[float, int]] = {}
        for inst in candidates:
            wid = inst.instance_id
            overlap = overlaps.get(wid, 0)
            new_prefill = max(0, request.input_tokens - overlap * bs)
            prefill_blocks = (self._active.prefill_tokens.get(wid, 0) + new_prefill) / bs
            decode_blocks = self._active.active_blocks(wid) + self._active.new_blocks(wid, hashes)
            out[wid] = (self.overlap_score_weight * prefill_blocks + decode_blocks, overlap)
        return out

    # -- policy ---------------------------------------------------------------
    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        if not self.exact:
            self._expire(pool.now_s)
        costs = self.costs(request, candidates)
        chosen = self._select(candidates, {k: c for k, (c, _) in costs.items()})
        cost, overlap = costs[chosen.instance_id]
        bs = self.block_size_tokens
        hashes = tuple(request.block_hashes)
        self._active.add(
            request.request_id,
            _ActiveRequest(
                worker=chosen.instance_id,
                block_hashes=hashes,
                prefill_tokens=max(0, request.input_tokens - overlap * bs),
            ),
        )
        if not self.exact:
            self._approx_insert(chosen, hashes, pool.now_s)
        return RouteDecision(
            instance_id=chosen.instance_id,
            expected_cached_tokens=min(request.input_tokens, overlap * bs),
            reason=f"cost:{cost:.1f}:overlap:{overlap}",
        )

    def _select(self, candidates: list[InstanceView], logits: dict[str, float]) -> InstanceView:
        if self.router_temperature == 0.0:
            low = min(logits.values())
            tied = [inst for inst in candidates if logits[inst.instance_id] == low]
            if len(tied) > 1:
                sizes = [self._index.entries(inst.instance_id) for inst in tied]
                smallest = min(sizes)
                tied = [inst for inst, s in zip(tied, sizes, strict=False) if s == smallest]
            return self._rng.choice(tied)
        values = [logits[inst.instance_id] for inst in candidates]
        lo, hi = min(values), max(values)
        if lo == hi:
            return self._rng.choice(candidates)
        scaled = [-(v / (hi - lo)) / self.router_temperature for v in values]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        return self._rng.choices(candidates, weights=weights, k=1)[0]

    # -- approximate index ----------------------------------------------------
    def _approx_insert(self, inst: InstanceView, hashes: tuple[int, ...], now_s: float) -> None:
        if not hashes:
            return
        wid = inst.instance_id
        if wid not in self._capacity_set and inst.kv_capacity_tokens > 0:
            self._index.set_capacity(wid, inst.kv_capacity_tokens // self.block_size_tokens)
            self._capacity_set.add(wid)
        self._index.insert(wid, hashes)
        expiry = now_s + self.approx_ttl_s
        timers = self._expiry.setdefault(wid, OrderedDict())
        for h in hashes:
            timers[h] = expiry
            timers.move_to_end(h)

    def _expire(self, now_s: float) -> None:
        for wid, timers in self._expiry.items():
            gone: list[int] = []
            while timers:
                h, expiry = next(iter(timers.items()))
                if expiry > now_s:
                    break
                del timers[h]
                gone.append(h)
            if gone:
                self._index.remove(wid, gone)

    # -- observations -----------------------------------------------------------
    def on_first_token(self, event: FirstTokenEvent) -> None:
        self._active.mark_prefill_completed(event.request.request_id)

    def on_complete(self, event: CompletionEvent) -> None:
        self._active.free(event.request.request_id)

    def on_kv_event(self, event: KVEvent) -> None:
        if self._use_kv_events is False:
            return
        if not event.on_gpu:
            # A host-tier block (vLLM offloading, medium "CPU") is no overlap:
            # the overlap score prices the prefill the worker's device cache
            # saves (docs/tokenpilot.md, "Host-memory KV tier").
            return
        if not event.exact:
            if self._events_seen:
                return  # engine events are the truth now; ignore inferred hints
            if event.kind == "stored":  # a hint: correct the routing-time guesses
                self._index.insert(event.instance_id, event.block_hashes)
            elif event.kind == "removed":
                self._index.remove(event.instance_id, event.block_hashes)
            return
        if not self._events_seen:
            self._events_seen = True
            # Exact mode from here on: drop the routing-time guesses.
            self._index = PrefixIndex(stride_blocks=1)
            self._expiry.clear()
        if event.kind == "stored":
            self._index.insert(event.instance_id, event.block_hashes)
        elif event.kind == "removed":
            self._index.remove(event.instance_id, event.block_hashes)
        elif event.kind == "cleared":
            self._index.clear(event.instance_id)
