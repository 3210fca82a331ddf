"""FleetMind's long cycle, live: from ledger outcomes to replica targets, and
from targets to prewarmed (and retired) engines.

* ``planner_input`` turns what beat can read (live pools, the ledger's served
  and refused work, spilled-in counters, the topology) into the planner's
  input; the shipped ``Planner`` then decides.
* ``fleet_cycle`` runs that over real Redis and PostgreSQL and writes the
  plan's targets where the actuator reads them.
* ``LocalReplicas`` (``tokenfleet up``'s actuator) prewarms a replica with a
  real engine and Celery worker, and retires it when the target drops.
"""

from __future__ import annotations

import textwrap
import time
import urllib.request
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.core.fleet import Plan, Planner, parse_topology
from tokenfleet.engine.profiles import get_profile
from tokenfleet.live.dc_select import LivePool, planner_input
from tokenfleet.service.queries import PoolWorkRow

PROFILE = get_profile("llama3-8b-h200")
MODEL = "m"
TOPO = parse_topology(
    {
        "name": "t",
        "datacenters": {
            "dc-a": {
                "region": "r1",
                "gpus": 3,
                "load_ceiling": 0.8,
                "deployments": [{"model": MODEL, "version": "1", "profile": PROFILE.name}],
            },
            "dc-b": {
                "region": "r2",
                "gpus": 1,
                "load_ceiling": 0.8,
                "deployments": [{"model": MODEL, "version": "1", "profile": PROFILE.name}],
            },
        },
        "rtt_ms": {"dc-a": {"dc-b": 30}},
    }
)


def pools() -> list[LivePool]:
    return [
        LivePool("dc-a", MODEL, "", PROFILE, ready=1),
        LivePool("dc-b", MODEL, "", PROFILE, ready=1),
    ]


def work(
    dc: str,
    served: int,
    *,
    uncached: int = 4000,
    out: int = 200,
    met: float = 1.0,
    rejected: int = 0,
) -> PoolWorkRow:
    return PoolWorkRow(
        dc=dc,
        model=MODEL,
        version="",
        served=served,
        slo_met=int(served * met),
        uncached_prompt_tokens=served * uncached,
        completion_tokens=served * out,
        rejected=rejected,
        rejected_prompt_tokens=rejected * uncached,
    )


def plan_for(inp: Any) -> tuple[Plan, Any]:
    initial = Plan(
        plan_id=0,
        at_s=0.0,
        replicas={(p.dc, p.model, p.version): p.replicas for p in inp.pools},
        spill_share={dc: 1.0 for dc in inp.dcs},
    )
    planner = Planner(initial=initial, rtt_s=TOPO.rtt)
    return planner.step(inp)


def test_demand_over_the_ceiling_prewarms_a_replica_where_gpus_are_free() -> None:
    # 60 s of 4k-token prompts: about 1.3 work-s/s at dc-a, 0.1 at dc-b
    inp = planner_input(60.0, 60.0, pools(), [work("dc-a", 600), work("dc-b", 40)], {}, TOPO)
    a = {p.dc: p for p in inp.pools}
    assert a["dc-a"].demand_work_s > 1.0 > 0.2 > a["dc-b"].demand_work_s
    assert inp.dcs["dc-a"].free_gpus == 2 and inp.dcs["dc-b"].free_gpus == 0
    plan, rollbacks = plan_for(inp)
    adds = [x for x in plan.actions if x.kind == "add"]
    assert not rollbacks and adds and {x.dc for x in adds} == {"dc-a"}
    assert plan.replicas[("dc-a", MODEL, "")] >= 2


def test_refused_work_is_demand_too_and_nothing_moves_when_load_is_light() -> None:
    light = planner_input(60.0, 60.0, pools(), [work("dc-a", 100)], {}, TOPO)
    plan, _ = plan_for(light)
    assert not plan.actions  # 0.2 work-s/s: under the ceiling
    refused = planner_input(60.0, 60.0, pools(), [work("dc-a", 100, rejected=600)], {}, TOPO)
    assert refused.pools[0].served_work_s == light.pools[0].served_work_s
    plan, _ = plan_for(refused)
    assert any(x.kind == "add" and x.dc == "dc-a" for x in plan.actions)


