"""Celery tasks: the request task, and beat's control tasks.

``tokenfleet.chat`` runs one attempt of one request against this worker's
engine and relays its tokens. Exactly-once against the engine comes from the
Redis claim (``LiveState.claim``): a delivery for an attempt that finished,
is running elsewhere or was superseded is acknowledged without calling the
engine. It is folded into the request's own ledger row as a ``duplicate``
record, the lowest status in the writer's precedence: it can only fill gaps,
never add a second row for the request or change its status or bill.
"""

from __future__ import annotations

import functools
import json
import logging
import queue
import time
from collections.abc import Iterator
from typing import Any

from celery.signals import task_received

from tokenfleet.core.types import BLOCK_SIZE_TOKENS, KVEvent, RequestInfo
from tokenfleet.hf_tokenizer import HFChatTokenizer
from tokenfleet.live.direct import api_alive_key, outcome_key
from tokenfleet.live.engine_client import (
    EngineCall,
    EngineError,
    first_token_timeout_s,
    send_abort,
)
from tokenfleet.live.jobs import (
    PREFILL_HEADER,
    TASK_CHAT,
    TASK_CONTROL,
    TASK_FLEET,
    TASK_RECONCILE,
    ChatJob,
    send_chat_job,
)
from tokenfleet.live.queues import pool_queue
from tokenfleet.live.relay import RelayEvent, RelayWriter
from tokenfleet.live.resend import pick_resend_target
from tokenfleet.live.settle import completed, first_token_counts
from tokenfleet.service.writer import RequestRecord
from tokenfleet.tokenizer import chat_block_hashes
from workers.api_watch import API_LOST, SETTLED, Waiting
from workers.app import app
from workers.runtime import RequestInFlight, WorkerRuntime, runtime

log = logging.getLogger("tokenfleet.worker")


@app.task(name=TASK_CHAT, acks_late=True, reject_on_worker_lost=True, ignore_result=True, bind=True)
def chat(self: Any, message: dict[str, Any]) -> str:
    rt = runtime()
    received = rt.started(self.request.id)
    try:
        return run_job_guarded(rt, message, received_ts=received, task_id=self.request.id)
    finally:
        rt.task_done(self.request.id)


@task_received.connect
def _on_received(request: Any = None, **_: Any) -> None:
    """A message left its queue: note when (queue order is judged by this, not
    by when a pool thread got to it) and apply the tier's share at once."""
    from workers import runtime as rt_mod

    if rt_mod.RUNTIME is not None and request is not None:
        info = getattr(request, "delivery_info", None) or {}
        headers = getattr(request, "request_dict", None) or {}
        prefill = headers.get(PREFILL_HEADER)
        rt_mod.RUNTIME.on_received(
            request.id,
            str(info.get("routing_key") or ""),
            int(prefill) if prefill is not None else None,
        )


def _row(job: ChatJob, rt: WorkerRuntime, status: str, **cols: Any) -> RequestRecord:
    """The ledger row of ``job`` run here (placement: this instance)."""
    return job.ledger_row(status, **{"dc": rt.info.dc, "instance": rt.info.instance_id, **cols})


def _record(rt: WorkerRuntime, row: RequestRecord) -> None:
    if rt.ledger is None:
        return
    try:
        rt.ledger.record(row)
    except Exception:
        log.exception("ledger row for %s not recorded", row.request_id)


def _record_duplicate(rt: WorkerRuntime, job: ChatJob, why: str) -> str:
    rt.state.count(duplicates=1)
    log.info("duplicate delivery of %s attempt %s (%s): not run", job.request_id, job.attempt, why)
    # the request's own row: an attempt that was delivered again, not a second
    # request (placement NULL: where the real attempt ran is not here)
    _record(rt, _row(job, rt, "duplicate", dc=None, instance=None, admitted_ts=None))
    return "duplicate"


