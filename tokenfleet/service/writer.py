"""Batching, loss-free writer for the ``requests`` ledger.

The token path calls :meth:`LedgerWriter.record`, which only appends to an
in-memory deque (no I/O in the common case). A background thread flushes
batches of up to ``batch_size`` rows, or whatever is there every
``flush_interval_s``, as ``INSERT .. ON CONFLICT (request_id) DO UPDATE``
(on PostgreSQL over the thread's own autocommit psycopg connection, a row
per statement in one pipeline; elsewhere through SQLAlchemy, one transaction).

Delivery is at-least-once and the upsert is idempotent, which together give
exactly one row per ``request_id``:

* database down (connection refused, restart, failover): the batch that
  failed and every row waiting in memory go to a spill file, and so does
  every new row until a write succeeds again (a process that dies during
  the outage loses nothing); the thread retries with exponential backoff by
  replaying the spill files;
* spill files are bounded (``max_spill_bytes`` over the whole spill dir):
  beyond it a row is dropped, counted (``stats.dropped``) and logged, so an
  outage cannot fill the disk;
* queue full (``max_buffer_rows``): new rows are appended to a spill file
  ``<data_dir>/spill/ledger-<pid>-<n>.jsonl.part``; once the database answers
  again the thread replays spill files, its own and those left behind by
  processes that died or closed while the database was down;
* ``close()`` that cannot drain in time spills the rest, so a later writer
  on the same data dir finishes the job;
* a row the database rejects as data (constraint, bad value) is isolated by
  bisection and written to ``rejected-*.jsonl`` with the error instead of
  blocking the rows behind it.

Process model: a writer owns a thread and a connection pool, neither of
which survives ``fork()``. Celery prefork workers must create their writer
after the fork (``worker_process_init``) and close it on
``worker_process_shutdown``; one writer per process, shared by all threads.

Merge rule when a ``request_id`` is seen again (retry, replay, a second
writer, lifecycle update): the status of higher precedence wins
(:data:`STATUS_PRECEDENCE`: a served answer over a cancel over a failure over
a refusal over ``in_flight`` over a ``duplicate`` delivery; equal ranks: the
later write). The winning row's status and token counts are taken whole, its
other non-NULL columns overwrite the stored ones, and the losing row only
fills columns still NULL; ``attempts`` keeps the maximum. Several writers may
therefore record the same end (worker, API, reconciler) in any order and the
row converges to one final state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.service.ledger import RequestRow, RequestStatus, utcnow

log = logging.getLogger(__name__)

TIMESTAMP_FIELDS = ("arrival_ts", "admitted_ts", "dispatched_ts", "first_token_ts", "finished_ts")
NON_FINAL = frozenset({RequestStatus.IN_FLIGHT.value, RequestStatus.DUPLICATE.value})

#: which status wins when two rows of one request meet (higher wins; ties: the
#: later write). Tokens the engine produced outrank every verdict reached
#: without them (a reconciler's "failed" must not erase a late spilled
#: "completed"); a client's cancel outranks a failure seen after it left.
STATUS_PRECEDENCE: dict[str, int] = {
    RequestStatus.DUPLICATE.value: 0,
    RequestStatus.IN_FLIGHT.value: 1,
    RequestStatus.REJECTED.value: 2,
    RequestStatus.FAILED.value: 3,
    RequestStatus.TIMED_OUT.value: 3,
    RequestStatus.CANCELLED.value: 4,
    RequestStatus.SLO_MISSED.value: 5,
    RequestStatus.COMPLETED.value: 5,
}
#: columns the winning row takes whole (a 0 token count is a real value)
_WINNER_COLUMNS = ("status", "prompt_tokens", "cached_tokens", "completion_tokens")


@dataclass(slots=True)
class RequestRecord:
    """One ledger row as the token path produces it.

    Timestamps may be ``datetime`` (naive = UTC) or Unix epoch seconds as float.
    """

    request_id: str
    tenant_id: str
    tier: str
    model: str
    status: RequestStatus | str
    arrival_ts: datetime | float
    model_version: str | None = None
    dc: str | None = None
    instance: str | None = None
    admitted_ts: datetime | float | None = None
    dispatched_ts: datetime | float | None = None
    first_token_ts: datetime | float | None = None
    finished_ts: datetime | float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    attempts: int = 1
    error: str | None = None


RECORD_FIELDS = tuple(f.name for f in dataclasses.fields(RequestRecord))


def _to_datetime(value: datetime | float | int | str | None) -> datetime | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    if isinstance(value, str):
        return _to_datetime(datetime.fromisoformat(value))
    return datetime.fromtimestamp(float(value), tz=UTC)


def normalize_row(row: RequestRecord | Mapping[str, Any]) -> dict[str, Any]:
    """Validate and convert a record into column values; raises ValueError on bad input."""
    if isinstance(row, RequestRecord):
        data = {name: getattr(row, name) for name in RECORD_FIELDS}
    else:
        data = dict(row)
    unknown = set(data) - set(RECORD_FIELDS)
    if unknown:
        raise ValueError(
            f"unknown ledger fields {sorted(unknown)}; valid: {', '.join(RECORD_FIELDS)}"
        )
    for required in ("request_id", "tenant_id", "tier", "model", "status", "arrival_ts"):
        if data.get(required) in (None, ""):
            raise ValueError(f"ledger row needs '{required}'")
    out: dict[str, Any] = {name: data.get(name) for name in RECORD_FIELDS}
    out["request_id"] = str(out["request_id"])
    out["status"] = RequestStatus(out["status"]).value  # ValueError names the bad status
    for name in TIMESTAMP_FIELDS:
        out[name] = _to_datetime(out[name])
    for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        out[name] = int(out[name] or 0)
    out["attempts"] = int(out["attempts"] or 1)
    return out


def merge_rows(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The upsert's merge rule in Python, for two rows of one request_id in one batch."""
    wins = STATUS_PRECEDENCE[new["status"]] >= STATUS_PRECEDENCE[old["status"]]
    merged = dict(old)
    for key, value in new.items():
        if key == "attempts":
            merged[key] = max(old.get(key) or 1, value or 1)
        elif key in _WINNER_COLUMNS:
            if wins:
                merged[key] = value
        elif value is not None and (wins or old.get(key) is None):
            merged[key] = value
    return merged


