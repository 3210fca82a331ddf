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

Chained hashes mean holding block ``k`` implies holding ``0..k-1``, so we
probe only every ``stride``-th block, and a lookup binary-searches each
holder's depth: O(prompt blocks / stride) to sample plus
O(holders * log(probes)) dictionary lookups, whatever the cache size. To keep
"held" monotone along a prompt under LRU eviction, prompts are inserted
deepest block first, so a prefix's shallow blocks are always fresher than its
deep ones and are evicted last (vLLM evicts tails first too).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.types import KVEvent

#: Speculative entries keep every 4th probe: they only need to be right to
#: within a few probes (2,048 tokens) and are written on the routing path,
#: where every dictionary operation counts.
_SPEC_EVERY = 4

#: Above this many holders of a prompt's first probe, narrow the set walking
#: probes in order before binary-searching each survivor.
_NARROW_ABOVE = 8


def _depths(
    table: Mapping[int, Mapping[str, object] | set[str]], probes: Sequence[int], stride: int
) -> dict[str, int]:
    """Leading probes each instance holds, times ``stride`` (engine blocks)."""
    n = len(probes)
    if n == 0:
        return {}
    first = table.get(probes[0])
    if not first:
        return {}
    out: dict[str, int] = {}
    alive = set(first)
    lo0 = 1
    while len(alive) > _NARROW_ABOVE and lo0 < n:
        here = table.get(probes[lo0])
        keep = alive.intersection(here) if here else set()
        for inst in alive - keep:
            out[inst] = lo0 * stride
        alive = keep
        lo0 += 1
    for inst in alive:
        lo, hi = lo0, n
        while lo < hi:
            mid = (lo + hi) // 2
            held = table.get(probes[mid])
            if held is not None and inst in held:
                lo = mid + 1
            else:
                hi = mid
        out[inst] = lo * stride
    return out


