"""Workloads: request arrivals and lengths from the bundled traces or from a distribution, and the
token ids that make them real prompts.

    reqs = load_trace("azure_conv", scale=0.1, max_prompt=512, max_output=64, max_requests=200)
    reqs = retime(reqs, rate=2.0, burstiness=1.0, seed=0)    # Poisson at 2 req/s, lengths kept
    prompts = build_prompts(reqs, vocab_size=49152, seed=0)

Lengths in the traces are in the original service's tokens; `scale` multiplies them (then caps
apply, and every request keeps at least one prompt and one output token). Mooncake `hash_ids` name
512-token prefix blocks: equal ids get equal token blocks (scaled to `scale * 512` tokens), so
prompts that share ids really share prefixes.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import pathlib
import random
from dataclasses import dataclass, replace

# shift_*: workload-shift traces built from the two azure traces by tuning/shift_trace.py
# (traces/README.md); they have an extra `phase` column the reader ignores.
TRACES = (
    "azure_conv",
    "azure_code",
    "mooncake_synthetic",
    "shift_code_conv_decode",
    "shift_code_conv_reason",
)
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # from the start of the run
    prompt_len: int
    output_len: int
    block_ids: tuple[int, ...] = ()  # shared-prefix blocks (mooncake hash_ids); () = unique prompt
    block_tokens: int = 0  # tokens per prefix block after scaling


BUNDLED_TRACES_DIR = pathlib.Path(__file__).resolve().parent / "traces"  # shipped in the package


def traces_dir() -> pathlib.Path:
    """$PDSERVE_TRACES_DIR, else the traces that ship with pdserve (tuning/traces/)."""
    env = os.environ.get("PDSERVE_TRACES_DIR")
    if env:
        return pathlib.Path(env)
    return BUNDLED_TRACES_DIR


def resolve_trace(name_or_path: str) -> pathlib.Path:
    path = pathlib.Path(name_or_path)
    if path.is_file():
        return path
    if name_or_path in TRACES:
        ext = ".jsonl" if name_or_path.startswith("mooncake") else ".csv"
        folder = traces_dir()
        for candidate in (folder / f"{name_or_path}{ext}", folder / f"{name_or_path}{ext}.gz"):
            if candidate.is_file():
                return candidate
        raise ValueError(
            f"trace {name_or_path!r} is not in {folder} (as {name_or_path}{ext} or "
            f"{name_or_path}{ext}.gz): set PDSERVE_TRACES_DIR to the folder that holds it"
        )
    raise ValueError(
        f"unknown trace {name_or_path!r}: use one of {', '.join(TRACES)} or a path to "
        f"a .csv (arrived_at,num_prefill_tokens,num_decode_tokens) or .jsonl (mooncake) "
        f"file, either of them optionally gzip-compressed (.gz)"
    )


def _scaled(n: int, scale: float, cap: int | None) -> int:
    n = max(1, round(n * scale))
    return min(n, cap) if cap else n


def load_trace(
    name_or_path: str,
    *,
    scale: float = 1.0,
    max_prompt: int | None = None,
    max_output: int | None = None,
    max_requests: int | None = None,
    start_s: float = 0.0,
) -> list[RequestSpec]:
    """The trace's requests from `start_s` on (arrival times shifted to start at 0)."""
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    for name, cap in (
        ("max_prompt", max_prompt),
        ("max_output", max_output),
        ("max_requests", max_requests),
    ):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1, got {cap}")
    path = resolve_trace(name_or_path)
    rows = _read_rows(path)  # (arrival_s, prompt, output, hash_ids)
    rows = [r for r in rows if r[0] >= start_s]
    rows.sort(key=lambda r: r[0])
    if max_requests is not None:
        rows = rows[:max_requests]
    if not rows:
        raise ValueError(f"trace {path} has no requests from {start_s}s on")
    t0 = rows[0][0]
    block_tokens = max(1, round(MOONCAKE_BLOCK_TOKENS * scale))
    return [
        RequestSpec(
            t - t0,
            _scaled(p, scale, max_prompt),
            _scaled(o, scale, max_output),
            tuple(ids),
            block_tokens if ids else 0,
        )
        for t, p, o, ids in rows
    ]


def _read_rows(path: pathlib.Path) -> list[tuple[float, int, int, list[int]]]:
    gz = path.suffix == ".gz"
    kind = pathlib.Path(path.stem).suffix if gz else path.suffix  # .jsonl or (anything else) csv
    opener = gzip.open if gz else open
    try:
        if kind == ".jsonl":
            with opener(path, "rt") as f:
                return [
                    (
                        d["timestamp"] / 1000.0,
                        int(d["input_length"]),
                        int(d["output_length"]),
                        list(d.get("hash_ids", ())),
                    )
                    for d in map(json.loads, filter(str.strip, f))
                ]
        with opener(path, "rt", newline="") as f:
            return [
                (
                    float(r["arrived_at"]),
                    int(r["num_prefill_tokens"]),
                    int(r["num_decode_tokens"]),
                    [],
                )
                for r in csv.DictReader(f)
            ]
    except (KeyError, ValueError, json.JSONDecodeError, gzip.BadGzipFile, EOFError) as e:
        raise ValueError(
            f"{path}: not a trace this reader knows ({e!r}); expected csv columns "
            f"arrived_at,num_prefill_tokens,num_decode_tokens or mooncake jsonl"
        ) from None


def arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """n arrival times at mean `rate` req/s: gamma inter-arrival gaps with shape `burstiness`
    (1 = Poisson; below 1 burstier, above 1 more regular), as in vLLM's benchmark."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


def retime(
    requests: list[RequestSpec], rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    """The same requests (lengths, order) arriving at `rate` req/s instead of the trace's times."""
    times = arrivals(len(requests), rate, burstiness, seed)
    return [replace(r, arrival_s=t) for r, t in zip(requests, times)]


def synthetic(
    n: int, rate: float, prompt_len: int, output_len: int, burstiness: float = 1.0, seed: int = 0
) -> list[RequestSpec]:
    return [RequestSpec(t, prompt_len, output_len) for t in arrivals(n, rate, burstiness, seed)]


def build_prompts(
    requests: list[RequestSpec], vocab_size: int, seed: int = 0, low: int = 1000
) -> list[list[int]]:
    """Token ids for each request: prefix blocks shared by id, the rest unique per request.
    Ids come from [low, vocab_size), above the special tokens of common vocabularies."""
    if vocab_size <= low + 1:
        low = 0
    blocks: dict[int, list[int]] = {}
    prompts = []
    for i, r in enumerate(requests):
        ids: list[int] = []
        for b in r.block_ids:
            if len(ids) >= r.prompt_len:
                break
            block = blocks.get(b)
            if block is None:
                rng = random.Random(f"{seed}/block/{b}")
                block = blocks[b] = [rng.randrange(low, vocab_size) for _ in range(r.block_tokens)]
            ids += block
        rng = random.Random(f"{seed}/request/{i}")
        ids += [rng.randrange(low, vocab_size) for _ in range(r.prompt_len - len(ids))]
        prompts.append(ids[: r.prompt_len])
    return prompts