def test_without_a_topology_no_gpus_are_assumed_free() -> None:
    inp = planner_input(60.0, 60.0, pools(), [work("dc-a", 600)], {}, None)
    plan, _ = plan_for(inp)
    assert not [x for x in plan.actions if x.kind == "add"]


def test_spilled_in_work_that_hurts_a_dc_rolls_its_share_back() -> None:
    inp = planner_input(
        60.0, 60.0, pools(), [work("dc-a", 100), work("dc-b", 100, met=0.5)], {"dc-b": 30}, TOPO
    )
    assert inp.dcs["dc-b"].spilled_in == 30 and inp.dcs["dc-b"].attainment == 0.5
    plan, rollbacks = plan_for(inp)
    assert [r.dc for r in rollbacks] == ["dc-b"]
    assert plan.spill_share["dc-b"] == 0.0 and plan.kind == "rollback"


# ---- beat's cycle over real Redis and PostgreSQL --------------------------------------
def test_fleet_cycle_turns_ledger_demand_into_a_replica_target(
    redis_server: Any, pg: Any, tmp_path: Path
) -> None:
    import sqlalchemy as sa

    from tests.support.stores import fresh_database
    from tokenfleet.live.config import LiveConfig
    from tokenfleet.live.state import InstanceInfo, LiveState
    from tokenfleet.service.db import make_engine
    from tokenfleet.service.ledger import RequestRow
    from workers import control

    topo = tmp_path / "topo.yaml"
    topo.write_text(
        textwrap.dedent(f"""\
        name: t
        datacenters:
          dc-a: {{region: r1, gpus: 3, deployments: [{{model: {MODEL}, version: "1", profile: {PROFILE.name}}}]}}
          dc-b: {{region: r2, gpus: 1, deployments: [{{model: {MODEL}, version: "1", profile: {PROFILE.name}}}]}}
        rtt_ms: {{dc-a: {{dc-b: 30}}}}
        """)
    )
    url = fresh_database(pg, "tokenfleet_replicas")
    engine = make_engine(url)
    state = LiveState.from_url(redis_server.url, prefix="tfrep")
    state.r.flushdb()
    for dc, iid in (("dc-a", "a0"), ("dc-b", "b0")):
        info = InstanceInfo(
            instance_id=iid,
            dc=dc,
            model=MODEL,
            url="http://x",
            profile=PROFILE.name,
            max_model_len_tokens=131072,
            kv_capacity_tokens=PROFILE.kv_capacity_tokens,
            slots=64,
        )
        state.register_instance(info)
    now = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(
            sa.insert(RequestRow),
            [
                {
                    "request_id": f"r{i}",
                    "tenant_id": "t",
                    "tier": "interactive",
                    "model": MODEL,
                    "dc": "dc-a",
                    "arrival_ts": now - timedelta(seconds=30),
                    "finished_ts": now,
                    "prompt_tokens": 4000,
                    "cached_tokens": 0,
                    "completion_tokens": 200,
                    "status": "completed",
                }
                for i in range(600)
            ],
        )
    live = LiveConfig.load(env={}, redis_prefix="tfrep", topology=str(topo), fleet_period_s=60.0)
    control.CONTEXT = control.ControlContext(live=live, state=state, db_engine=engine)
    try:
        out = control.fleet_cycle()
    finally:
        control.CONTEXT = None
        engine.dispose()
    assert any(a.startswith("add dc-a") for a in out["actions"]), out
    fleet = {k.decode(): v.decode() for k, v in state.r.hgetall(state.k("fleet")).items()}
    assert int(fleet[f"target:dc-a|{MODEL}|"]) >= 2
    assert int(fleet[f"target:dc-b|{MODEL}|"]) == 1
    targets = state.replica_targets()
    assert targets[("dc-a", MODEL, "")] >= 2 and targets[("dc-b", MODEL, "")] == 1