def _json_default(value: object) -> object:
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"not JSON serialisable: {value!r}")


def _row_from_json(line: str) -> dict[str, Any]:
    data = json.loads(line)
    for name in TIMESTAMP_FIELDS:
        data[name] = _to_datetime(data.get(name))
    return data  # type: ignore[no-any-return]


@dataclass
class WriterStats:
    recorded: int = 0
    written: int = 0  # rows sent in successful upserts (replays count again)
    batches: int = 0
    failures: int = 0  # failed flush attempts (database unreachable etc.)
    spilled: int = 0
    replayed: int = 0
    rejected: int = 0  # rows the database refused as data; see rejected-*.jsonl
    dropped: int = 0  # rows that did not fit under max_spill_bytes (lost)
    merged_in_batch: int = 0  # same request_id twice within one batch
    last_error: str | None = None
    healthy: bool = True
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)


_TRANSIENT = (
    sa.exc.OperationalError,
    sa.exc.InterfaceError,
    sa.exc.TimeoutError,
    sa.exc.ProgrammingError,
    sa.exc.DisconnectionError,
    # the PostgreSQL path's own connection (:meth:`LedgerWriter._upsert_pg`)
    psycopg.OperationalError,
    psycopg.InterfaceError,
    psycopg.ProgrammingError,
)
_ROW_ERRORS = (sa.exc.IntegrityError, sa.exc.DataError, psycopg.IntegrityError, psycopg.DataError)


