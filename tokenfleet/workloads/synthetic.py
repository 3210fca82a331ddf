"""Seeded synthetic workloads, found by name in ``SYNTHETIC``.

Every generator has the signature ``(n_requests, seed, rate_rps, **options)``
and returns ``n_requests`` requests sorted by arrival. Arrivals are open-loop:
a chat's next turn is timed from the previous turn's arrival plus a reading
and think time, not from the simulated response, so a trace is a fixed input
that every policy sees identically.

Prompts are built from content segments (see ``hashing.SegmentHasher``), so
shared text (system prompts, earlier turns, documents) yields exactly shared
block hashes and nothing else does. Shapes and constants are documented in
docs/workloads.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tokenfleet.core.registry import Registry
from tokenfleet.core.types import RequestInfo
from tokenfleet.errors import ConfigError
from tokenfleet.workloads.common import (
    DEFAULT_MAX_TOKENS,
    check_budget,
    engine_output_tokens,
    make_request,
)
from tokenfleet.workloads.hashing import Segment, SegmentHasher, content_id
from tokenfleet.workloads.trace import TraceRequest

SYNTHETIC: Registry[list[TraceRequest]] = Registry("synthetic workload")


@dataclass(slots=True)
class _Draft:
    """A request before hashing: hashing is the costly part, so we cut to
    ``n_requests`` first and hash only what is kept."""

    arrival_s: float
    request_id: str
    segments: tuple[Segment, ...]
    true_output_tokens: int
    tenant: str
    task_type: str = "chat"
    session: str | None = None
    deadline_s: float | None = None
    answer: Segment | None = None  # the answer's content, when a later turn quotes it

    @property
    def input_tokens(self) -> int:
        return sum(n for _, n in self.segments)


def _check(n_requests: int, seed: int, rate_rps: float) -> None:
    if isinstance(n_requests, bool) or not isinstance(n_requests, int) or n_requests < 0:
        raise ConfigError(f"n_requests must be a non-negative integer, got {n_requests!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    if not isinstance(rate_rps, (int, float)) or not rate_rps > 0 or math.isinf(rate_rps):
        raise ConfigError(f"rate_rps must be a finite number > 0, got {rate_rps!r}")


def _lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(float(rng.lognormal(math.log(median), sigma))))))


def _finish(
    drafts: list[_Draft], n_requests: int, model: str, max_tokens: int
) -> list[TraceRequest]:
    drafts.sort(key=lambda d: d.arrival_s)
    hasher = SegmentHasher()
    out: list[TraceRequest] = []
    for d in drafts[:n_requests]:
        prompt_hashes = hasher.hashes(d.segments)
        output_hashes: tuple[int, ...] = ()
        if d.answer is not None:
            # the engine caches the answer's KV under the hashes the next turn has
            output_hashes = hasher.hashes(d.segments + (d.answer,))[len(prompt_hashes) :]
        info = RequestInfo(
            request_id=d.request_id,
            arrival_s=d.arrival_s,
            input_tokens=d.input_tokens,
            max_tokens=max_tokens,
            block_hashes=prompt_hashes,
            tenant=d.tenant,
            task_type=d.task_type,
            model=model,
            session=d.session,
            # as OpenAI asks clients to do: one cache key per conversation
            prompt_cache_key=d.session,
            deadline_s=d.deadline_s,
        )
        out.append(make_request(info, d.true_output_tokens, output_block_hashes=output_hashes))
    return out


def _sessions(
    n_requests: int,
    rng: np.random.Generator,
    session_rate_rps: float,
    warmup_s: float,
    make_session: Callable[[int, float], list[_Draft]],
) -> list[_Draft]:
    """Poisson session starts from ``-warmup_s`` on, keeping arrivals >= 0, so
    the trace is a window on a steady state rather than a ramp-up. Stops once
    no later session can rank among the first ``n_requests`` arrivals."""
    drafts: list[_Draft] = []
    t = -warmup_s
    s = 0
    cutoff = math.inf
    while True:
        if len(drafts) >= n_requests and cutoff == math.inf:
            # More sessions can only lower the n-th arrival, never raise it.
            cutoff = sorted(d.arrival_s for d in drafts)[n_requests - 1] if n_requests else 0.0
        if t > cutoff:
            break
        drafts.extend(d for d in make_session(s, t) if d.arrival_s >= 0.0)
        s += 1
        t += float(rng.exponential(1.0 / session_rate_rps))
    return drafts


# ---------------------------------------------------------------------------
def _conversation(
    rng: np.random.Generator,
    tag: str,
    message_label: str,
    seed: int,
    s: int,
    start_s: float,
    system: Segment,
    mean_turns: float,
    budget: int,
    max_context_tokens: int,
    tenant: str,
    *,
    message: Callable[[], int],
    output: Callable[[], int],
    gap: Callable[[int], float],
) -> list[_Draft]:
    """One session: turn k's prompt is the system prompt + every earlier
    (message, answer) pair + message k, and each draft carries its answer so
    the engine caches it for the next turn. Turns are geometric (mean
    ``mean_turns``); the session ends before a prompt plus the output budget
    would pass ``max_context_tokens``; ``gap(answer tokens)`` spaces the turns."""
    turns = int(rng.geometric(1.0 / mean_turns))
    segs: list[Segment] = [system]
    used = system[1]
    t = start_s
    out: list[_Draft] = []
    for k in range(turns):
        msg = message()
        true_out = output()
        if used + msg + budget > max_context_tokens:
            break
        segs.append((content_id(f"{tag}-{message_label}", seed, s, k), msg))
        used += msg
        answer = engine_output_tokens(true_out, budget)
        answer_seg = (content_id(f"{tag}-answer", seed, s, k), answer)
        out.append(
            _Draft(
                t,
                f"{tag}-{s}-{k}",
                tuple(segs),
                true_out,
                tenant,
                session=f"{tag}-{seed}-{s}",
                answer=answer_seg,
            )
        )
        segs.append(answer_seg)
        used += answer
        t += gap(answer)
    return out


@SYNTHETIC.register("chat")
def chat(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    tenant: str = "chat",
    n_system_prompts: int = 4,
    mean_turns: float = 4.0,
    think_time_s: float = 20.0,
    max_context_tokens: int = 32768,
) -> list[TraceRequest]:
    """Multi-turn chat sessions over a few shared system prompts.

    Turn k's prompt is system + (user, answer) pairs of turns 1..k-1 + user k,
    so consecutive turns share a growing prefix, and the engine caches each
    answer's KV under the hashes the next turn's prompt carries. Sessions start as a Poisson
    process at ``rate_rps / mean_turns``; turns per session are geometric with
    mean ``mean_turns``; the gap to the next turn is reading time (20 ms per
    answer token) plus an exponential think time. A session ends early when
    its next prompt plus ``max_tokens`` would exceed ``max_context_tokens``.
    """
    _check(n_requests, seed, rate_rps)
    budget = check_budget(max_tokens)
    if mean_turns < 1:
        raise ConfigError(f"mean_turns must be >= 1, got {mean_turns}")
    if n_system_prompts < 1:
        raise ConfigError(f"n_system_prompts must be >= 1, got {n_system_prompts}")
    rng = np.random.default_rng(seed)
    sys_ids = [content_id("chat-sys", seed, k) for k in range(n_system_prompts)]
    sys_lens = [int(x) for x in rng.integers(300, 2500, size=n_system_prompts)]
    weights = np.array([1.0 / (k + 1) for k in range(n_system_prompts)])
    weights /= weights.sum()

    def session(s: int, start_s: float) -> list[_Draft]:
        k_sys = int(rng.choice(n_system_prompts, p=weights))
        return _conversation(
            rng,
            "chat",
            "user",
            seed,
            s,
            start_s,
            (sys_ids[k_sys], sys_lens[k_sys]),
            mean_turns,
            budget,
            max_context_tokens,
            tenant,
            message=lambda: _lognormal_int(rng, 80, 0.8, 4, 2000),
            output=lambda: _lognormal_int(rng, 200, 0.9, 1, 4000),
            gap=lambda answer: 0.02 * answer + float(rng.exponential(think_time_s)),
        )

    warmup_s = 5 * mean_turns * (think_time_s + 0.02 * 200)
    drafts = _sessions(n_requests, rng, rate_rps / mean_turns, warmup_s, session)
    return _finish(drafts, n_requests, model, budget)


@SYNTHETIC.register("conversations")
def conversations(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    tenant: str = "chat",
    n_apps: int = 8,
    mean_turns: float = 12.0,
    burst_share: float = 0.6,
    burst_gap_s: float = 1.5,
    think_median_s: float = 30.0,
    think_sigma: float = 1.2,
    app_tokens: tuple[int, int] = (500, 4000),
    message_median_tokens: float = 150.0,
    message_sigma: float = 1.0,
    answer_median_tokens: float = 180.0,
    answer_sigma: float = 0.9,
    max_context_tokens: int = 32768,
) -> list[TraceRequest]:
    """Long multi-turn conversations whose next turns often come in bursts.

    What agents and tool-using chats send: each session belongs to one of
    ``n_apps`` applications (system prompts of 500-4000 tokens, popularity
    1/k), runs a geometric number of turns (mean ``mean_turns``), and each
    turn's prompt is the previous prompt + its answer + a new message (tool
    output or user text: lognormal, median 150 tokens), so the engine reuses
    the answer's KV. A next turn follows at once with probability
    ``burst_share`` (an exponential gap, mean ``burst_gap_s``: a tool call or
    a retry) and otherwise after a human think time (lognormal, median
    ``think_median_s``, sigma ``think_sigma``: a heavy tail of minutes).
    Many sessions share each system prompt, so routing by prompt prefix alone
    cannot tell conversations apart; each request carries its ``session``.
    ``app_tokens`` (system prompt range) and the lognormal message and answer
    medians and sigmas shape the text; docs/workloads.md gives the published
    chat statistics ``examples/scenarios/conversations.yaml`` sets them to.
    """
    _check(n_requests, seed, rate_rps)
    budget = check_budget(max_tokens)
    if mean_turns < 1 or n_apps < 1 or not 0.0 <= burst_share <= 1.0:
        raise ConfigError("need mean_turns >= 1, n_apps >= 1 and 0 <= burst_share <= 1")
    if not burst_gap_s > 0 or not think_median_s > 0 or not think_sigma >= 0:
        raise ConfigError("burst_gap_s and think_median_s must be > 0, think_sigma >= 0")
    lo_app, hi_app = (int(x) for x in app_tokens)
    if not 1 <= lo_app < hi_app:
        raise ConfigError(f"app_tokens must be (low, high) with 1 <= low < high, got {app_tokens}")
    if not (message_median_tokens >= 1 and answer_median_tokens >= 1):
        raise ConfigError("message_median_tokens and answer_median_tokens must be >= 1")
    rng = np.random.default_rng(seed)
    app_ids = [content_id("conv-app", seed, k) for k in range(n_apps)]
    app_lens = [int(x) for x in rng.integers(lo_app, hi_app, size=n_apps)]
    weights = np.array([1.0 / (k + 1) for k in range(n_apps)])
    weights /= weights.sum()

    def gap(_answer: int) -> float:
        if rng.random() < burst_share:
            return float(rng.exponential(burst_gap_s))
        return float(rng.lognormal(math.log(think_median_s), think_sigma))

    def session(s: int, start_s: float) -> list[_Draft]:
        k_app = int(rng.choice(n_apps, p=weights))
        return _conversation(
            rng,
            "conv",
            "msg",
            seed,
            s,
            start_s,
            (app_ids[k_app], app_lens[k_app]),
            mean_turns,
            budget,
            max_context_tokens,
            tenant,
            message=lambda: _lognormal_int(rng, message_median_tokens, message_sigma, 4, 8000),
            output=lambda: _lognormal_int(rng, answer_median_tokens, answer_sigma, 1, 4000),
            gap=gap,
        )

    mean_gap = burst_share * burst_gap_s + (1 - burst_share) * think_median_s * math.exp(
        think_sigma**2 / 2
    )
    drafts = _sessions(n_requests, rng, rate_rps / mean_turns, 3 * mean_turns * mean_gap, session)
    return _finish(drafts, n_requests, model, budget)


@SYNTHETIC.register("agentic")
def agentic(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    message_median_tokens: int = 1000,
    think_median_s: float = 120.0,
    **options: Any,
) -> list[TraceRequest]:
    """``conversations`` with tool outputs of about 1,000 tokens per turn and
    humans who think for minutes.

    Why: the load scaling ignores prefix reuse, so ``conversations`` (94% of
    prompt tokens cached) at load 0.8-0.9 leaves the engines' prefill mostly
    idle and nothing to herd onto. Here each turn adds ~1k uncached tokens,
    contexts reach 10-30k tokens and thousands of sessions wait between turns,
    so the pool's KV is under pressure and prefill queues form, as on the
    held-out multi-turn trace of issue #21.
    """
    return conversations(
        n_requests,
        seed,
        rate_rps,
        message_median_tokens=message_median_tokens,
        think_median_s=think_median_s,
        **options,
    )


@SYNTHETIC.register("longdoc")
def longdoc(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    tenant: str = "docs",
    min_doc_tokens: int = 8192,
    max_doc_tokens: int = 65536,
    min_questions: int = 2,
    max_questions: int = 6,
    question_gap_s: float = 30.0,
) -> list[TraceRequest]:
    """Long documents, each queried several times with short questions.

    Prompt = shared instruction (128 tokens) + document + question. Document
    lengths are log-uniform in [min_doc_tokens, max_doc_tokens]; each document
    gets a uniform number of questions in [min_questions, max_questions],
    spaced by exponential gaps; documents arrive as a Poisson process.
    """
    _check(n_requests, seed, rate_rps)
    budget = check_budget(max_tokens)
    if not 1 <= min_doc_tokens <= max_doc_tokens:
        raise ConfigError("need 1 <= min_doc_tokens <= max_doc_tokens")
    if not 1 <= min_questions <= max_questions:
        raise ConfigError("need 1 <= min_questions <= max_questions")
    rng = np.random.default_rng(seed)
    instr = (content_id("doc-instr", seed), 128)
    mean_q = (min_questions + max_questions) / 2

    def session(s: int, start_s: float) -> list[_Draft]:
        doc_len = int(
            round(math.exp(rng.uniform(math.log(min_doc_tokens), math.log(max_doc_tokens))))
        )
        doc = (content_id("doc-body", seed, s), doc_len)
        n_q = int(rng.integers(min_questions, max_questions + 1))
        t = start_s
        out: list[_Draft] = []
        for q in range(n_q):
            question = (
                content_id("doc-question", seed, s, q),
                _lognormal_int(rng, 60, 0.6, 8, 400),
            )
            true_out = _lognormal_int(rng, 150, 0.8, 1, 2000)
            out.append(
                _Draft(
                    t,
                    f"doc-{s}-{q}",
                    (instr, doc, question),
                    true_out,
                    tenant,
                    session=f"doc-{seed}-{s}",
                )
            )
            t += float(rng.exponential(question_gap_s))
        return out

    drafts = _sessions(n_requests, rng, rate_rps / mean_q, 5 * mean_q * question_gap_s, session)
    return _finish(drafts, n_requests, model, budget)


def _burst_drafts(
    n_requests: int,
    seed: int,
    rate_rps: float,
    rng: np.random.Generator,
    *,
    tenant: str,
    on_s: float,
    off_s: float,
    task_type: str,
    deadline_slack_s: float | None,
    prefix: str,
) -> list[_Draft]:
    if not on_s > 0 or not off_s >= 0:
        raise ConfigError("need on_s > 0 and off_s >= 0")
    on_rate = rate_rps * (on_s + off_s) / on_s
    sys_ids = [(content_id(prefix + "-sys", seed, k), 200 + 300 * k) for k in range(2)]
    drafts: list[_Draft] = []
    t = 0.0
    if off_s > 0 and rng.random() >= on_s / (on_s + off_s):
        t = float(rng.exponential(off_s))  # start in a random phase, maybe off
    while len(drafts) < n_requests:
        end = t + float(rng.exponential(on_s))
        a = t + float(rng.exponential(1.0 / on_rate))
        while a < end and len(drafts) < n_requests:
            i = len(drafts)
            body = (content_id(prefix + "-body", seed, i), _lognormal_int(rng, 600, 1.0, 16, 16000))
            segs = (sys_ids[int(rng.integers(0, 2))], body)
            true_out = _lognormal_int(rng, 150, 0.9, 1, 4000)
            deadline = None if deadline_slack_s is None else a + deadline_slack_s
            drafts.append(
                _Draft(
                    a,
                    f"{prefix}-{i}",
                    segs,
                    true_out,
                    tenant,
                    task_type=task_type,
                    deadline_s=deadline,
                )
            )
            a += float(rng.exponential(1.0 / on_rate))
        t = end + (float(rng.exponential(off_s)) if off_s > 0 else 0.0)
    return drafts


@SYNTHETIC.register("burst")
def burst(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    tenant: str = "burst",
    on_s: float = 5.0,
    off_s: float = 15.0,
    task_type: str = "chat",
    deadline_slack_s: float | None = None,
) -> list[TraceRequest]:
    """On/off arrivals: exponential on and off periods (means ``on_s``,
    ``off_s``); Poisson at ``rate_rps * (on_s + off_s) / on_s`` while on,
    silent while off, so the long-run mean rate is ``rate_rps``."""
    _check(n_requests, seed, rate_rps)
    budget = check_budget(max_tokens)
    rng = np.random.default_rng(seed)
    drafts = _burst_drafts(
        n_requests,
        seed,
        rate_rps,
        rng,
        tenant=tenant,
        on_s=on_s,
        off_s=off_s,
        task_type=task_type,
        deadline_slack_s=deadline_slack_s,
        prefix="burst",
    )
    return _finish(drafts, n_requests, model, budget)


@SYNTHETIC.register("mixed")
def mixed(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    chat_share: float = 0.6,
    longdoc_share: float = 0.15,
    batch_deadline_s: float = 600.0,
) -> list[TraceRequest]:
    """Chat + long documents + bursts of batch jobs, interleaved.

    Each part gets its share of ``n_requests`` and of ``rate_rps`` and its own
    seed derived from ``seed``; the burst part is ``task_type="batch"`` with a
    deadline ``batch_deadline_s`` after arrival (tenant "batch").
    """
    _check(n_requests, seed, rate_rps)
    burst_share = 1.0 - chat_share - longdoc_share
    if chat_share <= 0 or longdoc_share <= 0 or burst_share <= 0:
        raise ConfigError(
            "chat_share and longdoc_share must be > 0 and sum to < 1 "
            "(the rest is the batch burst share)"
        )
    seeds = [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(3)]
    n_chat = round(n_requests * chat_share)
    n_doc = round(n_requests * longdoc_share)
    n_burst = n_requests - n_chat - n_doc
    parts = (
        chat(n_chat, seeds[0], rate_rps * chat_share, model=model, max_tokens=max_tokens),
        longdoc(n_doc, seeds[1], rate_rps * longdoc_share, model=model, max_tokens=max_tokens),
        burst(
            n_burst,
            seeds[2],
            rate_rps * burst_share,
            model=model,
            max_tokens=max_tokens,
            tenant="batch",
            task_type="batch",
            deadline_slack_s=batch_deadline_s,
        ),
    )
    out = [r for part in parts for r in part]
    out.sort(key=lambda r: r.info.arrival_s)
    return out


def generate(
    name: str, n_requests: int, seed: int, rate_rps: float, **options: object
) -> list[TraceRequest]:
    """Run a registered generator by name."""
    return SYNTHETIC.get(name)(n_requests, seed, rate_rps, **options)


# Generators in modules of their own register on import.
from tokenfleet.workloads import code_completion as _code_completion  # noqa: E402, F401
