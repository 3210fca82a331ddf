"""Time to first chunk through the API's HTTP server alone, lingering or not.

A trivial Flask route that streams two SSE chunks, served by
:class:`web.server.ApiServer` in a child process; the parent sends
``--rate`` requests per second on one keep-alive connection (as the overhead
benchmark's client and a load balancer's upstream pool do) and prints the
p50/p90 time to the first chunk, with the pool threads lingering on the
connection (``linger_s`` = 1) and without (cheroot's own hand-back to its
selector), in alternation::

    .venv/bin/python benchmarks/api_ingress.py [--n 600] [--rounds 2]

This is the floor the server puts under every API request, before any of
TokenFleet's own work.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.*, tests.support

SERVER = r"""
import sys
from flask import Flask, Response
from web.server import ApiServer

app = Flask("ingress")

@app.post("/v1/chat/completions")
def chat():
    def gen():
        yield b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n'
        yield b"data: [DONE]\n\n"
    return Response(gen(), mimetype="text/event-stream")

srv = ApiServer(app, port=0, threads=32, linger_s=float(sys.argv[1]))
print(srv.port, flush=True)
srv.serve_forever()
"""


def measure(linger_s: float, n: int, rate_rps: float) -> tuple[float, float]:
    from benchmarks.live_overhead import _Caller, _pct

    child = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(linger_s)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        client = _Caller(f"http://127.0.0.1:{port}", None)
        lat = []
        for i in range(n + 50):
            t0 = time.perf_counter()
            ttft, _ = client.call({"i": i})
            if i >= 50:  # warm-up
                lat.append(ttft)
            time.sleep(max(0.0, 1.0 / rate_rps - (time.perf_counter() - t0)))
        return round(_pct(lat, 50) * 1e3, 3), round(_pct(lat, 90) * 1e3, 3)
    finally:
        child.terminate()
        child.wait(timeout=5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=600, help="requests per measurement")
    p.add_argument("--rate", type=float, default=50.0, help="requests per second")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    for r in range(args.rounds):
        for linger in (0.0, 1.0):
            p50, p90 = measure(linger, args.n, args.rate)
            print(
                f"round {r + 1}, linger_s {linger:g}: first chunk p50 {p50} ms, p90 {p90} ms",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
