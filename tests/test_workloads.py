"""Workload layer: trace loaders, block hashing, synthetic generators, scaling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tokenfleet.core.types import BLOCK_SIZE_TOKENS
from tokenfleet.engine.profiles import get_profile
from tokenfleet.errors import ConfigError, TraceFormatError
from tokenfleet.workloads import (
    DEFAULT_MAX_TOKENS,
    SYNTHETIC,
    capacity_rps,
    clear_cache,
    detect_format,
    generate,
    limit,
    load_workload,
    offered_rps,
    rate_scale,
    scale_to_load,
)
from tokenfleet.workloads.hashing import SegmentHasher, hash_token_ids
from tokenfleet.workloads.trace import TraceRequest

TRACES = Path(__file__).parents[1] / ".." / "shared" / "traces"
B = BLOCK_SIZE_TOKENS


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _mc(ts: int, n_in: int, n_out: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# -- hashing ------------------------------------------------------------------
def test_token_hashes_are_chained_and_cover_only_full_blocks() -> None:
    toks = list(range(100))
    h = hash_token_ids(toks)
    assert len(h) == 100 // B
    changed = hash_token_ids([999] + toks[1:])
    # A change in block 0 changes every later hash (chaining), not just block 0.
    assert all(x != y for x, y in zip(h, changed, strict=False))
    tail_changed = hash_token_ids(toks[:96] + [7, 7, 7, 7])
    assert tail_changed == h  # the partial block never gets a hash


def test_prompt_block_hashes_are_chained_xxh3_of_each_block_as_emulators_cache_them() -> None:
    """The byte tokenizer's block hash is part of the emulator's wire format
    (KV events, cache hits): XXH3-64 of the block's 64 bytes seeded with the
    parent's hash (0 for the first block). Pinned here, with a golden value,
    so a faster implementation cannot change it unnoticed."""
    import xxhash

    from tokenfleet.tokenizer import block_hashes, encode_text

    stream = encode_text("def f(x):\n    return x * 2  # " * 40)
    prev, want = 0, []
    for j in range(len(stream) // 64):
        prev = xxhash.xxh3_64_intdigest(stream[j * 64 : (j + 1) * 64], seed=prev)
        want.append(prev)
    assert block_hashes(stream) == want and len(want) == 18
    assert want[0] == 0xAC513869C7DE9031  # the first block's hash, as emulators cache it
    # a parent continues the chain: the tail hashed from block 9's hash is the same tail
    assert block_hashes(stream[9 * 64 :], parent=want[8]) == want[9:]


def test_segment_hasher_shares_exactly_the_common_full_blocks() -> None:
    hs = SegmentHasher()
    a = hs.hashes([(1, 100), (2, 50)])
    b = hs.hashes([(1, 200)])
    assert len(a) == 150 // B and len(b) == 200 // B
    assert _common_prefix(a, b) == 100 // B  # tokens 96..99 match but block 6 differs
    assert hs.hashes([(1, 100), (2, 50)]) == a  # memoised path agrees


def test_hashes_do_not_depend_on_pythonhashseed(tmp_path: Path) -> None:
    trace = _jsonl(
        tmp_path / "t.jsonl",
        [
            {
                "arrival_s": 0,
                "input_tokens": 300,
                "output_tokens": 5,
                "prefix_id": "system-A",
                "prefix_tokens": 200,
                "request_id": "r1",
            },
        ],
    )
    code = (
        "import sys; from tokenfleet.workloads import load_workload; "
        "r = load_workload(sys.argv[1]); print(hash(r[0].info.block_hashes))"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run(
            [sys.executable, "-c", code, str(trace)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        outs.add(res.stdout.strip())
    assert len(outs) == 1


# -- Mooncake -------------------------------------------------------------------
def test_mooncake_shared_hash_ids_share_exactly_that_prefix(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "mc.jsonl",
        [
            _mc(0, 2048, 10, [1, 2, 3, 4]),
            _mc(5, 2048, 10, [1, 2, 9, 10]),
            _mc(9, 2048, 10, [7, 2, 3, 4]),  # same later ids, different first: no sharing
        ],
    )
    a, b, c = load_workload(path, "mooncake")
    assert len(a.info.block_hashes) == 2048 // B == 128
    assert _common_prefix(a.info.block_hashes, b.info.block_hashes) == 2 * 32
    assert _common_prefix(a.info.block_hashes, c.info.block_hashes) == 0
    assert not set(a.info.block_hashes) & set(c.info.block_hashes)


def test_mooncake_partial_last_block(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "mc.jsonl",
        [
            _mc(0, 1000, 3, [1, 2]),  # 512 + 488: 62 full engine blocks
            _mc(1, 1024, 3, [1, 2]),  # 64 blocks; same ids -> same first 62
            _mc(2, 600, 3, [1, 5]),  # 37 blocks; shares the first 32
            _mc(3, 15, 3, [8]),  # shorter than one engine block
        ],
    )
    a, b, c, d = load_workload(path)
    assert [len(r.info.block_hashes) for r in (a, b, c, d)] == [62, 64, 37, 0]
    assert b.info.block_hashes[:62] == a.info.block_hashes
    assert _common_prefix(a.info.block_hashes, c.info.block_hashes) == 32


def test_mooncake_sorts_and_converts_ms(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "mc.jsonl", [_mc(2500, 16, 1, [1]), _mc(500, 16, 1, [2])])
    reqs = load_workload(path)
    assert [r.arrival_s for r in reqs] == [0.5, 2.5]
    assert [r.info.request_id for r in reqs] == ["mc-1", "mc-0"]


@pytest.mark.parametrize(
    "bad_line, problem",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"timestamp": 0, "input_length": 1024, "output_length": 1}), "hash_ids"),
        (json.dumps(_mc(0, 1024, 1, [1, 2, 3])), "ceil(1024/512) = 2"),
        (json.dumps(_mc(0, -5, 1, [])), "input_length"),
        (json.dumps(_mc(-1, 16, 1, [1])), "timestamp"),
        (json.dumps(_mc(0, 16, 1, ["a"])), "integers"),
        (json.dumps({**_mc(0, 16, 1, [1]), "output_length": True}), "output_length"),
    ],
)
def test_mooncake_malformed_line_names_file_and_line(
    tmp_path: Path, bad_line: str, problem: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(_mc(0, 16, 1, [1])) + "\n\n" + bad_line + "\n")
    with pytest.raises(TraceFormatError) as ei:
        load_workload(path, "mooncake")
    assert ei.value.line_no == 3 and ei.value.path == str(path)
    assert str(ei.value).startswith(f"{path}:3: ")
    assert problem in str(ei.value)


def test_max_tokens_never_reads_true_lengths(tmp_path: Path) -> None:
    rows = [_mc(0, 1024, 5, [1, 2]), _mc(10, 512, 900, [1])]
    a = load_workload(_jsonl(tmp_path / "a.jsonl", rows))
    rows2 = [dict(r, output_length=o) for r, o in zip(rows, (700, 1), strict=False)]
    b = load_workload(_jsonl(tmp_path / "b.jsonl", rows2))
    assert [r.info for r in a] == [r.info for r in b]
    assert all(r.info.max_tokens == DEFAULT_MAX_TOKENS["mooncake"] for r in a)
    assert [r.output_tokens for r in a] != [r.output_tokens for r in b]


def test_true_length_is_clamped_to_budget(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "mc.jsonl", [_mc(0, 16, 5000, [1]), _mc(1, 16, 0, [2])])
    big, zero = load_workload(path, max_tokens=256)
    assert big.info.max_tokens == 256 and big.output_tokens == 256
    assert zero.output_tokens == 1  # an engine always emits a first token


# -- Azure ----------------------------------------------------------------------
AZURE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:59.9999999,374,44
2023-11-16 23:59:58.6805900,396,109
2023-11-17 00:00:03.2224670,879,55
2023-11-17 00:00:03.2224670,91,16
"""


