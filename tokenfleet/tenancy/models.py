"""Ledger tables of the tenancy layer (migration 0002).

They live on the ledger's ``Base`` so Alembic and the drift check see one
schema. ``tenant_quotas`` holds one row per (tenant, budget): the Tenant
row's own limit columns only know one budget and a monthly total, while
quotas are per budget (interactive, batch) and per UTC day.
``tenant_usage`` is a per-day counter table written by
:class:`tokenfleet.tenancy.usage.UsageRecorder` as additive upserts, one row
per (tenant, budget, day) per flush, never one per request.
"""

from __future__ import annotations

from datetime import date, datetime

import sqlalchemy as sa
from sqlalchemy.orm import Mapped, mapped_column

from tokenfleet.service.ledger import Base, _now_column


class TenantQuota(Base):
    __tablename__ = "tenant_quotas"
    __table_args__ = (sa.CheckConstraint("budget IN ('interactive', 'batch')", name="budget"),)

    tenant_id: Mapped[str] = mapped_column(
        sa.ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    budget: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    #: None = unlimited
    requests_per_minute: Mapped[int | None] = mapped_column(sa.Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(sa.BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(sa.Integer)
    daily_token_budget: Mapped[int | None] = mapped_column(sa.BigInteger)
    updated_at: Mapped[datetime] = _now_column()


class TenantUsage(Base):
    __tablename__ = "tenant_usage"

    tenant_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    budget: Mapped[str] = mapped_column(sa.String(16), primary_key=True)
    day: Mapped[date] = mapped_column(sa.Date, primary_key=True)
    requests: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    rejected: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    prompt_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(sa.BigInteger, default=0)
    updated_at: Mapped[datetime] = _now_column()


class AdminUser(Base):
    """An admin of the web UI; separate from tenant API keys (which cannot log in)."""

    __tablename__ = "admin_users"

    username: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    #: werkzeug ``scrypt`` hash; the plaintext is never stored
    password_hash: Mapped[str] = mapped_column(sa.String(300))
    created_at: Mapped[datetime] = _now_column()
    last_login_at: Mapped[datetime | None] = mapped_column(sa.DateTime(timezone=True))


TENANCY_TABLES = ("admin_users", "tenant_quotas", "tenant_usage")
