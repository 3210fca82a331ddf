"""The live driver of the API: validate, dispatch, watch, feedback.

``web/`` speaks HTTP and calls a :class:`Gateway`; the gateway speaks to
Redis, the broker and the policies (``tokenfleet.core``) and raises
:class:`GatewayError` subclasses when it refuses a request.

=================  ============================================================
module             what it does
=================  ============================================================
``validate``       body -> :class:`ChatRequest` (one tokenization per request)
``dispatch``       datacenter, admission, router, pin, publish (one round trip)
``watch``          relay events, lost workers, re-sends, timeouts, cancel
``feedback``       first token and completion to the router, SLOMax, FleetMind
``refresh``        the Redis state the request path reads, kept fresh
``holding``        requests admission queued, held until it releases them
``errors``         why a request is refused, with the OpenAI status and code
=================  ============================================================
"""

from tokenfleet.live.gateway.core import Gateway
from tokenfleet.live.gateway.dispatch import Dispatched, HoldWait
from tokenfleet.live.gateway.errors import (
    AtCapacity,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    ModelNotFound,
    NoCapacity,
    Overloaded,
    RegionNotAllowed,
    StoreUnavailable,
    openai_error_body,
)
from tokenfleet.live.gateway.validate import TIER_HEADER, ChatRequest

__all__ = [
    "Gateway",
    "ChatRequest",
    "Dispatched",
    "HoldWait",
    "GatewayError",
    "InvalidRequest",
    "ContextLengthExceeded",
    "ModelNotFound",
    "RegionNotAllowed",
    "AtCapacity",
    "NoCapacity",
    "Overloaded",
    "StoreUnavailable",
    "openai_error_body",
    "TIER_HEADER",
]
