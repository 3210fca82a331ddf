"""FleetMind on the live request path (tokenfleet/live/dc_select.py, live/gateway/dispatch.py).

The first tests drive :class:`LiveDCSelector` directly with instance views, as
the gateway does; the last ones go through the real stack (Redis, Postgres,
Celery workers, emulated engines) and read where the ledger says requests ran.
"""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tokenfleet.core.fleet import parse_topology
from tokenfleet.core.types import InstanceView, RequestInfo, ScrapedMetrics
from tokenfleet.engine.profiles import get_profile
from tokenfleet.errors import NoCandidateError
from tokenfleet.live.dc_select import LiveDCSelector

MODEL = "llama"
PROFILE = get_profile("llama3-8b-h200")

TOPOLOGY = {
    "name": "two-regions",
    "datacenters": {
        "east": {
            "region": "eu",
            "load_ceiling": 0.7,
            "deployments": [
                {"model": MODEL, "version": "2", "profile": PROFILE.name, "instances": 2}
            ],
        },
        "west": {
            "region": "us",
            "load_ceiling": 0.7,
            "deployments": [
                {"model": MODEL, "version": "2", "profile": PROFILE.name, "instances": 2}
            ],
        },
    },
    "rtt_ms": {"east": {"west": 40}},
    "tenants": {
        "acme": {"home": "east"},
        "bank": {"home": "east", "allowed_regions": ["eu"], "allow_cross_region": False},
    },
}


def view(
    dc: str,
    iid: str,
    *,
    version: str = "2",
    ready: bool = True,
    healthy: bool = True,
    waiting: int = 0,
) -> InstanceView:
    return InstanceView(
        instance_id=iid,
        profile=PROFILE,
        dc=dc,
        model=MODEL,
        model_version=version,
        ready=ready,
        kv_capacity_tokens=PROFILE.kv_capacity_tokens,
        max_model_len_tokens=131072,
        metrics=ScrapedMetrics(scraped_at_s=0.0, num_waiting=waiting, healthy=healthy),
    )


def request(i: int, tenant: str = "acme", tokens: int = 2000, version: str = "") -> RequestInfo:
    return RequestInfo(
        request_id=f"r{i}",
        arrival_s=float(i),
        input_tokens=tokens,
        max_tokens=128,
        tenant=tenant,
        model=MODEL,
        model_version=version,
        tier="interactive",
        block_hashes=tuple(i * 1000 + k for k in range(1, 41)),
    )  # 640 tokens


def fleet(**kw: Any) -> LiveDCSelector:
    return LiveDCSelector("fleetmind", topology=parse_topology(TOPOLOGY), **kw)


def four() -> list[InstanceView]:
    return [view("east", "e0"), view("east", "e1"), view("west", "w0"), view("west", "w1")]


def test_home_serves_while_it_is_not_under_pressure() -> None:
    f = fleet()
    f.refresh(four(), 0.0)
    for i in range(5):
        d, home = f.select(request(i), f.tenant("acme"))
        assert (d.dc, home, d.spilled) == ("east", "east", False)
        f.dispatched(request(i), d)


def test_a_hotspot_at_home_spills_new_requests_and_pinned_tenants_stay() -> None:
    f = fleet()
    f.refresh(four(), 0.0)
    reasons = []
    # 60 4k-token prompts in one second, no first token back: home's queue grows
    for i in range(60):
        r = request(i, tokens=4000)
        f.snap.now_s = i / 60
        d, home = f.select(r, f.tenant("acme"))
        f.dispatched(r, d)
        reasons.append((d.dc, d.reason))
    assert reasons[0] == ("east", "home")
    spilled = [dc for dc, why in reasons if why.startswith("spill")]
    assert spilled and set(spilled) == {"west"}, reasons
    # a tenant pinned to its region never leaves it, however hot home is
    d, _ = f.select(request(99, tenant="bank"), f.tenant("bank"))
    assert d.dc == "east" and d.reason == "home:pinned"


