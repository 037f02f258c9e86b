"""Decode attention on a GPU: the Triton kernel reading the paged cache in place against the torch
path it replaced (gather each row's blocks into a padded tensor, then SDPA), one layer.

    python -m benchmarks.engine.paged_decode_bench --out paged_decode.json

Shapes: SmolLM2 (9 query heads, 3 KV heads of 64) and Llama-3-8B (32 / 8 of 128), bf16 cache and
queries, 16-token blocks scattered over the pool, every row at the same context length; batch 1,
32 and 256 at 512 and 2048 tokens. Each figure is the median of CUDA-event timings of 50 launches
after 5 warm-ups; GB/s counts the K/V bytes the rows attend (what either path must read at
least). Needs CUDA; BENCHMARKS.md "The engine on a GPU" quotes it.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from benchmarks.bench_common import write_result
from pdserve.engine.kernels import paged_decode_triton as kernel

SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}
BLOCK = 16


def gather_sdpa(q, cache, tables, lens, scale):
    """The torch path (engine/attention.py before the kernel), mask built as the runner builds it."""
    n, hq, d = q.shape
    hkv = cache.shape[3]
    kv = cache[:, tables].view(2, n, -1, hkv, d).transpose(2, 3)
    span = torch.arange(kv.shape[3], device=q.device)
    mask = (span[None, :] < lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o.squeeze(2)


def timed(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def case(shape: str, batch: int, ctx: int) -> dict:
    hq, hkv, d = SHAPES[shape]
    per_row = ctx // BLOCK
    pool = torch.randperm(batch * per_row + 8, device="cuda")
    cache = torch.randn(2, batch * per_row + 8, BLOCK, hkv, d, device="cuda", dtype=torch.bfloat16)
    tables = pool[: batch * per_row].view(batch, per_row).contiguous()
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.long)
    q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
    scale = d**-0.5
    ours = kernel.paged_decode(q, cache, tables, lens, scale)
    theirs = gather_sdpa(q, cache, tables, lens, scale)
    err = float((ours.float() - theirs.float()).abs().max())
    t_ours = timed(lambda: kernel.paged_decode(q, cache, tables, lens, scale))
    t_theirs = timed(lambda: gather_sdpa(q, cache, tables, lens, scale))
    kv_bytes = 2 * batch * ctx * hkv * d * 2
    return {
        "shape": shape,
        "batch": batch,
        "context": ctx,
        "splits": kernel.num_splits(batch, hkv, per_row * BLOCK),
        "triton_ms": round(t_ours, 4),
        "gather_sdpa_ms": round(t_theirs, 4),
        "speedup": round(t_theirs / t_ours, 2),
        "triton_gbps": round(kv_bytes / t_ours / 1e6, 1),
        "max_abs_diff": err,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rows = []
    for shape in SHAPES:
        for batch in (1, 32, 256):
            for ctx in (512, 2048):
                rows.append(case(shape, batch, ctx))
                print(rows[-1], flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": rows}
    write_result(args.out, report, "benchmarks.engine.paged_decode_bench", argv)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
