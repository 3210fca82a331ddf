"""The real-time driver: one thread steps the shared engine model on a clock.

:class:`EmulatedEngine` is the simulator's :class:`EngineInstance` plus hooks
that report prefix-cache changes as vLLM KV events; the public API and the
scheduling are untouched, so the emulator's timing *is* the simulator's.
:class:`EngineLoop` runs ``plan_step -> sleep(duration * time_scale) ->
finish_step`` and hands new tokens to per-request :class:`RequestHandle`s,
which the HTTP threads wait on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenfleet.emulator.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventPublisher,
    RawEvent,
)
from tokenfleet.emulator.metrics import EmulatorMetrics, EngineState
from tokenfleet.engine.instance import EngineInstance, EngineRequest, StepResult
from tokenfleet.engine.profiles import EngineProfile
from tokenfleet.tokenizer import BYTES_PER_TOKEN, token_ids


@dataclass(slots=True)
class EmulatedRequest(EngineRequest):
    """Engine request plus what the HTTP side needs: prompt bytes (for
    BlockStored token ids), the client's budget (for ``finish_reason``) and a
    seed for the filler text."""

    prompt_stream: bytes = b""
    max_tokens: int = 0
    filler_seed: int = 0


class EmulatedEngine(EngineInstance):
    """EngineInstance that records BlockStored/BlockRemoved when ``events`` is set."""

    def __init__(
        self,
        instance_id: str,
        profile: EngineProfile,
        kv_capacity_blocks: int | None = None,
        record_events: bool = False,
    ) -> None:
        super().__init__(instance_id, profile, kv_capacity_blocks)
        self.events: list[RawEvent] | None = [] if record_events else None
        self.last_batch: list[EngineRequest] = []

    def finish_step(self) -> StepResult:
        # finish_step replaces _batch with a fresh list, so this reference survives.
        self.last_batch = self._batch
        return super().finish_step()

    def take_events(self) -> list[RawEvent]:
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def reset_prefix_cache(self) -> list[int]:
        dropped = super().reset_prefix_cache()
        if self.events is not None and not self._cache:
            self.events.append(AllBlocksCleared())
        return dropped

    # -- hooks --------------------------------------------------------------
    def _on_stored(self, req: EngineRequest, first_block: int, hashes: list[int]) -> None:
        super()._on_stored(req, first_block, hashes)
        if self.events is None:
            return
        parent = req.chain[first_block - 1] if first_block else None
        ids: tuple[int, ...] = ()
        if isinstance(req, EmulatedRequest) and req.prompt_stream:
            step = self.block * BYTES_PER_TOKEN
            ids = tuple(
                token_ids(
                    req.prompt_stream[first_block * step : (first_block + len(hashes)) * step]
                )
            )
        self.events.append(BlockStored(tuple(hashes), parent, ids, self.block))

    def _on_removed(self, hashes: list[int]) -> None:
        super()._on_removed(hashes)
        if self.events is not None:
            self.events.append(BlockRemoved(tuple(hashes)))

    # the host tier's events, as vLLM's OffloadingConnector.take_events gives them:
    # no parent, no token ids, medium "CPU"
    def _on_host_stored(self, hashes: list[int]) -> None:
        super()._on_host_stored(hashes)
        if self.events is not None:
            self.events.append(BlockStored(tuple(hashes), None, (), self.block, MEDIUM_CPU))

    def _on_host_removed(self, hashes: list[int]) -> None:
        super()._on_host_removed(hashes)
        if self.events is not None:
            self.events.append(BlockRemoved(tuple(hashes), MEDIUM_CPU))


class RequestHandle:
    """What an HTTP thread waits on. The engine thread writes, then sets ``changed``.

    Readers must read ``done`` before ``generated``: both are written in one
    critical section, so a reader that sees ``done`` sees the final count.
    """

    __slots__ = (
        "request_id",
        "req",
        "arrival_s",
        "generated",
        "first_token_at_s",
        "first_token_model_s",
        "last_token_at_s",
        "cached_tokens",
        "done",
        "status",
        "changed",
    )

    def __init__(self, req: EmulatedRequest, arrival_s: float) -> None:
        self.request_id = req.request_id
        self.req = req
        self.arrival_s = arrival_s
        self.generated = 0
        self.first_token_at_s: float | None = None
        #: when the engine model's step that made the first token ended (the
        #: loop's virtual clock); ``first_token_at_s`` is when it was delivered
        self.first_token_model_s: float | None = None
        self.last_token_at_s = 0.0
        self.cached_tokens = 0
        self.done = False
        self.status = ""  # "completed" | "aborted" | "shutdown"
        self.changed = threading.Event()


class EngineLoop:
    """Steps an :class:`EmulatedEngine` in real time on its own thread.

    All engine calls happen under ``lock``; the lock is released while a step
    "runs" (sleeps), which is exactly the window in which the engine model
    accepts mid-step ``add``/``abort``. Failure injection lives here because
    it acts on the step loop: periodic pauses (latency spikes) and a
    permanent stall. Times for failure injection are wall-clock seconds.
    """

    #: beyond this lag the virtual clock resyncs to wall time (e.g. after idling)
    MAX_LAG_S = 0.05

    def __init__(
        self,
        engine: EmulatedEngine,
        metrics: EmulatorMetrics,
        *,
        time_scale: float = 1.0,
        latency_spike_s: float = 0.0,
        spike_every_s: float = 0.0,
        stall_after_s: float | None = None,
        publisher: KVEventPublisher | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.time_scale = time_scale
        self.latency_spike_s = latency_spike_s
        self.spike_every_s = spike_every_s
        self.stall_after_s = stall_after_s
        self.publisher = publisher
        self.clock = clock
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self.handles: dict[str, RequestHandle] = {}
        self.started_at_s = clock()
        self.prompt_tokens_total = 0
        self.steps = 0
        self._stop = False
        self._vclock: float | None = None
        #: times the loop fell more than MAX_LAG_S behind its virtual clock and
        #: resynced, and the model time lost that way (a faithful run has ~0)
        self.resyncs = 0
        self.lost_s = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        #: P/D decode side: called (engine thread, lock held) when a request's
        #: remote KV has arrived; it must not block
        self.on_remote_loaded: Callable[[EngineRequest], None] | None = None
        metrics.attach(self.snapshot)

    # -- lifecycle ------------------------------------------------------------
    def start(self) -> None:
        self.started_at_s = self.clock()
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            for h in self.handles.values():
                h.done = True
                h.status = "shutdown"
                h.changed.set()
            self.handles.clear()
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    @property
    def stalled(self) -> bool:
        return (
            self.stall_after_s is not None
            and self.clock() - self.started_at_s >= self.stall_after_s
        )

    # -- requests -------------------------------------------------------------
    def submit(self, req: EmulatedRequest) -> RequestHandle:
        """Queue a request; raises CapacityError if it can never fit."""
        handle = RequestHandle(req, self.clock())
        with self._cond:
            if req.request_id in self.handles or req.request_id in self.engine.by_id:
                raise ValueError(f"request id '{req.request_id}' is already in flight")
            self.engine.add(req)
            self.handles[req.request_id] = handle
            self._cond.notify()
        return handle

    def abort(self, request_id: str, status: str = "aborted") -> bool:
        """Cancel a request (client gone or admin); frees its KV blocks."""
        with self._cond:
            handle = self.handles.pop(request_id, None)
            if handle is None:
                return False
            self.engine.abort(request_id)
            handle.done = True
            handle.status = status
            self.metrics.request_finished("abort", handle.arrival_s, self.clock())
            self._publish()
        handle.changed.set()
        return True

    def release_kv(self, request_id: str) -> bool:
        """P/D prefill side: a decode instance has read this request's KV."""
        with self._cond:
            return self.engine.release(request_id, transferred=True) is not None

    def abort_all(self) -> int:
        with self._cond:
            ids = list(self.handles)
        return sum(1 for rid in ids if self.abort(rid))

    def reset_prefix_cache(self) -> int:
        with self._cond:
            n = len(self.engine.reset_prefix_cache())
            self._publish()
            return n

    def snapshot(self) -> EngineState:
        with self._cond:
            e = self.engine
            c = e.counters
            return EngineState(
                running=len(e.running),
                waiting=len(e.waiting),
                kv_usage=e.kv_usage,
                prefix_queries_tokens=c.prefix_queries_tokens,
                prefix_hits_tokens=c.prefix_hits_tokens,
                preemptions=c.preemptions,
                prompt_tokens=self.prompt_tokens_total,
                generation_tokens=c.generation_tokens,
                num_gpu_blocks=e.capacity_blocks,
                block_size=e.block,
                external_queries_tokens=c.external_queries_tokens,
                external_hits_tokens=c.external_hits_tokens,
                num_cpu_blocks=e.host_capacity_blocks,
                cpu_blocks_used=e.host_blocks,
                kv_transfer_in_tokens=c.kv_transfer_in_tokens,
                kv_transfer_in_s=c.kv_transfer_in_s,
                kv_transfer_out_tokens=c.kv_transfer_out_tokens,
                kv_held_blocks=e.held_blocks,
            )

    # -- the step loop --------------------------------------------------------------
    def _spike_pause_s(self, now: float) -> float:
        """Remaining pause if ``now`` falls in a spike window (every S s, MS long)."""
        if self.latency_spike_s <= 0 or self.spike_every_s <= 0:
            return 0.0
        since = now - self.started_at_s
        k = int(since // self.spike_every_s)
        if k < 1:
            return 0.0
        into = since - k * self.spike_every_s
        return max(0.0, self.latency_spike_s - into)

    def _run(self) -> None:
        engine = self.engine
        cond = self._cond
        while True:
            with cond:
                while not self._stop and (engine.idle or self.stalled):
                    self._vclock = None  # idle time is not owed to anyone
                    cond.wait()
                if self._stop:
                    return
                dur = engine.plan_step()
                if dur <= 0.0:
                    # Nothing schedulable (cannot happen with add()'s checks); back off.
                    cond.wait(0.001)
                    continue
            now = self.clock()
            pause = self._spike_pause_s(now)
            # Steps run back to back on a virtual clock, so per-step Python
            # overhead does not stretch the model's timing at small time scales.
            vstart = self._vclock
            if vstart is not None and now - vstart < self.MAX_LAG_S:
                base = vstart
            else:
                base = now
                if vstart is not None:
                    self.resyncs += 1
                    self.lost_s += now - vstart
            if pause:
                base = max(base, now) + pause
            deadline = base + dur * self.time_scale
            delay = deadline - now
            if delay > 0:
                time.sleep(delay)
            self._vclock = deadline
            with cond:
                if self._stop:
                    return
                result = engine.finish_step()
                self.steps += 1
                self._deliver(engine.last_batch, result, self.clock(), deadline)
                self._publish()

    def _deliver(
        self,
        batch: list[EngineRequest],
        result: StepResult,
        now: float,
        model_now: float | None = None,
    ) -> None:
        handles = self.handles
        metrics = self.metrics
        woken: list[RequestHandle] = []
        if result.remote_loaded and self.on_remote_loaded is not None:
            for req in result.remote_loaded:
                self.on_remote_loaded(req)
        for req in batch:
            h = handles.get(req.request_id)
            if h is None or req.output_tokens < 0:
                continue
            g = req.generated_tokens
            if g <= h.generated:
                continue
            if h.first_token_at_s is None:
                h.first_token_at_s = now
                h.first_token_model_s = model_now
                h.cached_tokens = req.cached_tokens
                self.prompt_tokens_total += req.input_tokens
                metrics.observe_ttft(now - h.arrival_s)
                extra = g - h.generated - 1
            else:
                extra = g - h.generated
            if extra > 0:
                metrics.observe_itl(now - h.last_token_at_s, extra)
            h.last_token_at_s = now
            h.generated = g
            woken.append(h)
        for req in result.finished:
            h = handles.pop(req.request_id, None)
            if h is None:
                continue
            h.done = True
            h.status = "completed"
            reason = finish_reason(h.req)
            metrics.request_finished(reason, h.arrival_s, now)
        for h in woken:
            h.changed.set()

    def _publish(self) -> None:
        if self.publisher is not None:
            events = self.engine.take_events()
            if events:
                self.publisher.publish(events)


def finish_reason(req: EmulatedRequest) -> str:
    """vLLM's reason: the budget ran out ("length") or the model stopped ("stop")."""
    budget = req.max_tokens or req.output_tokens
    return "length" if req.generated_tokens >= budget else "stop"