# ---- tokenfleet up's actuator with a real engine and worker ---------------------------
@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[Any]:
    # DC selection off: round robin over every instance, so a new one gets its turn
    with live_stack(
        router="round_robin",
        time_scale=0.05,
        with_postgres=False,
        live_overrides={"fleet_policy": "off"},
    ) as s:
        yield s


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=0.5) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def test_up_actuator_prewarms_then_retires_a_replica(stack: Any) -> None:
    from tests.support.stack import PROFILE as STACK_PROFILE
    from tests.support.stack import InstanceSpec
    from tokenfleet.emulator import EmulatorServer
    from tokenfleet.live.replicas import LocalReplicas

    st = stack.gateway.state

    def start_engine(dc: str, name: str) -> tuple[str, str]:
        emu = EmulatorServer(STACK_PROFILE, port=0, instance_id=name, time_scale=0.05)
        emu.start()
        stack.emulators[name] = emu
        stack.engine_urls[name] = emu.url
        return "", emu.url  # in this process: no supervisor child

    def start_worker(dc: str, name: str, url: str) -> str:
        stack.start_worker(InstanceSpec(dc, name))
        return f"worker-{name}"

    act = LocalReplicas(
        stack.sup,
        st,
        base={"dc-a": 1, "dc-b": 1},
        start_engine=start_engine,
        start_worker=start_worker,
        healthy=_healthy,
        max_per_dc=2,
    )
    key = f"target:dc-a|{stack.model}|"
    st.r.hset(st.k("fleet"), mapping={key: 5, f"target:dc-b|{stack.model}|": 1})
    # the plan is on /metrics, for an autoscaler that follows it (deploy/k8s HPAs)
    metrics = urllib.request.urlopen(stack.url + "/metrics", timeout=5).read().decode()
    assert (
        f'tokenfleet_replica_target{{dc="dc-a",model="{stack.model}",version=""}} 5.0' in metrics
    ), [ln for ln in metrics.splitlines() if "replica_target" in ln]
    said: list[str] = []
    deadline = time.time() + 30
    while time.time() < deadline:
        said += act.reconcile()
        live = {
            i.instance_id
            for i in st.instances()
            if i.is_healthy(time.time(), stack.live.stale_after_s)
        }
        if "a-p1" in live:
            break
        time.sleep(0.2)
    assert "a-p1" in live, said
    assert act.count("dc-a") == 2 and act.count("dc-b") == 1, "capped at max_per_dc"
    assert said[0].startswith("plan: prewarming") and any("is warm" in s for s in said)
    assert int(st.r.hget(st.k("fleet"), f"warming:dc-a|{stack.model}|") or 0) == 0
    # the new replica serves traffic once the API sees it healthy (its first scrape)
    # and its worker consumes: healthy in Redis comes first, and until its consumer
    # runs the pool requests routed to it are all taken by a0
    stack.wait_ready(timeout_s=30, n=3)
    c = stack.client()

    def served() -> float:
        return sum(
            v._value.get()  # type: ignore[attr-defined]
            for v in stack.emulators["a-p1"].metrics.success.values()
        )

    for i in range(30):  # round robin over three instances: a-p1's turn comes quickly
        c.chat.completions.create(
            model=stack.model, max_tokens=2, messages=[{"role": "user", "content": f"scale {i}"}]
        )
        if served() >= 1:
            break
        time.sleep(0.05)
    assert served() >= 1, "the prewarmed replica serves requests"
    # a rollback lowers the target: the added replica goes, the base one stays
    st.r.hset(st.k("fleet"), key, 1)
    said = act.reconcile()
    assert said == ["plan: retired replica a-p1 in dc-a"]
    assert "worker-a-p1" not in stack.sup.children and act.count("dc-a") == 1
    assert act.reconcile() == []  # stable
