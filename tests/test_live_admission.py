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
