"""The emulator's HTTP server: vLLM's OpenAI API and /metrics over a real socket.

A stdlib ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-
alive). Streams use chunked transfer encoding and write each SSE event as it
is produced, with TCP_NODELAY, so a client sees every token when the engine
step that made it ends. A client that goes away is aborted in the engine
even before its first token, as vLLM aborts on ``http.disconnect``: one
thread watches every waiting socket for the hang-up (:mod:`.hangup`), so a
handler thread sleeps until a token, its end or the hang-up wakes it.
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tokenfleet.emulator.engine import (
    EmulatedEngine,
    EmulatedRequest,
    EngineLoop,
    RequestHandle,
    finish_reason,
)
from tokenfleet.emulator.hangup import HangupWatch
from tokenfleet.emulator.kv_events import EVENT_FORMATS, KVEventPublisher
from tokenfleet.emulator.metrics import EmulatorMetrics
from tokenfleet.emulator.openai_api import (
    ApiError,
    ParsedRequest,
    chunk_body,
    completion_body,
    parse_request,
    prompt_stream,
    usage,
    usage_chunk,
)
from tokenfleet.emulator.pd import (
    RELEASE_PATH,
    KVTransferParams,
    log,
    notify_release,
    parse_kv_transfer_params,
    prefill_response_params,
)
from tokenfleet.engine.instance import EngineRequest
from tokenfleet.engine.kv_link import KVLink
from tokenfleet.engine.profiles import EngineProfile, get_profile
from tokenfleet.errors import CapacityError, ConfigError
from tokenfleet.tokenizer import block_hashes, decode_token_ids, filler_word, token_ids

#: exit status when ``crash_after_s`` fires
CRASH_EXIT_CODE = 1
#: how often a handler asks its own socket for EOF where no hang-up watch runs
_POLL_S = 0.05
#: a watched handler's longest sleep between looks at its request (seconds)
_WATCHED_WAIT_S = 2.0
_MAX_BODY_BYTES = 64 << 20


@dataclass(slots=True)
class EmulatorConfig:
    """Everything ``tokenfleet engine-sim`` accepts; times are wall-clock seconds."""

    profile: str | EngineProfile = "llama3-8b-h200"
    host: str = "127.0.0.1"
    port: int = 0
    model: str | None = None  # defaults to the profile's model name
    served_model_names: tuple[str, ...] = ()
    kv_capacity_blocks: int | None = None
    #: host-memory KV tier, GB (vLLM's ``--kv-offloading-size``); 0 = off
    host_kv_gb: float = 0.0
    max_model_len_tokens: int | None = None
    time_scale: float = 1.0
    fail_5xx_rate: float = 0.0
    latency_spike_ms: float = 0.0
    spike_every_s: float = 0.0
    stall_after_s: float | None = None
    crash_after_s: float | None = None
    kv_events_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_format: str = "map"
    kv_events_connect: bool = False  # default: bind the endpoint (see kv_events.py)
    seed: int = 0
    access_log: bool = False
    instance_id: str = field(default="emulator-0")
    #: JSONL file with one line per finished completion (engine-side timings,
    #: wall-clock seconds); default: ``$TOKENFLEET_EMULATOR_REQUEST_LOG``
    request_log: str | None = None

    def resolved_profile(self) -> EngineProfile:
        prof = get_profile(self.profile) if isinstance(self.profile, str) else self.profile
        if self.max_model_len_tokens is not None:
            prof = prof.with_overrides(
                model=replace(prof.model, max_model_len_tokens=self.max_model_len_tokens)
            )
        if self.host_kv_gb > 0:
            prof = prof.with_overrides(host_kv_bytes=self.host_kv_gb * 1e9)
        return prof

    def validate(self) -> None:
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0 (1.0 = real time), got {self.time_scale}")
        if not 0.0 <= self.fail_5xx_rate <= 1.0:
            raise ConfigError(f"fail_5xx_rate must be within 0..1, got {self.fail_5xx_rate}")
        if (self.latency_spike_ms > 0) != (self.spike_every_s > 0):
            raise ConfigError(
                "latency spikes need both --latency-spike-ms and --spike-every-s (> 0)"
            )
        if self.latency_spike_ms < 0 or self.spike_every_s < 0:
            raise ConfigError("--latency-spike-ms and --spike-every-s must be >= 0")
        for name in ("stall_after_s", "crash_after_s"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name} must be >= 0 seconds, got {value}")
        if self.kv_capacity_blocks is not None and self.kv_capacity_blocks < 1:
            raise ConfigError("kv_capacity_blocks must be >= 1")
        if not 0.0 <= self.host_kv_gb < float("inf"):
            raise ConfigError(f"host_kv_gb must be a finite number >= 0, got {self.host_kv_gb}")
        if self.max_model_len_tokens is not None and self.max_model_len_tokens < 2:
            raise ConfigError("max_model_len must be >= 2 tokens")
        if self.kv_events_format not in EVENT_FORMATS:
            raise ConfigError(f"kv_events_format must be one of {', '.join(EVENT_FORMATS)}")


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 1024

    def __init__(self, addr: tuple[str, int], app: EmulatorServer) -> None:
        self.app = app
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, _Handler)


class EmulatorServer:
    """An in-process emulated vLLM server.

    >>> srv = EmulatorServer("llama3-8b-h200", port=0, time_scale=0.05)
    >>> url = srv.start()          # "http://127.0.0.1:PORT"
    >>> srv.stop()

    ``crash_after_s`` ends the *whole process* with ``os._exit``; use it from
    the CLI or a subprocess, never inside a test runner.
    """

    def __init__(
        self,
        profile: str | EngineProfile | EmulatorConfig = "llama3-8b-h200",
        port: int = 0,
        **options: Any,
    ) -> None:
        if isinstance(profile, EmulatorConfig):
            cfg = replace(profile, **options) if options else profile
            if port:
                cfg = replace(cfg, port=port)
        else:
            cfg = EmulatorConfig(profile=profile, port=port, **options)
        cfg.validate()
        self.config = cfg
        self.profile = cfg.resolved_profile()
        model = cfg.model or self.profile.model.name
        self.served_model_names = cfg.served_model_names or (model,)
        self.model_name = model
        self.max_model_len_tokens = self.profile.model.max_model_len_tokens
        self.metrics = EmulatorMetrics(self.served_model_names[0])
        self.publisher = (
            KVEventPublisher(
                cfg.kv_events_endpoint,
                cfg.kv_events_topic,
                cfg.kv_events_format,
                bind=not cfg.kv_events_connect,
            )
            if cfg.kv_events_endpoint
            else None
        )
        #: where subscribers connect (bound ``tcp://127.0.0.1:*`` resolved to its port)
        self.kv_events_endpoint = (
            self.publisher.resolved_endpoint if self.publisher is not None else None
        )
        self.engine = EmulatedEngine(
            cfg.instance_id,
            self.profile,
            cfg.kv_capacity_blocks,
            record_events=self.publisher is not None,
        )
        self.loop = EngineLoop(
            self.engine,
            self.metrics,
            time_scale=cfg.time_scale,
            latency_spike_s=cfg.latency_spike_ms / 1000.0,
            spike_every_s=cfg.spike_every_s,
            stall_after_s=cfg.stall_after_s,
            publisher=self.publisher,
        )
        self.hangups = HangupWatch()
        #: P/D: KV link to other instances; decode-side requests waiting for KV
        self.kv_link = KVLink()
        self._remote: dict[str, KVTransferParams] = {}
        self.loop.on_remote_loaded = self._remote_loaded
        self._rng = random.Random(cfg.seed)
        self._fail_rng = random.Random(cfg.seed ^ 0x5EED)
        self._rng_lock = threading.Lock()
        self._httpd: _HTTPServer | None = None
        self._serve_thread: threading.Thread | None = None
        self.failures_injected = 0
        log_path = cfg.request_log or os.environ.get("TOKENFLEET_EMULATOR_REQUEST_LOG")
        self._request_log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115
        self._request_log_lock = threading.Lock()
        #: wall clock minus the loop's clock, to write loop times as wall times
        self._wall_offset = time.time() - self.loop.clock()

    # -- lifecycle -----------------------------------------------------------
    @property
    def url(self) -> str:
        if self._httpd is None:
            raise RuntimeError("server not started; call start() first")
        host, port = self._httpd.server_address[:2]
        shown = host.decode() if isinstance(host, bytes) else str(host)
        if shown in ("0.0.0.0", ""):
            shown = "127.0.0.1"
        elif shown == "::":
            shown = "::1"
        if ":" in shown:
            shown = f"[{shown}]"
        return f"http://{shown}:{port}"

    @property
    def base_url(self) -> str:
        """OpenAI client ``base_url``."""
        return self.url + "/v1"

    def _bind(self) -> None:
        try:
            self._httpd = _HTTPServer((self.config.host, self.config.port), self)
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {self.config.host}:{self.config.port}: "
                f"{exc}; pick another --port"
            ) from None
        self.loop.start()
        if self.config.crash_after_s is not None:
            threading.Thread(target=self._crash_later, name="crash-timer", daemon=True).start()

    def start(self) -> str:
        """Serve on a background thread; return the base URL (no ``/v1``)."""
        self._bind()
        assert self._httpd is not None
        self._serve_thread = threading.Thread(
            target=self._httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="emulator-http",
            daemon=True,
        )
        self._serve_thread.start()
        return self.url

    def serve_forever(self, on_ready: Callable[[str], None] | None = None) -> None:
        """Serve on the calling thread (the CLI); ``on_ready(url)`` once listening."""
        self._bind()
        assert self._httpd is not None
        if on_ready is not None:
            on_ready(self.url)
        try:
            self._httpd.serve_forever(poll_interval=0.2)
        finally:
            self._close()

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
        self._close()

    def _close(self) -> None:
        self.loop.stop()
        self.hangups.close()
        if self._httpd is not None:
            self._httpd.server_close()
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self._request_log is not None:
            with self._request_log_lock:
                self._request_log.close()
                self._request_log = None

    def log_request(self, handle: RequestHandle, received_s: float) -> None:
        """One line of the request log (if enabled): when the HTTP request came
        in, was submitted to the engine, when the model's step produced its
        first token and when that token was delivered (all wall clock)."""
        if self._request_log is None:
            return
        off = self._wall_offset
        loop = self.loop
        line = json.dumps(
            {
                "id": handle.request_id,
                "received": received_s,
                "submitted": handle.arrival_s + off,
                "first_model": (
                    handle.first_token_model_s + off
                    if handle.first_token_model_s is not None
                    else None
                ),
                "first": handle.first_token_at_s + off if handle.first_token_at_s else None,
                "done": time.time(),
                "status": handle.status,
                "input_tokens": handle.req.input_tokens,
                "cached_tokens": handle.cached_tokens,
                "generated": handle.generated,
                "loop_resyncs": loop.resyncs,
                "loop_lost_s": round(loop.lost_s, 6),
            }
        )
        with self._request_log_lock:
            if self._request_log is not None:
                self._request_log.write(line + "\n")

    def __enter__(self) -> EmulatorServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _crash_later(self) -> None:
        assert self.config.crash_after_s is not None
        time.sleep(self.config.crash_after_s)
        sys.stderr.write(
            f"tokenfleet engine-sim: injected crash after {self.config.crash_after_s}s\n"
        )
        sys.stderr.flush()
        os._exit(CRASH_EXIT_CODE)

    # -- request plumbing ---------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return not self.loop.stalled

    def inject_failure(self) -> bool:
        if self.config.fail_5xx_rate <= 0:
            return False
        with self._rng_lock:
            hit = self._fail_rng.random() < self.config.fail_5xx_rate
        if hit:
            self.failures_injected += 1
        return hit

    def parse(self, body: Any, headers: dict[str, str], chat: bool) -> ParsedRequest:
        with self._rng_lock:
            parsed = parse_request(
                body,
                headers,
                chat=chat,
                max_model_len_tokens=self.max_model_len_tokens,
                rng=self._rng,
            )
        if parsed.model is not None and parsed.model not in self.served_model_names:
            raise ApiError(404, f"The model `{parsed.model}` does not exist.", "model")
        return parsed

    def submit(
        self, parsed: ParsedRequest, request_id: str, kv: KVTransferParams | None = None
    ) -> RequestHandle:
        req = EmulatedRequest(
            request_id=request_id,
            input_tokens=parsed.input_tokens,
            output_tokens=parsed.output_tokens,
            block_hashes=block_hashes(parsed.prompt_stream, self.profile.block_size_tokens),
            prompt_stream=parsed.prompt_stream if self.publisher is not None else b"",
            max_tokens=parsed.max_tokens,
            filler_seed=parsed.filler_seed,
        )
        if kv is not None and kv.do_remote_decode:
            req.hold_kv = True  # the decode instance reads the KV, then releases it
        elif kv is not None and kv.do_remote_prefill:
            same_node = kv.remote_host == self.config.host
            req.remote_kv_tokens = parsed.input_tokens
            req.remote_load_s = self.kv_link.transfer_s(
                self.profile, parsed.input_tokens, same_node
            )
            self._remote[request_id] = kv
        try:
            return self.loop.submit(req)
        except CapacityError as exc:
            raise ApiError(400, str(exc), "max_tokens") from None
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None

    def _remote_loaded(self, req: EngineRequest) -> None:
        """Decode side: the prompt's KV arrived; tell the prefill side (engine thread)."""
        kv = self._remote.pop(req.request_id, None)
        if kv is None or kv.remote_host is None or kv.remote_port is None:
            return
        log.info(
            "kv transfer: %s received %d tokens of KV from engine %s in %.4f s (model time)",
            req.request_id,
            req.remote_hit_tokens,
            kv.remote_engine_id,
            req.remote_load_s,
        )
        notify_release(
            kv.remote_host,
            kv.remote_port,
            kv.remote_request_id or req.request_id,
            self.config.instance_id,
            req.remote_hit_tokens,
        )

    def release_kv(self, request_id: str, reader: str, tokens: int) -> bool:
        """Prefill side: a decode instance has read ``request_id``'s KV."""
        ok = self.loop.release_kv(request_id)
        log.info(
            "kv transfer: %s sent %d tokens of KV to engine %s%s",
            request_id,
            tokens,
            reader,
            "" if ok else " (nothing held: already released)",
        )
        return ok

    def served_model(self, parsed: ParsedRequest) -> str:
        return parsed.model or self.served_model_names[0]

    def models_body(self) -> dict[str, Any]:
        created = int(time.time())
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": self.model_name,
                    "parent": None,
                    "max_model_len": self.max_model_len_tokens,
                    "permission": [],
                }
                for name in self.served_model_names
            ],
        }


