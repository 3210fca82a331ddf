"""Summary plots for the P/D runs of docs/benchmarks.md section 13 (issue #22).

Reads the ``tokenfleet sim --json`` files of one scenario and draws, per run,
SLO attainment and goodput (with the acceptance lines) and the latencies
behind them (TTFT p50/p95, TPOT p50, against the SLO limits). Each file
holds one run; the label is given on the command line, so a peer's
``--pd-prefill-share`` can be part of it.

    .venv/bin/python benchmarks/pd_plots.py --out docs/img/bench/pd_prefill_heavy.png \\
        --title "prefill-heavy.yaml (M = 5,100), 8 x llama3-8b-h200" \\
        --baseline "round_robin+fcfs" --target-attainment 0.86 \\
        "round_robin+fcfs=out/ph-rr-fcfs.json" "tokenpilot_pd_shed=out/ph-tppdshed.json"
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenfleet.sim.plots import _save, plt, titled


def load_runs(specs: list[str]) -> dict[str, dict[str, Any]]:
    """``LABEL=path.json`` -> the file's first run summary, in the order given."""
    runs: dict[str, dict[str, Any]] = {}
    for spec in specs:
        label, _, path = spec.partition("=")
        if not path:
            raise SystemExit(f"expected LABEL=path.json, got {spec!r}")
        runs[label] = json.loads(Path(path).read_text())["runs"][0]
    return runs


def plot(
    runs: dict[str, dict[str, Any]],
    out: Path,
    title: str,
    baseline: str | None,
    target_attainment: float | None,
    ttft_limit_s: float,
    tpot_limit_s: float,
) -> Path:
    names = list(runs)
    xs = range(len(names))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_att, ax_good), (ax_ttft, ax_tpot) = axes

    att = [100.0 * (runs[n]["slo_attainment"] or 0.0) for n in names]
    ax_att.bar(xs, att, color="tab:blue")
    if target_attainment is not None:
        ax_att.axhline(100 * target_attainment, color="k", ls="--", lw=1)
        ax_att.text(0, 100 * target_attainment + 1, f"{100 * target_attainment:.3g}%", fontsize=8)
    ax_att.set_ylabel("SLO attainment (%)")
    ax_att.set_ylim(0, 105)

    good = [runs[n]["goodput_tok_s"] or 0.0 for n in names]
    thr = [runs[n]["throughput_tok_s"] or 0.0 for n in names]
    ax_good.bar(xs, thr, color="lightgrey", label="all output")
    ax_good.bar(xs, good, color="tab:green", label="goodput (met SLO)")
    two_x = 0.0
    if baseline is not None and baseline in runs:
        two_x = 2 * (runs[baseline]["goodput_tok_s"] or 0.0)
        ax_good.axhline(two_x, color="k", ls="--", lw=1)
        ax_good.text(0, two_x * 1.01, f"2 x {baseline}", fontsize=8)
    top = max([*thr, two_x])
    ax_good.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax_good.set_ylabel("output tokens/s")
    ax_good.legend(fontsize=8, loc="upper right", ncol=2)

    for ax, keys, limit, label in (
        (ax_ttft, ("ttft_p50_s", "ttft_p95_s"), ttft_limit_s, "TTFT (s)"),
        (ax_tpot, ("tpot_p50_s", "tpot_p95_s"), tpot_limit_s, "TPOT (s)"),
    ):
        w = 0.4
        for k, key in enumerate(keys):
            vals = [runs[n].get(key) or 0.0 for n in names]
            ax.bar([x + (k - 0.5) * w for x in xs], vals, w, label=key.split("_")[1])
        ax.axhline(limit, color="k", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylabel(label + " (log)")
        ax.legend(fontsize=8)

    for ax in axes.flat:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    titled(fig, "P/D disaggregation: SLO attainment, goodput and latency per run", title)
    out.parent.mkdir(parents=True, exist_ok=True)
    return _save(fig, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=path.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="")
    ap.add_argument("--baseline", default=None, help="label whose goodput x2 is drawn")
    ap.add_argument("--target-attainment", type=float, default=None)
    ap.add_argument("--ttft-limit-s", type=float, default=1.0)
    ap.add_argument("--tpot-limit-s", type=float, default=0.10)
    args = ap.parse_args(argv)
    path = plot(
        load_runs(args.runs),
        args.out,
        args.title,
        args.baseline,
        args.target_attainment,
        args.ttft_limit_s,
        args.tpot_limit_s,
    )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
