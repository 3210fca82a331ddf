"""Azure LLM inference trace loader (Azure/AzurePublicDataset, 2023 and 2024).

CSV with a header: ``TIMESTAMP`` (wall clock, e.g.
``2023-11-16 18:15:46.6805900``: seven fractional digits, more than
``datetime`` accepts), ``ContextTokens`` and ``GeneratedTokens``. Arrivals are
seconds since the earliest row. The trace has no prefix information, so every
request gets block hashes seeded by its row index: nothing is falsely shared.
"""

from __future__ import annotations

import csv
import re
from datetime import date
from pathlib import Path

from tokenfleet.core.types import RequestInfo
from tokenfleet.errors import TraceFormatError
from tokenfleet.workloads.common import DEFAULT_MAX_TOKENS, LineChecker, check_budget, make_request
from tokenfleet.workloads.hashing import content_id, unique_hashes
from tokenfleet.workloads.trace import TraceRequest

_TS = re.compile(
    r"^\s*(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?"
    r"\s*(?:Z|[+-]00:?00)?\s*$"
)
_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def parse_timestamp_ns(text: str) -> int | None:
    """Wall-clock text -> integer nanoseconds since 0001-01-01 (exact, no float)."""
    m = _TS.match(text)
    if m is None:
        return None
    y, mo, d, hh, mm, ss, frac = m.groups()
    try:
        days = date(int(y), int(mo), int(d)).toordinal()
    except ValueError:
        return None
    if int(hh) > 23 or int(mm) > 59 or int(ss) > 60:
        return None
    secs = days * 86400 + int(hh) * 3600 + int(mm) * 60 + int(ss)
    ns = int((frac or "0").ljust(9, "0"))
    return secs * 1_000_000_000 + ns


def load_azure(
    path: str | Path,
    *,
    max_tokens: int | None = None,
    model: str = "default",
    tenant: str = "default",
    task_type: str = "chat",
) -> list[TraceRequest]:
    """Load an Azure trace CSV, sorted by arrival (ties keep file order)."""
    budget = check_budget(max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS["azure"])
    src = str(path)
    salt = content_id("azure", Path(path).name)
    rows: list[tuple[int, int, int]] = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(
                src, 1, "empty file; expected a header TIMESTAMP,ContextTokens,GeneratedTokens"
            )
        cols = [h.strip() for h in header]
        missing = [c for c in _FIELDS if c not in cols]
        if missing:
            raise TraceFormatError(
                src,
                1,
                f"header lacks {', '.join(missing)}; expected "
                "columns TIMESTAMP,ContextTokens,GeneratedTokens",
            )
        i_ts, i_in, i_out = (cols.index(c) for c in _FIELDS)
        for row in reader:
            line_no = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            chk = LineChecker(src, line_no)
            if len(row) != len(cols):
                raise chk.fail(f"expected {len(cols)} columns, got {len(row)}")
            ts = parse_timestamp_ns(row[i_ts])
            if ts is None:
                raise chk.fail(f"TIMESTAMP {row[i_ts]!r} is not 'YYYY-MM-DD HH:MM:SS[.fraction]'")
            vals = []
            for name, i, lo in (("ContextTokens", i_in, 1), ("GeneratedTokens", i_out, 0)):
                try:
                    v = int(row[i].strip())
                except ValueError:
                    raise chk.fail(f"{name} must be an integer, got {row[i]!r}") from None
                if v < lo:
                    raise chk.fail(f"{name} must be >= {lo}, got {v}")
                vals.append(v)
            rows.append((ts, vals[0], vals[1]))
    if not rows:
        return []
    t0 = min(r[0] for r in rows)
    out: list[TraceRequest] = []
    for idx, (ts, n_in, n_out) in enumerate(rows):
        info = RequestInfo(
            request_id=f"az-{idx}",
            arrival_s=(ts - t0) / 1e9,
            input_tokens=n_in,
            max_tokens=budget,
            block_hashes=unique_hashes(hash((salt, idx)), n_in),
            tenant=tenant,
            task_type=task_type,
            model=model,
        )
        out.append(make_request(info, n_out))
    out.sort(key=lambda r: r.info.arrival_s)
    return out
