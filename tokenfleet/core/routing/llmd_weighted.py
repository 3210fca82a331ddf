"""llm-d inference scheduler's default weighted scorers and max-score picker."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

from tokenfleet.core.prefix_index import weighted_runs
from tokenfleet.core.routing.base import ROUTERS, BaseRouter, eligible
from tokenfleet.core.types import (
    BLOCK_SIZE_TOKENS,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)

#: Upstream ``DefaultMaxPrefixBlocks``: prompts are hashed up to this many blocks.
DEFAULT_MAX_PREFIX_BLOCKS = 256
#: Upstream ``DefaultLRUCapacityPerServer`` (blocks), used when a pod does not
#: report its number of GPU KV blocks.
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250


class _PrefixIndexer:
    """Approximate prefix index: one LRU of block hashes per pod.

    Mirrors the upstream ``indexer``: a pod's LRU is sized once, when the pod
    is first added; adding a prompt touches its hashes in prompt order (so a
    long-unused prompt loses its *first* blocks first); lookups ask, per
    hash, which pods hold it.
    """

    def __init__(self) -> None:
        self._hash_to_pods: dict[int, set[str]] = {}
        self._pod_lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def entries(self, pod: str) -> int:
        lru = self._pod_lru.get(pod)
        return len(lru) if lru is not None else 0

    def add(self, hashes: Sequence[int], pod: str, capacity_blocks: int) -> None:
        lru = self._pod_lru.get(pod)
        if lru is None:
            lru = self._pod_lru[pod] = OrderedDict()
            self._capacity[pod] = max(1, capacity_blocks)
        cap = self._capacity[pod]
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._hash_to_pods.setdefault(h, set()).add(pod)
            if len(lru) > cap:
                old, _ = lru.popitem(last=False)
                pods = self._hash_to_pods.get(old)
                if pods is not None:
                    pods.discard(pod)
                    if not pods:
                        del self._hash_to_pods[old]

    def match_longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Upstream ``matchLongestPrefix``: walk hashes until no pod holds one;
        every pod holding a walked hash scores one block for it."""
        res: dict[str, int] = {}
        for h in hashes:
            pods = self._hash_to_pods.get(h)
            if not pods:
                break
            for pod in pods:
                res[pod] = res.get(pod, 0) + 1
        return res


class _PreciseIndex:
    """The precise-prefix-cache-scorer's view: which pod holds which block,
    exactly as the engines' KV events (BlockStored / BlockRemoved /
    AllBlocksCleared) report it (llm-d-kv-cache-manager ``kvevents.Pool``
    feeding ``kvblock.Index``). Nothing is inserted at routing time
    (speculative indexing is off by default upstream)."""

    def __init__(self) -> None:
        self._pods: dict[int, set[str]] = {}
        self._held: dict[str, set[int]] = {}

    def stored(self, pod: str, hashes: Sequence[int]) -> None:
        held = self._held.setdefault(pod, set())
        for h in hashes:
            held.add(h)
            self._pods.setdefault(h, set()).add(pod)

    def removed(self, pod: str, hashes: Sequence[int]) -> None:
        held = self._held.get(pod)
        for h in hashes:
            if held is not None:
                held.discard(h)
            pods = self._pods.get(h)
            if pods is not None:
                pods.discard(pod)
                if not pods:
                    del self._pods[h]

    def cleared(self, pod: str) -> None:
        self.removed(pod, list(self._held.pop(pod, ())))

    def longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """Upstream ``LongestPrefixScorer``: consecutive blocks from block 0
        per pod; only pods holding the first block appear."""
        if not hashes:
            return {}
        active = set(self._pods.get(hashes[0], ()))
        scores = {pod: 1 for pod in active}
        for h in hashes[1:]:
            if not active:
                break
            active &= self._pods.get(h, set())
            for pod in active:
                scores[pod] += 1
        return scores


#: llm-d-kv-cache-manager ``DefaultKVCacheBackendConfig`` (``pkg/kvcache``): the
#: scorer's weight per device tier, the lowercased ``medium`` of the KV events
#: (vLLM's offloading connector reports its host tier as "CPU")
DEFAULT_TIER_WEIGHTS = {"gpu": 1.0, "cpu": 0.8, "shared_storage": 0.4}