class _SpillReplay:
    """A claimed spill file being fed back into the database in chunks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fh = open(path, encoding="utf-8")  # noqa: SIM115 - read in chunks, closed by close()

    def chunk(self, size: int) -> list[dict[str, Any]]:
        rows = []
        for line in itertools.islice(self.fh, size):
            line = line.strip()
            if line:
                with contextlib.suppress(ValueError):
                    rows.append(_row_from_json(line))
        return rows

    def close(self) -> None:
        self.fh.close()


class LedgerWriter:
    """Non-blocking ``record()``; batched, retried, spilled, idempotent writes.

    ``engine`` may be an Engine (shared, not disposed) or a URL (owned).
    """

    def __init__(
        self,
        engine: Engine | str,
        *,
        spill_dir: str | Path,
        batch_size: int = 500,
        flush_interval_s: float = 0.25,
        max_buffer_rows: int = 100_000,
        retry_initial_s: float = 0.05,
        retry_max_s: float = 5.0,
        spill_scan_interval_s: float = 5.0,
        max_spill_bytes: int = 1 << 30,
        name: str = "ledger-writer",
    ) -> None:
        from tokenfleet.service.db import make_engine

        self._owns_engine = isinstance(engine, str)
        self.engine: Engine = make_engine(engine) if isinstance(engine, str) else engine
        self.spill_dir = Path(spill_dir).expanduser().resolve()
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_buffer_rows = max_buffer_rows
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.spill_scan_interval_s = spill_scan_interval_s
        self.max_spill_bytes = max_spill_bytes
        self._spill_dir_bytes = 0  # size of the spill dir as last measured, plus writes since
        self._spill_dir_measured_at = float("-inf")
        self.stats = WriterStats()

        self._cond = threading.Condition()
        self._buf: deque[dict[str, Any]] = deque()
        self._oldest_at: float | None = None
        self._inflight: list[dict[str, Any]] = []
        self._inflight_from_spill = False
        self._flush_requested = False
        self._stopping = False
        self._spill_fh: Any = None
        self._spill_path: Path | None = None
        self._spill_rows_open = 0
        self._spill_seq = itertools.count()
        self._replay: _SpillReplay | None = None
        self._next_spill_scan = 0.0  # scan at start: pick up leftovers of earlier runs
        self._closed = False
        #: the writer thread's own PostgreSQL connection (:meth:`_upsert_pg`)
        self._pg: psycopg.Connection[Any] | None = None
        self._pg_direct = self.engine.dialect.name == "postgresql" and (
            self.engine.dialect.driver == "psycopg"
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: Any, database_url: str) -> LedgerWriter:
        """A writer with the ledger_* settings of a ServiceConfig."""
        return cls(
            database_url,
            spill_dir=config.resolved_data_dir() / "spill",
            batch_size=config.ledger_batch_size,
            flush_interval_s=config.ledger_flush_interval_s,
            max_buffer_rows=config.ledger_max_buffer_rows,
            retry_max_s=config.ledger_retry_max_s,
        )

    # ---- producer side ------------------------------------------------------
    def record(self, row: RequestRecord | Mapping[str, Any]) -> None:
        """Queue one row; never blocks on the database. Raises ValueError for a malformed row."""
        data = normalize_row(row)
        with self._cond:
            if self._closed:
                raise RuntimeError("LedgerWriter is closed; create a new one")
            self.stats.recorded += 1
            if len(self._buf) >= self.max_buffer_rows or not self.stats.healthy:
                # full, or the database is away: straight to disk
                self._spill_locked([data])
                return
            self._buf.append(data)
            if self._oldest_at is None:
                self._oldest_at = time.monotonic()
            if len(self._buf) >= self.batch_size:
                self._cond.notify_all()

    def record_many(self, rows: Iterable[RequestRecord | Mapping[str, Any]]) -> None:
        for row in rows:
            self.record(row)

    def pending(self) -> int:
        """Rows not yet confirmed written, counting this process's spill only."""
        with self._cond:
            return self._pending_locked()

    def pending_now(self) -> int | None:
        """:meth:`pending`, or None if the writer holds its lock right now (for
        a caller that must not wait: the server's own ``/health`` answer)."""
        if not self._cond.acquire(blocking=False):
            return None
        try:
            return self._pending_locked()
        finally:
            self._cond.release()

    def _pending_locked(self) -> int:
        spilled = max(0, self.stats.spilled - self.stats.replayed)
        # a batch replayed from a spill file is counted there until it is written
        inflight = 0 if self._inflight_from_spill else len(self._inflight)
        return len(self._buf) + inflight + spilled

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Write everything queued and every spill file now; True if fully drained in time."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._flush_requested = True
            self._next_spill_scan = 0.0
            self._cond.notify_all()
            while not self._drained_locked():
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                if not self._thread.is_alive():
                    return False
                self._cond.wait(0.05 if remaining is None else min(0.05, remaining))
                self._flush_requested = True
            return True

    def close(self, timeout: float | None = 10.0) -> bool:
        """Flush, stop the thread; spill what could not be written. True if nothing was spilled."""
        if self._closed:
            return True
        drained = self.flush(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=10.0)
        with self._cond:
            self._closed = True
            leftovers = list(self._inflight) + list(self._buf)
            self._buf.clear()
            self._inflight = []
            if leftovers:
                log.warning(
                    "ledger writer closing with %d unwritten rows; spilled to %s",
                    len(leftovers),
                    self.spill_dir,
                )
                self._spill_locked(leftovers)
            self._rotate_spill_locked()
            if self._replay is not None:
                self._release_replay_locked()
        if self._owns_engine:
            self.engine.dispose()
        return drained and not leftovers

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- spill files ------------------------------------------------------------
    def _spill_budget_locked(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit under ``max_spill_bytes`` (the dir's size is
        re-measured at most once a second: other processes spill there too)."""
        now = time.monotonic()
        if now - self._spill_dir_measured_at > 1.0:
            total = 0
            for path in self.spill_dir.glob("ledger-*"):
                with contextlib.suppress(OSError):
                    total += path.stat().st_size
            self._spill_dir_bytes = total
            self._spill_dir_measured_at = now
        if self._spill_dir_bytes + nbytes > self.max_spill_bytes:
            return False
        self._spill_dir_bytes += nbytes
        return True

    def _spill_locked(self, rows: list[dict[str, Any]]) -> None:
        lines = [json.dumps(row, default=_json_default) + "\n" for row in rows]
        size = sum(len(line) for line in lines)
        if not self._spill_budget_locked(size):
            self.stats.dropped += len(rows)
            log.error(
                "ledger spill dir %s is over %d bytes: %d rows dropped (%d in all)",
                self.spill_dir,
                self.max_spill_bytes,
                len(rows),
                self.stats.dropped,
            )
            return
        if self._spill_fh is None:
            self._spill_path = (
                self.spill_dir
                / f"ledger-{os.getpid()}-{next(self._spill_seq)}-{time.time_ns()}.jsonl.part"
            )
            self._spill_fh = open(self._spill_path, "a", encoding="utf-8")  # noqa: SIM115 - kept open across batches
        self._spill_fh.writelines(lines)
        self._spill_fh.flush()
        self._spill_rows_open += len(rows)
        self.stats.spilled += len(rows)

    def _rotate_spill_locked(self) -> None:
        """Close the open spill file and make it replayable (.jsonl)."""
        if self._spill_fh is None or self._spill_path is None:
            return
        self._spill_fh.close()
        self._spill_path.rename(self._spill_path.with_suffix(""))  # drop ".part"
        self._spill_fh = None
        self._spill_path = None
        self._spill_rows_open = 0

    def _claimable(self) -> list[Path]:
        """Replayable files: finished .jsonl, plus .part/.claimed of processes that are gone."""
        from tokenfleet.service.embedded import pid_alive

        out = []
        for path in sorted(self.spill_dir.glob("ledger-*")):
            name = path.name
            if name.endswith(".jsonl"):
                out.append(path)
                continue
            try:
                pid = (
                    int(name.split("-")[1])
                    if name.endswith(".part")
                    else int(name.rsplit(".claimed-", 1)[1])
                )
            except (IndexError, ValueError):
                continue
            if pid != os.getpid() and not pid_alive(pid):
                out.append(path)
        return out

    def _claim_next(self) -> _SpillReplay | None:
        for path in self._claimable():
            base = path.name.split(".jsonl")[0]
            claimed = self.spill_dir / f"{base}.jsonl.claimed-{os.getpid()}"
            try:
                path.rename(claimed)  # atomic: exactly one process wins a file
            except FileNotFoundError:
                continue
            return _SpillReplay(claimed)
        return None

    def _release_replay_locked(self) -> None:
        assert self._replay is not None
        self._replay.close()
        base = self._replay.path.name.split(".jsonl")[0]
        with contextlib.suppress(FileNotFoundError):
            self._replay.path.rename(self.spill_dir / f"{base}.jsonl")
        self._replay = None

    def _spill_outstanding_locked(self) -> bool:
        if self._spill_rows_open or self._replay is not None:
            return True
        return bool(self._claimable())

    def _drained_locked(self) -> bool:
        return not self._buf and not self._inflight and not self._spill_outstanding_locked()

    # ---- consumer thread ----------------------------------------------------
    def _take_batch_locked(self) -> tuple[list[dict[str, Any]], bool] | None:
        """Next batch and whether it came from a spill file; None means exit."""
        while True:
            now = time.monotonic()
            if self._buf:
                due = (
                    len(self._buf) >= self.batch_size
                    or self._flush_requested
                    or self._stopping
                    or (
                        self._oldest_at is not None
                        and now - self._oldest_at >= self.flush_interval_s
                    )
                )
                if due:
                    n = min(self.batch_size, len(self._buf))
                    batch = [self._buf.popleft() for _ in range(n)]
                    self._oldest_at = now if self._buf else None
                    return batch, False
            elif self._stopping:
                return None
            # memory is not due: feed spill files back (failures back off like any batch)
            if len(self._buf) < self.batch_size:
                want_scan = self._flush_requested or now >= self._next_spill_scan
                if self._replay is None and (self._spill_rows_open or want_scan):
                    self._rotate_spill_locked()
                    self._replay = self._claim_next()
                    self._next_spill_scan = now + self.spill_scan_interval_s
                if self._replay is not None:
                    rows = self._replay.chunk(self.batch_size)
                    if rows:
                        return rows, True
                    self._replay.close()
                    self._replay.path.unlink(missing_ok=True)
                    self._replay = None
                    self._cond.notify_all()
                    continue
            if self._flush_requested and self._drained_locked():
                self._flush_requested = False
                self._cond.notify_all()
            wait = self.flush_interval_s
            if self._oldest_at is not None:
                wait = max(0.0, self._oldest_at + self.flush_interval_s - now)
            self._cond.wait(min(wait, self.spill_scan_interval_s) or 0.001)

    def _run(self) -> None:
        try:
            self._run_batches()
        finally:
            self._close_pg()

    def _run_batches(self) -> None:
        backoff = 0.0
        while True:
            with self._cond:
                taken = self._take_batch_locked()
                if taken is None:
                    return
                batch, from_spill = taken
                self._inflight = batch
                self._inflight_from_spill = from_spill
            try:
                self._write_with_isolation(batch)
            except _TRANSIENT as exc:
                backoff = min(max(backoff * 2, self.retry_initial_s), self.retry_max_s)
                with self._cond:
                    self._inflight = []
                    self.stats.failures += 1
                    self.stats.healthy = False
                    self.stats.last_error = str(getattr(exc, "orig", exc)).strip()[:500]
                    if from_spill:
                        self._release_replay_locked()
                    else:
                        # durable while the database is away (see the module doc)
                        self._spill_locked(batch + list(self._buf))
                        self._buf.clear()
                        self._oldest_at = None
                    log.warning(
                        "ledger flush failed (%s); retrying in %.2fs",
                        self.stats.last_error.splitlines()[0] if self.stats.last_error else exc,
                        backoff,
                    )
                    if not self._stopping:
                        self._cond.wait(backoff)
                    else:
                        return  # close() spills what is left
                continue
            except Exception:  # noqa: BLE001 - never let the thread die with rows in hand
                log.error(
                    "unexpected ledger writer error; rows kept for retry: %s",
                    str(sys.exc_info()[1])[:500],
                )
                with self._cond:
                    self._inflight = []
                    if from_spill:
                        self._release_replay_locked()
                    else:
                        self._buf.extendleft(reversed(batch))
                    if self._stopping:
                        return
                    self._cond.wait(self.retry_max_s)
                continue
            backoff = 0.0
            with self._cond:
                self._inflight = []
                self.stats.healthy = True
                self.stats.batches += 1
                self.stats.written += len(batch)
                if from_spill:
                    self.stats.replayed += len(batch)
                self._cond.notify_all()

    # ---- database -----------------------------------------------------------
    def _write_with_isolation(self, batch: list[dict[str, Any]]) -> None:
        """Upsert; on a data error, bisect to dead-letter only the bad rows."""
        try:
            self._upsert(batch)
        except _ROW_ERRORS as exc:
            if len(batch) == 1:
                self._dead_letter(batch[0], exc)
                return
            mid = len(batch) // 2
            self._write_with_isolation(batch[:mid])
            self._write_with_isolation(batch[mid:])

    def _dead_letter(self, row: Mapping[str, Any], exc: Exception) -> None:
        path = self.spill_dir / f"rejected-{os.getpid()}.jsonl"
        entry = {"row": row, "error": str(getattr(exc, "orig", exc)).strip()[:1000]}
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, default=_json_default) + "\n")
        with self.stats._lock:
            self.stats.rejected += 1
        log.error(
            "ledger row %s rejected by the database: %s (kept in %s)",
            row.get("request_id"),
            entry["error"],
            path,
        )

    def _upsert(self, batch: list[dict[str, Any]]) -> None:
        merged: dict[str, dict[str, Any]] = {}
        for row in batch:
            rid = row["request_id"]
            if rid in merged:
                merged[rid] = merge_rows(merged[rid], row)
                self.stats.merged_in_batch += 1
            else:
                merged[rid] = row
        now = utcnow()
        # in request-id order: PostgreSQL locks each row as it upserts it, and
        # two writers (the API and a worker) taking the same rows in their own
        # orders deadlocked; one order for everyone cannot
        values = [{**merged[rid], "updated_at": now} for rid in sorted(merged)]
        if self._pg_direct:
            self._upsert_pg(values)
            return
        with self.engine.begin() as conn:
            conn.execute(upsert_statement(conn.dialect.name), values)

    def _upsert_pg(self, values: list[dict[str, Any]]) -> None:
        """The upsert on the thread's own psycopg connection, in autocommit.

        Why not the engine: a flush of one row cost 0.42-0.45 ms of CPU
        through SQLAlchemy (pool checkout with its ping, the compiled-statement
        lookup, bind processing, BEGIN and COMMIT) and 0.13 ms here, two rows
        0.46-0.52 against 0.19 (``benchmarks/store_writes.py``;
        docs/benchmarks.md, section 32). The API flushes every 0.25 s, one or
        two rows at a time at a few requests a second. Each row commits on
        its own: the upsert is idempotent and delivery at-least-once anyway,
        a failed batch is retried or bisected whole, and no transaction holds
        one row's lock while it waits for another's (what ordering the rows
        guards against when a batch is one transaction)."""
        conn = self._pg
        if conn is None or conn.closed:
            url = self.engine.url.set(drivername="postgresql")
            conn = self._pg = psycopg.connect(
                url.render_as_string(hide_password=False),
                autocommit=True,
                connect_timeout=3,
                application_name="tokenfleet-ledger",
            )
        params = [{name: row.get(name) for name in _PG_COLUMNS} for row in values]
        try:
            if len(params) == 1:
                conn.execute(pg_upsert_sql(), params[0])
            else:
                with conn.cursor() as cur:
                    cur.executemany(pg_upsert_sql(), params)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            self._close_pg()  # a new connection for the retry
            raise

    def _close_pg(self) -> None:
        conn, self._pg = self._pg, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()


_PG_COLUMNS = (*RECORD_FIELDS, "updated_at")


@functools.cache
def pg_upsert_sql() -> str:
    """:func:`upsert_statement` as psycopg's SQL text, every column bound by name."""
    from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

    compiled = upsert_statement("postgresql").compile(
        dialect=pg_psycopg.dialect(),  # type: ignore[no-untyped-call]
        column_keys=list(_PG_COLUMNS),
    )
    return str(compiled)


@functools.cache
def upsert_statement(dialect: str) -> Any:
    """``INSERT .. ON CONFLICT (request_id) DO UPDATE`` implementing :func:`merge_rows`.

    Built once per dialect: SQLAlchemy caches the compiled form by the
    statement's structure, but a new statement object has to be walked to
    find that cache key, which cost more than the flush itself."""
    table: sa.Table = RequestRow.__table__  # type: ignore[assignment]
    insert: Any
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:
        raise NotImplementedError(f"ledger upsert not implemented for {dialect}; use PostgreSQL")
    stmt = insert(table)
    ex = stmt.excluded
    cur = table.c

    def rank(col: Any) -> Any:
        # constants inlined: one compiled statement for every executemany batch
        return sa.case(
            *(
                (col == sa.literal_column(f"'{k}'"), sa.literal_column(str(v)))
                for k, v in STATUS_PRECEDENCE.items()
            ),
            else_=sa.literal_column("0"),
        )

    wins = rank(ex.status) >= rank(cur.status)
    greatest = sa.func.greatest if dialect == "postgresql" else sa.func.max
    update: dict[str, Any] = {}
    for name in RECORD_FIELDS:
        if name == "request_id":
            continue
        if name == "attempts":
            update[name] = greatest(cur.attempts, ex.attempts)
        elif name in _WINNER_COLUMNS:
            update[name] = sa.case((wins, ex[name]), else_=cur[name])
        else:
            update[name] = sa.case(
                (wins, sa.func.coalesce(ex[name], cur[name])),
                else_=sa.func.coalesce(cur[name], ex[name]),
            )
    update["updated_at"] = ex.updated_at
    return stmt.on_conflict_do_update(index_elements=[cur.request_id], set_=update)