def test_the_plans_spill_share_closes_a_dc_to_spilled_work() -> None:
    f = fleet()
    f.spill_share = {"west": 0.0}
    f.refresh(four(), 0.0)
    for i in range(60):
        r = request(i, tokens=4000)
        f.snap.now_s = i / 60
        d, home = f.select(r, f.tenant("acme"))
        f.dispatched(r, d)
        assert d.dc == "east", (i, d)


def test_only_ready_healthy_pools_of_the_right_version_are_candidates() -> None:
    f = fleet()
    views = [
        view("east", "e0", ready=False),
        view("east", "e1", healthy=False),
        view("west", "w0", version="1"),
        view("west", "w1", version="2"),
    ]
    f.refresh(views, 0.0)
    d, _ = f.select(request(1, version="2"), f.tenant("acme"))
    assert d.dc == "west" and d.reason.startswith("failover")
    with pytest.raises(NoCandidateError):
        f.select(request(2, version="3"), f.tenant("acme"))
    # east comes back on the next refresh
    f.refresh(four(), 1.0)
    d, _ = f.select(request(3, version="2"), f.tenant("acme"))
    assert d.dc == "east"


def test_the_tenant_records_regions_narrow_the_topology() -> None:
    f = fleet()
    f.refresh(four(), 0.0)
    us_only = f.tenant("acme", ["us"])
    for i in range(4):
        d, _ = f.select(request(i), us_only)
        assert d.dc == "west"
    nowhere = f.tenant("acme", ["asia"])
    with pytest.raises(NoCandidateError):
        f.select(request(9), nowhere)
    assert not f.permitted_anywhere(request(9), nowhere)
    assert f.permitted_anywhere(request(9), us_only)
    # regions intersect with the topology's own rule: bank may use eu only
    assert f.compliant_dcs(request(9, tenant="bank"), f.tenant("bank", ["eu", "us"])) == {"east"}


def test_without_a_home_the_best_predicted_dc_wins_and_ties_alternate() -> None:
    f = LiveDCSelector("fleetmind")  # no topology: each DC its own region, no homes
    f.refresh(four(), 0.0)
    chosen = []
    for i in range(8):  # one at a time: nothing queued, equal predictions
        r = request(i, tenant="anyone")
        d, home = f.select(r, f.tenant("anyone"))
        t = f.dispatched(r, d)
        f.first_token(t, r, t.predicted_dc_ttft_s or 0.0)  # as predicted: kappa stays 1
        f.finished(t, r, "completed", 10)
        chosen.append(d.dc)
    assert home is None and chosen == ["east", "west"] * 4, chosen
    # a burst piles prefill onto one DC's drain clock: the next request goes to the other
    f.snap.now_s = 10.0
    burst = [request(100 + i, tokens=8000, tenant="anyone") for i in range(3)]
    for r in burst:
        d, home = f.select(r, f.tenant("anyone"))
        f.dispatched(r, d)
    east = f.views["east"].pools[(MODEL, "2")].queue_s(10.0)
    west = f.views["west"].pools[(MODEL, "2")].queue_s(10.0)
    nxt = f.select(request(200, tokens=8000, tenant="anyone"), f.tenant("anyone"))[0].dc
    assert nxt == ("east" if east < west else "west") and east != west


def test_accounting_is_released_once_whatever_ends_the_request() -> None:
    f = fleet()
    f.refresh(four(), 0.0)
    r = request(1, tokens=8000)
    d, home = f.select(r, f.tenant("acme"))
    t = f.dispatched(r, d)
    acct = t.pool.accounting
    assert acct.pending_requests == 1 and acct.pending_prefill_s > 0
    f.finished(t, r, "cancelled", 0)  # no first token ever came
    f.finished(t, r, "failed", 0)
    f.first_token(t, r, 0.1)
    assert acct.pending_requests == 0 and acct.pending_prefill_s == 0


