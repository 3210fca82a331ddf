"""PNG plots for multi-datacenter runs: per-DC load and spill share over time.

Timeline events (dotted), plans (dashed) and rollbacks (solid red) are drawn
as vertical lines so a reader can tie a change in the curves to its cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tokenfleet.sim.plots import titled

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from tokenfleet.sim.fleet import FleetRun


def _marks(ax: Axes, run: FleetRun) -> None:
    for ev in run.timeline:
        ax.axvline(ev["at_s"], color="0.4", linestyle=":", linewidth=1)
    for p in run.plans:
        if p["kind"] != "rollback":
            ax.axvline(p["at_s"], color="tab:green", linestyle="--", linewidth=1)
    for rb in run.rollbacks:
        ax.axvline(rb["at_s"], color="tab:red", linewidth=1.5)


def _grid(n: int) -> tuple[Any, list[Axes]]:
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.6 * n + 0.8), sharex=True, squeeze=False)
    return fig, [a for row in axes for a in row]


def _legend_note(fig: Any) -> None:
    fig.text(
        0.01,
        0.005,
        "dotted: timeline event   dashed green: plan   red: rollback",
        fontsize=7,
        color="0.3",
    )


def plot_fleet_load(runs: Sequence[FleetRun], out_dir: Path, title: str = "") -> Path:
    """Per-DC load (1.0 = every ready replica busy) over time, one panel per policy."""
    fig, axes = _grid(len(runs))
    for ax, run in zip(axes, runs, strict=False):
        ts = run.timeseries
        for dc, ys in ts["load"].items():
            ax.plot(ts["t"], [min(y, 3.0) for y in ys], label=dc, linewidth=1.2)
        ax.axhline(1.0, color="0.6", linewidth=0.8)
        _marks(ax, run)
        ax.set_ylabel("load")
        ax.set_ylim(0, 3.05)
        ax.set_title(run.policy, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=4)
    axes[-1].set_xlabel("simulated time (s)")
    titled(fig, "Per-DC load over time", title)
    _legend_note(fig)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / "fleet_load.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_fleet_spill(runs: Sequence[FleetRun], out_dir: Path, title: str = "") -> Path:
    """Share of arriving requests served away from home, split by target DC."""
    fig, axes = _grid(len(runs))
    for ax, run in zip(axes, runs, strict=False):
        sp = run.timeseries["spill"]
        t = sp["t"]
        ax.plot(t, sp["spill_share"], color="black", linewidth=1.4, label="all spill")
        for dc, ys in sp["to"].items():
            if any(ys):
                ax.plot(t, ys, linewidth=1.0, label=f"to {dc}")
        _marks(ax, run)
        ax.set_ylabel("share of arrivals")
        ax.set_ylim(0, 1.02)
        ax.set_title(run.policy, fontsize=9, loc="left")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right", ncol=5)
    axes[-1].set_xlabel(f"arrival time (s, {run.timeseries['spill']['bin_s']:g} s bins)")
    titled(fig, "Spill share over time", title)
    _legend_note(fig)
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / "fleet_spill.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_fleet_dcs(runs: Sequence[FleetRun], out_dir: Path, title: str = "") -> Path:
    """Per-DC goodput and SLO attainment, grouped by policy."""
    dcs = sorted({dc for r in runs for dc in r.per_dc})
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(1, len(runs))
    for k, run in enumerate(runs):
        xs = [i + k * width for i in range(len(dcs))]
        ax1.bar(xs, [run.per_dc[d]["goodput_tok_s"] for d in dcs], width, label=run.policy)
        ax2.bar(
            xs,
            [100 * (run.per_dc[d]["slo_attainment"] or 0.0) for d in dcs],
            width,
            label=run.policy,
        )
    for ax, label in ((ax1, "goodput (tok/s)"), (ax2, "SLO attainment (%)")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(dcs))], dcs)
        ax.set_ylabel(label)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    titled(fig, "Per-DC outcomes", title)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    p = out_dir / "fleet_dcs.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def plot_fleet_runs(runs: Sequence[FleetRun], out_dir: Path, title: str = "") -> list[Path]:
    if not runs:
        return []
    return [
        plot_fleet_load(runs, out_dir, title),
        plot_fleet_spill(runs, out_dir, title),
        plot_fleet_dcs(runs, out_dir, title),
    ]
