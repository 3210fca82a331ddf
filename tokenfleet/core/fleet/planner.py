"""The long cycle: replica placement, prewarming, spill shares and rollback.

Once per long cycle (default 60 s) the planner reads what the last cycle
looked like (demand per model version and home DC, load and SLO attainment
per DC, spilled-in traffic) and returns the next :class:`Plan`:

1. **Rollback.** A DC that took spilled-in work (at least
   ``rollback_min_spill_in`` of its outcomes) and missed its attainment
   target, over the whole cycle or over its recent half, is being hurt by
   the spill. Its spill share is cut (multiplied by ``rollback_cut``, 0 by
   default) and its replica targets are restored to the plan in force before
   the last change that touched it. Each such DC yields a
   :class:`RollbackEvent`; it is excluded from capacity moves this cycle.
2. **Recovery.** A DC whose share was cut and that met its target again
   gets ``recover_step`` of share back per cycle.
3. **Capacity.** Per model version, the *unmet* demand is what the home
   pools cannot carry under their ``load_ceiling`` minus the room other
   pools of that version have under their spill-in ceiling (closed shares
   and rolled-back DCs offer none); demand is in work-seconds per second,
   so 1.0 keeps one replica busy. Unmet demand is covered, at most
   ``max_changes`` replicas per cycle, by (a) new replicas at the hot DC,
   (b) new replicas at the DCs nearest to it, within free GPU slots and the
   global GPU budget, then (c) by converting under-used replicas (load below
   ``donor_load``, beyond what their own demand needs) of another version
   at the DC nearest the demand. New replicas prewarm: the simulator makes
   them ready ``prewarm_s`` later.

The planner is pure: no clock, no I/O; the driver enacts plans.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

PoolKey = tuple[str, str, str]  # (dc, model, version)


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One (DC, model, version) over the last long cycle."""

    dc: str
    model: str
    version: str
    tp: int  # GPUs per replica
    replicas: int  # ready + warming now
    ready: int
    demand_work_s: float  # work-s/s of requests whose home is this pool's DC
    served_work_s: float  # work-s/s dispatched to this pool
    load: float  # mean load over the cycle (1.0 = fully busy)


@dataclass(frozen=True, slots=True)
class DCStats:
    dc: str
    served: int  # requests finished here in the cycle
    slo_met: int
    spilled_in: int  # of those, requests whose home is elsewhere
    target: float
    free_gpus: int  # slots not used by any replica (ready or warming)
    load_ceiling: float = 0.85
    spill_in_ceiling: float = 0.85
    # the same counts over the most recent part of the cycle, so that a DC that
    # degrades late in a cycle is rolled back at its end, not one cycle later
    recent_served: int = 0
    recent_slo_met: int = 0
    recent_spilled_in: int = 0

    @property
    def attainment(self) -> float | None:
        return self.slo_met / self.served if self.served else None

    @property
    def spilled_in_share(self) -> float:
        return self.spilled_in / self.served if self.served else 0.0

    @property
    def recent_attainment(self) -> float | None:
        return self.recent_slo_met / self.recent_served if self.recent_served else None

    @property
    def recent_spilled_in_share(self) -> float:
        return self.recent_spilled_in / self.recent_served if self.recent_served else 0.0

    def hurt_by_spill(self, min_spill_in: float, min_recent: int) -> bool:
        """Below target while taking spilled-in work, over the whole cycle or
        over its recent part (given at least ``min_recent`` outcomes)."""
        att = self.attainment
        if att is not None and att < self.target and self.spilled_in_share >= min_spill_in:
            return True
        ratt = self.recent_attainment
        return (
            self.recent_served >= min_recent
            and ratt is not None
            and ratt < self.target
            and self.recent_spilled_in_share >= min_spill_in
        )


@dataclass(frozen=True, slots=True)
class PlanAction:
    kind: str  # "add" (prewarm new replicas) | "remove" | "spill_share"
    dc: str
    model: str = ""
    version: str = ""
    count: int = 0
    value: float | None = None  # new spill share for "spill_share"
    reason: str = ""


@dataclass(frozen=True)
class Plan:
    plan_id: int
    at_s: float
    replicas: Mapping[PoolKey, int]  # target replicas (ready + warming)
    spill_share: Mapping[str, float]  # per DC: cap on spill into it, 0..1
    actions: tuple[PlanAction, ...] = ()
    kind: str = "initial"  # "initial" | "plan" | "rollback"
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RollbackEvent:
    at_s: float
    dc: str
    attainment: float  # over the whole cycle
    recent_attainment: float | None  # over its recent part
    target: float
    spilled_in_share: float
    spill_share_before: float
    spill_share_after: float
    restored_plan_id: int
    plan_id: int  # the plan the rollback produced


