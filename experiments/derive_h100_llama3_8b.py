"""Writes h100_llama3_8b.json: a profile DERIVED from published hardware and model figures, not
measured (no GPU here), in the schema `pdserve profile` writes, so `pdserve tune` can plan GPU
deployments.

    python -m experiments.derive_h100_llama3_8b

Model: Llama-3-8B (32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, MLP 14336, vocab
128256, bf16). Step time = fixed overhead + weight read + linear compute + attention + TP
all-reduces, added up (no overlap assumed: on a real GPU part of it overlaps, which the efficiency
factors below are set low enough to absorb). Samples are computed on the same grid the profiler
measures and fitted by the same code, so the fit is exact by construction.
"""

from __future__ import annotations

import json
import pathlib

from pdserve.tuning.perf_model import (
    decode_features,
    fit_nonnegative,
    prefill_features,
    profile_dict,
)

OUT = pathlib.Path(__file__).resolve().parents[1] / "tuning" / "profiles" / "h100_llama3_8b.json"

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 32, 4096, 32, 8, 128, 14336, 128256
PARAMS = 8.03e9
WEIGHT_BYTES = PARAMS * 2  # bf16
KV_BYTES_PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # K and V, bf16: 131072
LINEAR_FLOPS_PER_TOKEN = 2 * (PARAMS - VOCAB * HIDDEN)  # the lm_head runs for sampled rows only
LM_HEAD_FLOPS = 2 * VOCAB * HIDDEN
ATTN_FLOPS_PER_PAIR = (
    2 * 2 * HEADS * HEAD_DIM * LAYERS / 2
)  # QK^T and PV; A counts n*(start+n), ~2x causal pairs

# H100 SXM5 80GB (NVIDIA datasheet)
PEAK_BF16 = 989.4e12
HBM_BYTES_PER_S = 3.35e12
NVLINK_BYTES_PER_S = 450e9  # per direction (900 GB/s total)
MEMORY_BYTES = 80 << 30
# assumptions (efficiency of each part; see "source" in the JSON)
MFU_LINEAR, MFU_ATTENTION, HBM_EFFICIENCY, NCCL_EFFICIENCY = 0.6, 0.5, 0.8, 0.7
STEP_OVERHEAD_S = 1.5e-3  # scheduling, sampling, kernel launches per step
ALLREDUCE_LATENCY_S = 15e-6  # per all-reduce, small messages over NVLink
GPU_MEMORY_UTILIZATION, ACTIVATION_RESERVE = 0.9, 2 << 30
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


def allreduce_s(tp: int, num_tokens: int) -> float:
    if tp == 1:
        return 0.0
    per_call = num_tokens * HIDDEN * 2 * 2 * (tp - 1) / tp / (NVLINK_BYTES_PER_S * NCCL_EFFICIENCY)
    return 2 * LAYERS * (ALLREDUCE_LATENCY_S + per_call)


def step_s(tp: int, num_tokens: int, pairs: float, num_sampled: int, kv_tokens_read: int) -> float:
    compute = (num_tokens * LINEAR_FLOPS_PER_TOKEN + num_sampled * LM_HEAD_FLOPS) / (
        PEAK_BF16 * MFU_LINEAR
    )
    attention = pairs * ATTN_FLOPS_PER_PAIR / (PEAK_BF16 * MFU_ATTENTION)
    reads = (WEIGHT_BYTES + kv_tokens_read * KV_BYTES_PER_TOKEN) / (
        HBM_BYTES_PER_S * HBM_EFFICIENCY
    )
    return STEP_OVERHEAD_S + (compute + attention + reads) / tp + allreduce_s(tp, num_tokens)


def kv_capacity_tokens(tp: int) -> int:
    free = tp * (MEMORY_BYTES * GPU_MEMORY_UTILIZATION - ACTIVATION_RESERVE) - WEIGHT_BYTES
    return int(free // KV_BYTES_PER_TOKEN)


def tp_entry(tp: int) -> dict:
    prefill = [
        {
            "seq_lens": lens,
            "num_tokens": sum(lens),
            "computed": True,
            "latency_s": step_s(tp, sum(lens), sum(n * n for n in lens), len(lens), 0),
        }
        for lens in PREFILL_GRID
    ]
    cap = kv_capacity_tokens(tp)
    decode = [
        {
            "batch_size": b,
            "context_tokens": c,
            "computed": True,
            "latency_s": step_s(tp, b, 0, b, b * c),
        }
        for b in DECODE_BATCHES
        for c in DECODE_CONTEXTS
        if b * c <= cap
    ]
    pf = fit_nonnegative(
        [prefill_features(s["seq_lens"]) for s in prefill], [s["latency_s"] for s in prefill]
    )
    # decode attention is a KV read, which step_s prices per context token: fit it as such
    df = fit_nonnegative(
        [decode_features(s["batch_size"], s["context_tokens"]) for s in decode],
        [s["latency_s"] for s in decode],
    )
    return {
        "prefill": {**pf, "samples": prefill},
        "decode": {**df, "samples": decode},
        "kv_capacity_tokens": cap,
    }


def build() -> dict:
    source = {
        "summary": "DERIVED, not measured: step times computed from hardware datasheet figures, the "
        "model's shape and assumed efficiencies; use a measured profile where there is one",
        "publications": [
            "NVIDIA H100 Tensor Core GPU datasheet: H100 SXM5 80 GB, 989.4 TFLOPS dense BF16, "
            "3.35 TB/s HBM3, NVLink 900 GB/s total (450 GB/s per direction)",
            "Meta Llama 3 8B config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, "
            "MLP 14336, vocab 128256, ~8.03B parameters",
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
        "peak_bf16_flops": PEAK_BF16,
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "nvlink_bytes_per_s_per_direction": NVLINK_BYTES_PER_S,
        "kv_cache_memory": GPU_MEMORY_UTILIZATION,
        "threads_per_rank": None,
    }
    model = {
        "id": "Meta-Llama-3-8B",
        "name": "meta-llama/Meta-Llama-3-8B",
        "num_layers": LAYERS,
        "num_heads": HEADS,
        "num_kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_size": HIDDEN,
        "dtype": "bfloat16",
    }
    return profile_dict(
        model=model,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN,
        hardware=hardware,
        tp={t: tp_entry(t) for t in TP_DEGREES},
        kv_transfer=transfer,
        derived=True,
        source=source,
    )


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1) + "\n")
    print(f"wrote {OUT}")