def run_job(
    rt: WorkerRuntime, job: ChatJob, received_ts: float | None = None, task_id: str | None = None
) -> str:
    state = rt.state
    rid = job.request_id
    attempt = job.attempt
    info = job.info()
    accounted = job.accounted == rt.info.instance_id
    cached_est = job.expected_cached
    relay = RelayWriter(state, rid, rt.live.stream_ttl_s, rt.info.instance_id)
    uncached = job.input_tokens - job.prefill_cached if job.prefill_url else job.prefill_tokens
    call = EngineCall(
        rt.info.url,
        job.body,
        f"{rid}-{attempt}",
        connect_timeout_s=rt.live.engine_connect_timeout_s,
        stall_timeout_s=rt.live.engine_stall_timeout_s,
        headers=job.engine_headers or None,
        prefill_url=job.prefill_url,
        first_token_timeout_s=first_token_timeout_s(
            rt.live.engine_stall_timeout_s, rt.state.profile(rt.info.profile), uncached
        ),
    )
    healthy = rt.is_engine_healthy()
    # the direct path hands the call to the API in the claim's own step (not for
    # a disaggregated request: its prefill side opens between the two)
    waiter = (
        _ApiStream(rt, job, relay, call) if job.direct and healthy and not job.prefill_url else None
    )
    dispatched = time.time()
    try:
        verdict = state.claim(
            rid,
            attempt,
            rt.worker_id,
            rt.live.lease_ttl_s,
            rt.info.instance_id,
            received_ts or time.time(),
            queue=job.queue,
            dispatch=None if accounted else (info, cached_est),
            go=waiter.go() if waiter is not None else None,
        )
    except BaseException:
        if waiter is not None:
            waiter.sub.close()
        raise
    if verdict == "run" and waiter is not None:
        waiter.handed_over()
    elif waiter is not None:
        waiter.sub.close()
        waiter = None
    if verdict != "run":
        state.queued_incr(job.queue, -1)
    if verdict in ("done", "busy", "stale", "missing"):
        return _record_duplicate(rt, job, verdict)
    if verdict == "cancelled":
        won, _ = state.finish(rid, "cancelled")
        if won:
            _record(rt, _row(job, rt, "cancelled", finished_ts=time.time()))
        return "cancelled"
    if verdict == "started":
        # A previous attempt streamed tokens and its worker died: the client has
        # a partial answer we cannot continue, so end it cleanly.
        won, _ = state.finish(rid, "failed")
        if won:
            relay.error(
                "the worker serving this request was lost after streaming began; retry the request",
                502,
                "server_error",
            )
            _record(
                rt,
                _row(
                    job,
                    rt,
                    "failed",
                    finished_ts=time.time(),
                    error="worker lost after first token",
                ),
            )
        return "failed"

    if not healthy and attempt < rt.live.max_attempts:
        # Taken from a queue just before the gate closed it: send it on, untouched.
        if _retry_elsewhere(rt, job, relay, "engine unhealthy before start"):
            state.account_finish(rt.info.instance_id, info, False, cached_est)
            return "retried"

    flight = RequestInFlight(rid, job.tier, attempt, prefill_tokens=job.prefill_tokens)
    rt.add_flight(flight, task_id)
    if waiter is None:
        dispatched = time.time()
    first_ts: float | None = None
    tokens = 0
    usage: dict[str, Any] | None = None
    finish_reason = "stop"
    streamed = False
    coalesce = _RelayCoalescer(relay, rt.live.relay_flush_interval_s)
    prefill_open = _open_prefill_side(rt, job, info)

    def close_prefill_side(prefilled: bool) -> None:
        nonlocal prefill_open
        if prefill_open:
            prefill_open = False
            _close_prefill_side(rt, job, info, prefilled)

    def first_token_done() -> None:
        # its prefill is done: pool work may flow again. Woken only now, so
        # the gate thread does not take the GIL while the token is in transit.
        rt.gate_kick.set()
        close_prefill_side(True)
        # after the token is on its way: hashing a long prompt takes a while
        events = _prefix_events(rt, job)
        if events:
            state.publish_kv_events(events)

    try:
        if job.direct:
            if waiter is None:  # handed over below, not in the claim
                waiter = _ApiStream(rt, job, relay, call)
            flight.call = waiter  # the watchdog's cancel and the scraper's abort wake it
            for ev in waiter.outcomes():
                if ev.kind == "ft":
                    first_ts = waiter.first_ts
                    flight.first_token = True
                    with state.batch() as b:  # the API set the state's flag itself
                        b.account(rt.info.instance_id, "on_first_token", info, cached_est)
                        b.count(**_first_token_counts(rt, job, first_ts))
                    first_token_done()
            first_ts, tokens = waiter.first_ts, waiter.tokens
            usage, finish_reason = waiter.usage, waiter.finish_reason
        else:
            flight.call = call
            for piece in call.stream():
                if piece.tokens and first_ts is None:
                    # first token: relay it and do all first-token bookkeeping in one
                    # round trip, the relay entry first
                    first_ts = time.time()
                    flight.first_token = True
                    with state.batch() as b:
                        b.xadd(
                            relay.key,
                            relay.delta_fields(piece.text, piece.tokens),
                            ttl_s=rt.live.stream_ttl_s,
                        )
                        b.first_token(rid)
                        b.account(rt.info.instance_id, "on_first_token", info, cached_est)
                        b.count(**_first_token_counts(rt, job, first_ts))
                    relay.mark_expiry_set()
                    first_token_done()
                    tokens += piece.tokens
                    coalesce.written()
                elif piece.text or piece.tokens:
                    coalesce.add(piece.text, piece.tokens)
                    tokens += piece.tokens
                if piece.finish_reason:
                    finish_reason = piece.finish_reason
                if piece.usage is not None:
                    usage = piece.usage
            coalesce.flush()
        rt.note_engine_success()
        streamed = True
    except EngineError as exc:
        coalesce.flush_quietly()  # what the client was owed before the error event
        if waiter is not None:
            first_ts, tokens = waiter.first_ts, waiter.tokens
        return _on_engine_error(rt, job, relay, exc, first_ts, tokens, dispatched)
    finally:
        rt.remove_flight(rid)
        close_prefill_side(first_ts is not None)
        if not streamed:
            state.account_finish(rt.info.instance_id, info, first_ts is not None, cached_est)

    got_first_token = first_ts is not None
    won, final = False, ""
    try:
        done = completed(
            rt.slo,
            job,
            relay,
            first_ts=first_ts,
            finished_ts=time.time(),
            dispatched_ts=dispatched,
            usage=usage,
            tokens=tokens,
            finish_reason=finish_reason,
        )
        status = done.status
        # settle and append the end entry atomically: only the winner ends the stream
        won, final = state.finish(
            rid, status, rt.worker_id, end_event=done.end, stream_ttl_s=rt.live.stream_ttl_s
        )
    finally:
        # the instance's accounting and the winner's counters: one round trip,
        # after the end entry (the client's answer does not wait for them)
        with state.batch() as b:
            b.account(
                rt.info.instance_id, "on_finish", info, cached_est, got_first_token=got_first_token
            )
            if won:
                b.count(**done.counts(job.tier))
    if not won:
        status = final or status
    _record(
        rt,
        _row(
            job,
            rt,
            status,
            dispatched_ts=dispatched,
            first_token_ts=done.first_ts,
            finished_ts=done.finished_ts,
            prompt_tokens=done.prompt_tokens,
            cached_tokens=done.cached_tokens,
            completion_tokens=done.completion_tokens,
        ),
    )
    return status


