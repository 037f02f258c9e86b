"""GPU profiles DERIVED from published hardware and model figures, not measured: the step-time
model of experiments/derive_h100_llama3_8b.py (which wrote the shipped Llama-3-8B profile) for
any Llama-shaped model, with the figures that price pipeline stages and nodes (devices per node,
the inter-node link, the weights' bytes and the memory a device holds for weights and KV).

    python -m pdserve.tuning.derive_profile            # rewrites both shipped H100 profiles

Step time = fixed overhead + weight read + linear compute + attention + TP all-reduces over
NVLink, added up (no overlap assumed), for one node of 8 H100 SXM5 80GB; the samples are computed
on the profiler's grid and fitted by the same code, so the fit is exact by construction. Nothing
here runs at serving or tuning time: tests/unit/test_tune_pp.py checks that the shipped files are
what this module writes, and that the 8B one is still what the experiment wrote.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from pdserve.tuning.perf_model import (
    decode_features,
    fit_nonnegative,
    prefill_features,
    profile_dict,
)

PROFILES = pathlib.Path(__file__).resolve().parent / "profiles"

# H100 SXM5 80GB (NVIDIA datasheet)
PEAK_BF16 = 989.4e12
HBM_BYTES_PER_S = 3.35e12
NVLINK_BYTES_PER_S = 450e9  # per direction (900 GB/s total)
MEMORY_BYTES = 80 << 30
DEVICES_PER_NODE = 8  # an HGX H100 node
# between nodes: one 400 Gb/s NDR InfiniBand NIC per GPU (50 GB/s), of which an all-reduce ring
# across nodes gets INTER_NODE_EFFICIENCY (NCCL's bus bandwidth), and a call's latency
INTER_NODE_BYTES_PER_S, INTER_NODE_EFFICIENCY, INTER_NODE_LATENCY_S = 50e9, 0.8, 25e-6
# assumptions (efficiency of each part; see "source" in the JSON)
MFU_LINEAR, MFU_ATTENTION, HBM_EFFICIENCY, NCCL_EFFICIENCY = 0.6, 0.5, 0.8, 0.7
STEP_OVERHEAD_S = 1.5e-3  # scheduling, sampling, kernel launches per step
ALLREDUCE_LATENCY_S = 15e-6  # per all-reduce, small messages over NVLink
GPU_MEMORY_UTILIZATION, ACTIVATION_RESERVE = 0.9, 2 << 30
USABLE_BYTES_PER_DEVICE = MEMORY_BYTES * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE
TP_DEGREES = (1, 2, 4, 8)

# one prompt of 16, 32, ..., 8192 tokens, then batches of several
PREFILL_GRID = [[1 << k] for k in range(4, 14)] + [
    [512] * 4,
    [256] * 8,
    [128] * 16,
    [2048] * 2,
    [1024] * 8,
]
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (128, 512, 2048, 8192)


@dataclass(frozen=True)
class Shape:
    """A Llama-shaped model in bf16, as its config.json gives it."""

    id: str
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    params: float
    source: str  # where the figures come from

    @property
    def weight_bytes(self) -> float:
        return self.params * 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2  # K and V, bf16


LLAMA3_8B = Shape(
    "Meta-Llama-3-8B",
    "meta-llama/Meta-Llama-3-8B",
    32,
    4096,
    32,
    8,
    128,
    14336,
    128256,
    8.03e9,
    "Meta Llama 3 8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, "
    "MLP 14336, vocab 128256, ~8.03B parameters",
)
LLAMA3_70B = Shape(
    "Meta-Llama-3-70B",
    "meta-llama/Meta-Llama-3-70B",
    80,
    8192,
    64,
    8,
    128,
    28672,
    128256,
    70.6e9,
    "Meta Llama 3 70B config.json: 80 layers, hidden 8192, 64 heads, 8 KV heads, head dim 128, "
    "MLP 28672, vocab 128256, ~70.6B parameters",
)
FILES = {LLAMA3_8B: "h100_llama3_8b.json", LLAMA3_70B: "h100_llama3_70b.json"}


def allreduce_s(m: Shape, tp: int, num_tokens: int) -> float:
    """The TP group's all-reduces over NVLink in one step: 2 a layer."""
    if tp == 1:
        return 0.0
    per_call = (
        num_tokens * m.hidden * 2 * 2 * (tp - 1) / tp / (NVLINK_BYTES_PER_S * NCCL_EFFICIENCY)
    )
    return 2 * m.layers * (ALLREDUCE_LATENCY_S + per_call)


