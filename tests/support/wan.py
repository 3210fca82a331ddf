"""A WAN link between two datacenters on one machine: a TCP proxy that delays.

``tc netem`` is not available on the test machines, so each cross-datacenter
connection of a multi-DC test goes through a :class:`WanLink`: bytes are
forwarded in order, each chunk delivered ``one_way_ms`` after it arrived (the
link's latency, not a bandwidth cap: chunks are pipelined as on a real WAN).
A test can slow the link (``one_way_ms``), cut it (every connection closed,
new ones refused: the remote DC is unreachable) and heal it.

It runs an asyncio loop in a daemon thread and listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any


class WanLink:
    def __init__(self, target_host: str, target_port: int, one_way_ms: float = 20.0) -> None:
        self.target = (target_host, target_port)
        self.one_way_ms = one_way_ms
        self.port = 0
        self._cut = False
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wan-link", daemon=True)
        #: chunks forwarded in both directions (a test can see traffic crossed)
        self.chunks = 0

    @classmethod
    def to_url(cls, url: str, one_way_ms: float = 20.0) -> tuple[WanLink, str]:
        """A started link in front of ``redis://host:port/db``-style ``url``, and
        the same URL through the link."""
        scheme, rest = url.split("://", 1)
        hostport, _, tail = rest.partition("/")
        auth, _, hostport = hostport.rpartition("@")
        host, _, port = hostport.rpartition(":")
        link = cls(host, int(port), one_way_ms).start()
        prefix = f"{auth}@" if auth else ""
        return link, f"{scheme}://{prefix}127.0.0.1:{link.port}/{tail}"

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> WanLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("WAN link did not start")
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        fut = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        with contextlib.suppress(Exception):
            fut.result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- what a test does to the link -------------------------------------------------
    def cut(self) -> None:
        """The link goes down: open connections are reset, new ones refused."""
        self._cut = True
        fut = asyncio.run_coroutine_threadsafe(self._drop_all(), self._loop)
        fut.result(5)

    def heal(self) -> None:
        self._cut = False

    # -- inside the loop --------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._accept, "127.0.0.1", 0)
        )
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._drop_all()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _drop_all(self) -> None:
        for w in list(self._writers):
            with contextlib.suppress(Exception):
                w.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut:
            writer.transport.abort()
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_w))
        await asyncio.gather(
            self._pipe(reader, up_w), self._pipe(up_r, writer), return_exceptions=True
        )
        for w in (writer, up_w):
            self._writers.discard(w)
            with contextlib.suppress(Exception):
                w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Forward ``src`` to ``dst``, each chunk ``one_way_ms`` late, in order."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()
                self.chunks += 1
            with contextlib.suppress(Exception):
                dst.write_eof()

        sender: Any = asyncio.ensure_future(deliver())
        try:
            while data := await src.read(65536):
                queue.put_nowait((time.monotonic() + self.one_way_ms / 1000.0, data))
        finally:
            queue.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await sender