def _open_prefill_side(rt: WorkerRuntime, job: ChatJob, info: RequestInfo) -> bool:
    """A disaggregated job: book its prefill on the prefill instance's dispatch
    accounting (the router weighs that instance's queue by it) until the
    decode's first token says the prefill and the KV transfer are done."""
    if not job.prefill_instance:
        return False
    with rt.state.batch() as b:
        b.account(job.prefill_instance, "on_dispatch", info, job.prefill_cached)
    return True


def _close_prefill_side(rt: WorkerRuntime, job: ChatJob, info: RequestInfo, done: bool) -> None:
    try:
        with rt.state.batch() as b:
            if done:
                b.account(job.prefill_instance, "on_first_token", info, job.prefill_cached)
            b.account(
                job.prefill_instance, "on_finish", info, job.prefill_cached, got_first_token=done
            )
    except Exception:  # noqa: BLE001 - a Redis blip: the request itself is unharmed
        log.warning(
            "prefill accounting of %s on %s not closed", job.request_id, job.prefill_instance
        )


def run_job_guarded(
    rt: WorkerRuntime,
    message: dict[str, Any],
    received_ts: float | None = None,
    task_id: str | None = None,
) -> str:
    """Decode the task's message and :func:`run_job` it; an unexpected error (a
    bug, a malformed message) ends the request with an error event at once:
    otherwise the client would wait for its request timeout, since nothing
    else settles a request that no worker holds a lease on."""
    job: ChatJob | None = None
    try:
        job = ChatJob.from_message(message)
        return run_job(rt, job, received_ts=received_ts, task_id=task_id)
    except Exception as exc:
        msg = message if isinstance(message, dict) else {}
        rid = msg.get("rid")
        log.exception("request %s attempt %s failed inside the worker", rid, msg.get("attempt"))
        if not rid:
            return "failed"
        err = RelayWriter.error_fields(
            f"internal error in the worker ({exc.__class__.__name__}); retry the request"
        )
        try:
            won, _ = rt.state.finish(
                str(rid), "failed", rt.worker_id, end_event=err, stream_ttl_s=rt.live.stream_ttl_s
            )
            if won:
                rt.state.count(**{f"failed_{msg.get('tier') or 'unknown'}": 1})
        except Exception:
            log.exception("request %s could not be settled after the error", rid)
            return "failed"
        if won and job is not None:  # a malformed message has no row to record
            _record(
                rt,
                _row(
                    job, rt, "failed", finished_ts=time.time(), error=f"worker error: {exc!r}"[:500]
                ),
            )
        return "failed"


