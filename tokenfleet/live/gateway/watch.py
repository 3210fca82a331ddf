"""Follow a dispatched request to its end: relay events, lost workers, timeouts.

:meth:`Watcher.events` yields the request's relay events (tokens, end, error)
from its Redis Stream. While it waits it checks, at most twice a lease period,
that the request is still being served: a worker that died before the first
token gets its request re-sent elsewhere (:mod:`tokenfleet.live.resend`, the
same rule the workers use), one that died after it ends the stream with an
error event, and a request queued for an instance that went away is re-sent
to a live one. The request timeout and a client that went away settle it here;
``client_gone`` lets the caller say the client closed its connection while the
request waits (a non-streamed request writes nothing until its end, so only
the socket tells). Every end it relays is also recorded in the ledger
(:mod:`.rows`), so a request keeps its final row when the worker that served
it dies before its ledger writer flushed, or when the end is the API's own
verdict.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any

import redis
from kombu.exceptions import KombuError

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import KVEvent
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.direct import outcome_key
from tokenfleet.live.engine_client import EngineError
from tokenfleet.live.gateway.direct import (
    DEADLINE,
    GONE,
    LOST,
    SUPERSEDED,
    DirectCall,
    DirectCalls,
    engine_call,
)
from tokenfleet.live.gateway.dispatch import Dispatched, ledger_record
from tokenfleet.live.gateway.pump import PumpResult, StreamPump
from tokenfleet.live.gateway.rows import (
    PendingSettlements,
    end_record,
    error_record,
    settled,
)
from tokenfleet.live.jobs import ChatJob
from tokenfleet.live.queues import pool_queue
from tokenfleet.live.relay import RelayEvent, RelayReader, RelayWriter
from tokenfleet.live.resend import pick_resend_target
from tokenfleet.live.settle import completed, first_token_counts
from tokenfleet.live.state import InstanceInfo, LiveState
from tokenfleet.service.writer import RequestRecord

log = logging.getLogger("tokenfleet.api")

#: a waiting request looks at its client, deadline and worker this often (ms)
IDLE_MS = 500
#: an SSE keep-alive comment is sent after this long without any event (seconds)
KEEPALIVE_S = 5.0


class Watcher:
    """Part of :class:`~tokenfleet.live.gateway.Gateway`: waiting for the answer."""

    state: LiveState
    live: LiveConfig
    index: Any
    index_lock: threading.Lock
    metrics: Any
    direct_calls: DirectCalls
    pump: StreamPump | None
    slo: SLOConfig
    accounting: Any
    express_running: dict[tuple[str, str], int]
    express_lock: threading.Lock
    #: instance -> this process's own attempts there that failed in a row
    engine_failures: dict[str, int]

    if TYPE_CHECKING:  # from LiveView, Dispatcher and Feedback

        def instances(self, max_age_s: float = ...) -> list[InstanceInfo]: ...
        def _publish(self, job: ChatJob) -> None: ...
        def _ledger(self, row: RequestRecord) -> None: ...
        def first_token_feedback(self, d: Dispatched) -> None: ...
        def _settle_dc_choice(self, d: Dispatched, status: str) -> None: ...
        def _on_complete(self, d: Dispatched, ev: RelayEvent) -> None: ...

    def events(
        self, d: Dispatched, client_gone: Callable[[], bool] | None = None
    ) -> Generator[RelayEvent, None, None]:
        """Relay events of one request, with the lost-worker and timeout checks.

        ``client_gone()`` is asked whenever nothing came for ``IDLE_MS``,
        and every quarter second while tokens come; when it says so the
        iteration ends with a ``gone`` event and the caller cancels the
        request (:meth:`cancel`)."""
        deadline = d.request.info.arrival_s + self.live.request_timeout_s
        redis_down_since: list[float] = []

        def on_idle() -> RelayEvent | None:
            if client_gone is not None and client_gone():
                return RelayEvent("gone")
            now = time.time()
            if now > deadline:
                return self._settle(
                    d,
                    "timed_out",
                    504,
                    f"request not finished within {self.live.request_timeout_s:.0f}s",
                )
            # the lost-worker check costs two Redis reads: at most twice a lease
            # period, and only after that long without an entry (entries coming
            # mean a worker is writing them)
            period = min(1.0, self.live.lease_ttl_s / 2)
            if now - d.state_checked_s < period or now - last_entry[0] < period:
                return None
            d.state_checked_s = now
            try:
                ev = self._watch(d, now)
                redis_down_since.clear()
                return ev
            except (redis.ConnectionError, redis.TimeoutError):
                if not redis_down_since:
                    redis_down_since.append(now)
                if now - redis_down_since[0] > max(5.0, 3 * self.live.lease_ttl_s):
                    self._settle_later(d.request.info.request_id, "failed")
                    return RelayEvent(
                        "err",
                        message="lost contact with the live state store "
                        "while waiting for this request; retry it",
                        code=503,
                        error_type="server_error",
                        ledger=settled("failed"),
                    )
                return None

        last_entry = [0.0]  # wall time of the last entry from the stream
        relayed = (
            d.sub.events(on_idle, idle_ms=IDLE_MS)
            if d.sub is not None
            else RelayReader(self.state, d.request.info.request_id, block_ms=250).events(on_idle)
        )
        source = self._with_direct(d, relayed, client_gone, last_entry)
        gone_checked = time.monotonic()
        quiet_since = gone_checked
        for ev in source:
            if ev.kind == "idle":
                # a keep-alive comment after KEEPALIVE_S of silence, not at every
                # idle tick: with thousands of slow streams those writes were
                # most of the process's work (client_gone notices a closed socket)
                if time.monotonic() - quiet_since < KEEPALIVE_S:
                    continue
            else:
                last_entry[0] = time.time()
            quiet_since = time.monotonic()
            if client_gone is not None and ev.kind == "d":
                # tokens flowing leave no idle moment: ask the socket every quarter second too
                now_m = time.monotonic()
                if now_m - gone_checked >= 0.25:
                    gone_checked = now_m
                    if client_gone():
                        source.close()
                        yield RelayEvent("gone")
                        return
            if ev.kind == "d" and d.first_token_s is None:
                d.first_token_s = time.time()
                d.first_token_due = ev.instance or d.instance
            if ev.kind == "d":
                d.tokens += ev.tokens
                d.serving = ev.instance or d.serving
            elif ev.kind == "retry":
                d.attempt = max(d.attempt, ev.attempt)
                d.serving = ""  # the next attempt's instance is not known yet
            elif ev.kind == "end":
                self._on_complete(d, ev)
                self._ledger_end(d, ev)
            elif ev.kind == "err":
                self._settle_dc_choice(d, "failed")
                self._ledger(error_record(d, ev, self._dc_of(d.serving)))
            yield ev
            # the policies learn from the first token once the caller has sent it
            # on (it asks for the next event after writing the chunk)
            self.first_token_feedback(d)

    def _with_direct(
        self,
        d: Dispatched,
        relayed: Generator[RelayEvent, None, None],
        client_gone: Callable[[], bool] | None,
        last_entry: list[float],
    ) -> Generator[RelayEvent, None, None]:
        """The relay stream's events, with each ``go`` hand-over replaced by the
        engine's own stream (:meth:`_direct`)."""
        try:
            if d.express is not None:  # this process's own first attempt
                for dev in self._direct(d, d.express, client_gone, owned=True):
                    yield dev
                    if dev.kind in ("end", "err", "gone"):
                        return
                last_entry[0] = time.time()  # its end (or re-send) follows on the stream
            for ev in relayed:
                if ev.kind != "go":
                    yield ev
                    continue
                for dev in self._direct(d, ev, client_gone):
                    yield dev
                    if dev.kind in ("err", "gone"):
                        return
                last_entry[0] = time.time()  # the worker's verdict follows on the stream
        finally:
            relayed.close()
            d.drop_express_call(GONE)  # closed before its stream was read

    def _direct(
        self,
        d: Dispatched,
        go: RelayEvent,
        client_gone: Callable[[], bool] | None,
        owned: bool = False,
    ) -> Generator[RelayEvent, None, None]:
        """Read the engine's stream of the attempt ``go`` hands over
        (:mod:`tokenfleet.live.direct`).

        Yields ``d`` events; ends after reporting the outcome to the worker
        (whose ``end``, ``retry`` or ``err`` entry follows on the relay stream),
        or with a terminal ``err``/``gone`` when the watch thread closed the call.
        ``owned``: this process claimed the attempt (express dispatch) and
        settles it itself, as the worker would (:meth:`_own_end`)."""
        facts = go.facts or {}
        info = d.request.info
        rid = info.request_id
        attempt = int(facts.get("a") or 0)
        if attempt < d.attempt:
            return  # a superseded attempt's hand-over
        d.attempt = attempt
        instance = facts.get("i", "")
        d.serving = instance
        # the express attempt's call was sent at dispatch; any other is opened here
        call = (d.express_call if owned else None) or engine_call(facts, d.job, self.live)
        d.express_call = None
        watched = DirectCall(
            rid,
            attempt,
            call,
            info.arrival_s + self.live.request_timeout_s,
            client_gone,
            owned=owned,
        )
        out_key = outcome_key(self.state, rid, attempt)
        first_s: float | None = None
        tokens = 0
        usage: dict[str, Any] | None = None
        finish = "stop"
        completed = False
        self.direct_calls.register(watched)
        try:
            try:
                coalesce_s = self.live.relay_flush_interval_s
                pumped: PumpResult | None = None
                for piece in call.stream(coalesce_s=coalesce_s):
                    if not (piece.text or piece.tokens):
                        pass
                    elif first_s is None:
                        first_s = time.time()
                        tokens += piece.tokens
                        yield RelayEvent("d", piece.text, piece.tokens, instance=instance)
                        # after the token left: the state's flag first (a lost worker
                        # then means an error, not a re-send), then the worker's entry
                        if owned:
                            self._own_first_token(d, instance, first_s)
                        else:
                            self._report(out_key, {"k": "ft", "t": first_s}, first_token_of=rid)
                        if facts.get("x") == "0":
                            self._approximate_kv(instance, info.block_hashes)
                    else:
                        tokens += piece.tokens
                        yield RelayEvent("d", piece.text, piece.tokens, instance=instance)
                    if piece.finish_reason:
                        finish = piece.finish_reason
                    if piece.usage is not None:
                        usage = piece.usage
                    if first_s is not None and d.sink is not None and self.pump is not None:
                        # the rest of the stream goes through the process's pump
                        pumped = self.pump.carry(
                            call, d.sink, coalesce_s=coalesce_s, stall_s=call.stall_timeout_s
                        )
                        if pumped is not None:
                            break
                if pumped is not None:
                    if pumped.client_failed:
                        call.abort(GONE)
                    tokens += pumped.tokens
                    finish = pumped.finish_reason or finish
                    usage = pumped.usage if pumped.usage is not None else usage
                    if pumped.tokens and not pumped.client_failed:
                        yield RelayEvent("d", pumped.text, pumped.tokens, instance=instance)
                    if pumped.error is not None:
                        raise pumped.error
                    if pumped.client_failed:
                        raise EngineError(f"aborted: {GONE}", 499, False, True, kind="aborted")
                completed = True
            except EngineError as exc:
                completed = True
                why = call.aborted
                if why in (GONE, LOST, DEADLINE, SUPERSEDED):
                    ev = self._direct_closed(d, why, first_s is not None)
                    if ev is not None:
                        yield ev
                    return
                if owned:
                    ev = self._own_failure(d, instance, attempt, exc, first_s)
                    if ev is not None:
                        yield ev
                    return
                fields: dict[str, Any] = {
                    "k": "out",
                    "x": exc.kind,
                    "m": str(exc)[:500],
                    "c": exc.status,
                    "r": int(exc.retryable),
                    "n": tokens,
                }
                if first_s is not None:
                    fields["t"] = first_s
                self._report(out_key, fields)
                return
            if owned:
                end = self._own_end(d, instance, first_s, tokens, usage, finish)
                if end is not None:
                    yield end
                return
        finally:
            self.direct_calls.unregister(watched)
            if not completed:
                call.abort("closed")  # the caller stopped reading: the engine stops too
            if owned:
                self._own_release(d, instance, first_s is not None)
        fields = {"k": "out", "f": finish, "n": tokens, "u": json.dumps(usage) if usage else ""}
        if first_s is not None:
            fields["t"] = first_s
        self._report(out_key, fields)

    # -- express dispatch: the attempts this process claimed (dispatch.py, _express) --------
    def _own_first_token(self, d: Dispatched, instance: str, first_s: float) -> None:
        """The worker's first-token step: the state's flag (a re-send is no
        longer possible), the instance's accounting and beat's counters."""
        info = d.request.info
        try:
            with self.state.batch() as b:
                b.first_token(info.request_id)
                delta = b.account(instance, "on_first_token", info, d.job.expected_cached)
                b.count(
                    **first_token_counts(
                        self.slo, info.tier, info.input_tokens, info.arrival_s, first_s
                    )
                )
            self.accounting.wrote(instance, delta)
        except redis.RedisError:
            log.warning("first token of %s not recorded in the live state", info.request_id)

    def _own_end(
        self,
        d: Dispatched,
        instance: str,
        first_s: float | None,
        tokens: int,
        usage: dict[str, Any] | None,
        finish: str,
    ) -> RelayEvent | None:
        """Settle a completed attempt as its worker would: the verdict and the
        ``end`` entry in one atomic step. Returns the ``end`` event for the
        client (and the API's row, in :meth:`events`) at once, also when Redis
        is away (settled there once it is back); None when something else
        settled the request first (its verdict is on the stream)."""
        rid = d.request.info.request_id
        done = completed(
            self.slo,
            d.job,
            RelayWriter(self.state, rid, self.live.stream_ttl_s, instance),
            first_ts=first_s,
            finished_ts=time.time(),
            dispatched_ts=d.dispatch_s,
            usage=usage,
            tokens=tokens,
            finish_reason=finish,
        )
        try:
            won, _ = self.state.finish(
                rid,
                done.status,
                self.direct_calls.owner,
                end_event=done.end,
                stream_ttl_s=self.live.stream_ttl_s,
            )
        except redis.RedisError:
            self._settle_later(rid, done.status)
            won = True
        else:
            if won:
                d.extra["counts"] = done.counts(d.request.info.tier)
        with self.express_lock:
            self.engine_failures.pop(instance, None)
        if not won:
            return None
        return RelayEvent(
            "end",
            finish_reason=finish or "stop",
            usage=json.loads(done.end["u"]) if done.end.get("u") else None,
            instance=instance,
            ledger={k: str(done.end[k]) for k in ("s", "td", "tf", "te", "ca")},
        )

    def _own_failure(
        self, d: Dispatched, instance: str, attempt: int, exc: EngineError, first_s: float | None
    ) -> RelayEvent | None:
        """The worker's engine-error rule: before any token, a retryable error
        re-sends the request (through the broker: another instance, else its
        datacenter's pool); otherwise the request ends with the error."""
        try:
            return self._own_failure_settled(d, instance, attempt, exc, first_s)
        except redis.RedisError:
            self._settle_later(d.request.info.request_id, "failed")
            return RelayEvent(
                "err",
                message="lost contact with the live state store after the engine failed "
                f"({exc}); retry the request",
                code=503,
                error_type="server_error",
                ledger=settled("failed"),
            )

    def _own_failure_settled(
        self, d: Dispatched, instance: str, attempt: int, exc: EngineError, first_s: float | None
    ) -> RelayEvent | None:
        info = d.request.info
        if exc.kind in ("error", "stall", "connect") or (exc.kind == "aborted" and first_s is None):
            self._engine_failed(instance, str(exc))
        retryable = exc.retryable or exc.kind == "aborted"
        if first_s is None and retryable and attempt < self.live.max_attempts:
            log.warning(
                "request %s attempt %d failed on %s: %s", info.request_id, attempt, instance, exc
            )
            dc = self._dc_of(instance) or d.job.dc
            ev = self._resend(
                d,
                attempt,
                {instance},
                f"attempt {attempt} on {instance}: {exc}",
                owner=self.direct_calls.owner,
                fallback_queue=pool_queue(dc, info.tier),
            )
            if d.attempt > attempt or ev is not None:
                return ev
        status = "timed_out" if exc.kind == "stall" else "failed"
        code = 504 if status == "timed_out" else (exc.status if exc.status < 500 else 502)
        verb = "engine timed out" if status == "timed_out" else "engine failed"
        ev = self._settle(
            d,
            status,
            code,
            f"{verb} after {attempt} attempt(s): {exc}",
            "invalid_request_error" if code < 500 else None,
        )
        if ev is not None:
            d.extra["counts"] = {f"failed_{info.tier}": 1}
        return ev

    def _engine_failed(self, instance: str, reason: str) -> None:
        """The worker's health rule for the attempts run here: after
        ``engine_fail_threshold`` failures in a row the instance is marked
        unhealthy for ``engine_unhealthy_s`` (routers skip it meanwhile)."""
        with self.express_lock:
            n = self.engine_failures[instance] = self.engine_failures.get(instance, 0) + 1
            if n < self.live.engine_fail_threshold:
                return
            self.engine_failures[instance] = 0
        log.warning(
            "instance %s marked unhealthy for %.1fs: %s",
            instance,
            self.live.engine_unhealthy_s,
            reason,
        )
        try:
            self.state.mark_unhealthy(instance, self.live.engine_unhealthy_s, reason)
            self.state.count(instances_marked_unhealthy=1)
        except redis.RedisError:
            log.warning("instance %s could not be marked unhealthy in Redis", instance)

    def _own_release(self, d: Dispatched, instance: str, got_first_token: bool) -> None:
        """The attempt left the engine: its accounting, and the settler's counters."""
        info = d.request.info
        with self.express_lock:
            key = (instance, info.tier)
            left = self.express_running.get(key, 0) - 1
            if left > 0:
                self.express_running[key] = left
            else:
                self.express_running.pop(key, None)
        try:
            with self.state.batch() as b:
                delta = b.account(
                    instance,
                    "on_finish",
                    info,
                    d.job.expected_cached,
                    got_first_token=got_first_token,
                )
                if counts := d.extra.pop("counts", None):
                    b.count(**counts)
            self.accounting.wrote(instance, delta)
        except redis.RedisError:
            log.warning("accounting of %s on %s not released", info.request_id, instance)

    def _approximate_kv(self, instance: str, hashes: Sequence[int]) -> None:
        """Without the engine's KV events, every replica learns that ``instance``
        holds the prompt's blocks once its prefill is done (hashed here, once)."""
        if not hashes:
            return
        try:
            self.state.publish_kv_events([KVEvent(instance, "stored", tuple(hashes), exact=False)])
        except redis.RedisError:
            log.debug("approximate KV event not published", exc_info=True)

    def _direct_closed(self, d: Dispatched, why: str, started: bool) -> RelayEvent | None:
        """The watch thread closed a direct call: what the request does next."""
        if why == GONE:
            return RelayEvent("gone")
        if why == DEADLINE:
            limit = self.live.request_timeout_s
            return self._settle(d, "timed_out", 504, f"request not finished within {limit:.0f}s")
        if started:
            # the client has part of an answer another attempt cannot continue
            return self._settle(
                d,
                "failed",
                502,
                "the worker serving this request was lost after streaming began; retry the request",
            )
        if why == LOST:
            return self._watch(d, time.time())  # re-sent (None) or settled
        return None  # superseded before any token: the stream says what follows

    def _report(self, key: str, fields: dict[str, Any], first_token_of: str | None = None) -> None:
        """One entry to the worker's outcome stream, retried across a short Redis outage."""
        until = time.monotonic() + max(5.0, 3 * self.live.lease_ttl_s)
        while True:
            try:
                with self.state.batch() as b:
                    if first_token_of is not None:
                        b.first_token(first_token_of)
                    b.xadd(key, fields, ttl_s=self.live.stream_ttl_s)
                return
            except (redis.ConnectionError, redis.TimeoutError):
                if first_token_of is not None or time.monotonic() > until:
                    log.warning("outcome entry for %s not written", key)
                    return
                time.sleep(0.2)

    def _watch(self, d: Dispatched, now: float) -> RelayEvent | None:
        """Detect a lost worker or a request stranded in a dead instance's queue."""
        st = self.state.request_state(d.request.info.request_id)
        status = st.get("status")
        if not st:
            # Redis came back without this request's state (restarted from an
            # older snapshot): nothing will settle it, so end it now
            missing = d.extra.setdefault("state_missing_s", now)
            if now - missing > self.live.lease_ttl_s:
                return self._settle(
                    d, "failed", 503, "the live state of this request was lost; retry it"
                )
            return None
        d.extra.pop("state_missing_s", None)
        attempt = int(st.get("attempt", "1") or 1)
        d.attempt = max(d.attempt, attempt)
        if status == "running" and not self.state.lease_alive(d.request.info.request_id):
            st = self.state.request_state(d.request.info.request_id)
            if st.get("status") != "running":
                return None
            lost = st.get("instance", "")
            if st.get("first_token") == "1":
                return self._settle(
                    d,
                    "failed",
                    502,
                    "the worker serving this request was "
                    "lost after streaming began; retry the request",
                )
            return self._resend(d, attempt, {lost}, f"worker of {lost} lost")
        if status == "queued":
            queue = st.get("queue", d.queue)
            queued_at = float(st.get("queued_at", "0") or 0)
            if now - queued_at < self.live.affinity_dead_after_s:
                return None
            if not self._queue_served(queue, now):
                return self._resend(d, attempt, set(), f"no live worker consumes {queue}")
        if status == "done" and st.get("final") in ("failed", "timed_out", "cancelled"):
            # settled by someone who could not write to the stream (e.g. lost worker)
            return RelayEvent(
                "err",
                message=f"request {st.get('final')}",
                code=502,
                error_type="server_error",
                ledger=settled(st.get("final") or "failed"),
            )
        return None

    def _queue_served(self, queue: str, now: float) -> bool:
        parts = queue.split(".")
        for i in self.instances(max_age_s=0.5):
            if not i.is_healthy(now, self.live.stale_after_s):
                continue
            if len(parts) == 3 and i.instance_id == parts[1] and i.dc == parts[0]:
                return True
            if len(parts) == 2 and i.dc == parts[0]:
                return True
        return False

    def _resend(
        self,
        d: Dispatched,
        attempt: int,
        exclude: set[str],
        why: str,
        owner: str = "",
        fallback_queue: str = "",
    ) -> RelayEvent | None:
        """Publish the next attempt by the shared re-send rule (:mod:`tokenfleet.live.resend`).
        ``owner``: the attempt's lease is this process's (express dispatch),
        given up by the move; ``fallback_queue``: where to with no other instance."""
        info = d.request.info
        now = time.time()
        tried = set(d.job.tried) | exclude
        views = self.state.instance_views(
            now, self.live.stale_after_s, self.instances(max_age_s=0.0)
        )
        target = pick_resend_target(views, d.job, tried)
        if target is None and not fallback_queue:
            if attempt >= self.live.max_attempts:
                return self._settle(d, "failed", 503, f"{why}; no other instance available")
            return None  # wait for one to come back (or the request timeout)
        queue = target.queue if target is not None else fallback_queue
        new_attempt = self.state.redispatch(
            info.request_id, attempt, self.live.max_attempts, queue, owner
        )
        if new_attempt == -5:
            return self._settle(d, "failed", 502, f"{why}; out of attempts")
        if new_attempt < 0:
            return None  # raced with a worker or another check: look again next tick
        cached = 0
        if target is not None:
            with self.index_lock:
                cached = self.index.match_instance(target.instance_id, info.block_hashes) * 16
        job = d.job.next_attempt(
            new_attempt, queue, tried=tried, expected_cached=min(cached, info.input_tokens)
        )
        try:
            self._publish(job)
        except KombuError:
            log.warning(
                "request %s: broker unavailable for the re-send; the next check retries",
                info.request_id,
            )
            self.state.set_request_status(info.request_id, "running")
            return None
        d.job = job
        d.attempt = new_attempt
        d.redispatches += 1
        self.state.count(api_redispatches=1)
        log.warning(
            "request %s re-sent as attempt %d to %s: %s",
            info.request_id,
            new_attempt,
            queue,
            why,
        )
        return None

    def _settle(
        self, d: Dispatched, status: str, code: int, message: str, error_type: str | None = None
    ) -> RelayEvent | None:
        info = d.request.info
        won, _final = self.state.finish(info.request_id, status)
        if not won:
            return None  # the worker settled it first; its events are on the way
        self.state.cancel(info.request_id)
        # the row: recorded by events() with every error it relays
        if self.metrics is not None:
            self.metrics.finished(info.tier, status, tenant=info.tenant)
        self._settle_dc_choice(d, status)
        return RelayEvent(
            "err",
            message=message,
            code=code,
            error_type=error_type or ("timeout" if code == 504 else "server_error"),
            ledger=settled(status),
        )

    def cancel(self, d: Dispatched) -> None:
        """The client went away: stop the engine work and settle as cancelled."""
        info = d.request.info
        if d.sub is not None:
            d.sub.close()
        d.drop_express_call(GONE)  # sent, never read
        try:
            self.state.cancel(info.request_id)
            won, _ = self.state.finish(info.request_id, "cancelled")
        except redis.RedisError:
            # settled in Redis once it is back; the row records the end now
            self._settle_later(info.request_id, "cancelled")
            won = True
        if won:
            self._ledger(
                ledger_record(
                    info,
                    "cancelled",
                    dc=self._dc_of(d.serving),
                    instance=d.serving or None,
                    finished_ts=time.time(),
                    first_token_ts=d.first_token_s,
                    completion_tokens=d.tokens,
                )
            )
            if self.metrics is not None:
                self.metrics.finished(info.tier, "cancelled", tenant=info.tenant)
        self._settle_dc_choice(d, "cancelled")

    def _ledger_end(self, d: Dispatched, ev: RelayEvent) -> None:
        """The API's copy of the worker's final row (see :mod:`.rows`)."""
        row = end_record(d, ev, self._dc_of(ev.instance))
        if row is not None:
            self._ledger(row)

    def _dc_of(self, instance: str) -> str | None:
        """The datacenter of ``instance`` for the API's rows (None: not known)."""
        if not instance:
            return None
        try:
            infos = self.instances(max_age_s=60.0)
        except redis.RedisError:
            return None
        return next((i.dc for i in infos if i.instance_id == instance), None)

    def _settle_later(self, request_id: str, status: str) -> None:
        """Settle in Redis when it answers again (:class:`.rows.PendingSettlements`)."""
        pending: PendingSettlements | None = getattr(self, "_pending_settlements", None)
        if pending is None:
            pending = self._pending_settlements = PendingSettlements(self.state)
        pending.add(request_id, status)
