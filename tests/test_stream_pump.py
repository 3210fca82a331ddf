"""The stream pump on its own: socket pairs stand in for the engine and the
client, so how it coalesces and when it reads can be checked exactly."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from typing import Any

from tests.support.pump import FakeEngineCall
from tokenfleet.live.gateway.pump import PumpResult, PumpSink, StreamPump


def _event(text: str) -> bytes:
    body = b"data: " + json.dumps({"choices": [{"delta": {"content": text}}]}).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(body), body)


_END = (
    b"data: "
    + json.dumps(
        {"choices": [{"delta": {}, "finish_reason": "stop"}], "usage": {"completion_tokens": 9}}
    ).encode()
    + b"\n\ndata: [DONE]\n\n"
)
_LAST = b"%x\r\n%s\r\n0\r\n\r\n" % (len(_END), _END)


def _carry(pump: StreamPump, coalesce_s: float, engine_script: Any) -> tuple[PumpResult, bytes]:
    """Run ``engine_script(send)`` on a thread as the engine; returns the pump's
    result and every byte the client received."""
    pump_engine, engine = socket.socketpair()
    pump_client, client = socket.socketpair()
    call = FakeEngineCall(pump_engine)
    engine_thread = threading.Thread(target=engine_script, args=(engine.sendall,))
    engine_thread.start()
    sink = PumpSink(
        pump_client, lambda text: b"data: " + text.encode() + b"\n\n", chunked=lambda: False
    )
    result = pump.carry(call, sink, coalesce_s=coalesce_s, stall_s=5.0)  # type: ignore[arg-type]
    engine_thread.join()
    pump_client.close()
    received = b""
    while chunk := client.recv(65536):
        received += chunk
    for s in (pump_engine, engine, client):
        s.close()
    assert result is not None
    return result, received


def test_a_coalescing_pump_merges_flushes_and_keeps_every_token() -> None:
    """Nine tokens flushed 5 ms apart, read every 40 ms: all of them reach the
    client in order, in fewer chunks than flushes, and the usage is kept."""

    def engine(send: Any) -> None:
        for i in range(8):
            send(_event(f"t{i} "))
            time.sleep(0.005)
        send(_event("t8 ") + _LAST)

    pump = StreamPump()
    try:
        result, received = _carry(pump, 0.04, engine)
    finally:
        pump.close()
    assert result.error is None and not result.client_failed
    assert result.tokens == 9 and result.finish_reason == "stop"
    assert result.usage == {"completion_tokens": 9}
    texts = [line[6:].decode() for line in received.split(b"\n\n") if line.startswith(b"data: ")]
    assert "".join(texts) == "".join(f"t{i} " for i in range(9))
    assert 1 <= len(texts) < 9  # merged: at most one chunk per 40 ms of ~45 ms of flushes


def test_a_stream_that_pauses_past_the_coalescing_interval_is_still_read() -> None:
    """When nothing has come by the time a read is due, the pump waits on the
    socket instead: tokens after a pause arrive."""

    def engine(send: Any) -> None:
        send(_event("a "))
        time.sleep(0.3)  # many due reads find nothing
        send(_event("b "))
        time.sleep(0.3)
        send(_LAST)

    pump = StreamPump()
    try:
        result, received = _carry(pump, 0.02, engine)
    finally:
        pump.close()
    assert result.error is None and result.tokens == 2
    assert b"data: a \n\n" in received and b"data: b \n\n" in received


def test_a_stream_aborted_while_it_rests_between_reads_ends_with_the_reason() -> None:
    """The watch thread aborts a call (client gone, lease lost) by shutting its
    socket; a job resting until its next read ends with that reason."""
    pump = StreamPump()
    pump_engine, engine = socket.socketpair()
    pump_client, client = socket.socketpair()
    call = FakeEngineCall(pump_engine)
    sink = PumpSink(pump_client, lambda text: text.encode(), chunked=lambda: False)
    out: list[PumpResult | None] = []
    t = threading.Thread(
        target=lambda: out.append(pump.carry(call, sink, coalesce_s=0.05, stall_s=5.0))  # type: ignore[arg-type]
    )
    try:
        t.start()
        engine.sendall(_event("x "))
        time.sleep(0.1)
        call.abort("client went away")
        t.join(timeout=5.0)
        assert not t.is_alive()
    finally:
        pump.close()
        for s in (pump_engine, engine, pump_client, client):
            s.close()
    result = out[0]
    assert result is not None and result.error is not None
    assert result.error.status == 499 and "client went away" in str(result.error)


#: a token's text with escapes and the shape of the event's own keys
_TRICKY = '\\ "choices": [{"index": 0, "delta": {"content": "x"}}]} \n\t'


def _events(shapes: list[dict[str, Any]], compact: bool, done: bool = True) -> bytes:
    sep = (",", ":") if compact else (", ", ": ")
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return b"".join(
        b"data: "
        + json.dumps({**head, **s}, separators=sep, ensure_ascii=compact).encode()
        + b"\n\n"
        for s in shapes
    ) + (b"data: [DONE]\n\n" if done else b"")


def _delta(content: Any = None, finish: str | None = None, **delta: Any) -> dict[str, Any]:
    if content is not None:
        delta["content"] = content
    return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def test_plain_token_events_read_by_the_shortcut_equal_the_full_parse(monkeypatch: Any) -> None:
    """The shortcut for plain token events gives what parsing every event gives,
    for vLLM's compact JSON and the emulator's spaced JSON, with escapes,
    non-ASCII text, quotes that look like the event's own keys, and the events
    it must leave to the full parse (role, finish reason, usage, extra fields)."""
    from tokenfleet.live import engine_client

    tricky = _TRICKY
    shapes = [
        _delta("", role="assistant"),
        _delta("Hello"),
        _delta(" wörld ✓"),
        _delta(tricky),
        _delta(""),
        {**_delta(" more"), "usage": {"completion_tokens": 3}},
        {
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": " x"},
                    "logprobs": None,
                    "finish_reason": None,
                    "stop_reason": None,
                }
            ]
        },
        _delta(" end", finish="length"),
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 6}},
    ]
    for compact in (True, False):
        block = _events(shapes, compact)
        fast = engine_client._parse_events(block)
        monkeypatch.setattr(engine_client, "_PLAIN_DELTA", re.compile(rb"(?!)"))
        full = engine_client._parse_events(block)
        monkeypatch.undo()
        assert fast == full
        assert fast is not None and fast.tokens == 6 and fast.finish_reason == "length"
        assert fast.text == "Hello wörld ✓" + tricky + " more x end"
        assert fast.usage == {"prompt_tokens": 5, "completion_tokens": 6}


class _NoSearch:
    """A stand-in for the per-line pattern that fails the test when used."""

    def search(self, line: bytes) -> Any:
        raise AssertionError(f"read line by line: {line[:60]!r}")


def test_a_flush_of_plain_token_events_is_read_in_one_pass(monkeypatch: Any) -> None:
    """Mid-stream a flush holds token events only: one pass over the block
    reads them (the per-line pattern is not used), with the same text and
    count as the full parse; a block with anything else, or a token whose
    text says ``data:``, goes line by line and still agrees."""
    from tokenfleet.live import engine_client

    tricky = _TRICKY
    plain = [_delta("Hello"), _delta(" wörld ✓"), _delta(tricky), _delta(""), _delta(" end")]
    for compact in (True, False):
        block = _events(plain, compact, done=False)
        with monkeypatch.context() as m:
            m.setattr(engine_client, "_PLAIN_DELTA", _NoSearch())
            fast = engine_client._parse_events(block)
        with monkeypatch.context() as m:
            m.setattr(engine_client, "_PLAIN_DELTA", re.compile(rb"(?!)"))
            m.setattr(engine_client, "_PLAIN_EVENTS", re.compile(rb"(?!)"))
            full = engine_client._parse_events(block)
        assert fast == full
        assert fast is not None and fast.tokens == 4
        assert fast.text == "Hello wörld ✓" + tricky + " end"
        for other in ([*plain, _delta(" data: y")], [*plain, _delta(" z", finish="stop")]):
            block = _events(other, compact, done=False)
            got = engine_client._parse_events(block)
            with monkeypatch.context() as m:
                m.setattr(engine_client, "_PLAIN_DELTA", re.compile(rb"(?!)"))
                m.setattr(engine_client, "_PLAIN_EVENTS", re.compile(rb"(?!)"))
                assert got == engine_client._parse_events(block)
            assert got is not None and got.tokens == 5
