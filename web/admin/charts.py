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


#: legend and drawing order: the tiers in priority order, then other names by name
ORDER = {"interactive": 0, "long_context": 1, "batch": 2}


def _ordered(names: Sequence[str]) -> list[str]:
    return sorted(names, key=lambda n: (ORDER.get(n, len(ORDER)), n))


def nice_ticks(v_max: float, target: int = 4) -> list[float]:
    """0 .. top in steps of 1, 2 or 5 x 10^k (never 1.25 or 3.75), about ``target``
    steps, top >= ``v_max``."""
    if v_max <= 0:
        return [0.0, 1.0, 2.0, 3.0, 4.0]
    raw = v_max / target
    exp = 10.0 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1, 2, 5, 10) if raw <= m * exp * (1 + 1e-9))
    n = math.ceil(v_max / step - 1e-9)
    return [round(k * step, 10) for k in range(n + 1)]


def _fmt(v: float) -> str:
    if v >= 10_000:
        return f"{v / 1000:.0f}k"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.3f}".rstrip("0").rstrip(".") or "0"


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
    """An SVG line chart of ``{name: [(unix time, value or None), ...]}``.

    The SVG scales to its container (``viewBox``, CSS ``width: 100%``), so a phone
    shows it whole; the first and last time labels are anchored inside the plot;
    the legend lists tiers in priority order on every chart and wraps.
    """
    series = {n: series[n] for n in _ordered(list(series))}
    left, right, top, bottom = 44, 12, 26, 34
    legend_rows = _legend_rows(list(series), width - left)
    height += 14 * (len(legend_rows) - 1)
    pw, ph = width - left - right, height - top - bottom
    xs = [t for pts in series.values() for t, _ in pts]
    ys = [v for pts in series.values() for _, v in pts if v is not None]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" role="img" '
        f'id="{escape(chart_id)}" viewBox="0 0 {width} {height}" '
        f'preserveAspectRatio="xMinYMin meet" aria-label="{escape(title)}">',
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
    ticks = [y_max * k / 4 for k in range(5)] if y_max is not None else nice_ticks(max(ys))
    top_v = ticks[-1]

    def px(t: float) -> float:
        return left + (t - x0) / (x1 - x0) * pw

    def py(v: float) -> float:
        return top + ph - min(max(v, 0.0), top_v) / top_v * ph

    for v in ticks:
        y = py(v)
        parts.append(
            f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" '
            f'class="grid"/><text x="{left - 4}" y="{y + 3:.1f}" text-anchor="end" '
            f'class="tick ytick">{_fmt(v)}</text>'
        )
    fmt = "%H:%M" if x1 - x0 >= 600 else "%H:%M:%S"  # short spans: three distinct labels
    shown: set[str] = set()
    for t, anchor in ((x0, "start"), ((x0 + x1) / 2, "middle"), (x1, "end")):
        label = datetime.fromtimestamp(t, UTC).strftime(fmt)
        if label in shown:
            continue
        shown.add(label)
        parts.append(
            f'<text x="{px(t):.1f}" y="{top + ph + 14}" text-anchor="{anchor}" '
            f'class="tick">{label}</text>'
        )
    where = {name: (row, x) for row, names in enumerate(legend_rows) for name, x in names}
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
        row, lx = where[name]
        ly = top + ph + 24 + 14 * row
        parts.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="4" fill="{color}"/>'
            f'<text x="{lx + 14}" y="{ly + 5}" class="legend">{escape(name)}</text>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def _legend_rows(names: list[str], room: float, left: float = 44) -> list[list[tuple[str, float]]]:
    """Legend entries placed left to right, wrapping to a new row when full."""
    rows: list[list[tuple[str, float]]] = [[]]
    x = left
    for name in names:
        w = 22 + 6.5 * len(name)
        if rows[-1] and x + w > left + room:
            rows.append([])
            x = left
        rows[-1].append((name, x))
        x += w
    return rows


def share_bars(shares: dict[str, float], *, width: int = 460) -> Markup:
    """Horizontal bars of the current tier shares (0..1)."""
    row = 22
    height = 8 + row * max(1, len(shares))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="tier-shares" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="tier shares">'
    ]
    for i, tier in enumerate(_ordered(list(shares))):
        share = shares[tier]
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
