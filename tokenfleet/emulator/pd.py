"""vLLM's disaggregated-serving protocol, as the emulator speaks it.

A P/D router (vllm-router ``--vllm-pd-disaggregation``, vLLM's
``toy_proxy_server.py``, llm-d's sidecar) sends the prefill instance the
client's request with ``max_tokens`` 1, ``stream`` false and

    "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false,
                           "remote_engine_id": null, "remote_block_ids": null,
                           "remote_host": null, "remote_port": null}

The prefill instance keeps the prompt's KV and answers with
``kv_transfer_params`` naming where it is (``do_remote_prefill`` true,
``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
``remote_port``, ``remote_request_id``, ``tp_size``, as NixlConnector's
``request_finished`` returns them). The router sends those, unchanged, with
the original request to the decode instance, which takes blocks, receives
the KV (``KVLink.transfer_s``), computes the last prompt token and streams.
Where NIXL notifies the prefill side that its blocks were read, the
emulator's decode side POSTs ``/kv_transfer/release`` to the prefill side's
``remote_host:remote_port``; the prefill side then frees them.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenfleet.emulator.openai_api import ApiError

log = logging.getLogger("tokenfleet.emulator.pd")

RELEASE_PATH = "/kv_transfer/release"


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """The fields of ``kv_transfer_params`` the emulator acts on."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None


def parse_kv_transfer_params(body: Mapping[str, Any]) -> KVTransferParams | None:
    """``body["kv_transfer_params"]``, checked; None when absent or null."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ApiError(400, "'kv_transfer_params' must be an object", "kv_transfer_params")
    decode = raw.get("do_remote_decode") is True
    prefill = raw.get("do_remote_prefill") is True
    if decode and prefill:
        raise ApiError(
            400,
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
            "kv_transfer_params",
        )
    port = raw.get("remote_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise ApiError(
            400, "kv_transfer_params.remote_port must be an integer", "kv_transfer_params"
        )
    if prefill and (raw.get("remote_host") is None or port is None):
        raise ApiError(
            400,
            "kv_transfer_params: do_remote_prefill needs remote_host and remote_port "
            "(pass on what the prefill instance returned)",
            "kv_transfer_params",
        )

    def text(key: str) -> str | None:
        v = raw.get(key)
        return None if v is None else str(v)

    return KVTransferParams(
        decode,
        prefill,
        text("remote_engine_id"),
        text("remote_host"),
        port,
        text("remote_request_id"),
    )


def prefill_response_params(
    engine_id: str, host: str, port: int, request_id: str, block_ids: list[int], tp_size: int
) -> dict[str, Any]:
    """What the prefill instance returns for the decode request to carry."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": block_ids,
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": request_id,
        "tp_size": tp_size,
    }


def notify_release(host: str, port: int, request_id: str, engine_id: str, tokens: int) -> None:
    """Tell the prefill side, off the engine thread, that its KV was read."""

    def post() -> None:
        data = json.dumps(
            {"request_id": request_id, "engine_id": engine_id, "tokens": tokens}
        ).encode()
        req = urllib.request.Request(
            f"http://{host}:{port}{RELEASE_PATH}",
            data=data,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=5.0) as resp:
                resp.read()
        except OSError as exc:
            log.warning(
                "kv transfer: could not notify %s:%s of %s: %s", host, port, request_id, exc
            )

    threading.Thread(target=post, name="kv-release", daemon=True).start()