def step_s(m: Shape, tp: int, tokens: int, pairs: float, sampled: int, kv_read: int) -> float:
    linear_flops = 2 * (m.params - m.vocab * m.hidden)  # the LM head runs for sampled rows only
    compute = (tokens * linear_flops + sampled * 2 * m.vocab * m.hidden) / (PEAK_BF16 * MFU_LINEAR)
    # QK^T and PV; pairs counts n*(start+n), about twice the causal pairs
    attention = pairs * (2 * 2 * m.heads * m.head_dim * m.layers / 2) / (PEAK_BF16 * MFU_ATTENTION)
    reads = (m.weight_bytes + kv_read * m.kv_bytes_per_token) / (HBM_BYTES_PER_S * HBM_EFFICIENCY)
    return STEP_OVERHEAD_S + (compute + attention + reads) / tp + allreduce_s(m, tp, tokens)


def kv_capacity_tokens(m: Shape, tp: int) -> int:
    """KV tokens of one worker of tp GPUs in one stage; 0 where the weights leave no room."""
    return max(0, int((tp * USABLE_BYTES_PER_DEVICE - m.weight_bytes) // m.kv_bytes_per_token))


def tp_entry(m: Shape, tp: int) -> dict:
    prefill = [
        {
            "seq_lens": lens,
            "num_tokens": sum(lens),
            "computed": True,
            "latency_s": step_s(m, tp, sum(lens), sum(n * n for n in lens), len(lens), 0),
        }
        for lens in PREFILL_GRID
    ]
    cap = kv_capacity_tokens(m, tp)
    # decode samples where the batch's KV fits; a degree that holds none is fitted on the same
    # grid as if it did (the step model still prices a stage of it, which holds 1/pp the weights)
    decode = [
        {
            "batch_size": b,
            "context_tokens": c,
            "computed": True,
            "latency_s": step_s(m, tp, b, 0, b, b * c),
        }
        for b in DECODE_BATCHES
        for c in DECODE_CONTEXTS
        if b * c <= cap or cap == 0
    ]
    pf = fit_nonnegative(
        [prefill_features(s["seq_lens"]) for s in prefill], [s["latency_s"] for s in prefill]
    )
    df = fit_nonnegative(
        [decode_features(s["batch_size"], s["context_tokens"]) for s in decode],
        [s["latency_s"] for s in decode],
    )
    return {
        "prefill": {**pf, "samples": prefill},
        "decode": {**df, "samples": decode},
        "kv_capacity_tokens": cap,
    }


def _source(m: Shape) -> dict:
    """Where the figures come from and what was assumed (for people; the tuner ignores it)."""
    return {
        "summary": "DERIVED, not measured: step times computed from hardware datasheet figures, the "
        "model's shape and assumed efficiencies; use a measured profile where there is one",
        "derivation": "python -m pdserve.tuning.derive_profile (tuning/derive_profile.py): the "
        "model of experiments/derive_h100_llama3_8b.py for this model's shape",
        "publications": [
            "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 80 GB, 989.4 TFLOPS dense BF16, "
            "3.35 TB/s HBM3, NVLink 900 GB/s total (450 GB/s per direction)",
            m.source,
            "NVIDIA DGX H100: 8 GPUs a node, one 400 Gb/s ConnectX-7 (NDR InfiniBand) per GPU",
            "DistServe (Zhong et al., OSDI 2024), simdistserve/estimators/profile_data/"
            "profiler-a100-80g.distserve.json: OPT-13B tp1 on A100 prefill 0.0926 ms/token (~280 "
            "TFLOPS, ~90% of A100 peak) and a decode step of ~20 ms + 0.04 ms/request: the same "
            "a + b*tokens + c*tokens^2 / a + b*context + c*batch forms, used as a sanity check",
            "vLLM (Kwon et al., SOSP 2023): decode is bound by reading weights and KV from HBM",
        ],
        "assumptions": {
            "linear_mfu": MFU_LINEAR,
            "attention_mfu": MFU_ATTENTION,
            "hbm_efficiency": HBM_EFFICIENCY,
            "nccl_efficiency_of_nvlink": NCCL_EFFICIENCY,
            "step_overhead_s": STEP_OVERHEAD_S,
            "allreduce_latency_s": ALLREDUCE_LATENCY_S,
            "all_reduces_per_layer": 2,
            "gpu_memory_utilization": GPU_MEMORY_UTILIZATION,
            "activation_reserve_bytes_per_gpu": ACTIVATION_RESERVE,
            "inter_node_efficiency": INTER_NODE_EFFICIENCY,
            "composition": "overhead + (weights read + KV read + linear FLOPs + attention FLOPs) / tp "
            "+ all-reduces, added without overlap",
        },
        "kv_transfer": {
            "torch": "NCCL point-to-point over NVLink: 450 GB/s per direction x 0.7; NOTE pdserve's "
            "torch backend runs gloo (CPU) today: this is what a CUDA/NCCL hand-off would get",
            "shm": "same host through CPU shared memory: order of this repo's measured shm transport "
            "(5.2 GB/s, BENCHMARKS.md), a device-to-host copy on PCIe 5 is faster than that",
            "grpc": "host-staged gRPC stream: order of this repo's measured grpc transport (1.8 GB/s, "
            "BENCHMARKS.md)",
        },
    }


def build(m: Shape) -> dict:
    """The profile of `m` on H100 nodes, in the schema `pdserve profile` writes."""
    transfer = {
        "torch": {
            "bandwidth_bytes_per_s": NVLINK_BYTES_PER_S * NCCL_EFFICIENCY,
            "latency_s": 50e-6,
        },
        "shm": {"bandwidth_bytes_per_s": 5.0e9, "latency_s": 300e-6},
        "grpc": {"bandwidth_bytes_per_s": 2.0e9, "latency_s": 500e-6},
    }
    hardware = {
        "device": "gpu",
        "name": "NVIDIA H100 SXM5 80GB (derived, not measured)",
        "memory_bytes_per_device": MEMORY_BYTES,
        "usable_memory_bytes_per_device": USABLE_BYTES_PER_DEVICE,
        "peak_bf16_flops": PEAK_BF16,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "nvlink_bytes_per_s_per_direction": NVLINK_BYTES_PER_S,
        "devices_per_node": DEVICES_PER_NODE,
        "inter_node": {
            "bandwidth_bytes_per_s": INTER_NODE_BYTES_PER_S * INTER_NODE_EFFICIENCY,
            "latency_s": INTER_NODE_LATENCY_S,
        },
        "intra_node": transfer["torch"],
        "kv_cache_memory": GPU_MEMORY_UTILIZATION,
        "threads_per_rank": None,
    }
    model = {
        "id": m.id,
        "name": m.name,
        "num_layers": m.layers,
        "num_heads": m.heads,
        "num_kv_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_size": m.hidden,
        "dtype": "bfloat16",
        "weight_bytes": m.weight_bytes,
    }
    return profile_dict(
        model=model,
        kv_bytes_per_token=m.kv_bytes_per_token,
        hardware=hardware,
        tp={t: tp_entry(m, t) for t in TP_DEGREES},
        kv_transfer=transfer,
        derived=True,
        source=_source(m),
    )


def text(m: Shape) -> str:
    return json.dumps(build(m), indent=1) + "\n"


if __name__ == "__main__":
    for shape, name in FILES.items():
        (PROFILES / name).write_text(text(shape))
        print(f"wrote {PROFILES / name}")
