"""The CPU a front door cannot avoid: relaying streams, and nothing else (issue #23).

Issue #23 asks the whole control plane for at most 3 CPU-ms per request at
8k-token prompts streamed with 256 output tokens. This measures what the
relay alone costs on this machine, with every other duty taken away: a bare
relay (``--serve``: one thread, ``selectors``, no JSON, no routing state, no
ledger, no Redis) that forwards each request to the next engine in turn and
the engine's chunked answer byte for byte, reading an engine socket at most
every ``C`` ms (``bare:C``; ``bare:0`` forwards every write of the engine as
it comes, as the Rust routers do; TokenFleet's pump reads every 20 ms), and
beside it the Rust routers users run (``sglang:cache_aware``,
``vllm:kv_aware`` with the engines' KV events), on the same fresh emulated
``llama3-8b-h200`` engines at real decode speed, the same requests
(``cpu_per_request.py``'s prompts: 70% of them a prefix shared by all),
open loop at ``--rate``. Printed per front: the front's CPU-ms per request
(user + system, from ``/proc``, its whole process tree), and for the bare
relay its engine reads per request. ::

    .venv/bin/python benchmarks/relay_floor.py
    .venv/bin/python benchmarks/relay_floor.py --fronts bare:0,bare:20,bare:50 --requests 60

What it shows is a floor under any Python front door that streams through
itself: whatever else a request costs comes on top.
"""

from __future__ import annotations

import argparse
import heapq
import json
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.*, tests.support

#: the end of a chunked body
_LAST_CHUNK = b"0\r\n\r\n"


# ---- the bare relay (runs as its own process: --serve) -------------------------------
@dataclass
class _Client:
    sock: socket.socket
    buf: bytearray = field(default_factory=bytearray)


@dataclass
class _Upstream:
    sock: socket.socket
    engine: int
    client: _Client | None = None
    #: the answer's head until it is whole, then the body's last five bytes
    tail: bytes = b""
    in_body: bool = False
    resting: bool = False


