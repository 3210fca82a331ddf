"""SLOMax admission on the live path sees what waits in the broker queues.

The gateway publishes queued work to Celery, so its own queues are empty;
the admission snapshot instead gets per-tier totals from the queue-depth
counters in Redis (tokenfleet/live/gateway/dispatch.py ``_broker_queues``). With a long backlog of
long-context work, a new long-context request is refused with a 429 whose
Retry-After comes from the predicted wait, while interactive work is still
admitted; once the backlog is gone, long-context work is admitted again.
Prefill already booked on the instances (the shared dispatch accounting, per
tier) counts the same way, as the simulator's driver counts its own.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from tests.support.stack import API_KEY, InstanceSpec
from tokenfleet.core.types import RequestInfo


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[Any]:
    with live_stack(
        router="tokenpilot", admission="slomax", time_scale=0.02, app_config={"CHAT_QUOTAS": False}
    ) as s:
        yield s
        s.app.extensions["tokenfleet.tenancy"].close()


def post(stack: Any, text: str) -> requests.Response:
    return requests.post(
        stack.url + "/v1/chat/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": stack.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": text}],
        },
    )


def test_a_long_context_backlog_in_the_broker_refuses_new_long_work_only(stack: Any) -> None:
    # ~30k tokens: long_context, and a long prefill (1.2 s on the profile; a
    # prompt whose prefill fits the interactive clean budget needs no lane slot)
    long_prompt = "lorem ipsum dolor sit amet " * 4500
    st = stack.gateway.state
    # (no long request first: the emulator runs 50x faster than the model, and
    # admission would learn that from its first token and shrink every wait)
    backlog = {f"{dc}.long_context": 300 for dc in ("dc-a", "dc-b")}
    for q, n in backlog.items():
        st.queued_incr(q, n)
    time.sleep(0.1)  # the gateway re-reads depths every 25 ms
    try:
        r = post(stack, long_prompt + " again")
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "long_context" in err["message"]
        assert 1 <= int(r.headers["Retry-After"]) <= 120
        ok = post(stack, "a short interactive question")
        assert ok.status_code == 200, ok.text
    finally:
        for q, n in backlog.items():
            st.queued_incr(q, -n)
    time.sleep(0.1)  # the gateway re-reads depths every 25 ms
    assert post(stack, long_prompt + " after").status_code == 200


def test_long_prefills_booked_on_the_instances_hold_new_long_work_back(stack: Any) -> None:
    # ~30k tokens that no instance holds (the test above cached its prompt)
    long_prompt = "consectetur adipiscing elit " * 4400
    st = stack.gateway.state
    # one long-context prefill pending on every instance, booked as another API
    # replica's (no first token yet), so long that the predicted wait for a lane
    # slot is minutes even at the emulator's speed; the gateway's admission
    # used to see only the requests running per tier, and admitted
    other = RequestInfo("other-replica", 0.0, 2_000_000, 16, tier="long_context")
    booked = [
        (i.instance_id, st.book_dispatch(i.instance_id, other, 0)[0])
        for i in stack.gateway.instances()
    ]
    time.sleep(0.3)  # the gateway re-reads the accounting every 20-250 ms
    try:
        r = post(stack, long_prompt + " behind")
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "long_context" in err["message"]
        assert int(r.headers["Retry-After"]) >= 60  # the booked prefill, not a guess
    finally:
        for iid, delta in booked:
            st.unbook(iid, delta)
    time.sleep(0.3)
    assert post(stack, long_prompt + " later").status_code == 200


@pytest.fixture(scope="module")
def pair(live_stack: Any) -> Iterator[Any]:
    """Two instances in one datacenter: admission chooses between them."""
    with live_stack(
        instances=[InstanceSpec("dc-a", "a0"), InstanceSpec("dc-a", "a1")],
        router="tokenpilot",
        admission="slomax",
        time_scale=0.02,
        app_config={"CHAT_QUOTAS": False},
    ) as s:
        yield s
        s.app.extensions["tokenfleet.tenancy"].close()


def _served_by(stack: Any, r: requests.Response) -> str:
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    rows = stack.ledger_rows(
        f"request_id = '{rid}'", expect=lambda rows: bool(rows and rows[0]["instance"])
    )
    return str(rows[0]["instance"])


def test_an_instance_whose_kv_is_booked_full_gets_no_new_work(pair: Any) -> None:
    """The KV every writer booked (prompt + output budget of what is in flight)
    is in admission's snapshot, as in the simulator: a turn whose prefix one
    instance holds goes to the other while the holder's KV is spoken for.
    Before, the live snapshot reserved nothing and the router sent it back to
    its prefix."""
    prompt = f"kv {time.time_ns()} " + "Please keep the ledger tidy and the queues short. " * 220
    holder = _served_by(pair, post(pair, prompt))
    assert _served_by(pair, post(pair, prompt + " again")) == holder  # the prefix draws it
    other = next(i.instance_id for i in pair.gateway.instances() if i.instance_id != holder)
    st = pair.gateway.state
    cap = next(i.kv_capacity_tokens for i in pair.gateway.instances() if i.instance_id == holder)
    hog = RequestInfo("kv-hog", 0.0, cap, 0, tier="interactive")
    st.book_dispatch(holder, hog, cap)  # all of it cached: no prefill pending...
    st.account_first_token(holder, hog, cap)  # ...and past its first token
    time.sleep(0.3)  # the gateway re-reads the accounting every 20-250 ms
    try:
        assert _served_by(pair, post(pair, prompt + " and again")) == other
    finally:
        st.account_finish(holder, hog, True, cap)


@contextlib.contextmanager
def _no_room(pair: Any) -> Iterator[dict[str, tuple[RequestInfo, int]]]:
    """Every instance's whole KV booked as in flight past its first token, as
    another replica's requests would be: no interactive request fits anywhere.
    Yields the bookings (instance -> (request, tokens)); one released early is
    popped by the caller. The bookings change a little every 50 ms, as live
    traffic does: a worker whose engine is idle clears accounting that stays
    the same over a few scrapes (a worker lost mid-request left it:
    ``workers/runtime.py``, ``_repair_accounting``)."""
    st = pair.gateway.state
    hogs: dict[str, tuple[RequestInfo, int]] = {}
    for inst in pair.gateway.instances():
        cap = inst.kv_capacity_tokens
        hog = RequestInfo(f"kv-hog-{inst.instance_id}", 0.0, cap, 0, tier="interactive")
        st.book_dispatch(inst.instance_id, hog, cap)
        st.account_first_token(inst.instance_id, hog, cap)
        hogs[inst.instance_id] = (hog, cap)
    stop = threading.Event()
    tick = RequestInfo("traffic", 0.0, 0, 0, tier="batch")

    def traffic() -> None:
        while not stop.wait(0.05):
            for iid in list(hogs):
                st.unbook(iid, st.book_dispatch(iid, tick, 0)[0])

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    deadline = time.monotonic() + 5  # the gateway re-reads the accounting every 20-250 ms
    while time.monotonic() < deadline:
        seen = pair.gateway.accounting.get(list(hogs))
        if all(seen[i].inflight_input_tokens >= cap for i, (_, cap) in hogs.items()):
            break
        time.sleep(0.02)
    try:
        yield hogs
    finally:
        stop.set()
        t.join()
        for iid, (hog, cap) in hogs.items():
            st.account_finish(iid, hog, True, cap)


def test_a_request_admission_queues_is_held_until_room_frees_then_served(pair: Any) -> None:
    """SLOMax queues an interactive request no instance has room for; the API
    holds it (as the simulator's driver does) instead of sending it on, and
    sends it when admission releases it: to the instance whose KV freed.
    Before, the gateway routed a queued request at once."""
    pen = pair.gateway.holding
    assert pen is not None
    out: dict[str, requests.Response] = {}
    t = threading.Thread(target=lambda: out.update(r=post(pair, f"held {time.time_ns()}")))
    with _no_room(pair) as hogs:
        t.start()
        deadline = time.monotonic() + 5
        while len(pen) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pen) == 1, "the request was not held"
        time.sleep(0.5)
        assert t.is_alive() and len(pen) == 1  # still held: nothing has room
        freed = next(iter(hogs))
        hog, cap = hogs.pop(freed)
        pair.gateway.state.account_finish(freed, hog, True, cap)
        t.join(timeout=10)
        assert not t.is_alive()
    assert _served_by(pair, out["r"]) == freed
    assert len(pen) == 0
    metrics = requests.get(pair.url + "/metrics", timeout=10).text
    holds = re.search(r'^tokenfleet_api_holds_total\{tier="interactive"\} (\S+)$', metrics, re.M)
    assert holds is not None and float(holds.group(1)) >= 1
    assert 'tokenfleet_api_held_requests{tier="interactive"} 0.0' in metrics


def test_a_held_request_whose_client_leaves_is_dropped_and_recorded(pair: Any) -> None:
    pen = pair.gateway.holding
    assert pen is not None
    text = f"gone {time.time_ns()}"
    with _no_room(pair):  # still no room when the client leaves: only leaving ends the hold
        with pytest.raises(requests.exceptions.ReadTimeout):
            r = requests.post(
                pair.url + "/v1/chat/completions",
                timeout=0.6,  # the client gives up while the request is held
                headers={"Authorization": f"Bearer {API_KEY}"},
                json={
                    "model": pair.model,
                    "max_tokens": 4,
                    "messages": [{"role": "user", "content": text}],
                },
            )
            pytest.fail(f"answered while it should have been held: {r.status_code} {r.text}")
        rows = pair.ledger_rows("status = 'cancelled'", expect=lambda rows: len(rows) >= 1)
        assert rows and not rows[-1]["instance"]  # it never reached an engine
        assert len(pen) == 0