def test_azure_seven_digit_timestamps_relative_to_first(tmp_path: Path) -> None:
    path = tmp_path / "az.csv"
    path.write_text(AZURE_CSV)
    reqs = load_workload(path)  # detected from the .csv extension
    assert [r.info.input_tokens for r in reqs] == [396, 374, 879, 91]
    arrivals = [r.arrival_s for r in reqs]
    assert arrivals[0] == 0.0
    assert arrivals[1] == pytest.approx(1.3194099, abs=1e-9)
    assert arrivals[2] == pytest.approx(4.541877, abs=1e-9)  # across midnight
    assert arrivals[3] == arrivals[2]
    assert all(r.info.max_tokens == DEFAULT_MAX_TOKENS["azure"] for r in reqs)


def test_azure_requests_share_no_blocks(tmp_path: Path) -> None:
    rows = "\n".join(f"2023-11-16 18:00:{i:02d}.5,512,10" for i in range(20))
    path = tmp_path / "az.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + rows + "\n")
    reqs = load_workload(path)
    seen: set[int] = set()
    for r in reqs:
        assert len(r.info.block_hashes) == 32
        assert not seen & set(r.info.block_hashes)
        seen.update(r.info.block_hashes)


@pytest.mark.parametrize(
    "row, problem",
    [
        ("2023-11-16 18:15,10,5", "TIMESTAMP"),
        ("2023-11-16 18:15:46.1,ten,5", "ContextTokens"),
        ("2023-11-16 18:15:46.1,10", "columns"),
    ],
)
def test_azure_bad_row_names_line(tmp_path: Path, row: str, problem: str) -> None:
    path = tmp_path / "az.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n" + row + "\n"
    )
    with pytest.raises(TraceFormatError, match=problem) as ei:
        load_workload(path)
    assert ei.value.line_no == 3


