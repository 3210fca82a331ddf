"""Server-side SVG charts for the admin UI: no JavaScript library, no CDN.

A chart is a small, self-contained ``<svg>`` string: multi-series line
charts with a y-axis, a few ticks, and a legend. Values of ``None`` break the
line (no data in that interval). Labels are escaped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from html import escape

from markupsafe import Markup

#: colour per series name, stable across charts (tiers first)
PALETTE = {"interactive": "#2563eb", "long_context": "#d97706", "batch": "#059669"}
_FALLBACK = ("#7c3aed", "#dc2626", "#0891b2", "#4b5563")

Point = tuple[float, "float | None"]


def _color(name: str, i: int) -> str:
    return PALETTE.get(name, _FALLBACK[i % len(_FALLBACK)])


def _nice_max(v: float) -> float:
    if v <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(v))
    for m in (1, 2, 2.5, 5, 10):
        if v <= m * exp:
            return m * exp
    return 10 * exp


def _fmt(v: float) -> str:
    if v >= 100:
        return f"{v:.0f}"
    if v >= 1:
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return f"{v:.2f}".rstrip("0").rstrip(".") or "0"


def line_chart(
    series: Mapping[str, Sequence[Point]],
    *,
    title: str,
    unit: str = "",
    y_max: float | None = None,
    width: int = 460,
    height: int = 180,
    chart_id: str = "",
) -> Markup:
    """An SVG line chart of ``{name: [(unix time, value or None), ...]}``."""
    left, right, top, bottom = 44, 10, 26, 34
    pw, ph = width - left - right, height - top - bottom
    xs = [t for pts in series.values() for t, _ in pts]
    ys = [v for pts in series.values() for _, v in pts if v is not None]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
        f'id="{escape(chart_id)}" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" aria-label="{escape(title)}">',
        f'<text x="{left}" y="16" class="chart-title">{escape(title)}'
        f"{(' (' + escape(unit) + ')') if unit else ''}</text>",
    ]
    if not xs or not ys:
        parts.append(
            f'<text x="{left + pw / 2}" y="{top + ph / 2}" text-anchor="middle" '
            f'class="chart-empty">no data yet</text></svg>'
        )
        return Markup("".join(parts))
    x0, x1 = min(xs), max(xs)
    if x1 <= x0:
        x1 = x0 + 1
    top_v = y_max if y_max is not None else _nice_max(max(ys))

    def px(t: float) -> float:
        return left + (t - x0) / (x1 - x0) * pw

    def py(v: float) -> float:
        return top + ph - min(max(v, 0.0), top_v) / top_v * ph

    for k in range(5):
        v = top_v * k / 4
        y = py(v)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" '
            f'class="grid"/><text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" '
            f'class="tick">{_fmt(v)}</text>'
        )
    for t in (x0, (x0 + x1) / 2, x1):
        label = datetime.fromtimestamp(t, UTC).strftime("%H:%M")
        parts.append(
            f'<text x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="middle" '
            f'class="tick">{label}</text>'
        )
    lx = left
    for i, (name, pts) in enumerate(series.items()):
        color = _color(name, i)
        runs: list[list[str]] = [[]]
        for t, val in sorted(pts):
            if val is None:
                runs.append([])
                continue
            runs[-1].append(f"{px(t):.1f},{py(val):.1f}")
        for run in runs:
            if len(run) == 1:
                cx, cy = run[0].split(",")
                parts.append(f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>')
            elif run:
                parts.append(
                    f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                    f'points="{" ".join(run)}"/>'
                )
        parts.append(
            f'<rect x="{lx}" y="{height - 12}" width="10" height="4" fill="{color}"/>'
            f'<text x="{lx + 14}" y="{height - 7}" class="legend">{escape(name)}</text>'
        )
        lx += 22 + 7 * len(name)
    parts.append("</svg>")
    return Markup("".join(parts))


def share_bars(shares: dict[str, float], *, width: int = 460) -> Markup:
    """Horizontal bars of the current tier shares (0..1)."""
    row = 22
    height = 8 + row * max(1, len(shares))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="tier-shares" '
        f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="tier shares">'
    ]
    for i, (tier, share) in enumerate(sorted(shares.items())):
        y = 4 + i * row
        w = max(0.0, min(1.0, share)) * (width - 190)
        parts.append(
            f'<text x="0" y="{y + 14}" class="tick">{escape(tier)}</text>'
            f'<rect x="110" y="{y + 3}" width="{w:.1f}" height="14" '
            f'fill="{_color(tier, i)}"/>'
            f'<text x="{116 + w:.1f}" y="{y + 14}" class="tick">{share:.0%}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))