class _TieredPreciseIndex:
    """The precise index per device tier, as ``kvblock.PodEntry`` carries a
    ``DeviceTier``: a pod's run of prompt blocks continues while any tier holds
    the next block, and each block scores the weight of the best tier holding
    it there. With GPU events only, scores are the plain run lengths."""

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.tiers: dict[str, _PreciseIndex] = {"gpu": _PreciseIndex()}

    def tier(self, medium: str) -> _PreciseIndex:
        key = medium.lower()
        idx = self.tiers.get(key)
        if idx is None:
            idx = self.tiers[key] = _PreciseIndex()
        return idx

    def cleared(self, pod: str) -> None:
        for idx in self.tiers.values():
            idx.cleared(pod)

    def longest_prefix(self, hashes: Sequence[int]) -> tuple[dict[str, float], dict[str, int]]:
        """(weighted scores, run lengths in blocks) per pod."""
        if len(self.tiers) == 1:
            run = self.tiers["gpu"].longest_prefix(hashes)
            return {p: float(n) for p, n in run.items()}, run
        tiers = [(self.weights.get(k, 0.0), idx._pods) for k, idx in self.tiers.items()]

        def holders(h: int) -> dict[str, float]:
            best: dict[str, float] = {}
            for w, pods in tiers:
                for pod in pods.get(h, ()):
                    if w > best.get(pod, 0.0):
                        best[pod] = w
            return best

        return weighted_runs(hashes, holders)


def normalized_precise_scores(pods: Sequence[str], raw: dict[str, float]) -> dict[str, float]:
    """Upstream ``indexedScoresToNormalizedScoredPods``: min-max over the pods
    the index returned (all 1.0 when they tie), 0 for pods it did not return."""
    if not raw:
        return {p: 0.0 for p in pods}
    lo, hi = min(raw.values()), max(raw.values())
    out = {}
    for p in pods:
        v = raw.get(p)
        if v is None:
            out[p] = 0.0
        elif lo == hi:
            out[p] = 1.0
        else:
            out[p] = (v - lo) / (hi - lo)
    return out


