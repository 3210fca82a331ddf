"""Engine profiles: a model, a GPU, a parallelism degree and efficiency factors.

A profile is plain data plus a roofline step-time model. Routers may read a
profile (operators configure it, so a live router knows it); only the engine
model uses it to decide how long a step really takes. Formulas and constants
are documented, with the calibration against public measurements, in
``docs/engine-model.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from tokenfleet.core.registry import Registry
from tokenfleet.core.types import BLOCK_SIZE_TOKENS


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    n_params: float  # total parameters (weights read once per step)
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_model_len_tokens: int
    bytes_per_param: float = 2.0  # bf16
    kv_bytes_per_elem: float = 2.0  # bf16 KV cache
    n_active_params: float | None = None  # MoE: parameters touched per token
    vocab_size: int = 0  # 0: no separate embedding / LM head accounting
    tied_embeddings: bool = False  # LM head shares the embedding matrix

    @property
    def active_params(self) -> float:
        return self.n_active_params if self.n_active_params is not None else self.n_params

    @property
    def lm_head_params(self) -> float:
        """The output projection, ``vocab x hidden``: run only for sampled positions."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def linear_params_per_token(self) -> float:
        """Weights every token multiplies: active parameters minus the embedding
        table (a row gather, no FLOPs) and the LM head (sampled positions only)."""
        emb = self.lm_head_params  # embedding table, vocab x hidden
        return self.active_params - (emb if self.tied_embeddings else 2 * emb)

    @property
    def weight_read_bytes(self) -> float:
        """Weights streamed from HBM once per step: everything but the embedding
        table, of which only the batch's rows are gathered."""
        emb = 0.0 if self.tied_embeddings else self.lm_head_params
        return (self.n_params - emb) * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V, every layer, every KV head."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_elem

    @property
    def weight_bytes(self) -> float:
        return self.n_params * self.bytes_per_param


@dataclass(frozen=True, slots=True)
class GPUSpec:
    name: str
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes_per_s: float
    hbm_bytes: float
    interconnect_bytes_per_s: float  # per-GPU NVLink all-reduce bus bandwidth
    #: effective host-to-device (load) and device-to-host (offload) DMA bandwidth
    #: of one GPU's host link, pinned memory (docs/engine-model.md, section 2b)
    host_read_bytes_per_s: float = 50e9
    host_write_bytes_per_s: float = 50e9
    #: fixed cost of one KV transfer job (launch, completion polling by the scheduler)
    host_transfer_latency_s: float = 0.0005


