"""A simulated inference instance that schedules like vLLM (V1).

The engine is clock-free: ``plan_step`` builds the next batch and returns its
duration; ``finish_step`` applies it and reports first tokens and
completions. The discrete-event simulator and the real-time HTTP emulator
both drive this same object, so the emulator's timing is the simulator's.

Modelled, after vLLM's V1 scheduler and KV cache manager (file by file in
docs/engine-model.md, section 5):
- continuous batching: running requests first (decodes and unfinished
  chunked prefills), then waiting requests FCFS, within a token budget
  (``max_num_batched_tokens``) and ``max_num_seqs``;
- a paged KV cache of fixed 16-token blocks; a request enters the batch only
  if blocks for its scheduled tokens are free, otherwise it waits (FCFS: no
  skipping ahead);
- automatic prefix caching over chained block hashes: a full block is cached
  when it is *scheduled* (``cache_blocks`` in ``allocate_slots``), so a
  request scheduled later in the same step reuses it; generated tokens' full
  blocks are cached too when the driver knows their hashes;
- one free-block queue ordered by free time: never-used blocks first, then
  the least recently freed block, cached or not (a request frees its tail
  first), as ``FreeKVCacheBlockQueue`` does;
- recompute preemption when a running request cannot grow (counted, since
  admission control aims to make it never happen);
- optionally (``profile.host_kv_bytes > 0``, off by default) a host-memory KV
  tier as vLLM's ``OffloadingConnector`` keeps it (``--kv-offloading-size``):
  every block the GPU caches is also written to host memory (its own LRU),
  and a waiting request whose prefix continues in host memory first loads
  those blocks into fresh GPU blocks at the host link's bandwidth, without
  holding up the requests behind it, then prefills the rest;
- prefill/decode disaggregation, as vLLM's ``NixlConnector`` does it: a
  prefill-side request (``hold_kv``) keeps its blocks after its one token
  until the decode side has read them (``release``); a decode-side request
  (``remote_kv_tokens``) takes blocks for the prompt's KV at admission and
  waits while it arrives (``remote_load_s``), then recomputes the last
  prompt token and decodes (docs/engine-model.md, section 2c).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.errors import CapacityError


@dataclass(slots=True, eq=False)
class EngineRequest:
    """Engine-side request state. ``output_tokens`` is the true length.

    ``eq=False``: requests compare by identity; field-wise equality would make
    every ``list.remove`` compare whole hash tuples.
    """

    request_id: str
    input_tokens: int
    output_tokens: int
    block_hashes: Sequence[int] = ()
    #: Hashes of the full blocks of prompt + generated tokens after the prompt's
    #: own full blocks (truth the driver knows, e.g. a conversation's answer);
    #: empty when unknown, and then generated blocks stay uncached.
    output_block_hashes: Sequence[int] = ()
    # -- progress (engine-owned) --
    prompt_tokens: int = 0  # tokens to prefill: input + already generated
    computed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit at (first) admission
    chain: Sequence[int] = ()  # every block hash known: prompt, then output
    hashed: list[int] = field(default_factory=list)  # cache blocks referenced
    blocks: int = 0  # total KV blocks held
    blocks_private_hashed: int = 0  # chain blocks kept private (already cached)
    scheduled: int = 0  # tokens scheduled in the current step
    preemptions: int = 0
    first_token: bool = False
    admitted: bool = False
    host_hit_tokens: int = 0  # of cached_tokens, loaded from the host tier
    loading: bool = False  # waiting for its prefix to arrive from host memory
    load_left_s: float = 0.0
    #: P/D, prefill side: keep the KV blocks after finishing, until ``release``
    hold_kv: bool = False
    #: P/D, decode side: prompt tokens whose KV a prefill instance computed
    remote_kv_tokens: int = 0
    #: P/D, decode side: seconds the KV transfer takes once blocks are allocated
    remote_load_s: float = 0.0
    remote_hit_tokens: int = 0  # of the prompt, received from the prefill instance

    def __post_init__(self) -> None:
        self.prompt_tokens = self.input_tokens
        self.chain = self.block_hashes


@dataclass(slots=True)
class StepResult:
    first_tokens: list[EngineRequest]
    finished: list[EngineRequest]
    tokens_emitted: int
    #: P/D decode side: requests whose remote KV arrived during this step
    remote_loaded: list[EngineRequest] = field(default_factory=list)


@dataclass(slots=True)
class EngineCounters:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    # host tier (vLLM's external prefix cache counters: tokens past the GPU hit)
    host_queries_tokens: int = 0
    host_hits_tokens: int = 0
    host_hits_preempted_tokens: int = 0  # of host_hits_tokens, readmitted after preemption
    host_stored_blocks: int = 0
    host_evicted_blocks: int = 0
    host_load_s: float = 0.0  # link time spent loading (host -> GPU)
    host_store_s: float = 0.0  # link time spent offloading (GPU -> host)
    # P/D disaggregation (NixlConnector-style KV transfer)
    kv_transfer_in_tokens: int = 0  # decode side: prompt KV received
    kv_transfer_in_s: float = 0.0  # decode side: transfer time of what it received
    kv_transfer_out_tokens: int = 0  # prefill side: KV read by a decode instance
    kv_held_peak_blocks: int = 0  # prefill side: most blocks held for transfers at once

    @property
    def external_hits_tokens(self) -> int:
        """vLLM's ``external_prefix_cache_hits``: prompt KV a connector supplied
        (loaded from the host tier, or received from a prefill instance), which
        the GPU prefix cache's counters count as queried and not hit."""
        return self.host_hits_tokens - self.host_hits_preempted_tokens + self.kv_transfer_in_tokens

    @property
    def external_queries_tokens(self) -> int:
        """vLLM's ``external_prefix_cache_queries``: what connectors were asked
        for, past the GPU hit (a received prompt's KV counted as asked for)."""
        return self.host_queries_tokens + self.kv_transfer_in_tokens


