"""A pool-wide prefix index: block hash -> instances believed to hold it.

Routers cannot see engine caches directly. They either remember what they
routed where (approximate mode, as llm-d's approximate prefix scorer and
SGLang's router do) or consume engine KV events (exact mode, as Dynamo's
KV router does). Both feed this one structure.

Because block hashes are *chained* (a block's hash covers the whole prefix up
to it), holding block ``k`` implies holding blocks ``0..k-1``, so we only
need to index every ``stride``-th block. A lookup walks the request's sampled
hashes once and narrows the set of holders, so its cost is
O(prompt blocks / stride + instances), independent of pool-wide cache size.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.core.types import KVEvent


class PrefixIndex:
    """Approximate, LRU-bounded map from block hashes to instances."""

    def __init__(self, stride_blocks: int = 16) -> None:
        if stride_blocks < 1:
            raise ValueError("stride_blocks must be >= 1")
        self.stride_blocks = stride_blocks
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    # -- configuration ----------------------------------------------------
    def set_capacity(self, instance_id: str, capacity_blocks: int) -> None:
        """Bound one instance's entries to roughly its KV capacity."""
        self._capacity[instance_id] = max(1, capacity_blocks // self.stride_blocks)
        self._lru.setdefault(instance_id, OrderedDict())

    def sampled(self, block_hashes: Sequence[int]) -> Sequence[int]:
        s = self.stride_blocks
        return block_hashes[s - 1 :: s]

    # -- queries ------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading engine blocks each instance is believed to hold (>0 only)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        n = 0
        for h in self.sampled(block_hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            if alive is None:
                alive = set(holders)
            elif not alive <= holders:  # fast path: nobody dropped out
                for inst in alive - holders:
                    out[inst] = n
                alive &= holders
                if not alive:
                    break
            n += self.stride_blocks
        if alive:
            for inst in alive:
                out[inst] = n
        return {k: v for k, v in out.items() if v > 0}

    def match_instance(self, instance_id: str, block_hashes: Sequence[int]) -> int:
        lru = self._lru.get(instance_id)
        if not lru:
            return 0
        n = 0
        for h in self.sampled(block_hashes):
            if h not in lru:
                break
            n += self.stride_blocks
        return n

    def entries(self, instance_id: str) -> int:
        return len(self._lru.get(instance_id, ()))

    # -- updates ----------------------------------------------------------
    @property
    def holders(self) -> dict[int, set[str]]:
        """Sampled hash -> instances believed to hold it (read-only view)."""
        return self._holders

    def insert(
        self, instance_id: str, block_hashes: Sequence[int], deepest_first: bool = False
    ) -> None:
        """Record (or refresh) that ``instance_id`` now holds this prefix.

        ``deepest_first`` touches the tail first so the shallow blocks end up
        freshest and are evicted last, as an engine evicts tails before heads.
        """
        lru = self._lru.get(instance_id)
        if lru is None:
            lru = self._lru[instance_id] = OrderedDict()
        holders = self._holders
        get = holders.get
        touch = lru.move_to_end
        sampled = self.sampled(block_hashes)
        for h in reversed(sampled) if deepest_first else sampled:
            if h in lru:
                touch(h)
                continue
            lru[h] = None
            held = get(h)
            if held is None:
                holders[h] = {instance_id}
            else:
                held.add(instance_id)
        cap = self._capacity.get(instance_id)
        if cap is not None:
            pop = lru.popitem
            while len(lru) > cap:
                old, _ = pop(last=False)
                held = holders[old]
                held.discard(instance_id)
                if not held:
                    del holders[old]

    def apply(self, event: KVEvent) -> None:
        """One engine KV event (``stored``, ``removed``, or a clear)."""
        if event.kind == "stored":
            self.insert(event.instance_id, event.block_hashes)
        elif event.kind == "removed":
            self.remove(event.instance_id, event.block_hashes)
        else:
            self.clear(event.instance_id)

    def remove(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        """Forget blocks, e.g. on a vLLM ``BlockRemoved`` event."""
        lru = self._lru.get(instance_id)
        if lru is None:
            return
        for h in block_hashes:
            if h in lru:
                del lru[h]
                self._drop(h, instance_id)

    def clear(self, instance_id: str) -> None:
        lru = self._lru.get(instance_id)
        if lru is None:
            return
        for h in lru:
            self._drop(h, instance_id)
        lru.clear()

    def _drop(self, h: int, instance_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._holders[h]


def weighted_runs(
    block_hashes: Sequence[int], holders_of: Callable[[int], Mapping[str, float]]
) -> tuple[dict[str, float], dict[str, int]]:
    """Per holder, the leading run of ``block_hashes`` it holds and the run's
    summed weight. ``holders_of(h)`` maps each holder of block ``h`` to that
    block's weight there (the best tier holding it; <= 0 counts as absent), so
    a run goes on while *some* tier holds the next block, as tier-aware
    indexes (llm-d's per-``DeviceTier`` entries, vllm-router's
    ``StorageTier``) score it."""
    scores: dict[str, float] = {}
    runs: dict[str, int] = {}
    active: set[str] | None = None
    for h in block_hashes:
        here = holders_of(h)
        alive = {w: v for w, v in here.items() if v > 0.0 and (active is None or w in active)}
        if not alive:
            break
        for holder, v in alive.items():
            scores[holder] = scores.get(holder, 0.0) + v
            runs[holder] = runs.get(holder, 0) + 1
        active = set(alive)
    return scores, runs
