"""Memory of the API process under the attacks of issue #16: random bearer keys, huge bodies.

Starts an embedded Redis and PostgreSQL and ``tokenfleet api`` as its own
process (so its RSS is the API's alone), then:

1. ``--keys`` requests (default 20,000) to ``GET /v1/models``, each with a
   random bearer key of ``--key-chars`` characters (default 6 KB: refused
   before any lookup), then as many with random 40-character keys (looked up
   in Redis and PostgreSQL, and remembered as unknown: the bounded cache);
2. a 300 MB chat body with its ``Content-Length`` (answered 413 before it is
   read), the same body chunked (cut off at ``max_body_bytes``), and a 300 MB
   file upload with its ``Content-Length``.

It prints the API's RSS (MiB) before and after each step, its peak during
each body, and its RSS after a pause.
Not a timing benchmark: the numbers are memory, so the machine's load does not
change them much. ``--repo DIR`` runs the API from another checkout (e.g. an
export of an older commit) for a before/after comparison::

    .venv/bin/python benchmarks/api_limits.py [--keys 20000] [--repo /tmp/base]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.support

MiB = 1024 * 1024


def rss_mib(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / MiB, 1)


class PeakRss:
    """The highest RSS of ``pid`` while the ``with`` block runs (sampled every 20 ms):
    what the API held at worst, which the RSS after a step does not show (large
    buffers go back to the OS when freed)."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid = pid
        self.peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_mib = max(self.peak_mib, rss_mib(self.pid))
            self._stop.wait(0.02)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_mib = max(self.peak_mib, rss_mib(self.pid))


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the API exited with {proc.returncode}")
        try:
            requests.get(url + "/health", timeout=1)
            return
        except requests.RequestException:
            time.sleep(0.2)
    raise TimeoutError("the API did not start")


def random_keys(url: str, n: int, chars: int, threads: int = 8) -> dict[int, int]:
    """``n`` requests with random keys of ``chars`` characters; {status: count}."""
    import threading

    import requests

    local = threading.local()

    def one(_: int) -> int:
        s = getattr(local, "s", None)
        if s is None:
            s = local.s = requests.Session()
        key = "tf-" + secrets.token_urlsafe(chars)[: max(1, chars - 3)]
        return int(
            s.get(
                url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30
            ).status_code
        )

    counts: dict[int, int] = {}
    with ThreadPoolExecutor(threads) as pool:
        for status in pool.map(one, range(n)):
            counts[status] = counts.get(status, 0) + 1
    return counts


def declared_body(url: str, path: str, size: int, ctype: str, key: str) -> int | str:
    """Send ``size`` bytes with their ``Content-Length`` (from another thread, stopping
    if the server closes) and read the answer: its status."""
    import threading

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(
            (
                f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {size}\r\n\r\n"
            ).encode()
        )

        def send() -> None:
            block = b"{" * MiB
            try:
                for _ in range(size // MiB):
                    sock.sendall(block)
            except OSError:
                pass  # answered (413) and closed before the rest was needed

        t = threading.Thread(target=send, daemon=True)
        t.start()
        try:
            line = sock.makefile("rb").readline()
        except OSError as exc:
            return f"no answer ({exc.__class__.__name__})"
        finally:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            t.join(timeout=60)
        return int(line.split()[1]) if line else "connection closed without an answer"


def chunked_body(url: str, size: int, key: str) -> int | str:
    """``size`` bytes of chat JSON without Content-Length: the status, or how it failed."""
    import requests

    def gen() -> Any:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        sent = 0
        block = b"x" * MiB
        while sent < size:
            yield block
            sent += len(block)
        yield b'"}]}'

    try:
        r = requests.post(
            url + "/v1/chat/completions",
            data=gen(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=120,
        )
        return r.status_code
    except requests.RequestException as exc:  # the server answered and closed mid-upload
        return f"connection closed by the server ({exc.__class__.__name__})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=20_000)
    ap.add_argument("--key-chars", type=int, default=6 * 1024)
    ap.add_argument("--body-mb", type=int, default=300)
    ap.add_argument("--pause-s", type=float, default=10.0)
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout the API runs from")
    args = ap.parse_args(argv)

    from tests.support.stores import (
        embedded_postgres,
        embedded_redis,
        fresh_database,
        temp_data_dir,
    )
    from tokenfleet.service.embedded import free_port

    with (
        temp_data_dir("tokenfleet-limits-") as d,
        embedded_redis(d) as r,
        embedded_postgres(d) as pg,
    ):
        db = fresh_database(pg)
        port = free_port()
        key = "tf-bench-" + secrets.token_hex(8)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENFLEET_")}
        env.update(
            TOKENFLEET_REDIS_URL=r.url,
            TOKENFLEET_DATABASE_URL=db,
            TOKENFLEET_DATA_DIR=str(d),
            TOKENFLEET_API_KEY=key,
            PYTHONPATH=str(args.repo.resolve()),
        )
        log = open(d / "api.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen(
            [sys.executable, "-m", "tokenfleet.cli.main", "api", "--port", str(port)]
            + ["--admission", "none", "--loglevel", "WARNING"],
            env=env,
            cwd=str(args.repo),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        url = f"http://127.0.0.1:{port}"
        out: dict[str, Any] = {"repo": str(args.repo)}
        try:
            wait_up(url, proc)
            size = args.body_mb * MiB
            out["rss_start_mib"] = rss_mib(proc.pid)
            t0 = time.monotonic()
            out["long_keys"] = random_keys(url, args.keys, args.key_chars)
            out["rss_after_long_keys_mib"] = rss_mib(proc.pid)
            out["short_keys"] = random_keys(url, args.keys, 40)
            out["rss_after_short_keys_mib"] = rss_mib(proc.pid)
            out["keys_s"] = round(time.monotonic() - t0, 1)
            with PeakRss(proc.pid) as peak:
                out["declared_body_status"] = declared_body(
                    url, "/v1/chat/completions", size, "application/json", key
                )
            out["peak_during_declared_body_mib"] = peak.peak_mib
            out["rss_after_declared_body_mib"] = rss_mib(proc.pid)
            with PeakRss(proc.pid) as peak:
                out["chunked_body"] = chunked_body(url, size, key)
            out["peak_during_chunked_body_mib"] = peak.peak_mib
            out["rss_after_chunked_body_mib"] = rss_mib(proc.pid)
            with PeakRss(proc.pid) as peak:
                out["upload_status"] = declared_body(
                    url, "/v1/files", size, "multipart/form-data; boundary=x", key
                )
            out["peak_during_upload_mib"] = peak.peak_mib
            out["rss_after_upload_mib"] = rss_mib(proc.pid)
            time.sleep(args.pause_s)
            out[f"rss_after_{args.pause_s:g}s_pause_mib"] = rss_mib(proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
