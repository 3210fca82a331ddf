"""CPU per write of the live path's two stores, on their own
(``python benchmarks/store_writes.py``; issue #23).

Two writes every request makes, measured in this process's CPU time
(``time.process_time``, this thread and the writer's):

* **ledger flush**: :meth:`LedgerWriter._upsert` of a batch of 1, 2, 5 and 20
  rows (at 5 req/s a process flushes every 0.25 s, one or two rows at a
  time), into a real PostgreSQL: the embedded one the tests use, or
  ``--database-url``;
* **Redis batch**: the live state's batch of a request's dispatch (the
  accounting's ``HINCRBY`` s, a gate ``PUBLISH``, counters, the request's hash
  and lease), through the live state's own client (``LiveState.from_url``),
  into a real Redis (embedded, or ``--redis-url``).

Run it at the commit before and after a change in alternation: the numbers
move with the machine's speed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support


def _cpu_us(fn: Callable[[], Any], n: int, warmup: int = 20) -> float:
    for _ in range(warmup):
        fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n * 1e6


def ledger(url: str, n: int) -> dict[str, float]:
    from tokenfleet.service.writer import LedgerWriter, normalize_row

    writer = LedgerWriter(url, spill_dir=tempfile.mkdtemp(), flush_interval_s=3600)
    out: dict[str, float] = {}
    try:
        for size in (1, 2, 5, 20):
            now = time.time()

            def rows(size: int = size, now: float = now) -> list[dict[str, Any]]:
                return [
                    normalize_row(
                        {
                            "request_id": uuid.uuid4().hex,
                            "tenant_id": "bench",
                            "tier": "interactive",
                            "model": "m",
                            "status": "in_flight",
                            "arrival_ts": now,
                            "dc": "dc-a",
                            "instance": "i0",
                            "admitted_ts": now,
                            "prompt_tokens": 8192,
                        }
                    )
                    for _ in range(size)
                ]

            batches = iter([rows() for _ in range(n + 20)])

            def flush(batches: Any = batches) -> None:
                writer._upsert(next(batches))

            out[f"ledger flush of {size} row(s)"] = _cpu_us(flush, n)
    finally:
        writer.close()
    return out


def redis_batch(url: str, n: int) -> dict[str, float]:
    from tokenfleet.live.state import LiveState

    state = LiveState.from_url(url, prefix=f"bench-{uuid.uuid4().hex[:6]}")

    def batch() -> None:
        now = time.time()
        with state.batch() as b:
            pipe = b.pipe
            for i in range(6):
                pipe.hincrby(state.k("acct", "i0"), f"f{i}", 3)
            pipe.publish(state.k("gate", "i0"), 1)
            b.count(requests=1, interactive=1)
            b.create_request("x", "q", 600.0, tier="interactive")
            b.own_request("x", "api:1", 30.0, "i0")
            pipe.set(state.k("t"), now)

    try:
        return {"Redis batch of a dispatch (14 commands)": _cpu_us(batch, n)}
    finally:
        keys = state.r.keys(state.k("*"))
        if keys:
            state.r.delete(*keys)
        state.r.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", default=None, help="default: an embedded PostgreSQL")
    p.add_argument("--redis-url", default=None, help="default: an embedded Redis")
    p.add_argument("--n", type=int, default=1000, help="writes per figure")
    args = p.parse_args(argv)
    from tests.support.stores import (
        embedded_postgres,
        embedded_redis,
        fresh_database,
        temp_data_dir,
    )

    results: dict[str, float] = {}
    with temp_data_dir("tokenfleet-bench-") as tmp:
        if args.database_url:
            results |= ledger(args.database_url, args.n)
        else:
            print("starting an embedded PostgreSQL ...", flush=True)
            with embedded_postgres(tmp / "pg", template=False) as pg:
                results |= ledger(fresh_database(pg, "bench"), args.n)
        if args.redis_url:
            results |= redis_batch(args.redis_url, args.n)
        else:
            with embedded_redis(tmp / "redis") as server:
                results |= redis_batch(server.url, args.n)
    for name, us in results.items():
        print(f"{name:42s} {us:8.1f} us CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
