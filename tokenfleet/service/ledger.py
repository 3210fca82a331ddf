"""The service's system of record: SQLAlchemy 2 typed models.

Schema changes go through Alembic (migrations/versions/); a test compares
these models with the migrated database so the two cannot drift.

Design choices that matter to callers:

* ``requests.request_id`` is unique: every write is an upsert on it, so a
  retried task or a replayed spill file never creates a second row.
* ``requests`` has no foreign key to ``tenants``: the hot ledger path must not
  fail a whole batch because a tenant row is missing (simulations and the
  anonymous tenant write there too).
* Enums are stored as VARCHAR + CHECK (``native_enum=False``) so adding a
  status is a plain migration, and the schema also runs on SQLite for tooling.
* Timestamps are timezone-aware UTC.
"""

from __future__ import annotations

import enum
import hashlib
import secrets
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

#: JSON that is JSONB on PostgreSQL (indexable) and plain JSON elsewhere
JSONType = sa.JSON().with_variant(JSONB(), "postgresql")

#: 64-bit ids on PostgreSQL, INTEGER PRIMARY KEY (rowid) on SQLite
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def _now_column(*, index: bool = False) -> Mapped[datetime]:
    """A UTC timestamp filled by the ORM, or by the server for raw SQL inserts."""
    return mapped_column(
        sa.DateTime(timezone=True), default=utcnow, server_default=sa.func.now(), index=index
    )


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


def _enum(cls: type[enum.Enum], name: str) -> sa.Enum:
    return sa.Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


class RequestStatus(str, enum.Enum):
    """Final (or latest) state of one request in the ledger."""

    COMPLETED = "completed"  # finished within its SLO: counts toward goodput
    SLO_MISSED = "slo_missed"  # finished, but TTFT/TPOT/deadline missed
    FAILED = "failed"
    CANCELLED = "cancelled"  # by the client; excluded from attainment
    TIMED_OUT = "timed_out"
    REJECTED = "rejected"  # by admission control
    DUPLICATE = "duplicate"  # a retried submission of a known request_id
    IN_FLIGHT = "in_flight"  # recorded at admission, not finished yet


class FleetEventKind(str, enum.Enum):
    PLAN = "plan"
    ROLLBACK = "rollback"


