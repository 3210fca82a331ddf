"""Where a prefix's KV is, and what reusing it costs, in predicted seconds.

An engine with vLLM's ``OffloadingConnector`` (``--kv-offloading-size``)
keeps a host-memory KV tier behind its GPU prefix cache: every block it
caches is also written to host memory, and a request whose prefix is no
longer on the GPU but still in host memory loads it back over the host link
instead of recomputing it (docs/engine-model.md, section 2b). To a router a
hit is then worth what it saves, by tier:

* GPU: free (the prefill skips it);
* host: the transfer, ``latency + tokens * kv_bytes_per_token / (tp * link)``
  from the engine profile an operator configures;
* none: the prefill of those tokens (the cost model TokenPilot already has).

TokenPilot learns the host tier the way it learns the GPU tier, only from
what a live router can see: the engine's KV events, where vLLM tags each
``BlockStored`` / ``BlockRemoved`` with a ``medium`` ("GPU", or "CPU" for
the offloading tier), or, without events, its own accounting: the tier is
write-through, so whatever it saw prefilled on an instance is in that
instance's host tier until an LRU as large as the tier would have dropped it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenfleet.core.tokenpilot.cache import PrefixKnowledge
from tokenfleet.core.types import BLOCK_SIZE_TOKENS, KVEvent
from tokenfleet.engine.profiles import EngineProfile


class HostTierKnowledge:
    """One router replica's beliefs about every instance's host-memory KV tier.

    The same three-source structure as the GPU tier's :class:`PrefixKnowledge`
    (without speculation: a host copy exists only after a prefill): exact
    once an instance has sent a host-tier event (``medium="CPU"``),
    approximate before that, for instances whose profile has a host tier.
    """

    def __init__(self, stride_blocks: int = 32) -> None:
        self.blocks = PrefixKnowledge(stride_blocks, speculative_ttl_s=0.0)
        self.profiles: dict[str, EngineProfile] = {}  # instances with a host tier

    @property
    def enabled(self) -> bool:
        return bool(self.profiles)

    def set_instance(self, instance_id: str, profile: EngineProfile) -> None:
        """An instance (re)appears with this profile: size its approximate tier."""
        blocks = profile.host_kv_capacity_blocks
        if blocks > 0:
            self.profiles[instance_id] = profile
            self.blocks.set_capacity(instance_id, blocks)
        else:
            self.profiles.pop(instance_id, None)

    def price(
        self, probes: Sequence[int], gpu_hits: dict[str, int] | None, max_cached: int
    ) -> tuple[dict[str, int] | None, dict[str, float] | None]:
        """Cached tokens per instance counting both tiers, and the load seconds
        the host part costs there (none where the GPU already covers it)."""
        host, _ = self.blocks.match(probes) if self.profiles else ({}, {})
        if not host:
            return gpu_hits, None
        hits = dict(gpu_hits) if gpu_hits else {}
        loads: dict[str, float] = {}
        for iid, depth in host.items():
            prof = self.profiles.get(iid)
            if prof is None:
                continue
            c_host = min(max_cached, depth * BLOCK_SIZE_TOKENS)
            c_gpu = hits.get(iid, 0)
            if c_host > c_gpu:
                hits[iid] = c_host
                loads[iid] = prof.host_load_time_s(c_host - c_gpu)
        return hits, loads

    def confirm(self, instance_id: str, probes: Sequence[int]) -> None:
        """Prefilled there: written through to its host tier (own accounting)."""
        if instance_id in self.profiles:
            self.blocks.confirm(instance_id, probes)

    def on_event(self, event: KVEvent) -> None:
        """A host-tier engine event (vLLM's offloading connector, medium "CPU")."""
        if not event.exact:
            return
        self.blocks.apply(event)
