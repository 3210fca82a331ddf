"""``tokenfleet bench`` against a live stack: a small trace written here, the
sim-shaped JSON, and prefix sharing in the trace becoming cache hits live."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.stack import API_KEY, LiveStack
from tokenfleet.core.types import RequestInfo
from tokenfleet.live.bench import BYTES_PER_BLOCK, block_text, prompt_text
from tokenfleet.tokenizer import chat_block_hashes
from tokenfleet.workloads.trace import TraceRequest


@pytest.fixture(scope="module")
def stack(live_stack: Any) -> Iterator[LiveStack]:
    with live_stack(router="tokenpilot", time_scale=0.1) as s:
        yield s


def test_prompt_text_turns_shared_block_hashes_into_shared_bytes() -> None:
    a = TraceRequest(RequestInfo("a", 0.0, 100, 10, block_hashes=(1, 2, 3, 4, 5, 6)), 5)
    b = TraceRequest(RequestInfo("b", 0.0, 100, 10, block_hashes=(1, 2, 3, 9, 9, 9)), 5)
    ta, tb = prompt_text(a), prompt_text(b)
    assert len(ta.encode()) == 4 * 100 and len(tb.encode()) == 4 * 100
    assert ta[: 3 * BYTES_PER_BLOCK] == tb[: 3 * BYTES_PER_BLOCK]
    assert (
        ta[3 * BYTES_PER_BLOCK : 4 * BYTES_PER_BLOCK]
        != tb[3 * BYTES_PER_BLOCK : 4 * BYTES_PER_BLOCK]
    )
    assert len(block_text(12345)) == BYTES_PER_BLOCK
    # the emulator hashes them to a common prefix of at least the shared blocks minus one
    ha = chat_block_hashes([{"role": "user", "content": ta}])
    hb = chat_block_hashes([{"role": "user", "content": tb}])
    common = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert common >= 2


def test_bench_replays_a_trace_and_reports_like_sim(stack: LiveStack, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = []
    for i in range(24):
        lines.append(
            {
                "arrival_s": i * 0.05,
                "input_tokens": 1200 + 16 * (i % 3),
                "output_tokens": 20,
                "max_tokens": 64,
                "prefix_id": f"doc-{i % 2}",
                "prefix_tokens": 1024,
            }
        )
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet.cli.main",
            "bench",
            "--url",
            stack.url,
            "--trace",
            str(trace),
            "--api-key",
            API_KEY,
            "--json",
            str(out),
            "--quiet",
            "--rate-scale",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    for key in (
        "requests",
        "completed",
        "ttft_p50_s",
        "ttft_p95_s",
        "tpot_p50_s",
        "goodput_tok_s",
        "slo_attainment",
        "per_tier",
        "prefix_hit_ratio",
    ):
        assert key in run, key
    assert run["requests"] == 24 and run["completed"] == 24, run.get("sample_errors")
    assert run["ttft_p50_s"] > 0 and run["goodput_tok_s"] > 0
    # two shared 1024-token prefixes: most of the prompt tokens come from cache
    assert run["prefix_hit_ratio"] > 0.5
    assert "TTFT p50/p95/p99" in proc.stdout


def test_bench_errors_are_one_line(stack: LiveStack, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet.cli.main",
            "bench",
            "--url",
            stack.url,
            "--trace",
            str(tmp_path / "missing.jsonl"),
            "--api-key",
            API_KEY,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "does not exist" in proc.stderr
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfleet.cli.main",
            "bench",
            "--url",
            stack.url,
            "--trace",
            str(tmp_path / "missing.jsonl"),
            "--api-key",
            "wrong",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "401" in proc.stderr


def _lost() -> Any:
    """An outcome the engines never saw (its id is in no engine log)."""
    from tokenfleet.live.bench import Outcome

    return Outcome(
        TraceRequest(RequestInfo("lost", 0.0, 100, 10), 5),
        "interactive",
        sent_s=0.0,
        api_request_id="nobody",
        sent_wall=1.0,
    )


def _write_engine_log(d: Path, lines: list[dict[str, Any]]) -> None:
    (d / "e0.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")


def test_path_latency_joins_client_outcomes_with_engine_logs(tmp_path: Path) -> None:
    """Dispatch = client send -> engine submit, relay = engine first-token step
    -> client; requests are joined by the API's id (engine id '<id>-<attempt>')."""
    from tokenfleet.live.bench import Outcome, path_delays, path_latency

    outs, lines = [], []
    for i in range(200):
        req = TraceRequest(RequestInfo(f"t{i}", 0.0, 100, 10), 5)
        sent_wall = 1000.0 + i
        d, r = 0.004 + 0.0001 * i, 0.001 + 0.00002 * i
        outs.append(
            Outcome(
                req,
                "interactive",
                sent_s=float(i),
                first_token_s=i + d + 0.05 + r,
                api_request_id=f"rid{i}",
                sent_wall=sent_wall,
            )
        )
        lines.append(
            {
                "id": f"rid{i}-1",
                "received": sent_wall + d - 0.001,
                "submitted": sent_wall + d,
                "first_model": sent_wall + d + 0.05,
                "first": sent_wall + d + 0.0502,
            }
        )
    outs.append(_lost())
    _write_engine_log(tmp_path, lines)
    rows = path_delays(outs, tmp_path)
    assert len(rows) == 200
    dispatch, relay = [d for _, d, _ in rows], [r for _, _, r in rows]
    assert rows[7][0] == 100
    assert dispatch[7] == pytest.approx(0.0047) and relay[7] == pytest.approx(0.00114)
    lat = path_latency(outs, tmp_path)
    assert lat.dispatch_min_s == pytest.approx(0.0041, abs=2e-4)
    assert lat.dispatch_min_s + lat.dispatch_tail_s == pytest.approx(sum(dispatch) / 200)
    assert lat.relay_min_s + lat.relay_tail_s == pytest.approx(sum(relay) / 200)
    with pytest.raises(ValueError):
        path_latency(outs, tmp_path / "empty")


