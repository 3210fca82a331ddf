"""How low can any router push the TTFT tail on a trace? A prefix-cache bound.

With one router and little queueing, TokenPilot's TTFT tail on Mooncake is
prefill of the prompt part that is not cached. A router decides only where a
prompt goes; each engine then caches and evicts by LRU. So the best a router
can do, short of knowing the future, is what one LRU cache holding the whole
pool's KV would do (no prefix stored twice), with no queueing at all. This
replays the trace through such caches and prints the p50/p95 of *prefill
alone* (the engine profile's chunked prefill of the uncached part):

* ``lru_pooled``: one LRU of ``instances x kv_capacity`` (the no-future bound);
* ``oracle_admission``: the same LRU, but a block is cached only if a later
  request will use it (future knowledge no router has; how much smarter
  admission could buy at most, with LRU eviction);
* ``infinite``: every block stays cached (only first-time content misses);
* with ``--host-kv-gb N``, ``lru_pooled+host``: the pooled GPU LRU backed by a
  pooled host-memory tier of ``instances x N`` GB that every cached block is
  written through to (vLLM's offloading connector); a host hit costs the
  profile's host-link transfer instead of its prefill.

Generated blocks count as the engine caches them: a workload with
conversation structure (``output_block_hashes``: synthetic ``chat`` and
``conversations``, TokenFleet JSONL with ``turn``) adds each answer's blocks
after its request, so the next turn can hit them.

Block granularity is the engine's (16 tokens); blocks are inserted deepest
first, so the shallow end of a prompt is the freshest, as in vLLM's free
queue. With ``--against FILE`` (a ``tokenfleet sim --json`` result) it also
prints the p95 a policy needs to be 15% below the best cache-aware peer.

    .venv/bin/python benchmarks/cache_bound.py [--trace PATH] [--instances 8] \
        [--against out/tokenpilot/load0.8.json]
    .venv/bin/python benchmarks/cache_bound.py --workload examples/scenarios/conversations.yaml \
        --host-kv-gb 256 [--against out/conv.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

from tokenfleet.engine.profiles import EngineProfile, get_profile
from tokenfleet.workloads.loader import load_workload
from tokenfleet.workloads.trace import TraceRequest

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "mooncake_synthetic.jsonl"
)
PEERS = ("llmd_weighted", "sglang_cache_aware", "dynamo_kv")


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _insert(lru: OrderedDict[int, None], hashes: Sequence[int], cap: int | None) -> None:
    for h in reversed(hashes):  # deepest first: the prompt's head is freshest
        lru[h] = None
        lru.move_to_end(h)
    if cap is not None:
        while len(lru) > cap:
            lru.popitem(last=False)


def _depth(lru: OrderedDict[int, None], hashes: Sequence[int]) -> int:
    n = 0
    for h in hashes:
        if h not in lru:
            break
        n += 1
    return n


def replay(
    prompts: Sequence[tuple[int, ...]],
    inputs: Sequence[int],
    capacity_blocks: int | None,
    oracle: bool,
    block_tokens: int,
    outputs: Sequence[tuple[int, ...]] = (),
) -> tuple[list[int], float]:
    """Cached tokens per request, and the token hit ratio. ``outputs``: the
    blocks each request's answer adds to the cache (empty: none)."""
    last_use: dict[int, int] = {}
    if oracle:  # the last request that uses each block
        for i, hashes in enumerate(prompts):
            for h in hashes:
                last_use[h] = i
    lru: OrderedDict[int, None] = OrderedDict()
    cached_tokens: list[int] = []
    hit = total = 0
    for i, hashes in enumerate(prompts):
        n = _depth(lru, hashes)
        c = min(n * block_tokens, max(0, inputs[i] - 1))
        cached_tokens.append(c)
        hit += c
        total += inputs[i]
        written = tuple(hashes) + (tuple(outputs[i]) if outputs else ())
        if oracle:  # never used again: do not cache it
            for h in written:
                if last_use.get(h, -1) <= i:
                    lru.pop(h, None)
            written = tuple(h for h in written if last_use.get(h, -1) > i)
        _insert(lru, written, capacity_blocks)
    return cached_tokens, hit / max(1, total)


def replay_tiered(
    prompts: Sequence[tuple[int, ...]],
    inputs: Sequence[int],
    gpu_blocks: int,
    host_blocks: int,
    block_tokens: int,
    outputs: Sequence[tuple[int, ...]] = (),
) -> tuple[list[tuple[int, int]], float, float]:
    """(GPU-cached, host-loaded) tokens per request, and both hit ratios:
    a pooled GPU LRU written through to a pooled host LRU."""
    gpu: OrderedDict[int, None] = OrderedDict()
    host: OrderedDict[int, None] = OrderedDict()
    out: list[tuple[int, int]] = []
    g_hit = h_hit = total = 0
    for i, hashes in enumerate(prompts):
        lim = max(0, inputs[i] - 1)
        g = min(_depth(gpu, hashes) * block_tokens, lim)
        deep = min(max(_depth(host, hashes) * block_tokens, g), lim)
        out.append((g, deep - g))
        g_hit += g
        h_hit += deep - g
        total += inputs[i]
        written = tuple(hashes) + (tuple(outputs[i]) if outputs else ())
        _insert(gpu, written, gpu_blocks)
        _insert(host, written, host_blocks)
    return out, g_hit / max(1, total), h_hit / max(1, total)


