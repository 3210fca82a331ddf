"""Ledger reconciler: a partial index on the rows not final yet.

Beat's reconciler (tokenfleet/live/reconcile.py) looks every
``reconcile_period_s`` for ``in_flight``/``duplicate`` rows older than its
grace; without an index that is a scan of the whole ledger. The partial index
holds only open rows, so it stays as small as the requests in flight.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 18:00:00+00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_OPEN = sa.text("status IN ('in_flight', 'duplicate')")


def upgrade() -> None:
    op.create_index(
        "ix_requests_open_arrival",
        "requests",
        ["arrival_ts"],
        postgresql_where=_OPEN,
        sqlite_where=_OPEN,
    )


def downgrade() -> None:
    op.drop_index("ix_requests_open_arrival", table_name="requests")