def test_hop_breakdown_joins_client_ledger_state_and_engine_times(tmp_path: Path) -> None:
    """Each hop is the difference of two stamps of one request; a request without
    a ledger row or an engine entry is left out, and a missing Redis stamp only
    drops the hops that need it."""
    from datetime import UTC, datetime

    from tokenfleet.live.bench import EXPRESS_HOPS, HOPS, Outcome, hop_breakdown, outcome_traces

    def at(t: float) -> datetime:
        return datetime.fromtimestamp(t, tz=UTC)

    outs, rows, lines, state = [], [], [], {}
    for i in range(10):
        t0 = 1000.0 + 10 * i
        k = 1 + i / 10  # hop = c * k: nearest rank gives k = 1.4 (p50), 1.8 (p90)
        outs.append(
            Outcome(
                TraceRequest(RequestInfo(f"t{i}", 0.0, 100, 10), 5),
                "interactive",
                sent_s=float(i),
                first_token_s=i + 0.030 * k,
                api_request_id=f"rid{i}",
                sent_wall=t0,
            )
        )
        rows.append(
            {
                "request_id": f"rid{i}",
                "arrival_ts": at(t0 + 0.002 * k),
                "admitted_ts": at(t0 + 0.003 * k),
                "dispatched_ts": at(t0 + 0.007 * k),
                "first_token_ts": at(t0 + 0.028 * k),
            }
        )
        state[f"rid{i}"] = (
            {"received_at": str(t0 + 0.005 * k), "claimed_at": str(t0 + 0.006 * k)}
            if i != 9
            else {}
        )
        lines.append({"id": f"rid{i}-1", "received": t0 + 0.008 * k, "first": t0 + 0.027 * k})
    # two express dispatches: the API claimed them (``api:<id>``) and called the
    # engine itself, 1 ms after admitting; no broker, no worker hops
    for j, i in enumerate((10, 11)):
        t0 = 1000.0 + 10 * i
        outs.append(
            Outcome(
                TraceRequest(RequestInfo(f"t{i}", 0.0, 100, 10), 5),
                "interactive",
                sent_s=float(i),
                first_token_s=i + 0.020,
                api_request_id=f"rid{i}",
                sent_wall=t0,
            )
        )
        rows.append(
            {
                "request_id": f"rid{i}",
                "arrival_ts": at(t0 + 0.002),
                "admitted_ts": at(t0 + 0.003),
                "dispatched_ts": at(t0 + 0.003),
                "first_token_ts": at(t0 + 0.019),
            }
        )
        # the claim is written after the engine call started: later than its stamp
        state[f"rid{i}"] = {
            "received_at": str(t0 + 0.005),
            "claimed_at": str(t0 + 0.005),
            "owner": "api:a1",
        }
        lines.append({"id": f"rid{i}-1", "received": t0 + 0.004 + 0.001 * j, "first": t0 + 0.018})
    outs.append(_lost())  # never reached the engine: no first token, not in the table
    _write_engine_log(tmp_path, lines)
    traces = outcome_traces(outs)
    assert [t["rid"] for t in traces] == [f"rid{i}" for i in range(12)]
    hops = hop_breakdown(traces, rows, lambda rid: state[rid], tmp_path)
    express = [
        name for name, _, _ in EXPRESS_HOPS if name not in dict.fromkeys(n for n, _, _ in HOPS)
    ]
    assert list(hops) == [name for name, _, _ in HOPS] + express
    # express requests take no worker hop (a claim stamped after the engine call
    # read as a negative "claimed -> engine call" before)
    assert hops["worker: claimed -> engine call"]["n"] == 9
    assert hops["express: API -> engine receives"] == {"p50_ms": 1.0, "p90_ms": 2.0, "n": 2}
    assert hops["client -> API arrival"]["n"] == 12
    relay = hop_breakdown(traces[:10], rows, lambda rid: state[rid], tmp_path)
    assert relay["client -> API arrival"] == {"p50_ms": 2.8, "p90_ms": 3.6, "n": 10}
    assert relay["engine: received -> first token"]["p50_ms"] == pytest.approx(26.6)
    assert hops["worker -> client first token"]["p90_ms"] == pytest.approx(3.6)
    assert hops["publish -> worker receives"]["n"] == 9  # rid9 has no Redis stamps
    assert hops["API: arrival -> admitted"]["n"] == 12  # both paths


