"""Replay a trace against a live TokenFleet API and measure what clients see.

Each trace request becomes a streamed chat completion sent at its (scaled)
arrival time. Prompts are synthesised so prefix sharing in the trace becomes
byte-identical prefixes on the wire: engine block ``j`` of a request is 64
bytes (16 tokens at the emulator's 4 bytes per token) derived from its
chained block hash, so two requests share leading text exactly as long as
they share leading block hashes. The true output length goes to the engine
through ``vllm_xargs.output_tokens`` (an engine-side knob the policies never
see; ``max_tokens`` stays the trace's budget). Results are summarised by
:func:`tokenfleet.sim.metrics.summarize`, so the JSON has the same shape as
``tokenfleet sim --json``.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import BLOCK_SIZE_TOKENS
from tokenfleet.live.httpclient import KeepAliveClient
from tokenfleet.sim.records import RequestRecord
from tokenfleet.workloads.trace import TraceRequest

if TYPE_CHECKING:
    from tokenfleet.sim.cluster import PathLatency

BYTES_PER_BLOCK = BLOCK_SIZE_TOKENS * 4
_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def block_text(block_hash: int) -> str:
    """64 printable bytes determined by one chained block hash."""
    digest = hashlib.blake2b(str(block_hash).encode(), digest_size=48).digest()
    words = []
    for i in range(0, 48, 4):
        chunk = digest[i : i + 4]
        words.append("".join(_ALPHABET[b % 26] for b in chunk))
    text = " ".join(words) + " "
    return text[:BYTES_PER_BLOCK].ljust(BYTES_PER_BLOCK, ".")


def prompt_text(req: TraceRequest) -> str:
    """Text of ``input_tokens`` tokens whose full blocks follow the block hashes."""
    hashes = req.info.block_hashes
    n_full = req.info.input_tokens // BLOCK_SIZE_TOKENS
    parts = [block_text(h) for h in hashes[:n_full]]
    for j in range(len(parts), n_full):  # a trace without hashes: unique blocks
        parts.append(block_text(hash((req.info.request_id, j))))
    tail_tokens = req.info.input_tokens - n_full * BLOCK_SIZE_TOKENS
    if tail_tokens:
        parts.append(block_text(hash((req.info.request_id, "tail")))[: 4 * tail_tokens])
    return "".join(parts)


@dataclass(slots=True)
class Outcome:
    request: TraceRequest
    tier: str
    sent_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    status: str = "pending"
    output_tokens: int = 0
    cached_tokens: int = 0
    http_status: int = 0
    error: str = ""
    #: the API's id for the request (``X-Request-Id``), to join with its ledger row
    api_request_id: str = ""
    #: ``time.time()`` when it was sent, to line it up with server-side timestamps
    sent_wall: float = 0.0


class _Client(KeepAliveClient):
    """One keep-alive connection per sender thread, to ``<url>/v1``."""

    def __init__(
        self, url: str, api_key: str, timeout_s: float, keys: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(url, timeout_s)
        if not self.path.endswith("/v1"):
            self.path += "/v1"
        self.api_key = api_key
        self.keys = dict(keys or {})  # tenant -> key, for multi-tenant scenarios

    def key_for(self, tenant: str) -> str:
        return self.keys.get(tenant, self.api_key)

    #: send an ``X-Request-Id`` of our own (front doors that forward it to the
    #: engine can then be joined with the engine's request log)
    send_request_ids: bool = False
    #: edits each request body before it is sent (e.g. a front door that drops
    #: ``vllm_xargs`` gets the output length as ``ignore_eos`` + ``max_tokens``)
    body_hook: Callable[[dict[str, Any], TraceRequest], None] | None = None


def _one(client: _Client, out: Outcome, model: str, clock: Callable[[], float]) -> None:
    req = out.request
    body = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.info.max_tokens,
        "messages": [{"role": "user", "content": prompt_text(req)}],
        "vllm_xargs": {"output_tokens": max(1, req.output_tokens)},
    }
    if client.body_hook is not None:
        client.body_hook(body, req)
    payload = json.dumps(body).encode()
    headers = {
        "Authorization": f"Bearer {client.key_for(req.info.tenant)}",
        "Content-Type": "application/json",
        "X-TokenFleet-Tier": out.tier,
    }
    own_id = ""
    if client.send_request_ids:
        own_id = headers["X-Request-Id"] = uuid.uuid4().hex
    try:
        out.sent_s = clock()
        out.sent_wall = time.time()
        resp = client.request("POST", "/chat/completions", body=payload, headers=headers)
        out.http_status = resp.status
        out.api_request_id = resp.getheader("X-Request-Id") or own_id
        if resp.status != 200:
            raw = resp.read()
            out.status = "rejected" if resp.status == 429 else "failed"
            out.error = raw[:300].decode("utf-8", "replace")
            out.finish_s = clock()
            return
        buf = b""
        errored = False
        while True:
            data = resp.read1(65536)
            if not data:
                break
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"event: error"):
                    errored = True
                    out.error = event[:300].decode("utf-8", "replace")
                    continue
                if not event.startswith(b"data: "):
                    continue
                data_s = event[6:]
                if data_s == b"[DONE]":
                    continue
                chunk = json.loads(data_s)
                if chunk.get("usage"):
                    u = chunk["usage"]
                    out.output_tokens = int(u.get("completion_tokens", 0))
                    out.cached_tokens = int(
                        (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                    )
                for ch in chunk.get("choices") or ():
                    if (ch.get("delta") or {}).get("content") and out.first_token_s is None:
                        out.first_token_s = clock()
        out.finish_s = clock()
        out.status = "failed" if errored else "completed"
    except (OSError, http.client.HTTPException, ValueError) as exc:
        client.drop()
        out.status = "failed"
        out.error = repr(exc)[:300]
        out.finish_s = clock()


def replay(
    url: str | Sequence[str],
    api_key: str,
    requests: Sequence[TraceRequest],
    *,
    model: str,
    slo: SLOConfig | None = None,
    max_inflight: int = 512,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    tenant_keys: Mapping[str, str] | None = None,
    send_request_ids: bool = False,
    body_hook: Callable[[dict[str, Any], TraceRequest], None] | None = None,
) -> tuple[list[Outcome], float]:
    """Send every request at its arrival time (relative to now); returns the
    outcomes and the wall-clock span of the run. ``tenant_keys``: the API key
    of each tenant the requests name (others use ``api_key``). Several URLs:
    the requests go to them in turn, as a load balancer over API replicas."""
    slo = slo or SLOConfig()
    clients = []
    for u in [url] if isinstance(url, str) else url:
        client = _Client(u, api_key, timeout_s, tenant_keys)
        client.send_request_ids = send_request_ids
        client.body_hook = body_hook
        clients.append(client)
    start = time.monotonic()
    base = requests[0].arrival_s if requests else 0.0

    def clock() -> float:
        return time.monotonic() - start

    outs = [Outcome(r, classify(r.info, slo), r.arrival_s - base) for r in requests]
    done = [0]
    lock = threading.Lock()

    def run(k: int, o: Outcome) -> None:
        _one(clients[k % len(clients)], o, model, clock)
        if progress is not None:
            with lock:
                done[0] += 1
                progress(done[0], len(outs))

    with ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="bench") as pool:
        for k, o in enumerate(outs):
            delay = o.sent_s - clock()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run, k, o)
    return outs, clock()


def to_records(outs: Sequence[Outcome]) -> list[RequestRecord]:
    """Client-side outcomes as simulator records (arrival = when it was sent)."""
    recs = []
    for o in outs:
        info = o.request.info
        recs.append(
            RequestRecord(
                request_id=info.request_id,
                tenant=info.tenant,
                tier=o.tier,
                arrival_s=o.sent_s,
                input_tokens=info.input_tokens,
                max_tokens=info.max_tokens,
                dispatched_s=o.sent_s if o.http_status == 200 else None,
                first_token_s=o.first_token_s,
                finish_s=o.finish_s,
                cached_tokens=o.cached_tokens,
                output_tokens=o.output_tokens,
                status=o.status if o.status != "pending" else "failed",
            )
        )
    return recs


def summary(
    outs: Sequence[Outcome], wall_s: float, slo: SLOConfig | None = None, label: str = "live"
) -> dict[str, Any]:
    from tokenfleet.sim.metrics import summarize

    recs = to_records(outs)
    span = max((r.finish_s or r.arrival_s for r in recs), default=0.0)
    out: dict[str, Any] = {"policy": label}
    out.update(summarize(recs, slo or SLOConfig(), duration_s=max(span, 1e-9)))
    out["wall_s"] = wall_s
    errors = [o.error for o in outs if o.error][:5]
    if errors:
        out["sample_errors"] = errors
    return out


def engine_entries(engine_logs: Path) -> dict[str, dict[str, Any]]:
    """The emulators' request logs (``TOKENFLEET_EMULATOR_REQUEST_LOG``, one
    ``*.jsonl`` per engine under ``engine_logs``) by request id: a front door's
    own id as forwarded, and TokenFleet's ``<id>-<attempt>`` under ``<id>``
    (the last attempt)."""
    engine: dict[str, dict[str, Any]] = {}
    for f in sorted(engine_logs.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            e = json.loads(line)
            engine[e["id"]] = e
            engine[e["id"].rsplit("-", 1)[0]] = e
    return engine


def path_delays(outs: Sequence[Outcome], engine_logs: Path) -> list[tuple[int, float, float]]:
    """Per request (prompt tokens, ``dispatch``, ``relay``): seconds from the
    client's send to its engine taking the request, and from the engine step
    that made the first token to the client reading it. The outcomes are
    joined by request id with the emulators' request logs
    (``TOKENFLEET_EMULATOR_REQUEST_LOG``, one ``*.jsonl`` per engine under
    ``engine_logs``)."""
    engine = engine_entries(engine_logs)
    out: list[tuple[int, float, float]] = []
    for o in outs:
        e = engine.get(o.api_request_id)
        if e is None or o.first_token_s is None or not e.get("first_model"):
            continue
        out.append(
            (
                int(e.get("input_tokens") or o.request.info.input_tokens),
                e["submitted"] - o.sent_wall,
                o.sent_wall + (o.first_token_s - o.sent_s) - e["first_model"],
            )
        )
    return out


#: hops every request takes, whichever process calls the engine
_ARRIVAL = (
    ("client -> API arrival", "sent", "arrival"),
    ("API: arrival -> admitted", "arrival", "admitted"),
)
_ENGINE = ("engine: received -> first token", "engine_received", "engine_first")
#: hops of TokenFleet's request path through a worker (the broker, or a hand-over
#: to the worker's slot), in order: (name, from timestamp, to timestamp)
HOPS = (
    *_ARRIVAL,
    ("publish -> worker receives", "admitted", "received"),
    ("worker: received -> claimed", "received", "claimed"),
    ("worker: claimed -> engine call", "claimed", "dispatched"),
    ("worker -> engine receives", "dispatched", "engine_received"),
    _ENGINE,
    ("engine -> worker first token", "engine_first", "worker_first"),
    ("worker -> client first token", "worker_first", "first"),
)
#: hops of an express dispatch (the API called the engine itself, claiming the
#: request as ``api:<id>``: no broker, no worker; the ledger's dispatch stamp is
#: the API's, and its first-token stamp the API's too)
EXPRESS_HOPS = (
    *_ARRIVAL,
    ("express: API -> engine receives", "dispatched", "engine_received"),
    _ENGINE,
    ("express: engine -> API first token", "engine_first", "worker_first"),
    ("express: API -> client first token", "worker_first", "first"),
)


def hop_breakdown(
    traces: Sequence[Mapping[str, Any]],
    ledger_rows: Sequence[Mapping[str, Any]],
    request_state: Callable[[str], Mapping[str, Any]],
    engine_logs: Path,
) -> dict[str, dict[str, float]]:
    """Median and p90 (ms) of each hop on TokenFleet's path: :data:`HOPS` over
    the requests a worker served, then :data:`EXPRESS_HOPS` not already named
    there over those the API called the engine for itself (express dispatch;
    the hops both paths share count both). Hops no request took are left out.

    ``traces`` are the client's wall-clock times per request (``rid``,
    ``sent``, ``first``); they are joined with the ledger (API and worker
    stamps), the request state in Redis (when the worker's consumer received
    the message and claimed it, and who claimed it) and the emulators'
    request logs. Every time is a wall clock of a process on one machine."""
    rows = {r["request_id"]: r for r in ledger_rows}
    engine = engine_entries(engine_logs)

    def ts(x: Any) -> float | None:
        return x.timestamp() if x is not None else None

    per_hop: dict[str, list[float]] = {name: [] for name, _, _ in (*HOPS, *EXPRESS_HOPS)}
    for t in traces:
        rid = t.get("rid")
        row, e = rows.get(rid), engine.get(rid) if rid else None
        if not rid or row is None or e is None:
            continue
        st = request_state(rid)
        point = dict(
            t,
            arrival=ts(row["arrival_ts"]),
            admitted=ts(row["admitted_ts"]),
            received=_float_or_none(st.get("received_at")),
            claimed=_float_or_none(st.get("claimed_at")),
            dispatched=ts(row["dispatched_ts"]),
            engine_received=e["received"],
            engine_first=e["first"],
            worker_first=ts(row["first_token_ts"]),
        )
        express = str(st.get("owner") or "").startswith("api:")
        for name, a, b in EXPRESS_HOPS if express else HOPS:
            if point.get(a) is not None and point.get(b) is not None:
                per_hop[name].append(point[b] - point[a])
    return _p50_p90_ms(per_hop, digits=2)


def _p50_p90_ms(samples: Mapping[str, list[float]], digits: int) -> dict[str, dict[str, float]]:
    """{name: {p50_ms, p90_ms, n}} of each non-empty list of seconds."""

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]

    return {
        name: {
            "p50_ms": round(pct(xs, 0.5) * 1e3, digits),
            "p90_ms": round(pct(xs, 0.9) * 1e3, digits),
            "n": len(xs),
        }
        for name, xs in samples.items()
        if xs
    }


def step_breakdown(
    traces: Sequence[Mapping[str, Any]],
    steps: Mapping[str, Sequence[tuple[str, float]]],
    engine_logs: Path,
) -> dict[str, dict[str, float]]:
    """Median and p90 (ms) of each step of an express request's path to its
    first token: the client's send to the API's app, every step the API
    stamped (:mod:`tokenfleet.live.steps`) up to sending the engine the
    request, the engine's receipt, its own time to the first token, and from
    there every stamped step to the client reading the token. Then the sums:
    the API's own steps before the engine call is sent and after the first
    token comes back. Requests a worker called the engine for are left out
    (their engine call is another process's).

    ``traces``: the client's wall-clock times (:func:`outcome_traces`);
    ``steps``: the API's stamps by request id
    (:func:`tokenfleet.live.steps.read_steps`)."""
    engine = engine_entries(engine_logs)
    per: dict[str, list[float]] = {}

    def add(name: str, a: float, b: float) -> None:
        per.setdefault(name, []).append(b - a)

    for t in traces:
        rid = t.get("rid") or ""
        marks, e = steps.get(rid), engine.get(rid)
        if not marks or e is None:
            continue
        names = [n for n, _ in marks]
        if "engine_sent" not in names or "first_event" not in names:
            continue
        at = dict(marks)
        before = names[: names.index("engine_sent") + 1]
        after = names[names.index("first_event") :]
        add("client sends -> API app", t["sent"], at["app"])
        for a, b in zip(before, before[1:], strict=False):
            add(f"API: {a} -> {b}", at[a], at[b])
        add("API engine_sent -> engine receives", at["engine_sent"], e["received"])
        add("engine: receives -> first token", e["received"], e["first"])
        add("engine first token -> API first_event", e["first"], at["first_event"])
        for a, b in zip(after, after[1:], strict=False):
            add(f"API: {a} -> {b}", at[a], at[b])
        add(f"API {after[-1]} -> client reads it", at[after[-1]], t["first"])
        add("API steps before the engine call is sent", at["app"], at["engine_sent"])
        add("API steps from first_event", at["first_event"], at[after[-1]])
    return _p50_p90_ms(per, digits=3)


def _float_or_none(x: Any) -> float | None:
    return float(x) if x not in (None, "") else None


def outcome_traces(outs: Sequence[Outcome]) -> list[dict[str, Any]]:
    """:func:`hop_breakdown`'s client times of replayed requests."""
    return [
        {
            "rid": o.api_request_id,
            "sent": o.sent_wall,
            "first": o.sent_wall + (o.first_token_s - o.sent_s),
        }
        for o in outs
        if o.api_request_id and o.first_token_s is not None
    ]


def path_latency(outs: Sequence[Outcome], engine_logs: Path) -> PathLatency:
    """The live path's latency as the simulator models it: per direction a
    shifted exponential fitted to :func:`path_delays` (its shift the 1st
    percentile, robust to a stray clock read; its tail mean the sample mean
    above that). Dispatch grows with the prompt on the live path (it is read,
    parsed, hashed and copied at every hop: about 6 ms for 1k-token prompts,
    14 ms for 50k on the 2-core dev box); the fit keeps one distribution for
    all sizes, which is enough for TTFT percentiles."""
    from tokenfleet.sim.cluster import PathLatency

    rows = path_delays(outs, engine_logs)
    if not rows:
        raise ValueError(f"no request could be joined with the engine logs in {engine_logs}")

    def fit(xs: list[float]) -> tuple[float, float]:
        xs = sorted(xs)
        lo = max(0.0, xs[int(0.01 * (len(xs) - 1))])
        return lo, max(0.0, sum(xs) / len(xs) - lo)

    d_min, d_tail = fit([d for _, d, _ in rows])
    r_min, r_tail = fit([r for _, _, r in rows])
    return PathLatency(d_min, d_tail, r_min, r_tail)
