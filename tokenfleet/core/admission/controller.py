"""Goodput feedback controller: per-tier outcomes in, capacity shares out.

Every control period (5 s by default) the driver hands over one
``WindowStats`` (per-tier attainment, first-token attainment, rejections,
cancellations, duplicates, batch progress) and gets back the knobs SLOMax
uses until the next period:

``batch_share``
    how much of each instance batch work may fill (seats and prefill budget);
    batch is the first to yield when a protected tier misses its target.
``long_share``
    the fraction of instances in the long-context lane (the only instances
    that run long prefills); the rest stay free of multi-second prefills so
    interactive TTFT and TPOT hold. It is feedforward plus feedback: the
    long-context share of the prefill work dispatched (smoothed), plus a
    damped trim that grows when long-context requests wait for lane slots
    and shrinks when interactive misses its target.
``reject_factor``
    a long-context request is rejected at arrival when its predicted TTFT
    exceeds ``reject_factor`` x its limit.

Why AIMD with damping and a dead band: the plant (attainment as a function
of shares) is steep near saturation, so a plain AIMD settles into a sawtooth.
Here each knob holds still while the signal sits inside its hysteresis band,
and every direction reversal shrinks that knob's step (``damping``), so any
oscillation decays geometrically; a run of moves in one direction regrows
the step, so the controller still tracks a genuine load change.

The object is pure (``update(window, now_s)``, no clock, no I/O) and its
state round-trips through ``state_dict``/``load_state``, so the live
service can run the very same code from a Celery beat task, persisting the
state between ticks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenfleet.core.admission.base import WindowStats


@dataclass(frozen=True, slots=True)
class ControlState:
    batch_share: float
    long_share: float
    reject_factor: float
    #: ``long_share`` comes from a measured work mix (a window saw prefill
    #: work); until then the admission sizes the lane from its own arrivals
    lane_measured: bool = False

    def as_dict(self) -> dict[str, float]:
        return {
            "batch_share": self.batch_share,
            "long_share": self.long_share,
            "reject_factor": self.reject_factor,
            "lane_measured": float(self.lane_measured),
        }


@dataclass(slots=True)
class _Knob:
    """One damped AIMD actuator."""

    value: float
    lo: float
    hi: float
    step: float  # additive step (also the multiplicative decrease fraction scale)
    min_step: float
    max_step: float
    last_dir: int = 0
    run: int = 0

    def move(self, direction: int, damping: float, regrow_after: int, multiplicative: bool) -> None:
        if direction == 0:
            return
        if self.last_dir and direction != self.last_dir:
            self.step = max(self.min_step, self.step * damping)
            self.run = 0
        else:
            self.run += 1
            if self.run >= regrow_after:
                self.step = min(self.max_step, self.step * 1.5)
        self.last_dir = direction
        if direction > 0:
            self.value += self.step
        elif multiplicative:
            # Decrease proportionally, at least by one step (AIMD's MD, damped).
            self.value -= max(self.step, self.value * min(0.5, 2 * self.step))
        else:
            self.value -= self.step
        self.value = min(self.hi, max(self.lo, self.value))


@dataclass
class ControllerConfig:
    period_s: float = 5.0
    #: attainment targets for the protected tiers
    targets: Mapping[str, float] = field(
        default_factory=lambda: {"interactive": 0.97, "long_context": 0.95}
    )
    #: hysteresis: act below target - band or above target + band/2 only
    band: float = 0.02
    #: below this, protect even at the cost of a batch deadline
    hard_floor: float = 0.90
    min_samples: int = 8
    smoothing: float = 0.5  # EWMA weight of the newest window
    damping: float = 0.5
    regrow_after: int = 3
    batch_share: float = 0.5
    batch_share_bounds: tuple[float, float] = (0.05, 1.0)
    batch_step: float = 0.1
    long_share: float = 0.5  # used until prefill work has been observed
    long_share_bounds: tuple[float, float] = (0.125, 0.875)
    long_trim: float = 0.1  # initial feedback trim on top of the work share
    long_trim_bounds: tuple[float, float] = (-0.25, 0.375)
    long_step: float = 0.0625
    reject_factor: float = 1.0
    reject_factor_bounds: tuple[float, float] = (0.8, 2.0)
    reject_step: float = 0.1
    #: batch must be done this long before its deadline (covers its own e2e)
    deadline_margin_s: float = 30.0
    #: batch counts as behind schedule below this ratio of achieved/required rate
    pace_slack: float = 1.2


class SLOMaxController:
    """Damped AIMD over (batch_share, long_share, reject_factor)."""

    def __init__(self, config: ControllerConfig | None = None) -> None:
        self.cfg = c = config or ControllerConfig()
        if c.period_s <= 0:
            raise ValueError("period_s must be > 0")
        self.batch = _Knob(
            c.batch_share,
            *c.batch_share_bounds,
            step=c.batch_step,
            min_step=c.batch_step / 16,
            max_step=c.batch_step * 2,
        )
        self.long = _Knob(
            c.long_trim,
            *c.long_trim_bounds,
            step=c.long_step,
            min_step=c.long_step / 8,
            max_step=c.long_step * 2,
        )
        self.long_work: float | None = None  # smoothed long-context share of prefill work
        self.reject = _Knob(
            c.reject_factor,
            *c.reject_factor_bounds,
            step=c.reject_step,
            min_step=c.reject_step / 8,
            max_step=c.reject_step * 2,
        )
        self.att: dict[str, float] = {}  # smoothed attainment per protected tier
        self.batch_rate: float | None = None  # smoothed batch completions per second
        self.last_reason = ""

    @property
    def long_share(self) -> float:
        c = self.cfg
        base = c.long_share - c.long_trim if self.long_work is None else self.long_work
        return self._trimmed(base)

    def _trimmed(self, work_share: float) -> float:
        """The lane share for a work mix: feedforward plus trim, within bounds."""
        lo, hi = self.cfg.long_share_bounds
        return min(hi, max(lo, work_share + self.long.value))

    def share_from_mix(self, lane_tokens: int, interactive_tokens: int) -> float:
        """The lane share the first window would set for this work mix (its
        feedforward plus the current trim), for the admission to use before
        any window has measured one."""
        total = lane_tokens + interactive_tokens
        if total <= 0:
            return self.long_share
        return self._trimmed(lane_tokens / total)

    @property
    def state(self) -> ControlState:
        return ControlState(
            self.batch.value, self.long_share, self.reject.value, self.long_work is not None
        )

    # -- the control law -----------------------------------------------------------
    def update(self, window: WindowStats, now_s: float) -> ControlState:
        c = self.cfg
        a = c.smoothing
        for tier in c.targets:
            w = window.tiers.get(tier)
            if w is None or w.finished < c.min_samples:
                continue
            sig = w.attainment if w.attainment is not None else 1.0
            if w.ttft_attainment is not None and w.first_tokens >= c.min_samples:
                sig = min(sig, w.ttft_attainment)
            old = self.att.get(tier)
            self.att[tier] = sig if old is None else a * sig + (1 - a) * old
        gaps = {t: self.att[t] - c.targets[t] for t in c.targets if t in self.att}
        worst = min(gaps.values(), default=0.0)
        # the hard floor that outranks a batch deadline protects interactive
        floor_att = self.att.get("interactive", min(self.att.values(), default=1.0))

        # Batch deadline pacing.
        period = max(window.period_s, 1e-9)
        rate = window.batch_finished / period
        self.batch_rate = rate if self.batch_rate is None else a * rate + (1 - a) * self.batch_rate
        behind = False
        if window.batch_remaining > 0 and window.batch_deadline_s is not None:
            left_s = window.batch_deadline_s - now_s - c.deadline_margin_s
            need = window.batch_remaining / left_s if left_s > 0 else math.inf
            behind = self.batch_rate * c.pace_slack < need
        backlog = window.batch_remaining > 0

        reasons = []
        # 1) batch share: first to yield, first to grow back.
        if worst < -c.band and not (behind and floor_att >= c.hard_floor):
            self.batch.move(-1, c.damping, c.regrow_after, multiplicative=True)
            reasons.append("batch-")
        elif backlog and (behind or worst > c.band / 2):
            self.batch.move(+1, c.damping, c.regrow_after, multiplicative=True)
            reasons.append("batch+")

        # 2) long-context lane: feedforward from the work mix (long-context and
        #    long batch prompts vs interactive prefill), trimmed by feedback.
        wi = window.tiers.get("interactive")
        lw = window.tiers.get("long_context")
        # Batch lane demand is what the deadline requires, not what was let
        # through (that would shrink the lane whenever batch was held back).
        batch_need = window.batch_long_tokens
        if window.batch_long_queued_tokens and window.batch_deadline_s is not None:
            left_s = max(period, window.batch_deadline_s - now_s - c.deadline_margin_s)
            batch_need = max(batch_need, int(window.batch_long_queued_tokens * period / left_s))
        lane_work = (lw.prefill_tokens if lw is not None else 0) + batch_need
        int_work = wi.prefill_tokens if wi is not None else 0
        if lane_work + int_work > 0:
            frac = lane_work / (lane_work + int_work)
            self.long_work = frac if self.long_work is None else a * frac + (1 - a) * self.long_work
        g_int = gaps.get("interactive")
        short_of_slots = lw is not None and (
            lw.queued > 0 or lw.rejected > max(1.0, c.band * max(1, lw.finished))
        )
        if g_int is not None and g_int < -c.band:
            self.long.move(-1, c.damping, c.regrow_after, multiplicative=False)
            reasons.append("long-")
        elif short_of_slots and (g_int is None or g_int > c.band / 2):
            self.long.move(+1, c.damping, c.regrow_after, multiplicative=False)
            reasons.append("long+")

        # 3) long-context reject threshold: reject earlier while admitted work
        #    finishes late; admit more while rejections are the main miss.
        w = window.tiers.get("long_context")
        if w is not None and w.finished >= c.min_samples:
            late = w.completed - w.met
            if late > max(w.rejected, c.band * w.finished):
                self.reject.move(-1, c.damping, c.regrow_after, multiplicative=False)
                reasons.append("reject-")
            elif w.rejected > max(2 * late, c.band * w.finished):
                self.reject.move(+1, c.damping, c.regrow_after, multiplicative=False)
                reasons.append("reject+")
        self.last_reason = ",".join(reasons) or "hold"
        return self.state

    # -- persistence for the live beat task -----------------------------------------
    def state_dict(self) -> dict[str, Any]:
        def knob(k: _Knob) -> dict[str, float]:
            return {"value": k.value, "step": k.step, "last_dir": k.last_dir, "run": k.run}

        return {
            "batch": knob(self.batch),
            "long": knob(self.long),
            "reject": knob(self.reject),
            "att": dict(self.att),
            "batch_rate": self.batch_rate,
            "long_work": self.long_work,
        }

    def load_state(self, data: Mapping[str, Any]) -> None:
        for name in ("batch", "long", "reject"):
            k: _Knob = getattr(self, name)
            d = data[name]
            k.value = min(k.hi, max(k.lo, float(d["value"])))
            k.step = float(d["step"])
            k.last_dir = int(d["last_dir"])
            k.run = int(d["run"])
        self.att = {str(t): float(v) for t, v in data.get("att", {}).items()}
        br = data.get("batch_rate")
        self.batch_rate = None if br is None else float(br)
        lw = data.get("long_work")
        self.long_work = None if lw is None else float(lw)
