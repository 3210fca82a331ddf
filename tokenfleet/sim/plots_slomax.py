"""Plots for admission runs: per-tier attainment and capacity shares over time.

They read the controller timeline an admission run records every control
period (``admission_report["timeline"]``), so what is drawn is exactly what
the controller saw and did.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tokenfleet.sim.plots import titled

TIER_ORDER = ("interactive", "long_context", "batch")


def _timeline(run: Any) -> list[dict[str, Any]]:
    rep = getattr(run, "admission_report", None) or {}
    tl = rep.get("timeline") or []
    return list(tl)


def _label(run: Any) -> str:
    return str(getattr(run, "label", getattr(run, "policy", "run")))


def plot_admission(runs: Sequence[Any], out_dir: Path, title: str = "") -> list[Path]:
    """``admission_attainment.png`` (every run) and ``slomax_controller.png``
    (runs whose policy reports knobs)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    with_tl = [r for r in runs if _timeline(r)]
    if not with_tl:
        return paths

    tiers = [t for t in TIER_ORDER if any(t in s["tiers"] for r in with_tl for s in _timeline(r))]
    fig, axes = plt.subplots(
        len(tiers), 1, figsize=(8, 2.4 * len(tiers) + 0.8), sharex=True, squeeze=False
    )
    for ax, tier in zip(axes[:, 0], tiers, strict=False):
        for r in with_tl:
            xs, ys = [], []
            for s in _timeline(r):
                m = s["tiers"].get(tier)
                if m and m.get("attainment") is not None and m.get("finished", 0) > 0:
                    xs.append(s["t_s"])
                    ys.append(100.0 * m["attainment"])
            if xs:
                ax.plot(xs, ys, marker=".", label=_label(r))
        ax.set_ylabel(f"{tier}\nattainment %")
        ax.set_ylim(-3, 103)
        ax.grid(True, alpha=0.3)
    axes[0, 0].legend(fontsize=8, loc="lower right")
    axes[-1, 0].set_xlabel("simulated time (s), per control period")
    titled(fig, "Per-tier SLO attainment per control period", title)
    fig.tight_layout()
    p = out_dir / "admission_attainment.png"
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    paths.append(p)

    ctl = [r for r in with_tl if any(s["knobs"] for s in _timeline(r))]
    for r in ctl:
        tl = _timeline(r)
        ts = [s["t_s"] for s in tl]
        fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
        for knob, style in (("batch_share", "-"), ("long_share", "--"), ("reject_factor", ":")):
            ys = [s["knobs"].get(knob) for s in tl]
            if any(y is not None for y in ys):
                a1.step(ts, ys, style, where="post", label=knob)
        a1.set_ylabel("knob value")
        a1.grid(True, alpha=0.3)
        a1.legend(fontsize=8)
        a1.set_title("capacity shares and reject threshold (controller output)", fontsize=9)
        for tier in tiers:
            xs, ys = [], []
            for s in tl:
                m = s["tiers"].get(tier)
                if m and m.get("attainment") is not None and m.get("finished", 0) > 0:
                    xs.append(s["t_s"])
                    ys.append(100.0 * m["attainment"])
            if xs:
                a2.plot(xs, ys, marker=".", label=tier)
        a2.set_ylabel("attainment % (window)")
        a2.set_ylim(-3, 103)
        a2.grid(True, alpha=0.3)
        a2.legend(fontsize=8, loc="lower right")
        for tier in tiers:
            q = [s["tiers"].get(tier, {}).get("queued", 0) for s in tl]
            f = [s["tiers"].get(tier, {}).get("inflight", 0) for s in tl]
            if any(q) or any(f):
                a3.plot(ts, f, label=f"{tier} in flight")
                if any(q):
                    a3.plot(ts, q, "--", label=f"{tier} queued")
        a3.set_ylabel("requests")
        a3.set_yscale("symlog")
        a3.set_xlabel("simulated time (s)")
        a3.grid(True, alpha=0.3)
        a3.legend(fontsize=7, ncol=2)
        titled(fig, f"{_label(r)}: controller at work", title)
        fig.tight_layout()
        name = _label(r).replace("/", "_").replace("+", "_")
        p = out_dir / f"controller_{name}.png"
        fig.savefig(p, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(p)
    return paths
