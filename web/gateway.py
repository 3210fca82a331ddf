"""The API side of the request path: validate, admit, route, enqueue, relay.

One :class:`Gateway` per API process. It builds the router's snapshot from
Redis (instance snapshots, shared dispatch accounting, the shared prefix
index), calls the configured policies (``tokenfleet.core``: admission, router,
tier classification), publishes one Celery task to a computed queue and then
reads the request's Redis Stream. It also watches the request while it waits:
a worker that died before the first token gets its request re-sent elsewhere,
one that died after it ends the stream with an error event, and a request
queued for an instance that went away is re-sent to a live one.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import redis
from kombu.exceptions import KombuError

from tokenfleet.core.prefix_index import PrefixIndex
from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig, classify
from tokenfleet.core.types import (
    CompletionEvent,
    FirstTokenEvent,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)
from tokenfleet.emulator.tokenizer import (
    BYTES_PER_TOKEN,
    encode_text,
    prompt_block_hashes,
    render_chat,
)
from tokenfleet.errors import NoCandidateError, TokenFleetError
from tokenfleet.live.accounting import AccountingView
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.fleet import FleetTicket, LiveFleet, load_topology
from tokenfleet.live.queues import affinity_queue, pool_queue, prefill_header
from tokenfleet.live.relay import RelayEvent, RelayReader
from tokenfleet.live.redis_transport import PipelinePublisher
from tokenfleet.live.state import InstanceInfo, LiveState
from web.errors import ApiError, bad_request

log = logging.getLogger("tokenfleet.api")

TASK_CHAT = "tokenfleet.chat"  # = workers.app.TASK_CHAT (kept here: web must not import workers)
#: default output budget when the client gives none (vLLM uses all the context left)
DEFAULT_MAX_TOKENS = 4096
#: body fields passed through to the engine unchanged
PASSTHROUGH = ("temperature", "top_p", "stop", "seed", "presence_penalty",
               "frequency_penalty", "logit_bias", "ignore_eos", "min_tokens", "vllm_xargs",
               "top_k", "repetition_penalty")
TIER_HEADER = "X-TokenFleet-Tier"
#: how often the registered instances are re-read from Redis (a background thread)
INSTANCES_REFRESH_S = 0.1
#: the fleet view is re-aggregated from the instance snapshots at most this often
FLEET_REFRESH_S = 0.1
#: admission reads the broker queue depths from Redis at most this often
QUEUE_DEPTHS_MAX_AGE_S = 0.05
#: beat's admission knobs and FleetMind spill shares are re-read this often
KNOBS_REFRESH_S = 1.0
#: every instance's dispatch accounting is re-read this often (AccountingView)
ACCOUNTING_REFRESH_S = 0.02


@dataclass(slots=True)
class Prepared:
    """A validated request, ready to dispatch."""

    info: RequestInfo
    body: dict[str, Any]  # what the engine gets
    messages: list[Any]
    stream: bool
    include_usage: bool
    model: str
    created: int
    deadline_s: float | None = None


@dataclass(slots=True)
class Dispatched:
    prep: Prepared
    queue: str
    instance: str  # routed instance ('' when the router had no opinion)
    decision: RouteDecision | None
    dispatch_s: float
    affinity: bool
    attempt: int = 1
    redispatches: int = 0
    first_token_s: float | None = None
    #: instance of the first token whose policy feedback has not run yet
    first_token_due: str | None = None
    tokens: int = 0  # completion tokens relayed so far
    state_checked_s: float = 0.0
    fleet: FleetTicket | None = None  # the DC choice's accounting, settled at the end
    extra: dict[str, Any] = field(default_factory=dict)


def _task_id(job: Mapping[str, Any]) -> str:
    return f"{job['rid']}.{job['attempt']}"


class Gateway:
    def __init__(self, *, state: LiveState, celery: Any, live: LiveConfig,
                 slo: SLOConfig | None = None, ledger: Any = None,
                 admission: Any = None, publish_with_state: bool = False) -> None:
        self.state = state
        self.celery = celery
        #: publish_with_state: the broker is this Redis (same server and database) and
        #: its transport is tokenfleet.live.redis_transport, so a task's LPUSH goes
        #: into the request-state pipeline
        self._publisher = PipelinePublisher(celery) if publish_with_state else None
        self.live = live
        self.slo = slo or SLOConfig()
        self.ledger = ledger
        self.admission = admission
        self.router = ROUTERS.create(live.router, seed=live.router_seed)
        self.router_lock = threading.Lock()
        # FleetMind first (which DC), then the router inside it; both under router_lock
        self.fleet: LiveFleet | None = None
        if live.fleet_policy and live.fleet_policy != "off":
            topo = load_topology(live.topology) if live.topology else None
            self.fleet = LiveFleet(live.fleet_policy, topology=topo, slo=self.slo,
                                   entry_dc=live.entry_dc)
        self._fleet_at = -1.0
        self._plan_at = 0.0
        self._depths: dict[str, int] = {}
        self._depths_at = -1.0
        self._mean_tokens: dict[str, tuple[float, float]] = {}
        #: tenant id -> regions its record allows (set by the tenancy layer; () = any)
        self.tenant_regions: Callable[[str], Sequence[str]] | None = None
        self.index = PrefixIndex(stride_blocks=1)
        self.index_lock = threading.Lock()
        self._infos: list[InstanceInfo] = []
        self._infos_at = 0.0
        self._infos_lock = threading.Lock()
        self._knobs_at = 0.0
        self.accounting = AccountingView(self.state.accounting, ACCOUNTING_REFRESH_S)
        self._stop = threading.Event()
        self._kv_thread = threading.Thread(target=self._kv_loop, name="kv-index", daemon=True)
        self._kv_thread.start()
        self._refresh_thread = threading.Thread(target=self._refresh_loop, name="refresh",
                                                daemon=True)
        self._refresh_thread.start()
        self.metrics: Any = None  # set by create_app

    def close(self) -> None:
        self._stop.set()
        self._kv_thread.join(timeout=2.0)
        self._refresh_thread.join(timeout=2.0)

    # -- shared prefix index ----------------------------------------------------------
    def _kv_loop(self) -> None:
        """Tail the KV event stream (fed by every worker) into the router and
        the local index, so every API replica sees the same cache knowledge."""
        last = "0-0"
        while not self._stop.is_set():
            try:
                last, events = self.state.read_kv_events(last, block_ms=500)
            except (redis.ConnectionError, redis.TimeoutError):
                self._stop.wait(0.5)
                continue
            except Exception:  # noqa: BLE001
                log.exception("KV event stream read failed")
                self._stop.wait(1.0)
                continue
            if events:
                self.apply_kv_events(events)

    def apply_kv_events(self, events: list[KVEvent]) -> None:
        with self.index_lock:
            for ev in events:
                if ev.kind == "stored":
                    self.index.insert(ev.instance_id, ev.block_hashes)
                elif ev.kind == "removed":
                    self.index.remove(ev.instance_id, ev.block_hashes)
                else:
                    self.index.clear(ev.instance_id)
        with self.router_lock:
            for ev in events:
                self.router.on_kv_event(ev)

    # -- live topology ----------------------------------------------------------------
    def instances(self, max_age_s: float = 2 * INSTANCES_REFRESH_S) -> list[InstanceInfo]:
        """Registered instances, as of at most ``max_age_s`` ago (the refresh
        thread keeps them fresh; reading here is the fallback when it lags)."""
        now = time.monotonic()
        with self._infos_lock:
            if now - self._infos_at <= max_age_s:
                return self._infos
        return self._refresh_instances()

    def _refresh_instances(self) -> list[InstanceInfo]:
        now = time.monotonic()
        infos = self.state.instances()
        with self._infos_lock:
            if now >= self._infos_at:
                self._infos, self._infos_at = infos, now
        return infos

    def _refresh_loop(self) -> None:
        """Keep what routing and admission read from Redis fresh, off the request
        path: each of these reads is a round trip a request would otherwise pay
        whenever its copy aged out (the dispatch accounting: on every request).
        The request path still reads inline, at twice the age, if this thread
        falls behind or Redis was down."""
        due = {"instances": 0.0, "accounting": 0.0, "depths": 0.0, "knobs": 0.0}
        while not self._stop.wait(0.01):  # finer than every period below
            now = time.monotonic()
            try:
                if now >= due["instances"]:
                    due["instances"] = now + INSTANCES_REFRESH_S
                    self._refresh_instances()
                if now >= due["accounting"]:
                    due["accounting"] = now + ACCOUNTING_REFRESH_S
                    self.accounting.refresh_if_used([i.instance_id for i in self.instances()])
                if self.admission is not None and now >= due["depths"]:
                    due["depths"] = now + QUEUE_DEPTHS_MAX_AGE_S / 2
                    self._refresh_depths()
                if now >= due["knobs"]:
                    due["knobs"] = now + KNOBS_REFRESH_S / 2
                    self._refresh_admission_knobs(max_age_s=0.0)
                    self._refresh_fleet_plan(max_age_s=0.0)
            except redis.RedisError:
                continue  # requests see the outage themselves
            except Exception:  # noqa: BLE001
                log.exception("live-state refresh failed")

    def live_instances(self) -> list[InstanceInfo]:
        now = time.time()
        return [i for i in self.instances() if i.is_live(now, self.live.stale_after_s)]

    def models(self) -> dict[str, int]:
        """Served model -> largest context length among live instances."""
        out: dict[str, int] = {}
        for i in self.live_instances():
            out[i.model] = max(out.get(i.model, 0), i.max_model_len_tokens)
        return out

    # -- validation -----------------------------------------------------------------
    def prepare(self, body: Any, tenant: str, headers: Mapping[str, str],
                slo_class: str | None = None) -> Prepared:
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        model = body.get("model")
        if model is None or model == "":
            raise bad_request("you must provide a model parameter", "model")
        if not isinstance(model, str):
            raise bad_request("'model' must be a string", "model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty array of messages", "messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string 'role'",
                                  f"messages[{i}]")
            if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
                raise bad_request(f"messages[{i}].role '{m['role']}' is not one of system, "
                                  "developer, user, assistant, tool", f"messages[{i}].role")
        max_tokens = _opt_int(body, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens")
        n = _opt_int(body, "n")
        if n is not None and n != 1:
            raise bad_request("only n=1 is supported", "n")
        stream = body.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise bad_request("'stream' must be a boolean", "stream")
        options = body.get("stream_options")
        if options is not None:
            if not stream:
                raise bad_request("'stream_options' is only allowed when 'stream' is true",
                                  "stream_options")
            if not isinstance(options, dict):
                raise bad_request("'stream_options' must be an object", "stream_options")
        include_usage = bool(stream and options and options.get("include_usage") is True)
        for name in ("user", "prompt_cache_key"):
            if body.get(name) is not None and not isinstance(body.get(name), str):
                raise bad_request(f"'{name}' must be a string", name)
        models = self.models()
        if model not in models:
            if not models:
                raise ApiError(503, "no engine instance is up yet; retry shortly",
                               code="no_capacity", retry_after_s=2)
            raise ApiError(404, f"The model `{model}` does not exist or you do not have "
                           f"access to it. Available: {', '.join(sorted(models))}",
                           param="model", code="model_not_found",
                           type_="invalid_request_error")
        try:
            text = render_chat(messages)
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        stream_bytes = encode_text(text)
        input_tokens = len(stream_bytes) // BYTES_PER_TOKEN
        max_len = models[model]
        if input_tokens + 1 > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, your messages resulted in {input_tokens} tokens. "
                           "Please reduce the length of the messages.", param="messages",
                           code="context_length_exceeded")
        room = max_len - input_tokens
        if max_tokens is None:
            max_tokens = min(room, DEFAULT_MAX_TOKENS)
        elif max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                           f"However, you requested {input_tokens + max_tokens} tokens "
                           f"({input_tokens} in the messages, {max_tokens} in the "
                           "completion). Please reduce the length of the messages or "
                           "completion.", param="max_tokens", code="context_length_exceeded")
        tier_hint = headers.get(TIER_HEADER, "") or ""
        if tier_hint and tier_hint not in self.slo.tiers:
            raise bad_request(f"header {TIER_HEADER} must be one of "
                              f"{', '.join(sorted(self.slo.tiers))}", TIER_HEADER)
        task_type = "batch" if body.get("service_tier") == "flex" else "chat"
        now = time.time()
        rid = uuid.uuid4().hex
        info = RequestInfo(
            request_id=rid, arrival_s=now, input_tokens=input_tokens, max_tokens=max_tokens,
            block_hashes=prompt_block_hashes(text), tenant=tenant, task_type=task_type,
            tier=tier_hint, model=model, session=body.get("user"),
            prompt_cache_key=body.get("prompt_cache_key"), slo_class=slo_class)
        tier = classify(info, self.slo)
        deadline = None
        tslo = self.slo.slo_for(tier)
        if tier == "batch" and tslo.deadline_s is not None:
            deadline = now + tslo.deadline_s
        info = _replace(info, tier=tier, deadline_s=deadline)
        engine_body: dict[str, Any] = {"model": model, "messages": messages,
                                       "max_tokens": max_tokens, "stream": True,
                                       "stream_options": {"include_usage": True}}
        for k in PASSTHROUGH:
            if k in body:
                engine_body[k] = body[k]
        return Prepared(info=info, body=engine_body, messages=messages, stream=stream,
                        include_usage=include_usage, model=model, created=int(now),
                        deadline_s=deadline)

    # -- admission + routing + publish -------------------------------------------------
    def _refresh_admission_knobs(self, max_age_s: float = KNOBS_REFRESH_S) -> None:
        if self.admission is None:
            return
        now = time.monotonic()
        if now - self._knobs_at < max_age_s:
            return
        self._knobs_at = now
        try:
            thr = self.state.thresholds()
        except redis.RedisError:
            return
        for knob in ("batch_share", "long_share", "reject_factor"):
            v = thr.get(knob)
            if v is not None and hasattr(self.admission, knob):
                setattr(self.admission, knob, v)

    def _admit(self, prep: Prepared, views: list[Any], now: float) -> tuple[str, ...] | None:
        """Admission policy at arrival: None = anywhere, else allowed instance ids."""
        if self.admission is None:
            return None
        from tokenfleet.core.admission import (
            ADMIT,
            REJECT,
            AdmissionSnapshot,
            InstanceLoad,
        )

        self._refresh_admission_knobs()
        loads = []
        infos = {i.instance_id: i for i in self.instances()}
        for v in views:
            if not v.ready:
                continue
            load = InstanceLoad(view=v)
            rbt = infos[v.instance_id].running_by_tier if v.instance_id in infos else {}
            for tier, n in rbt.items():
                load.tier(tier).inflight = n
                load.tier(tier).reserved_kv_tokens = 0
            loads.append(load)
        dcs = {v.dc for v in views}
        snap = AdmissionSnapshot(now_s=now, instances=loads,
                                 queues=self._broker_queues(dcs, prep.info))
        with self.router_lock:
            decision = self.admission.on_arrival(prep.info, snap)
        if decision.action == REJECT:
            self._reject(prep, decision.reason, decision.retry_after_s,
                         dcs.pop() if len(dcs) == 1 else None)
        if decision.action == ADMIT and decision.instance_ids:
            return tuple(decision.instance_ids)
        return None

    def _broker_queues(self, dcs: set[str], info: RequestInfo) -> dict[str, Any]:
        """What waits in the chosen DC's broker queues, per tier, as admission totals.

        Counts come from the per-queue depth counters in Redis (the API adds
        at publish, the worker that takes a task subtracts); prompt tokens are
        the count times the mean prompt this API published to that tier (this
        request's own size until it has published any).
        """
        from tokenfleet.core.admission import QueueTotals

        if time.monotonic() - self._depths_at > QUEUE_DEPTHS_MAX_AGE_S:
            try:
                self._refresh_depths()
            except redis.RedisError:
                self._depths, self._depths_at = {}, time.monotonic()
        n_by_tier: dict[str, int] = {}
        for queue, n in self._depths.items():
            parts = queue.split(".")
            if n > 0 and len(parts) in (2, 3) and parts[0] in dcs:
                n_by_tier[parts[-1]] = n_by_tier.get(parts[-1], 0) + n
        out = {}
        for tier, n in n_by_tier.items():
            mean_in, mean_out = self._mean_tokens.get(
                tier, (float(info.input_tokens), float(info.max_tokens)))
            out[tier] = QueueTotals(tier, n, int(n * mean_in), int(n * (mean_in + mean_out)))
        return out

    def _refresh_depths(self) -> None:
        now = time.monotonic()
        depths = self.state.queued()
        self._depths, self._depths_at = depths, now

    def _published(self, info: RequestInfo) -> None:
        """Running mean prompt and budget of what this API published, per tier."""
        mean_in, mean_out = self._mean_tokens.get(info.tier, (float(info.input_tokens),
                                                              float(info.max_tokens)))
        a = 0.05
        self._mean_tokens[info.tier] = (mean_in + a * (info.input_tokens - mean_in),
                                        mean_out + a * (info.max_tokens - mean_out))

    def _reject(self, prep: Prepared, reason: str, retry_after_s: float | None,
                dc: str | None = None) -> None:
        info = prep.info
        self._ledger({"request_id": info.request_id, "tenant_id": info.tenant, "dc": dc,
                      "tier": info.tier, "model": info.model, "status": "rejected",
                      "arrival_ts": info.arrival_s, "finished_ts": time.time(),
                      "prompt_tokens": info.input_tokens, "error": reason[:500]})
        try:
            self.state.count(**{f"rejected_{info.tier}": 1})
        except redis.RedisError:
            pass
        if self.metrics is not None:
            self.metrics.finished(info.tier, "rejected")
        raise ApiError(429, f"TokenFleet is at capacity for {info.tier} requests ({reason}); "
                       "retry after the indicated delay", code="rate_limit_exceeded",
                       retry_after_s=retry_after_s if retry_after_s is not None else 1.0)

    def dispatch(self, prep: Prepared) -> Dispatched:
        info = prep.info
        now = time.time()
        try:
            views = self.state.instance_views(now, self.live.stale_after_s, self.instances(),
                                              self.accounting.get)
            views, dc_choice = self._pick_dc(prep, views, now)
            allowed = self._admit(prep, views, now)
            if allowed is not None:
                views = [v for v in views if v.instance_id in allowed] or views
            for i, v in enumerate(views):
                v.index = i
            decision = self._route(prep, views, now)
            target = next(v for v in views if v.instance_id == decision.instance_id)
            target, sticky = self._sticky(prep, views, target)
            cached = (decision.expected_cached_tokens
                      if target.instance_id == decision.instance_id else 0)
            with self.index_lock:
                cached = max(cached, self.index.match_instance(
                    target.instance_id, info.block_hashes) * 16)
            cached = min(cached, info.input_tokens)
            affinity = sticky or self._valuable(info, cached)
            if affinity:
                queue = affinity_queue(target.dc, target.instance_id, info.tier)
            else:
                queue = pool_queue(target.dc, info.tier)
            admitted = time.time()
            log.debug("route %s: %s -> %s (expected cached %d, %s)", info.request_id,
                      decision.instance_id, queue, cached, decision.reason)
            job = self._job(prep, queue, target.instance_id if affinity else "",
                            target.dc, cached, admitted, attempt=1)
            # request state, queue depth, accounting, counters and (when the broker
            # is this Redis) the task itself: one round trip, the state first, so a
            # worker never takes a task whose state is missing (the id is a fresh
            # uuid, so no existence check is needed)
            try:
                self._dispatch_writes(prep, job, queue, target, affinity, cached, dc_choice)
            except KombuError as exc:
                raise ApiError(503, f"the message broker is unavailable ({exc.__class__.__name__})"
                               "; retry shortly", code="service_unavailable",
                               retry_after_s=2) from None
            self._ledger({"request_id": info.request_id, "tenant_id": info.tenant,
                          "tier": info.tier, "model": info.model, "status": "in_flight",
                          "arrival_ts": info.arrival_s, "admitted_ts": admitted,
                          "dc": target.dc, "prompt_tokens": info.input_tokens,
                          "attempts": 1})
        except redis.RedisError as exc:
            raise ApiError(503, f"the live state store is unavailable ({exc.__class__.__name__})"
                           "; retry shortly", code="service_unavailable",
                           retry_after_s=2) from None
        self._published(info)
        ticket = None
        if dc_choice is not None and self.fleet is not None:
            with self.router_lock:
                try:
                    ticket = self.fleet.dispatched(info, dc_choice[0])
                except NoCandidateError:  # the pool vanished between choice and send
                    ticket = None
        # the router's choice: a pin elsewhere is corrected like late binding, at
        # the first token (_rebind)
        return Dispatched(prep=prep, queue=queue, instance=decision.instance_id,
                          decision=decision, dispatch_s=admitted, affinity=affinity,
                          fleet=ticket)

    # -- datacenter choice (FleetMind) ----------------------------------------------------
    def _refresh_fleet_plan(self, max_age_s: float = KNOBS_REFRESH_S) -> None:
        """The long cycle's spill shares (beat writes them to Redis)."""
        now = time.monotonic()
        if self.fleet is None or now - self._plan_at < max_age_s:
            return
        self._plan_at = now
        try:
            raw = self.state.r.hgetall(self.state.k("fleet"))
        except redis.RedisError:
            return
        shares = {}
        for k, v in raw.items():
            key = k.decode()
            if key.startswith("spill_share:"):
                try:
                    shares[key.partition(":")[2]] = float(v)
                except ValueError:
                    continue
        self.fleet.spill_share = shares

    def _tenant(self, tenant_id: str) -> Any:
        assert self.fleet is not None
        regions: Sequence[str] = ()
        if self.tenant_regions is not None:
            try:
                regions = self.tenant_regions(tenant_id)
            except Exception:  # noqa: BLE001 - tenancy store down: topology rules only
                log.warning("tenant %s: allowed regions unavailable; using the topology's",
                            tenant_id)
        return self.fleet.tenant(tenant_id, regions)

    def _pick_dc(self, prep: Prepared, views: list[Any], now: float
                 ) -> tuple[list[Any], tuple[Any, str | None] | None]:
        """FleetMind picks the datacenter; the router then sees only its instances.

        Returns the chosen DC's views and (decision, home) for the accounting,
        or all views and None when DC selection is off.
        """
        if self.fleet is None:
            return views, None
        info = prep.info
        self._refresh_fleet_plan()
        tenant = self._tenant(info.tenant)
        with self.router_lock:
            if now - self._fleet_at >= FLEET_REFRESH_S or now < self._fleet_at:
                self.fleet.refresh(views, now)
                self._fleet_at = now
            self.fleet.snap.now_s = now
            why = ""
            try:
                decision, home = self.fleet.select(info, tenant)
            except NoCandidateError as exc:
                why = str(exc)
                permitted = self.fleet.permitted_anywhere(info, tenant)
        if why:
            if not permitted:
                raise ApiError(403, f"tenant '{info.tenant}' may not use any datacenter that "
                               f"serves `{info.model}` (its allowed regions or sites exclude "
                               "them); ask the operator to widen the tenant's allowed regions",
                               param="model", code="region_not_allowed",
                               type_="invalid_request_error")
            raise ApiError(503, f"no datacenter can serve this request now ({why})",
                           code="no_capacity", retry_after_s=2)
        if self.metrics is not None:
            self.metrics.dc_decision(decision.dc, decision.reason)
        chosen = [v for v in views if v.dc == decision.dc]
        return chosen, (decision, home)

    def _compliant_views(self, info: RequestInfo, views: list[Any]) -> list[Any]:
        """Re-sends may leave the chosen DC, but never the tenant's allowed sites."""
        if self.fleet is None:
            return views
        tenant = self._tenant(info.tenant)
        with self.router_lock:
            ok = self.fleet.compliant_dcs(info, tenant)
        return [v for v in views if v.dc in ok]

    def _route(self, prep: Prepared, views: list[Any], now: float) -> RouteDecision:
        try:
            with self.router_lock:
                return self.router.route(prep.info, PoolSnapshot(now_s=now, instances=views))
        except NoCandidateError as exc:
            raise ApiError(503, f"no healthy engine instance can take this request now ({exc})",
                           code="no_capacity", retry_after_s=2) from None

    def _valuable(self, info: RequestInfo, cached_tokens: int) -> bool:
        """A cache hit worth waiting for that instance (else: late binding)."""
        return (cached_tokens >= self.live.affinity_min_cached_tokens
                and cached_tokens >= self.live.affinity_min_cached_fraction * info.input_tokens)

    def _sticky(self, prep: Prepared, views: list[Any], target: Any) -> tuple[Any, bool]:
        """``prompt_cache_key``: the client's own affinity hint. The first request
        with a key pins it to the routed instance for ten minutes; later ones
        go to that instance's own queue while it is healthy. Returns (the
        instance to send to, whether to its own queue); a pinned instance the
        DC choice or admission left out keeps its pin, and this request goes
        where the router sent it, through the pool."""
        key = prep.info.prompt_cache_key
        if not key:
            return target, False
        rkey = self.state.k("pck", prep.info.tenant, key)
        pinned = self.state.r.get(rkey)
        now = time.time()
        if pinned is not None:
            pinned_id = pinned.decode()
            for i in self.instances():
                if i.instance_id == pinned_id and i.is_healthy(now, self.live.stale_after_s):
                    self.state.r.expire(rkey, 600)
                    there = next((v for v in views if v.instance_id == pinned_id), None)
                    return (there, True) if there is not None else (target, False)
        self.state.r.set(rkey, target.instance_id, ex=600)
        return target, True

    def _job(self, prep: Prepared, queue: str, accounted: str, dc: str, cached: int,
             admitted: float, attempt: int) -> dict[str, Any]:
        info = prep.info
        return {"rid": info.request_id, "attempt": attempt, "tenant": info.tenant,
                "tier": info.tier, "model": info.model, "body": prep.body,
                "input_tokens": info.input_tokens,
                "max_tokens": info.max_tokens, "arrival_ts": info.arrival_s,
                "admitted_ts": admitted, "queue": queue, "accounted": accounted,
                "dc": dc, "expected_cached": cached, "tried": [],
                "deadline_ts": prep.deadline_s}

    def _dispatch_writes(self, prep: Prepared, job: dict[str, Any], queue: str, target: Any,
                         affinity: bool, cached: int,
                         dc_choice: tuple[Any, str | None] | None) -> None:
        info = prep.info
        joined = self._publisher
        booked: dict[str, int] = {}
        with self.state.batch() as b:
            b.create_request(info.request_id, queue, self.live.request_state_ttl_s,
                             tier=info.tier, instance=target.instance_id)
            b.queued(queue, 1)
            if affinity:
                booked = b.account(target.instance_id, "on_dispatch", info, cached)
            b.count(**{f"arrived_{info.tier}": 1,
                       f"dispatched_{'affinity' if affinity else 'pool'}": 1})
            if dc_choice is not None and dc_choice[1] not in (None, target.dc):
                # beat's planner needs each DC's spilled-in share (rollback rule)
                b.count(**{f"spilled_in:{target.dc}": 1})
            if joined is not None:
                # a KombuError here leaves the batch unsent: nothing to undo
                joined.publish(b.pipe, TASK_CHAT, [job], _task_id(job), queue,
                               prefill_header(job))
        if booked:  # the pool's dispatches are booked by the worker that claims them
            self.accounting.wrote(target.instance_id, booked)
        if joined is not None:
            return
        try:
            self._send(job, queue)
        except KombuError:
            self.state.finish(info.request_id, "failed")
            self.state.queued_incr(queue, -1)
            raise

    def _publish(self, job: dict[str, Any], queue: str) -> None:
        self.state.queued_incr(queue)
        self._send(job, queue)

    def _send(self, job: dict[str, Any], queue: str) -> None:
        # argsrepr/kwargsrepr: skip Celery's safe-repr of the job for its headers
        self.celery.send_task(TASK_CHAT, args=[job], task_id=_task_id(job),
                              queue=queue, routing_key=queue, argsrepr="", kwargsrepr="",
                              headers=prefill_header(job))

    def _ledger(self, row: dict[str, Any]) -> None:
        if self.ledger is None:
            return
        try:
            self.ledger.record(row)
        except Exception:  # noqa: BLE001
            log.exception("ledger row not recorded")

    # -- waiting ---------------------------------------------------------------------
    def events(self, d: Dispatched) -> Iterator[RelayEvent]:
        """Relay events of one request, with the lost-worker and timeout checks."""
        reader = RelayReader(self.state, d.prep.info.request_id, block_ms=250)
        deadline = d.prep.info.arrival_s + self.live.request_timeout_s
        redis_down_since: list[float] = []

        def on_idle() -> RelayEvent | None:
            now = time.time()
            if now > deadline:
                return self._settle(d, "timed_out", 504,
                                    f"request not finished within {self.live.request_timeout_s:.0f}s")
            # the lost-worker check costs two Redis reads: at most twice a lease period
            if now - d.state_checked_s < min(1.0, self.live.lease_ttl_s / 2):
                return None
            d.state_checked_s = now
            try:
                ev = self._watch(d, now)
                redis_down_since.clear()
                return ev
            except (redis.ConnectionError, redis.TimeoutError):
                if not redis_down_since:
                    redis_down_since.append(now)
                if now - redis_down_since[0] > max(5.0, 3 * self.live.lease_ttl_s):
                    return RelayEvent("err", message="lost contact with the live state store "
                                      "while waiting for this request; retry it", code=503,
                                      error_type="server_error")
                return None

        for ev in reader.events(on_idle):
            if ev.kind == "d" and d.first_token_s is None:
                d.first_token_s = time.time()
                d.first_token_due = ev.instance or d.instance
            if ev.kind == "d":
                d.tokens += ev.tokens
            elif ev.kind == "retry":
                d.attempt = max(d.attempt, ev.attempt)
            elif ev.kind == "end":
                self._on_complete(d, ev)
            elif ev.kind == "err":
                self._fleet_done(d, "failed")
            yield ev
            # the policies learn from the first token once the caller has sent it
            # on (it asks for the next event after writing the chunk)
            self.first_token_feedback(d)

    def _watch(self, d: Dispatched, now: float) -> RelayEvent | None:
        """Detect a lost worker or a request stranded in a dead instance's queue."""
        st = self.state.request_state(d.prep.info.request_id)
        status = st.get("status")
        attempt = int(st.get("attempt", "1") or 1)
        d.attempt = max(d.attempt, attempt)
        if status == "running" and not self.state.lease_alive(d.prep.info.request_id):
            st = self.state.request_state(d.prep.info.request_id)
            if st.get("status") != "running":
                return None
            lost = st.get("instance", "")
            if st.get("first_token") == "1":
                return self._settle(d, "failed", 502, "the worker serving this request was "
                                    "lost after streaming began; retry the request")
            return self._resend(d, attempt, {lost}, f"worker of {lost} lost")
        if status == "queued":
            queue = st.get("queue", d.queue)
            queued_at = float(st.get("queued_at", "0") or 0)
            if now - queued_at < self.live.affinity_dead_after_s:
                return None
            if not self._queue_served(queue, now):
                return self._resend(d, attempt, set(), f"no live worker consumes {queue}")
        if status == "done" and st.get("final") in ("failed", "timed_out", "cancelled"):
            # settled by someone who could not write to the stream (e.g. lost worker)
            return RelayEvent("err", message=f"request {st.get('final')}", code=502,
                              error_type="server_error")
        return None

    def _queue_served(self, queue: str, now: float) -> bool:
        parts = queue.split(".")
        for i in self.instances(max_age_s=0.5):
            if not i.is_healthy(now, self.live.stale_after_s):
                continue
            if len(parts) == 3 and i.instance_id == parts[1] and i.dc == parts[0]:
                return True
            if len(parts) == 2 and i.dc == parts[0]:
                return True
        return False

    def _resend(self, d: Dispatched, attempt: int, exclude: set[str],
                why: str) -> RelayEvent | None:
        info = d.prep.info
        now = time.time()
        views = [v for v in self.state.instance_views(now, self.live.stale_after_s,
                                                      self.instances(max_age_s=0.0))
                 if v.instance_id not in exclude]
        views = self._compliant_views(info, views)
        for i, v in enumerate(views):
            v.index = i
        try:
            with self.router_lock:
                decision = self.router.route(info, PoolSnapshot(now_s=now, instances=views))
        except NoCandidateError:
            if attempt >= self.live.max_attempts:
                return self._settle(d, "failed", 503, f"{why}; no other instance available")
            return None  # wait for one to come back (or the request timeout)
        target = next(v for v in views if v.instance_id == decision.instance_id)
        queue = affinity_queue(target.dc, target.instance_id, info.tier)
        new_attempt = self.state.redispatch(info.request_id, attempt, self.live.max_attempts,
                                            queue)
        if new_attempt == -5:
            return self._settle(d, "failed", 502, f"{why}; out of attempts")
        if new_attempt < 0:
            return None  # raced with a worker or another check: look again next tick
        job = self._job(d.prep, queue, "", target.dc, decision.expected_cached_tokens,
                        d.dispatch_s, new_attempt)
        job["tried"] = sorted(exclude)
        try:
            self._publish(job, queue)
        except KombuError:
            log.warning("request %s: broker unavailable for the re-send; the next check "
                        "retries", info.request_id)
            self.state.r.hset(self.state.k("req", info.request_id), "status", "running")
            return None
        d.attempt = new_attempt
        d.redispatches += 1
        self.state.count(api_redispatches=1)
        log.warning("request %s re-sent as attempt %d to %s: %s", info.request_id,
                    new_attempt, queue, why)
        return None

    def _settle(self, d: Dispatched, status: str, code: int, message: str) -> RelayEvent | None:
        info = d.prep.info
        won, _final = self.state.finish(info.request_id, status)
        if not won:
            return None  # the worker settled it first; its events are on the way
        self.state.cancel(info.request_id)
        self._ledger({"request_id": info.request_id, "tenant_id": info.tenant,
                      "tier": info.tier, "model": info.model, "status": status,
                      "arrival_ts": info.arrival_s, "finished_ts": time.time(),
                      "first_token_ts": d.first_token_s, "instance": d.instance or None,
                      "prompt_tokens": info.input_tokens, "completion_tokens": d.tokens,
                      "attempts": d.attempt, "error": message[:500]})
        if self.metrics is not None:
            self.metrics.finished(info.tier, status)
        self._fleet_done(d, status)
        return RelayEvent("err", message=message, code=code,
                          error_type="timeout" if code == 504 else "server_error")

    def cancel(self, d: Dispatched) -> None:
        """The client went away: stop the engine work and settle as cancelled."""
        info = d.prep.info
        try:
            self.state.cancel(info.request_id)
            won, _ = self.state.finish(info.request_id, "cancelled")
        except redis.RedisError:
            return
        if won:
            self._ledger({"request_id": info.request_id, "tenant_id": info.tenant,
                          "tier": info.tier, "model": info.model, "status": "cancelled",
                          "arrival_ts": info.arrival_s, "finished_ts": time.time(),
                          "first_token_ts": d.first_token_s,
                          "prompt_tokens": info.input_tokens, "completion_tokens": d.tokens})
            if self.metrics is not None:
                self.metrics.finished(info.tier, "cancelled")
        self._fleet_done(d, "cancelled")

    # -- policy feedback ----------------------------------------------------------------
    def first_token_feedback(self, d: Dispatched) -> None:
        """Run the first token's feedback (router, admission, FleetMind, metrics)
        if it is still due; every end of a request calls it first."""
        actual, d.first_token_due = d.first_token_due, None
        if actual is None:
            return
        if actual != d.instance:
            self._rebind(d, actual)
        self._on_first_token(d, actual)

    def _fleet_done(self, d: Dispatched, status: str) -> None:
        self.first_token_feedback(d)
        if d.fleet is None or self.fleet is None:
            return
        with self.router_lock:
            self.fleet.finished(d.fleet, d.prep.info, status, d.tokens)

    def _rebind(self, d: Dispatched, actual: str) -> None:
        """Late binding put the request elsewhere than the router chose: correct
        what the router believes about both caches (a cache-aware router records
        its own choice as the new holder of this prefix)."""
        hashes = d.prep.info.block_hashes
        if not hashes:
            return
        with self.index_lock:
            known = self.index.match_instance(d.instance, hashes)
        events = [KVEvent(actual, "stored", hashes, exact=False)]
        if known < len(hashes):
            events.append(KVEvent(d.instance, "removed", tuple(hashes[known:]), exact=False))
        with self.router_lock:
            for ev in events:
                self.router.on_kv_event(ev)
        d.instance = actual

    def _on_first_token(self, d: Dispatched, instance: str) -> None:
        assert d.first_token_s is not None
        pred = d.decision.predicted_ttft_s if d.decision else None
        ev = FirstTokenEvent(request=d.prep.info, instance_id=instance, now_s=d.first_token_s,
                             ttft_s=d.first_token_s - d.dispatch_s, predicted_ttft_s=pred)
        with self.router_lock:
            self.router.on_first_token(ev)
            if self.admission is not None:
                self.admission.on_first_token(ev)
            if d.fleet is not None and self.fleet is not None:
                self.fleet.first_token(d.fleet, d.prep.info, ev.ttft_s)
        if self.metrics is not None:
            self.metrics.first_token(d.prep.info.tier, d.first_token_s - d.prep.info.arrival_s)

    def _on_complete(self, d: Dispatched, ev: RelayEvent) -> None:
        self.first_token_feedback(d)
        now = time.time()
        usage = ev.usage or {}
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        done = CompletionEvent(
            request=d.prep.info, instance_id=ev.instance or d.instance, now_s=now,
            status="completed", output_tokens=int(usage.get("completion_tokens", 0)),
            cached_tokens=cached,
            ttft_s=(d.first_token_s - d.dispatch_s) if d.first_token_s else None,
            e2e_s=now - d.prep.info.arrival_s)
        with self.router_lock:
            self.router.on_complete(done)
            if self.admission is not None:
                self.admission.on_complete(done)
            if d.fleet is not None and self.fleet is not None:
                self.fleet.finished(d.fleet, d.prep.info, "completed", done.output_tokens)
        if self.metrics is not None:
            self.metrics.finished(d.prep.info.tier, "completed",
                                  int(usage.get("completion_tokens", 0)))


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"'{name}' must be an integer, got {v!r}", name)
    if v <= 0:
        raise bad_request(f"'{name}' must be at least 1, got {v}", name,
                          code="invalid_value")
    return v


def _replace(info: RequestInfo, **changes: Any) -> RequestInfo:
    from dataclasses import replace

    return replace(info, **changes)


__all__ = ["Gateway", "Prepared", "Dispatched", "TokenFleetError"]
