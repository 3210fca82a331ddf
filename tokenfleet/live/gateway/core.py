"""The live driver of one API process: :class:`Gateway`.

One request, as the chat view drives it::

    req = gateway.validate(body, tenant=..., tier_hint=..., slo_class=...)  # validate.py
    d = gateway.dispatch(req, hold)  # dispatch.py; holding.py while admission queues it
    for ev in gateway.events(d): ...                                      # watch.py
    gateway.cancel(d)  # only if the client went away

Everything that can refuse a request raises a
:class:`~tokenfleet.live.gateway.errors.GatewayError`; ``web/`` turns it into
an OpenAI-shaped response. The work is split by concern into the bases of
:class:`Gateway`: :class:`LiveView` (the Redis state it keeps fresh),
:class:`Dispatcher`, :class:`Watcher` and :class:`Feedback`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis

from tokenfleet.core.routing import ROUTERS
from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import BLOCK_SIZE_TOKENS
from tokenfleet.live.brokers import DcBrokers
from tokenfleet.live.config import LiveConfig
from tokenfleet.live.dc_select import LiveDCSelector, load_topology
from tokenfleet.live.gateway.direct import DirectCalls
from tokenfleet.live.gateway.dispatch import Dispatcher
from tokenfleet.live.gateway.errors import StoreUnavailable
from tokenfleet.live.gateway.feedback import Feedback
from tokenfleet.live.gateway.holding import HoldingPen
from tokenfleet.live.gateway.overload import FrontGate, InflightBound, WaitPredictor
from tokenfleet.live.gateway.pump import StreamPump
from tokenfleet.live.gateway.refresh import LiveView
from tokenfleet.live.gateway.validate import ChatRequest, validate_chat
from tokenfleet.live.gateway.watch import Watcher
from tokenfleet.live.queues import DEFAULT_SHARES
from tokenfleet.live.redis_transport import TRANSPORT_PATH, PipelinePublisher, same_database
from tokenfleet.live.relay import RelayHub
from tokenfleet.live.state import InstanceInfo, LiveState
from tokenfleet.service.writer import RequestRecord
from tokenfleet.tokenizer import BYTE_TOKENIZER, PromptTokenizer

#: /health answers from the refresh thread's copy of the instances up to this age
HEALTH_MAX_AGE_S = 1.0


def make_admission(name: str) -> Any:
    """The admission policy named ``name`` (None for ``"none"``). The API runs SLOMax
    without its own adaptation: beat's control loop sets its knobs for every replica."""
    if not name or name == "none":
        return None
    from tokenfleet.core.admission import ADMISSION

    if name == "slomax":
        # its knobs do adapt, in beat: until beat's controller has measured a
        # window (the refresh copies its flag), the lane follows the arrivals
        return ADMISSION.create(name, adaptive=False, lane_measured=False)
    return ADMISSION.create(name)


log = logging.getLogger("tokenfleet.api")


