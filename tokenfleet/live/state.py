"""Live state in Redis: instance snapshots, dispatch accounting, tier shares,
per-request idempotency state, cancel flags and queue depths.

Everything the router needs to decide is here, so any number of API replicas
make decisions from the same view. Request state is the idempotency record of
the request path (the ledger's ``request_id`` upsert is the billing one):

``tf:req:<rid>`` holds ``status`` (queued, running, done), ``attempt``,
``first_token`` and the final status; ``tf:lease:<rid>`` exists while a worker
runs the current attempt and is renewed by it. The transitions are Lua
scripts, atomic in Redis, so a task redelivered by the broker (acks_late +
reject_on_worker_lost), a retry the API sends after a worker died, and the
original delivery can race without the engine ever running one attempt twice.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import redis

from tokenfleet.core.types import (
    DispatchAccounting,
    InstanceView,
    KVEvent,
    RequestInfo,
    ScrapedMetrics,
)
from tokenfleet.engine.profiles import EngineProfile, get_profile
from tokenfleet.live.redis_pack import use_hiredis_packing

#: DispatchAccounting fields kept in Redis, in dataclass order
ACCOUNTING_FIELDS = tuple(DispatchAccounting.__slots__)
#: the accounting field a worker's tier gate reads (its pool opens while it is under
#: budget); a booking that moves it publishes on the instance's :meth:`LiveState.gate_channel`
GATED_FIELD = "prefill_pending_uncached_tokens"

# -- Lua: request state transitions -------------------------------------------------
_CLAIM = """
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return 'missing' end
if st == 'done' then return 'done' end
if redis.call('EXISTS', KEYS[3]) == 1 then return 'cancelled' end
if redis.call('EXISTS', KEYS[2]) == 1 then return 'busy' end
local att = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '1')
if att ~= tonumber(ARGV[1]) then return 'stale' end
if redis.call('HGET', KEYS[1], 'first_token') == '1' then return 'started' end
redis.call('HSET', KEYS[1], 'status', 'running', 'owner', ARGV[2], 'claimed_at', ARGV[4],
           'instance', ARGV[5], 'received_at', ARGV[6])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
