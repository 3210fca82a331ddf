"""Tenancy: per-budget quotas, daily usage counters, admin users of the web UI.

Models: tokenfleet/tenancy/models.py.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 09:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "admin_users",
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("password_hash", sa.String(length=300), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.Column("last_login_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("username", name=op.f("pk_admin_users")),
    )
    op.create_table(
        "tenant_quotas",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("budget", sa.String(length=16), nullable=False),
        sa.Column("requests_per_minute", sa.Integer(), nullable=True),
        sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent_requests", sa.Integer(), nullable=True),
        sa.Column("daily_token_budget", sa.BigInteger(), nullable=True),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.CheckConstraint(
            "budget IN ('interactive', 'batch')", name=op.f("ck_tenant_quotas_budget")
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_quotas_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", "budget", name=op.f("pk_tenant_quotas")),
    )
    op.create_table(
        "tenant_usage",
        sa.Column("tenant_id", sa.String(length=64), nullable=False),
        sa.Column("budget", sa.String(length=16), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("rejected", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False
        ),
        sa.PrimaryKeyConstraint("tenant_id", "budget", "day", name=op.f("pk_tenant_usage")),
    )


def downgrade() -> None:
    op.drop_table("tenant_usage")
    op.drop_table("tenant_quotas")
    op.drop_table("admin_users")
