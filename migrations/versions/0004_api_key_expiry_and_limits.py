"""API keys: an optional expiry (refused after it) and optional per-key limits.

A key's requests/min and tokens/min apply on top of its tenant's quotas (the
tenant's budget is shared by all its keys; a key's limit caps that one key).

``api_keys.last_used_at`` exists since 0001; the tenancy directory now fills
it (at most once a minute per key and process, off the request path).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 18:20:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("api_keys", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("api_keys", sa.Column("requests_per_minute", sa.Integer(), nullable=True))
    op.add_column("api_keys", sa.Column("tokens_per_minute", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("api_keys", "tokens_per_minute")
    op.drop_column("api_keys", "requests_per_minute")
    op.drop_column("api_keys", "expires_at")