-- start-of-run bookkeeping in the same step: queue depth, dispatch accounting
if ARGV[7] ~= '' then redis.call('HINCRBY', KEYS[5], ARGV[7], -1) end
local n = tonumber(ARGV[8])
for i = 9, 8 + 2 * n, 2 do redis.call('HINCRBY', KEYS[4], ARGV[i], ARGV[i + 1]) end
-- the direct path's hand-over too (KEYS[6]: the relay stream, KEYS[7]: the
-- worker's outcome reader's wake-up stream; ARGV: stream TTL, then the fields)
if #KEYS >= 7 then
  local g = 9 + 2 * n
  redis.call('XADD', KEYS[6], '*', unpack(ARGV, g + 1, #ARGV))
  redis.call('EXPIRE', KEYS[6], ARGV[g])
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', '64', '*', 'w', '1')
  redis.call('EXPIRE', KEYS[7], '3600')
end
return 'run'
"""

# KEYS: (req, lease) of each request; one call renews a worker's whole set
_RENEW = """
local n = 0
for i = 1, #KEYS, 2 do
  if redis.call('PEXPIRE', KEYS[i + 1], ARGV[2]) == 1 then
    n = n + 1
  elseif redis.call('HGET', KEYS[i], 'status') == 'running'
      and redis.call('HGET', KEYS[i], 'owner') == ARGV[1] then
    redis.call('SET', KEYS[i + 1], ARGV[1], 'PX', ARGV[2])
    n = n + 1
  end
end
return n
"""
#: requests per renewal script call or cancel-flag MGET: a worker holding
#: a thousand streams sends a few commands a tick, not a thousand, and no
#: single script holds Redis for long
_BATCH_KEYS = 256

_REDISPATCH = """
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'queued' and st ~= 'running' then return -1 end
if redis.call('HGET', KEYS[1], 'first_token') == '1' then return -2 end
local att = tonumber(redis.call('HGET', KEYS[1], 'attempt') or '1')
if att ~= tonumber(ARGV[1]) then return -3 end
if ARGV[4] == '' then
  if redis.call('EXISTS', KEYS[2]) == 1 then return -4 end
else
  if redis.call('GET', KEYS[2]) ~= ARGV[4] then return -4 end
  redis.call('DEL', KEYS[2])
end
if att >= tonumber(ARGV[2]) then return -5 end
redis.call('HSET', KEYS[1], 'attempt', att + 1, 'status', 'queued', 'queue', ARGV[3],
           'owner', '', 'queued_at', ARGV[5])
return att + 1
"""

_FINISH = """
local st = redis.call('HGET', KEYS[1], 'status')
if st == 'done' then return {0, redis.call('HGET', KEYS[1], 'final') or ''} end
if ARGV[2] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[2]
   and redis.call('EXISTS', KEYS[2]) == 1 then
  return {0, 'busy'}
end
redis.call('HSET', KEYS[1], 'status', 'done', 'final', ARGV[1])
redis.call('DEL', KEYS[2])
if #ARGV > 3 then
  -- the winner's terminal stream entry, in the same step (saves a round trip)
  local fields = {}
  for i = 4, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('XADD', KEYS[3], '*', unpack(fields))
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[3]))
end
return {1, ARGV[1]}
"""


@dataclass(slots=True)
class InstanceInfo:
    """One engine instance as registered by its worker, plus the last scrape."""

    instance_id: str
    dc: str
    model: str
    url: str
    profile: str
    max_model_len_tokens: int
    kv_capacity_tokens: int
    slots: int
    model_version: str = ""
    #: the served model's tokenizer directory (a real vLLM serving a local
    #: model: the API hashes prompts as it does); "" for the byte tokenizer
    tokenizer: str = ""
    #: the engine's KV block size (0: the router's 16 tokens)
    block_size_tokens: int = 0
    #: P/D role ("mixed", "prefill", "decode"; :mod:`tokenfleet.core.routing.pd_base`)
    role: str = "mixed"
    #: the engine's URL as the API reaches it ("": :attr:`url`; a worker's
    #: ``--public-engine-url``), for the API's own attempts (express dispatch)
    api_url: str = ""
    #: the worker relays the engine's own KV events (else the API publishes
    #: the prompt's blocks at its first token)
    exact_kv: bool = False
    metrics: ScrapedMetrics = field(default_factory=ScrapedMetrics)
    heartbeat_at_s: float = float("-inf")
    unhealthy_until_s: float = 0.0
    unhealthy_reason: str = ""
    running_by_tier: dict[str, int] = field(default_factory=dict)

    def age_s(self, now_s: float) -> float:
        """Seconds since the worker last wrote this snapshot."""
        return now_s - self.heartbeat_at_s

    def is_live(self, now_s: float, stale_after_s: float) -> bool:
        return self.age_s(now_s) <= stale_after_s

    def is_healthy(self, now_s: float, stale_after_s: float) -> bool:
        return (
            self.is_live(now_s, stale_after_s)
            and self.metrics.healthy
            and now_s >= self.unhealthy_until_s
        )


def _static_facts(info: InstanceInfo) -> dict[str, Any]:
    """What a worker registers about its engine (rewritten with snapshots)."""
    return {
        "dc": info.dc,
        "model": info.model,
        "model_version": info.model_version,
        "url": info.url,
        "profile": info.profile,
        "max_model_len": info.max_model_len_tokens,
        "kv_capacity_tokens": info.kv_capacity_tokens,
        "slots": info.slots,
        "tokenizer": info.tokenizer,
        "block_size": info.block_size_tokens,
        "role": info.role,
        "api_url": info.api_url,
        "exact_kv": int(info.exact_kv),
    }


def _f(raw: Mapping[bytes, bytes], key: str, default: float = 0.0) -> float:
    v = raw.get(key.encode())
    return float(v) if v not in (None, b"") else default


def _i(raw: Mapping[bytes, bytes], key: str, default: int = 0) -> int:
    v = raw.get(key.encode())
    return int(float(v)) if v not in (None, b"") else default


def _s(raw: Mapping[bytes, bytes], key: str, default: str = "") -> str:
    v = raw.get(key.encode())
    return v.decode() if v is not None else default


def _accounting(
    raw: Mapping[bytes, bytes], less: Mapping[str, int] | None = None
) -> DispatchAccounting:
    """An instance's accounting hash as stored, minus ``less`` (no field below 0)."""
    acct = DispatchAccounting()
    for name in ACCOUNTING_FIELDS:
        setattr(acct, name, max(0, _i(raw, name) - (less.get(name, 0) if less else 0)))
    return acct


def _hash(raw: Any) -> Mapping[bytes, bytes]:
    """An ``HGETALL`` reply as read off the connection: a flat list in RESP2."""
    if isinstance(raw, dict):
        return raw
    return dict(zip(raw[::2], raw[1::2], strict=True))


