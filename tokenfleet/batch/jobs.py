"""Batch jobs: create (validate + store every line durably), read, list, cancel.

State machine (OpenAI Batch API)::

    validating -> in_progress -> finalizing -> completed
    validating -> failed                        (bad input: error names the line)
    in_progress -> cancelling -> (finalizing) -> cancelled
    in_progress -> (finalizing) -> expired      (24 h window passed)

Creation validates the whole input file and inserts every line into
``batch_lines`` in one transaction with the switch to ``in_progress``, so a
crash leaves either no lines (the batch is re-validated by the runner) or all
of them. All reads are filtered by tenant: another tenant's batch is a 404.

Column mapping for the few OpenAI timestamps the ledger has no column for:
``cancelling_at`` is stored in ``cancelled_at`` while cancelling, and the
final ``cancelled_at`` / ``expired_at`` in ``completed_at``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from tokenfleet.batch.files import FileStore
from tokenfleet.batch.validate import SUPPORTED_ENDPOINTS, BatchInputError, iter_input_lines
from tokenfleet.errors import TokenFleetError
from tokenfleet.service.db import session_scope
from tokenfleet.service.ledger import Batch, BatchLine, BatchLineStatus, BatchStatus, utcnow

COMPLETION_WINDOWS = {"24h": timedelta(hours=24)}
INSERT_CHUNK_LINES = 2000
ACTIVE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.CANCELLING,
)
TERMINAL = (BatchStatus.COMPLETED, BatchStatus.FAILED, BatchStatus.EXPIRED, BatchStatus.CANCELLED)


class BatchRequestError(TokenFleetError):
    """A create/cancel request the API answers with 4xx (not a failed batch)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


@dataclass(frozen=True, slots=True)
class Owner:
    """Who is creating a batch: the tenant and what it may use."""

    tenant_id: str
    allowed_models: tuple[str, ...] = ()


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex


def _ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_object(b: Batch) -> dict[str, Any]:
    status = BatchStatus(b.status)
    cancelling_at = (
        b.cancelled_at if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED) else None
    )
    return {
        "id": b.id,
        "object": "batch",
        "endpoint": b.endpoint,
        "errors": b.errors,
        "input_file_id": b.input_file_id,
        "completion_window": b.completion_window,
        "status": status.value,
        "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id,
        "created_at": _ts(b.created_at),
        "in_progress_at": _ts(b.in_progress_at),
        "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at),
        "completed_at": _ts(b.completed_at) if status == BatchStatus.COMPLETED else None,
        "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.completed_at) if status == BatchStatus.EXPIRED else None,
        "cancelling_at": _ts(cancelling_at),
        "cancelled_at": _ts(b.completed_at) if status == BatchStatus.CANCELLED else None,
        "request_counts": {
            "total": int(b.total_count),
            "completed": int(b.completed_count),
            "failed": int(b.failed_count),
        },
        "metadata": b.batch_metadata,
    }


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if (
        not isinstance(metadata, dict)
        or len(metadata) > 16
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
            for k, v in metadata.items()
        )
    ):
        raise BatchRequestError(
            400,
            "metadata must be an object of at most 16 string pairs "
            "(keys up to 64, values up to 512 characters)",
            param="metadata",
        )
    return dict(metadata)


