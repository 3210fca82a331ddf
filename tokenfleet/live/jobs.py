"""What crosses the process boundary between the API and the workers.

* :data:`TASK_CHAT` (and the control task names): the Celery task names, here
  once, imported by the API (``tokenfleet.live.gateway``) and the workers.
* :class:`ChatJob`: one attempt of one chat request, as the API publishes it
  and a worker runs it. ``to_message()`` is the task's only argument on the
  wire (a JSON object with the short keys it always had, so messages queued
  by an older API still decode); ``from_message()`` reads one back and fails
  with a ``KeyError`` naming the missing key.
* :meth:`ChatJob.ledger_row`: the :class:`~tokenfleet.service.writer.RequestRecord`
  of this request, filled from the job, for either side to complete.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.core.types import RequestInfo
from tokenfleet.service.writer import RequestRecord

TASK_CHAT = "tokenfleet.chat"
TASK_CONTROL = "tokenfleet.control_tick"
TASK_FLEET = "tokenfleet.fleet_cycle"
TASK_RECONCILE = "tokenfleet.reconcile_ledger"

#: message header with the uncached prompt tokens the request will prefill, so a
#: worker can weigh a message on receipt without decoding its body
PREFILL_HEADER = "tf_prefill_tokens"


@dataclass(slots=True)
class ChatJob:
    """One attempt of one chat request."""

    request_id: str
    attempt: int
    tenant: str
    tier: str
    model: str
    #: the OpenAI request body the engine gets (always streamed, with usage);
    #: empty in a direct job's message (the API keeps it)
    body: dict[str, Any]
    input_tokens: int
    max_tokens: int
    arrival_ts: float
    #: the queue this attempt was published to
    queue: str
    admitted_ts: float | None = None
    #: instance whose dispatch accounting the API already booked ("" = none:
    #: the worker that claims it books it)
    accounted: str = ""
    #: datacenter the request was sent to (re-sends prefer it)
    dc: str = ""
    #: prompt tokens the router expects cached where it was sent
    expected_cached: int = 0
    #: instances earlier attempts failed on (a re-send avoids them)
    tried: tuple[str, ...] = ()
    #: datacenters the tenant may be served in (() = any): re-sends stay inside
    allowed_dcs: tuple[str, ...] = ()
    #: absolute deadline of a batch request (epoch seconds)
    deadline_ts: float | None = None
    #: extra HTTP headers for the engine call
    engine_headers: dict[str, str] = field(default_factory=dict)
    #: the API process that reads the engine's stream itself ("" = the worker
    #: reads it and relays the tokens): :mod:`tokenfleet.live.direct`
    direct: str = ""
    #: disaggregated (P/D): the instance that prefills the prompt, its URL and the
    #: tokens the router expects cached there; the worker's engine decodes
    #: (:meth:`~tokenfleet.live.engine_client.EngineCall._remote_prefill`)
    prefill_instance: str = ""
    prefill_url: str = ""
    prefill_cached: int = 0

    # -- wire format --------------------------------------------------------------
    def to_message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {
            "rid": self.request_id,
            "attempt": self.attempt,
            "tenant": self.tenant,
            "tier": self.tier,
            "model": self.model,
            # the direct path's worker never sends the body (the API does): the
            # message stays small (an 8k-token prompt was ~45 KB through kombu)
            "body": {} if self.direct else self.body,
            "input_tokens": self.input_tokens,
            "max_tokens": self.max_tokens,
            "arrival_ts": self.arrival_ts,
            "admitted_ts": self.admitted_ts,
            "queue": self.queue,
            "accounted": self.accounted,
            "dc": self.dc,
            "expected_cached": self.expected_cached,
            "tried": list(self.tried),
            "deadline_ts": self.deadline_ts,
        }
        if self.allowed_dcs:
            msg["allowed_dcs"] = list(self.allowed_dcs)
        if self.engine_headers:
            msg["engine_headers"] = dict(self.engine_headers)
        if self.direct:
            msg["direct"] = self.direct
        if self.prefill_url:
            msg["prefill"] = [self.prefill_instance, self.prefill_url, self.prefill_cached]
        return msg

    @classmethod
    def from_message(cls, msg: Mapping[str, Any]) -> ChatJob:
        """The job in a task message (``KeyError`` names a missing required key)."""
        if not isinstance(msg, Mapping):
            raise TypeError(f"a chat job message is a JSON object, got {type(msg).__name__}")
        deadline = msg.get("deadline_ts")
        admitted = msg.get("admitted_ts")
        p_inst, p_url, p_cached = msg.get("prefill") or ("", "", 0)
        return cls(
            request_id=str(msg["rid"]),
            attempt=int(msg["attempt"]),
            tenant=str(msg["tenant"]),
            tier=str(msg["tier"]),
            model=str(msg["model"]),
            body=dict(msg["body"]),
            input_tokens=int(msg["input_tokens"]),
            max_tokens=int(msg["max_tokens"]),
            arrival_ts=float(msg["arrival_ts"]),
            queue=str(msg["queue"]),
            admitted_ts=float(admitted) if admitted is not None else None,
            accounted=str(msg.get("accounted") or ""),
            dc=str(msg.get("dc") or ""),
            expected_cached=int(msg.get("expected_cached") or 0),
            tried=tuple(msg.get("tried") or ()),
            allowed_dcs=tuple(msg.get("allowed_dcs") or ()),
            deadline_ts=float(deadline) if deadline else None,
            engine_headers=dict(msg.get("engine_headers") or {}),
            direct=str(msg.get("direct") or ""),
            prefill_instance=str(p_inst),
            prefill_url=str(p_url),
            prefill_cached=int(p_cached),
        )

    @property
    def task_id(self) -> str:
        """Celery task id: one per attempt, so a re-send is a new message."""
        return f"{self.request_id}.{self.attempt}"

    @property
    def prefill_tokens(self) -> int:
        """Uncached prompt tokens (the router's estimate)."""
        return max(0, self.input_tokens - self.expected_cached)

    def headers(self) -> dict[str, int]:
        """Message headers (see :data:`PREFILL_HEADER`)."""
        return {PREFILL_HEADER: self.prefill_tokens}

    # -- derived ------------------------------------------------------------------
    def info(self) -> RequestInfo:
        """The policies' view of the request (what the worker's accounting needs)."""
        return RequestInfo(
            request_id=self.request_id,
            arrival_s=self.arrival_ts,
            input_tokens=self.input_tokens,
            max_tokens=self.max_tokens,
            tenant=self.tenant,
            tier=self.tier,
            model=self.model,
        )

    def next_attempt(
        self,
        attempt: int,
        queue: str,
        *,
        tried: set[str] | tuple[str, ...],
        expected_cached: int = 0,
    ) -> ChatJob:
        """The job of a re-send: a new attempt on ``queue``, not yet accounted
        (``dc`` stays the datacenter first chosen: re-sends prefer it), served
        aggregated (the prefill instance's KV was for the first attempt)."""
        return dataclasses.replace(
            self,
            attempt=attempt,
            queue=queue,
            tried=tuple(sorted(tried)),
            accounted="",
            expected_cached=expected_cached,
            prefill_instance="",
            prefill_url="",
            prefill_cached=0,
        )

    def ledger_row(self, status: str, **columns: Any) -> RequestRecord:
        """This request's ledger row with ``status``; ``columns`` fill or override the rest."""
        base: dict[str, Any] = {
            "request_id": self.request_id,
            "tenant_id": self.tenant,
            "tier": self.tier,
            "model": self.model,
            "status": status,
            "arrival_ts": self.arrival_ts,
            "admitted_ts": self.admitted_ts,
            "prompt_tokens": self.input_tokens,
            "attempts": self.attempt,
        }
        base.update(columns)
        return RequestRecord(**base)


def send_chat_job(send_task: Any, job: ChatJob) -> None:
    """Publish ``job`` with Celery's ``send_task`` (the app's, or a worker's own).

    ``argsrepr``/``kwargsrepr`` skip Celery's safe-repr of the job for its headers.
    """
    send_task(
        TASK_CHAT,
        args=[job.to_message()],
        task_id=job.task_id,
        queue=job.queue,
        routing_key=job.queue,
        argsrepr="",
        kwargsrepr="",
        headers=job.headers(),
    )