class Gateway(LiveView, Dispatcher, Watcher, Feedback):
    """Validate, admit, route, publish and follow the requests of one API process.

    ``admission``: a policy object or its name in
    ``tokenfleet.core.admission.ADMISSION`` (``"none"``: admit everything).
    ``redis_url``: the live state's URL; when the broker is that same Redis
    (server and database) with the transport of
    :mod:`tokenfleet.live.redis_transport`, a task's LPUSH goes into the
    request-state pipeline (one round trip per dispatch).
    """

    def __init__(
        self,
        *,
        state: LiveState,
        celery: Any,
        live: LiveConfig,
        slo: SLOConfig | None = None,
        ledger: Any = None,
        admission: Any = None,
        redis_url: str | None = None,
        brokers: DcBrokers | None = None,
    ) -> None:
        self.state = state
        self.celery = celery
        #: per-datacenter brokers (multi-region); none: every task goes to ``celery``'s
        self.brokers = brokers or DcBrokers(celery, {}, lambda _url: celery)
        joined = (
            redis_url is not None
            and celery.conf.broker_transport == TRANSPORT_PATH
            and same_database(celery.conf.broker_url, redis_url)
        )
        self._publisher = PipelinePublisher(celery) if joined else None
        if isinstance(admission, str):
            admission = make_admission(admission)
        self.live = live
        self.slo = slo or SLOConfig()
        self.ledger = ledger
        self.admission = admission
        self.router = ROUTERS.create(live.router, seed=live.router_seed)
        self.router_lock = threading.Lock()
        # FleetMind first (which DC), then the router inside it; both under router_lock
        self.dc_selector: LiveDCSelector | None = None
        if live.fleet_policy and live.fleet_policy != "off":
            topo = load_topology(live.topology) if live.topology else None
            self.dc_selector = LiveDCSelector(
                live.fleet_policy, topology=topo, slo=self.slo, entry_dc=live.entry_dc
            )
        self._dc_views_at = -1.0
        self._dc_views_dcs: frozenset[str] = frozenset()
        self._mean_tokens: dict[str, tuple[float, float]] = {}
        #: the slot shares beat gives each tier (the workers' tier gates apply them)
        self.tier_shares: dict[str, float] = dict(DEFAULT_SHARES)
        #: (instance, tier) -> attempts this process runs itself (express
        #: dispatch): no worker reports them in its running counts
        self.express_running: dict[tuple[str, str], int] = {}
        self.express_lock = threading.Lock()
        self.engine_failures: dict[str, int] = {}
        #: tenant id -> regions its record allows (set by the tenancy layer; () = any)
        self.tenant_regions = None
        self.metrics: Any = None  # the API's metrics (web.metrics.ApiMetrics), if any
        self._tokenizers: dict[str, PromptTokenizer] = {}
        #: the front door's load shedding (overload.py)
        self.inflight = InflightBound(live.api_max_inflight)
        self.front_gate = FrontGate(live.api_front_slots, live.api_front_wait_s)
        self.wait_predictor = WaitPredictor(self.slo, live.shed_wait_factor)
        self._start_view()
        #: every stream this process waits on, read by one thread (relay.py)
        self.relay_hub = RelayHub(state)
        #: the engine calls this process reads itself (direct.py)
        self.direct_calls = DirectCalls(state, live, self.api_id)
        #: carries the direct streams past their first token, all on one thread (pump.py)
        self.pump: StreamPump | None = StreamPump() if live.api_stream_pump else None
        #: requests admission queued, held here until it releases them (holding.py)
        self.holding: HoldingPen | None = None
        if self.admission is not None and live.api_hold_queued:
            self.holding = HoldingPen(self.release_held, live.api_hold_tick_s)

    def close(self) -> None:
        if self.holding is not None:
            self.holding.close()
        if self.pump is not None:
            self.pump.close()
        self.direct_calls.close()
        self.relay_hub.close()
        self.brokers.close()
        super().close()

    def validate(
        self,
        body: Any,
        *,
        tenant: str,
        tier_hint: str = "",
        slo_class: str | None = None,
        kind: str = "chat",
    ) -> ChatRequest:
        """``body`` (parsed JSON) as a :class:`ChatRequest`, checked against the
        models the live instances serve; its prompt is tokenized here, once.
        ``kind="completion"``: a legacy ``/v1/completions`` body."""
        try:
            models = self.models()
        except redis.RedisError as exc:
            raise StoreUnavailable(
                f"the live state store is unavailable ({exc.__class__.__name__}); retry shortly"
            ) from None
        model = body.get("model") if isinstance(body, dict) else None
        return validate_chat(
            body,
            tenant=tenant,
            models=models,
            slo=self.slo,
            tier_hint=tier_hint,
            slo_class=slo_class,
            tokenizer=self.tokenizer_for(model) if isinstance(model, str) else BYTE_TOKENIZER,
            kind=kind,
        )

    def tokenizer_for(self, model: str) -> PromptTokenizer:
        """The tokenizer whose block hashes ``model``'s engines publish.

        A worker in front of a real vLLM serving a local model directory
        registers that directory; prompts for the model are then tokenized and
        hashed as vLLM does (:mod:`tokenfleet.hf_tokenizer`), so the router's
        exact cache tier matches the engine's KV events. Otherwise the
        emulator's byte tokenizer."""
        path, block = "", 0
        for info in self.live_instances():
            if info.model == model and info.tokenizer:
                path, block = info.tokenizer, info.block_size_tokens
                break
        if not path:
            return BYTE_TOKENIZER
        key = f"{path}@{block}"
        tok = self._tokenizers.get(key)
        if tok is None:
            try:
                from tokenfleet.hf_tokenizer import HFChatTokenizer

                tok = HFChatTokenizer(path, block_size_tokens=block or BLOCK_SIZE_TOKENS)
            except (ImportError, OSError, ValueError) as exc:
                log.warning(
                    "model %s: cannot load its tokenizer from %s (%s); using the byte "
                    "tokenizer, so exact cache matching with its engines is off",
                    model,
                    path,
                    exc,
                )
                tok = BYTE_TOKENIZER
            self._tokenizers[key] = tok
        return tok

    def record(self, row: RequestRecord) -> None:
        """Queue a ledger row (never blocks; without a ledger, nothing)."""
        self._ledger(row)

    def health(self) -> dict[str, Any]:
        """Redis and the instances as ``/health`` reports them (raises RedisError).

        The refresh thread reads the instances from Redis every quarter
        second: a copy at most a second old is Redis answering that recently,
        so ``/health`` answers from it without a round trip. Holding 2,000
        streams, the ping itself once waited 855 ms behind the store's and the
        machine's load (docs/benchmarks.md, "Overload"). An older copy means
        the thread is behind or Redis is down: then Redis is pinged and read
        now, and a failure says it is down; so it is after any Redis call of
        this process failed since the copy was read."""
        cached = self.cached_health()
        if cached is not None:
            return cached
        self.state.r.ping()
        return self._health_of(self._refresh_instances())

    def cached_health(self) -> dict[str, Any] | None:
        """:meth:`health` from the refresh thread's copy, without any I/O; None
        when the copy is too old to vouch for Redis (then :meth:`health` asks)."""
        with self._infos_lock:
            fresh = (
                time.monotonic() - self._infos_at <= HEALTH_MAX_AGE_S
                and self._redis_failed_at < self._infos_at
            )
            infos = self._infos
        return self._health_of(infos) if fresh else None

    def _health_of(self, infos: list[InstanceInfo]) -> dict[str, Any]:
        now = time.time()
        healthy = {i.instance_id for i in infos if i.is_healthy(now, self.live.stale_after_s)}
        return {
            "healthy": sorted(healthy),
            "instances": {
                i.instance_id: {
                    "dc": i.dc,
                    "healthy": i.instance_id in healthy,
                    "age_s": round(max(0.0, i.age_s(now)), 3),
                }
                for i in infos
            },
        }