# ---- through the live stack --------------------------------------------------------------
@pytest.fixture(scope="module")
def regional(tmp_path_factory: pytest.TempPathFactory, live_stack: Any) -> Iterator[Any]:
    topo: Path = tmp_path_factory.mktemp("topo") / "topology.yaml"
    topo.write_text(
        textwrap.dedent(f"""\
        name: two-regions
        datacenters:
          dc-a: {{region: eu, deployments: [{{model: m, version: "1", profile: {PROFILE.name}}}]}}
          dc-b: {{region: us, deployments: [{{model: m, version: "1", profile: {PROFILE.name}}}]}}
        rtt_ms: {{dc-a: {{dc-b: 40}}}}
        """)
    )
    with live_stack(
        router="tokenpilot", time_scale=0.02, live_overrides={"topology": str(topo)}
    ) as stack:
        yield stack
        stack.app.extensions["tokenfleet.tenancy"].close()


def test_live_requests_go_only_to_the_regions_a_tenant_may_use(regional: Any) -> None:
    import requests

    from tokenfleet.tenancy import admin

    svc = regional.app.extensions["tokenfleet.tenancy"]
    admin.create_tenant(
        svc.engine, "us-co", actor="test", allowed_regions=["us"], cache=svc.directory
    )
    key, _ = admin.create_key(svc.engine, "us-co", actor="test", cache=svc.directory)
    admin.create_tenant(
        svc.engine, "asia-co", actor="test", allowed_regions=["asia"], cache=svc.directory
    )
    asia_key, _ = admin.create_key(svc.engine, "asia-co", actor="test", cache=svc.directory)
    url = regional.url + "/v1/chat/completions"
    ids = []
    for i in range(6):
        r = requests.post(
            url,
            timeout=60,
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": regional.model,
                "max_tokens": 3,
                "messages": [{"role": "user", "content": f"where {i}"}],
            },
        )
        assert r.status_code == 200, r.text
        ids.append(r.json()["id"].removeprefix("chatcmpl-"))
    rows = regional.ledger_rows(
        expect=lambda rows: (
            set(ids)
            <= {x["request_id"] for x in rows if x["status"] in ("completed", "slo_missed")}
        )
    )
    assert {x["dc"] for x in rows if x["request_id"] in ids} == {"dc-b"}
    # a tenant whose regions hold no deployment: a clear 403, and nothing ran
    r = requests.post(
        url,
        timeout=60,
        headers={"Authorization": f"Bearer {asia_key}"},
        json={
            "model": regional.model,
            "max_tokens": 3,
            "messages": [{"role": "user", "content": "from asia"}],
        },
    )
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "region_not_allowed" and "asia-co" in err["message"]
    # the API's /metrics counts the DC choices
    text = requests.get(regional.url + "/metrics", timeout=10).text
    assert 'tokenfleet_dc_decisions_total{dc="dc-b"' in text


def test_live_residency_holds_when_the_only_allowed_region_is_down(regional: Any) -> None:
    """Last in the module: it stops dc-b's worker."""
    import requests

    from tokenfleet.tenancy import admin

    svc = regional.app.extensions["tokenfleet.tenancy"]
    admin.create_tenant(
        svc.engine, "us-only", actor="test", allowed_regions=["us"], cache=svc.directory
    )
    key, _ = admin.create_key(svc.engine, "us-only", actor="test", cache=svc.directory)
    url = regional.url + "/v1/chat/completions"
    body = {
        "model": regional.model,
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "region down"}],
    }
    regional.sup.stop("worker-b0")
    deadline = time.time() + 10
    while time.time() < deadline and any(
        i.instance_id == "b0" and i.is_live(time.time(), regional.live.stale_after_s)
        for i in regional.gateway.state.instances()
    ):
        time.sleep(0.2)
    time.sleep(0.3)  # the gateway re-reads instances every 100 ms
    r = requests.post(url, json=body, timeout=60, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 503, r.text  # never served outside its region
    assert r.json()["error"]["code"] == "no_capacity" and int(r.headers["Retry-After"]) >= 1
    # a tenant without restrictions is simply served in the other region
    c = regional.client()
    resp = c.chat.completions.create(**body)
    rid = resp.id.removeprefix("chatcmpl-")
    rows = regional.ledger_rows(
        f"request_id = '{rid}'",
        expect=lambda rows: bool(rows) and rows[0]["status"] in ("completed", "slo_missed"),
    )
    assert rows[0]["dc"] == "dc-a"