# -- TokenFleet JSONL ---------------------------------------------------------
def test_tokenfleet_optional_fields_map_onto_request_info(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "w.jsonl",
        [
            {
                "arrival_s": 1.5,
                "input_tokens": 64,
                "output_tokens": 20,
                "max_tokens": 50,
                "tenant": "acme",
                "task_type": "batch",
                "deadline_s": 100.0,
                "region": "eu",
                "model": "llama",
                "model_version": "v2",
                "session": "s1",
                "client_timeout_s": 30.0,
                "request_id": "x1",
                "slo_class": "gold",
                "allow_cross_region": False,
            },
            {"timestamp_ms": 500, "input_tokens": 10, "output_tokens": 2000, "tier": "interactive"},
        ],
    )
    second, first = load_workload(path)  # sorted by arrival: 0.5 s, then 1.5 s
    assert second.arrival_s == 0.5 and second.info.tier == "interactive"
    assert second.info.max_tokens == DEFAULT_MAX_TOKENS["tokenfleet"]
    assert second.output_tokens == DEFAULT_MAX_TOKENS["tokenfleet"]
    assert second.info.block_hashes == ()
    i = first.info
    assert (i.request_id, i.arrival_s, i.input_tokens, i.max_tokens) == ("x1", 1.5, 64, 50)
    assert (i.tenant, i.task_type, i.deadline_s, i.region) == ("acme", "batch", 100.0, "eu")
    assert (i.model, i.model_version, i.session, i.slo_class) == ("llama", "v2", "s1", "gold")
    assert i.allow_cross_region is False and len(i.block_hashes) == 4
    assert first.output_tokens == 20 and first.client_timeout_s == 30.0


def test_tokenfleet_turns_quote_the_previous_prompt_and_answer(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "w.jsonl",
        [
            {
                "arrival_s": 0,
                "input_tokens": 300,
                "output_tokens": 90,
                "session": "c1",
                "turn": 1,
                "prefix_id": "sys",
                "prefix_tokens": 200,
            },
            {
                "arrival_s": 1,
                "input_tokens": 300,
                "output_tokens": 5,
                "session": "c2",
                "turn": 1,
                "prefix_id": "sys",
                "prefix_tokens": 200,
            },
            {"arrival_s": 9, "input_tokens": 420, "output_tokens": 40, "session": "c1", "turn": 2},
        ],
    )
    t1, other, t2 = load_workload(path)
    quoted = t1.info.block_hashes + t1.output_block_hashes
    assert len(quoted) == (300 + 90) // B
    assert t2.info.block_hashes[: len(quoted)] == quoted  # prompt + answer, block for block
    assert len(t2.info.block_hashes) == 420 // B
    # the other session shares only the system prompt
    assert _common_prefix(other.info.block_hashes, t2.info.block_hashes) == 200 // B


