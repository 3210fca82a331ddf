"""CPU of the API's stream pump per stream and per read, on its own
(``python benchmarks/stream_pump.py``; issue #23).

The pump (``tokenfleet/live/gateway/pump.py``) carries every direct stream
past its first token: it reads the engine's socket at most every
``--coalesce-ms``, decodes the SSE events, frames them for the client and
sends. In the live benchmark (``benchmarks/cpu_per_request.py``) it is the
API's largest thread, but that run shares the machine with emulated engines,
workers and databases. Here the engine and the client are two other
processes on TCP loopback: the engine writes vLLM-style chunked token events
(the emulator's JSON) every ``--tpot-ms`` on each connection, the client
drains. This process runs the pump and one thread per stream (the request
threads, which only wait), ``--concurrency`` streams at a time, and reads
the pump thread's CPU from ``/proc`` (user + system, in 10 ms ticks: run
long enough).

Printed: streams, tokens and pump reads; the pump thread's CPU per stream,
per read and per token; the bytes the client got.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.pump import FakeEngineCall
from tokenfleet.live.gateway.pump import PumpSink, StreamPump
from tokenfleet.live.procstat import stat_cpu_s

_HEAD = {
    "id": "chatcmpl-f9a2d9cb476346b795ccaae2c2d2d2ed",
    "object": "chat.completion.chunk",
    "created": 1796457769,
    "model": "meta-llama/Llama-3.1-8B-Instruct",
}


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _token_event(text: str) -> bytes:
    ev = {
        **_HEAD,
        "choices": [
            {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
        ],
    }
    return _chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")


def _last_events(tokens: int) -> bytes:
    fin = {
        **_HEAD,
        "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}],
    }
    usage = {**_HEAD, "choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": tokens}}
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (fin, usage))
    return _chunk(body + b"data: [DONE]\n\n") + b"0\r\n\r\n"


def _engine(listener: socket.socket, tokens: int, tpot_s: float) -> None:
    """Every connection gets ``tokens`` token events, one per ``tpot_s``."""
    words = [f" w{i % 97}" for i in range(tokens)]

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.monotonic()
        with conn:
            for i, w in enumerate(words):
                delay = start + i * tpot_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                conn.sendall(_token_event(w))
            conn.sendall(_last_events(tokens))
            conn.recv(1)  # until the pump closes it

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def _client(listener: socket.socket, got: Any) -> None:
    """Drains every connection; counts the bytes."""

    def drain(conn: socket.socket) -> None:
        n = 0
        with conn:
            while data := conn.recv(65536):
                n += len(data)
        with got.get_lock():
            got.value += n

    while True:
        conn, _ = listener.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def _thread_cpu_s(tid: int) -> float:
    used = stat_cpu_s(f"/proc/self/task/{tid}/stat")
    assert used is not None, f"no /proc stat for thread {tid}"
    return used


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(512)
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=10)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--tpot-ms", type=float, default=7.0)
    p.add_argument("--coalesce-ms", type=float, default=20.0)
    args = p.parse_args(argv)

    eng_l, cli_l = _listener(), _listener()
    got = mp.Value("q", 0)
    procs = [
        mp.Process(target=_engine, args=(eng_l, args.tokens, args.tpot_ms / 1e3), daemon=True),
        mp.Process(target=_client, args=(cli_l, got), daemon=True),
    ]
    for proc in procs:
        proc.start()
    pump = StreamPump()
    frame_head = json.dumps({**_HEAD, "choices": []})[:-1].encode()

    def frame(text: str) -> bytes:
        return frame_head + json.dumps(text).encode() + b"}\n\n"

    results: list[Any] = []
    sem = threading.Semaphore(args.concurrency)

    def one() -> None:
        try:
            engine = socket.create_connection(eng_l.getsockname())
            client = socket.create_connection(cli_l.getsockname())
            sink = PumpSink(client, frame, chunked=lambda: True)
            res = pump.carry(
                FakeEngineCall(engine),  # type: ignore[arg-type]
                sink,
                coalesce_s=args.coalesce_ms / 1e3,
                stall_s=10.0,
            )
            results.append(res)
            client.close()
        finally:
            sem.release()

    # one warm stream starts the pump's thread
    sem.acquire()
    one()
    tid = pump._thread.native_id if pump._thread is not None else None
    assert tid is not None
    results.clear()
    reads0 = getattr(pump, "reads", 0)  # (a pump from before its counter: 0)
    cpu0, wall0 = _thread_cpu_s(tid), time.monotonic()
    threads = []
    for i in range(args.streams):
        sem.acquire()
        t = threading.Thread(target=one, daemon=True)
        t.start()
        threads.append(t)
        if (i + 1) % 50 == 0:
            print(f"  {i + 1}/{args.streams} streams started", file=sys.stderr, flush=True)
    for t in threads:
        t.join()
    cpu_s, wall_s = _thread_cpu_s(tid) - cpu0, time.monotonic() - wall0
    reads = getattr(pump, "reads", 0) - reads0
    pump.close()
    tokens = sum(r.tokens for r in results if r is not None)
    bad = sum(1 for r in results if r is None or r.error is not None or r.client_failed)
    n = len(results)
    print(
        f"streams={n} (failed {bad}) tokens={tokens} reads={reads} "
        f"({reads / max(n, 1):.1f} per stream) wall={wall_s:.1f}s\n"
        f"pump CPU: {cpu_s * 1e3:.0f} ms = {cpu_s * 1e3 / max(n, 1):.2f} ms per stream, "
        f"{cpu_s * 1e6 / max(reads, 1):.1f} us per read, "
        f"{cpu_s * 1e6 / max(tokens, 1):.2f} us per token ({cpu_s / wall_s * 100:.1f}% of a core)"
    )
    for proc in procs:
        proc.terminate()
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
