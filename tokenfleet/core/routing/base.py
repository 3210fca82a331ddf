"""The router interface: one Protocol, one base class with no-op hooks.

Routers are pure: ``route`` takes a request and a pool snapshot and returns a
decision. The hooks let a router learn from what a live router can observe
(first tokens, completions, engine KV events); the default is to ignore them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from tokenfleet.core.registry import Registry
from tokenfleet.core.types import (
    CompletionEvent,
    FirstTokenEvent,
    InstanceView,
    KVEvent,
    PoolSnapshot,
    RequestInfo,
    RouteDecision,
)
from tokenfleet.errors import NoCandidateError


@runtime_checkable
class Router(Protocol):
    name: str

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision: ...

    def on_first_token(self, event: FirstTokenEvent) -> None: ...

    def on_complete(self, event: CompletionEvent) -> None: ...

    def on_kv_event(self, event: KVEvent) -> None: ...


@runtime_checkable
class TwoPhaseRouter(Router, Protocol):
    """A router whose choice the driver may check before it is taken.

    Replicas that share dispatch accounting see each other's dispatches one
    refresh late, and replicas deciding alike from the same late view send
    their requests to the same instance. Booking a dispatch in the shared
    store answers with that instance's current accounting; when it shows
    dispatches the view lacked, the driver proposes again on a snapshot that
    has them, then commits. ``route`` is ``commit(propose(...))``."""

    def propose(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision: ...

    def commit(self, request: RequestInfo) -> RouteDecision: ...


class BaseRouter:
    """Convenience base: hooks do nothing until a router needs them."""

    name = "base"

    def route(self, request: RequestInfo, pool: PoolSnapshot) -> RouteDecision:
        raise NotImplementedError

    def on_first_token(self, event: FirstTokenEvent) -> None:
        return None

    def on_complete(self, event: CompletionEvent) -> None:
        return None

    def on_kv_event(self, event: KVEvent) -> None:
        return None


ROUTERS: Registry[Router] = Registry("policy")


def eligible(request: RequestInfo, pool: PoolSnapshot) -> list[InstanceView]:
    """Instances that are ready, serve the request's model/version and fit it.

    Every router (peers included) starts here: routing to a wrong model or a
    dead endpoint is a correctness bug, not a policy choice.
    """
    out = [
        inst
        for inst in pool.instances
        if inst.ready
        and inst.metrics.healthy
        and (request.model == "default" or inst.model == request.model)
        and (not request.model_version or inst.model_version == request.model_version)
        and (
            inst.max_model_len_tokens == 0 or request.input_tokens + 1 <= inst.max_model_len_tokens
        )
    ]
    if not out:
        raise NoCandidateError(
            f"no ready instance serves model '{request.model}'"
            f"{' version ' + request.model_version if request.model_version else ''}"
            f" for a {request.input_tokens}-token prompt; check the deployment"
        )
    return out