class PendingRead:
    """Commands written to a pooled connection now, their replies read when
    wanted, by whichever thread asks first (:meth:`result` is idempotent).

    Why not a pipeline: a request's dispatch needs the shared accounting and
    the queue depths that it starts reading at arrival; a pipeline, or the
    refresh thread reading for it, holds the reply until both the round trip
    and a thread hand-off are done, so the request waited 0.15 ms at the
    median (0.44 at p90) after its parsing and hashing were over
    (docs/benchmarks.md, section 25). Written here, the commands run on Redis
    while the request thread parses, and the replies are usually waiting in
    the socket by the time the dispatch reads them. The connection goes back
    to the pool when they are read (or dropped, on an error)."""

    def __init__(self, state: LiveState, ids: list[str], commands: list[tuple[str, str]]) -> None:
        self.ids = ids
        self.sent_at = time.monotonic()
        self._state = state
        self._n = len(commands)
        self._lock = threading.Lock()
        self._result: tuple[dict[str, DispatchAccounting], dict[str, int]] | None = None
        self._error: BaseException | None = None
        pool = state.r.connection_pool
        self._conn: Any = pool.get_connection()
        try:
            conn = self._conn
            conn.send_packed_command(conn.pack_commands(commands))  # type: ignore[no-untyped-call]
        except BaseException:
            self._drop()
            raise

    def result(self) -> tuple[dict[str, DispatchAccounting], dict[str, int]]:
        """(accounting by instance, queue depths); raises what reading raised."""
        with self._lock:
            if self._result is None and self._error is None:
                try:
                    raws = [self._conn.read_response() for _ in range(self._n)]
                    for raw in raws:
                        if isinstance(raw, BaseException):
                            raise raw
                except BaseException as exc:  # noqa: BLE001 - kept, raised to every caller
                    self._error = exc
                    self._drop()
                else:
                    self._state.r.connection_pool.release(self._conn)
                    self._conn = None
                    accts = {i: _accounting(_hash(r)) for i, r in zip(self.ids, raws, strict=False)}
                    queued = {k.decode(): max(0, int(v)) for k, v in _hash(raws[-1]).items()}
                    self._result = (accts, queued)
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return self._result

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
            self._state.r.connection_pool.release(conn)


