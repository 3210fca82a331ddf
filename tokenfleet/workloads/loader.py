"""One entry point for trace files: format detection, dispatch and caching.

Parsed traces are cached per (path, size, mtime, options) because experiment
sweeps reload the same trace many times; callers get fresh ``TraceRequest``
objects each time (the frozen ``RequestInfo`` and its hash tuple are shared).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from tokenfleet.errors import ConfigError, TraceFormatError
from tokenfleet.workloads.azure import load_azure
from tokenfleet.workloads.mooncake import load_mooncake
from tokenfleet.workloads.native import load_tokenfleet
from tokenfleet.workloads.scaling import limit as limit_requests
from tokenfleet.workloads.trace import TraceRequest

FORMATS = ("mooncake", "azure", "tokenfleet")

_CACHE_ENTRIES = 4
_cache: OrderedDict[tuple[object, ...], tuple[TraceRequest, ...]] = OrderedDict()


def detect_format(path: str | Path) -> str:
    """Guess the format from the extension, then from the first record."""
    p = Path(path)
    if p.suffix.lower() == ".csv":
        return "azure"
    try:
        with open(p, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                text = line.strip()
                if not text or text.startswith("#"):
                    continue
                if "ContextTokens" in text and "GeneratedTokens" in text:
                    return "azure"
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError:
                    raise TraceFormatError(
                        str(p),
                        line_no,
                        "cannot detect the format: first record is neither JSON nor an "
                        "Azure CSV header; pass the format explicitly "
                        "(mooncake | azure | tokenfleet)",
                    ) from None
                if isinstance(obj, dict):
                    if "input_length" in obj and "hash_ids" in obj:
                        return "mooncake"
                    if "input_tokens" in obj:
                        return "tokenfleet"
                raise TraceFormatError(
                    str(p),
                    line_no,
                    "cannot detect the format from the first record (expected Mooncake "
                    "'input_length'+'hash_ids' or TokenFleet 'input_tokens'); pass the "
                    "format explicitly (mooncake | azure | tokenfleet)",
                )
    except FileNotFoundError:
        raise ConfigError(f"trace file {p} does not exist; check the path") from None
    raise TraceFormatError(str(p), 1, "file is empty; nothing to load")


def load_workload(
    path: str | Path,
    fmt: str | None = None,
    limit: int | None = None,
    *,
    model: str = "default",
    tenant: str = "default",
    max_tokens: int | None = None,
    use_cache: bool = True,
) -> list[TraceRequest]:
    """Load a trace file as requests sorted by arrival.

    ``fmt`` is "mooncake" | "azure" | "tokenfleet", or None to detect it.
    ``max_tokens`` overrides the per-format default budget (docs/workloads.md);
    ``limit`` keeps the first N requests by arrival.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"trace file {p} does not exist; check the path")
    fmt = fmt or detect_format(p)
    if fmt not in FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}; choose one of: {', '.join(FORMATS)}")
    st = os.stat(p)
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, fmt, model, tenant, max_tokens)
    cached = _cache.get(key) if use_cache else None
    if cached is None:
        loaders: dict[str, Callable[..., list[TraceRequest]]] = {
            "mooncake": load_mooncake,
            "azure": load_azure,
            "tokenfleet": load_tokenfleet,
        }
        cached = tuple(loaders[fmt](p, max_tokens=max_tokens, model=model, tenant=tenant))
        if use_cache:
            _cache[key] = cached
            while len(_cache) > _CACHE_ENTRIES:
                _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    reqs = [replace(r) for r in cached]
    return limit_requests(reqs, limit) if limit is not None else reqs


def clear_cache() -> None:
    _cache.clear()