def test_step_breakdown_lines_up_client_api_and_engine_stamps(tmp_path: Path) -> None:
    """Each step is the difference of two stamps of one request, in the order
    the API took them; a request the API did not call the engine for (no
    ``engine_sent``), or without an engine entry, is left out."""
    from tokenfleet.live.bench import step_breakdown

    names = ["app", "view", "dispatch", "engine_call", "engine_sent", "state_written"]
    traces, marks, lines = [], {}, []
    for i in range(10):
        t0 = 2000.0 + 10 * i
        k = 1 + i / 10  # nearest rank: k = 1.4 at p50, 1.8 at p90
        traces.append({"rid": f"r{i}", "sent": t0, "first": t0 + 0.030 * k})
        api = [(n, t0 + 0.001 * k * (j + 1)) for j, n in enumerate(names)]
        api += [("first_event", t0 + 0.025 * k), ("first_written", t0 + 0.026 * k)]
        marks[f"r{i}"] = api
        lines.append({"id": f"r{i}-1", "received": t0 + 0.007 * k, "first": t0 + 0.024 * k})
    # through a worker: the API stamped no engine call of its own
    traces.append({"rid": "w", "sent": 3000.0, "first": 3000.05})
    marks["w"] = [("app", 3000.001), ("dispatch", 3000.002), ("first_event", 3000.04)]
    lines.append({"id": "w-1", "received": 3000.01, "first": 3000.03})
    # no engine entry
    traces.append({"rid": "x", "sent": 4000.0, "first": 4000.05})
    marks["x"] = marks["r0"]
    _write_engine_log(tmp_path, lines)
    got = step_breakdown(traces, marks, tmp_path)
    assert list(got) == [
        "client sends -> API app",
        "API: app -> view",
        "API: view -> dispatch",
        "API: dispatch -> engine_call",
        "API: engine_call -> engine_sent",
        "API engine_sent -> engine receives",
        "engine: receives -> first token",
        "engine first token -> API first_event",
        "API: first_event -> first_written",
        "API first_written -> client reads it",
        "API steps before the engine call is sent",
        "API steps from first_event",
    ]
    assert all(v["n"] == 10 for v in got.values())
    assert got["client sends -> API app"] == {"p50_ms": 1.4, "p90_ms": 1.8, "n": 10}
    assert got["API engine_sent -> engine receives"]["p50_ms"] == pytest.approx(2.8)
    assert got["engine: receives -> first token"]["p90_ms"] == pytest.approx(30.6)
    assert got["API steps before the engine call is sent"]["p50_ms"] == pytest.approx(5.6)
    assert got["API first_written -> client reads it"]["p50_ms"] == pytest.approx(5.6)