class _ApiStream:
    """The worker's side of a direct request (:mod:`tokenfleet.live.direct`):
    hands the engine call to the API with a ``go`` entry, then waits for the
    API's ``ft`` and ``out`` entries while its slot and lease stay held.

    Ends by returning (``out``: finish reason, usage, tokens) or raising the
    :class:`EngineError` the API saw, so the relay path's settling, re-sends
    and error handling apply unchanged. ``abort`` (the watchdog's client
    cancel, the scraper's unhealthy engine) wakes the wait at once; an API
    whose liveness key lapsed ends it as failed."""

    def __init__(
        self, rt: WorkerRuntime, job: ChatJob, relay: RelayWriter, call: EngineCall
    ) -> None:
        self.rt = rt
        self.job = job
        self.relay = relay
        self.call = call
        self.first_ts: float | None = None
        self.tokens = 0
        self.usage: dict[str, Any] | None = None
        self.finish_reason = "stop"
        self._aborted: str | None = None
        #: the ``go`` entry is written (by the claim's step, :meth:`go`)
        self._handed_over = False
        self.sub = rt.outcome_hub().subscribe(
            job.request_id, key=outcome_key(rt.state, job.request_id, job.attempt)
        )

    def _go_fields(self) -> dict[str, Any]:
        rt = self.rt
        return self.relay.go_fields(
            rt.public_engine_url,
            self.call.request_id,
            self.job.attempt,
            exact_kv_events=rt.exact_kv_events,
            prefill_url=self.job.prefill_url,
            first_token_timeout_s=self.call.first_token_timeout_s,
        )

    def go(self) -> tuple[str, dict[str, Any], float, str]:
        """The hand-over for :meth:`LiveState.claim` to write if the claim wins."""
        hub = self.rt.outcome_hub()
        return (self.relay.key, self._go_fields(), self.rt.live.stream_ttl_s, hub.wake_key)

    def handed_over(self) -> None:
        """The claim won and wrote :meth:`go`'s entry (and the stream's expiry)."""
        self._handed_over = True
        self.relay.mark_expiry_set()

    @property
    def aborted(self) -> str | None:
        return self._aborted

    def abort(self, reason: str) -> None:
        """Thread-safe: the wait raises ``aborted`` (and the engine is told, best effort)."""
        if self._aborted is None:
            self._aborted = reason
            self.sub.inbox.put(RelayEvent("abort", message=reason))

    def _started(self) -> bool:
        return self.first_ts is not None

    def outcomes(self) -> Iterator[RelayEvent]:
        """Yields ``ft`` once the API sent the first token; returns at ``out``."""
        rt, job = self.rt, self.job
        state = rt.state
        watch = rt.api_watch()
        waiting: Waiting | None = None
        try:
            if not self._handed_over:
                with state.batch() as b:
                    b.xadd(self.relay.key, self._go_fields(), ttl_s=rt.live.stream_ttl_s)
                    rt.outcome_hub().wake(b.pipe)
                self.handed_over()
            deadline = job.arrival_ts + rt.live.request_timeout_s + 2 * rt.live.lease_ttl_s
            # the API's death and a settle without it are the watch's to notice
            # (one thread for all waiters): this thread wakes for news only
            waiting = Waiting(
                job.request_id,
                api_alive_key(state, job.direct),
                lambda kind: self.sub.inbox.put(RelayEvent(kind)),
            )
            watch.add(waiting)
            while True:
                try:
                    ev = self.sub.inbox.get(timeout=max(0.05, deadline - time.time()))
                except queue.Empty:
                    if time.time() <= deadline:
                        continue
                    raise EngineError(
                        "no outcome from the API within the request timeout",
                        504,
                        False,
                        self._started(),
                        kind="api_lost",
                    ) from None
                if ev.kind in (API_LOST, SETTLED):
                    raise EngineError(
                        "the API process streaming this request was lost"
                        if ev.kind == API_LOST
                        else "the request was settled while its API streamed it",
                        502,
                        False,
                        self._started(),
                        kind="api_lost",
                    )
                facts = ev.facts or {}
                if ev.kind == "abort":
                    raise EngineError(
                        f"aborted: {ev.message}", 499, False, self._started(), kind="aborted"
                    )
                if ev.kind == "ft":
                    if self.first_ts is None:
                        self.first_ts = float(facts.get("t") or time.time())
                        yield ev
                    continue
                if ev.kind != "out":
                    continue
                self.tokens = int(facts.get("n") or 0)
                if facts.get("t") and self.first_ts is None:
                    self.first_ts = float(facts["t"])
                    yield RelayEvent("ft", facts=facts)
                if facts.get("x"):
                    raise EngineError(
                        facts.get("m", "engine failed"),
                        int(facts.get("c") or 502),
                        facts.get("r") == "1",
                        self._started(),
                        kind=facts["x"],
                    )
                u = facts.get("u")
                self.usage = json.loads(u) if u else None
                self.finish_reason = facts.get("f") or "stop"
                return
        finally:
            if waiting is not None:
                watch.discard(waiting)
            self.sub.close()


