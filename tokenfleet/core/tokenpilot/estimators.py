"""Cost estimators for TokenPilot: seconds of prefill, decode interference,
output-length quantiles and online ratio correction.

All of them start from configuration an operator really has (the engine
profile) and learn only from what a live router observes (first tokens and
completions); none of them ever sees a request's true output length.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenfleet.core.types import RequestInfo
    from tokenfleet.engine.profiles import EngineProfile


class PrefillModel:
    """Closed-form prefill time of ``u`` uncached tokens after ``c`` cached ones.

    vLLM prefills in chunks of ``max_num_batched_tokens``; in the compute-bound
    regime a chunk costs ``overhead + a*q + b*pairs`` where ``pairs`` are the
    query-key pairs attended. Summed over chunks, the pairs telescope to
    ``u*c + u*(u+1)/2``, so the whole prefill is O(1) to evaluate instead of
    one roofline call per chunk (which would break the decision-cost budget).
    The three coefficients are fitted once from ``profile.step_time_s``.
    """

    __slots__ = ("chunk_tokens", "overhead_s", "per_token_s", "per_pair_s", "floor_step_s")

    def __init__(self, profile: EngineProfile) -> None:
        c = max(2, int(profile.max_num_batched_tokens))
        half = c // 2
        ctx = 4 * c
        p_full = c * (c + 1) / 2
        p_half = half * (half + 1) / 2
        t_full = profile.step_time_s(c, p_full, 0, 0, 0)
        t_ctx = profile.step_time_s(c, p_full + c * ctx, ctx, 0, 0)
        t_half = profile.step_time_s(half, p_half, 0, 0, 0)
        b = max(0.0, (t_ctx - t_full) / (c * ctx))
        x_full = t_full - b * p_full  # = overhead + a*c
        x_half = t_half - b * p_half  # = overhead + a*half
        a = (x_full - x_half) / (c - half)
        overhead = x_full - a * c
        if a <= 0.0 or overhead < 0.0:
            # Probes fell in the memory-bound regime: fall back to a pure rate.
            overhead, a = 0.0, x_full / c
        self.chunk_tokens = c
        self.overhead_s = overhead
        self.per_token_s = a
        self.per_pair_s = b
        self.floor_step_s = profile.step_time_s(1, 1.0, 0, 0, 0)

    def seconds(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Prefill time alone on an idle engine (the roofline, chunk by chunk)."""
        u = uncached_tokens if uncached_tokens > 0 else 1  # vLLM recomputes >= 1 token
        steps = -(-u // self.chunk_tokens)
        t = (
            steps * self.overhead_s
            + self.per_token_s * u
            + self.per_pair_s * (u * cached_tokens + u * (u + 1) * 0.5)
        )
        floor = steps * self.floor_step_s
        return t if t > floor else floor


class StepInflation:
    """How much running decodes slow a prefill down, from the profile.

    Decodes ride in the same batch as prefill chunks (chunked prefill), so
    each chunk step grows by the decode tokens and their KV reads. The factor
    is ``step(chunk + D decodes) / step(chunk)``; we add half a decode-only
    step for the step already in flight when the request arrives. Memoised on
    (D, context bucket) because the roofline call is the expensive part.
    """

    __slots__ = ("_profile", "_chunk", "_pairs", "_base_s", "_memo")

    CTX_BUCKET_TOKENS = 2048

    def __init__(self, profile: EngineProfile) -> None:
        self._profile = profile
        self._chunk = max(1, int(profile.max_num_batched_tokens))
        self._pairs = self._chunk * (self._chunk + 1) / 2
        self._base_s = profile.step_time_s(self._chunk, self._pairs, 0, 0, 0)
        self._memo: dict[tuple[int, int], tuple[float, float]] = {}

    def get(self, decode_seqs: int, mean_ctx_tokens: float) -> tuple[float, float]:
        """Return (multiplicative factor, additive wait in seconds)."""
        if decode_seqs <= 0:
            return 1.0, 0.0
        bucket = int(mean_ctx_tokens) // self.CTX_BUCKET_TOKENS
        key = (decode_seqs, bucket)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        ctx = (bucket + 0.5) * self.CTX_BUCKET_TOKENS
        p = self._profile
        with_decodes = p.step_time_s(
            self._chunk, self._pairs, 0, decode_seqs, int(decode_seqs * ctx)
        )
        factor = with_decodes / self._base_s if self._base_s > 0 else 1.0
        wait = 0.5 * p.decode_step_time_s(decode_seqs, ctx)
        out = (max(1.0, factor), wait)
        if len(self._memo) < 65536:
            self._memo[key] = out
        return out


class OutputLengthModel:
    """Online output-length quantiles per (tenant, task type), never the truth.

    Log-spaced histogram (4 buckets per octave) with exponential forgetting,
    so it follows drifting traffic. Forgetting is done by giving each new
    sample a growing weight (O(1) per update) and rescaling rarely. Keys fall
    back to the task type and then to the whole stream until they have
    ``min_samples`` completions.
    """

    BUCKETS_PER_OCTAVE = 4
    N_BUCKETS = 4 * 21  # up to ~2M tokens

    def __init__(
        self, prior_tokens: int = 256, min_samples: int = 20, decay: float = 0.998
    ) -> None:
        self.prior_tokens = prior_tokens
        self.min_samples = min_samples
        self.decay = decay
        self._hist: dict[tuple[str, str], list[float]] = {}
        self._weight: dict[tuple[str, str], float] = {}
        self._count: dict[tuple[str, str], int] = {}
        self._cache: dict[tuple[str, str], tuple[int, int]] = {}

    @classmethod
    def _bucket(cls, tokens: int) -> int:
        b = int(cls.BUCKETS_PER_OCTAVE * math.log2(tokens + 1))
        return b if b < cls.N_BUCKETS else cls.N_BUCKETS - 1

    @classmethod
    def _upper(cls, bucket: int) -> int:
        return max(1, int(round(2 ** ((bucket + 1) / cls.BUCKETS_PER_OCTAVE) - 1)))

    def observe(self, tenant: str, task_type: str, output_tokens: int) -> None:
        if output_tokens < 0:
            return
        b = self._bucket(output_tokens)
        for key in ((tenant, task_type), ("*", task_type), ("*", "*")):
            hist = self._hist.get(key)
            if hist is None:
                hist = self._hist[key] = [0.0] * self.N_BUCKETS
                self._weight[key] = 1.0
                self._count[key] = 0
            w = self._weight[key] / self.decay
            if w > 1e12:
                hist[:] = [x / w for x in hist]
                w = 1.0
            hist[b] += w
            self._weight[key] = w
            self._count[key] += 1
            self._cache.pop(key, None)

    def quantiles(self, tenant: str, task_type: str) -> tuple[int, int] | None:
        """(p50, p90) of observed output tokens, or None before enough data."""
        for key in ((tenant, task_type), ("*", task_type), ("*", "*")):
            if self._count.get(key, 0) >= self.min_samples:
                cached = self._cache.get(key)
                if cached is None:
                    cached = self._cache[key] = self._compute(self._hist[key])
                return cached
        return None

    def _compute(self, hist: list[float]) -> tuple[int, int]:
        total = sum(hist)
        acc = 0.0
        p50 = -1
        for i, x in enumerate(hist):
            acc += x
            if p50 < 0 and acc >= 0.5 * total:
                p50 = self._upper(i)
            if acc >= 0.9 * total:
                return p50, self._upper(i)
        top = self._upper(self.N_BUCKETS - 1)
        return (p50 if p50 > 0 else top), top

    def estimate(self, request: RequestInfo) -> tuple[int, int]:
        """(typical, reserved) output tokens, both capped by the budget."""
        q = self.quantiles(request.tenant, request.task_type)
        budget = request.max_tokens if request.max_tokens > 0 else self.prior_tokens
        if q is None:
            typical = reserved = min(budget, self.prior_tokens)
        else:
            typical, reserved = min(budget, q[0]), min(budget, q[1])
        return typical, reserved


class LogRatioCorrector:
    """Multiplicative correction ``kappa`` learned from actual/expected ratios.

    Samples are *estimates of kappa itself* (observed / uncorrected
    prediction), so in-flight predictions made with an older kappa cannot
    make it overshoot. The first ``warmup`` samples are averaged in log space
    (a badly wrong profile is fixed within a few requests); after that kappa
    tracks the *median* sample with steps of at most ``step`` in log space,
    because some observations are polluted by queueing we could not see
    (other router replicas) and those errors are one-sided.
    """

    __slots__ = ("value", "step", "warmup", "lo", "hi", "samples")

    def __init__(
        self,
        value: float = 1.0,
        step: float = 0.02,
        warmup: int = 8,
        lo: float = 0.05,
        hi: float = 20.0,
    ) -> None:
        self.value = value
        self.step = step
        self.warmup = warmup
        self.lo = lo
        self.hi = hi
        self.samples = 0

    def update(self, kappa_sample: float) -> None:
        if not kappa_sample > 0.0 or not math.isfinite(kappa_sample):
            return
        s = min(self.hi, max(self.lo, kappa_sample))
        d = math.log(s) - math.log(self.value)
        if self.samples < self.warmup:
            d /= self.samples + 2
        elif d > self.step:
            d = self.step
        elif d < -self.step:
            d = -self.step
        self.value = min(self.hi, max(self.lo, self.value * math.exp(d)))
        self.samples += 1
