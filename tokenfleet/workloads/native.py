"""TokenFleet's own JSONL workload format (spec: docs/workloads.md).

Strict on purpose: an unknown key is an error (a typo such as ``arival_s``
would otherwise silently fall back to a default), and each line maps onto a
:class:`RequestInfo` field by field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenfleet.core.types import TIERS, RequestInfo
from tokenfleet.workloads.common import (
    DEFAULT_MAX_TOKENS,
    LineChecker,
    check_budget,
    engine_output_tokens,
    make_request,
)
from tokenfleet.workloads.hashing import BLOCK, BlockIdHasher, Segment, SegmentHasher, content_id
from tokenfleet.workloads.trace import TraceRequest

TASK_TYPES = ("chat", "completion", "batch")

KNOWN_FIELDS = frozenset(
    {
        "arrival_s",
        "timestamp_ms",
        "input_tokens",
        "output_tokens",
        "max_tokens",
        "tenant",
        "task_type",
        "tier",
        "deadline_s",
        "region",
        "model",
        "model_version",
        "session",
        "prefix_id",
        "prefix_tokens",
        "hash_ids",
        "hash_block_tokens",
        "client_timeout_s",
        "request_id",
        "slo_class",
        "prompt_cache_key",
        "allow_cross_region",
        "turn",
    }
)

_STR_FIELDS = (
    "tenant",
    "region",
    "model",
    "model_version",
    "session",
    "slo_class",
    "prompt_cache_key",
)


class _Turns:
    """Each session's last turn: its number, prompt segments and answer.

    A line with ``session`` and ``turn`` continues the session's previous
    turn: its prompt is that prompt + that answer + new tokens, so it shares
    their blocks, and the engine caches its own answer for the next turn.
    """

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int, tuple[Segment, ...], Segment]] = {}

    def segments(
        self,
        chk: LineChecker,
        session: str,
        turn: int,
        n_in: int,
        first: tuple[Segment, ...],
        new_content: int,
    ) -> tuple[Segment, ...]:
        prev = self.last.get(session)
        if prev is None:
            return first
        prev_turn, prev_line, prev_segs, answer = prev
        if turn != prev_turn + 1:
            raise chk.fail(
                f"turn {turn} of session {session!r} follows turn {prev_turn} "
                f"(line {prev_line}); a session's turns must be consecutive and "
                "in file order"
            )
        quoted = sum(n for _, n in prev_segs) + answer[1]
        if n_in < quoted:
            raise chk.fail(
                f"input_tokens {n_in} is less than turn {prev_turn}'s prompt plus "
                f"its answer ({quoted} tokens, line {prev_line}); a turn's prompt "
                "contains the previous prompt and answer"
            )
        return prev_segs + (answer, (new_content, n_in - quoted))

    def remember(
        self, session: str, turn: int, line_no: int, segs: tuple[Segment, ...], answer: Segment
    ) -> None:
        self.last[session] = (turn, line_no, segs, answer)


def load_tokenfleet(
    path: str | Path,
    *,
    max_tokens: int | None = None,
    model: str = "default",
    tenant: str = "default",
) -> list[TraceRequest]:
    """Load a TokenFleet JSONL workload, sorted by arrival (ties keep file order).

    ``max_tokens``/``model``/``tenant`` are defaults for lines that omit them.
    Arrival times are kept as written (not rebased) because ``deadline_s`` is
    on the same clock.
    """
    budget = check_budget(
        max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS["tokenfleet"]
    )
    src = str(path)
    salt = content_id("tokenfleet", Path(path).name)
    segs = SegmentHasher()
    id_hashers: dict[int, BlockIdHasher] = {}
    seen_ids: dict[str, int] = {}
    turns = _Turns()
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            chk = LineChecker(src, line_no)
            try:
                obj: Any = json.loads(text)
            except json.JSONDecodeError as e:
                raise chk.fail(
                    f"not valid JSON ({e.msg}); each line must be one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise chk.fail("each line must be a JSON object (see docs/workloads.md)")
            unknown = sorted(set(obj) - KNOWN_FIELDS)
            if unknown:
                raise chk.fail(
                    f"unknown field(s) {', '.join(unknown)}; known fields: "
                    f"{', '.join(sorted(KNOWN_FIELDS))}"
                )
            out.append(
                _parse(
                    obj,
                    chk,
                    len(out),
                    budget,
                    model,
                    tenant,
                    salt,
                    segs,
                    id_hashers,
                    seen_ids,
                    turns,
                )
            )
    out.sort(key=lambda r: r.info.arrival_s)
    return out


def _parse(
    obj: dict[str, Any],
    chk: LineChecker,
    idx: int,
    budget: int,
    model: str,
    tenant: str,
    salt: int,
    segs: SegmentHasher,
    id_hashers: dict[int, BlockIdHasher],
    seen_ids: dict[str, int],
    turns: _Turns,
) -> TraceRequest:
    if ("arrival_s" in obj) == ("timestamp_ms" in obj):
        raise chk.fail("give exactly one of 'arrival_s' (seconds) or 'timestamp_ms'")
    arrival_s = (
        chk.num_field(obj, "arrival_s")
        if "arrival_s" in obj
        else chk.num_field(obj, "timestamp_ms") / 1000.0
    )
    n_in = chk.int_field(obj, "input_tokens", minimum=1)
    n_out = chk.int_field(obj, "output_tokens")
    mt = chk.int_field(obj, "max_tokens", minimum=1) if "max_tokens" in obj else budget

    strs: dict[str, str] = {}
    for name in _STR_FIELDS:
        if name in obj:
            strs[name] = chk.str_field(obj, name)

    request_id = chk.str_field(obj, "request_id") if "request_id" in obj else f"tf-{idx}"
    if request_id in seen_ids:
        raise chk.fail(
            f"request_id {request_id!r} already used on line {seen_ids[request_id]}; "
            "request ids must be unique"
        )
    seen_ids[request_id] = chk.line_no

    task_type = "chat"
    tier = ""
    if "task_type" in obj:
        task_type = chk.str_field(obj, "task_type")
        if task_type not in TASK_TYPES:
            raise chk.fail(f"task_type must be one of {', '.join(TASK_TYPES)}, got {task_type!r}")
    if "tier" in obj:
        tier = chk.str_field(obj, "tier")
        if tier not in TIERS:
            raise chk.fail(f"tier must be one of {', '.join(TIERS)}, got {tier!r}")
        if tier == "batch" and "task_type" not in obj:
            task_type = "batch"

    deadline_s = None
    if "deadline_s" in obj:
        deadline_s = chk.num_field(obj, "deadline_s")
        if deadline_s < arrival_s:
            raise chk.fail(
                f"deadline_s {deadline_s} is before the arrival ({arrival_s}); "
                "deadline_s is absolute, on the same clock as arrival_s"
            )
    client_timeout_s = None
    if "client_timeout_s" in obj:
        client_timeout_s = chk.num_field(obj, "client_timeout_s")
        if client_timeout_s <= 0:
            raise chk.fail("client_timeout_s must be > 0 (omit it for no timeout)")
    allow_cross_region = True
    if "allow_cross_region" in obj:
        v = obj["allow_cross_region"]
        if not isinstance(v, bool):
            raise chk.fail(f"allow_cross_region must be true or false, got {v!r}")
        allow_cross_region = v

    output_hashes: tuple[int, ...] = ()
    if "turn" in obj:
        turn = chk.int_field(obj, "turn")
        session = strs.get("session")
        if session is None:
            raise chk.fail("turn needs session: it numbers the turns of one conversation")
        if "hash_ids" in obj:
            raise chk.fail(
                "give either turn (the prompt continues the previous turn) or hash_ids, not both"
            )
        unique = content_id("tf-unique", salt, request_id)
        prompt = turns.segments(
            chk, session, turn, n_in, _prefix_segments(obj, chk, n_in, unique), unique
        )
        answer = (content_id("tf-answer", salt, session, turn), engine_output_tokens(n_out, mt))
        turns.remember(session, turn, chk.line_no, prompt, answer)
        hashes = segs.hashes(prompt)
        output_hashes = segs.hashes(prompt + (answer,))[len(hashes) :]
    else:
        hashes = _hashes(obj, chk, n_in, request_id, salt, segs, id_hashers)
    info = RequestInfo(
        request_id=request_id,
        arrival_s=arrival_s,
        input_tokens=n_in,
        max_tokens=mt,
        block_hashes=hashes,
        tenant=strs.get("tenant", tenant),
        task_type=task_type,
        tier=tier,
        model=strs.get("model", model),
        model_version=strs.get("model_version", ""),
        region=strs.get("region"),
        deadline_s=deadline_s,
        session=strs.get("session"),
        prompt_cache_key=strs.get("prompt_cache_key"),
        slo_class=strs.get("slo_class"),
        allow_cross_region=allow_cross_region,
    )
    return make_request(info, n_out, client_timeout_s, output_hashes)


def _hashes(
    obj: dict[str, Any],
    chk: LineChecker,
    n_in: int,
    request_id: str,
    salt: int,
    segs: SegmentHasher,
    id_hashers: dict[int, BlockIdHasher],
) -> tuple[int, ...]:
    has_prefix = "prefix_id" in obj or "prefix_tokens" in obj
    if has_prefix and "hash_ids" in obj:
        raise chk.fail("give either prefix_id/prefix_tokens or hash_ids, not both")
    if "hash_block_tokens" in obj and "hash_ids" not in obj:
        raise chk.fail("hash_block_tokens only makes sense together with hash_ids")
    unique = content_id("tf-unique", salt, request_id)
    if "hash_ids" in obj:
        ids = chk.int_list(obj, "hash_ids")
        bt = (
            chk.int_field(obj, "hash_block_tokens", minimum=1)
            if "hash_block_tokens" in obj
            else BLOCK
        )
        if bt % BLOCK:
            raise chk.fail(
                f"hash_block_tokens must be a multiple of {BLOCK} (the engine block), got {bt}"
            )
        want = -(-n_in // bt)
        if len(ids) != want:
            raise chk.fail(
                f"hash_ids has {len(ids)} entries but input_tokens {n_in} needs "
                f"ceil({n_in}/{bt}) = {want}"
            )
        hasher = id_hashers.get(bt)
        if hasher is None:
            hasher = id_hashers[bt] = BlockIdHasher(bt)
        return hasher.hashes(ids, n_in)
    return segs.hashes(_prefix_segments(obj, chk, n_in, unique))


def _prefix_segments(
    obj: dict[str, Any], chk: LineChecker, n_in: int, unique: int
) -> tuple[Segment, ...]:
    """The prompt as segments: an optional shared ``prefix_id``, then unique text."""
    if "prefix_id" not in obj and "prefix_tokens" not in obj:
        return ((unique, n_in),)
    if "prefix_id" not in obj or "prefix_tokens" not in obj:
        raise chk.fail("prefix_id and prefix_tokens go together; give both")
    pid = obj["prefix_id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise chk.fail(f"prefix_id must be a string or integer, got {pid!r}")
    n_pre = chk.int_field(obj, "prefix_tokens")
    if n_pre > n_in:
        raise chk.fail(f"prefix_tokens {n_pre} exceeds input_tokens {n_in}")
    # Same prefix_id -> same text, so different prefix_tokens share the shorter.
    pre = content_id("tf-prefix", type(pid).__name__, pid)
    return ((pre, n_pre), (unique, n_in - n_pre))