class _RelayCoalescer:
    """Relays tokens after the first in entries at most every ``interval_s``.

    One Redis Stream entry per engine flush is one round trip in the worker and
    one XREAD wake-up and SSE chunk in the API, per token at real decode speed:
    at 256 output tokens that was most of the control plane's CPU per request.
    Text that arrives within ``interval_s`` of the last entry waits for the next
    piece (or the stream's end), so a client sees its tokens at most
    ``interval_s`` plus one inter-token gap late; the first token never waits."""

    __slots__ = ("relay", "interval_s", "text", "tokens", "last_s")

    def __init__(self, relay: RelayWriter, interval_s: float) -> None:
        self.relay = relay
        self.interval_s = interval_s
        self.text = ""
        self.tokens = 0
        self.last_s = time.monotonic()

    def written(self) -> None:
        """An entry went out by another way (the first token's pipeline)."""
        self.last_s = time.monotonic()

    def add(self, text: str, tokens: int) -> None:
        self.text += text
        self.tokens += tokens
        now = time.monotonic()
        if now - self.last_s >= self.interval_s:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self.text or self.tokens:
            self.relay.delta(self.text, self.tokens)
            self.text, self.tokens = "", 0
        self.last_s = time.monotonic() if now is None else now

    def flush_quietly(self) -> None:
        try:
            self.flush()
        except Exception:  # Redis trouble: the error path reports it
            log.debug("held tokens not relayed", exc_info=True)


@functools.cache
def _model_tokenizer(path: str, block_size_tokens: int) -> HFChatTokenizer:
    return HFChatTokenizer(path, block_size_tokens=block_size_tokens or BLOCK_SIZE_TOKENS)


def _prefix_events(rt: WorkerRuntime, job: ChatJob) -> list[KVEvent]:
    """Approximate prefix knowledge for every API replica: once prefill is done
    this instance holds the prompt's blocks. None when the engine's own vLLM KV
    events are relayed (exact mode), and for a direct job (its message has no
    prompt: the API publishes its own hashes, ``go``'s ``x``)."""
    messages = job.body.get("messages")
    if rt.exact_kv_events or not messages:
        return []
    try:
        if rt.info.tokenizer:  # a real vLLM's model: hash as the API does
            hashes = (
                _model_tokenizer(rt.info.tokenizer, rt.info.block_size_tokens)
                .tokenize_chat(messages)
                .block_hashes
            )
        else:
            hashes = chat_block_hashes(messages)
    except Exception:
        log.debug("approximate KV event not built", exc_info=True)
        return []
    return [KVEvent(rt.info.instance_id, "stored", hashes, exact=False)] if hashes else []


def _first_token_counts(rt: WorkerRuntime, job: ChatJob, first_ts: float | None) -> dict[str, int]:
    return first_token_counts(rt.slo, job.tier, job.input_tokens, job.arrival_ts, first_ts)