class _ClientGone(Exception):
    pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "tokenfleet-emulator"
    server: _HTTPServer
    #: the request in the engine is on the hang-up watch; the client hung up
    _watched = False
    _gone = False

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        if self.server.app.config.access_log:
            super().log_message(format, *args)

    # -- plumbing -----------------------------------------------------------------
    @property
    def app(self) -> EmulatorServer:
        return self.server.app

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    def _send(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_error(self, err: ApiError) -> None:
        self._send_json(err.status, err.body())

    def _read_json(self) -> Any:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise ApiError(411, "chunked request bodies are not supported; send Content-Length")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise ApiError(400, "bad Content-Length header") from None
        if length > _MAX_BODY_BYTES:
            self.close_connection = True
            raise ApiError(400, f"request body over {_MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(length) if length else b""
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None

    def _client_gone(self) -> bool:
        """EOF on the socket while we have not answered: the client hung up."""
        sock = self.connection
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            if not readable:
                return False
            return bool(sock.recv(1, socket.MSG_PEEK) == b"")
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _wait(self, handle: RequestHandle, seen: int | None) -> None:
        """Block until ``handle`` has more than ``seen`` tokens (``None``: until
        done); raises :class:`_ClientGone` when the client hung up."""
        if self._watched:
            while True:
                handle.changed.clear()
                if self._gone:
                    raise _ClientGone()
                if handle.done or (seen is not None and handle.generated > seen):
                    return
                handle.changed.wait(_WATCHED_WAIT_S)
        next_check = time.monotonic() + _POLL_S
        while True:
            handle.changed.clear()
            if handle.done or (seen is not None and handle.generated > seen):
                return
            handle.changed.wait(_POLL_S)
            now = time.monotonic()
            if now >= next_check:
                if self._client_gone():
                    raise _ClientGone()
                next_check = now + _POLL_S

    # -- routes ----------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self._path()
        app = self.app
        if path == "/health":
            if app.healthy:
                self._send(200, b"", "text/plain")
            else:
                self._send_json(503, ApiError(503, "engine is stalled").body())
        elif path == "/metrics":
            self._send(200, app.metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/v1/models":
            self._send_json(200, app.models_body())
        elif path == "/version":
            self._send_json(200, {"version": "tokenfleet-emulator"})
        else:
            self._send_error(ApiError(404, f"no route GET {path}"))

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        path = self._path()
        try:
            if path == "/v1/chat/completions":
                self._completion(chat=True)
            elif path == "/v1/completions":
                self._completion(chat=False)
            elif path == "/tokenize":
                self._tokenize()
            elif path == "/detokenize":
                self._detokenize()
            elif path in ("/v1/chat/completions/render", "/v1/completions/render"):
                self._render(chat=path.startswith("/v1/chat"))
            elif path == "/abort_request":
                self._abort()
            elif path == RELEASE_PATH:
                self._release_kv()
            elif path == "/reset_prefix_cache":
                self._read_json_or_empty()
                dropped = self.app.loop.reset_prefix_cache()
                self._send_json(200, {"dropped_blocks": dropped})
            else:
                self._read_json_or_empty()
                self._send_error(ApiError(404, f"no route POST {path}"))
        except ApiError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def _read_json_or_empty(self) -> Any:
        length = self.headers.get("Content-Length")
        if not length or length == "0":
            return {}
        return self._read_json()

    def _release_kv(self) -> None:
        """P/D: the decode side read a held request's KV (NIXL's notification)."""
        body = self._read_json_or_empty()
        if not isinstance(body, dict) or not isinstance(body.get("request_id"), str):
            raise ApiError(400, 'body must be {"request_id": ID, ...}')
        tokens = body.get("tokens")
        ok = self.app.release_kv(
            body["request_id"],
            str(body.get("engine_id", "?")),
            tokens if isinstance(tokens, int) else 0,
        )
        self._send_json(200, {"released": ok})

    def _abort(self) -> None:
        """SGLang-style ``{"rid": ID}`` or ``{"abort_all": true}`` (vLLM has none)."""
        body = self._read_json_or_empty()
        if not isinstance(body, dict):
            raise ApiError(400, "body must be a JSON object")
        loop = self.app.loop
        if body.get("abort_all") is True:
            n = loop.abort_all()
        else:
            rids = body.get("rid", body.get("request_ids"))
            if isinstance(rids, str):
                rids = [rids]
            if not isinstance(rids, list) or not all(isinstance(r, str) for r in rids):
                raise ApiError(
                    400, "give 'rid' (a request id or a list) or 'abort_all': true", "rid"
                )
            n = sum(1 for r in rids if loop.abort(r))
        self._send_json(200, {"aborted": n})

    def _tokenize(self) -> None:
        """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages`` -> token ids."""
        body = self._read_json()
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        chat = "messages" in body
        ids = list(token_ids(prompt_stream(body, chat)))
        self._send_json(
            200,
            {
                "count": len(ids),
                "max_model_len": self.app.max_model_len_tokens,
                "tokens": ids,
                "token_strs": None,
            },
        )

    def _detokenize(self) -> None:
        """vLLM's ``POST /detokenize``: ``tokens`` -> ``prompt`` text."""
        body = self._read_json()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list):
            raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
        try:
            text = decode_token_ids(tokens)
        except ValueError as exc:
            raise ApiError(400, str(exc), "tokens") from None
        self._send_json(200, {"prompt": text})

    def _render(self, chat: bool) -> None:
        """vLLM's render endpoints (``--enable-scale-out``): the request as the
        engine would run it, token ids and sampling limits, without running it."""
        body = self._read_json()
        headers = {k.lower(): v for k, v in self.headers.items()}
        parsed = self.app.parse(body, headers, chat)
        self._send_json(
            200,
            {
                "request_id": self.headers.get("X-Request-Id") or uuid.uuid4().hex,
                "token_ids": list(token_ids(parsed.prompt_stream)),
                "sampling_params": {"max_tokens": parsed.max_tokens},
                "model": parsed.model or self.app.model_name,
                "stream": parsed.stream,
            },
        )

    def _completion(self, chat: bool) -> None:
        app = self.app
        received = time.time()
        body = self._read_json()
        if app.inject_failure():
            raise ApiError(500, "injected failure (--fail-5xx-rate)")
        headers = {k.lower(): v for k, v in self.headers.items()}
        parsed = app.parse(body, headers, chat)
        kv = parse_kv_transfer_params(body) if isinstance(body, dict) else None
        request_id = self.headers.get("X-Request-Id") or uuid.uuid4().hex
        handle = app.submit(parsed, request_id, kv)
        prefix = "chatcmpl-" if chat else "cmpl-"
        rid = prefix + request_id
        self._gone = False

        def hung_up() -> None:
            self._gone = True
            handle.changed.set()

        self._watched = app.hangups.watch(self.connection, hung_up)
        try:
            if parsed.stream:
                self._stream(handle, parsed, rid)
            else:
                self._respond(handle, parsed, rid)
        except (_ClientGone, BrokenPipeError, ConnectionResetError, TimeoutError):
            app.loop.abort(handle.request_id)
            self.close_connection = True
        finally:
            if self._watched:
                app.hangups.unwatch(self.connection)
            app.log_request(handle, received)

    def _respond(self, handle: RequestHandle, parsed: ParsedRequest, rid: str) -> None:
        self._wait(handle, None)
        if handle.status == "shutdown":
            raise ApiError(503, "server is shutting down")
        n = handle.generated
        seed = handle.req.filler_seed
        text = "".join(filler_word(seed, i) for i in range(n))
        reason = finish_reason(handle.req) if handle.status == "completed" else "abort"
        body = completion_body(
            parsed.chat,
            rid,
            int(time.time()),
            self.app.served_model(parsed),
            text,
            reason,
            usage(parsed.input_tokens, n, handle.cached_tokens),
        )
        if handle.req.hold_kv:
            app = self.app
            body["kv_transfer_params"] = prefill_response_params(
                app.config.instance_id,
                app.config.host,
                self.server.server_address[1],
                handle.request_id,
                list(range(-(-handle.req.input_tokens // app.profile.block_size_tokens))),
                app.profile.tp,
            )
        self._send_json(200, body, {"X-Request-Id": handle.request_id})

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def _stream(self, handle: RequestHandle, parsed: ParsedRequest, rid: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Request-Id", handle.request_id)
        self.end_headers()
        chat = parsed.chat
        model = self.app.served_model(parsed)
        created = int(time.time())
        seed = handle.req.filler_seed
        sent = 0
        while True:
            self._wait(handle, sent)
            done = handle.done
            status = handle.status
            n = handle.generated
            events: list[dict[str, Any]] = []
            if chat and sent == 0 and n > 0:
                events.append(chunk_body(True, rid, created, model, "", None, role=True))
            reason: str | None = None
            if done:
                reason = finish_reason(handle.req) if status == "completed" else "abort"
            for i in range(sent, n):
                last = done and i == n - 1
                events.append(
                    chunk_body(
                        chat, rid, created, model, filler_word(seed, i), reason if last else None
                    )
                )
            if done and n == sent:
                events.append(chunk_body(chat, rid, created, model, "", reason))
            sent = n
            payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            if done:
                if parsed.include_usage:
                    use = usage(parsed.input_tokens, n, handle.cached_tokens)
                    payload += (
                        b"data: "
                        + json.dumps(usage_chunk(chat, rid, created, model, use)).encode()
                        + b"\n\n"
                    )
                payload += b"data: [DONE]\n\n"
                self._write_chunk(payload)
                self.wfile.write(b"0\r\n\r\n")
                return
            if payload:
                self._write_chunk(payload)
