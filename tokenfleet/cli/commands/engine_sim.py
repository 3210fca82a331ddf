"""``tokenfleet engine-sim``: run one emulated vLLM server in the foreground."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tokenfleet.engine.profiles import PROFILES


def register(subparsers: Any) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "engine-sim",
        help="serve an emulated vLLM (OpenAI API + /metrics) driven by the engine model",
        description="Serve vLLM's OpenAI-compatible API and Prometheus metrics from the "
        "simulator's engine model, in real time. See docs/emulator.md.",
    )
    p.add_argument("--port", type=int, required=True, help="TCP port (0 = any free port)")
    p.add_argument(
        "--profile", required=True, help=f"engine profile: {', '.join(PROFILES.names())}"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--model", default=None, help="model name (default: the profile's model)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may use in 'model' (default: --model)",
    )
    p.add_argument(
        "--kv-capacity-blocks",
        type=int,
        default=None,
        help="override the profile's KV cache size, in 16-token blocks",
    )
    p.add_argument(
        "--host-kv-gb",
        type=float,
        default=0.0,
        metavar="N",
        help="host-memory KV tier of N GB, as vLLM's --kv-offloading-size "
        "(OffloadingConnector); 0 (default) = GPU KV only",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="override the model context length, in tokens",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per model second (0.1 = 10x faster)",
    )
    p.add_argument(
        "--fail-5xx-rate",
        type=float,
        default=0.0,
        help="fraction of completion requests answered 500 (seeded)",
    )
    p.add_argument(
        "--latency-spike-ms", type=float, default=0.0, help="pause the step loop this long ..."
    )
    p.add_argument("--spike-every-s", type=float, default=0.0, help="... every this many seconds")
    p.add_argument(
        "--stall-after-s",
        type=float,
        default=None,
        help="stop making progress after S seconds (/health turns 503)",
    )
    p.add_argument(
        "--crash-after-s",
        type=float,
        default=None,
        help="exit the process hard (status 1) after S seconds",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish vLLM KV events on this ZMQ endpoint (bound, e.g. "
        "tcp://127.0.0.1:5557; subscribers connect to it)",
    )
    p.add_argument(
        "--kv-events-connect",
        action="store_true",
        help="connect to --kv-events-endpoint instead (one indexer binds, many engines connect)",
    )
    p.add_argument("--kv-events-topic", default="", help="ZMQ topic (vLLM default: empty)")
    p.add_argument(
        "--kv-events-format",
        choices=["map", "array"],
        default="map",
        help="event encoding: map (vLLM >= #42892) or array (older vLLM)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for output lengths and faults")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tokenfleet.emulator.server import EmulatorConfig, EmulatorServer

    cfg = EmulatorConfig(
        profile=args.profile,
        host=args.host,
        port=args.port,
        model=args.model,
        served_model_names=tuple(args.served_model_name or ()),
        kv_capacity_blocks=args.kv_capacity_blocks,
        host_kv_gb=args.host_kv_gb,
        max_model_len_tokens=args.max_model_len,
        time_scale=args.time_scale,
        fail_5xx_rate=args.fail_5xx_rate,
        latency_spike_ms=args.latency_spike_ms,
        spike_every_s=args.spike_every_s,
        stall_after_s=args.stall_after_s,
        crash_after_s=args.crash_after_s,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_format=args.kv_events_format,
        kv_events_connect=args.kv_events_connect,
        seed=args.seed,
        access_log=args.access_log,
        instance_id=f"engine-sim-{args.port}",
    )
    server = EmulatorServer(cfg)

    def announce(url: str) -> None:
        events = f", KV events on {server.kv_events_endpoint}" if server.kv_events_endpoint else ""
        print(
            f"engine-sim: serving {server.profile.name} as "
            f"{', '.join(server.served_model_names)} on {url} "
            f"(time_scale={cfg.time_scale}{events})",
            file=sys.stderr,
            flush=True,
        )

    try:
        server.serve_forever(on_ready=announce)
    except KeyboardInterrupt:
        pass
    return 0
