"""Check that TokenFleet tokenizes and hashes prompts as a running vLLM does.

    .venv/bin/python tools/vllm/check_hashes.py --model-dir DIR \
        [--url http://127.0.0.1:8100] [--kv tcp://127.0.0.1:5557] [--model tiny]

Sends chat requests that share a long system prompt, reads the engine's KV
events (ZMQ) and compares, for each request: the token ids with vLLM's
``/tokenize``, the prompt token count with the response's usage, and the
block hashes :class:`tokenfleet.hf_tokenizer.HFChatTokenizer` computes with
the ones the engine stored (before splitting into router blocks). The engine's
block size comes from its ``vllm:cache_config_info`` metric. Exit code 0 when
everything matches.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from typing import Any

import msgpack
import zmq

from tokenfleet.hf_tokenizer import HFChatTokenizer, vllm_block_hashes
from tokenfleet.live.scrape import cache_config


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        raw = r.read()
    return json.loads(raw) if body is not None else raw.decode()


def _stored_hashes(sock: zmq.Socket[bytes], wait_s: float) -> list[int]:
    out: list[int] = []
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if not sock.poll(100):
            continue
        _topic, _seq, payload = sock.recv_multipart()
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for ev in batch[1]:
            if isinstance(ev, dict) and ev.get("type") == "BlockStored":
                out.extend(ev["block_hashes"])
            elif isinstance(ev, list) and ev and ev[0] == "BlockStored":
                out.extend(ev[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8100")
    ap.add_argument("--kv", default="tcp://127.0.0.1:5557")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    block = int(cache_config(_call(args.url + "/metrics")).get("block_size", "16"))
    tok = HFChatTokenizer(args.model_dir, block_size_tokens=block)
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(args.kv)
    time.sleep(1.0)  # ZMQ's slow joiner
    # a fresh prefix: blocks the engine already holds are not stored (or reported) again
    nonce = f"run {time.time_ns()}. "
    system = {"role": "system", "content": nonce + "You are a helpful assistant. " * 30}
    seen: set[int] = set()
    ok = True
    for i, text in enumerate(["hello world", "write code for the router " * 5, "a question"]):
        messages = [system, {"role": "user", "content": f"{text} {i}"}]
        ids = tok.token_ids(messages)
        remote = _call(args.url + "/tokenize", {"model": args.model, "messages": messages})
        resp = _call(
            args.url + "/v1/chat/completions",
            {"model": args.model, "messages": messages, "max_tokens": 4},
        )
        seen.update(_stored_hashes(sock, 2.0))
        ours = vllm_block_hashes(ids, block)
        held = sum(1 for h in ours if h in seen)
        same = remote["tokens"] == ids and resp["usage"]["prompt_tokens"] == len(ids)
        print(
            f"request {i}: {len(ids)} tokens (/tokenize {remote['count']}, usage "
            f"{resp['usage']['prompt_tokens']}), ids equal {remote['tokens'] == ids}; "
            f"{held}/{len(ours)} of our {block}-token block hashes stored by the engine"
        )
        ok = ok and same and held == len(ours)
    print("MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
