"""Code-completion traffic: prompts of a few thousand tokens, answers of a few dozen.

Medians from the public Azure LLM inference trace 2023, *code* service
(Azure/AzurePublicDataset, ``data/AzureLLMInferenceTrace_code.csv``,
described in ``AzureLLMInferenceDataset2023.md``), as characterised in
Patel et al., "Splitwise: Efficient generative LLM inference using phase
splitting", ISCA 2024 (arXiv:2311.18677): coding prompts have a median of
1,500 tokens and outputs a median of 13 tokens (the service completes the
next few words or lines), conversation 1,020 and 129. Not from the
source: the sigmas, 0.6 (prompt) and 1.0 (output), are our choice for a
long right tail, and the cut at 8,000 tokens keeps every prompt in the
interactive tier. The trace itself is not in ../shared/traces, so this is a
lognormal stand-in with those medians; ``prompt_median_tokens`` lets a
scenario move the prompts (issue #22's held-out mix has prompts of a few
thousand tokens). Every prompt starts with one of a few IDE-plugin
instruction headers (shared blocks, as a real plugin's fixed preamble is);
the file context after it is unique. Arrivals are Poisson (completions fire
on keystroke pauses of many users).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tokenfleet.workloads.common import DEFAULT_MAX_TOKENS, check_budget
from tokenfleet.workloads.hashing import content_id
from tokenfleet.workloads.synthetic import (
    SYNTHETIC,
    _check,
    _Draft,
    _finish,
    _lognormal_int,
)
from tokenfleet.workloads.trace import TraceRequest


@SYNTHETIC.register("code_completion")
def code_completion(
    n_requests: int,
    seed: int,
    rate_rps: float,
    *,
    model: str = "default",
    max_tokens: int = DEFAULT_MAX_TOKENS["synthetic"],
    tenant: str = "code",
    prompt_median_tokens: float = 1500.0,
    prompt_sigma: float = 0.6,
    max_prompt_tokens: int = 8000,
    output_median_tokens: float = 13.0,
    output_sigma: float = 1.0,
    n_headers: int = 3,
    header_tokens: int = 256,
    **_unused: Any,
) -> list[TraceRequest]:
    """``n_requests`` Poisson arrivals at ``rate_rps``; lengths as the module says."""
    _check(n_requests, seed, rate_rps)
    budget = check_budget(max_tokens)
    rng = np.random.default_rng(seed)
    headers = [(content_id("code-header", seed, k), header_tokens) for k in range(n_headers)]
    drafts: list[_Draft] = []
    t = 0.0
    for i in range(n_requests):
        t += float(rng.exponential(1.0 / rate_rps))
        prompt = _lognormal_int(
            rng, prompt_median_tokens, prompt_sigma, header_tokens + 16, max_prompt_tokens
        )
        header = headers[int(rng.integers(0, n_headers))]
        body = (content_id("code-body", seed, i), prompt - header_tokens)
        out = _lognormal_int(rng, output_median_tokens, output_sigma, 1, budget)
        drafts.append(_Draft(t, f"code-{i}", (header, body), out, tenant, task_type="completion"))
    return _finish(drafts, n_requests, model, budget)