@dataclass(frozen=True, slots=True)
class EngineProfile:
    """A deployable engine configuration with a roofline step-time model."""

    name: str
    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    # vLLM scheduler knobs
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024  # vLLM V1 server default on >= 70 GiB GPUs
    block_size_tokens: int = BLOCK_SIZE_TOKENS
    gpu_memory_utilization: float = 0.9
    # per GPU: activation peak, CUDA graphs, NCCL/cuBLAS workspaces (~2.8 GiB)
    activation_reserve_bytes: float = 3e9
    # efficiency factors, fitted on the in-sample rows of
    # benchmarks/calibrate_engine.py (`--fit`; table and sources: docs/engine-model.md)
    mfu: float = 0.52  # fraction of peak FLOP/s of the linear layers (GEMMs + their
    #                    per-token elementwise work: norms, RoPE, SiLU; GEMMs alone ~0.7)
    attn_eff: float = 0.60  # fraction of peak reached by prefill attention (FA3-class)
    mbu: float = 0.95  # achieved fraction of HBM bandwidth in memory-bound steps
    step_overhead_s: float = 0.000768  # scheduler + input prep + launch, per step (V1)
    per_seq_overhead_s: float = 0.0  # per sequence in the step (not fitted for V1: 0)
    allreduce_latency_s: float = 4e-5  # per all-reduce call under TP (NCCL, 4xH100)
    #: host-memory KV tier per instance, bytes (vLLM's ``--kv-offloading-size``);
    #: 0 = off, the GPU-only engine
    host_kv_bytes: float = 0.0
    notes: str = field(default="", compare=False)

    # -- capacity -----------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        per_gpu = (
            self.gpu.hbm_bytes * self.gpu_memory_utilization
            - self.model.weight_bytes / self.tp
            - self.activation_reserve_bytes
        )
        total = per_gpu * self.tp
        tokens = int(total // self.model.kv_bytes_per_token)
        return max(0, tokens - tokens % self.block_size_tokens)

    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size_tokens

    @property
    def host_kv_capacity_blocks(self) -> int:
        """Blocks the host tier holds (0: no host tier)."""
        per_block = self.model.kv_bytes_per_token * self.block_size_tokens
        return int(self.host_kv_bytes // per_block) if self.host_kv_bytes > 0 else 0

    def host_load_time_s(self, tokens: int) -> float:
        """Loading ``tokens`` of KV from host memory: every TP rank reads its
        shard over its own link, so the links add up."""
        if tokens <= 0:
            return 0.0
        link = self.tp * self.gpu.host_read_bytes_per_s
        return self.gpu.host_transfer_latency_s + tokens * self.model.kv_bytes_per_token / link

    def host_store_time_s(self, tokens: int) -> float:
        """Offloading ``tokens`` of KV to host memory (the device-to-host direction)."""
        if tokens <= 0:
            return 0.0
        link = self.tp * self.gpu.host_write_bytes_per_s
        return self.gpu.host_transfer_latency_s + tokens * self.model.kv_bytes_per_token / link

    # -- roofline step time ---------------------------------------------------
    def step_parts(
        self,
        prefill_new_tokens: int,
        prefill_attn_pairs: float,
        prefill_ctx_tokens: int,
        decode_seqs: int,
        decode_ctx_tokens: int,
        prefill_seqs: int | None = None,
    ) -> tuple[float, float, float, float, float]:
        """``(gemm_s, attn_s, memory_s, comm_s, overhead_s)`` of one step.

        ``gemm_s`` and ``attn_s`` are the compute times of the linear layers
        (LM head included) and of attention; ``step_time_s`` combines them as
        ``overhead + max(gemm + attn, memory) + comm``. Arguments as there.
        """
        m = self.model
        tokens = prefill_new_tokens + decode_seqs
        if tokens == 0:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        if prefill_seqs is None:
            prefill_seqs = 1 if prefill_new_tokens > 0 else 0
        seqs = decode_seqs + prefill_seqs  # each computes logits at one position
        # 2 FLOPs per MAC. Every token multiplies every linear weight; the LM
        # head runs once per sequence in the batch (the position it samples).
        lin_flops = 2.0 * (m.linear_params_per_token * tokens + m.lm_head_params * seqs)
        # Attention: QK^T and AV, 2 * 2 * H * d FLOPs per (query, key) pair per layer.
        attn_flops = (
            4.0
            * m.n_layers
            * m.n_heads
            * m.head_dim
            * (prefill_attn_pairs + decode_ctx_tokens + decode_seqs)
        )
        peak = self.tp * self.gpu.peak_flops
        gemm_s = lin_flops / (peak * self.mfu)
        attn_s = attn_flops / (peak * self.attn_eff)
        kv_read = (prefill_ctx_tokens + decode_ctx_tokens) * m.kv_bytes_per_token
        kv_write = tokens * m.kv_bytes_per_token
        hbm = m.weight_read_bytes + kv_read + kv_write
        memory_s = hbm / (self.tp * self.gpu.hbm_bytes_per_s * self.mbu)
        comm_s = 0.0
        if self.tp > 1:
            # Two all-reduces of the hidden state per layer (Megatron-style TP).
            calls = 2 * m.n_layers
            ring_bytes = 2.0 * (self.tp - 1) / self.tp * tokens * m.hidden_size * 2
            comm_s = calls * (
                self.allreduce_latency_s + ring_bytes / self.gpu.interconnect_bytes_per_s
            )
        overhead_s = self.step_overhead_s + self.per_seq_overhead_s * seqs
        return gemm_s, attn_s, memory_s, comm_s, overhead_s

    def step_time_s(
        self,
        prefill_new_tokens: int,
        prefill_attn_pairs: float,
        prefill_ctx_tokens: int,
        decode_seqs: int,
        decode_ctx_tokens: int,
        prefill_seqs: int | None = None,
    ) -> float:
        """Duration of one engine step (one forward pass of the whole batch).

        ``prefill_attn_pairs`` is sum over prefill chunks of
        ``q * ctx + q * (q + 1) / 2`` (query-key pairs attended),
        ``prefill_ctx_tokens`` the cached context those chunks read, and
        ``decode_ctx_tokens`` the summed context lengths of decoding sequences.
        ``prefill_seqs`` is the number of prefill chunks in the step (each
        computes logits for one position, as vLLM V1 does even for a partial
        chunk); ``None`` means one chunk if there are prefill tokens.
        """
        gemm_s, attn_s, memory_s, comm_s, overhead_s = self.step_parts(
            prefill_new_tokens,
            prefill_attn_pairs,
            prefill_ctx_tokens,
            decode_seqs,
            decode_ctx_tokens,
            prefill_seqs,
        )
        if overhead_s == 0.0 and memory_s == 0.0:
            return 0.0
        compute_s = gemm_s + attn_s
        return overhead_s + (compute_s if compute_s > memory_s else memory_s) + comm_s

    # -- conveniences used by estimators -------------------------------------
    def prefill_time_s(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill alone, in chunks of ``max_num_batched_tokens``."""
        t = 0.0
        done = cached_tokens
        left = uncached_tokens
        while left > 0:
            q = min(left, self.max_num_batched_tokens)
            t += self.step_time_s(q, q * done + q * (q + 1) / 2, done, 0, 0, 1)
            done += q
            left -= q
        return t

    def decode_step_time_s(self, batch: int, mean_ctx_tokens: float) -> float:
        return self.step_time_s(0, 0.0, 0, batch, int(batch * mean_ctx_tokens), 0)

    def with_overrides(self, **kwargs: object) -> EngineProfile:
        return replace(self, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Built-in hardware and models (public spec sheets / HF configs)
# --------------------------------------------------------------------------
H200 = GPUSpec(
    name="H200-SXM",
    peak_flops=989e12,  # dense BF16, NVIDIA H200 datasheet
    hbm_bytes_per_s=4.8e12,
    hbm_bytes=150e9,  # "141 GB" = 143771 MiB in nvidia-smi; ~139.7 GiB usable
    # NCCL all-reduce bus bandwidth measured on NVLink 4 (900 GB/s bidirectional
    # nominal): Vidur's 4xH100 DGX profile; H200 has the same NVLink
    interconnect_bytes_per_s=330e9,
    # host link: PCIe Gen5 x16 to the CPU, 64 GB/s per direction nominal (63 GB/s
    # after 128b/130b coding); pinned-memory DMA reaches ~50 GB/s (section 2b)
    host_read_bytes_per_s=50e9,
    host_write_bytes_per_s=50e9,
)

H100 = GPUSpec(
    name="H100-SXM",
    peak_flops=989e12,  # dense BF16, NVIDIA H100 datasheet
    hbm_bytes_per_s=3.35e12,
    hbm_bytes=85e9,  # "80 GB" = 81559 MiB; ~79.2 GiB usable
    interconnect_bytes_per_s=330e9,
    # host link: PCIe Gen5 x16 to the CPU, 64 GB/s per direction nominal (63 GB/s
    # after 128b/130b coding); pinned-memory DMA reaches ~50 GB/s (section 2b)
    host_read_bytes_per_s=50e9,
    host_write_bytes_per_s=50e9,
)

LLAMA3_8B = ModelSpec(
    name="meta-llama/Llama-3.1-8B-Instruct",
    n_params=8.03e9,
    n_layers=32,
    hidden_size=4096,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    max_model_len_tokens=131072,
    vocab_size=128256,
)

LLAMA3_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    n_params=70.6e9,
    n_layers=80,
    hidden_size=8192,
    n_heads=64,
    n_kv_heads=8,
    head_dim=128,
    max_model_len_tokens=131072,
    vocab_size=128256,
)

PROFILES: Registry[EngineProfile] = Registry("profile")


def _builtin(profile: EngineProfile) -> None:
    PROFILES.add(profile.name, lambda: profile)


_builtin(
    EngineProfile(
        name="llama3-8b-h200", model=LLAMA3_8B, gpu=H200, tp=1, notes="8B dense on one H200"
    )
)
_builtin(
    EngineProfile(
        name="llama3-70b-h200-tp4",
        model=LLAMA3_70B,
        gpu=H200,
        tp=4,
        notes="70B dense on 4xH200, tensor parallel",
    )
)
_builtin(
    EngineProfile(
        name="llama3-8b-h100",
        model=LLAMA3_8B,
        gpu=H100,
        tp=1,
        notes="8B dense on one H100 (calibration reference)",
    )
)
_builtin(
    EngineProfile(
        name="llama3-70b-h100-tp4",
        model=LLAMA3_70B,
        gpu=H100,
        tp=4,
        notes="70B dense on 4xH100 (calibration reference)",
    )
)


def get_profile(name: str) -> EngineProfile:
    return PROFILES.create(name)
