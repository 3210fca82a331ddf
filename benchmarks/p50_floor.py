"""How low can TTFT p50 go on a workload at a load, whatever the router? A batched floor.

``benchmarks/cache_bound.py`` bounds what caching can do with *prefill
alone*: no queueing and no batching. At a real load every engine is always
mid-step (decodes run all the time), so a request also waits for the step in
progress and shares its prefill step with the running decodes. This runs the
simulator itself (the same engines and arrivals as ``tokenfleet sim``) with
engines no deployment can have, to show where a TTFT p50 target sits:

* ``real``: the engines as shipped (GPU KV, plus ``--host-kv-gb`` host tier),
  round robin and TokenPilot: the ratio the target is stated in;
* ``shared unbounded``: every engine holds every block any engine ever
  computed, at no cost (a pool-wide, infinite, free KV store: each prompt
  hits what an infinite cache allows), with round robin, least requests and
  TokenPilot routing;
* ``shared unbounded + step oracle``: the same cache, and a router that reads
  each engine's true step phase (when its current step ends, how many
  requests it holds) and sends the request to the one that starts its
  prefill first. No live router sees that: scrapes are 0.1-0.5 s old.

Whatever no router can beat with those engines it cannot beat with real ones
either (a real engine only hits less). Issue #19's line "TokenPilot TTFT p50
<= 0.25x round robin" on ``conversations.yaml`` is checked against it::

    .venv/bin/python benchmarks/p50_floor.py [--load 0.8 --load 0.9] [--host-kv-gb 256]

One run takes 20-60 s of simulation (13k requests); each is shown as it goes.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.core.types import PoolSnapshot, RequestInfo, RouteDecision
from tokenfleet.engine.instance import EngineInstance, EngineRequest
from tokenfleet.engine.profiles import EngineProfile, get_profile
from tokenfleet.sim.cluster import PoolConfig, PoolSim, run_pool
from tokenfleet.sim.core import Environment
from tokenfleet.sim.metrics import summarize
from tokenfleet.sim.records import RequestRecord
from tokenfleet.sim.runner import SimSettings
from tokenfleet.workloads.trace import TraceRequest

DEFAULT_WORKLOAD = Path(__file__).resolve().parents[1] / "examples/scenarios/conversations.yaml"
#: GPU memory multiplier of the unbounded engines: ~100 M KV tokens each for
#: an 8B model on an H200, far above any shipped workload's working set
UNBOUNDED_HBM_X = 100.0


class _SharedCacheEngine(EngineInstance):
    """An engine whose prefix cache also holds, for free, every block any
    engine of its pool has stored (``seen``, shared by the pool)."""

    seen: set[int]
    planned_s = 0.0

    def _on_stored(self, req: EngineRequest, first_block: int, hashes: list[int]) -> None:
        self.seen.update(hashes)
        super()._on_stored(req, first_block, hashes)

    def plan_step(self) -> float:
        self.planned_s = super().plan_step()  # the step phase the oracle reads
        return self.planned_s

    def _match(self, req: EngineRequest) -> tuple[int, int]:
        cache = self._cache
        lim = min((req.prompt_tokens - 1) // self.block, len(req.chain))
        for h in req.chain[:lim]:
            if h not in self.seen:
                break
            if h not in cache:  # another engine computed it: here it is, free and cached
                cache[h] = 0
                self._free_queue[h] = None
                self._fresh -= 1
        return super()._match(req)


class _SharedCachePool(PoolSim):
    """A pool of :class:`_SharedCacheEngine`; with ``oracle``, routed by the
    engines' true step phase instead of the configured router."""

    def __init__(
        self,
        env: Environment,
        config: PoolConfig,
        slo: SLOConfig,
        on_done: Callable[[RequestRecord], None],
        oracle: bool,
    ) -> None:
        super().__init__(env, config, slo, on_done)
        seen: set[int] = set()
        engines: list[EngineInstance] = []
        for old in self.engines:
            e = _SharedCacheEngine(old.instance_id, config.profile, config.kv_capacity_blocks)
            e.seen = seen
            e.kv_listener, e.host_listener = old.kv_listener, old.host_listener
            engines.append(e)
        self.engines = engines
        self.oracle = oracle
        self._step_ends = [0.0] * len(engines)

    def _start_step(self, idx: int) -> None:
        engine = self.engines[idx]
        was_stepping = engine.stepping
        super()._start_step(idx)
        if not was_stepping and isinstance(engine, _SharedCacheEngine):
            self._step_ends[idx] = self.env.now + engine.planned_s

    def _route_and_dispatch(
        self,
        trace: TraceRequest,
        info: RequestInfo,
        record: RequestRecord,
        replica: int,
        snap: PoolSnapshot,
    ) -> None:
        if not self.oracle:
            super()._route_and_dispatch(trace, info, record, replica, snap)
            return
        now = self.env.now

        def starts(idx: int) -> tuple[float, int]:
            e = self.engines[idx]
            left = self._step_ends[idx] - now if e.stepping else 0.0
            return (round(max(0.0, left), 4), len(e.running) + len(e.waiting))

        idx = min(range(len(self.engines)), key=starts)
        decision = RouteDecision(self.engines[idx].instance_id, 0, 0.0, "step oracle")
        self._dispatch(trace, info, record, replica, decision)


