"""Time prefill and decode forward passes of a Llama-3.1-8B-shaped model on one GPU.

Random bf16 weights (no download), plain PyTorch: SDPA (flash attention on
Hopper) for prefill, a grouped-query attention over a contiguous KV cache for
decode, and the LM head on the last position of each sequence only (as an
engine samples). Decode steps are captured in CUDA graphs so the time is GPU
time, not Python launch overhead; prefill runs eagerly (kernels are large).

It writes a JSON file (``--out``) that ``benchmarks/calibrate_engine.py
--extra FILE`` takes as extra rows, compared with the engine model's GPU part
of a step (no scheduler overhead). Default sweep on an H200: prefill of
1k..32k tokens, decode of batch 1..256 at 2k context, in well under 5 minutes.

    python benchmarks/gpu_step_times.py --out h200.json          # on the GPU machine
    python benchmarks/gpu_step_times.py --tiny --device cpu      # smoke test, seconds
    PYTHONPATH=$PWD python benchmarks/calibrate_engine.py --extra h200.json

torch is imported inside main(), so ``--help`` and importing this module
work without it. Not measured: paged KV, KV-cache writes during prefill,
sampling, the engine's scheduler; vLLM's fused kernels differ from these.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = "tokenfleet-gpu-step-times/1"


@dataclass(frozen=True)
class Shape:
    name: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_model_len_tokens: int

    @property
    def n_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.n_heads + 2 * self.n_kv_heads) * d + self.n_heads * d * h
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h  # two RMSNorm weights
        return self.n_layers * per_layer + 2 * self.vocab_size * h + h  # emb, head, norm


LLAMA31_8B = Shape("Llama-3.1-8B-shape", 32, 4096, 32, 8, 128, 14336, 128256, 131072)
TINY = Shape("tiny-llama-shape", 2, 256, 4, 2, 64, 512, 1000, 4096)


def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--out", default="gpu_step_times.json", help="JSON file to write")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument(
        "--tiny", action="store_true", help="a 2-layer toy shape and small sweeps (smoke test)"
    )
    ap.add_argument(
        "--prefill",
        type=_parse_ints,
        default=None,
        help="prefill lengths, comma-separated (default 1024..32768)",
    )
    ap.add_argument(
        "--batches",
        type=_parse_ints,
        default=None,
        help="decode batch sizes (default 1,2,4,...,256)",
    )
    ap.add_argument("--ctx", type=int, default=None, help="decode context (default 2048)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per point")
    ap.add_argument("--no-graphs", action="store_true", help="decode without CUDA graphs")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=270.0,
        help="skip remaining points once this much time has passed",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the run, not after
    import torch  # type: ignore[import-not-found]
    import torch.nn.functional as F  # type: ignore[import-not-found]

    shape = TINY if args.tiny else LLAMA31_8B
    prefill_lens = args.prefill or (
        [64, 128] if args.tiny else [1024, 2048, 4096, 8192, 16384, 32768]
    )
    batches = args.batches or ([1, 2] if args.tiny else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    ctx = args.ctx or (128 if args.tiny else 2048)
    repeats = args.repeats or (2 if args.tiny else 5)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    t_start = time.perf_counter()
    torch.manual_seed(0)

    h, nh, nkv, d = shape.hidden_size, shape.n_heads, shape.n_kv_heads, shape.head_dim
    group = nh // nkv

    def w(*size: int) -> Any:
        return torch.empty(*size, device=dev, dtype=dtype).normal_(0.0, 0.02)

    layers = [
        dict(
            qkv=w((nh + 2 * nkv) * d, h),
            o=w(h, nh * d),
            gate_up=w(2 * shape.intermediate_size, h),
            down=w(h, shape.intermediate_size),
            n1=torch.ones(h, device=dev, dtype=dtype),
            n2=torch.ones(h, device=dev, dtype=dtype),
        )
        for _ in range(shape.n_layers)
    ]
    emb = w(shape.vocab_size, h)
    head = w(shape.vocab_size, h)
    norm_f = torch.ones(h, device=dev, dtype=dtype)
    inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))

    def rope(x: Any, pos: Any) -> Any:  # x: [B, heads, T, d]; pos: [T] or [B, 1, 1]
        f = pos.to(torch.float32)[..., None] * inv
        cos, sin = f.cos().to(x.dtype), f.sin().to(x.dtype)
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def rms(x: Any, weight: Any) -> Any:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * weight

    def mlp(x: Any, lw: dict[str, Any]) -> Any:
        gu = x @ lw["gate_up"].t()
        g, u = gu.chunk(2, dim=-1)
        return (F.silu(g) * u) @ lw["down"].t()

    def prefill(ids: Any) -> Any:  # ids: [B, T]
        b, t = ids.shape
        x = emb[ids]
        pos = torch.arange(t, device=dev)
        for lw in layers:
            y = rms(x, lw["n1"]) @ lw["qkv"].t()
            q, k, v = y.split([nh * d, nkv * d, nkv * d], dim=-1)
            q = rope(q.view(b, t, nh, d).transpose(1, 2), pos)
            k = rope(k.view(b, t, nkv, d).transpose(1, 2), pos)
            v = v.view(b, t, nkv, d).transpose(1, 2)
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(b, t, nh * d) @ lw["o"].t()
            x = x + mlp(rms(x, lw["n2"]), lw)
        return rms(x[:, -1], norm_f) @ head.t()  # logits of the sampled position only

    def make_decode(bsz: int) -> tuple[Callable[[], Any], Any]:
        kc = [torch.empty(bsz, nkv, ctx + 1, d, device=dev, dtype=dtype).normal_() for _ in layers]
        vc = [torch.empty(bsz, nkv, ctx + 1, d, device=dev, dtype=dtype).normal_() for _ in layers]
        ids = torch.zeros(bsz, 1, dtype=torch.long, device=dev)
        pos = torch.full((bsz, 1, 1), ctx, dtype=torch.long, device=dev)  # [B, 1, 1]
        scale = 1.0 / math.sqrt(d)

        def step() -> Any:
            x = emb[ids]  # [B, 1, h]
            for i, lw in enumerate(layers):
                y = rms(x, lw["n1"]) @ lw["qkv"].t()
                q, k, v = y.split([nh * d, nkv * d, nkv * d], dim=-1)
                q = rope(q.view(bsz, 1, nh, d).transpose(1, 2), pos)  # [B, nh, 1, d]
                k = rope(k.view(bsz, 1, nkv, d).transpose(1, 2), pos)
                kc[i][:, :, ctx : ctx + 1] = k  # write this token's KV
                vc[i][:, :, ctx : ctx + 1] = v.view(bsz, 1, nkv, d).transpose(1, 2)
                qg = q.view(bsz, nkv, group, d)  # grouped queries read each KV head once
                s = (qg @ kc[i].transpose(-1, -2)) * scale  # [B, nkv, group, ctx+1]
                a = torch.softmax(s.float(), dim=-1).to(dtype) @ vc[i]  # [B, nkv, group, d]
                x = x + a.reshape(bsz, 1, nh * d) @ lw["o"].t()
                x = x + mlp(rms(x, lw["n2"]), lw)
            return rms(x[:, -1], norm_f) @ head.t()

        return step, (kc, vc)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn: Callable[[], Any], n: int) -> list[float]:
        out = []
        for _ in range(n):
            if cuda:
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
                out.append(e0.elapsed_time(e1))
            else:
                t0 = time.perf_counter()
                fn()
                out.append(1e3 * (time.perf_counter() - t0))
        return out

    def free_bytes() -> float:
        return float(torch.cuda.mem_get_info()[0]) if cuda else float("inf")

    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    with torch.inference_mode():
        for t in prefill_lens:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"prefill {t}: time budget")
                continue
            ids = torch.randint(0, shape.vocab_size, (1, t), device=dev)
            try:
                timed(lambda ids=ids: prefill(ids), 1)  # warm-up (kernel selection)
                sync()
                ms = timed(lambda ids=ids: prefill(ids), repeats)
            except RuntimeError as e:  # out of memory on a smaller GPU
                skipped.append(f"prefill {t}: {str(e).splitlines()[0][:80]}")
                if cuda:
                    torch.cuda.empty_cache()
                continue
            rows.append(
                dict(
                    phase="prefill",
                    batch=1,
                    tokens=t,
                    ctx=0,
                    median_ms=statistics.median(ms),
                    min_ms=min(ms),
                    repeats=repeats,
                    cuda_graph=False,
                )
            )
            print(f"prefill {t:6d} tokens: {statistics.median(ms):9.3f} ms", flush=True)
        for bsz in batches:
            if time.perf_counter() - t_start > args.budget_s:
                skipped.append(f"decode b{bsz}: time budget")
                continue
            kv_bytes = 2 * shape.n_layers * bsz * nkv * (ctx + 1) * d * (2 if cuda else 4)
            if kv_bytes > 0.9 * free_bytes():
                skipped.append(f"decode b{bsz}: KV ({kv_bytes / 1e9:.1f} GB) does not fit")
                continue
            step, cache = make_decode(bsz)
            fn: Callable[[], Any] = step
            graphed = False
            g = None
            if cuda and not args.no_graphs:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    step()
                fn = g.replay
                graphed = True
            fn()
            sync()
            ms = timed(fn, max(repeats, 10 if cuda else repeats))
            rows.append(
                dict(
                    phase="decode",
                    batch=bsz,
                    tokens=bsz,
                    ctx=ctx,
                    median_ms=statistics.median(ms),
                    min_ms=min(ms),
                    repeats=len(ms),
                    cuda_graph=graphed,
                )
            )
            print(f"decode batch {bsz:4d} ctx {ctx}: {statistics.median(ms):9.3f} ms", flush=True)
            del step, cache, fn, g
            if cuda:
                torch.cuda.empty_cache()

    model = {k: v for k, v in asdict(shape).items() if k != "intermediate_size"}
    model["n_params"] = float(shape.n_params)
    device_name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    out = dict(
        format=FORMAT,
        device=device_name,
        torch=torch.__version__,
        dtype=str(dtype).replace("torch.", ""),
        tiny=args.tiny,
        intermediate_size=shape.intermediate_size,
        model=model,
        rows=rows,
        skipped=skipped,
        wall_s=time.perf_counter() - t_start,
    )
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(f"wrote {args.out}: {len(rows)} rows, {len(skipped)} skipped, {out['wall_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
