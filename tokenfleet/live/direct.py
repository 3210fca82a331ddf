"""The direct path: the API reads the engine's stream, the worker places and settles.

Relaying every batch of tokens through Redis cost a Python step per token on
both sides of it (the worker reading the engine and writing entries, the API
reading and decoding them): most of the control plane's CPU per request
(docs/benchmarks.md, "CPU per request at real prompt lengths"). On this path
the tokens cross the control plane once, in the API. Per attempt:

1. The worker pulls the Celery task, passes its tier gate and claims the
   request exactly as before, then writes a ``go`` entry (engine URL, engine
   request id, attempt, instance) to the request's relay stream.
2. The API calls the engine itself and forwards its tokens to the client. At
   the first token it sets the request state's ``first_token`` flag and writes
   ``ft`` to the attempt's outcome stream (:func:`outcome_key`); at the end it
   writes ``out``: finish reason, usage and tokens, or the engine's error.
3. The worker, which held the slot and its lease meanwhile, settles as
   before: the ``end`` entry on the relay stream, the ledger row and the
   accounting; or, for an engine error, a re-send or the error entry.

Faults keep the relay path's outcomes: a worker lost while the API streams is
seen by the API's lease check (:mod:`tokenfleet.live.gateway.direct`), which
closes its engine call and re-sends the request (no token yet) or ends it with
an error; a client that leaves is cancelled as before (the API closes the
engine call, the worker's watchdog settles). An API lost mid-stream stops
renewing :func:`api_alive_key`; the worker then settles the request as failed.
"""

from __future__ import annotations

from tokenfleet.live.state import LiveState

#: seconds an API's liveness key lives without renewal, in lease periods
API_ALIVE_LEASES = 5.0


def outcome_key(state: LiveState, request_id: str, attempt: int) -> str:
    """The stream the API writes one attempt's ``ft`` and ``out`` entries to."""
    return state.k("out", request_id, str(attempt))


def api_alive_key(state: LiveState, api_id: str) -> str:
    """Exists while the API process ``api_id`` streams direct requests."""
    return state.k("api-alive", api_id)