@dataclass(frozen=True, slots=True)
class PlannerInput:
    now_s: float
    pools: Sequence[PoolStats]
    dcs: Mapping[str, DCStats]
    gpu_budget: int | None
    gpus_used: int  # by ready + warming replicas, fleet-wide


@dataclass
class Planner:
    """Keeps the plan history; ``step`` returns the next plan (or the same)."""

    initial: Plan
    rtt_s: Callable[[str, str], float]
    donor_load: float = 0.5
    max_changes: int = 2
    rollback_min_spill_in: float = 0.05
    rollback_min_recent: int = 20
    rollback_cut: float = 0.0
    recover_step: float = 0.5
    history: list[Plan] = field(default_factory=list)
    rollbacks: list[RollbackEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.history:
            self.history.append(self.initial)

    @property
    def current(self) -> Plan:
        return self.history[-1]

    def step(self, inp: PlannerInput) -> tuple[Plan, list[RollbackEvent]]:
        cur = self.current
        replicas = _actual(inp, cur)
        shares = dict(cur.spill_share)
        actions: list[PlanAction] = []
        offenders = [
            st
            for _, st in sorted(inp.dcs.items())
            if st.hurt_by_spill(self.rollback_min_spill_in, self.rollback_min_recent)
        ]
        restored: dict[str, int] = {}
        for st in offenders:
            before = shares.get(st.dc, 1.0)
            shares[st.dc] = before * self.rollback_cut
            actions.append(
                PlanAction(
                    "spill_share",
                    st.dc,
                    value=shares[st.dc],
                    reason="rollback: spilled-in traffic drove attainment below target",
                )
            )
            prev = self._before_last_change(st.dc)
            restored[st.dc] = prev.plan_id
            for key in sorted(set(replicas) | set(prev.replicas)):
                if key[0] != st.dc:
                    continue
                want = prev.replicas.get(key, 0)
                have = replicas.get(key, 0)
                if want != have:
                    replicas[key] = want
                    actions.append(
                        PlanAction(
                            "add" if want > have else "remove",
                            key[0],
                            key[1],
                            key[2],
                            abs(want - have),
                            reason=f"rollback: restore plan {prev.plan_id}",
                        )
                    )
        bad = {st.dc for st in offenders}
        for dc, st in sorted(inp.dcs.items()):
            share = shares.get(dc, 1.0)
            att = st.attainment
            if dc not in bad and share < 1.0 and (att is None or att >= st.target):
                new = min(1.0, share + self.recover_step)
                shares[dc] = new
                actions.append(
                    PlanAction(
                        "spill_share", dc, value=new, reason="recovered: attainment back at target"
                    )
                )
        actions.extend(self._capacity(inp, replicas, shares, bad))
        if not actions:
            return cur, []
        plan = Plan(
            plan_id=cur.plan_id + 1,
            at_s=inp.now_s,
            replicas=replicas,
            spill_share=shares,
            actions=tuple(actions),
            kind="rollback" if offenders else "plan",
            reason="; ".join(dict.fromkeys(a.reason for a in actions)),
        )
        self.history.append(plan)
        events = [
            RollbackEvent(
                at_s=inp.now_s,
                dc=st.dc,
                attainment=st.attainment or 0.0,
                recent_attainment=st.recent_attainment,
                target=st.target,
                spilled_in_share=st.spilled_in_share,
                spill_share_before=cur.spill_share.get(st.dc, 1.0),
                spill_share_after=shares[st.dc],
                restored_plan_id=restored[st.dc],
                plan_id=plan.plan_id,
            )
            for st in offenders
        ]
        self.rollbacks.extend(events)
        return plan, events

    def _before_last_change(self, dc: str) -> Plan:
        """The plan in force before the latest change to ``dc``'s replicas."""

        def at(p: Plan) -> dict[PoolKey, int]:
            return {k: v for k, v in p.replicas.items() if k[0] == dc and v}

        hist = self.history
        latest = at(hist[-1])
        for p in reversed(hist[:-1]):
            if at(p) != latest:
                return p
        return hist[-1]

    # -- capacity -----------------------------------------------------------------
    def unmet_work_s(
        self,
        inp: PlannerInput,
        mv: tuple[str, str],
        replicas: Mapping[PoolKey, int],
        shares: Mapping[str, float],
        bad: set[str],
    ) -> float:
        """Demand for ``mv`` (work-s/s) that no pool can carry under its ceilings.

        A pool carries its own DC's demand up to ``replicas x load_ceiling``;
        what is left over at the hot DCs may spill into the room other pools
        have under their spill-in ceiling, unless the plan closed their share
        or they are being rolled back.
        """
        deficit = 0.0
        room = 0.0
        for p in inp.pools:
            if (p.model, p.version) != mv:
                continue
            st = inp.dcs.get(p.dc)
            if st is None:
                continue
            n = replicas.get((p.dc, p.model, p.version), 0)
            cap = n * st.load_ceiling
            deficit += max(0.0, p.demand_work_s - cap)
            if p.dc not in bad and shares.get(p.dc, 1.0) > 0.0:
                room += max(0.0, min(cap, n * st.spill_in_ceiling) - p.demand_work_s)
        return max(0.0, deficit - room)

    def _capacity(
        self,
        inp: PlannerInput,
        replicas: dict[PoolKey, int],
        shares: Mapping[str, float],
        bad: set[str],
    ) -> list[PlanAction]:
        stats = {(p.dc, p.model, p.version): p for p in inp.pools}
        tp = {(p.model, p.version): p.tp for p in inp.pools}
        free = {dc: st.free_gpus for dc, st in inp.dcs.items()}
        budget_left = math.inf if inp.gpu_budget is None else inp.gpu_budget - inp.gpus_used
        actions: list[PlanAction] = []
        changes = 0
        versions = sorted({(p.model, p.version) for p in inp.pools})
        unmet = {mv: self.unmet_work_s(inp, mv, replicas, shares, bad) for mv in versions}
        for mv in sorted(versions, key=lambda m: (-unmet[m], m)):
            if unmet[mv] <= 0.0:
                continue
            homes = sorted(
                (p for p in inp.pools if (p.model, p.version) == mv and p.demand_work_s > 0),
                key=lambda p: (-(p.demand_work_s - p.replicas), p.dc),
            )
            if not homes:
                continue
            hot = homes[0].dc
            per_replica = inp.dcs[hot].load_ceiling if hot in inp.dcs else 0.8
            need = math.ceil(unmet[mv] / max(0.05, per_replica) - 1e-9)
            g = tp[mv]
            order = sorted(
                (d for d in inp.dcs if d not in bad),
                key=lambda d: (d != hot, self.rtt_s(hot, d), d),
            )
            # (a)+(b): new replicas in free slots, within the budget
            for dc in order:
                while (
                    need > 0
                    and changes < self.max_changes
                    and free.get(dc, 0) >= g
                    and budget_left >= g
                ):
                    key = (dc, mv[0], mv[1])
                    replicas[key] = replicas.get(key, 0) + 1
                    free[dc] -= g
                    budget_left -= g
                    need -= 1
                    changes += 1
                    _merge(
                        actions,
                        PlanAction(
                            "add",
                            dc,
                            mv[0],
                            mv[1],
                            1,
                            reason=f"prewarm: {mv[0]}@{mv[1]} demand exceeds capacity near {hot}",
                        ),
                    )
            # (c): convert under-used replicas of other versions, nearest first
            donors = sorted(
                (
                    s
                    for s in stats.values()
                    if (s.model, s.version) != mv
                    and s.load < self.donor_load
                    and s.ready > 0
                    and s.dc not in bad
                    and tp.get((s.model, s.version)) == g
                ),
                key=lambda s: (self.rtt_s(hot, s.dc), s.load, s.dc),
            )
            for d in donors:
                key_d = (d.dc, d.model, d.version)
                ceiling = inp.dcs[d.dc].load_ceiling if d.dc in inp.dcs else 0.8
                own = max(d.served_work_s, d.demand_work_s)
                own_need = max(1 if own > 0 else 0, math.ceil(own / max(0.05, ceiling) - 1e-9))
                spare = replicas.get(key_d, 0) - own_need
                while need > 0 and spare > 0 and changes < self.max_changes:
                    key = (d.dc, mv[0], mv[1])
                    replicas[key_d] -= 1
                    replicas[key] = replicas.get(key, 0) + 1
                    spare -= 1
                    need -= 1
                    changes += 1
                    why = (
                        f"move: {d.model}@{d.version} at {d.dc} is under-used "
                        f"(load {d.load:.2f}); {mv[0]}@{mv[1]} short near {hot}"
                    )
                    _merge(actions, PlanAction("remove", d.dc, d.model, d.version, 1, reason=why))
                    _merge(actions, PlanAction("add", d.dc, mv[0], mv[1], 1, reason=why))
        return actions


def _actual(inp: PlannerInput, cur: Plan) -> dict[PoolKey, int]:
    """Replica counts as they are now: timeline events (rollouts, failures) change
    them outside any plan, so plans start from the truth, not from the last plan."""
    out = {k: v for k, v in cur.replicas.items()}
    for p in inp.pools:
        out[(p.dc, p.model, p.version)] = p.replicas
    return out


def _merge(actions: list[PlanAction], a: PlanAction) -> None:
    """Fold repeated single-replica actions on one pool into one action."""
    for i, b in enumerate(actions):
        if (b.kind, b.dc, b.model, b.version, b.reason) == (
            a.kind,
            a.dc,
            a.model,
            a.version,
            a.reason,
        ):
            actions[i] = replace(b, count=b.count + a.count)
            return
    actions.append(a)
