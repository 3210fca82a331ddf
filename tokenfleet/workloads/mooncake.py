"""Mooncake trace loader (FAST'25 release, kvcache-ai/Mooncake ``traces/``).

One JSON object per line: ``timestamp`` (ms since the first request),
``input_length``, ``output_length`` and ``hash_ids``: ids of 512-token prompt
blocks, equal ids meaning an equal prefix (format as documented in Dynamo's
``benchmarks/data_generator/README.md``). The last id covers a partial block
when ``input_length`` is not a multiple of 512, so
``len(hash_ids) == ceil(input_length / 512)``; every line of the shared trace
obeys this and we enforce it. Extra keys are ignored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenfleet.core.types import RequestInfo
from tokenfleet.workloads.common import DEFAULT_MAX_TOKENS, LineChecker, check_budget, make_request
from tokenfleet.workloads.hashing import BlockIdHasher
from tokenfleet.workloads.trace import TraceRequest

MOONCAKE_BLOCK_TOKENS = 512


def load_mooncake(
    path: str | Path,
    *,
    max_tokens: int | None = None,
    model: str = "default",
    tenant: str = "default",
    task_type: str = "chat",
) -> list[TraceRequest]:
    """Load a Mooncake JSONL trace, sorted by arrival (ties keep file order)."""
    budget = check_budget(max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS["mooncake"])
    src = str(path)
    hasher = BlockIdHasher(MOONCAKE_BLOCK_TOKENS)
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            chk = LineChecker(src, line_no)
            try:
                obj: Any = json.loads(line)
            except json.JSONDecodeError as e:
                raise chk.fail(
                    f"not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise chk.fail(
                    "each line must be a JSON object with timestamp, input_length, "
                    "output_length, hash_ids"
                )
            ts_ms = chk.num_field(obj, "timestamp")
            n_in = chk.int_field(obj, "input_length", minimum=1)
            n_out = chk.int_field(obj, "output_length")
            ids = chk.int_list(obj, "hash_ids")
            want = -(-n_in // MOONCAKE_BLOCK_TOKENS)
            if len(ids) != want:
                raise chk.fail(
                    f"hash_ids has {len(ids)} entries but input_length {n_in} needs "
                    f"ceil({n_in}/{MOONCAKE_BLOCK_TOKENS}) = {want}"
                )
            info = RequestInfo(
                request_id=f"mc-{len(out)}",
                arrival_s=ts_ms / 1000.0,
                input_tokens=n_in,
                max_tokens=budget,
                block_hashes=hasher.hashes(ids, n_in),
                tenant=tenant,
                task_type=task_type,
                model=model,
            )
            out.append(make_request(info, n_out))
    out.sort(key=lambda r: r.info.arrival_s)
    return out