@pytest.mark.parametrize(
    "rows, problem",
    [
        (
            [
                {"input_tokens": 100, "output_tokens": 50, "session": "s", "turn": 1},
                {"input_tokens": 120, "output_tokens": 5, "session": "s", "turn": 2},
            ],
            "less than turn 1's prompt plus its answer",
        ),
        (
            [
                {"input_tokens": 100, "output_tokens": 5, "session": "s", "turn": 1},
                {"input_tokens": 200, "output_tokens": 5, "session": "s", "turn": 3},
            ],
            "must be consecutive",
        ),
        ([{"input_tokens": 100, "output_tokens": 5, "turn": 1}], "turn needs session"),
    ],
)
def test_tokenfleet_turns_reject_inconsistent_conversations(
    tmp_path: Path, rows: list[dict[str, object]], problem: str
) -> None:
    path = _jsonl(tmp_path / "w.jsonl", [{"arrival_s": i, **r} for i, r in enumerate(rows)])
    with pytest.raises(TraceFormatError, match=problem):
        load_workload(path)


def test_tokenfleet_prefix_ids_and_hash_ids(tmp_path: Path) -> None:
    path = _jsonl(
        tmp_path / "w.jsonl",
        [
            {
                "arrival_s": 0,
                "input_tokens": 400,
                "output_tokens": 1,
                "prefix_id": "sys",
                "prefix_tokens": 100,
            },
            {
                "arrival_s": 1,
                "input_tokens": 400,
                "output_tokens": 1,
                "prefix_id": "sys",
                "prefix_tokens": 100,
            },
            {
                "arrival_s": 2,
                "input_tokens": 400,
                "output_tokens": 1,
                "prefix_id": "sys",
                "prefix_tokens": 320,
            },
            {
                "arrival_s": 3,
                "input_tokens": 400,
                "output_tokens": 1,
                "prefix_id": "other",
                "prefix_tokens": 100,
            },
            {"arrival_s": 4, "input_tokens": 400, "output_tokens": 1},
            {
                "arrival_s": 5,
                "input_tokens": 100,
                "output_tokens": 1,
                "hash_ids": [3, 4, 5, 6],
                "hash_block_tokens": 32,
            },
            {
                "arrival_s": 6,
                "input_tokens": 64,
                "output_tokens": 1,
                "hash_ids": [3, 4],
                "hash_block_tokens": 32,
            },
        ],
    )
    a, b, c, d, e, f, g = (r.info.block_hashes for r in load_workload(path))
    assert _common_prefix(a, b) == 100 // B  # then each request's own text
    assert _common_prefix(a, c) == 100 // B  # longer cut of the same prefix
    assert _common_prefix(a, d) == 0 and _common_prefix(a, e) == 0
    assert len(f) == 6 and f[:4] == g


