"""Per-tenant quotas, checked and charged in one Redis Lua script at admission.

Why one script: a check-then-increment done in two round trips lets N
concurrent requests all read "10 left" and all pass (the budget overshoot
LiteLLM users report, BerriAI/litellm issues on concurrent spend checks).
Redis runs a script atomically, so every limit of a budget is checked
and, only if all pass, charged, as one step; 50 concurrent requests against
10 left admit exactly 10.

The model (docs/tenancy.md has the long form). Each tenant has two
independent budgets, ``interactive`` and ``batch``; each budget has four
optional limits:

* ``requests_per_minute`` and ``tokens_per_minute``: token buckets holding
  at most one minute's worth, refilled continuously at ``limit / 60`` per
  second. A request costs 1 request and ``prompt_tokens + max_tokens``
  tokens (the output is unknown at admission, so its budget is reserved);
  at completion the unused part of the reservation is refunded.
* ``max_concurrent_requests``: a sorted set of running request tickets, each
  with a lease deadline, so a crashed process cannot leak slots forever.
* ``daily_token_budget``: tokens charged per UTC day, reserved and refunded
  like the per-minute tokens.

Retry-After is the time at which the request *would* pass, computed from the
bucket levels (the maximum over the limits that failed); for the concurrency
limit nobody can know when a running request ends, so it is one second (a
poll hint). A request that can never pass (cost above the bucket size or
the daily budget) gets no Retry-After at all.

The clock is Redis' own ``TIME``, so API processes with skewed clocks agree.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

#: the two budgets of every tenant
BUDGETS: tuple[str, ...] = ("interactive", "batch")

LIMIT_NAMES: tuple[str, ...] = (
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_requests",
    "daily_token_budget",
)

#: OpenAI-style error codes, by limit (returned in ``error.code`` of the 429)
CODE_RPM = "requests_per_minute_exceeded"
CODE_TPM = "tokens_per_minute_exceeded"
CODE_CONCURRENCY = "concurrent_requests_exceeded"
CODE_DAILY = "daily_token_budget_exceeded"
CODE_TOO_LARGE = "request_exceeds_quota"
_CODES = {1: CODE_RPM, 2: CODE_TPM, 3: CODE_CONCURRENCY, 4: CODE_DAILY, 5: CODE_TOO_LARGE}
_LIMIT_OF_CODE = {
    CODE_RPM: "requests_per_minute",
    CODE_TPM: "tokens_per_minute",
    CODE_CONCURRENCY: "max_concurrent_requests",
    CODE_DAILY: "daily_token_budget",
}

#: how long a concurrency slot is held if nobody releases it (crashed process)
DEFAULT_LEASE_S = 900.0


@dataclass(frozen=True, slots=True)
class QuotaLimits:
    """Limits of one budget; ``None`` means unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_token_budget: int | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(
                    f"quota '{f.name}' must be a non-negative integer or unset, got {v!r}"
                )

    def as_dict(self) -> dict[str, int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> QuotaLimits:
        return cls(**{k: (None if data.get(k) is None else int(data[k])) for k in LIMIT_NAMES})

    @property
    def unlimited(self) -> bool:
        return all(getattr(self, n) is None for n in LIMIT_NAMES)


@dataclass(frozen=True, slots=True)
class TenantQuotas:
    interactive: QuotaLimits = field(default_factory=QuotaLimits)
    batch: QuotaLimits = field(default_factory=QuotaLimits)

    def for_budget(self, budget: str) -> QuotaLimits:
        if budget not in BUDGETS:
            raise ValueError(f"unknown budget '{budget}'; use one of {', '.join(BUDGETS)}")
        return self.interactive if budget == "interactive" else self.batch

    def as_dict(self) -> dict[str, dict[str, int | None]]:
        return {b: self.for_budget(b).as_dict() for b in BUDGETS}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> TenantQuotas:
        return cls(**{b: QuotaLimits.from_mapping(data.get(b) or {}) for b in BUDGETS})


@dataclass(frozen=True, slots=True)
class Ticket:
    """Proof of admission; give it back to :meth:`QuotaEnforcer.release`."""

    tenant_id: str
    budget: str
    ticket_id: str
    reserved_tokens: int
    #: False when admitted without limits: nothing was written, so release has
    #: nothing to undo (and skips its round trip)
    charged: bool = True


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    allowed: bool
    ticket: Ticket | None = None
    code: str | None = None
    #: seconds until the request would pass; None when it never can (or was allowed)
    retry_after_s: float | None = None
    limit: int | None = None

    @property
    def limit_name(self) -> str | None:
        return _LIMIT_OF_CODE.get(self.code or "")

    def message(self) -> str:
        if self.allowed:
            return "admitted"
        name = self.limit_name
        if self.code == CODE_TOO_LARGE:
            return (
                f"this request needs more tokens than the quota can ever grant "
                f"(limit {self.limit}); lower max_tokens or ask an admin to raise the quota"
            )
        wait = "" if self.retry_after_s is None else f"; retry after {self.retry_after_s:.1f}s"
        return f"quota exceeded: {name} = {self.limit}{wait}"

    def retry_after_header(self) -> dict[str, str]:
        """``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` (openai client)."""
        if self.allowed or self.retry_after_s is None:
            return {}
        return {
            "Retry-After": str(max(1, math.ceil(self.retry_after_s))),
            "retry-after-ms": str(max(1, math.ceil(self.retry_after_s * 1000))),
        }


# KEYS: 1 rpm bucket, 2 tpm bucket, 3 running zset, 4 daily hash, 5 ticket
# ARGV: 1 rpm limit, 2 tpm limit, 3 concurrency limit, 4 daily limit (-1 = none),
#       5 cost tokens, 6 ticket id, 7 lease ms
_ADMIT_LUA = r"""
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local rpm = tonumber(ARGV[1]); local tpm = tonumber(ARGV[2])
local conc = tonumber(ARGV[3]); local daily = tonumber(ARGV[4])
local cost = tonumber(ARGV[5]); local lease = tonumber(ARGV[7])
local day = math.floor(now / 86400000)
local day_end = (day + 1) * 86400000

local function level(key, cap)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return cap end
  local lv = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000.0
  if lv > cap then lv = cap end
  return lv
end
local function store(key, cap, lv)
  redis.call('HSET', key, 'level', tostring(lv), 'ts', now)
  local full_ms = math.ceil((cap - lv) * 60000.0 / cap) + 1000
  redis.call('PEXPIRE', key, full_ms)
end

local code = 0; local wait = 0; local lim = -1; local never = false
local function fail(c, w, l)
  if code == 0 then code = c; lim = l end
  if w > wait then wait = w end
end

local used = 0
if daily >= 0 then
  local d = redis.call('HMGET', KEYS[4], 'day', 'used')
  if d[1] and tonumber(d[1]) == day then used = tonumber(d[2]) end
  if cost > daily then never = true; fail(5, 0, daily)
  elseif used + cost > daily then fail(4, day_end - now, daily) end
end
local tl = 0
if tpm >= 0 then
  tl = level(KEYS[2], tpm)
  if cost > tpm then never = true; fail(5, 0, tpm)
  elseif tl < cost then fail(2, math.ceil((cost - tl) * 60000.0 / tpm), tpm) end
end
local rl = 0
if rpm >= 0 then
  rl = level(KEYS[1], rpm)
  if rpm < 1 then never = true; fail(5, 0, rpm)
  elseif rl < 1 then fail(1, math.ceil((1 - rl) * 60000.0 / rpm), rpm) end
end
if conc >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  local running = redis.call('ZCARD', KEYS[3])
  if conc < 1 then never = true; fail(5, 0, conc)
  elseif running >= conc then fail(3, 1000, conc) end
end
if code ~= 0 then
  if never then return {0, code, -1, lim} end
  return {0, code, wait, lim}
end

if rpm >= 0 then store(KEYS[1], rpm, rl - 1) end
if tpm >= 0 then store(KEYS[2], tpm, tl - cost) end
if conc >= 0 then
  redis.call('ZADD', KEYS[3], now + lease, ARGV[6])
  redis.call('PEXPIRE', KEYS[3], lease + 1000)
end
if daily >= 0 then
  redis.call('HSET', KEYS[4], 'day', day, 'used', used + cost)
  redis.call('PEXPIRE', KEYS[4], day_end - now + 3600000)
end
redis.call('HSET', KEYS[5], 'tokens', cost, 'day', day)
redis.call('PEXPIRE', KEYS[5], lease + 1000)
return {1, 0, 0, -1}
"""

# KEYS: 1 tpm bucket, 2 running zset, 3 daily hash, 4 ticket
# ARGV: 1 actual tokens, 2 tpm limit (-1 none), 3 ticket id
# Returns the refunded tokens (negative: extra charge), or false if the ticket
# was already released (so a retried release never refunds twice).
_RELEASE_LUA = r"""
if redis.replicate_commands then redis.replicate_commands() end
redis.call('ZREM', KEYS[2], ARGV[3])
local tk = redis.call('HMGET', KEYS[4], 'tokens', 'day')
if not tk[1] then return false end
redis.call('DEL', KEYS[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local delta = tonumber(tk[1]) - tonumber(ARGV[1])
if delta == 0 then return 0 end
local tpm = tonumber(ARGV[2])
local v = redis.call('HMGET', KEYS[1], 'level', 'ts')
if tpm > 0 and v[1] then
  local lv = tonumber(v[1]) + (now - tonumber(v[2])) * tpm / 60000.0 + delta
  if lv > tpm then lv = tpm end
  redis.call('HSET', KEYS[1], 'level', tostring(lv), 'ts', now)
  redis.call('PEXPIRE', KEYS[1], math.ceil((tpm - lv) * 60000.0 / tpm) + 1000)
end
local d = redis.call('HMGET', KEYS[3], 'day', 'used')
if d[1] and tonumber(d[1]) == tonumber(tk[2]) then
  local used = tonumber(d[2]) - delta
  if used < 0 then used = 0 end
  redis.call('HSET', KEYS[3], 'used', used)
end
return delta
"""

# KEYS: 1 rpm, 2 tpm, 3 running, 4 daily. Read-only view for dashboards and /v1/usage.
_PEEK_LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, 2 do
  local cap = tonumber(ARGV[i])
  local v = redis.call('HMGET', KEYS[i], 'level', 'ts')
  if cap < 0 then out[i] = -1
  elseif not v[1] then out[i] = tostring(cap)
  else
    local lv = tonumber(v[1]) + (now - tonumber(v[2])) * cap / 60000.0
    if lv > cap then lv = cap end
    out[i] = tostring(lv)
  end
end
out[3] = redis.call('ZCOUNT', KEYS[3], now, '+inf')
local day = math.floor(now / 86400000)
local d = redis.call('HMGET', KEYS[4], 'day', 'used')
if d[1] and tonumber(d[1]) == day then out[4] = tonumber(d[2]) else out[4] = 0 end
return out
"""


def _arg(v: int | None) -> int:
    return -1 if v is None else int(v)


@dataclass(frozen=True, slots=True)
class QuotaState:
    """Remaining capacity of one budget right now (None = unlimited)."""

    requests_left: float | None
    tokens_left: float | None
    running: int
    daily_tokens_used: int


class QuotaEnforcer:
    """Admission-time quota checks against one Redis; thread-safe (redis-py pools)."""

    def __init__(self, client: Any, prefix: str = "tf", lease_s: float = DEFAULT_LEASE_S) -> None:
        self.redis = client
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self._admit = client.register_script(_ADMIT_LUA)
        self._release = client.register_script(_RELEASE_LUA)
        self._peek = client.register_script(_PEEK_LUA)

    def _keys(self, tenant_id: str, budget: str) -> tuple[str, str, str, str]:
        # one hash tag per tenant+budget keeps a script's keys on one Redis Cluster slot
        base = f"{self.prefix}:quota:{{{tenant_id}:{budget}}}"
        return f"{base}:rpm", f"{base}:tpm", f"{base}:running", f"{base}:daily"

    def _ticket_key(self, tenant_id: str, budget: str, ticket_id: str) -> str:
        return f"{self.prefix}:quota:{{{tenant_id}:{budget}}}:ticket:{ticket_id}"

    def admit(
        self,
        tenant_id: str,
        budget: str,
        limits: QuotaLimits,
        *,
        prompt_tokens: int,
        max_tokens: int,
        ticket_id: str | None = None,
    ) -> QuotaDecision:
        """Check every limit of ``budget`` and, only if all pass, charge them."""
        if budget not in BUDGETS:
            raise ValueError(f"unknown budget '{budget}'; use one of {', '.join(BUDGETS)}")
        cost = max(0, int(prompt_tokens)) + max(0, int(max_tokens))
        tid = ticket_id or uuid.uuid4().hex
        if limits.unlimited:
            return QuotaDecision(True, Ticket(tenant_id, budget, tid, cost, charged=False))
        rpm, tpm, running, daily = self._keys(tenant_id, budget)
        res = self._admit(
            keys=[rpm, tpm, running, daily, self._ticket_key(tenant_id, budget, tid)],
            args=[
                _arg(limits.requests_per_minute),
                _arg(limits.tokens_per_minute),
                _arg(limits.max_concurrent_requests),
                _arg(limits.daily_token_budget),
                cost,
                tid,
                self.lease_ms,
            ],
        )
        ok, code, wait_ms, lim = (int(x) for x in res)
        if ok:
            return QuotaDecision(True, Ticket(tenant_id, budget, tid, cost))
        return QuotaDecision(
            False,
            code=_CODES[code],
            retry_after_s=None if wait_ms < 0 else wait_ms / 1000.0,
            limit=None if lim < 0 else lim,
        )

    def release(self, ticket: Ticket, limits: QuotaLimits, *, actual_tokens: int) -> int | None:
        """Free the concurrency slot and reconcile the reservation with real usage.

        Returns the tokens refunded (negative if the request used more than it
        reserved), or None if this ticket was already released: safe to retry.
        """
        if not ticket.charged or (limits.unlimited and ticket.reserved_tokens == 0):
            return 0
        _, tpm, running, daily = self._keys(ticket.tenant_id, ticket.budget)
        res = self._release(
            keys=[
                tpm,
                running,
                daily,
                self._ticket_key(ticket.tenant_id, ticket.budget, ticket.ticket_id),
            ],
            args=[max(0, int(actual_tokens)), _arg(limits.tokens_per_minute), ticket.ticket_id],
        )
        return None if res is None else int(res)

    def state(self, tenant_id: str, budget: str, limits: QuotaLimits) -> QuotaState:
        rpm, tpm, running, daily = self._keys(tenant_id, budget)
        res = self._peek(
            keys=[rpm, tpm, running, daily],
            args=[_arg(limits.requests_per_minute), _arg(limits.tokens_per_minute)],
        )
        r, t = float(res[0]), float(res[1])
        return QuotaState(
            requests_left=None if r < 0 else r,
            tokens_left=None if t < 0 else t,
            running=int(res[2]),
            daily_tokens_used=int(res[3]),
        )

    def reset(self, tenant_id: str) -> None:
        """Forget all usage of a tenant (tests, and an admin's "reset quota" action)."""
        for budget in BUDGETS:
            keys = list(self._keys(tenant_id, budget))
            self.redis.delete(*keys)
