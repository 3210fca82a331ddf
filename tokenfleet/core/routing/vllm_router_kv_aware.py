"""vllm-router's ``kv_aware`` policy (vllm-project/router), as a peer.

Source: ``src/policies/kv_aware.rs`` (scoring), ``src/kv_index/scorer.rs``
(``PrefixScorer``) and ``src/kv_index/subscriber.rs`` (event ingestion).
The policy is backed by the engines' KV events only:

1. the prompt's block keys (16-token blocks, as the engine hashes them);
2. per worker, the longest run of those keys from block 0 that the block
   index says it holds (a gap ends the run);
3. the healthy worker with the highest score; with no hit anywhere (or a
   prompt shorter than one block), the least-loaded worker (the router's
   own in-flight count, ``Worker::load``);
4. speculative index entries for the chosen worker's uncached blocks, kept
   2 s (``KvAwareConfig::default``), so a burst sharing a new prefix follows
   the first request before its ``BlockStored`` events arrive.

Ties: Rust's ``max_by_key`` keeps the *last* maximum and ``min_by_key`` the
first minimum; so do we, in pool order.

Tiers. The subscriber files every event under a ``StorageTier`` derived from
the event's ``medium`` ("GPU" -> device; vLLM's offloading connector reports
its host tier as "CPU") or, for shared-pool copies, ``External``. A block
scores its tier's credit: 1 on the device, and the router's
``--kv-penalty-host`` / ``--kv-penalty-external`` ("KV transfer credit
(0.0-1.0)", defaults 0.8 and 0.6 in the vllm-router 0.1.17 wheel the live
head-to-head installs: its ``--help`` and ``vllm_router/router_args.py``;
the ``kv_aware.rs`` snapshots we could read state no values; its
``--kv-penalty-disk``, 0.3, has no tier here: no engine of ours has a disk).
A worker's run continues while any tier holds the next block; each block
scores its best tier there.

Not reproduced: the 0.1.17 wheel's ``kv_aware`` also has a cost model (its
``--router-temperature``: "0 selects minimum cost", a softmax over costs
otherwise; symbols ``PrefillWorkEstimate``, ``SlotCounters``) that the
stored source predates; this peer follows the stored source. On the live
head-to-head's slices the simulated peer stays within 15% of the real
router's TTFT p50 and p95 (docs/benchmarks.md, sections 26 and 30).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from tokenfleet.core.prefix_index import weighted_runs
from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)

#: vllm-router 0.1.17's ``--kv-penalty-host`` / ``--kv-penalty-external``
#: defaults: what a block held in that tier scores (a device copy scores 1)
HOST_CREDIT, EXTERNAL_CREDIT = 0.8, 0.6


class _TieredBlockIndex:
    """``KVBlockIndex``: block -> worker -> tiers it holds it in, plus
    speculative (device-tier) entries that expire."""

    def __init__(self) -> None:
        self.held: dict[int, dict[str, set[str]]] = {}
        self.spec: dict[int, dict[str, float]] = {}  # block -> worker -> expiry
        self._spec_order: deque[tuple[float, int, str]] = deque()

    def stored(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            self.held.setdefault(h, {}).setdefault(worker, set()).add(tier)

    def removed(self, worker: str, tier: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            by_worker = self.held.get(h)
            if by_worker is None:
                continue
            tiers = by_worker.get(worker)
            if tiers is None:
                continue
            tiers.discard(tier)
            if not tiers:
                del by_worker[worker]
                if not by_worker:
                    del self.held[h]

    def cleared(self, worker: str) -> None:
        for h in [h for h, w in self.held.items() if worker in w]:
            by_worker = self.held[h]
            del by_worker[worker]
            if not by_worker:
                del self.held[h]

    def speculate(self, worker: str, hashes: Sequence[int], until_s: float) -> None:
        for h in hashes:
            self.spec.setdefault(h, {})[worker] = until_s
            self._spec_order.append((until_s, h, worker))

    def expire(self, now_s: float) -> None:
        order = self._spec_order
        while order and order[0][0] <= now_s:
            _, h, worker = order.popleft()
            entries = self.spec.get(h)
            if entries is not None and entries.get(worker, now_s + 1.0) <= now_s:
                del entries[worker]
                if not entries:
                    del self.spec[h]

    def score(
        self, hashes: Sequence[int], weights: dict[str, float]
    ) -> tuple[dict[str, float], dict[str, int]]:
        """(tier-weighted score, run length in blocks) per worker."""
        device = weights["device"]

        def holders(h: int) -> dict[str, float]:
            best = {
                w: max(weights.get(t, 0.0) for t in tiers)
                for w, tiers in self.held.get(h, {}).items()
            }
            for worker in self.spec.get(h, ()):
                best[worker] = max(best.get(worker, 0.0), device)
            return best

        return weighted_runs(hashes, holders)


def storage_tier(medium: str) -> str:
    """``StorageTier::from_medium`` of the stored source: GPU (or none) is the
    device, CPU the host, anything else external."""
    m = medium.upper()
    if m in ("", "GPU"):
        return "device"
    if m.startswith("CPU"):
        return "host"
    return "external"


@ROUTERS.register("vllm_router_kv_aware")
class VllmRouterKvAware(BaseRouter):
    """vllm-router ``--policy kv_aware`` (see the module docstring)."""

    name = "vllm_router_kv_aware"
    #: the policy needs vLLM's KV events (``--kv-events-config``); the
    #: simulator turns them on for it unless told otherwise
    engines_publish_kv_events = True

    def __init__(
        self,
        *,
        enable_speculative: bool = True,
        speculative_ttl_s: float = 2.0,
        host_credit: float = HOST_CREDIT,
        external_credit: float = EXTERNAL_CREDIT,
        seed: int = 0,
        **_shared: object,
    ) -> None:
        self.enable_speculative = enable_speculative
        self.speculative_ttl_s = speculative_ttl_s
        self.weights = {
            "device": 1.0,
            "host": host_credit,
            "external": external_credit,
        }
        self.index = _TieredBlockIndex()

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        healthy = eligible(request, pool)
        if len(healthy) == 1:
            return RouteDecision(healthy[0].instance_id, reason="kv_aware: single worker")
        self.index.expire(pool.now_s)
        keys = request.block_hashes
        if not keys:
            chosen = min(healthy, key=lambda v: v.accounting.inflight_requests)
            return RouteDecision(chosen.instance_id, reason="kv_aware: short prompt, least load")
        scores, runs = self.index.score(keys, self.weights)
        best = healthy[0]
        best_score = scores.get(best.instance_id, 0.0)
        for inst in healthy[1:]:  # max_by_key: the last of equal maxima
            s = scores.get(inst.instance_id, 0.0)
            if s >= best_score:
                best, best_score = inst, s
        if best_score <= 0.0:
            best = min(healthy, key=lambda v: v.accounting.inflight_requests)
        run = runs.get(best.instance_id, 0)
        if self.enable_speculative and run < len(keys):
            self.index.speculate(best.instance_id, keys[run:], pool.now_s + self.speculative_ttl_s)
        cached = min(run * BLOCK_SIZE_TOKENS, max(0, request.input_tokens - 1))
        return RouteDecision(
            instance_id=best.instance_id,
            expected_cached_tokens=cached,
            reason=f"kv_aware: prefix score {best_score:.1f}/{len(keys)}",
        )

    def on_kv_event(self, event: KVEvent) -> None:
        if not event.exact:  # the policy reads engine events only
            return
        tier = storage_tier(event.medium)
        if event.kind == "stored":
            self.index.stored(event.instance_id, tier, event.block_hashes)
        elif event.kind == "removed":
            self.index.removed(event.instance_id, tier, event.block_hashes)
        elif event.kind == "cleared":
            self.index.cleared(event.instance_id)
