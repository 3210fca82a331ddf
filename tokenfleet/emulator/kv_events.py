"""vLLM-compatible KV-cache events over ZeroMQ: publisher and subscriber.

Wire format, after ``vllm/distributed/kv_events.py`` (``ZmqEventPublisher``):
every message is three frames ``(topic, seq, payload)`` where ``seq`` is an
8-byte big-endian counter and ``payload`` a msgpack ``EventBatch``
``[ts, events, data_parallel_rank]``. Events are msgspec tagged structs:

- ``"map"`` (vLLM since PR #42892): ``{"type": "BlockStored", "block_hashes":
  [...], "parent_block_hash": h|None, "token_ids": [...], "block_size": 16,
  "lora_id": None, "medium": "GPU", "lora_name": None}``,
  ``{"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}``,
  ``{"type": "AllBlocksCleared"}``;
- ``"array"`` (older vLLM, ``array_like=True``): the same fields positionally,
  tag first: ``["BlockStored", hashes, parent, token_ids, block_size,
  lora_id, medium]``.

The subscriber accepts both, and a batch given as a map, so it can consume a
real vLLM as well as the emulator. vLLM's publisher *binds* when the endpoint
has a wildcard (``tcp://*:5557``) or is ipc/inproc and *connects* otherwise;
the subscriber applies the same rule by default, so a subscriber given
``tcp://host:5557`` connects to an engine bound on ``tcp://*:5557``. The
emulator binds to whatever endpoint it is given unless told to connect
(``--kv-events-connect``, for llm-d's layout where one indexer binds and
many engines connect). The replay socket is not implemented: a gap in
``seq`` is counted in :attr:`KVEventSubscriber.missed` and the consumer
should treat its index for that instance as stale.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from tokenfleet.core.types import BLOCK_SIZE_TOKENS, KVEvent
from tokenfleet.errors import ConfigError
from tokenfleet.tokenizer import split_engine_blocks

EVENT_FORMATS = ("map", "array")
MEDIUM_GPU = "GPU"
#: the OffloadingConnector's CPU tier (``CPULoadStoreSpec.medium()``)
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


RawEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: wildcard, ipc and inproc endpoints bind."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# -- codec ------------------------------------------------------------------
def encode_event(event: RawEvent, fmt: str = "map") -> Any:
    if isinstance(event, BlockStored):
        if fmt == "array":
            return [
                "BlockStored",
                list(event.block_hashes),
                event.parent_block_hash,
                list(event.token_ids),
                event.block_size,
                None,
                event.medium,
            ]
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        if fmt == "array":
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}


def encode_batch(
    ts: float, events: Sequence[RawEvent], fmt: str = "map", data_parallel_rank: int = 0
) -> bytes:
    body = [ts, [encode_event(e, fmt) for e in events], data_parallel_rank]
    out = msgpack.packb(body, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _hashes(value: Any) -> tuple[int, ...]:
    # vLLM sends a hash as bytes when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0; its
    # int form (the default) is the digest's last 8 bytes (maybe_convert_block_hash)
    out: list[int] = []
    for h in value or ():
        if isinstance(h, (bytes, bytearray)):
            out.append(int.from_bytes(h, "big") & 0xFFFFFFFFFFFFFFFF)
        else:
            out.append(int(h))
    return tuple(out)


def _medium(value: Any) -> str:
    """vLLM leaves ``medium`` None for the GPU block pool in older releases."""
    return str(value) if value else MEDIUM_GPU


def decode_event(raw: Any) -> RawEvent | None:
    """One event, map or array encoded; unknown tags give ``None``."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
        if tag == "BlockStored":
            parent = fields.get("parent_block_hash")
            return BlockStored(
                _hashes(fields.get("block_hashes")),
                _hashes([parent])[0] if parent is not None else None,
                tuple(fields.get("token_ids") or ()),
                int(fields.get("block_size") or 0),
                _medium(fields.get("medium")),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(_hashes(fields.get("block_hashes")), _medium(fields.get("medium")))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(raw, (list, tuple)) and raw:
        tag = raw[0]
        if tag == "BlockStored" and len(raw) >= 5:
            parent = raw[2]
            return BlockStored(
                _hashes(raw[1]),
                _hashes([parent])[0] if parent is not None else None,
                tuple(raw[3] or ()),
                int(raw[4] or 0),
                _medium(raw[6] if len(raw) > 6 else None),
            )
        if tag == "BlockRemoved" and len(raw) >= 2:
            return BlockRemoved(_hashes(raw[1]), _medium(raw[2] if len(raw) > 2 else None))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    return None


def decode_batch(payload: bytes) -> tuple[float, list[RawEvent]]:
    """``(ts, events)`` of one payload; the batch may be an array or a map."""
    body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if isinstance(body, dict):
        ts, raw_events = body.get("ts", 0.0), body.get("events") or []
    else:
        ts, raw_events = body[0], body[1]
    events = [e for e in (decode_event(r) for r in raw_events) if e is not None]
    return float(ts), events


def to_kv_events(
    instance_id: str, events: Sequence[RawEvent], block_size_tokens: int = BLOCK_SIZE_TOKENS
) -> list[KVEvent]:
    """Router events; an engine's bigger blocks become several router blocks
    (:func:`tokenfleet.tokenizer.split_engine_blocks`). ``BlockRemoved`` has no
    block size: it is the engine's, from ``block_size_tokens`` or a
    ``BlockStored`` earlier in the batch."""
    out: list[KVEvent] = []
    size = block_size_tokens
    for e in events:
        if isinstance(e, BlockStored):
            size = e.block_size or size
            hashes = split_engine_blocks(e.block_hashes, size)
            out.append(KVEvent(instance_id, "stored", hashes, medium=e.medium))
        elif isinstance(e, BlockRemoved):
            hashes = split_engine_blocks(e.block_hashes, size)
            out.append(KVEvent(instance_id, "removed", hashes, medium=e.medium))
        else:
            out.append(KVEvent(instance_id, "cleared", ()))
    return out


# -- publisher ----------------------------------------------------------------
class KVEventPublisher:
    """PUB socket fed from a queue by its own thread (sockets are not thread-safe).

    ``bind=None`` applies vLLM's bind-or-connect heuristic to the endpoint.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        fmt: str = "map",
        hwm: int = 100_000,
        bind: bool | None = None,
    ) -> None:
        if fmt not in EVENT_FORMATS:
            raise ConfigError(
                f"KV event format '{fmt}' is unknown; use one of {', '.join(EVENT_FORMATS)}"
            )
        if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"KV events endpoint '{endpoint}' must look like "
                "tcp://HOST:PORT (connect) or tcp://*:PORT (bind)"
            )
        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self.fmt = fmt
        self._queue: queue.SimpleQueue[tuple[float, list[RawEvent]] | None] = queue.SimpleQueue()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.binds = bind if bind is not None else _binds(endpoint)
        try:
            if self.binds:
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ConfigError(
                f"cannot open KV events endpoint '{endpoint}': {exc}; "
                "pick a free port or a valid address"
            ) from None
        last = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        #: the address subscribers should use (a bound ``:*`` port resolved)
        self.resolved_endpoint = last.decode() if isinstance(last, bytes) and last else endpoint
        self._seq = 0
        self.published_batches = 0
        self._thread = threading.Thread(target=self._run, name="kv-events-pub", daemon=True)
        self._thread.start()

    def publish(self, events: list[RawEvent]) -> None:
        if events:
            self._queue.put((time.time(), events))

    def _run(self) -> None:
        sock = self._sock
        while True:
            item = self._queue.get()
            if item is None:
                break
            ts, events = item
            payload = encode_batch(ts, events, self.fmt)
            sock.send_multipart((self.topic, self._seq.to_bytes(8, "big"), payload))
            self._seq += 1
            self.published_batches += 1
        sock.close(linger=0)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)


# -- subscriber ---------------------------------------------------------------
class KVEventSubscriber:
    """SUB socket that turns vLLM KV event batches into :class:`KVEvent`.

    ``instance_id`` names the publisher; when ``None`` the message topic is
    used (llm-d publishes ``kv@<pod-ip>:<port>@<model>``), or the endpoint
    when the topic is empty. Not thread-safe: poll it from one thread.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        instance_id: str | None = None,
        bind: bool | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.instance_id = instance_id
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        do_bind = bind if bind is not None else _binds(endpoint)
        try:
            if do_bind:
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise ConfigError(
                f"cannot open KV events endpoint '{endpoint}': {exc}; "
                "pick a free port or a valid address"
            ) from None
        self._last_seq: dict[bytes, int] = {}
        self.missed = 0
        self.batches = 0
        #: the engine's block size, learnt from its BlockStored events
        self.block_size_tokens = BLOCK_SIZE_TOKENS

    @property
    def last_endpoint(self) -> str:
        """The bound address (resolves ``tcp://127.0.0.1:*`` to a real port)."""
        value = self._sock.getsockopt(zmq.LAST_ENDPOINT)
        return value.decode() if isinstance(value, bytes) else str(value)

    def poll(self, timeout_s: float = 0.0, max_batches: int = 1000) -> list[KVEvent]:
        """Events received within ``timeout_s`` (returns early once any arrive)."""
        out: list[KVEvent] = []
        wait_ms = int(timeout_s * 1000)
        for _ in range(max_batches):
            if not self._sock.poll(wait_ms):
                break
            wait_ms = 0
            frames = self._sock.recv_multipart()
            if len(frames) != 3:
                continue
            topic, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            last = self._last_seq.get(topic)
            if last is not None and seq > last + 1:
                self.missed += seq - last - 1
            self._last_seq[topic] = seq
            self.batches += 1
            _, events = decode_batch(payload)
            inst = self.instance_id or topic.decode("utf-8", "replace") or self.endpoint
            for e in events:
                if isinstance(e, BlockStored) and e.block_size:
                    self.block_size_tokens = e.block_size
            out.extend(to_kv_events(inst, events, self.block_size_tokens))
        return out

    def close(self) -> None:
        self._sock.close(linger=0)
