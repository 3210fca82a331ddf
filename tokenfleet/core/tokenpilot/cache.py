"""What one TokenPilot replica believes each instance holds in its KV cache.

Three sources, in decreasing order of trust:

* **exact** block sets fed by engine KV events (vLLM ``BlockStored`` /
  ``BlockRemoved``; the approach of Dynamo's KV router,
  ``lib/llm/src/kv_router/indexer.rs``). Once an instance has sent an event,
  its exact set replaces the approximate one.
* **approximate** prefixes this router saw prefilled (confirmed at first
  token), an LRU sized from the instance's KV capacity, as llm-d's
  approximate prefix scorer and SGLang's radix-tree router do
  (``pkg/plugins/scorer/prefix`` in llm-d-inference-scheduler,
  ``sgl-router/src/policies/cache_aware.rs``).
* **speculative** entries written at routing time, reference-counted and
  expiring after a TTL, so a burst of requests sharing a new prefix follows
  the first one instead of scattering before any prefill has finished.

Chained hashes mean holding block ``k`` implies holding ``0..k-1``, so all
lookups probe every ``stride``-th block only: O(prompt blocks / stride +
holders) per request whatever the pool's total cache size.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping, Sequence

from tokenfleet.core.prefix_index import PrefixIndex


def _walk(table: Mapping[int, Iterable[str]], probes: Sequence[int],
          stride: int) -> dict[str, int]:
    """Longest leading run of probes each instance holds, in engine blocks."""
    out: dict[str, int] = {}
    alive: set[str] | None = None
    n = 0
    for h in probes:
        holders = table.get(h)
        if not holders:
            break
        if alive is None:
            alive = set(holders)
        else:
            keep = alive.intersection(holders)
            if len(keep) != len(alive):
                for inst in alive - keep:
                    out[inst] = n
                alive = keep
                if not alive:
                    break
        n += stride
    if alive:
        for inst in alive:
            out[inst] = n
    return out


class PrefixKnowledge:
    """Per-router cache beliefs; see the module docstring for the three tiers."""

    def __init__(self, stride_blocks: int = 16, speculative_ttl_s: float = 30.0) -> None:
        if stride_blocks < 1:
            raise ValueError("stride_blocks must be >= 1")
        self.stride_blocks = stride_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self.routed = PrefixIndex(stride_blocks)
        self._spec: dict[int, dict[str, int]] = {}  # probe hash -> instance -> refs
        self._spec_expiry: deque[tuple[float, str, tuple[int, ...]]] = deque()
        self._exact: dict[int, set[str]] = {}
        self._exact_blocks: dict[str, set[int]] = {}
        self.exact_instances: set[str] = set()

    def probes(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        s = self.stride_blocks
        return tuple(block_hashes[s - 1 :: s])

    def set_capacity(self, instance_id: str, capacity_blocks: int) -> None:
        self.routed.set_capacity(instance_id, capacity_blocks)

    # -- lookups ----------------------------------------------------------
    def match(self, block_hashes: Sequence[int],
              probes: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """(confirmed, speculative) leading engine blocks per instance.

        ``probes`` must be ``self.probes(block_hashes)`` (computed once by the
        caller, which also needs them to speculate).
        """
        if not probes:
            return {}, {}
        s = self.stride_blocks
        confirmed = self.routed.match(block_hashes)
        if self.exact_instances:
            for inst in self.exact_instances:
                confirmed.pop(inst, None)
            confirmed.update(_walk(self._exact, probes, s))
        spec = _walk(self._spec, probes, s) if self._spec else {}
        return confirmed, spec

    # -- updates from routing and first tokens -------------------------------
    def speculate(self, instance_id: str, probes: tuple[int, ...], now_s: float) -> None:
        for h in probes:
            refs = self._spec.get(h)
            if refs is None:
                self._spec[h] = {instance_id: 1}
            else:
                refs[instance_id] = refs.get(instance_id, 0) + 1
        self._spec_expiry.append((now_s + self.speculative_ttl_s, instance_id, probes))

    def unspeculate(self, instance_id: str, probes: tuple[int, ...]) -> None:
        for h in probes:
            refs = self._spec.get(h)
            if refs is None:
                continue
            n = refs.get(instance_id, 0) - 1
            if n > 0:
                refs[instance_id] = n
            else:
                refs.pop(instance_id, None)
                if not refs:
                    del self._spec[h]

    def expire(self, now_s: float) -> None:
        """Drop speculation nobody confirmed (lost events, cancelled requests)."""
        q = self._spec_expiry
        while q and q[0][0] <= now_s:
            _, inst, probes = q.popleft()
            self.unspeculate(inst, probes)

    def confirm(self, instance_id: str, block_hashes: Sequence[int]) -> None:
        """The prefill finished: the prefix is now really cached there."""
        if instance_id not in self.exact_instances:
            self.routed.insert(instance_id, block_hashes)

    # -- exact engine KV events ------------------------------------------------
    def stored(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        self.exact_instances.add(instance_id)
        mine = self._exact_blocks.setdefault(instance_id, set())
        for h in block_hashes:
            if h not in mine:
                mine.add(h)
                self._exact.setdefault(h, set()).add(instance_id)

    def removed(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        self.exact_instances.add(instance_id)
        mine = self._exact_blocks.setdefault(instance_id, set())
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                holders = self._exact.get(h)
                if holders is not None:
                    holders.discard(instance_id)
                    if not holders:
                        del self._exact[h]

    def cleared(self, instance_id: str) -> None:
        self.exact_instances.add(instance_id)
        self.removed(instance_id, list(self._exact_blocks.get(instance_id, ())))
        self.routed.clear(instance_id)
