"""SGLang router's cache-aware policy, over block hashes instead of characters."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.routing.dynamo_kv import held_prefix_blocks
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    InstanceView,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)

#: SGLang's default ``--max-tree-size`` is 2**26 *characters* per worker; at
#: the ~4 characters per token its peers assume that is 2**24 tokens.
DEFAULT_MAX_TREE_SIZE_TOKENS = 2**26 // 4


class _ApproxTrees:
    """One approximate radix tree per worker, as sets of chained block hashes.

    A chained hash names a whole prefix, so a worker's set of hashes *is* its
    radix tree (one node per block) and "longest routed prefix" is the
    number of leading prompt blocks in the set. Each worker's blocks sit in
    an LRU order in which a path is touched leaf-first, root-last: an
    ancestor is therefore always more recent than its descendants, evicting
    from the old end removes leaves first (SGLang's leaf-LRU eviction), and
    the set stays prefix-closed.
    """

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def size_blocks(self, worker: str) -> int:
        lru = self._lru.get(worker)
        return len(lru) if lru is not None else 0

    def match_worker(self, worker: str, hashes: Sequence[int]) -> int:
        """Longest routed prefix; the leaf-first eviction keeps each tree
        prefix-closed, so a binary search finds it."""
        lru = self._lru.get(worker)
        if not lru:
            return 0
        return held_prefix_blocks(lru, hashes)

    def insert(self, worker: str, hashes: Sequence[int]) -> None:
        lru = self._lru.setdefault(worker, OrderedDict())
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None

    def evict_to(self, max_blocks: int) -> None:
        for lru in self._lru.values():
            while len(lru) > max_blocks:
                lru.popitem(last=False)


@ROUTERS.register("sglang_cache_aware")
class SGLangCacheAwareRouter(BaseRouter):
    """SGLang model-gateway's default ``cache_aware`` policy.

    Source: ``sgl-router/src/policies/cache_aware.rs`` and ``tree.rs`` in
    sgl-project/sglang. Per request:

    1. load = in-flight requests this router sent to each worker. If
       ``max - min > balance_abs_threshold`` *and*
       ``max > balance_rel_threshold * min``, the pool is imbalanced: route to
       the least-loaded worker (shortest queue).
    2. Otherwise find the longest prefix any worker's approximate tree holds.
       If ``matched / input > cache_threshold`` (strictly), route to a worker
       holding that prefix; else to the worker with the smallest tree, i.e.
       the least routed content (SGLang: most free cache).
    3. Either way insert the prompt into the chosen worker's tree.

    Mapping to our inputs: SGLang's tree stores raw characters and divides
    matched characters by prompt characters; we store 16-token block hashes
    and divide matched tokens (full blocks) by input tokens, the same ratio
    up to the partial last block. Tree size is counted in tokens of distinct
    blocks (SGLang: distinct characters). Trees are evicted leaf-LRU down to
    ``max_tree_size_tokens`` every ``eviction_interval_s`` of pool time
    (SGLang defaults: 2**26 characters, 120 s); 0 evicts on every insert.

    Deviations, all forced by our contract: only eligible workers are
    considered (SGLang computes loads over every worker of the model and
    falls back to the first healthy one when its pick is unhealthy), and ties
    are broken at random where SGLang takes hash-map or index order.
    """

    name = "sglang_cache_aware"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size_tokens: int = DEFAULT_MAX_TREE_SIZE_TOKENS,
        eviction_interval_s: float = 120.0,
        block_size_tokens: int = BLOCK_SIZE_TOKENS,
        seed: int = 0,
    ) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.block_size_tokens = block_size_tokens
        self.max_tree_blocks = max(1, max_tree_size_tokens // block_size_tokens)
        self.eviction_interval_s = eviction_interval_s
        self._trees = _ApproxTrees()
        self._rng = random.Random(seed)
        self._last_eviction_s: float | None = None

    # -- introspection (tests, reports) -------------------------------------
    def tree_size_tokens(self, instance_id: str) -> int:
        return self._trees.size_blocks(instance_id) * self.block_size_tokens

    # -- policy ---------------------------------------------------------------
    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        hashes = request.block_hashes
        chosen, reason = self._select(request, candidates, hashes)
        cached_tokens = min(
            request.input_tokens,
            self._trees.match_worker(chosen.instance_id, hashes) * self.block_size_tokens,
        )
        self._trees.insert(chosen.instance_id, hashes)
        self._maybe_evict(pool.now_s)
        return RouteDecision(
            instance_id=chosen.instance_id, expected_cached_tokens=cached_tokens, reason=reason
        )

    def _select(
        self, request: RequestInfo, candidates: list[InstanceView], hashes: Sequence[int]
    ) -> tuple[InstanceView, str]:
        loads = [inst.accounting.inflight_requests for inst in candidates]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        ):
            least = [
                inst for inst, load in zip(candidates, loads, strict=False) if load == min_load
            ]
            return self._rng.choice(least), "imbalanced:shortest_queue"

        depths = [self._trees.match_worker(inst.instance_id, hashes) for inst in candidates]
        depth = max(depths)
        matched_tokens = min(request.input_tokens, depth * self.block_size_tokens)
        match_rate = matched_tokens / request.input_tokens if request.input_tokens else 0.0
        if match_rate > self.cache_threshold:
            best = [inst for inst, d in zip(candidates, depths, strict=False) if d == depth]
            return self._rng.choice(best), f"cache_hit:{match_rate:.2f}"

        sizes = [self._trees.size_blocks(inst.instance_id) for inst in candidates]
        smallest = min(sizes)
        small = [inst for inst, s in zip(candidates, sizes, strict=False) if s == smallest]
        return self._rng.choice(small), f"smallest_tree:{match_rate:.2f}"

    def _maybe_evict(self, now_s: float) -> None:
        if self.eviction_interval_s <= 0:
            self._trees.evict_to(self.max_tree_blocks)
            return
        if self._last_eviction_s is None:
            self._last_eviction_s = now_s
        elif now_s - self._last_eviction_s >= self.eviction_interval_s:
            self._trees.evict_to(self.max_tree_blocks)
            self._last_eviction_s = now_s
