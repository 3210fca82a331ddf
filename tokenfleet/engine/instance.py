"""A simulated inference instance that schedules like vLLM (V1).

The engine is clock-free: ``plan_step`` builds the next batch and returns its
duration; ``finish_step`` applies it and reports first tokens and
completions. The discrete-event simulator and the real-time HTTP emulator
both drive this same object, so the emulator's timing is the simulator's.

Modelled, after vLLM's V1 scheduler:
- continuous batching: running requests first (decodes and unfinished
  chunked prefills), then waiting requests FCFS, within a token budget
  (``max_num_batched_tokens``) and ``max_num_seqs``;
- a paged KV cache of fixed 16-token blocks; a request enters the batch only
  if blocks for its scheduled tokens are free, otherwise it waits (FCFS: no
  skipping ahead);
- automatic prefix caching over chained block hashes: full prompt blocks are
  hashed when computed, freed blocks stay reusable until their space is
  needed, and the least recently freed are evicted first (tails before
  heads, as vLLM frees blocks in reverse);
- recompute preemption when a running request cannot grow (counted, since
  admission control aims to make it never happen).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

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
    # -- progress (engine-owned) --
    prompt_tokens: int = 0  # tokens to prefill: input + already generated
    computed_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # prefix-cache hit at (first) admission
    hashed: list[int] = field(default_factory=list)  # cache blocks referenced
    blocks: int = 0  # total KV blocks held
    scheduled: int = 0  # tokens scheduled in the current step
    preemptions: int = 0
    first_token: bool = False
    admitted: bool = False

    def __post_init__(self) -> None:
        self.prompt_tokens = self.input_tokens


@dataclass(slots=True)
class StepResult:
    first_tokens: list[EngineRequest]
    finished: list[EngineRequest]
    tokens_emitted: int


@dataclass(slots=True)
class EngineCounters:
    prefix_queries_tokens: int = 0
    prefix_hits_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    busy_s: float = 0.0
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0


class EngineInstance:
    """One inference engine: scheduler + paged KV cache + roofline timing."""

    def __init__(self, instance_id: str, profile: EngineProfile,
                 kv_capacity_blocks: int | None = None) -> None:
        self.instance_id = instance_id
        self.profile = profile
        self.block = profile.block_size_tokens
        self.capacity_blocks = (kv_capacity_blocks if kv_capacity_blocks is not None
                                else profile.kv_capacity_blocks)
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.by_id: dict[str, EngineRequest] = {}
        # prefix cache: hash -> refcount; refcount-0 blocks live in `evictable`
        self._cache: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.used_blocks = 0  # blocks held by requests (shared counted once)
        self.counters = EngineCounters()
        self.stepping = False
        self._batch: list[EngineRequest] = []
        # Optional vLLM-style KV event sink: ("stored" | "removed", block hashes).
        self.kv_listener: Callable[[str, Sequence[int]], None] | None = None

    # -- public API -----------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.check(req)
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
            return None
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

    def plan_step(self) -> float:
        """Choose the next batch; return its duration (0.0 when idle)."""
        budget = self.profile.max_num_batched_tokens
        batch: list[EngineRequest] = []
        p_new = 0
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
                p_new += q
                p_pairs += q * c + q * (q + 1) / 2
                p_ctx += c
            else:
                d_seqs += 1
                # KV already cached (the new token's own KV is written this step);
                # computed_tokens would double-count tokens recomputed after preemption
                d_ctx += req.input_tokens + req.generated_tokens - 1
            i += 1
        # 2) waiting requests, FCFS, while budget, seats and KV blocks allow; none
        # in a step that preempted (vllm/v1/core/sched/scheduler.py:
        # `if not preempted_reqs`), else the victim could be readmitted at once
        max_seqs = self.profile.max_num_seqs
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < max_seqs):
            req = self.waiting[0]
            hit, revived = self._match(req)
            start = hit * blk
            q = min(req.prompt_tokens - start, budget)
            need = -(-(start + q) // blk) - hit
            # cached blocks we revive stop being free, so they count against us
            if need + revived > self.free_blocks:
                break
            self._count_query(req, hit)
            self.waiting.popleft()
            self._acquire(req, hit, start)
            self._grow(req, need)
            req.admitted = True
            self.running.append(req)
            req.scheduled = q
            batch.append(req)
            budget -= q
            p_new += q
            p_pairs += q * start + q * (q + 1) / 2
            p_ctx += start
        self._batch = batch
        if not batch:
            self.stepping = False
            return 0.0
        self.stepping = True
        dur = self.profile.step_time_s(p_new, p_pairs, p_ctx, d_seqs, d_ctx)
        self.counters.steps += 1
        self.counters.busy_s += dur
        return dur

    def finish_step(self) -> StepResult:
        """Apply the planned batch: advance prefills, emit decode tokens."""
        firsts: list[EngineRequest] = []
        done: list[EngineRequest] = []
        emitted = 0
        blk = self.block
        for req in self._batch:
            q = req.scheduled
            req.scheduled = 0
            if req.output_tokens < 0:  # aborted mid-step
                self._drop(req)
                self.by_id.pop(req.request_id, None)
                continue
            if req.computed_tokens < req.prompt_tokens:
                before = req.computed_tokens
                req.computed_tokens += q
                self.counters.prompt_tokens_computed += q
                self._register(req, before // blk, req.computed_tokens // blk)
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
                self._free(req)
                self.by_id.pop(req.request_id, None)
        self._batch = []
        self.stepping = False
        return StepResult(firsts, done, emitted)

    # -- KV/cache internals ------------------------------------------------------
    def _blocks_needed(self, req: EngineRequest, q: int) -> int:
        if req.computed_tokens < req.prompt_tokens:
            tokens = req.computed_tokens + q
        else:
            # the decode step writes the KV of the last sampled token
            tokens = req.input_tokens + req.generated_tokens
        return -(-tokens // self.block)

    def _match(self, req: EngineRequest) -> tuple[int, int]:
        """Leading prompt blocks in the cache, and how many of them are unreferenced.

        At least the last prompt token is always recomputed (vLLM does too),
        so at most ``(prompt - 1) // block`` blocks can hit.
        """
        cache = self._cache
        n = 0
        revived = 0
        hashes = req.block_hashes
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
        self.counters.prefix_queries_tokens += req.prompt_tokens
        self.counters.prefix_hits_tokens += hit * self.block
        if req.preemptions == 0:
            req.cached_tokens = hit * self.block

    def _acquire(self, req: EngineRequest, hit: int, start: int) -> None:
        cache = self._cache
        ev = self._evictable
        hashes = req.block_hashes
        for j in range(hit):
            h = hashes[j]
            rc = cache[h]
            if rc == 0:
                del ev[h]
                self.used_blocks += 1
            cache[h] = rc + 1
        req.hashed = list(hashes[:hit])
        req.blocks = hit
        req.computed_tokens = start

    def _grow(self, req: EngineRequest, n: int) -> None:
        if n <= 0:
            return
        # take never-used blocks first, then evict least-recently freed cached ones
        spare = self.capacity_blocks - self.used_blocks - len(self._evictable)
        if n > spare:
            ev = self._evictable
            cache = self._cache
            gone = []
            for _ in range(n - spare):
                h, _ = ev.popitem(last=False)
                del cache[h]
                gone.append(h)
            if self.kv_listener is not None:
                self.kv_listener("removed", gone)
        self.used_blocks += n
        req.blocks += n

    def _register(self, req: EngineRequest, first_block: int, end_block: int) -> None:
        """Hash prompt blocks that just became full, so others can reuse them."""
        hashes = req.block_hashes
        cache = self._cache
        start = len(req.hashed)
        if start < first_block:
            return  # chain broken earlier (a duplicate block): nothing more to share
        end = min(end_block, len(hashes), req.input_tokens // self.block)
        for j in range(start, end):
            h = hashes[j]
            if h in cache:
                # Someone else computed the same block meanwhile; keep ours private.
                break
            cache[h] = 1
            req.hashed.append(h)
        if self.kv_listener is not None and len(req.hashed) > start:
            self.kv_listener("stored", req.hashed[start:])

    def _free(self, req: EngineRequest) -> None:
        cache = self._cache
        ev = self._evictable
        shared_freed = 0
        for h in reversed(req.hashed):  # tails become evictable first
            rc = cache[h] - 1
            cache[h] = rc
            if rc == 0:
                ev[h] = None
                shared_freed += 1
        private = req.blocks - len(req.hashed)
        self.used_blocks -= private + shared_freed
        req.hashed = []
        req.blocks = 0

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