#: While only host loads are in flight, the engine polls for their completion
#: this often (vLLM's scheduler checks finished transfers every step).
_LOAD_POLL_S = 0.002

#: vLLM KV-event ``medium`` names: the GPU block pool and the CPU offloading tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


class _Empty:
    """A free block that holds no cached prefix: a free-queue key by identity."""

    __slots__ = ()


class EngineInstance:
    """One inference engine: scheduler + paged KV cache + roofline timing.

    Subclasses observe the prefix cache through hooks, ``_on_stored`` and
    ``_on_removed`` for the GPU and ``_on_host_stored`` / ``_on_host_removed``
    for the host tier (the emulator turns them into vLLM KV events); by
    default they forward to ``kv_listener`` and ``host_listener``.
    """

    def __init__(
        self,
        instance_id: str,
        profile: EngineProfile,
        kv_capacity_blocks: int | None = None,
        host_capacity_blocks: int | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.block = profile.block_size_tokens
        self.capacity_blocks = (
            kv_capacity_blocks if kv_capacity_blocks is not None else profile.kv_capacity_blocks
        )
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.by_id: dict[str, EngineRequest] = {}
        # prefix cache: hash -> refcount, for every block that holds a cached
        # prefix, in use (refcount > 0) or free (refcount 0)
        self._cache: dict[int, int] = {}
        # free blocks after the never-used ones, least recently freed first:
        # a hash key is a cached block, an _Empty key a block with no prefix
        self._free_queue: OrderedDict[int | _Empty, None] = OrderedDict()
        self._fresh = self.capacity_blocks  # never-used blocks (the queue's head)
        self.used_blocks = 0  # blocks held by requests (shared counted once)
        self.counters = EngineCounters()
        self.stepping = False
        self._batch: list[EngineRequest] = []
        # Optional vLLM-style KV event sink: ("stored" | "removed", block hashes).
        self.kv_listener: Callable[[str, Sequence[int]], None] | None = None
        # host tier: hash -> None, least recently used first; None when off
        self.host_capacity_blocks = (
            host_capacity_blocks
            if host_capacity_blocks is not None
            else profile.host_kv_capacity_blocks
        )
        self._host: OrderedDict[int, None] | None = (
            OrderedDict() if self.host_capacity_blocks > 0 else None
        )
        self._loading: list[EngineRequest] = []  # waiting on host -> GPU loads
        self._loaded_now: list[EngineRequest] = []  # remote loads done this step
        #: P/D prefill side: finished requests whose blocks a decode side still reads
        self.held: dict[str, EngineRequest] = {}
        self.held_blocks = 0
        self._step_s = 0.0
        # the same for the host tier's events (vLLM: medium "CPU")
        self.host_listener: Callable[[str, Sequence[int]], None] | None = None

    # -- public API -----------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.check(req)
        if req.output_block_hashes and len(req.block_hashes) == req.input_tokens // self.block:
            # output hashes continue the prompt's chain only if it is complete
            req.chain = tuple(req.block_hashes) + tuple(req.output_block_hashes)
        self.waiting.append(req)
        self.by_id[req.request_id] = req

    def check(self, req: EngineRequest) -> None:
        """Raise CapacityError if this instance could never run ``req``."""
        if req.input_tokens + 1 > self.profile.model.max_model_len_tokens:
            raise CapacityError(
                f"prompt of {req.input_tokens} tokens exceeds the model context "
                f"({self.profile.model.max_model_len_tokens}); shorten it"
            )
        need = -(-(req.input_tokens + req.output_tokens) // self.block)
        if need > self.capacity_blocks:
            raise CapacityError(
                f"request needs {need} KV blocks but the instance has "
                f"{self.capacity_blocks}; use a larger profile"
            )

    def abort(self, request_id: str) -> EngineRequest | None:
        """Cancel a request wherever it is; frees its blocks. Idempotent."""
        req = self.by_id.pop(request_id, None)
        if req is None:
            return self.release(request_id)
        if req in self._batch:
            # Mid-step: the step's work is spent; drop it once the step ends.
            req.output_tokens = -1
            self.by_id[request_id] = req
            return req
        if req.admitted:
            self.running.remove(req)
            self._free(req)
        else:
            self.waiting.remove(req)
            if req.loading:
                self._loading.remove(req)
                req.loading = False
            if req.blocks:  # holds blocks its host-tier prefix was loaded into
                self._free(req)
        return req

    def release(self, request_id: str, transferred: bool = False) -> EngineRequest | None:
        """P/D prefill side: the decode side has the KV (or gave up); free it.

        ``transferred`` counts the request's prompt as sent. Idempotent.
        """
        req = self.held.pop(request_id, None)
        if req is None:
            return None
        self.held_blocks -= req.blocks
        if transferred:
            self.counters.kv_transfer_out_tokens += req.input_tokens
        self._free(req)
        return req

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - self.used_blocks

    @property
    def kv_usage(self) -> float:
        return self.used_blocks / self.capacity_blocks if self.capacity_blocks else 0.0

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    @property
    def host_blocks(self) -> int:
        """Blocks the host tier holds now."""
        return len(self._host) if self._host is not None else 0

    def in_host(self, block_hash: int) -> bool:
        return self._host is not None and block_hash in self._host

    def plan_step(self) -> float:
        """Choose the next batch; return its duration (0.0 when idle)."""
        budget = self.profile.max_num_batched_tokens
        batch: list[EngineRequest] = []
        p_new = 0
        p_seqs = 0  # prefill chunks: each samples (computes logits) at one position
        p_pairs = 0.0
        p_ctx = 0
        d_seqs = 0
        d_ctx = 0
        blk = self.block
        # 1) running requests, in admission order; preempt from the back on OOM
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.computed_tokens < req.prompt_tokens:
                q = min(req.prompt_tokens - req.computed_tokens, budget)
            else:
                q = 1
            need = self._blocks_needed(req, q) - req.blocks
            while need > self.free_blocks:
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if not req.admitted:  # req itself was preempted
                break
            self._grow(req, need)
            req.scheduled = q
            batch.append(req)
            budget -= q
            if req.computed_tokens < req.prompt_tokens:
                c = req.computed_tokens
                self._cache_blocks(req, c + q)
                p_new += q
                p_seqs += 1
                p_pairs += q * c + q * (q + 1) / 2
                p_ctx += c
            else:
                d_seqs += 1
                # KV already cached (the new token's own KV is written this step);
                # computed_tokens would double-count tokens recomputed after preemption
                d_ctx += req.input_tokens + req.generated_tokens - 1
                if len(req.chain) > len(req.hashed):
                    self._cache_blocks(req, req.input_tokens + req.generated_tokens)
            i += 1
        # 2) waiting requests, FCFS, while budget, seats and KV blocks allow; none
        # in a step that preempted (vllm/v1/core/sched/scheduler.py:
        # `if not preempted_reqs`), else the victim could be readmitted at once
        max_seqs = self.profile.max_num_seqs
        waiting = self.waiting
        host = self._host
        w = 0  # requests passed over: their prefix is still loading from host memory
        while not preempted and w < len(waiting) and budget > 0 and len(self.running) < max_seqs:
            req = waiting[w]
            if req.loading:  # vLLM: WAITING_FOR_REMOTE_KVS, skipped, keeps its place
                w += 1
                continue
            if req.blocks:  # its host-tier prefix has arrived in blocks it holds
                hit, revived = req.blocks, 0
                start = req.computed_tokens
            else:
                hit, revived = self._match(req)
                start = hit * blk
                if req.remote_kv_tokens and req.preemptions == 0:
                    # P/D decode side: the prefill instance's KV past the local hit
                    lim = min((req.prompt_tokens - 1) // blk, req.remote_kv_tokens // blk)
                    got = max(0, lim - hit)
                    if got:
                        if got + revived > self.free_blocks:
                            break
                        self._start_remote_load(req, hit, got)
                        w += 1
                        continue
                if host is not None:
                    got = self._host_match(req, hit)
                    if got:
                        # the loaded KV needs GPU blocks of its own, now
                        if got + revived > self.free_blocks:
                            break
                        self._start_load(req, hit, got)
                        w += 1
                        continue
            q = min(req.prompt_tokens - start, budget)
            need = -(-(start + q) // blk) - hit
            # cached blocks we revive stop being free, so they count against us
            if need + revived > self.free_blocks:
                break
            if w:
                del waiting[w]
            else:
                waiting.popleft()
            if not req.blocks:
                self._count_query(req, hit)
                self._acquire(req, hit, start)
            self._grow(req, need)
            self._cache_blocks(req, start + q)
            req.admitted = True
            self.running.append(req)
            req.scheduled = q
            batch.append(req)
            budget -= q
            p_new += q
            p_seqs += 1
            p_pairs += q * start + q * (q + 1) / 2
            p_ctx += start
        self._batch = batch
        if not batch:
            if self._loading:  # nothing to compute: wait for the host loads
                self.stepping = True
                left = min(r.load_left_s for r in self._loading)
                self._step_s = left if left < _LOAD_POLL_S else _LOAD_POLL_S
                return self._step_s
            self.stepping = False
            return 0.0
        self.stepping = True
        dur = self.profile.step_time_s(p_new, p_pairs, p_ctx, d_seqs, d_ctx, p_seqs)
        self.counters.steps += 1
        self.counters.busy_s += dur
        self._step_s = dur
        return dur

    def finish_step(self) -> StepResult:
        """Apply the planned batch: advance prefills, emit decode tokens."""
        firsts: list[EngineRequest] = []
        done: list[EngineRequest] = []
        emitted = 0
        for req in self._batch:
            q = req.scheduled
            req.scheduled = 0
            if req.output_tokens < 0:  # aborted mid-step
                self._drop(req)
                self.by_id.pop(req.request_id, None)
                continue
            if req.computed_tokens < req.prompt_tokens:
                req.computed_tokens += q
                self.counters.prompt_tokens_computed += q
                if req.computed_tokens < req.prompt_tokens:
                    continue
                # prefill complete: the step also samples one token
                if not req.first_token:
                    req.first_token = True
                    firsts.append(req)
                req.generated_tokens += 1
            else:
                req.generated_tokens += 1
            emitted += 1
            self.counters.generation_tokens += 1
            if req.generated_tokens >= req.output_tokens:
                done.append(req)
        if done:
            if len(done) == 1:
                self.running.remove(done[0])
            else:
                gone = {id(r) for r in done}
                self.running = [r for r in self.running if id(r) not in gone]
            for req in done:
                self.by_id.pop(req.request_id, None)
                if req.hold_kv:  # P/D prefill side: a decode instance reads it next
                    self.held[req.request_id] = req
                    self.held_blocks += req.blocks
                    if self.held_blocks > self.counters.kv_held_peak_blocks:
                        self.counters.kv_held_peak_blocks = self.held_blocks
                else:
                    self._free(req)
        self._batch = []
        self.stepping = False
        loaded: list[EngineRequest] = []
        if self._loading:
            self._advance_loads(self._step_s)
            if self._loaded_now:
                loaded, self._loaded_now = self._loaded_now, []
        return StepResult(firsts, done, emitted, loaded)

    def reset_prefix_cache(self) -> list[int]:
        """Forget every cached block no request holds (vLLM's /reset_prefix_cache).

        The blocks stay free in their queue position; returns the dropped hashes.
        """
        cache = self._cache
        dropped = [k for k in self._free_queue if not isinstance(k, _Empty)]
        if dropped:
            self._free_queue = OrderedDict(
                (k if isinstance(k, _Empty) else _Empty(), None) for k in self._free_queue
            )
            for h in dropped:
                del cache[h]
            self._on_removed(dropped)
        return dropped

    # -- hooks ------------------------------------------------------------------
    def _on_stored(self, req: EngineRequest, first_block: int, hashes: list[int]) -> None:
        """Blocks ``first_block..`` of ``req``'s chain were just cached."""
        if self.kv_listener is not None:
            self.kv_listener("stored", hashes)

    def _on_removed(self, hashes: list[int]) -> None:
        """These cached blocks were evicted (or reset)."""
        if self.kv_listener is not None:
            self.kv_listener("removed", hashes)

    def _on_host_stored(self, hashes: list[int]) -> None:
        """These blocks were written to the host tier."""
        if self.host_listener is not None:
            self.host_listener("stored", hashes)

    def _on_host_removed(self, hashes: list[int]) -> None:
        """The host tier's LRU dropped these blocks."""
        if self.host_listener is not None:
            self.host_listener("removed", hashes)

    # -- host tier ---------------------------------------------------------------
    def _host_match(self, req: EngineRequest, hit: int) -> int:
        """Blocks after the GPU hit that the host tier holds, contiguously.

        Like vLLM's connector lookup, it also refreshes the request's blocks in
        the host LRU (first block most recent, as ``touch`` walks them in
        reverse) and writes back the GPU-hit blocks the host tier lost.
        """
        host = self._host
        assert host is not None
        hashes = req.chain
        missing = [h for h in hashes[:hit] if h not in host]
        if missing:
            self._host_put(missing)
        lim = min((req.prompt_tokens - 1) // self.block, len(hashes))
        got = 0
        while hit + got < lim and hashes[hit + got] in host:
            got += 1
        for j in range(hit + got - 1, -1, -1):
            if hashes[j] in host:
                host.move_to_end(hashes[j])
        return got

    def _begin_load(self, req: EngineRequest, hit: int, got: int, load_s: float) -> int:
        """Take GPU blocks for the ``hit`` cached and ``got`` incoming blocks and
        park the request until the copy (``load_s``) lands; the tokens copied."""
        blk = self.block
        self._count_query(req, hit)
        self._acquire(req, hit, hit * blk)
        self._grow(req, got)
        req.computed_tokens = (hit + got) * blk
        req.load_left_s = load_s
        req.loading = True
        self._loading.append(req)
        return got * blk

    def _start_load(self, req: EngineRequest, hit: int, got: int) -> None:
        """Take GPU blocks for ``got`` host-tier blocks and start copying them in."""
        tokens = self._begin_load(req, hit, got, self.profile.host_load_time_s(got * self.block))
        c = self.counters
        c.host_hits_tokens += tokens
        c.host_load_s += req.load_left_s
        if req.preemptions == 0:
            req.cached_tokens = req.computed_tokens
            req.host_hit_tokens = tokens
        else:  # vLLM's connector stats count a readmitted request's load apart
            c.host_hits_preempted_tokens += tokens

    def _start_remote_load(self, req: EngineRequest, hit: int, got: int) -> None:
        """Take GPU blocks for ``got`` blocks of prompt KV and start receiving them
        (vLLM: ``WAITING_FOR_REMOTE_KVS`` until the connector reports them done)."""
        tokens = self._begin_load(req, hit, got, req.remote_load_s)
        self.counters.kv_transfer_in_tokens += tokens
        self.counters.kv_transfer_in_s += req.remote_load_s
        req.cached_tokens = hit * self.block  # local prefix-cache hit only, as vLLM reports
        req.remote_hit_tokens = tokens

    def _advance_loads(self, dt: float) -> None:
        """Loads progress while steps run (a separate copy stream); a finished
        one caches its blocks on the GPU, as vLLM does once the copy lands."""
        still: list[EngineRequest] = []
        for r in self._loading:
            r.load_left_s -= dt
            if r.load_left_s > 1e-12:
                still.append(r)
            else:
                r.load_left_s = 0.0
                r.loading = False
                self._cache_blocks(r, r.computed_tokens)
                if r.remote_kv_tokens:
                    self._loaded_now.append(r)
        self._loading = still

    def _host_put(self, hashes: Sequence[int]) -> None:
        """Write blocks to the host tier (already there: nothing), evicting its LRU."""
        host = self._host
        assert host is not None
        cap = self.host_capacity_blocks
        stored: list[int] = []
        evicted: list[int] = []
        for h in hashes:
            if h in host:
                continue
            if len(host) >= cap:
                old, _ = host.popitem(last=False)
                evicted.append(old)
            host[h] = None
            stored.append(h)
        if not stored:
            return
        c = self.counters
        c.host_stored_blocks += len(stored)
        c.host_evicted_blocks += len(evicted)
        c.host_store_s += self.profile.host_store_time_s(len(stored) * self.block)
        if evicted:
            gone = set(evicted)
            stored = [h for h in stored if h not in gone or h in host]
            self._on_host_removed(evicted)
        if stored:
            self._on_host_stored(stored)

    # -- KV/cache internals ------------------------------------------------------
    def _blocks_needed(self, req: EngineRequest, q: int) -> int:
        if req.computed_tokens < req.prompt_tokens:
            tokens = req.computed_tokens + q
        else:
            # the decode step writes the KV of the last sampled token
            tokens = req.input_tokens + req.generated_tokens
        return -(-tokens // self.block)

    def _match(self, req: EngineRequest) -> tuple[int, int]:
        """Leading blocks of ``req``'s chain in the cache, and how many are free.

        At least the last prompt token is always recomputed (vLLM does too),
        so at most ``(prompt - 1) // block`` blocks can hit.
        """
        cache = self._cache
        n = 0
        revived = 0
        hashes = req.chain
        lim = min((req.prompt_tokens - 1) // self.block, len(hashes))
        while n < lim:
            rc = cache.get(hashes[n])
            if rc is None:
                break
            if rc == 0:
                revived += 1
            n += 1
        return n, revived

    def _count_query(self, req: EngineRequest, hit: int) -> None:
        """vLLM's prefix-cache stats. A request readmitted after a preemption
        is recorded apart (``PrefixCacheStats.record(..., preempted=True)``)
        and left out of the exported counters, so its recompute is not
        visible there to a router either."""
        if req.preemptions:
            return
        c = self.counters
        c.prefix_queries_tokens += req.prompt_tokens
        c.prefix_hits_tokens += hit * self.block
        if self._host is not None:  # what the host tier is asked for: past the GPU hit
            c.host_queries_tokens += req.prompt_tokens - hit * self.block
        req.cached_tokens = hit * self.block

    def _acquire(self, req: EngineRequest, hit: int, start: int) -> None:
        cache = self._cache
        free = self._free_queue
        hashes = req.chain
        for j in range(hit):
            h = hashes[j]
            rc = cache[h]
            if rc == 0:
                del free[h]  # a free cached block is touched: it leaves the queue
                self.used_blocks += 1
            cache[h] = rc + 1
        req.hashed = list(hashes[:hit])
        req.blocks = hit
        req.computed_tokens = start

    def _grow(self, req: EngineRequest, n: int) -> None:
        """Give ``req`` n more blocks from the head of the free queue."""
        if n <= 0:
            return
        fresh = min(n, self._fresh)
        self._fresh -= fresh
        if n > fresh:
            free = self._free_queue
            cache = self._cache
            gone: list[int] = []
            for _ in range(n - fresh):
                key, _ = free.popitem(last=False)
                if not isinstance(key, _Empty):
                    del cache[key]
                    gone.append(key)
            if gone:
                self._on_removed(gone)
        self.used_blocks += n
        req.blocks += n

    def _cache_blocks(self, req: EngineRequest, kv_tokens: int) -> None:
        """Cache ``req``'s full blocks up to ``kv_tokens`` as they are scheduled.

        vLLM caches in ``allocate_slots``, before the step runs, so a request
        scheduled after this one (same step included) hits these blocks. A
        block whose hash another block already caches stays private.
        """
        chain = req.chain
        end = min(kv_tokens // self.block, len(chain))
        j = len(req.hashed) + req.blocks_private_hashed
        if j >= end:
            return
        cache = self._cache
        run: list[int] = []
        first = first_all = j
        while j < end:
            h = chain[j]
            if h in cache:  # computed twice (e.g. a full-hit prompt's last block)
                req.blocks_private_hashed += 1
                if run:
                    self._on_stored(req, first, run)
                    run = []
                first = j + 1
            else:
                cache[h] = 1
                req.hashed.append(h)
                run.append(h)
            j += 1
        if run:
            self._on_stored(req, first, run)
        if self._host is not None:
            # write-through, as vLLM's OffloadingConnector stores every new full block
            self._host_put(chain[first_all:end])

    def _free(self, req: EngineRequest) -> None:
        """Return ``req``'s blocks, tail first, to the back of the free queue."""
        cache = self._cache
        free = self._free_queue
        private = req.blocks - len(req.hashed)
        for _ in range(private):
            free[_Empty()] = None
        shared_freed = 0
        for h in reversed(req.hashed):
            rc = cache[h] - 1
            cache[h] = rc
            if rc == 0:
                free[h] = None
                shared_freed += 1
        self.used_blocks -= private + shared_freed
        req.hashed = []
        req.blocks = 0
        req.blocks_private_hashed = 0

    def _drop(self, req: EngineRequest) -> None:
        if req in self.running:
            self.running.remove(req)
        self._free(req)

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self._free(req)
        req.preemptions += 1
        self.counters.preemptions += 1
        req.admitted = False
        req.prompt_tokens = req.input_tokens + req.generated_tokens
        req.computed_tokens = 0
        self.waiting.appendleft(req)
