"""Settings of the live request path (routing, scraping, timeouts, control loop).

One configuration system: these knobs are loaded by
:func:`tokenfleet.service.config.load_config` with the service's own keys,
in the same layers (defaults < file < ``TOKENFLEET_*`` environment <
overrides), and listed in the same generated reference table
(docs/deployment.md). ``ServiceConfig.live`` holds them;
:meth:`LiveConfig.load` is the shortcut for code that needs only these. A
worker, the API and beat started by ``tokenfleet up`` agree on them through
their environment (:meth:`LiveConfig.as_env`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfleet.errors import ConfigError

ENV_PREFIX = "TOKENFLEET_"


def _doc(text: str) -> dict[str, Any]:
    return {"doc": text, "secret": False}


@dataclass(frozen=True)
class LiveConfig:
    """Every knob of the live path; env var = ``TOKENFLEET_`` + upper-case name."""

    router: str = field(
        default="tokenpilot", metadata=_doc("Router name in tokenfleet.core.routing.ROUTERS.")
    )
    router_seed: int = field(
        default=0, metadata=_doc("Seed of the router's random choices (ties, sampling).")
    )
    fleet_policy: str = field(
        default="fleetmind",
        metadata=_doc(
            "Datacenter selector in tokenfleet.core.fleet.FLEET, run before the router "
            '("fleetmind"; "none" keeps every request at its home DC).'
        ),
    )
    topology: str = field(
        default="",
        metadata=_doc(
            "Topology YAML (the simulator's format): regions, RTTs, load ceilings, tenants' homes "
            "and residency. Empty: each DC is its own region, RTTs zero."
        ),
    )
    entry_dc: str = field(
        default="",
        metadata=_doc('The datacenter this API replica runs in (requests enter here); "" = none.'),
    )
    dc_broker_urls: str = field(
        default="",
        metadata=_doc(
            "Per-datacenter Celery brokers, DC=URL,DC=URL: the API publishes a request to "
            "its datacenter's broker, whose workers consume there (multi-region, "
            'docs/deployment.md). "": every DC uses broker_url.'
        ),
    )
    broker_down_s: float = field(
        default=5.0,
        metadata=_doc(
            "A datacenter whose broker refused a publish or a probe is left out of DC "
            "selection this long (its requests spill where residency allows)."
        ),
    )
    redis_prefix: str = field(
        default="tf", metadata=_doc("Key prefix in Redis, so several fleets can share one server.")
    )
    scrape_interval_s: float = field(
        default=0.5, metadata=_doc("How often a worker scrapes its engine's /metrics and /health.")
    )
    stale_after_s: float = field(
        default=3.0,
        metadata=_doc("A snapshot older than this is treated as a dead instance (worker gone)."),
    )
    affinity_min_cached_tokens: int = field(
        default=256,
        metadata=_doc(
            "A request is sent to an instance's own queue only if the router expects at least this"
            " many cached prompt tokens there; else to the shared pool."
        ),
    )
    affinity_min_cached_fraction: float = field(
        default=0.25,
        metadata=_doc("... and only if those are at least this fraction of the prompt."),
    )
    pool_prefill_budget_tokens: int = field(
        default=2048,
        metadata=_doc(
            "A worker takes work from its DC's shared pool queues only while the prompts waiting "
            "for prefill on its engine (uncached tokens) stay under this, so late binding means "
            '"the first engine whose prefill queue is (nearly) empty".'
        ),
    )
    affinity_when_idle: bool = field(
        default=True,
        metadata=_doc(
            "A request without a valuable cache hit still goes to the router's choice's own queue"
            " when, by the API's dispatch accounting, that instance has a slot free and less"
            " uncached prompt waiting for prefill than pool_prefill_budget_tokens, and nothing of"
            " the request's tier waits in the pool: its worker would take it from the pool at once"
            " anyway, and the router chose among such instances knowing more (cache, decode load,"
            " KV). False: only cache hits are pinned, the rest late-bound."
        ),
    )
    affinity_dead_after_s: float = field(
        default=2.0,
        metadata=_doc(
            "An affinity-queued request whose instance has been dead this long is re-sent."
        ),
    )
    lease_ttl_s: float = field(
        default=3.0,
        metadata=_doc("Worker lease on a running request; renewed every lease_ttl_s / 3."),
    )
    engine_stall_timeout_s: float = field(
        default=10.0,
        metadata=_doc(
            "No token from the engine for this long: the request is aborted and retried. Before "
            "the first token: this plus 3 x the prompt's own prefill time on the profile."
        ),
    )
    engine_connect_timeout_s: float = field(
        default=2.0, metadata=_doc("Connect timeout to an engine.")
    )
    engine_fail_threshold: int = field(
        default=2,
        metadata=_doc(
            "Engine failures in a row that mark an instance unhealthy (for `engine_unhealthy_s`)."
        ),
    )
    engine_unhealthy_s: float = field(
        default=5.0,
        metadata=_doc(
            "How long an instance stays marked unhealthy after `engine_fail_threshold` failures in"
            " a row."
        ),
    )
    max_attempts: int = field(
        default=3, metadata=_doc("Attempts per request (first try included) before it fails.")
    )
    request_timeout_s: float = field(
        default=600.0,
        metadata=_doc("How long the API waits for a request to finish before answering 504."),
    )
    control_period_s: float = field(
        # the simulator's: the controller smooths and steps per period, so at 1 s
        # (the default until 2026-12-05) the live lane jumped between a quarter and
        # all of the pool from one second to the next (docs/benchmarks.md, section 21)
        default=5.0,
        metadata=_doc(
            "Period of beat's control loop (SLOMax tier shares and admission knobs), "
            "seconds; the simulator's default too, for which the controller is tuned."
        ),
    )
    fleet_period_s: float = field(
        default=60.0,
        metadata=_doc(
            "Period of beat's long cycle (FleetMind spill shares and replica targets), seconds."
        ),
    )
    reconcile_period_s: float = field(
        default=10.0,
        metadata=_doc(
            "Period of beat's ledger reconciler: rows left `in_flight` whose request nobody"
            " serves any more are settled, seconds."
        ),
    )
    reconcile_grace_s: float = field(
        default=15.0,
        metadata=_doc(
            "The reconciler judges only rows older than this, and settles a request whose"
            " worker lease lapsed only after it stayed unowned this long, seconds."
        ),
    )
    stream_ttl_s: float = field(
        default=120.0,
        metadata=_doc(
            "Relay streams live this long after the last write (client reconnects, debugging)."
        ),
    )
    relay_flush_interval_s: float = field(
        default=0.02,
        metadata=_doc(
            "Tokens after the first are forwarded at most this often per request, seconds"
            " (0: as the engine flushes them): on the direct path the API reads the engine's"
            " stream at most this often, on the relay path the worker writes a Redis Stream"
            " entry at most this often. At one read, entry and SSE chunk per token they were"
            " most of the control plane's CPU per request; the API's pump CPU follows the reads"
            " (10/20/40/80 ms: 13.5/8.5/4.9/3.3 CPU-ms per 256-token stream on a 2-core VM,"
            " docs/benchmarks.md section 17)."
        ),
    )
    api_stream_pump: bool = field(
        default=True,
        metadata=_doc(
            "On the direct path, one thread of the API process (the stream pump) carries every"
            " stream past its first token, waiting on all engine and client sockets at once;"
            " the request's thread sleeps until the stream ends. False: each request's thread"
            " reads its engine and writes its client itself (a thread woken per flush): three times"
            " fewer streams held at once at 2,000 slow streams (docs/live.md, The stream pump)."
        ),
    )
    booking_check: bool = field(
        default=True,
        metadata=_doc(
            "While other API replicas are alive: book an affinity dispatch before it is final;"
            " when the booking's reply shows dispatches to that instance this replica's"
            " accounting copy (refreshed every 20 ms) lacked, the router decides again with"
            " them (replicas deciding alike from the same late copy would send their requests"
            " to the same instance). One more Redis round trip for those requests."
        ),
    )
    express_dispatch: bool = field(
        default=True,
        metadata=_doc(
            "With direct_stream, the API runs a request's first attempt itself, with no broker"
            " message and no worker hop, when the router's chosen instance is idle by the API's"
            " dispatch accounting (a slot free, its prefill queue under"
            " pool_prefill_budget_tokens, nothing of the tier queued for it or its pool): it"
            " claims the request, calls the engine and settles it as the worker would. Re-sends"
            " and every busy instance go through the broker. False: every attempt is a Celery task."
        ),
    )
    direct_stream: bool = field(
        default=True,
        metadata=_doc(
            "The API reads the engine's stream itself once the worker that claimed the request"
            " hands it over (the worker keeps queueing, admission, the slot and the ledger row;"
            " two Redis entries per request instead of one per relayed batch of tokens). False:"
            " the worker reads the engine and relays the tokens through Redis."
        ),
    )
    request_state_ttl_s: float = field(
        default=7200.0,
        metadata=_doc("Seconds the ledger row of a request may wait in Redis idempotency state."),
    )
    seed_api_keys: str = field(
        default="",
        metadata=_doc(
            '"key=tenant,key2=tenant2": API keys accepted without the database (seed keys).'
        ),
    )
    visibility_timeout_s: float = field(
        default=7200.0,
        metadata=_doc(
            "Celery broker visibility timeout (Redis/SQS): above the longest queued+running time."
        ),
    )
    worker_events: bool = field(
        default=False,
        metadata=_doc(
            "Workers send Celery heartbeats and task events, so Flower (`tokenfleet up "
            "--flower`, compose) shows workers and tasks; costs a few broker messages per task."
        ),
    )
    api_linger_s: float = field(
        default=1.0,
        metadata=_doc(
            "An API server thread waits this long on the keep-alive connection it just served for "
            "the next request (0: hand it straight back to cheroot's selector)."
        ),
    )
    max_body_bytes: int = field(
        default=50 * 1024 * 1024,
        metadata=_doc(
            "Largest request body the API reads (JSON endpoints), bytes; larger ones get 413 "
            "before they are read (Content-Length) or as soon as they pass it (chunked). 50 MiB "
            "is OpenAI's documented payload limit of one request."
        ),
    )
    max_upload_bytes: int = field(
        default=200 * 1024 * 1024,
        metadata=_doc(
            "Largest file accepted by POST /v1/files, bytes (OpenAI's limit for batch input "
            "files, 200 MB); the multipart body may be 1 MiB larger."
        ),
    )
    max_json_depth: int = field(
        default=64,
        metadata=_doc("Deepest nesting of arrays/objects in a JSON body; deeper gets 400."),
    )
    max_api_key_chars: int = field(
        default=256,
        metadata=_doc(
            "Longer bearer keys are refused (401) before any lookup; TokenFleet keys are 46 "
            "characters."
        ),
    )
    auth_cache_entries: int = field(
        default=10_000,
        metadata=_doc(
            "API keys (known or not) and tenants each API process remembers, least recently "
            "used first out, so random keys cannot grow its memory."
        ),
    )
    auth_stale_s: float = field(
        default=900.0,
        metadata=_doc(
            "While PostgreSQL is unreachable, keys and tenants this process looked up in the last "
            "auth_stale_s seconds keep working from its memory (0: refuse them, 503)."
        ),
    )
    admin_session_lifetime_s: float = field(
        default=12 * 3600.0,
        metadata=_doc("Lifetime of an admin UI login, seconds (the cookie and the server side)."),
    )
    admin_cookie_secure: str = field(
        default="auto",
        metadata=_doc(
            'Secure flag of the admin session cookie: "auto" (set when the request came over '
            'https, directly or per X-Forwarded-Proto), "true" or "false".'
        ),
    )
    api_max_inflight: int = field(
        default=4096,
        metadata=_doc(
            "Chat requests (streams included) one API process holds at once; the next is "
            "answered 503 with Retry-After at once (0: no bound). The server's thread pool "
            "grows to this plus a reserve, so /health never waits behind chat requests."
        ),
    )
    api_switch_interval_ms: float = field(
        default=1.0,
        metadata=_doc(
            "The API process's interpreter switch interval (Python's default is 5 ms): how "
            "long a thread running Python may keep the others, /health included, waiting."
        ),
    )
    api_full_gc_every_s: float = field(
        default=60.0,
        metadata=_doc(
            "The API process runs its full garbage collections itself: at most this often, "
            "when few requests are in flight (a full collection holds every thread; 0: "
            "Python's own schedule)."
        ),
    )
    api_full_gc_at_most_s: float = field(
        default=900.0,
        metadata=_doc("...and after this long without one even when the process is never quiet."),
    )
    api_stall_log_ms: float = field(
        default=100.0,
        metadata=_doc(
            "The API process logs every garbage collection, and every stall of its threads, "
            "of at least this long (what makes /health late; 0: off)."
        ),
    )
    worker_stall_log_ms: float = field(
        default=250.0,
        metadata=_doc(
            "A worker process logs every garbage collection, and every stall of its threads, "
            "of at least this long (what lapses its leases; 0: off)."
        ),
    )
    api_front_slots: int = field(
        default=8,
        metadata=_doc(
            "Chat requests of one API process doing their CPU work before the dispatch (parse, "
            "tokenize, route, publish) at once; the others wait (0: no gate)."
        ),
    )
    api_front_wait_s: float = field(
        default=2.0,
        metadata=_doc(
            "How long a chat request waits for the front gate before it is answered 503 with "
            "Retry-After."
        ),
    )
    shed_wait_factor: float = field(
        default=1.0,
        metadata=_doc(
            "Refuse (429, Retry-After) a request whose predicted queue wait in its datacenter "
            "exceeds this times its tier's TTFT limit (0: never; only with an admission policy)."
        ),
    )
    #: admission policy in tokenfleet.core.admission.ADMISSION ("none" admits everything)
    admission: str = field(
        default="slomax",
        metadata=_doc(
            'Admission policy in `tokenfleet.core.admission.ADMISSION`, run at arrival ("none" '
            "admits everything; `tokenfleet api --admission` overrides it)."
        ),
    )

    api_hold_queued: bool = field(
        default=True,
        metadata=_doc(
            "Hold an interactive or long-context request the admission policy queued in the "
            "API until the policy releases it, as the simulator does (false: route it at once "
            "into its tier's pool queue, which the workers' tier gates pace)."
        ),
    )
    api_hold_tick_s: float = field(
        default=0.005,
        metadata=_doc(
            "How often an API process asks the admission policy whether a held request may go."
        ),
    )

    @classmethod
    def load(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        path: str | Path | None = None,
        **overrides: Any,
    ) -> LiveConfig:
        """Defaults < config file (``path`` or ``$TOKENFLEET_CONFIG``) < ``env``
        (default: ``os.environ``) < ``overrides`` (``None`` values ignored)."""
        from tokenfleet.service.config import load_config

        return load_config(path, env=env, overrides=overrides).live

    def validate(self) -> None:
        for name in (
            "scrape_interval_s",
            "stale_after_s",
            "lease_ttl_s",
            "engine_stall_timeout_s",
            "control_period_s",
            "fleet_period_s",
            "request_timeout_s",
            "reconcile_period_s",
            "reconcile_grace_s",
            "broker_down_s",
        ):
            if not getattr(self, name) > 0:
                raise ConfigError(f"'{name}' must be > 0 seconds, got {getattr(self, name)}")
        if self.relay_flush_interval_s < 0:
            raise ConfigError("'relay_flush_interval_s' must be >= 0 seconds")
        if self.max_attempts < 1:
            raise ConfigError("'max_attempts' must be >= 1")
        for name in (
            "max_body_bytes",
            "max_upload_bytes",
            "max_json_depth",
            "max_api_key_chars",
            "auth_cache_entries",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"'{name}' must be >= 1, got {getattr(self, name)}")
        if self.auth_stale_s < 0 or self.admin_session_lifetime_s <= 0:
            raise ConfigError("'auth_stale_s' must be >= 0 and 'admin_session_lifetime_s' > 0")
        if self.admin_cookie_secure not in ("auto", "true", "false"):
            raise ConfigError(
                "'admin_cookie_secure' must be auto, true or false, got "
                f"{self.admin_cookie_secure!r}"
            )
        if self.stale_after_s < 2 * self.scrape_interval_s:
            raise ConfigError("'stale_after_s' must be at least two scrape intervals")
        self.dc_brokers()

    def dc_brokers(self) -> dict[str, str]:
        """``dc_broker_urls`` as {dc: broker URL}."""
        from tokenfleet.live.brokers import parse_dc_broker_urls

        try:
            return parse_dc_broker_urls(self.dc_broker_urls)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def seed_keys(self) -> dict[str, str]:
        """``seed_api_keys`` as {key: tenant}."""
        out: dict[str, str] = {}
        for part in self.seed_api_keys.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, tenant = part.partition("=")
            if not sep or not key or not tenant:
                raise ConfigError(f"seed_api_keys entry '{part}' must look like KEY=TENANT")
            out[key] = tenant
        return out

    def as_env(self) -> dict[str, str]:
        """Environment that reproduces this config in a child process."""
        return {
            ENV_PREFIX + f.name.upper(): str(getattr(self, f.name))
            for f in dataclasses.fields(self)
        }
