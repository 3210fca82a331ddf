"""PNG plots for simulator runs (matplotlib, headless Agg backend).

Every figure keeps its text inside the canvas: the run description (long: the
workload, cluster, load, scrape interval, ...) is wrapped into a small
suptitle and ``bbox_inches="tight"`` keeps the last tick label. Each policy
keeps one colour and its place in every legend (the order it was run in).
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from tokenfleet.core.tiers import SLOConfig
from tokenfleet.sim.records import RequestRecord

#: characters of 9-point type per inch of figure width (wraps the run description)
TITLE_CHARS_PER_INCH = 12


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return sorted(r.ttft_s for r in records if r.status == "completed" and r.ttft_s is not None)


def _colours(names: Sequence[str]) -> dict[str, Any]:
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    return {n: cycle[i % len(cycle)] for i, n in enumerate(names)}


def titled(fig: Figure, headline: str, description: str) -> None:
    """A bold headline, then the wrapped run description in small type."""
    chars = int(fig.get_figwidth() * TITLE_CHARS_PER_INCH)
    desc = "\n".join(textwrap.wrap(description, chars)) if description else ""
    fig.suptitle(headline + ("\n" + desc if desc else ""), fontsize=9, ha="center")


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=110, bbox_inches="tight")  # nothing clipped at the edges
    plt.close(fig)
    return path


def plot_runs(
    runs: Mapping[str, Sequence[RequestRecord]],
    out_dir: Path,
    title: str = "",
    bin_s: float | None = None,
    slo: SLOConfig | None = None,
    goodput_tok_s: Mapping[str, float] | None = None,
) -> list[Path]:
    """``ttft_cdf.png`` (with the interactive tier's TTFT SLO), ``over_time.png``
    (goodput and throughput, mean TTFT) and ``goodput.png`` (the headline
    number per policy: output tokens/s of requests that met their SLO)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slo = slo or SLOConfig()
    names = list(runs)
    colour = _colours(names)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        xs = _ttfts(runs[name])
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=name, color=colour[name])
    limit = slo.slo_for("interactive").ttft_s
    if limit is not None:
        ax.axvline(limit, color="black", linestyle=":", linewidth=1.2)
        ax.annotate(
            f"interactive TTFT SLO {limit:g} s",
            (limit, 0.03),
            xytext=(-3, 0),
            textcoords="offset points",
            fontsize=8,
            rotation=90,
            ha="right",
            va="bottom",
        )
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_ylim(0, 1.0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    titled(fig, "TTFT CDF", title)
    paths.append(_save(fig, out_dir / "ttft_cdf.png"))

    end = max((r.finish_s or 0.0 for recs in runs.values() for r in recs), default=1.0)
    width = bin_s or max(1.0, end / 60)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name in names:
        nb = int(end / width) + 1
        tok = [0.0] * nb
        good = [0.0] * nb
        ttft_sum = [0.0] * nb
        ttft_n = [0] * nb
        for r in runs[name]:
            if r.status != "completed" or r.finish_s is None:
                continue
            tok[int(r.finish_s / width)] += r.output_tokens
            if r.slo_met:
                good[int(r.finish_s / width)] += r.output_tokens
            if r.first_token_s is not None and r.ttft_s is not None:
                b = int(r.first_token_s / width)
                ttft_sum[b] += r.ttft_s
                ttft_n[b] += 1
        xs = [i * width for i in range(nb)]
        ax1.plot(xs, [t / width for t in good], label=name, color=colour[name])
        ax1.plot(
            xs,
            [t / width for t in tok],
            label="_nolegend_",  # the subtitle says what dashed means
            color=colour[name],
            linestyle="--",
            alpha=0.6,
        )
        ax2.plot(
            xs,
            [s / n if n else float("nan") for s, n in zip(ttft_sum, ttft_n, strict=False)],
            label=name,
            color=colour[name],
        )
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(
        "goodput (solid: tokens of requests that met their SLO) and all output (dashed)",
        fontsize=8,
    )
    ax2.set_ylabel("mean TTFT (s)")
    ax2.set_yscale("log")
    ax2.set_xlabel("simulated time (s)")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    titled(fig, "Goodput and TTFT over time", title)
    paths.append(_save(fig, out_dir / "over_time.png"))

    if goodput_tok_s is None:
        goodput_tok_s = {n: _goodput(runs[n]) for n in names}
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(names) + 2), 4.2))
    values = [goodput_tok_s.get(n, 0.0) for n in names]
    bars = ax.bar(names, values, color=[colour[n] for n in names])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8, padding=2)
    ax.set_ylabel("goodput (output tokens/s within SLO)")
    ax.set_ylim(0, max(values, default=0.0) * 1.15 or 1.0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.tick_params(axis="x", labelrotation=20 if len(names) > 4 else 0)
    titled(fig, "Goodput per policy", title)
    paths.append(_save(fig, out_dir / "goodput.png"))
    return paths


def _goodput(records: Sequence[RequestRecord]) -> float:
    """Output tokens/s of requests that met their SLO, over the run's span."""
    if not records:
        return 0.0
    start = min(r.arrival_s for r in records)
    end = max((r.finish_s or r.arrival_s) for r in records)
    good = sum(r.output_tokens for r in records if r.status == "completed" and r.slo_met)
    return good / (end - start) if end > start else 0.0


def plot_sweep(
    results: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]], out_dir: Path, title: str = ""
) -> Path:
    """TTFT p50 and p95 against offered load, one line per policy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    colour = _colours(list(results))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in results.items():
        loads = [x for x, _ in points]
        for ax, key in zip(axes, ("ttft_p50_s", "ttft_p95_s"), strict=False):
            ax.plot(
                loads,
                [m.get(key) or float("nan") for _, m in points],
                marker="o",
                label=name,
                color=colour[name],
            )
    for ax, label in zip(axes, ("TTFT p50 (s)", "TTFT p95 (s)"), strict=False):
        ax.set_xlabel("offered load (fraction of capacity)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    titled(fig, "TTFT vs load", title)
    return _save(fig, out_dir / "sweep_ttft.png")
