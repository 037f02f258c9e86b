"""Offline checks of a deployment config, run before anything starts: the pool shapes the workers
refuse whatever the model (placement_problems) and what would keep a pool's workers from starting
with a given model (fit_problems), both found without loading weights. `pdserve up` runs them
before it starts Ray, and `pdserve tune` on the placement it writes; they keep no state and import the engine's defaults only when called."""

from __future__ import annotations

from pdserve.deploy.config.schema import DeployConfig


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB"


def placement_problems(config: DeployConfig) -> list[str]:
    """Pool shapes the workers refuse whatever the model, found from the config alone: a
    disaggregated worker hands its KV off through CPU memory when it is tensor-parallel (every
    rank's pool mapped from a file under kv_cache_shared_dir) and a decode worker does with the
    shm backend, and the engine refuses kv_cache_shared_dir on a GPU (engine/engine_core.py:
    "KV hand-off is CPU-only for now"). Colocated workers hand nothing off: any tp runs."""
    problems = []
    if config.pools.colocated is not None:
        return problems
    for key, pool in config.worker_pools():
        if pool.resources.num_gpus <= 0:
            continue
        if pool.pp > 1:
            problems.append(
                f"pools.{key}.pp: {pool.pp} on GPUs is refused today (pipeline stages have run "
                f"only on CPUs, over gloo; their CUDA/NCCL path has never run on a GPU): set "
                f"pools.{key}.pp to 1, or run the pool on CPUs (resources.num_gpus: 0)"
            )
        elif pool.tp > 1:
            problems.append(
                f"pools.{key}.tp: {pool.tp} on GPUs is refused today (a tensor-parallel "
                f"{key} worker hands its KV off through CPU shared memory, which GPU KV pools "
                f"cannot use): set pools.{key}.tp to 1, or use pools.colocated"
            )
        elif key == "decode" and config.kvtransfer.backend == "shm":
            problems.append(
                "kvtransfer.backend: 'shm' with GPU decode workers is refused today (the shm "
                "hand-off maps KV pools in CPU memory): use 'grpc' or 'torch'"
            )
    return problems


def fit_problems(config: DeployConfig, hf: dict, cpu_memory_bytes: int | None = None) -> list[str]:
    """What would make a pool's workers refuse to start with this model (its config.json as a
    dict), found without loading weights: the pool shapes no model runs (placement_problems),
    TP must divide the heads, and one sequence of
    max_model_len must fit each rank's KV blocks, computed as engine/model_runner.py does. A
    kv_cache_memory fraction is checked on CPU pools against `cpu_memory_bytes` (this machine's
    free memory; None: not checked), never on GPU pools: it depends on the GPU."""
    # (imports torch: only when a check runs)
    from pdserve.engine.config import DEFAULT_CPU_KV_BYTES, MLA_ARCHITECTURES

    archs = hf.get("architectures") or [""]
    hf = hf.get("text_config", hf)
    heads = hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or heads
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    latent = archs[0] in MLA_ARCHITECTURES  # one latent a token, on every rank (ModelConfig)
    if latent:
        kv_heads, head_dim = 1, (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) // 2
    limit = hf.get("max_position_embeddings")
    problems = placement_problems(config)
    for key, pool in config.worker_pools():
        tp, bs, gpu = pool.tp, pool.block_size, pool.resources.num_gpus > 0
        if gpu and config.quantization in ("int8", "int4", "bf16"):
            problems.append(
                f"pools.{key}: quantization {config.quantization!r} runs on CPU only, and "
                f"this pool has GPUs; remove quantization or use dtype bfloat16"
            )
            continue
        if heads % tp or (kv_heads % tp and not latent):
            fits = [d for d in range(1, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
            problems.append(
                f"pools.{key}.tp: {tp} does not divide the model's {heads} attention "
                f"heads and {kv_heads} key/value heads; use one of {fits}"
            )
            continue
        max_len = pool.max_model_len or limit
        if limit and max_len > limit:
            problems.append(
                f"pools.{key}.max_model_len: {max_len} is more than the model's "
                f"max_position_embeddings ({limit}); lower it"
            )
            continue
        kv = pool.kv_cache_memory
        if kv is None:
            kv = None if gpu else DEFAULT_CPU_KV_BYTES
        elif isinstance(kv, float):
            kv = int(kv * cpu_memory_bytes) if cpu_memory_bytes and not gpu else None
        if kv is None or not max_len:
            continue
        # the KV cache's dtype: the activations' unless set; "auto" activations are bfloat16 on
        # a GPU, float32 on a CPU (engine/config.py). Under dtype "auto" a CPU worker may choose
        # a bfloat16 cache at start (engine/kv_dtype.py), which holds twice the blocks: float32,
        # the fewer blocks, is what is checked
        kv_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        fp32 = kv_dtype in ("float32", "fp32") or (kv_dtype == "auto" and not gpu)
        itemsize = 4 if fp32 else 2
        # each rank holds the KV of its stage's layers, sized by the largest stage as
        # engine/model_runner.py sizes it (every stage then has the same number of blocks)
        layers = -(-hf["num_hidden_layers"] // pool.pp)
        per_block = 2 * layers * bs * max(1, kv_heads // tp) * head_dim * itemsize
        blocks, need = kv // per_block, -(-max_len // bs)
        if blocks < need:
            shorter = f" or pools.{key}.max_model_len to at most {blocks * bs}" if blocks else ""
            per_stage = f" (each rank: {layers} layers of a stage)" if pool.pp > 1 else ""
            problems.append(
                f"pools.{key}: kv_cache_memory of {kv} bytes ({_mib(kv)}) holds {blocks} KV blocks "
                f"of {bs} tokens{per_stage}, but one sequence of max_model_len {max_len} needs {need}: set "
                f"pools.{key}.kv_cache_memory to at least {need * per_block} "
                f"({_mib(need * per_block)}){shorter}"
            )
    return problems
