"""CPU cost of two steps of every API request, old way against new, one thread.

* **publish**: a task message into a redis-py pipeline, with Celery's
  ``send_task`` (what the gateway called before) and with
  :class:`tokenfleet.live.redis_transport.PipelinePublisher` (what it calls
  now). The pipeline is never executed: this is the CPU of building and
  queueing the message, the part that differs.
* **request context**: Flask's request context push and pop with its
  signed-cookie sessions and a secret key, and with
  :class:`web.admin.CookieFirstSessionInterface`, for a request without a
  cookie (every API request).
* **Redis replies**: one command each of the kinds the live path sends
  (a ``GET``, an ``XREAD`` of a few token entries, a six-command pipeline),
  parsed by redis-py's pure-Python parser and by ``hiredis`` (a dependency;
  redis-py uses it whenever it is installed).
* **wake-up**: the round trip of one byte to another process and back, the
  gauge the overhead benchmark prints as ``machine_wakeup_rtt_us``.

CPU time is ``time.thread_time()``, best of five rounds, so it moves less with
the host's load than wall time does. Starts an embedded Redis (or uses
``TOKENFLEET_REDIS_URL``)::

    .venv/bin/python benchmarks/api_cpu.py [--n 1000]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, tests.support

#: a job of the size the gateway publishes for a short chat request
JOB = {
    "rid": "0" * 32,
    "attempt": 1,
    "tenant": "t",
    "tier": "interactive",
    "model": "m",
    "body": {
        "model": "m",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 8,
        "stream": True,
    },
    "input_tokens": 8,
    "max_tokens": 8,
    "arrival_ts": 1.0,
    "admitted_ts": 1.0,
    "queue": "bench.interactive",
    "accounted": "",
    "dc": "bench",
    "expected_cached": 0,
    "tried": [],
    "deadline_ts": None,
}


def best_us(fn: Callable[[int], None], n: int, rounds: int = 5) -> float:
    """Best per-call CPU time (µs) of ``fn`` over ``rounds`` rounds of ``n`` calls."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time()
        for i in range(n):
            fn(i)
        best = min(best, (time.thread_time() - t0) / n)
    return round(best * 1e6, 1)


@contextlib.contextmanager
def _redis_url() -> Iterator[str]:
    url = os.environ.get("TOKENFLEET_REDIS_URL")
    if url:
        yield url
        return
    from tests.support.stores import embedded_redis, temp_data_dir

    with temp_data_dir("tokenfleet-api-cpu-") as d, embedded_redis(d) as server:
        yield server.url


def publish(n: int) -> dict[str, float]:
    import redis

    from tokenfleet.live.config import LiveConfig
    from tokenfleet.live.jobs import TASK_CHAT
    from tokenfleet.live.redis_transport import PipelinePublisher, publishes_into
    from workers.app import create_celery

    with _redis_url() as url:
        app = create_celery(url, LiveConfig())
        pipe = redis.Redis.from_url(url).pipeline(transaction=False)
        queue = str(JOB["queue"])
        publisher = PipelinePublisher(app)

        def old(i: int) -> None:
            with publishes_into(pipe):
                app.send_task(
                    TASK_CHAT,
                    args=[JOB],
                    task_id=f"{i}.1",
                    queue=queue,
                    routing_key=queue,
                    argsrepr="",
                    kwargsrepr="",
                    headers={"prefill": 8},
                )
            pipe.reset()

        def new(i: int) -> None:
            publisher.publish(pipe, TASK_CHAT, [JOB], f"{i}.1", queue, {"prefill": 8})
            pipe.reset()

        old(0)  # connect and declare outside the timing
        new(0)
        out = {"send_task_us": best_us(old, n), "pipeline_publisher_us": best_us(new, n)}
        app.close()
    return out


def redis_parsers(n: int) -> dict[str, float]:
    import redis
    from redis._parsers import _HiredisParser, _RESP2Parser
    from redis.utils import HIREDIS_AVAILABLE

    out: dict[str, float] = {}
    parsers: list[tuple[str, Any]] = [("python", _RESP2Parser)]
    if HIREDIS_AVAILABLE:
        parsers.append(("hiredis", _HiredisParser))
    with _redis_url() as url:
        for label, parser in parsers:
            r = redis.Redis.from_url(url, parser_class=parser)
            r.delete("bench:s")
            for _ in range(4):
                r.xadd("bench:s", {"text": "hello world " * 3, "tokens": 1})

            def get(_: int, r: Any = r) -> None:
                r.get("bench:k")

            def xread(_: int, r: Any = r) -> None:
                r.xread({"bench:s": "0"}, count=4)

            def pipeline(_: int, r: Any = r) -> None:
                with r.pipeline(transaction=False) as pipe:
                    for _k in range(6):
                        pipe.hget("bench:h", "f")
                    pipe.execute()

            for name, fn in (("get", get), ("xread", xread), ("pipeline6", pipeline)):
                fn(0)
                out[f"{name}_{label}_us"] = best_us(fn, n)
            r.close()
    return out


def request_context(n: int) -> dict[str, float]:
    from flask import Flask

    from web.admin import CookieFirstSessionInterface

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/v1/chat/completions",
        "SERVER_NAME": "bench",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "HTTP_AUTHORIZATION": "Bearer key",
        "CONTENT_TYPE": "application/json",
    }
    out = {}
    for label, interface in (
        ("flask_sessions_us", None),
        ("cookie_first_sessions_us", CookieFirstSessionInterface()),
    ):
        app = Flask("bench")
        app.secret_key = "k" * 32
        if interface is not None:
            app.session_interface = interface
        app.add_url_rule("/v1/chat/completions", "chat", lambda: "", methods=["POST"])

        def push_pop(_: int, app: Any = app) -> None:
            ctx = app.request_context(dict(environ))
            ctx.push()
            ctx.pop()

        out[label] = best_us(push_pop, n)
    return out


def main(argv: list[str] | None = None) -> int:
    from benchmarks.live_overhead import wakeup_rtt_us

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1000, help="calls per round")
    args = p.parse_args(argv)
    for name, fn in (
        ("publish into a pipeline", publish),
        ("request context push + pop", request_context),
        ("Redis command, by reply parser", redis_parsers),
    ):
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in fn(args.n).items()), flush=True)
    print(f"process wake-up round trip: {wakeup_rtt_us()} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