def _on_engine_error(
    rt: WorkerRuntime,
    job: ChatJob,
    relay: RelayWriter,
    exc: EngineError,
    first_ts: float | None,
    tokens: int,
    dispatched: float,
) -> str:
    state = rt.state
    rid = job.request_id
    attempt = job.attempt
    now = time.time()
    if exc.kind == "aborted":
        send_abort(rt.info.url, f"{rid}-{attempt}")
        if "cancelled" in str(exc):
            won, final = state.finish(rid, "cancelled", rt.worker_id)
            _record(
                rt,
                _row(
                    job,
                    rt,
                    "cancelled" if won else (final or "cancelled"),
                    dispatched_ts=dispatched,
                    first_token_ts=first_ts,
                    finished_ts=now,
                    completion_tokens=tokens,
                ),
            )
            return "cancelled"
    if exc.kind in ("error", "stall", "connect") or (exc.kind == "aborted" and first_ts is None):
        rt.note_engine_failure(str(exc))
    log.warning("request %s attempt %d failed on %s: %s", rid, attempt, rt.info.instance_id, exc)
    started = first_ts is not None
    # an abort that was not the client's (engine unhealthy, stalled) is the
    # engine's fault: another instance may well serve the request
    retryable = exc.retryable or exc.kind == "aborted"
    if not started and retryable and attempt < rt.live.max_attempts:
        if _retry_elsewhere(rt, job, relay, str(exc)):
            # placement columns stay NULL: this row may reach the database after
            # the next attempt's final row, and must not overwrite where it ran
            _record(
                rt,
                _row(
                    job,
                    rt,
                    "in_flight",
                    attempts=attempt + 1,
                    dc=None,
                    instance=None,
                    error=f"attempt {attempt} on {rt.info.instance_id}: {exc}",
                ),
            )
            return "retried"
    status = "timed_out" if exc.kind == "stall" else "failed"
    won, final = state.finish(rid, status, rt.worker_id)
    if won:
        code = (
            504
            if status == "timed_out"
            else (exc.status if not retryable and exc.status < 500 else 502)
        )
        relay.error(
            f"{'engine timed out' if status == 'timed_out' else 'engine failed'}"
            f" after {attempt} attempt(s): {exc}",
            code,
            "invalid_request_error" if code < 500 else "server_error",
        )
        state.count(**{f"failed_{job.tier}": 1})
    _record(
        rt,
        _row(
            job,
            rt,
            final if not won else status,
            dispatched_ts=dispatched,
            first_token_ts=first_ts,
            finished_ts=now,
            completion_tokens=tokens,
            error=str(exc)[:500],
        ),
    )
    return status


def _retry_elsewhere(rt: WorkerRuntime, job: ChatJob, relay: RelayWriter, why: str) -> bool:
    """Re-send ``job`` (its engine failed before the first token) by the shared
    re-send rule (:mod:`tokenfleet.live.resend`); with no other instance, to this
    DC's pool queue (another worker, or this one later). False: not re-sent."""
    state = rt.state
    tried = set(job.tried) | {rt.info.instance_id}
    views = state.instance_views(time.time(), rt.live.stale_after_s)
    target = pick_resend_target(views, job, tried)
    if target is None:
        if not rt.pool_mode and len(tried) <= 1:
            return False
        queue = pool_queue(rt.info.dc, job.tier)
    else:
        queue = target.queue
    new_attempt = state.redispatch(
        job.request_id, job.attempt, rt.live.max_attempts, queue, rt.worker_id
    )
    if new_attempt < 0:
        return False
    nxt = job.next_attempt(new_attempt, queue, tried=tried)
    relay.retry(new_attempt)
    state.count(retries=1)
    log.info("request %s: attempt %d -> %s (%s)", job.request_id, new_attempt, queue, why)
    state.queued_incr(queue)
    send_chat_job(rt.send_task or app.send_task, nxt)
    return True


@app.task(name=TASK_CONTROL, ignore_result=True, acks_late=False)
def control_tick() -> dict[str, Any]:
    from workers.control import control_tick as tick

    return tick()


@app.task(name=TASK_FLEET, ignore_result=True, acks_late=False)
def fleet_cycle() -> dict[str, Any]:
    from workers.control import fleet_cycle as cycle

    return cycle()


@app.task(name=TASK_RECONCILE, ignore_result=True, acks_late=False)
def reconcile_ledger() -> dict[str, Any]:
    from workers.control import reconcile_ledger as run

    return run()
