"""PNG plots for simulator runs (matplotlib, headless Agg backend)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tokenfleet.sim.records import RequestRecord


def _ttfts(records: Sequence[RequestRecord]) -> list[float]:
    return sorted(r.ttft_s for r in records if r.status == "completed" and r.ttft_s is not None)


def plot_runs(
    runs: Mapping[str, Sequence[RequestRecord]],
    out_dir: Path,
    title: str = "",
    bin_s: float | None = None,
) -> list[Path]:
    """TTFT CDF per policy; throughput and TTFT over time."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, recs in runs.items():
        xs = _ttfts(recs)
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF {title}".strip())
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    p = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    end = max((r.finish_s or 0.0 for recs in runs.values() for r in recs), default=1.0)
    width = bin_s or max(1.0, end / 60)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    for name, recs in runs.items():
        nb = int(end / width) + 1
        tok = [0.0] * nb
        ttft_sum = [0.0] * nb
        ttft_n = [0] * nb
        for r in recs:
            if r.status != "completed" or r.finish_s is None:
                continue
            tok[int(r.finish_s / width)] += r.output_tokens
            if r.first_token_s is not None and r.ttft_s is not None:
                b = int(r.first_token_s / width)
                ttft_sum[b] += r.ttft_s
                ttft_n[b] += 1
        xs = [i * width for i in range(nb)]
        ax1.plot(xs, [t / width for t in tok], label=name)
        ax2.plot(
            xs,
            [s / n if n else float("nan") for s, n in zip(ttft_sum, ttft_n, strict=False)],
            label=name,
        )
    ax1.set_ylabel("output tokens/s")
    ax1.set_title(f"Throughput and TTFT over time {title}".strip())
    ax2.set_ylabel("mean TTFT (s)")
    ax2.set_yscale("log")
    ax2.set_xlabel("simulated time (s)")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    p = out_dir / "over_time.png"
    fig.tight_layout()
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def plot_sweep(
    results: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]], out_dir: Path, title: str = ""
) -> Path:
    """TTFT p50 and p95 against offered load, one line per policy."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, points in results.items():
        loads = [x for x, _ in points]
        for ax, key in zip(axes, ("ttft_p50_s", "ttft_p95_s"), strict=False):
            ax.plot(loads, [m.get(key) or float("nan") for _, m in points], marker="o", label=name)
    for ax, label in zip(axes, ("TTFT p50 (s)", "TTFT p95 (s)"), strict=False):
        ax.set_xlabel("offered load (fraction of capacity)")
        ax.set_ylabel(label)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"TTFT vs load {title}".strip())
    fig.tight_layout()
    p = out_dir / "sweep_ttft.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p