class LiveState:
    """Typed access to the live keys; one object per process, thread-safe
    (redis-py clients use a connection pool)."""

    def __init__(self, client: redis.Redis, prefix: str = "tf") -> None:
        self.r = client
        self.p = prefix
        self._claim = client.register_script(_CLAIM)
        self._redispatch = client.register_script(_REDISPATCH)
        self._renew = client.register_script(_RENEW)
        self._finish = client.register_script(_FINISH)
        self._profiles: dict[str, EngineProfile] = {}

    @classmethod
    def from_url(cls, url: str, prefix: str = "tf", **kwargs: Any) -> LiveState:
        opts: dict[str, Any] = {
            "socket_connect_timeout": 1.0,
            "socket_timeout": 5.0,
            "health_check_interval": 10,
            "max_connections": 2000,
        }
        opts.update(kwargs)
        pool = redis.BlockingConnectionPool.from_url(url, timeout=5.0, **opts)
        use_hiredis_packing(pool)
        return cls(redis.Redis(connection_pool=pool), prefix)

    # -- key names ----------------------------------------------------------------
    def k(self, *parts: str) -> str:
        return ":".join((self.p,) + parts)

    def stream_key(self, request_id: str) -> str:
        return self.k("stream", request_id)

    # -- instances ------------------------------------------------------------------
    def register_instance(self, info: InstanceInfo) -> None:
        key = self.k("inst", info.instance_id)
        with self.r.pipeline() as pipe:
            pipe.sadd(self.k("instances"), info.instance_id)
            pipe.hset(key, mapping={**_static_facts(info), "heartbeat_at": time.time()})
            pipe.execute()

    def publish_snapshot(
        self,
        instance_id: str,
        m: ScrapedMetrics,
        running_by_tier: Mapping[str, int] | None = None,
        info: InstanceInfo | None = None,
    ) -> None:
        """Write the last scrape. With ``info`` the static facts are rewritten
        too, so a Redis that lost its data (restart without persistence, flush)
        learns the instance again within one scrape interval."""
        mapping: dict[str, Any] = {
            "scraped_at": m.scraped_at_s,
            "num_running": m.num_running,
            "num_waiting": m.num_waiting,
            "kv_usage": m.kv_usage,
            "prefix_queries_total": m.prefix_queries_total,
            "prefix_hits_total": m.prefix_hits_total,
            "external_hits_total": m.external_hits_total,
            "healthy": int(m.healthy),
            "heartbeat_at": time.time(),
        }
        if running_by_tier is not None:
            mapping["running_by_tier"] = json.dumps(dict(running_by_tier))
        if info is None:
            self.r.hset(self.k("inst", instance_id), mapping=mapping)
            return
        mapping.update(_static_facts(info))
        with self.r.pipeline(transaction=False) as pipe:
            pipe.sadd(self.k("instances"), instance_id)
            pipe.hset(self.k("inst", instance_id), mapping=mapping)
            pipe.execute()

    def mark_unhealthy(self, instance_id: str, for_s: float, reason: str) -> None:
        self.r.hset(
            self.k("inst", instance_id),
            mapping={"unhealthy_until": time.time() + for_s, "unhealthy_reason": reason[:200]},
        )

    def deregister_instance(self, instance_id: str) -> None:
        with self.r.pipeline() as pipe:
            pipe.srem(self.k("instances"), instance_id)
            pipe.delete(self.k("inst", instance_id), self.k("acct", instance_id))
            pipe.execute()

    def instances(self) -> list[InstanceInfo]:
        ids = sorted(x.decode() for x in self.r.smembers(self.k("instances")))
        if not ids:
            return []
        with self.r.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self.k("inst", i))
            raws = pipe.execute()
        out = []
        for iid, raw in zip(ids, raws, strict=True):
            if not raw:
                continue
            m = ScrapedMetrics(
                scraped_at_s=_f(raw, "scraped_at", float("-inf")),
                num_running=_i(raw, "num_running"),
                num_waiting=_i(raw, "num_waiting"),
                kv_usage=_f(raw, "kv_usage"),
                prefix_queries_total=_i(raw, "prefix_queries_total"),
                prefix_hits_total=_i(raw, "prefix_hits_total"),
                external_hits_total=_i(raw, "external_hits_total"),
                healthy=_i(raw, "healthy", 1) == 1,
            )
            rbt = _s(raw, "running_by_tier")
            out.append(
                InstanceInfo(
                    instance_id=iid,
                    dc=_s(raw, "dc", "local"),
                    model=_s(raw, "model"),
                    model_version=_s(raw, "model_version"),
                    url=_s(raw, "url"),
                    profile=_s(raw, "profile"),
                    max_model_len_tokens=_i(raw, "max_model_len"),
                    kv_capacity_tokens=_i(raw, "kv_capacity_tokens"),
                    slots=_i(raw, "slots", 1),
                    tokenizer=_s(raw, "tokenizer"),
                    block_size_tokens=_i(raw, "block_size"),
                    role=_s(raw, "role", "mixed"),
                    api_url=_s(raw, "api_url"),
                    exact_kv=_i(raw, "exact_kv") == 1,
                    metrics=m,
                    heartbeat_at_s=_f(raw, "heartbeat_at", float("-inf")),
                    unhealthy_until_s=_f(raw, "unhealthy_until"),
                    unhealthy_reason=_s(raw, "unhealthy_reason"),
                    running_by_tier=json.loads(rbt) if rbt else {},
                )
            )
        return out

    def profile(self, name: str) -> EngineProfile:
        prof = self._profiles.get(name)
        if prof is None:
            prof = self._profiles[name] = get_profile(name)
        return prof

    def instance_views(
        self,
        now_s: float,
        stale_after_s: float,
        infos: Sequence[InstanceInfo] | None = None,
        accounting: Callable[[list[str]], Mapping[str, DispatchAccounting]] | None = None,
    ) -> list[InstanceView]:
        """Router views: static facts + last scrape + shared dispatch accounting
        (read now, or from ``accounting``: the API's :class:`AccountingView`).

        An instance whose worker stopped writing (dead or partitioned) is shown
        not ready; one the worker marked unhealthy shows ``metrics.healthy``
        False. Routers filter both through ``eligible()``.
        """
        infos = list(infos) if infos is not None else self.instances()
        accts = (accounting or self.accounting)([i.instance_id for i in infos])
        views = []
        for idx, info in enumerate(infos):
            m = info.metrics
            m.healthy = info.is_healthy(now_s, stale_after_s)
            views.append(
                InstanceView(
                    instance_id=info.instance_id,
                    profile=self.profile(info.profile),
                    dc=info.dc,
                    model=info.model,
                    model_version=info.model_version,
                    ready=info.is_live(now_s, stale_after_s),
                    kv_capacity_tokens=info.kv_capacity_tokens,
                    max_model_len_tokens=info.max_model_len_tokens,
                    metrics=m,
                    accounting=accts.get(info.instance_id, DispatchAccounting()),
                    index=idx,
                    role=info.role,
                )
            )
        return views

    # -- dispatch accounting ------------------------------------------------------------
    def accounting(self, instance_ids: Iterable[str]) -> dict[str, DispatchAccounting]:
        ids = list(instance_ids)
        with self.r.pipeline(transaction=False) as pipe:
            for i in ids:
                pipe.hgetall(self.k("acct", i))
            raws = pipe.execute()
        return {iid: _accounting(raw) for iid, raw in zip(ids, raws, strict=True)}

    def send_accounting_and_queued(self, instance_ids: Iterable[str]) -> PendingRead:
        """Every instance's accounting and the broker queue depths, sent now and
        read later (:meth:`PendingRead.result`): Redis answers while the caller
        works."""
        ids = list(instance_ids)
        keys = [self.k("acct", i) for i in ids] + [self.k("queued")]
        return PendingRead(self, ids, [("HGETALL", k) for k in keys])

    def prefill_pending_uncached(self, instance_id: str) -> int:
        """One field of the instance's accounting: the uncached prompt tokens
        booked there and not prefilled yet, by every API and worker."""
        raw = self.r.hget(self.k("acct", instance_id), GATED_FIELD)
        return int(raw) if raw else 0

    def book_dispatch(
        self, instance_id: str, req: RequestInfo, cached: int
    ) -> tuple[dict[str, int], DispatchAccounting]:
        """Book one dispatch and read back the instance's accounting in the same
        atomic round trip. Returns the deltas written and the accounting as it
        was just before them: every replica's and worker's bookings, including
        those this process's view has not read yet (the booking check)."""
        key = self.k("acct", instance_id)
        delta = {name: d for name, d in self._delta("on_dispatch", req, cached).items() if d}
        with self.r.pipeline(transaction=True) as pipe:
            for name, d in delta.items():
                pipe.hincrby(key, name, d)
            self._nudge_gate(pipe, instance_id, delta)
            pipe.hgetall(key)
            raw = pipe.execute()[-1]
        return delta, _accounting(raw, less=delta)

    def unbook(self, instance_id: str, delta: Mapping[str, int]) -> None:
        """Take back a :meth:`book_dispatch` whose decision changed."""
        self._acct_delta(instance_id, {name: -d for name, d in delta.items()})

    def api_heartbeat(self, api_id: str, now_s: float, fresh_s: float) -> int:
        """Record this API process as alive at ``now_s`` and count the others
        alive within ``fresh_s`` (one round trip; stale entries are removed)."""
        key = self.k("apis")
        with self.r.pipeline(transaction=False) as pipe:
            pipe.hset(key, api_id, now_s)
            pipe.hgetall(key)
            raw = pipe.execute()[-1]
        others, stale = 0, []
        for k, v in raw.items():
            name = k.decode()
            if name == api_id:
                continue
            if now_s - float(v) <= fresh_s:
                others += 1
            elif now_s - float(v) > 10 * fresh_s:
                stale.append(name)
        if stale:
            self.r.hdel(key, *stale)
        return others

    def acct_raw(self, instance_id: str) -> dict[bytes, bytes]:
        """The instance's accounting hash as stored (for :meth:`clear_acct_if`)."""
        return dict(self.r.hgetall(self.k("acct", instance_id)))

    def clear_acct_if(self, instance_id: str, seen: Mapping[bytes, bytes]) -> bool:
        """Zero the instance's accounting if it still holds exactly ``seen``
        (WATCH/MULTI: a booking written meanwhile wins, nothing is cleared).
        ``dispatched_total`` is a count, not load, and stays: a router tells
        shared accounting from its own by that total exceeding its own
        dispatches, which a reset to 0 would hide for as long as it took the
        others to dispatch that many again."""
        key = self.k("acct", instance_id)
        with self.r.pipeline() as pipe:
            try:
                pipe.watch(key)  # type: ignore[no-untyped-call]
                now = dict(pipe.hgetall(key))
                if now != dict(seen):
                    return False
                pipe.multi()
                pipe.delete(key)
                if int(now.get(GATED_FIELD.encode(), 0) or 0):
                    pipe.publish(self.gate_channel(instance_id), 1)
                total = now.get(b"dispatched_total")
                if total is not None and int(total) > 0:
                    pipe.hset(key, "dispatched_total", int(total))
                pipe.execute()
                return True
            except redis.WatchError:
                return False

    def _acct_delta(self, instance_id: str, delta: Mapping[str, int]) -> None:
        key = self.k("acct", instance_id)
        with self.r.pipeline(transaction=False) as pipe:
            for name, d in delta.items():
                if d:
                    pipe.hincrby(key, name, d)
            self._nudge_gate(pipe, instance_id, delta)
            pipe.execute()

    def gate_channel(self, instance_id: str) -> str:
        """Pub/sub channel that says the instance's booked prefill changed: its
        worker's tier gate re-reads it then (:class:`workers.runtime.WorkerRuntime`)
        instead of polling the accounting 20 times a second."""
        return self.k("gate", instance_id)

    def _nudge_gate(self, pipe: Any, instance_id: str, delta: Mapping[str, int]) -> None:
        """In the same round trip as a booking: wake the instance's gate when
        the booking moves the prefill it gates pool work by."""
        if delta.get(GATED_FIELD):
            pipe.publish(self.gate_channel(instance_id), 1)

    @staticmethod
    def _delta(fn_name: str, req: RequestInfo, cached: int, **kw: Any) -> dict[str, int]:
        """Field deltas of one DispatchAccounting transition (reuses its own rules)."""
        acct = DispatchAccounting()
        getattr(acct, fn_name)(req, expected_cached_tokens=cached, **kw)
        return {name: getattr(acct, name) for name in ACCOUNTING_FIELDS}

    def batch(self) -> Batch:
        """Several small writes in one round trip (``with state.batch() as b: ...``)."""
        return Batch(self)

    def account_first_token(self, instance_id: str, req: RequestInfo, cached: int) -> None:
        self._acct_delta(instance_id, self._delta("on_first_token", req, cached))

    def account_finish(
        self, instance_id: str, req: RequestInfo, got_first_token: bool, cached: int
    ) -> None:
        self._acct_delta(
            instance_id, self._delta("on_finish", req, cached, got_first_token=got_first_token)
        )

    # -- tier shares and admission thresholds (written by beat) -----------------------------
    def set_shares(
        self, shares: Mapping[str, float], thresholds: Mapping[str, float | None] | None = None
    ) -> None:
        with self.r.pipeline() as pipe:
            pipe.hset(self.k("shares"), mapping={t: float(s) for t, s in shares.items()})
            if thresholds:
                vals = {t: ("" if v is None else float(v)) for t, v in thresholds.items()}
                pipe.hset(self.k("thresholds"), mapping=vals)
            pipe.hset(self.k("control"), mapping={"updated_at": time.time()})
            pipe.execute()

    def shares(self) -> dict[str, float]:
        return {k.decode(): float(v) for k, v in self.r.hgetall(self.k("shares")).items()}

    def thresholds(self) -> dict[str, float | None]:
        return {
            k.decode(): (float(v) if v else None)
            for k, v in self.r.hgetall(self.k("thresholds")).items()
        }

    def spill_shares(self) -> dict[str, float]:
        """FleetMind's spill shares per datacenter, as beat's long cycle wrote them."""
        shares: dict[str, float] = {}
        for k, v in self.r.hgetall(self.k("fleet")).items():
            key = k.decode()
            if key.startswith("spill_share:"):
                try:
                    shares[key.partition(":")[2]] = float(v)
                except ValueError:
                    continue
        return shares

    def replica_targets(self) -> dict[tuple[str, str, str], int]:
        """FleetMind's replica target per (dc, model, version), as beat's long
        cycle wrote it (``target:<dc>|<model>|<version>``); {} before the first plan."""
        out: dict[tuple[str, str, str], int] = {}
        for k, v in self.r.hgetall(self.k("fleet")).items():
            key = k.decode()
            if not key.startswith("target:"):
                continue
            dc, _, rest = key.removeprefix("target:").partition("|")
            model, _, version = rest.rpartition("|")
            try:
                out[(dc, model, version)] = int(v)
            except ValueError:
                continue
        return out

    # -- prompt_cache_key pins ------------------------------------------------------------
    def pin(self, tenant: str, key: str) -> str | None:
        """The instance a tenant's ``prompt_cache_key`` is pinned to, if any."""
        raw = self.r.get(self.k("pck", tenant, key))
        return raw.decode() if raw is not None else None

    def set_pin(self, tenant: str, key: str, instance_id: str, ttl_s: int) -> None:
        self.r.set(self.k("pck", tenant, key), instance_id, ex=ttl_s)

    def renew_pin(self, tenant: str, key: str, ttl_s: int) -> None:
        self.r.expire(self.k("pck", tenant, key), ttl_s)

    # -- counters (read by the control loop) -------------------------------------------------
    def count(self, **deltas: int) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for name, d in deltas.items():
                pipe.hincrby(self.k("counters"), name, d)
            pipe.execute()

    def counters(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self.r.hgetall(self.k("counters")).items()}

    # -- queue depths (for tier yielding; broker-independent) ---------------------------------
    def queued_incr(self, queue: str, n: int = 1) -> None:
        self.r.hincrby(self.k("queued"), queue, n)

    def queued(self) -> dict[str, int]:
        return {k.decode(): max(0, int(v)) for k, v in self.r.hgetall(self.k("queued")).items()}

    # -- request state ----------------------------------------------------------------
    def set_request_status(self, rid: str, status: str) -> None:
        """Put a request back in ``status`` (the API undoing a re-send the broker refused)."""
        self.r.hset(self.k("req", rid), "status", status)

    def _req_keys(self, rid: str) -> list[str]:
        return [self.k("req", rid), self.k("lease", rid), self.k("cancel", rid)]

    def create_request(self, rid: str, queue: str, ttl_s: float, **extra: Any) -> bool:
        """First dispatch; False if the id is already known (client retried it)."""
        key = self.k("req", rid)
        if not self.r.hsetnx(key, "created", time.time()):
            return False
        mapping = {
            "status": "queued",
            "attempt": 1,
            "first_token": 0,
            "queue": queue,
            "queued_at": time.time(),
            **extra,
        }
        with self.r.pipeline() as pipe:
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, int(ttl_s))
            pipe.execute()
        return True

    def request_state(self, rid: str) -> dict[str, str]:
        raw = self.r.hgetall(self.k("req", rid))
        return {k.decode(): v.decode() for k, v in raw.items()}

    def lease_alive(self, rid: str) -> bool:
        return bool(self.r.exists(self.k("lease", rid)))

    def claim(
        self,
        rid: str,
        attempt: int,
        owner: str,
        lease_ttl_s: float,
        instance_id: str,
        received_at: float | None = None,
        *,
        queue: str = "",
        dispatch: tuple[RequestInfo, int] | None = None,
        go: tuple[str, Mapping[str, Any], float, str] | None = None,
    ) -> str:
        """'run' | 'done' | 'busy' | 'stale' | 'started' | 'cancelled' | 'missing'.

        On 'run' the same atomic step takes the request off ``queue``'s depth
        and, with ``dispatch`` = (request, expected cached tokens), books it in
        the instance's dispatch accounting: one round trip to start a request.
        With ``go`` = (relay stream, ``go`` entry, stream TTL s, wake-up stream
        of the reader the worker waits on) it also hands the engine call to
        the API (the direct path), which otherwise took a second round trip.
        """
        now = time.time()
        args: list[Any] = [
            attempt,
            owner,
            int(lease_ttl_s * 1000),
            now,
            instance_id,
            received_at or now,
            queue,
        ]
        pairs: list[Any] = []
        if dispatch is not None:
            for name, d in self._delta("on_dispatch", dispatch[0], dispatch[1]).items():
                if d:
                    pairs += [name, d]
        args += [len(pairs) // 2, *pairs]
        keys = self._req_keys(rid) + [self.k("acct", instance_id), self.k("queued")]
        if go is not None:
            stream, fields, ttl_s, wake = go
            keys += [stream, wake]
            args.append(int(ttl_s))
            for name, value in fields.items():
                args += [name, value]
        out = self._claim(keys=keys, args=args)
        return out.decode() if isinstance(out, bytes) else str(out)

    def renew_leases(self, rids: Iterable[str], lease_ttl_s: float, owner: str = "") -> None:
        """Extend each lease; with ``owner``, also take back a lease that lapsed
        while this worker still runs the request (status running, owner it): a
        worker starved of CPU for longer than the lease is not a lost one, and a
        re-send or a settle since then (owner reset, status moved on) wins."""
        ms = int(lease_ttl_s * 1000)
        rids = list(rids)
        with self.r.pipeline(transaction=False) as pipe:
            for i in range(0, len(rids), _BATCH_KEYS):
                chunk = rids[i : i + _BATCH_KEYS]
                if owner:
                    keys = [k for rid in chunk for k in self._req_keys(rid)[:2]]
                    self._renew(keys=keys, args=[owner, ms], client=pipe)
                else:
                    for rid in chunk:
                        pipe.pexpire(self.k("lease", rid), ms)
            pipe.execute()

    def mark_first_token(self, rid: str) -> None:
        self.r.hset(self.k("req", rid), "first_token", 1)

    def redispatch(
        self, rid: str, attempt: int, max_attempts: int, queue: str, owner: str = ""
    ) -> int:
        """Move attempt ``attempt`` to a new one on ``queue``; the new attempt
        number, or < 0: -1 finished, -2 streaming already, -3 someone else
        moved it, -4 still leased, -5 out of attempts."""
        return int(
            self._redispatch(
                keys=self._req_keys(rid)[:2],
                args=[attempt, max_attempts, queue, owner, time.time()],
            )
        )

    def finish(
        self,
        rid: str,
        status: str,
        owner: str = "",
        end_event: Mapping[str, Any] | None = None,
        stream_ttl_s: float = 120.0,
    ) -> tuple[bool, str]:
        """Settle the final status once; (won, final status). ``end_event``: stream
        entry fields the winner appends to the request's relay stream atomically."""
        args: list[Any] = [status, owner, int(stream_ttl_s)]
        for k, v in (end_event or {}).items():
            args += [k, v]
        won, final = self._finish(keys=self._req_keys(rid)[:2] + [self.stream_key(rid)], args=args)
        return bool(won), final.decode() if isinstance(final, bytes) else str(final)

    def cancel(self, rid: str, ttl_s: float = 600.0) -> None:
        self.r.set(self.k("cancel", rid), 1, ex=int(ttl_s))

    def cancelled(self, rids: Sequence[str]) -> set[str]:
        if not rids:
            return set()
        with self.r.pipeline(transaction=False) as pipe:
            for i in range(0, len(rids), _BATCH_KEYS):
                pipe.mget([self.k("cancel", rid) for rid in rids[i : i + _BATCH_KEYS]])
            flags = [f for reply in pipe.execute() for f in reply]
        return {rid for rid, f in zip(rids, flags, strict=True) if f is not None}

    # -- shared prefix index feed ----------------------------------------------------------
    def publish_kv_events(self, events: Sequence[KVEvent], maxlen: int = 200_000) -> None:
        if not events:
            return
        with self.r.pipeline(transaction=False) as pipe:
            for ev in events:
                fields = {
                    "i": ev.instance_id,
                    "k": ev.kind,
                    "h": msgpack.packb(list(ev.block_hashes)),
                }
                if not ev.exact:
                    fields["x"] = 0  # inferred, not reported by the engine
                if not ev.on_gpu:
                    fields["m"] = ev.medium  # a lower tier (vLLM's offloading: "CPU")
                pipe.xadd(
                    self.k("kv"),
                    fields,
                    maxlen=maxlen,
                    approximate=True,
                )
            pipe.execute()

    def read_kv_events(
        self, last_id: str, block_ms: int | None = None, count: int = 1000
    ) -> tuple[str, list[KVEvent]]:
        resp = self.r.xread({self.k("kv"): last_id}, count=count, block=block_ms)
        out: list[KVEvent] = []
        for _key, entries in resp or ():
            for eid, fields in entries:
                last_id = eid.decode()
                out.append(
                    KVEvent(
                        fields[b"i"].decode(),
                        fields[b"k"].decode(),
                        tuple(msgpack.unpackb(fields[b"h"])),
                        exact=fields.get(b"x", b"1") != b"0",
                        medium=fields.get(b"m", b"GPU").decode(),
                    )
                )
        return last_id, out


class Batch:
    """Buffered writes sent as one pipeline on exit (no transaction)."""

    def __init__(self, state: LiveState) -> None:
        self.state = state
        self.pipe = state.r.pipeline(transaction=False)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        try:
            if exc_type is None:
                self.pipe.execute()
        finally:
            self.pipe.reset()

    def account(
        self,
        instance_id: str,
        fn: str,
        req: RequestInfo,
        cached: int,
        already: Mapping[str, int] | None = None,
        **kw: Any,
    ) -> dict[str, int]:
        """A DispatchAccounting transition (``on_dispatch``, ``on_first_token``,
        ``on_finish``) of one instance; returns its field deltas. ``already``:
        deltas written before (``LiveState.book_dispatch``); only the rest is
        written now."""
        key = self.state.k("acct", instance_id)
        delta = {name: d for name, d in LiveState._delta(fn, req, cached, **kw).items() if d}
        before = already or {}
        written: dict[str, int] = {}
        for name in delta.keys() | before.keys():
            d = delta.get(name, 0) - before.get(name, 0)
            if d:
                self.pipe.hincrby(key, name, d)
                written[name] = d
        self.state._nudge_gate(self.pipe, instance_id, written)
        return delta

    def queued(self, queue: str, n: int) -> None:
        self.pipe.hincrby(self.state.k("queued"), queue, n)

    def count(self, **deltas: int) -> None:
        for name, d in deltas.items():
            self.pipe.hincrby(self.state.k("counters"), name, d)

    def create_request(self, rid: str, queue: str, ttl_s: float, **extra: Any) -> None:
        key = self.state.k("req", rid)
        now = time.time()
        self.pipe.hset(
            key,
            mapping={
                "created": now,
                "status": "queued",
                "attempt": 1,
                "first_token": 0,
                "queue": queue,
                "queued_at": now,
                **extra,
            },
        )
        self.pipe.expire(key, int(ttl_s))

    def first_token(self, rid: str) -> None:
        self.pipe.hset(self.state.k("req", rid), "first_token", 1)

    def own_request(self, rid: str, owner: str, lease_ttl_s: float, instance_id: str) -> None:
        """The claim of a request this batch creates (:meth:`create_request`),
        taken by ``owner`` at once: the API's express dispatch. No script is
        needed: nobody else knows the fresh id before the batch runs."""
        now = time.time()
        self.pipe.hset(
            self.state.k("req", rid),
            mapping={
                "status": "running",
                "owner": owner,
                "claimed_at": now,
                "received_at": now,
                "instance": instance_id,
            },
        )
        self.pipe.set(self.state.k("lease", rid), owner, px=int(lease_ttl_s * 1000))

    def xadd(self, key: str, fields: Mapping[str, Any], ttl_s: float | None = None) -> None:
        self.pipe.xadd(key, dict(fields))
        if ttl_s is not None:
            self.pipe.expire(key, int(ttl_s))

    def kv_events(self, events: Sequence[KVEvent], maxlen: int = 200_000) -> None:
        for ev in events:
            self.pipe.xadd(
                self.state.k("kv"),
                {"i": ev.instance_id, "k": ev.kind, "h": msgpack.packb(list(ev.block_hashes))},
                maxlen=maxlen,
                approximate=True,
            )
