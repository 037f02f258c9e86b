"""Tiny random models with random LoRA adapters written by PEFT itself (never by hand), and HF +
PEFT's greedy continuations under each adapter: the references the engine's LoRA path
(engine/lora.py) must match (tests/unit/test_lora.py, tests/integration/test_lora_cluster.py).

`lora_family(path, kind)` saves a base model of an ARCH_KINDS kind (tests/helpers/arch.py) and two
adapters of rank 8 with random A and B (`init_lora_weights=False`: PEFT's default makes B zero,
an adapter that changes nothing), on the attention and dense MLP projections (attention only for
a mixture of experts, whose MLPs are experts), and returns the paths and the PEFT models.

Not a test module: imported as `from helpers.lora import ...`.
"""

from __future__ import annotations

import os

import torch

from helpers.arch import ARCH_SCALE, build_arch_model
from helpers.models import LazyGreedy, random_prompts

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ADAPTERS = ("sql", "poem")  # the two adapters' names
LORA_NEW = 16  # greedy tokens compared per prompt
MOE_KINDS = ("mixtral", "qwen2-moe", "qwen3-moe", "qwen3.5-moe", "lfm2-moe")
# a Qwen3.5 hybrid's Gated DeltaNet projections (its full-attention layers take ATTN)
LINEAR_ATTN = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# Nemotron-H's layers' mixers (backbone.layers.N.mixer.X; PEFT matches the regex whole): the
# Mamba2 layers' in_proj (PEFT refuses their out_proj on a Mamba-based model_type, nemotron_h
# among them), attention's, the ReLU-squared MLP's up and down, and not the experts' (whose
# shared expert's up_proj sits a level lower: mixer.shared_experts.up_proj)
NEMOTRON_MIXERS = r".*\.mixer\.(in_proj|q_proj|k_proj|v_proj|o_proj|up_proj|down_proj)"


def make_adapter(base_dir: str, kind: str, out_dir: str, seed: int, targets=None, r: int = 8):
    """A random PEFT LoRA adapter of the model at base_dir, saved to out_dir; returns the PEFT
    model (float32, eval) for references."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if targets is None:
        targets = ATTN if kind in MOE_KINDS else ATTN + MLP
        if kind.startswith("qwen3.5"):
            targets = targets + LINEAR_ATTN
        if kind == "granite-4.0-h":  # (the Mamba2 mixers' in_proj and out_proj)
            targets = ATTN + ["in_proj", "out_proj"]
        if kind.startswith("lfm2"):  # (LFM2's names: out_proj in attention and convolution)
            targets = ["q_proj", "k_proj", "v_proj", "out_proj", "in_proj"]
            targets += [] if kind in MOE_KINDS else ["w1", "w2", "w3"]
        if kind == "nemotron-h":  # (each layer's mixer: Mamba2, attention or MLP; not experts)
            targets = NEMOTRON_MIXERS
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_modules=targets if isinstance(targets, str) else list(targets),
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # larger than PEFT's random init, so each adapter changes the tokens
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(out_dir)
    return peft_model.eval()


def lora_family(path, kind: str = "llama"):
    """(base dir, {adapter name: dir}, {adapter name or "base": HF/PEFT model}) under `path`."""
    base = os.path.join(path, "base")
    hf = build_arch_model(base, kind, initializer_range=ARCH_SCALE)
    dirs, models = {}, {"base": hf}
    for i, name in enumerate(ADAPTERS):
        dirs[name] = os.path.join(path, name)
        models[name] = make_adapter(base, kind, dirs[name], seed=100 + i)
    return base, dirs, models


def lora_prompts() -> list[list[int]]:
    return random_prompts([5, 33, 70], seed=41)


def lora_refs(models: dict, prompts) -> dict:
    """{adapter name or "base": [HF + PEFT greedy continuation of each prompt]}."""
    return {k: LazyGreedy(m, prompts, LORA_NEW) for k, m in models.items()}


def lora_engine(modules: dict, max_loras: int, max_model_len: int) -> dict:
    """The engine keywords of a LoRA cluster test's workers: float32, LoRA on with `modules`
    (name -> adapter folder), `max_loras` adapters a step, ranks up to 8."""
    return dict(
        dtype="float32",
        enable_lora=True,
        lora_modules=dict(modules),
        max_loras=max_loras,
        max_lora_rank=8,
        max_model_len=max_model_len,
    )


def lora_families(tmp_path_factory):
    """kind -> (base dir, {adapter: dir}, prompts, lora_refs), each kind built once (a test
    module's `family` fixture returns this)."""
    cache: dict = {}

    def get(kind):
        if kind not in cache:
            base, dirs, models = lora_family(tmp_path_factory.mktemp(f"lora-{kind}"), kind)
            prompts = lora_prompts()
            cache[kind] = (base, dirs, prompts, lora_refs(models, prompts))
        return cache[kind]

    return get


def lora_llm(base, **kw):
    """An engine on `base` with LoRA on (ranks up to 8), block size 4, no speculation."""
    from helpers.engine import KV
    from pdserve.engine import LLM

    kw = {
        "kv_cache_memory": KV,
        "block_size": 4,
        "enable_lora": True,
        "max_lora_rank": 8,
        "speculative_config": None,
        **kw,
    }
    return LLM(base, **kw)


def mixed_batch(llm, dirs, prompts) -> dict:
    """Every prompt under the base and under each adapter, all in one generate (one batch)."""
    from helpers.engine import greedy
    from pdserve.engine import LoRARequest

    keys, all_prompts, loras = [], [], []
    for k in ("base", *ADAPTERS):
        req = None if k == "base" else LoRARequest(k, ADAPTERS.index(k) + 1, dirs[k])
        for i, p in enumerate(prompts):
            keys.append((k, i))
            all_prompts.append(p)
            loras.append(req)
    outs = llm.generate(all_prompts, greedy(LORA_NEW), use_tqdm=False, lora_request=loras)
    got: dict = {}
    for (k, _), o in zip(keys, outs):
        got.setdefault(k, []).append(o.outputs[0].token_ids)
    return got