class BareRelay:
    """HTTP/1.1 keep-alive on both sides; one request per client connection at
    a time, the answer forwarded verbatim (status line, headers, chunks)."""

    def __init__(self, port: int, engines: list[str], coalesce_s: float) -> None:
        self.engines = [
            (urlsplit(u).hostname or "127.0.0.1", urlsplit(u).port or 80) for u in engines
        ]
        self.coalesce_s = coalesce_s
        self.sel = selectors.DefaultSelector()
        self.lsock = socket.create_server(("127.0.0.1", port), backlog=512)
        self.lsock.setblocking(False)
        self.sel.register(self.lsock, selectors.EVENT_READ, None)
        self.idle: list[list[_Upstream]] = [[] for _ in self.engines]
        self.next_engine = 0
        self.timers: list[tuple[float, int, _Upstream]] = []
        self.seq = 0
        self.stats = {"requests": 0, "engine_reads": 0}

    def run(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set (checked at least every second)."""
        while stop is None or not stop.is_set():
            timeout = 1.0
            if self.timers:
                timeout = min(timeout, max(0.0, self.timers[0][0] - time.monotonic()))
            for key, _ in self.sel.select(timeout):
                if key.data is None:
                    self._accept()
                elif isinstance(key.data, _Client):
                    self._from_client(key.data)
                else:
                    self._from_engine(key.data)
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                up = heapq.heappop(self.timers)[2]
                up.resting = False
                self._from_engine(up)

    def _accept(self) -> None:
        try:
            sock, _ = self.lsock.accept()
        except BlockingIOError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sel.register(sock, selectors.EVENT_READ, _Client(sock))

    def _from_client(self, c: _Client) -> None:
        try:
            data = c.sock.recv(1 << 16)
        except BlockingIOError:
            return
        if not data:
            self.sel.unregister(c.sock)
            c.sock.close()
            return
        c.buf += data
        end = c.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(c.buf[:end]).decode("latin-1").split("\r\n")
        length = 0
        for line in head[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        if len(c.buf) < end + 4 + length:
            return
        body = bytes(c.buf[end + 4 : end + 4 + length])
        del c.buf[: end + 4 + length]
        self.sel.unregister(c.sock)  # one request at a time: no pipelining
        self._forward(c, head[0], body)

    def _forward(self, c: _Client, request_line: str, body: bytes) -> None:
        k = self.next_engine
        self.next_engine = (k + 1) % len(self.engines)
        up = self.idle[k].pop() if self.idle[k] else None
        if up is None:
            s = socket.create_connection(self.engines[k])
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up = _Upstream(s, k)
        host, port = self.engines[k]
        method, path, _ = request_line.split(" ", 2)
        up.sock.setblocking(True)
        up.sock.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        up.sock.setblocking(False)
        up.client, up.tail, up.in_body = c, b"", False
        self.stats["requests"] += 1
        self.sel.register(up.sock, selectors.EVENT_READ, up)

    def _from_engine(self, up: _Upstream) -> None:
        if up.resting or up.sock.fileno() < 0:  # resting, or dropped while it rested
            return
        try:
            data = up.sock.recv(1 << 16)
        except BlockingIOError:
            # nothing came while it rested: wait on the socket
            if self.sel.get_map().get(up.sock) is None:
                self.sel.register(up.sock, selectors.EVENT_READ, up)
            return
        self.stats["engine_reads"] += 1
        c = up.client
        assert c is not None
        try:
            if not data:  # the engine closed: so does this answer
                raise ConnectionResetError
            c.sock.setblocking(True)
            c.sock.sendall(data)
            c.sock.setblocking(False)
        except OSError:  # either side gone: both connections closed
            self._drop(up)
            if self.sel.get_map().get(c.sock) is not None:
                self.sel.unregister(c.sock)
            c.sock.close()
            return
        seen = up.tail + data
        if not up.in_body:  # a header may end in "0" (a request id): not the end
            end = seen.find(b"\r\n\r\n")
            if end < 0:
                up.tail = seen
                self._rest(up)
                return
            up.in_body, seen = True, seen[end + 4 :]
        tail = seen[-len(_LAST_CHUNK) :]
        if tail == _LAST_CHUNK:  # the answer is whole: both connections kept
            if self.sel.get_map().get(up.sock) is not None:
                self.sel.unregister(up.sock)
            up.client = None
            self.idle[up.engine].append(up)
            self.sel.register(c.sock, selectors.EVENT_READ, c)
            if c.buf:
                self._from_client(c)
            return
        up.tail = tail
        self._rest(up)

    def _rest(self, up: _Upstream) -> None:
        """Leave a stream unread until the next tick of the coalescing grid (as
        TokenFleet's pump does)."""
        if self.coalesce_s > 0:
            if self.sel.get_map().get(up.sock) is not None:
                self.sel.unregister(up.sock)
            up.resting = True
            self.seq += 1
            # on a shared grid, so one wake-up reads every resting stream
            due = (time.monotonic() // self.coalesce_s + 1) * self.coalesce_s
            heapq.heappush(self.timers, (due, self.seq, up))

    def _drop(self, up: _Upstream) -> None:
        if self.sel.get_map().get(up.sock) is not None:
            self.sel.unregister(up.sock)
        up.sock.close()


def serve(args: argparse.Namespace) -> int:
    relay = BareRelay(args.port, args.engine_urls.split(","), args.coalesce_ms / 1000.0)

    def stop(*_: Any) -> None:
        Path(args.stats).write_text(json.dumps(relay.stats))
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    relay.run()
    return 0


# ---- the measurement ----------------------------------------------------------------------
def start_bare(
    coalesce_ms: float, urls: list[str], log_dir: Path
) -> tuple[str, subprocess.Popen[bytes], Path]:
    from tokenfleet.service.embedded import free_port

    port = free_port()
    stats = log_dir / f"bare-{coalesce_ms:g}.json"
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--serve",
        "--port",
        str(port),
        "--engine-urls",
        ",".join(urls),
        "--coalesce-ms",
        str(coalesce_ms),
        "--stats",
        str(stats),
    ]
    log = open(log_dir / f"bare-{coalesce_ms:g}.log", "wb")  # noqa: SIM115 - closed by the process
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bare relay did not start: {log.name}") from None
            time.sleep(0.1)
    return url, proc, stats


def measure(front: str, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from benchmarks import live_routers
    from benchmarks.cpu_per_request import _Caller, make_prompt, tree_cpu_s

    engines = live_routers.Engines(args.engines, log_dir, seed=args.seed)
    proc: subprocess.Popen[bytes] | None = None
    stats: Path | None = None
    out: dict[str, Any] = {"front": front, "requests": args.requests}
    try:
        kind, _, opt = front.partition(":")
        if kind == "bare":
            url, proc, stats = start_bare(float(opt or 0), engines.urls, log_dir)
        else:
            bin_dir = live_routers.routers_venv(args.routers_venv)
            url, proc = live_routers.start_rust_router(kind, opt, engines, bin_dir, log_dir)
        model = live_routers._model(engines.urls[0])
        client = _Caller(url, timeout_s=120)
        bodies = [
            {
                "model": model,
                "stream": True,
                "stream_options": {"include_usage": True},
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "messages": make_prompt(args.prompt_tokens, 0.7, i),
            }
            for i in range(-3, args.requests)
        ]
        errors: list[str] = []
        sizes: list[int] = []
        lock = threading.Lock()

        def one(body: dict[str, Any]) -> None:
            try:
                n = client.call(body)
                with lock:
                    sizes.append(n)
            except Exception as exc:  # noqa: BLE001
                with lock:
                    errors.append(f"{exc.__class__.__name__}: {str(exc)[:80]}")

        for body in bodies[:3]:  # warm: the shared prefix cached, connections open
            one(body)
        time.sleep(1.0)
        sizes.clear()
        cpu0 = tree_cpu_s(proc.pid) or 0.0
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=64) as pool:
            for k, body in enumerate(bodies[3:]):
                delay = t0 + k / args.rate - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(one, body)
        cpu1 = tree_cpu_s(proc.pid) or 0.0
        out.update(
            {
                "errors": len(errors),
                "cpu_ms_per_request": round((cpu1 - cpu0) * 1e3 / args.requests, 2),
                "answer_bytes_mean": round(sum(sizes) / max(1, len(sizes))),
            }
        )
        if errors:
            out["first_error"] = errors[0]
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        engines.stop()
        if stats is not None and stats.exists():
            s = json.loads(stats.read_text())
            # the warm-up's three requests are in the relay's counts
            out["engine_reads_per_request"] = round(s["engine_reads"] / max(1, s["requests"]), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fronts", default="bare:0,bare:20,bare:50,sglang:cache_aware,vllm:kv_aware")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rate", type=float, default=5.0, help="requests/s, open loop")
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--output-tokens", type=int, default=256)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--routers-venv", type=Path, default=ROOT / ".venv-routers")
    ap.add_argument("--json", type=Path, default=None)
    # the bare relay's own process
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--engine-urls", default="", help=argparse.SUPPRESS)
    ap.add_argument("--coalesce-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--stats", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args)
    rows = []
    with tempfile.TemporaryDirectory(prefix="relay-floor-") as d:
        fronts = [f for f in args.fronts.split(",") if f]
        for k, front in enumerate(fronts, 1):
            print(
                f"[{k}/{len(fronts)}] {front}: {args.requests} requests at {args.rate:g}/s",
                flush=True,
            )
            row = measure(front, args, Path(d))
            rows.append(row)
            print("   ", json.dumps(row), flush=True)
    print()
    print("| front | CPU ms per request | engine reads per request | errors |")
    print("| --- | ---: | ---: | ---: |")
    for r in rows:
        reads = r.get("engine_reads_per_request", "")
        print(f"| {r['front']} | {r['cpu_ms_per_request']:.2f} | {reads} | {r['errors']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