@pytest.mark.parametrize(
    "row, problem",
    [
        ({"arrival_s": 0, "input_tokens": 10, "output_tokens": 1, "arival": 3}, "unknown field"),
        (
            {"arrival_s": 0, "timestamp_ms": 0, "input_tokens": 10, "output_tokens": 1},
            "exactly one",
        ),
        ({"input_tokens": 10, "output_tokens": 1}, "exactly one"),
        ({"arrival_s": 0, "input_tokens": 10, "output_tokens": 1, "task_type": "x"}, "task_type"),
        (
            {
                "arrival_s": 0,
                "input_tokens": 10,
                "output_tokens": 1,
                "prefix_id": "p",
                "prefix_tokens": 11,
            },
            "exceeds",
        ),
        ({"arrival_s": 0, "input_tokens": 10, "output_tokens": 1, "prefix_id": "p"}, "together"),
        (
            {
                "arrival_s": 0,
                "input_tokens": 48,
                "output_tokens": 1,
                "hash_ids": [1, 2],
                "hash_block_tokens": 24,
            },
            "multiple of 16",
        ),
        ({"arrival_s": 5, "input_tokens": 10, "output_tokens": 1, "deadline_s": 4}, "before"),
        (
            {"arrival_s": 0, "input_tokens": 10, "output_tokens": 1, "request_id": "a"},
            "already used",
        ),
    ],
)
def test_tokenfleet_rejects_bad_lines(tmp_path: Path, row: dict[str, object], problem: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(
        "# comment lines and blank lines are skipped\n\n"
        + json.dumps({"arrival_s": 0, "input_tokens": 1, "output_tokens": 1, "request_id": "a"})
        + "\n"
        + json.dumps(row)
        + "\n"
    )
    with pytest.raises(TraceFormatError, match=problem) as ei:
        load_workload(path, "tokenfleet")
    assert ei.value.line_no == 4


# -- load_workload -------------------------------------------------------------
def test_detection_limit_and_cache(tmp_path: Path) -> None:
    mc = _jsonl(tmp_path / "a.jsonl", [_mc(i * 10, 32, 1, [i]) for i in range(5)])
    tf = _jsonl(tmp_path / "b.jsonl", [{"arrival_s": 0, "input_tokens": 3, "output_tokens": 1}])
    odd = _jsonl(tmp_path / "c.jsonl", [{"foo": 1}])
    assert detect_format(mc) == "mooncake" and detect_format(tf) == "tokenfleet"
    with pytest.raises(TraceFormatError, match="pass the format explicitly"):
        load_workload(odd)
    with pytest.raises(ConfigError, match="unknown trace format"):
        load_workload(mc, "parquet")
    with pytest.raises(ConfigError, match="does not exist"):
        load_workload(tmp_path / "missing.jsonl")

    assert [r.arrival_s for r in load_workload(mc, limit=2)] == [0.0, 0.01]
    first = load_workload(mc)
    first[0].output_tokens = 999  # callers may mutate their copy...
    assert load_workload(mc)[0].output_tokens == 1  # ...without touching the cache
    _jsonl(mc, [_mc(0, 32, 7, [1])])  # rewriting the file invalidates the cache
    assert [r.output_tokens for r in load_workload(mc)] == [7]
    clear_cache()


# -- synthetic ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["chat", "longdoc", "mixed", "burst", "conversations", "agentic"])
def test_synthetic_is_seeded_and_sorted(name: str) -> None:
    a = generate(name, 120, 7, 4.0)
    b = generate(name, 120, 7, 4.0)
    c = generate(name, 120, 8, 4.0)
    assert len(a) == 120
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert [(r.info, r.output_tokens) for r in a] == [(r.info, r.output_tokens) for r in b]
    assert [r.info.arrival_s for r in a] != [r.info.arrival_s for r in c]
    assert len({r.info.request_id for r in a}) == 120
    for r in a:
        assert len(r.info.block_hashes) == r.info.input_tokens // B
        assert 1 <= r.output_tokens <= r.info.max_tokens


def test_synthetic_registry_and_arguments() -> None:
    assert {"chat", "longdoc", "mixed", "burst", "conversations"} <= set(SYNTHETIC.names())
    with pytest.raises(ConfigError, match="burst_share"):
        generate("conversations", 10, 1, 1.0, burst_share=1.5)
    with pytest.raises(ConfigError, match="rate_rps"):
        generate("chat", 10, 1, 0.0)
    with pytest.raises(ConfigError, match="n_requests"):
        generate("burst", -1, 1, 1.0)
    assert generate("longdoc", 0, 1, 1.0) == []


def test_chat_turns_extend_previous_prompt() -> None:
    reqs = generate("chat", 400, 3, 5.0)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        assert r.info.session is not None
        by_session.setdefault(r.info.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) >= 3]
    assert len(multi) >= 10
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:], strict=False):
            # The previous prompt (and answer) is a prefix of the next prompt.
            assert nxt.info.input_tokens > prev.info.input_tokens + prev.output_tokens
            assert nxt.info.block_hashes[: len(prev.info.block_hashes)] == prev.info.block_hashes
    # A few system prompts are shared across sessions, but sessions' own turns are not.
    firsts = [turns[0].info.block_hashes for turns in by_session.values()]
    assert len({h[0] for h in firsts if h}) <= 4
    seconds = {turns[1].info.block_hashes[-1] for turns in multi}
    assert len(seconds) == len(multi)


