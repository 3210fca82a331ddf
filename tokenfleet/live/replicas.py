"""Enacting the FleetMind plan's replica targets on a local fleet.

Beat's long cycle writes ``target:<dc>|<model>|<version>`` (replicas, ready
plus warming) into the Redis ``fleet`` hash. On a real cluster a deployment
controller reads those keys; on one machine, ``tokenfleet up`` runs this
actuator over its own emulated engines:

* **prewarm**: a DC below its target gets a new engine process first; only
  when the engine answers ``/health`` does its worker start, register and
  become routable. Meanwhile ``warming:<dc>|<model>|<version>`` counts it,
  so the next planner cycle does not order the same replica twice;
* **retire** (a rollback restoring an earlier plan, or a lower target): the
  newest replica the actuator added goes first, worker before engine
  (Celery's warm shutdown lets running requests finish; the instance then
  ages out of every gateway's view). Replicas ``up`` started with are never
  retired, so the fleet never shrinks below what the user asked for;
* ``max_per_dc`` caps the local fleet (it shares two cores with everything).

The actuator decides from Redis and process state only; spawning is given
as callables so tests and ``up`` share it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("tokenfleet.replicas")


@dataclass
class Replica:
    dc: str
    name: str  # instance id
    url: str  # engine base URL
    state: str = "warming"  # warming -> serving -> retired
    children: list[str] = field(default_factory=list)  # supervisor names, start order


class LocalReplicas:
    """Reconciles the local fleet with the plan's replica targets."""

    def __init__(
        self,
        sup: Any,
        state: Any,
        *,
        base: dict[str, int],
        start_engine: Callable[[str, str], tuple[str, str]],
        start_worker: Callable[[str, str, str], str],
        healthy: Callable[[str], bool],
        max_per_dc: int = 3,
    ) -> None:
        """``start_engine(dc, name) -> (child, url)``; ``start_worker(dc, name,
        url) -> child``; ``healthy(url)`` probes an engine."""
        self.sup = sup
        self.state = state
        self.base = dict(base)
        self.start_engine = start_engine
        self.start_worker = start_worker
        self.healthy = healthy
        self.max_per_dc = max_per_dc
        self.added: dict[str, list[Replica]] = {dc: [] for dc in base}
        self._seq = 0
        self._pool_of: dict[str, str] = {}  # dc -> the pool key its target came from

    def targets(self) -> dict[str, tuple[int, str]]:
        """Per DC: (target replicas, the pool key it came from). The local fleet
        serves one model, so a DC's target is its largest pool target."""
        out: dict[str, tuple[int, str]] = {}
        for (dc, model, version), n in self.state.replica_targets().items():
            if dc in self.base and (dc not in out or n > out[dc][0]):
                out[dc] = (n, f"{dc}|{model}|{version}")
        return out

    def count(self, dc: str) -> int:
        return self.base.get(dc, 0) + sum(1 for r in self.added.get(dc, ()) if r.state != "retired")

    def reconcile(self) -> list[str]:
        """One pass; returns what changed, as lines for the console."""
        said: list[str] = []
        for dc, (target, pool) in sorted(self.targets().items()):
            have = self.count(dc)
            if target > have and have < self.max_per_dc:
                said.append(self._add(dc, pool))
            elif target < have and self.added[dc]:
                said.append(self._retire(dc))
        for dc, reps in self.added.items():
            for r in reps:
                if r.state == "warming" and self.healthy(r.url):
                    r.children.append(self.start_worker(dc, r.name, r.url))
                    r.state = "serving"
                    self._warming(dc, -1)
                    said.append(f"replica {r.name} in {dc} is warm; its worker is starting")
        for dc in self.added:
            self.added[dc] = [r for r in self.added[dc] if r.state != "retired"]
        return said

    def _add(self, dc: str, pool: str) -> str:
        self._seq += 1
        name = f"{dc.split('-')[-1]}-p{self._seq}"
        child, url = self.start_engine(dc, name)
        rep = Replica(dc, name, url, children=[child])
        self.added[dc].append(rep)
        self._pool_of[dc] = pool
        self._warming(dc, +1)
        log.info("plan: prewarming replica %s in %s (%s)", name, dc, url)
        return f"plan: prewarming a new replica {name} in {dc}"

    def _retire(self, dc: str) -> str:
        live = [r for r in self.added[dc] if r.state != "retired"]
        rep = live[-1]
        if rep.state == "warming":
            self._warming(dc, -1)
        for child in reversed(rep.children):  # worker first, then its engine
            c = self.sup.children.get(child)
            if c is not None:
                c.restart = False
                self.sup.stop(child)
                self.sup.children.pop(child, None)
        rep.state = "retired"
        log.info("plan: retired replica %s in %s", rep.name, dc)
        return f"plan: retired replica {rep.name} in {dc}"

    def _warming(self, dc: str, delta: int) -> None:
        pool = self._pool_of.get(dc)
        if pool is None:
            return
        self.state.r.hincrby(self.state.k("fleet"), f"warming:{pool}", delta)

    def stop(self) -> None:
        """Zero the warming counters this actuator set (``up`` is stopping)."""
        for dc, reps in self.added.items():
            n = sum(1 for r in reps if r.state == "warming")
            if n:
                self._warming(dc, -n)


__all__ = ["LocalReplicas", "Replica"]