class PrefixKnowledge:
    """Per-router cache beliefs; see the module docstring for the three tiers."""

    def __init__(
        self, stride_blocks: int = 32, speculative_ttl_s: float = 30.0, event_grace_s: float = 2.0
    ) -> None:
        if stride_blocks < 1:
            raise ValueError("stride_blocks must be >= 1")
        self.stride_blocks = stride_blocks
        self.speculative_ttl_s = speculative_ttl_s
        self.routed = PrefixIndex(stride_blocks=1)  # fed already-sampled probes
        self._spec: dict[int, dict[str, int]] = {}  # probe hash -> instance -> refs
        self._spec_live: dict[int, tuple[str, tuple[int, ...]]] = {}  # ticket -> entry
        self._spec_expiry: deque[tuple[float, int]] = deque()
        # entries whose prefill is done, kept until the engine's events arrive
        self._spec_grace: deque[tuple[float, int]] = deque()
        self.event_grace_s = event_grace_s
        self._ticket = 0
        self._exact: dict[int, set[str]] = {}
        self._exact_blocks: dict[str, set[int]] = {}
        self.exact_instances: set[str] = set()

    def probes(self, block_hashes: Sequence[int]) -> tuple[int, ...]:
        s = self.stride_blocks
        return tuple(block_hashes[s - 1 :: s])

    def set_capacity(self, instance_id: str, capacity_blocks: int) -> None:
        self.routed.set_capacity(instance_id, capacity_blocks // self.stride_blocks)

    # -- lookups ----------------------------------------------------------
    def match(self, probes: Sequence[int]) -> tuple[dict[str, int], dict[str, int]]:
        """(confirmed, speculative) leading engine blocks per instance."""
        if not probes:
            return {}, {}
        s = self.stride_blocks
        confirmed = _depths(self.routed.holders, probes, s) if self.routed.holders else {}
        if self.exact_instances:
            for inst in self.exact_instances:
                confirmed.pop(inst, None)
            confirmed.update(_depths(self._exact, probes, s))
        spec = (
            _depths(self._spec, probes[_SPEC_EVERY - 1 :: _SPEC_EVERY], s * _SPEC_EVERY)
            if self._spec
            else {}
        )
        return confirmed, spec

    # -- updates from routing and first tokens -------------------------------
    def speculate(self, instance_id: str, probes: tuple[int, ...], now_s: float) -> int:
        """Write a speculative entry; returns a ticket for :meth:`unspeculate` (0: none)."""
        if self.speculative_ttl_s <= 0.0:
            return 0
        spec = self._spec
        probes = probes[_SPEC_EVERY - 1 :: _SPEC_EVERY]
        for h in probes:
            refs = spec.get(h)
            if refs is None:
                spec[h] = {instance_id: 1}
            else:
                refs[instance_id] = refs.get(instance_id, 0) + 1
        self._ticket += 1
        self._spec_live[self._ticket] = (instance_id, probes)
        self._spec_expiry.append((now_s + self.speculative_ttl_s, self._ticket))
        return self._ticket

    def unspeculate(self, ticket: int) -> None:
        """Drop one speculative entry (first token arrived, or it was cancelled)."""
        entry = self._spec_live.pop(ticket, None)
        if entry is not None:
            self._unspeculate(*entry)

    def _unspeculate(self, instance_id: str, probes: tuple[int, ...]) -> None:
        spec = self._spec
        for h in probes:
            refs = spec.get(h)
            if refs is None:
                continue
            n = refs.get(instance_id, 0) - 1
            if n > 0:
                refs[instance_id] = n
            else:
                refs.pop(instance_id, None)
                if not refs:
                    del spec[h]

    def expire(self, now_s: float) -> None:
        """Drop speculation nobody confirmed (lost events, very long queues)."""
        for q in (self._spec_expiry, self._spec_grace):
            while q and q[0][0] <= now_s:
                self.unspeculate(q.popleft()[1])

    def release(self, ticket: int, instance_id: str, now_s: float) -> None:
        """The request's prefill is done: drop its speculative entry. For an
        instance whose engine reports KV events, keep it ``event_grace_s``
        longer: its BlockStored events travel another path (engine -> worker
        -> shared stream) and may arrive after the first token does."""
        if instance_id in self.exact_instances and self.event_grace_s > 0.0:
            if ticket in self._spec_live:
                self._spec_grace.append((now_s + self.event_grace_s, ticket))
            return
        self.unspeculate(ticket)

    def confirm(self, instance_id: str, probes: Sequence[int]) -> None:
        """The prefill finished: the prefix is now really cached there."""
        if instance_id not in self.exact_instances:
            self.routed.insert(instance_id, probes, deepest_first=True)

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
        self._end_grace(instance_id)
        mine = self._exact_blocks.setdefault(instance_id, set())
        for h in block_hashes:
            if h in mine:
                mine.discard(h)
                holders = self._exact.get(h)
                if holders is not None:
                    holders.discard(instance_id)
                    if not holders:
                        del self._exact[h]

    def _end_grace(self, instance_id: str) -> None:
        """The engine reported an eviction: its own events speak for it now."""
        if not self._spec_grace:
            return
        keep: deque[tuple[float, int]] = deque()
        for at, ticket in self._spec_grace:
            entry = self._spec_live.get(ticket)
            if entry is not None and entry[0] == instance_id:
                self.unspeculate(ticket)
            elif entry is not None:
                keep.append((at, ticket))
        self._spec_grace = keep

    def cleared(self, instance_id: str) -> None:
        self.exact_instances.add(instance_id)
        self.removed(instance_id, list(self._exact_blocks.get(instance_id, ())))
        self.routed.clear(instance_id)

    def apply(self, event: KVEvent) -> None:
        """One exact engine event (stored, removed or cleared)."""
        if event.kind == "stored":
            self.stored(event.instance_id, event.block_hashes)
        elif event.kind == "removed":
            self.removed(event.instance_id, event.block_hashes)
        elif event.kind == "cleared":
            self.cleared(event.instance_id)