def test_chat_answers_carry_the_block_hashes_the_next_turn_quotes() -> None:
    """The engine caches an answer's KV under hashes the next prompt carries."""
    reqs = generate("chat", 400, 3, 5.0)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(str(r.info.session), []).append(r)
    pairs = [
        (a, b) for turns in by_session.values() for a, b in zip(turns, turns[1:], strict=False)
    ]
    assert len(pairs) >= 50
    for prev, nxt in pairs:
        full = prev.info.block_hashes + prev.output_block_hashes
        assert len(full) == (prev.info.input_tokens + prev.output_tokens) // B
        assert nxt.info.block_hashes[: len(full)] == full
    # the policy-facing RequestInfo knows nothing of the answer
    assert all(not hasattr(r.info, "output_block_hashes") for r in reqs)


def test_conversations_are_long_share_app_prompts_and_come_back_in_bursts() -> None:
    reqs = generate("conversations", 3000, 4, 10.0)
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(str(r.info.session), []).append(r)
    turns = [len(v) for v in by_session.values()]
    assert max(turns) >= 20 and sum(turns) / len(turns) >= 4
    gaps = sorted(
        b.arrival_s - a.arrival_s
        for v in by_session.values()
        for a, b in zip(v, v[1:], strict=False)
    )
    assert gaps[len(gaps) // 4] < 2.0  # a quarter of next turns within 2 s: bursts
    assert gaps[-len(gaps) // 10] > 30.0  # and a tenth after more than 30 s
    for v in by_session.values():
        for prev, nxt in zip(v, v[1:], strict=False):
            quoted = prev.info.block_hashes + prev.output_block_hashes
            assert nxt.info.block_hashes[: len(quoted)] == quoted
    # many conversations share each application's system prompt
    firsts = {v[0].info.block_hashes[0] for v in by_session.values()}
    assert len(firsts) <= 8 < len(by_session)


def test_longdoc_questions_share_the_document() -> None:
    reqs = generate("longdoc", 200, 5, 2.0)
    by_doc: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        assert r.info.session is not None
        by_doc.setdefault(r.info.session, []).append(r)
        assert 8192 <= r.info.input_tokens <= 65536 + 128 + 400
    pairs = [v for v in by_doc.values() if len(v) >= 2]
    assert pairs
    for v in pairs:
        doc_blocks = min(r.info.input_tokens for r in v) // B - 400 // B - 1
        assert _common_prefix(v[0].info.block_hashes, v[1].info.block_hashes) >= doc_blocks
        assert v[0].info.block_hashes[-1] != v[1].info.block_hashes[-1]


def test_burst_is_on_off_and_mixed_has_all_parts() -> None:
    reqs = generate("burst", 600, 2, 5.0)
    gaps = sorted(b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    assert gaps[-1] > 20 * gaps[len(gaps) // 2]  # long silences between dense bursts
    mixed = generate("mixed", 300, 2, 5.0)
    kinds = {r.info.request_id.split("-")[0] for r in mixed}
    assert kinds == {"chat", "doc", "burst"}
    batch = [r for r in mixed if r.info.task_type == "batch"]
    assert batch and all(r.info.deadline_s == pytest.approx(r.arrival_s + 600) for r in batch)


# -- scaling -----------------------------------------------------------------
def test_rate_scale_compresses_arrivals_and_keeps_deadline_slack() -> None:
    reqs = generate("mixed", 200, 1, 2.0)
    fast = rate_scale(reqs, 2.0)
    assert offered_rps(fast) == pytest.approx(2 * offered_rps(reqs))
    t0 = reqs[0].arrival_s
    for a, b in zip(reqs, fast, strict=False):
        assert b.arrival_s == pytest.approx(t0 + (a.arrival_s - t0) / 2)
        if a.info.deadline_s is not None:
            assert b.info.deadline_s is not None
            assert b.info.deadline_s - b.arrival_s == pytest.approx(a.info.deadline_s - a.arrival_s)
    with pytest.raises(ConfigError, match="> 0"):
        rate_scale(reqs, 0)


def test_capacity_formula_and_scale_to_load() -> None:
    prof = get_profile("llama3-8b-h200")
    reqs = generate("chat", 300, 4, 3.0)
    one = [TraceRequest(r.info, 100) for r in reqs]
    # All outputs 100 and inputs varied: check the documented formula by hand.
    ctx = sum(r.info.input_tokens + 50 for r in one) / len(one)
    per_tok = prof.decode_step_time_s(32, ctx) / 32
    busy = [prof.prefill_time_s(r.info.input_tokens) + 100 * per_tok for r in one]
    assert capacity_rps(one, prof, 3) == pytest.approx(3 * len(busy) / sum(busy))
    assert capacity_rps(reqs, prof, 8) == pytest.approx(8 * capacity_rps(reqs, prof, 1))

    for load in (0.5, 1.3):
        scaled = scale_to_load(reqs, load, prof, 4)
        assert offered_rps(scaled) == pytest.approx(load * capacity_rps(scaled, prof, 4))
        assert [r.info.request_id for r in scaled] == [r.info.request_id for r in reqs]
    for bad in (0, -0.5):
        with pytest.raises(ConfigError, match="load must be a finite number > 0"):
            scale_to_load(reqs, bad, prof, 4)


def test_limit_keeps_first_by_arrival() -> None:
    reqs = generate("burst", 50, 1, 5.0)
    assert limit(list(reversed(reqs)), 5) == reqs[:5]
    with pytest.raises(ConfigError):
        limit(reqs, -1)


# -- real shared traces ---------------------------------------------------------
needs_traces = pytest.mark.skipif(
    not TRACES.is_dir(), reason=f"shared traces not found at {TRACES.resolve()}"
)


@pytest.mark.traces
@needs_traces
def test_real_mooncake_trace_loads_fast_and_matches_published_reuse() -> None:
    clear_cache()
    t = time.perf_counter()
    reqs = load_workload(TRACES / "mooncake_synthetic.jsonl")
    elapsed = time.perf_counter() - t
    assert len(reqs) == 3993
    assert elapsed < 10.0  # ~0.6 s on the dev machine; generous for a busy CI box
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        h = r.info.block_hashes
        assert len(h) == r.info.input_tokens // B
        assert r.info.max_tokens == 1024 and r.output_tokens <= 1024
        n = 0
        while n < len(h) and h[n] in seen:
            n += 1
        hit += n * B
        total += r.info.input_tokens
        seen.update(h)
    # The trace README: an ideal infinite prefix cache serves about 65% of input.
    assert hit / total == pytest.approx(0.65, abs=0.02)


@pytest.mark.traces
@needs_traces
def test_real_azure_trace_loads() -> None:
    reqs = load_workload(TRACES / "azure_conv_2023.csv")
    assert len(reqs) == 19366
    assert reqs[0].arrival_s == 0.0 and reqs[1].arrival_s == pytest.approx(4.314579)
    assert 3400 < reqs[-1].arrival_s < 3600


def test_the_conversations_scenario_draws_its_documented_statistics() -> None:
    """examples/scenarios/conversations.yaml: answers average WildChat's 441
    tokens, think times are heavy-tailed (median 2 min, a tenth beyond 15 min)
    and sessions run several turns over 50 shared system prompts."""
    from statistics import mean

    from tokenfleet.workloads.mix import load_mix

    spec = load_mix(Path(__file__).resolve().parents[1] / "examples/scenarios/conversations.yaml")
    (cls,) = spec.classes
    assert cls.synthetic == "conversations" and spec.load == 0.8
    opts = dict(cls.options)
    rate = float(opts.pop("rate_rps"))
    # a twentieth of the rate: the window then spans ~20 min, so long think
    # times are seen whole (think times do not depend on the rate)
    reqs = generate("conversations", 1500, 0, rate / 20, **opts)
    assert 400 <= mean(r.output_tokens for r in reqs) <= 480  # true lengths, before the budget
    by_session: dict[str, list[TraceRequest]] = {}
    for r in reqs:
        by_session.setdefault(str(r.info.session), []).append(r)
    gaps = sorted(
        b.info.arrival_s - a.info.arrival_s
        for v in by_session.values()
        for a, b in zip(v, v[1:], strict=False)
    )
    # a window sees a long gap only if both turns fall in it, so observed gaps
    # run shorter than drawn (median 120 s, p90 935 s)
    assert 60 <= gaps[len(gaps) // 2] <= 150
    assert gaps[-len(gaps) // 10] > 300  # minutes: a heavy tail
    firsts = {v[0].info.block_hashes[0] for v in by_session.values()}
    assert len(firsts) <= 50 < len(by_session)
