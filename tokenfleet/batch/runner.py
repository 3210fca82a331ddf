"""The batch runner: releases stored lines into serving and assembles the results.

Exactly one output or error line per input line, across crashes, comes
from three rules on ``batch_lines`` (PostgreSQL):

1. **Claim** with ``FOR UPDATE SKIP LOCKED``: a pending line becomes
   ``running`` with ``request_id = "<attempt>:<claim token>:<line id>"``;
   any number of runners (one per API process, or standalone) can claim
   concurrently without taking the same line.
2. **Finish conditionally**: a result is written only ``WHERE status =
   'running' AND request_id = <that attempt>``, in one transaction with the
   batch's counters, so a stale attempt (its runner was presumed dead) can
   never write a second result, and the counters count each line once.
3. **Lease**: a running line's ``updated_at`` is renewed by its runner every
   ``lease_s / 3``; a line whose lease lapsed (runner killed, API restarted)
   goes back to pending and runs again, up to ``max_attempts``, after which
   it fails with ``code = "too_many_attempts"``.

Execution is therefore at-least-once and output exactly-once. A batch is
finalized when no line is pending or running: the output and error files
are written (deterministic file ids, atomic writes: a crash during
finalization is simply redone) and the batch becomes completed, cancelled
or expired.

What to release, and when, is :func:`tokenfleet.batch.release.plan_release`
(the batch share of the fleet, fairness, deadline promotion); per-line quota
admission uses the tenant's *batch* budget, and a line refused by quota is
put back without using up an attempt.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.batch.executors import LineExecutor, LineResult
from tokenfleet.batch.files import FileStore
from tokenfleet.batch.jobs import validate_batch
from tokenfleet.batch.release import BatchDemand, plan_release
from tokenfleet.service.ledger import Batch, BatchLine, BatchLineStatus, BatchStatus, utcnow

log = logging.getLogger("tokenfleet.batch")

L: sa.Table = BatchLine.__table__  # type: ignore[assignment]
B: sa.Table = Batch.__table__  # type: ignore[assignment]
PENDING, RUNNING = BatchLineStatus.PENDING, BatchLineStatus.RUNNING
COMPLETED, FAILED, CANCELLED = (
    BatchLineStatus.COMPLETED,
    BatchLineStatus.FAILED,
    BatchLineStatus.CANCELLED,
)


@dataclass(frozen=True)
class RunnerConfig:
    #: lines this runner executes at once (its share of the batch tier is set by ``capacity``)
    max_inflight: int = 64
    #: a running line whose runner stopped renewing it for this long runs again
    lease_s: float = 30.0
    poll_s: float = 0.2
    #: the poll while no batch is in progress here and no line runs: each poll is
    #: a PostgreSQL query, and an idle API process paid 16 CPU-ms a second for
    #: them at 0.2 s; a new batch of this process wakes the runner at once
    idle_poll_s: float = 1.0
    housekeeping_s: float = 1.0
    #: housekeeping's period while no batch is in progress here, no line runs and
    #: its last round found nothing: a round is four PostgreSQL statements, most
    #: of an idle API process's batch-runner CPU at 1 s (docs/benchmarks.md,
    #: section 29); a batch created or cancelled through this process wakes it
    idle_housekeeping_s: float = 5.0
    max_attempts: int = 5
    #: results written per transaction
    flush_lines: int = 500
    #: per-line service time assumed before any line of a batch finished
    default_line_service_s: float = 2.0
    promote_margin: float = 0.5
    promote_min_slack_s: float = 600.0
    #: a batch left ``validating``/``finalizing`` this long by a dead process is redone
    stuck_s: float = 60.0


@dataclass(slots=True)
class _LineInFlight:
    line_id: int
    batch_id: str
    tenant_id: str
    request_id: str
    attempt: int
    started: float = field(default_factory=time.monotonic)


def _attempt_expr() -> Any:
    prev = sa.func.nullif(sa.func.split_part(L.c.request_id, ":", 1), "")
    return sa.func.coalesce(sa.cast(prev, sa.Integer), 0) + 1


def _error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


def output_record(
    line_id: int,
    custom_id: str,
    status: BatchLineStatus,
    result: dict[str, Any] | None,
    error: dict[str, Any] | None,
) -> dict[str, Any]:
    """One line of the output or error file (OpenAI batch output format)."""
    return {
        "id": f"batch_req_{line_id}",
        "custom_id": custom_id,
        "response": result if status != CANCELLED else None,
        "error": error,
    }


class BatchRunner:
    def __init__(
        self,
        engine: Engine,
        files: FileStore,
        executor: LineExecutor,
        *,
        config: RunnerConfig | None = None,
        gate: Any = None,
        capacity: Callable[[], int] | None = None,
        name: str = "batch-runner",
    ) -> None:
        self.engine = engine
        self.files = files
        self.executor = executor
        self.cfg = config or RunnerConfig()
        self.gate = gate
        self.capacity = capacity or (lambda: self.cfg.max_inflight)
        self.name = name
        self.token = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._flights: dict[int, _LineInFlight] = {}
        self._done: deque[tuple[_LineInFlight, LineResult]] = deque()
        self._deferred: dict[str, float] = {}
        self._service_s: dict[str, float] = {}
        self._pool = ThreadPoolExecutor(self.cfg.max_inflight, thread_name_prefix=name)
        self._stop = threading.Event()
        #: set when a line finishes, so its slot is refilled without waiting for the poll
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_housekeeping = 0.0
        self._next_heartbeat = 0.0
        #: the last release round saw a batch in progress (poll at ``poll_s``)
        self._busy = True
        self.stats = {
            "claimed": 0,
            "completed": 0,
            "failed": 0,
            "retried": 0,
            "quota_deferred": 0,
            "reaped": 0,
            "finalized": 0,
        }

    # ---- lifecycle ---------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop releasing; wait up to ``timeout_s`` for lines in flight, record them."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)
            self._thread = None
        deadline = time.monotonic() + timeout_s
        while self.inflight() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.flush()
        except Exception as exc:  # noqa: BLE001 - lines stay running and are reaped later
            log.warning("batch runner could not record final results: %s", exc)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.tick()
            except sa.exc.OperationalError as exc:  # database down: keep trying, quietly
                log.warning(
                    "batch runner: database unavailable (%s); retrying",
                    str(exc.orig).strip().splitlines()[0] if exc.orig else exc,
                )
                self._stop.wait(2.0)
            except Exception:
                log.exception("batch runner tick failed")
                self._stop.wait(1.0)
            if self._wake.wait(self._poll_s()):
                self._stop.wait(0.01)  # let a few more lines finish: one flush for all

    def _poll_s(self) -> float:
        """``poll_s`` while there is batch work; idle, ``idle_poll_s`` but no
        longer than the housekeeping period (which runs its rounds anyway)."""
        if self._busy or self.inflight():
            return self.cfg.poll_s
        return max(self.cfg.poll_s, min(self.cfg.idle_poll_s, self.cfg.housekeeping_s))

    def wake(self) -> None:
        """Run a scheduling round and housekeeping now (a batch was just created
        or cancelled in this process)."""
        self._next_housekeeping = 0.0
        self._wake.set()

    def inflight(self) -> int:
        with self._lock:
            return len(self._flights)

    # ---- one scheduling round --------------------------------------------------------
    def tick(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.cfg.lease_s / 3
            self.heartbeat()
        self.flush()
        if now >= self._next_housekeeping:
            self._next_housekeeping = now + self.cfg.housekeeping_s
            if not (self.housekeeping() or self._busy or self.inflight()):
                self._next_housekeeping = now + max(
                    self.cfg.housekeeping_s, self.cfg.idle_housekeeping_s
                )
        if not self._stop.is_set():
            self.release()

    def heartbeat(self) -> None:
        with self._lock:
            ids = list(self._flights)
        if ids:
            with self.engine.begin() as conn:
                conn.execute(
                    sa.update(L)
                    .where(L.c.id.in_(ids), L.c.status == RUNNING)
                    .values(updated_at=sa.func.now())
                )

    def housekeeping(self) -> bool:
        """One round; True if any step found something to do."""
        found = self.revalidate_stuck() > 0
        found = self.reap() > 0 or found
        found = self.wind_down() > 0 or found
        return self.finalize_ready() > 0 or found

    # ---- release ---------------------------------------------------------------------
    def release(self) -> int:
        free = self.cfg.max_inflight - self.inflight()
        if free <= 0:
            return 0
        now_m = time.monotonic()
        with self.engine.connect() as conn:
            rows = conn.execute(
                sa.select(
                    B.c.id,
                    B.c.tenant_id,
                    B.c.total_count,
                    B.c.completed_count,
                    B.c.failed_count,
                    B.c.expires_at,
                ).where(B.c.status == BatchStatus.IN_PROGRESS, B.c.expires_at > sa.func.now())
            ).all()
        self._busy = bool(rows)
        if not rows:
            return 0
        with self._lock:
            held: dict[str, int] = {}
            for f in self._flights.values():
                held[f.batch_id] = held.get(f.batch_id, 0) + 1
        now = utcnow()
        tenants = {r.id: r.tenant_id for r in rows}
        demands = []
        for r in rows:
            if self._deferred.get(r.id, 0.0) > now_m:
                continue
            remaining = int(r.total_count) - int(r.completed_count) - int(r.failed_count)
            if remaining <= held.get(r.id, 0):
                continue
            demands.append(
                BatchDemand(
                    batch_id=r.id,
                    remaining_lines=remaining,
                    inflight_lines=held.get(r.id, 0),
                    seconds_to_deadline=(r.expires_at - now).total_seconds(),
                    line_service_s=self._service_s.get(r.id, self.cfg.default_line_service_s),
                )
            )
        if not demands:
            return 0
        normal = max(0, min(self.cfg.max_inflight, int(self.capacity())))
        plan = plan_release(
            demands,
            normal_slots=normal,
            promoted_slots=self.cfg.max_inflight - normal,
            promote_margin=self.cfg.promote_margin,
            promote_min_slack_s=self.cfg.promote_min_slack_s,
        )
        started = 0
        for bid, n in sorted(plan.grants.items()):
            n = min(n, self.cfg.max_inflight - self.inflight())
            if n <= 0:
                break
            started += self._claim_and_start(bid, tenants[bid], n, bid in plan.promoted)
        return started

    def _claim_and_start(self, batch_id: str, tenant_id: str, n: int, promoted: bool) -> int:
        sub = (
            sa.select(L.c.id)
            .where(L.c.batch_id == batch_id, L.c.status == PENDING)
            .order_by(L.c.id)
            .limit(n)
            .with_for_update(skip_locked=True)
        )
        attempt = _attempt_expr()
        rid = sa.cast(attempt, sa.String) + f":{self.token}:" + sa.cast(L.c.id, sa.String)
        stmt = (
            sa.update(L)
            .where(L.c.id.in_(sub.scalar_subquery()))
            .values(status=RUNNING, request_id=rid, updated_at=sa.func.now())
            .returning(L.c.id, L.c.body, L.c.request_id)
        )
        with self.engine.begin() as conn:
            claimed = conn.execute(stmt).all()
        if not claimed:
            return 0
        self.stats["claimed"] += len(claimed)
        tenant = self.gate.directory.tenant(tenant_id) if self.gate is not None else None
        started = 0
        for i, row in enumerate(claimed):
            flight = _LineInFlight(
                row.id, batch_id, tenant_id, row.request_id, int(row.request_id.split(":", 1)[0])
            )
            admission = None
            if tenant is not None:
                admission, retry_s = self._admit(tenant, row.body, row.request_id)
                if admission is None:
                    self._unclaim([(r.id, r.request_id) for r in claimed[i:]])
                    self._deferred[batch_id] = time.monotonic() + (retry_s or 1.0)
                    self.stats["quota_deferred"] += len(claimed) - i
                    break
            with self._lock:
                self._flights[row.id] = flight
            self._pool.submit(
                self._execute,
                flight,
                row.body,
                admission,
                promoted,
                tenant.slo_class if tenant is not None else None,
            )
            started += 1
        return started

    def _admit(self, tenant: Any, body: dict[str, Any], rid: str) -> tuple[Any, float | None]:
        from tokenfleet.tenancy.gate import TenancyError, estimate_chat_cost

        prompt, max_tokens = estimate_chat_cost(body)
        try:
            return self.gate.admit(
                tenant,
                "batch",
                model=None,
                prompt_tokens=prompt,
                max_tokens=max_tokens,
                ticket_id=rid,
            ), None
        except TenancyError as err:
            if err.status == 429:
                ra = err.headers.get("retry-after-ms")
                return None, (int(ra) / 1000.0 if ra else 1.0)
            # can never pass (request larger than the batch budget): run it and let it fail
            # would hide the reason; defer for a minute so an admin can raise the quota
            return None, 60.0

    def _unclaim(self, lines: list[tuple[int, str]]) -> None:
        """Give claimed lines back without using up an attempt."""
        with self.engine.begin() as conn:
            for line_id, rid in lines:
                attempt, rest = rid.split(":", 1)
                prev = f"{int(attempt) - 1}:{rest}" if int(attempt) > 1 else None
                conn.execute(
                    sa.update(L)
                    .where(L.c.id == line_id, L.c.request_id == rid, L.c.status == RUNNING)
                    .values(status=PENDING, request_id=prev, updated_at=sa.func.now())
                )

    def _execute(
        self,
        flight: _LineInFlight,
        body: dict[str, Any],
        admission: Any,
        promoted: bool,
        slo_class: str | None,
    ) -> None:
        t0 = time.monotonic()
        try:
            result = self.executor.execute(
                flight.tenant_id,
                body,
                request_id=flight.request_id,
                slo_class=slo_class,
                promoted=promoted,
            )
        except Exception as exc:
            log.exception("batch line %s: executor raised", flight.line_id)
            result = LineResult(
                500,
                {
                    "error": {
                        "message": f"executor error: {exc}",
                        "type": "server_error",
                        "param": None,
                        "code": None,
                    }
                },
                flight.request_id,
                transient=True,
            )
        if admission is not None:
            # reconcile the reservation with what was used (nothing, if it did not run)
            prompt = result.prompt_tokens or (admission.prompt_tokens if result.ok else 0)
            try:
                self.gate.finish(
                    admission,
                    completion_tokens=result.completion_tokens,
                    prompt_tokens=prompt,
                    ran=not result.transient,
                )
            except Exception:
                log.exception("batch line %s: quota release failed", flight.line_id)
        dt = time.monotonic() - t0
        if not result.transient:
            prev = self._service_s.get(flight.batch_id)
            self._service_s[flight.batch_id] = dt if prev is None else 0.9 * prev + 0.1 * dt
        with self._lock:
            self._done.append((flight, result))
            if admission is not None:  # its quota (slot, tokens) was just given back
                self._deferred.pop(flight.batch_id, None)
        self._wake.set()

    # ---- recording results -----------------------------------------------------------
    def flush(self) -> int:
        """Write finished lines' results (conditionally: exactly once per line)."""
        with self._lock:
            batch = [
                self._done.popleft() for _ in range(min(len(self._done), self.cfg.flush_lines))
            ]
        if not batch:
            return 0
        counts: dict[str, list[int]] = {}
        retry_until: dict[str, float] = {}
        try:
            with self.engine.begin() as conn:
                for flight, res in batch:
                    cond = [
                        L.c.id == flight.line_id,
                        L.c.status == RUNNING,
                        L.c.request_id == flight.request_id,
                    ]
                    payload = {
                        "status_code": res.status_code,
                        "request_id": res.request_id,
                        "body": res.body,
                    }
                    if res.transient and flight.attempt < self.cfg.max_attempts:
                        conn.execute(
                            sa.update(L)
                            .where(*cond)
                            .values(status=PENDING, updated_at=sa.func.now())
                        )
                        self.stats["retried"] += 1
                        if res.retry_after_s:
                            retry_until[flight.batch_id] = max(
                                retry_until.get(flight.batch_id, 0.0),
                                time.monotonic() + min(res.retry_after_s, 60.0),
                            )
                        continue
                    status = COMPLETED if res.ok else FAILED
                    n = conn.execute(
                        sa.update(L)
                        .where(*cond)
                        .values(status=status, result=payload, updated_at=sa.func.now())
                    ).rowcount
                    if n:
                        c = counts.setdefault(flight.batch_id, [0, 0])
                        c[0 if res.ok else 1] += 1
                for bid, (ok, bad) in counts.items():
                    conn.execute(
                        sa.update(B)
                        .where(B.c.id == bid)
                        .values(
                            completed_count=B.c.completed_count + ok,
                            failed_count=B.c.failed_count + bad,
                        )
                    )
        except Exception:
            with self._lock:  # keep them for the next flush
                self._done.extendleft(reversed(batch))
            raise
        with self._lock:
            for flight, _ in batch:
                self._flights.pop(flight.line_id, None)
        for bid, until in retry_until.items():
            self._deferred[bid] = max(self._deferred.get(bid, 0.0), until)
        for ok, bad in counts.values():
            self.stats["completed"] += ok
            self.stats["failed"] += bad
        return len(batch)

    # ---- housekeeping ------------------------------------------------------------------
    def revalidate_stuck(self) -> int:
        cutoff = utcnow() - timedelta(seconds=self.cfg.stuck_s)
        with self.engine.connect() as conn:
            ids = [
                r
                for (r,) in conn.execute(
                    sa.select(B.c.id).where(
                        B.c.status == BatchStatus.VALIDATING, B.c.created_at < cutoff
                    )
                )
            ]
        for bid in ids:
            log.info("re-validating batch %s left in 'validating'", bid)
            validate_batch(self.engine, self.files, bid)
        return len(ids)

    def reap(self) -> int:
        """Lines whose runner stopped renewing their lease: run again, or fail after N tries."""
        active = (
            sa.select(B.c.id)
            .where(B.c.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING]))
            .scalar_subquery()
        )
        with self._lock:
            mine = list(self._flights)
        stale = [
            L.c.batch_id.in_(active),
            L.c.status == RUNNING,
            L.c.updated_at < sa.func.now() - timedelta(seconds=self.cfg.lease_s),
        ]
        if mine:
            stale.append(L.c.id.not_in(mine))
        exhausted = (
            sa.cast(sa.func.split_part(L.c.request_id, ":", 1), sa.Integer) >= self.cfg.max_attempts
        )
        with self.engine.begin() as conn:
            failed = conn.execute(
                sa.update(L)
                .where(*stale, exhausted)
                .values(
                    status=FAILED,
                    updated_at=sa.func.now(),
                    error=_error(
                        "too_many_attempts",
                        f"the line was started {self.cfg.max_attempts} "
                        "times and its worker was lost each time",
                    ),
                )
                .returning(L.c.batch_id)
            ).all()
            back = conn.execute(
                sa.update(L)
                .where(*stale)
                .values(status=PENDING, updated_at=sa.func.now())
                .returning(L.c.id)
            ).all()
            per: dict[str, int] = {}
            for (bid,) in failed:
                per[bid] = per.get(bid, 0) + 1
            for bid, n in per.items():
                conn.execute(
                    sa.update(B).where(B.c.id == bid).values(failed_count=B.c.failed_count + n)
                )
        n = len(failed) + len(back)
        if n:
            log.warning(
                "reaped %d batch lines whose lease lapsed (%d failed for good)", n, len(failed)
            )
            self.stats["reaped"] += n
        return n

    def wind_down(self) -> int:
        """Cancelled and expired batches: their pending lines end with an error
        line; how many lines."""
        with self.engine.begin() as conn:
            cancelled = conn.execute(
                sa.update(L)
                .where(
                    L.c.status == PENDING,
                    L.c.batch_id.in_(
                        sa.select(B.c.id)
                        .where(B.c.status == BatchStatus.CANCELLING)
                        .scalar_subquery()
                    ),
                )
                .values(
                    status=CANCELLED,
                    updated_at=sa.func.now(),
                    error=_error(
                        "batch_cancelled", "the batch was cancelled before this request ran"
                    ),
                )
            )
            expired = conn.execute(
                sa.update(L)
                .where(
                    L.c.status == PENDING,
                    L.c.batch_id.in_(
                        sa.select(B.c.id)
                        .where(
                            B.c.status == BatchStatus.IN_PROGRESS, B.c.expires_at <= sa.func.now()
                        )
                        .scalar_subquery()
                    ),
                )
                .values(
                    status=CANCELLED,
                    updated_at=sa.func.now(),
                    error=_error(
                        "batch_expired",
                        "the batch's completion window ended before this request ran",
                    ),
                )
            )
        return int(cancelled.rowcount or 0) + int(expired.rowcount or 0)

    def finalize_ready(self) -> int:
        unfinished = sa.exists().where(L.c.batch_id == B.c.id, L.c.status.in_([PENDING, RUNNING]))
        stuck = utcnow() - timedelta(seconds=self.cfg.stuck_s)
        with self.engine.connect() as conn:
            ids = [
                r
                for (r,) in conn.execute(
                    sa.select(B.c.id).where(
                        sa.or_(
                            sa.and_(
                                B.c.status.in_([BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING]),
                                ~unfinished,
                            ),
                            sa.and_(
                                B.c.status == BatchStatus.FINALIZING, B.c.finalizing_at < stuck
                            ),
                        )
                    )
                )
            ]
        done = 0
        for bid in ids:
            if self.finalize(bid):
                done += 1
        return done

    def finalize(self, batch_id: str) -> bool:
        with self.engine.begin() as conn:
            b = conn.execute(sa.select(B).where(B.c.id == batch_id).with_for_update()).one()
            status = BatchStatus(b.status)
            if status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
                left = conn.execute(
                    sa.select(sa.func.count()).where(
                        L.c.batch_id == batch_id, L.c.status.in_([PENDING, RUNNING])
                    )
                ).scalar_one()
                if left:
                    return False
                conn.execute(
                    sa.update(B)
                    .where(B.c.id == batch_id)
                    .values(status=BatchStatus.FINALIZING, finalizing_at=utcnow())
                )
            elif status != BatchStatus.FINALIZING:
                return False
        # outside the row lock: writing files may take a while for 50,000 lines
        n_out, n_err, expired = self._write_outputs(b.id, b.tenant_id)
        for n, fid in ((n_out, _output_id(batch_id)), (n_err, _error_id(batch_id))):
            if n == 0:  # like OpenAI: no file when there is nothing in it
                self.files.delete(b.tenant_id, fid)
        if b.cancelled_at is not None:
            final = BatchStatus.CANCELLED
        elif expired:
            final = BatchStatus.EXPIRED
        else:
            final = BatchStatus.COMPLETED
        with self.engine.begin() as conn:
            conn.execute(
                sa.update(B)
                .where(B.c.id == batch_id, B.c.status == BatchStatus.FINALIZING)
                .values(
                    status=final,
                    completed_at=utcnow(),
                    output_file_id=_output_id(batch_id) if n_out else None,
                    error_file_id=_error_id(batch_id) if n_err else None,
                )
            )
        self.stats["finalized"] += 1
        log.info(
            "batch %s %s: %d output lines, %d error lines", batch_id, final.value, n_out, n_err
        )
        return True

    def _write_outputs(self, batch_id: str, tenant_id: str) -> tuple[int, int, bool]:
        counts = {"out": 0, "err": 0, "expired": 0}

        def records(want_ok: bool) -> Iterator[bytes]:
            with self.engine.connect() as conn:
                result = conn.execution_options(stream_results=True, yield_per=1000).execute(
                    sa.select(L.c.id, L.c.custom_id, L.c.status, L.c.result, L.c.error)
                    .where(
                        L.c.batch_id == batch_id,
                        (L.c.status == COMPLETED) if want_ok else (L.c.status != COMPLETED),
                    )
                    .order_by(L.c.line_no)
                )
                for row in result:
                    st = BatchLineStatus(row.status)
                    if want_ok:
                        counts["out"] += 1
                    else:
                        counts["err"] += 1
                        if row.error and row.error.get("code") == "batch_expired":
                            counts["expired"] += 1
                    rec = output_record(row.id, row.custom_id, st, row.result, row.error)
                    yield (json.dumps(rec, separators=(",", ":")) + "\n").encode()

        self.files.write_generated(
            tenant_id,
            _output_id(batch_id),
            "batch_output",
            f"{batch_id}_output.jsonl",
            records(True),
        )
        self.files.write_generated(
            tenant_id,
            _error_id(batch_id),
            "batch_output",
            f"{batch_id}_error.jsonl",
            records(False),
        )
        return counts["out"], counts["err"], counts["expired"] > 0


def _output_id(batch_id: str) -> str:
    return "file-" + batch_id.removeprefix("batch_") + "-output"


def _error_id(batch_id: str) -> str:
    return "file-" + batch_id.removeprefix("batch_") + "-errors"
