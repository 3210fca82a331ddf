"""``tokenfleet profiles``: list engine profiles and what the model predicts for them."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("profiles", help="list engine profiles (model, GPU, KV capacity, timings)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from tokenfleet.engine.profiles import PROFILES

    t = Table(title="Engine profiles (roofline model; see docs/engine-model.md)")
    for col in (
        "name",
        "model",
        "GPU x TP",
        "KV tokens",
        "prefill 1k",
        "prefill 8k",
        "decode b=1",
        "decode b=64",
    ):
        t.add_column(col)
    for name in PROFILES.names():
        pr = PROFILES.create(name)
        t.add_row(
            name,
            pr.model.name.split("/")[-1],
            f"{pr.gpu.name} x{pr.tp}",
            f"{pr.kv_capacity_tokens:,}",
            f"{pr.prefill_time_s(1024) * 1e3:.1f} ms",
            f"{pr.prefill_time_s(8192) * 1e3:.1f} ms",
            f"{pr.decode_step_time_s(1, 1024) * 1e3:.2f} ms",
            f"{pr.decode_step_time_s(64, 1024) * 1e3:.2f} ms",
        )
    Console(width=160).print(t)
    return 0