def _requests(mix: Any, load: float, prof: EngineProfile, n: int) -> list[TraceRequest]:
    from tokenfleet.workloads.mix import build_at_load

    return sorted(build_at_load(mix, load, prof, n)[0], key=lambda r: r.info.arrival_s)


def _run(
    label: str,
    reqs: Sequence[TraceRequest],
    cfg: PoolConfig,
    slo: SLOConfig,
    factory: Any = None,
) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import Progress

    t0 = time.perf_counter()
    with Progress(console=Console(stderr=True), transient=True) as prog:
        task = prog.add_task(label, total=len(reqs))
        records, pool = run_pool(
            reqs,
            cfg,
            slo,
            progress=lambda done, total: prog.update(task, completed=done),
            pool_factory=factory,
        )
    out = summarize(records, slo, busy_s=pool.busy_s())
    out["wall_s"] = time.perf_counter() - t0
    return out


def _row(engines: str, router: str, s: dict[str, Any], rr_p50: float) -> None:
    p50 = s["ttft_p50_s"]
    print(
        f"{engines:<34} {router:<16} {p50:>7.4f} {s['ttft_p95_s']:>7.3f} "
        f"{s['prefix_hit_ratio']:>6.1%} {p50 / rr_p50:>7.3f}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--workload", default=str(DEFAULT_WORKLOAD), help="a scenario YAML")
    ap.add_argument("--load", type=float, action="append", help="repeatable (default 0.8, 0.9)")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--profile", default="llama3-8b-h200")
    ap.add_argument("--host-kv-gb", type=float, default=256.0, help="the real engines' host tier")
    ap.add_argument("--target", type=float, default=0.25, help="p50 target, x round robin")
    ap.add_argument(
        "--routers",
        default="round_robin,least_requests,tokenpilot",
        help="routers on the shared unbounded cache",
    )
    args = ap.parse_args(argv)
    prof = get_profile(args.profile)
    real = prof.with_overrides(host_kv_bytes=args.host_kv_gb * 1e9)
    unbounded = prof.with_overrides(
        gpu=replace(prof.gpu, hbm_bytes=prof.gpu.hbm_bytes * UNBOUNDED_HBM_X)
    )
    from tokenfleet.workloads.mix import load_mix

    mix = load_mix(args.workload)
    slo = SLOConfig.from_mapping(mix.slo, source="slo") if mix.slo is not None else SLOConfig()
    for load in args.load or [0.8, 0.9]:
        reqs = _requests(mix, load, prof, args.instances)
        print(
            f"\n{Path(args.workload).name}, load {load}, {len(reqs)} requests, "
            f"{args.instances} x {prof.name}"
        )
        print(f"{'engines':<34} {'router':<16} {'p50 s':>7} {'p95 s':>7} {'hit':>6} {'p50/RR':>7}")
        rr_p50 = 0.0
        tiers = f"real, GPU + {args.host_kv_gb:g} GB host" if args.host_kv_gb else "real, GPU"
        for router in ("round_robin", "tokenpilot"):
            cfg = SimSettings(profile=real, instances=args.instances).pool_config(router)
            s = _run(router, reqs, cfg, slo)
            rr_p50 = rr_p50 or s["ttft_p50_s"]
            _row(tiers, router, s, rr_p50)
        for router in [r for r in args.routers.split(",") if r] + ["step oracle"]:
            oracle = router == "step oracle"
            cfg = SimSettings(profile=unbounded, instances=args.instances).pool_config(
                "round_robin" if oracle else router
            )

            def factory(
                env: Environment,
                c: PoolConfig,
                s: SLOConfig,
                done: Callable[[RequestRecord], None],
                oracle: bool = oracle,
            ) -> PoolSim:
                return _SharedCachePool(env, c, s, done, oracle)

            _row("shared unbounded, free", router, _run(router, reqs, cfg, slo, factory), rr_p50)
        print(
            f"target: p50 <= {args.target} x {rr_p50:.4f} = {args.target * rr_p50:.4f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
