"""KV-cache transfer cost between a prefill and a decode instance.

Disaggregated serving moves the prompt's KV from the instance that
prefilled it to the one that decodes it (vLLM's ``NixlConnector``: the
decode side reads the prefill side's blocks over UCX, NVLink inside a node
and RDMA between nodes). The cost is bytes over bandwidth plus a fixed
per-transfer latency; figures and sources in docs/engine-model.md, section 2c.
Operators know their topology, so a router may read this.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenfleet.engine.profiles import EngineProfile


@dataclass(frozen=True, slots=True)
class KVLink:
    """Point-to-point KV transfer bandwidth, per GPU, and fixed latency."""

    #: NVLink 4 (H100/H200 SXM): 450 GB/s per direction nominal; taken at the
    #: bus bandwidth NCCL reaches on it (330 GB/s, GPUSpec.interconnect_bytes_per_s)
    nvlink_bytes_per_s: float = 330e9
    #: one 400 Gb/s ConnectX-7 NIC per GPU (HGX H200): 50 GB/s nominal, ~45 achieved
    rdma_bytes_per_s: float = 45e9
    #: per transfer: the decode request reaching the engine, the connector's
    #: handshake/notification and the scheduler noticing at its next step
    latency_s: float = 0.001
    #: GPUs per node (HGX: 8); instances fill nodes in order
    gpus_per_node: int = 8

    def transfer_s(self, profile: EngineProfile, tokens: int, same_node: bool) -> float:
        """Seconds to move ``tokens`` of KV; every TP rank moves its shard on its
        own link, so the links add up."""
        if tokens <= 0:
            return 0.0
        bw = self.nvlink_bytes_per_s if same_node else self.rdma_bytes_per_s
        return self.latency_s + tokens * profile.model.kv_bytes_per_token / (profile.tp * bw)

    def node_of(self, index: int, profile: EngineProfile) -> int:
        """Node of the ``index``-th instance when instances fill nodes in order."""
        per_node = max(1, self.gpus_per_node // max(1, profile.tp))
        return index // per_node