def create_batch(
    engine: Engine,
    files: FileStore,
    owner: Owner,
    *,
    input_file_id: Any,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
) -> Batch:
    """Create a batch and validate its input; returns it ``in_progress`` or ``failed``."""
    if not isinstance(input_file_id, str) or not input_file_id:
        raise BatchRequestError(400, "input_file_id is required", param="input_file_id")
    if endpoint not in SUPPORTED_ENDPOINTS:
        raise BatchRequestError(
            400,
            f"endpoint must be one of {', '.join(SUPPORTED_ENDPOINTS)}",
            param="endpoint",
            code="invalid_endpoint",
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise BatchRequestError(400, "completion_window must be '24h'", param="completion_window")
    meta = _check_metadata(metadata)
    f = files.get(owner.tenant_id, input_file_id)
    if f is None:
        raise BatchRequestError(
            404,
            f"No such File object: {input_file_id}",
            param="input_file_id",
            code="file_not_found",
        )
    if f.purpose != "batch":
        raise BatchRequestError(
            400,
            f"file {input_file_id} has purpose '{f.purpose}'; upload "
            "the input with purpose 'batch'",
            param="input_file_id",
        )
    now = utcnow()
    bid = new_batch_id()
    with session_scope(engine) as session:
        session.add(
            Batch(
                id=bid,
                tenant_id=owner.tenant_id,
                endpoint=endpoint,
                completion_window=completion_window,
                status=BatchStatus.VALIDATING,
                input_file_id=input_file_id,
                batch_metadata=meta,
                created_at=now,
                expires_at=now + COMPLETION_WINDOWS[completion_window],
            )
        )
    return validate_batch(engine, files, bid, allowed_models=owner.allowed_models)


def validate_batch(
    engine: Engine, files: FileStore, batch_id: str, *, allowed_models: tuple[str, ...] = ()
) -> Batch:
    """validating -> in_progress (all lines stored) or failed (error names the line).

    Idempotent and safe to repeat after a crash: lines and the status change
    commit together, and only a batch still ``validating`` is touched.
    """
    lines_t: sa.Table = BatchLine.__table__  # type: ignore[assignment]
    with session_scope(engine) as session:
        b = session.execute(
            sa.select(Batch).where(Batch.id == batch_id).with_for_update()
        ).scalar_one()
        if b.status != BatchStatus.VALIDATING:
            return b
        f = files.get(b.tenant_id, b.input_file_id)
        error: BatchInputError | None = None
        total = 0
        try:
            if f is None:
                raise BatchInputError("file_not_found", f"input file {b.input_file_id} is gone")
            # pass 1 validates without touching the database, so a bad line 50,001
            # fails in a second instead of after 50,000 inserts
            with files.open(f) as fh:
                for _ in iter_input_lines(fh, b.endpoint, allowed_models=allowed_models):
                    pass
            with files.open(f) as fh:
                chunk: list[dict[str, Any]] = []
                for line in iter_input_lines(fh, b.endpoint, allowed_models=allowed_models):
                    chunk.append(
                        {
                            "batch_id": batch_id,
                            "line_no": line.line_no,
                            "custom_id": line.custom_id,
                            "body": line.body,
                            "status": BatchLineStatus.PENDING,
                        }
                    )
                    total += 1
                    if len(chunk) >= INSERT_CHUNK_LINES:
                        session.execute(sa.insert(lines_t), chunk)
                        chunk = []
                if chunk:
                    session.execute(sa.insert(lines_t), chunk)
        except BatchInputError as exc:
            error = exc
        except OSError as exc:
            error = BatchInputError("file_unreadable", f"input file cannot be read ({exc})")
        now = utcnow()
        if error is None:
            b.status = BatchStatus.IN_PROGRESS
            b.total_count = total
            b.in_progress_at = now
            return b
    # failed: the line inserts above were rolled back with the transaction
    with session_scope(engine) as session:
        b = session.execute(
            sa.select(Batch).where(Batch.id == batch_id).with_for_update()
        ).scalar_one()
        if b.status == BatchStatus.VALIDATING:
            b.status = BatchStatus.FAILED
            b.failed_at = utcnow()
            b.errors = {"object": "list", "data": [error.as_openai()]}
        return b


def get_batch(engine: Engine, tenant_id: str, batch_id: str) -> Batch | None:
    with session_scope(engine) as session:
        return session.execute(
            sa.select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)
        ).scalar_one_or_none()


def batch_owner(engine: Engine, batch_id: str) -> str | None:
    """The tenant of a batch (admin UI only; tenant-facing code uses get_batch)."""
    with engine.connect() as conn:
        return conn.execute(
            sa.select(Batch.tenant_id).where(Batch.id == batch_id)
        ).scalar_one_or_none()


def list_batches(
    engine: Engine, tenant_id: str | None, *, limit: int = 20, after: str | None = None
) -> tuple[list[Batch], bool]:
    """Newest first; ``after`` is the id of the last batch of the previous page.

    ``tenant_id=None`` lists every tenant's batches (admin UI only).
    """
    stmt = sa.select(Batch)
    if tenant_id is not None:
        stmt = stmt.where(Batch.tenant_id == tenant_id)
    with session_scope(engine) as session:
        if after:
            cursor = session.execute(
                sa.select(Batch.created_at, Batch.id).where(
                    Batch.id == after, *([Batch.tenant_id == tenant_id] if tenant_id else [])
                )
            ).first()
            if cursor is not None:
                stmt = stmt.where(sa.tuple_(Batch.created_at, Batch.id) < sa.tuple_(*cursor))
        rows = list(
            session.scalars(
                stmt.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit + 1)
            )
        )
    return rows[:limit], len(rows) > limit


def cancel_batch(engine: Engine, tenant_id: str, batch_id: str) -> Batch | None:
    """in_progress/validating -> cancelling; the runner finishes the job. None if unknown."""
    with session_scope(engine) as session:
        b = session.execute(
            sa.select(Batch)
            .where(Batch.id == batch_id, Batch.tenant_id == tenant_id)
            .with_for_update()
        ).scalar_one_or_none()
        if b is None:
            return None
        status = BatchStatus(b.status)
        if status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
            return b
        if status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
            raise BatchRequestError(
                400, f"cannot cancel a batch that is {status.value}", code="batch_not_cancellable"
            )
        b.status = BatchStatus.CANCELLING
        b.cancelled_at = utcnow()
        return b


def line_counts(engine: Engine, batch_id: str) -> Mapping[str, int]:
    """Lines per status (progress display and tests)."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(BatchLine.status, sa.func.count())
            .where(BatchLine.batch_id == batch_id)
            .group_by(BatchLine.status)
        )
        return {BatchLineStatus(s).value: int(n) for s, n in rows}