def _requests(args: argparse.Namespace, prof: EngineProfile) -> list[TraceRequest]:
    """The trace, generator or scenario, as ``tokenfleet sim`` would replay it."""
    if args.workload:
        from tokenfleet.workloads.mix import build_at_load, load_mix

        spec = load_mix(args.workload)
        return build_at_load(spec, spec.load or 0.8, prof, args.instances)[0]
    if args.synthetic:
        from tokenfleet.workloads.synthetic import generate

        return generate(args.synthetic, args.synthetic_requests, args.seed, 10.0)
    return list(load_workload(args.trace))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--synthetic", help="a generator (e.g. conversations) instead of a trace")
    ap.add_argument("--synthetic-requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workload", help="a scenario YAML (e.g. examples/scenarios/conversations.yaml)"
    )
    ap.add_argument("--host-kv-gb", type=float, default=0.0, help="add the GPU+host bound")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--profile", default="llama3-8b-h200")
    ap.add_argument("--against", help="a `tokenfleet sim --json` result with the peers")
    args = ap.parse_args()
    if not (args.workload or args.synthetic) and not Path(args.trace).exists():
        print(f"trace {args.trace} not found (it lives in ../shared/traces)", file=sys.stderr)
        return 2
    prof: EngineProfile = get_profile(args.profile)
    reqs = sorted(_requests(args, prof), key=lambda r: r.info.arrival_s)
    prompts = [tuple(r.info.block_hashes) for r in reqs]
    inputs = [r.info.input_tokens for r in reqs]
    outputs = [tuple(r.output_block_hashes) for r in reqs]
    if not any(outputs):
        outputs = []
    cap = args.instances * prof.kv_capacity_blocks
    print(
        f"{len(reqs)} requests, {args.instances} x {prof.kv_capacity_tokens:,} KV tokens "
        f"({prof.name}), prefill alone, no queueing" + (", answers cached" if outputs else "")
    )
    print(f"{'cache':<18} {'hit ratio':>9} {'p50 s':>7} {'p95 s':>7}")
    rows = {}
    for name, capacity, oracle in (
        ("lru_pooled", cap, False),
        ("oracle_admission", cap, True),
        ("infinite", None, False),
    ):
        cached, ratio = replay(prompts, inputs, capacity, oracle, prof.block_size_tokens, outputs)
        ttft = [prof.prefill_time_s(max(1, n - c), c) for n, c in zip(inputs, cached, strict=True)]
        rows[name] = _pct(ttft, 0.95)
        print(f"{name:<18} {ratio:>9.1%} {_pct(ttft, 0.50):>7.3f} {_pct(ttft, 0.95):>7.3f}")
    if args.host_kv_gb > 0:
        tiered_prof = prof.with_overrides(host_kv_bytes=args.host_kv_gb * 1e9)
        host_cap = args.instances * tiered_prof.host_kv_capacity_blocks
        split, g_ratio, h_ratio = replay_tiered(
            prompts, inputs, cap, host_cap, prof.block_size_tokens, outputs
        )
        ttft = [
            tiered_prof.prefill_time_s(max(1, n - g - h), g + h) + tiered_prof.host_load_time_s(h)
            for n, (g, h) in zip(inputs, split, strict=True)
        ]
        print(
            f"{'lru_pooled+host':<18} {g_ratio + h_ratio:>9.1%} {_pct(ttft, 0.50):>7.3f} "
            f"{_pct(ttft, 0.95):>7.3f}   (GPU {g_ratio:.1%}, host {h_ratio:.1%}; "
            f"{args.instances} x {args.host_kv_gb:g} GB)"
        )
    if args.against:
        data = json.loads(Path(args.against).read_text())
        runs = data.get("runs", data.get("results", []))
        p95 = {}
        for run in runs:
            pol = run.get("policy")
            if pol in PEERS and run.get("ttft_p95_s") is not None:
                p95[pol] = float(run["ttft_p95_s"])
        if not p95:
            print(
                f"no peer ({', '.join(sorted(PEERS))}) with a TTFT p95 in {args.against}",
                file=sys.stderr,
            )
            return 2
        best = min(p95, key=lambda k: p95[k])
        need = 0.85 * p95[best]
        print(
            f"best peer p95 {p95[best]:.3f} s ({best}); 15% below it is {need:.3f} s; "
            f"the no-future bound is {rows['lru_pooled']:.3f} s "
            f"({'below' if rows['lru_pooled'] < need else 'ABOVE'} the target)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