@ROUTERS.register("llmd_weighted")
class LlmdWeightedRouter(BaseRouter):
    """llm-d / Gateway API Inference Extension endpoint picker, default profile.

    Sources (kubernetes-sigs/gateway-api-inference-extension):
    ``pkg/epp/scheduling/framework/plugins/multi/prefix/plugin.go`` and
    ``indexer.go`` (prefix-cache-scorer), ``.../plugins/scorer/queue.go``,
    ``.../plugins/scorer/kvcache_utilization.go``,
    ``.../plugins/picker/max_score_picker.go``; weights from the default
    ``EndpointPickerConfig`` the inferencepool chart installs
    (``config/charts/inferencepool/templates/epp-config.yaml``) and the llm-d
    inference-scheduling guide: prefix-cache 3, queue 2, kv-cache 2.

    Each eligible pod scores ``3*prefix + 2*queue + 2*kv``:

    - prefix = matched blocks / hashed blocks of the prompt (at most
      ``max_prefix_blocks``); 0 for prompts shorter than one block. Upstream
      hashes 64-character blocks, i.e. one 16-token engine block at its
      assumed 4 characters per token, so our 16-token block hashes map 1:1.
      The index is updated when a pod is picked (approximate: it never sees
      engine evictions) and each pod's LRU holds as many entries as the pod
      has KV blocks (upstream ``autoTune``), else 31250.
    - queue = ``(max_wait - wait) / (max_wait - min_wait)`` over the scraped
      ``num_waiting`` of the candidates; 1.0 for all when they are equal.
    - kv = ``1 - kv_usage`` (scraped).

    The picker takes the highest total; ties go to a random best pod
    (upstream shuffles, then stable-sorts by score).

    With engine KV events the prefix term is llm-d's
    ``precise-prefix-cache-scorer`` instead (llm-d/llm-d-inference-scheduler
    ``pkg/plugins/scorer/precise_prefix_cache.go`` and ``utils.go``;
    llm-d/llm-d-kv-cache-manager ``pkg/kvcache/kvblock_scorer.go``), the
    scorer of llm-d's precise-prefix-cache-aware guide, with the same 3/2/2
    weights: an index fed only by the engines' events, the longest run of
    prompt blocks from block 0 each pod holds, min-max normalised over the
    pods that hold at least the first block (a single holder scores 1, pods
    holding nothing 0). ``prefix_scorer``: ``"auto"`` (default) switches to
    it on the first engine event, as a deployment whose engines publish
    events is configured with it; ``"approximate"`` / ``"precise"`` force one.
    Engines with a host-memory KV tier (vLLM's offloading connector) also
    report its blocks, with ``medium="CPU"``: the precise index keeps them per
    tier and weighs each block by its tier (``tier_weights``, upstream's
    defaults gpu 1.0 / cpu 0.8).
    """

    name = "llmd_weighted"

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
        lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER,
        auto_tune: bool = True,
        block_size_tokens: int = BLOCK_SIZE_TOKENS,
        prefix_scorer: str = "auto",
        tier_weights: dict[str, float] | None = None,
        seed: int = 0,
    ) -> None:
        if prefix_scorer not in ("auto", "approximate", "precise"):
            raise ValueError("prefix_scorer must be 'auto', 'approximate' or 'precise'")
        self.prefix_scorer = prefix_scorer
        self._events_seen = False
        self._precise = _TieredPreciseIndex(dict(tier_weights or DEFAULT_TIER_WEIGHTS))
        self.prefix_weight = prefix_weight
        self.queue_weight = queue_weight
        self.kv_weight = kv_weight
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity_per_server = lru_capacity_per_server
        self.auto_tune = auto_tune
        self.block_size_tokens = block_size_tokens
        self._index = _PrefixIndexer()
        self._rng = random.Random(seed)

    @property
    def precise(self) -> bool:
        """True when the prefix term is the precise (KV-event) scorer."""
        if self.prefix_scorer == "auto":
            return self._events_seen
        return self.prefix_scorer == "precise"

    def index_entries(self, instance_id: str) -> int:
        return self._index.entries(instance_id)

    def _prefix_terms(
        self, request: RequestInfo, candidates: Sequence[InstanceView]
    ) -> tuple[dict[str, float], dict[str, int]]:
        """(prefix score in [0, 1], matched blocks) per candidate."""
        ids = [inst.instance_id for inst in candidates]
        if self.precise:
            weighted, matched = self._precise.longest_prefix(request.block_hashes)
            return normalized_precise_scores(ids, weighted), matched
        hashes = request.block_hashes[: self.max_prefix_blocks]
        matched = self._index.match_longest_prefix(hashes)
        n = len(hashes)
        return {i: (matched.get(i, 0) / n if n else 0.0) for i in ids}, matched

    def scores(self, request: RequestInfo, candidates: Sequence[InstanceView]) -> dict[str, float]:
        """Weighted total per candidate (exposed for tests and explanations)."""
        return self._totals(candidates, self._prefix_terms(request, candidates)[0])

    def _totals(
        self, candidates: Sequence[InstanceView], prefix_scores: dict[str, float]
    ) -> dict[str, float]:
        waits = [inst.metrics.num_waiting for inst in candidates]
        min_wait, max_wait = min(waits), max(waits)
        out: dict[str, float] = {}
        for inst in candidates:
            prefix = prefix_scores.get(inst.instance_id, 0.0)
            if max_wait == min_wait:
                queue = 1.0
            else:
                queue = (max_wait - inst.metrics.num_waiting) / (max_wait - min_wait)
            kv = 1.0 - inst.metrics.kv_usage
            out[inst.instance_id] = (
                self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * kv
            )
        return out

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        candidates = eligible(request, pool)
        prefix_scores, matched = self._prefix_terms(request, candidates)
        totals = self._totals(candidates, prefix_scores)
        best_score = max(totals.values())
        best = [inst for inst in candidates if totals[inst.instance_id] == best_score]
        chosen = self._rng.choice(best)

        if not self.precise:  # the approximate scorer learns from its own picks
            capacity = self.lru_capacity_per_server
            if self.auto_tune and chosen.kv_capacity_tokens > 0:
                capacity = chosen.kv_capacity_tokens // self.block_size_tokens
            self._index.add(
                request.block_hashes[: self.max_prefix_blocks], chosen.instance_id, capacity
            )
        cached_blocks = matched.get(chosen.instance_id, 0)
        return RouteDecision(
            instance_id=chosen.instance_id,
            expected_cached_tokens=min(
                request.input_tokens, cached_blocks * self.block_size_tokens
            ),
            reason=f"score:{best_score:.3f}",
        )

    def on_kv_event(self, event: KVEvent) -> None:
        """Engine KV events feed the precise scorer's index. Inferred hints
        (``exact=False``) are not engine events and are ignored, as the
        upstream kvevents pool only subscribes to the engines."""
        if not event.exact or self.prefix_scorer == "approximate":
            return
        self._events_seen = True
        if event.kind == "stored":
            self._precise.tier(event.medium).stored(event.instance_id, event.block_hashes)
        elif event.kind == "removed":
            self._precise.tier(event.medium).removed(event.instance_id, event.block_hashes)
        elif event.kind == "cleared":
            self._precise.cleared(event.instance_id)