class BatchStatus(str, enum.Enum):
    """OpenAI Batch API states."""

    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class BatchLineStatus(str, enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(200))
    slo_class: Mapped[str] = mapped_column(sa.String(32), default="standard")
    allowed_models: Mapped[list[str]] = mapped_column(JSONType, default=list)
    allowed_regions: Mapped[list[str]] = mapped_column(JSONType, default=list)
    #: None = unlimited
    requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(sa.Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(sa.BigInteger)
    disabled: Mapped[bool] = mapped_column(sa.Boolean, default=False)
    created_at: Mapped[datetime] = _now_column()

    api_keys: Mapped[list[ApiKey]] = relationship(back_populates="tenant")


class ApiKey(Base):
    """Only the SHA-256 of a key is stored; the plaintext is shown once at creation."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(
        sa.ForeignKey("tenants.id", ondelete="CASCADE"), index=True
    )
    key_sha256: Mapped[str] = mapped_column(sa.String(64), unique=True)
    prefix: Mapped[str] = mapped_column(sa.String(16))
    name: Mapped[str | None] = mapped_column(sa.String(200))
    created_at: Mapped[datetime] = _now_column()
    revoked_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    #: None = never expires; refused from this instant on (migration 0003)
    expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    #: per-key limits on top of the tenant's quotas; None = only the tenant's apply
    requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(sa.BigInteger)

    tenant: Mapped[Tenant] = relationship(back_populates="api_keys")


API_KEY_PREFIX = "tf-"


def hash_api_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def generate_api_key() -> tuple[str, str, str]:
    """(plaintext, sha256 hex, display prefix) for a new key."""
    plaintext = API_KEY_PREFIX + secrets.token_urlsafe(32)
    return plaintext, hash_api_key(plaintext), plaintext[:10]


class RequestRow(Base):
    """One row per request_id: the ledger that goodput and billing are computed from."""

    __tablename__ = "requests"
    __table_args__ = (
        sa.Index("ix_requests_arrival_ts", "arrival_ts"),
        sa.Index("ix_requests_tenant_arrival", "tenant_id", "arrival_ts"),
        sa.Index("ix_requests_tier_arrival", "tier", "arrival_ts"),
        sa.Index("ix_requests_dc_arrival", "dc", "arrival_ts"),
        # rows not final yet, for the ledger reconciler (migration 0003)
        sa.Index(
            "ix_requests_open_arrival",
            "arrival_ts",
            postgresql_where=sa.text("status IN ('in_flight', 'duplicate')"),
            sqlite_where=sa.text("status IN ('in_flight', 'duplicate')"),
        ),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(sa.String(128), unique=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64))
    tier: Mapped[str] = mapped_column(sa.String(32))
    model: Mapped[str] = mapped_column(sa.String(200))
    model_version: Mapped[str | None] = mapped_column(sa.String(64))
    dc: Mapped[str | None] = mapped_column(sa.String(64))
    instance: Mapped[str | None] = mapped_column(sa.String(128))
    arrival_ts: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True))
    admitted_ts: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    dispatched_ts: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    first_token_ts: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    finished_ts: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    prompt_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.Integer, default=0)
    status: Mapped[RequestStatus] = mapped_column(_enum(RequestStatus, "request_status"))
    attempts: Mapped[int] = mapped_column(sa.Integer, default=1)
    error: Mapped[str | None] = mapped_column(sa.Text)
    updated_at: Mapped[datetime] = _now_column()


class TierShare(Base):
    """History of the capacity share and admission threshold of each tier."""

    __tablename__ = "tier_shares"
    __table_args__ = (sa.Index("ix_tier_shares_tier_ts", "tier", "ts"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = _now_column()
    tier: Mapped[str] = mapped_column(sa.String(32))
    share: Mapped[float] = mapped_column(sa.Float)
    admission_threshold: Mapped[float | None] = mapped_column(sa.Float)
    reason: Mapped[str | None] = mapped_column(sa.Text)


class FleetEvent(Base):
    __tablename__ = "fleet_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = _now_column(index=True)
    kind: Mapped[FleetEventKind] = mapped_column(_enum(FleetEventKind, "fleet_event_kind"))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)


class AuditLog(Base):
    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[datetime] = _now_column(index=True)
    actor: Mapped[str] = mapped_column(sa.String(200))
    action: Mapped[str] = mapped_column(sa.String(200))
    payload: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)


class File(Base):
    """An uploaded or generated file (OpenAI Files API); content lives under data_dir."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    purpose: Mapped[str] = mapped_column(sa.String(32))
    filename: Mapped[str] = mapped_column(sa.String(500))
    bytes: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    storage_path: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = _now_column()


class Batch(Base):
    """An OpenAI-style batch job; counts are kept denormalised for cheap polling."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(sa.String(64), index=True)
    endpoint: Mapped[str] = mapped_column(sa.String(200))
    completion_window: Mapped[str] = mapped_column(sa.String(16), default="24h")
    status: Mapped[BatchStatus] = mapped_column(
        _enum(BatchStatus, "batch_status"), default=BatchStatus.VALIDATING
    )
    input_file_id: Mapped[str] = mapped_column(sa.ForeignKey("files.id"))
    output_file_id: Mapped[str | None] = mapped_column(sa.ForeignKey("files.id"))
    error_file_id: Mapped[str | None] = mapped_column(sa.ForeignKey("files.id"))
    total_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    completed_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    failed_count: Mapped[int] = mapped_column(sa.Integer, default=0)
    batch_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)
    errors: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = _now_column()
    in_progress_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))
    expires_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))

    lines: Mapped[list[BatchLine]] = relationship(
        back_populates="batch", cascade="all, delete-orphan", passive_deletes=True
    )


class BatchLine(Base):
    """One JSONL line of a batch input; ``custom_id`` is unique within its batch."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        sa.UniqueConstraint("batch_id", "custom_id", name="uq_batch_lines_batch_id_custom_id"),
        sa.Index("ix_batch_lines_batch_status", "batch_id", "status"),
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(sa.ForeignKey("batches.id", ondelete="CASCADE"))
    line_no: Mapped[int] = mapped_column(sa.Integer)
    custom_id: Mapped[str] = mapped_column(sa.String(200))
    body: Mapped[dict[str, Any]] = mapped_column(JSONType)
    status: Mapped[BatchLineStatus] = mapped_column(
        _enum(BatchLineStatus, "batch_line_status"), default=BatchLineStatus.PENDING
    )
    request_id: Mapped[str | None] = mapped_column(sa.String(128))
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    updated_at: Mapped[datetime] = _now_column()

    batch: Mapped[Batch] = relationship(back_populates="lines")


# Tenancy tables live beside their logic but share this metadata (migration 0002).
from tokenfleet.tenancy import models as _tenancy_models  # noqa: E402,F401

ALL_TABLES = tuple(sorted(Base.metadata.tables))
