"""Tiny random models of every architecture the engine serves, and their HF greedy references
(tests/helpers/arch_checks.py's checks, tests/integration/test_architectures_tp.py).

ARCH_KINDS names each kind with its HF `model_type` and the config keys that make it that kind
(a sliding window shorter than the longer prompts, soft-capping, experts). `build_arch_model`
saves a random model of a kind with the word-level tokenizer of tests/helpers/models.py, and draws every
norm weight and bias at random too, so a norm read with the wrong offset, or a bias left out,
changes the tokens. `arch_refs` gives the prompts (mixed lengths, three sharing a 48-token prefix)
and HF's own greedy continuations of ARCH_NEW tokens.

Not a test module: imported as `from helpers.arch import ...` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations

import torch

from helpers.models import SHARED_PREFIX, TINY_CONFIG, LazyGreedy, random_prompts

# greedy tokens compared with HF's: past a 1-token prompt's 32-token sliding window, and every
# prompt's decode reads a window and blocks of 4 and 16 from the first step (64 cost the fast
# lane twice the HF reference's time for no other path)
ARCH_NEW = 32
# The weights' scale (HF's initializer_range) of the models whose tokens are compared: at HF's
# default 0.02 the MLPs move the logits by ~0.007, and a dropped shared-expert gate or a missing
# all_reduce still gave HF's tokens; at 0.1 both change them. The quantized modes' bounds hold
# at the default scale (QUANT_SCALE), where the llama tests set them.
ARCH_SCALE = 0.1
QUANT_SCALE = 0.02
ARCH_LENGTHS = (1, 7, 33, 100, 150)  # (longer than the sliding windows below)

_MLA = {
    "num_key_value_heads": 4,  # (transformers' MLA expands every head's key and value)
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
}

# kind: (HF model_type, config keys over TINY_CONFIG's); 4 query heads of 16, 2 key/value heads
ARCH_KINDS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "mistral-sw": ("mistral", {"sliding_window": 32}),
    "qwen2-sw": (
        "qwen2",
        {
            "num_hidden_layers": 3,
            "use_sliding_window": True,
            "sliding_window": 32,
            "max_window_layers": 1,  # layer 0 full, layers 1 and 2 slide
        },
    ),
    "qwen3": ("qwen3", {}),
    "granite": (
        "granite",
        {
            "embedding_multiplier": 6.0,
            "attention_multiplier": 0.05,
            "residual_multiplier": 0.4,
            "logits_scaling": 4.0,
        },
    ),
    "olmo2": ("olmo2", {}),
    # a sliding layer with RoPE, then a full one without
    "exaone4": (
        "exaone4",
        {"sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "olmo3": (  # a sliding layer with a rope of its own, then a full one
        "olmo3",
        {
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    # layer 0 with RoPE, layer 1 without (no_rope_layers [1, 0])
    "smollm3": ("smollm3", {"no_rope_layer_interval": 2}),
    "gemma2": (
        "gemma2",
        {
            "sliding_window": 32,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 24,
        },
    ),
    "gemma3": (
        "gemma3_text",
        {
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 24,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        },
    ),
    "phi3": ("phi3", {}),
    "phi3-partial": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 32}),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 128,
            "mlp_only_layers": [1],  # layer 0 sparse, layer 1 dense
        },
    ),
    "qwen3-moe": (
        "qwen3_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,  # layer 0 dense, layer 1 sparse
        },
    ),
    # multi-head latent attention: a 48-value latent (32 + 16 rotary) cached per token; layer 0
    # dense, layer 1 eight experts in four groups, two of them open to each token
    "deepseek-v2": (
        "deepseek_v2",
        {
            **_MLA,
            "q_lora_rank": None,  # (V2-Lite's: one q_proj)
            "n_shared_experts": 2,
            "topk_method": "group_limited_greedy",
            "routed_scaling_factor": 1.5,
        },
    ),
    "deepseek-v3": (
        "deepseek_v3",
        {
            **_MLA,
            "q_lora_rank": 64,
            "n_shared_experts": 1,
            "routed_scaling_factor": 2.5,
            "norm_topk_prob": True,
            "rope_parameters": {  # YaRN with mscale_all_dim, as V3 ships (positions past 128)
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
    ),
    # V3's mixture of experts under Llama's attention: partial rotary (half of each head), q/k
    # bias, q/k norms per head; eight experts in two groups, one group open to each token
    "glm4-moe": (
        "glm4_moe",
        {
            "use_qk_norm": True,
            "attention_bias": True,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_intermediate_size": 32,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
            "routed_scaling_factor": 1.8,
        },
    ),
    # GLM-4.7 Flash: DeepSeek V3's latent attention and gate, layers typed dense or sparse
    "glm4-moe-lite": (
        "glm4_moe_lite",
        {
            **{k: v for k, v in _MLA.items() if k != "first_k_dense_replace"},
            "q_lora_rank": 64,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.8,
            "mlp_layer_types": ["dense", "sparse"],
        },
    ),
    # attention sinks, q/k/v/o biases, a sliding layer then a full one, YaRN; four biased experts,
    # two a token, behind gpt-oss's clamped SwiGLU (a limit low enough that both clamps bite)
    "gpt-oss": (
        "gpt_oss",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "full_attention"],
            "swiglu_limit": 0.5,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
    ),
    # Llama 4: layers 0, 1 and 3 rotate (pairs of neighbours) and attend in chunks of 16, with
    # weightless q/k norms; layer 2 has no rotary, attends everything and tunes its queries'
    # temperature (a step every 3 positions, strongly); layers 1 and 3 route each token to one of four
    # experts (the sigmoid of its logit weighing its input) beside a shared expert, 0 and 2 are
    # dense and twice as wide; llama3 rope scaling
    "llama4": (
        "llama4_text",
        {
            "num_hidden_layers": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "intermediate_size": 48,
            "intermediate_size_mlp": 96,
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 16,
            "no_rope_layers": [1, 1, 0, 1],
            "floor_scale": 3,
            "attn_scale": 2.0,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    # Ministral 3: Mistral with YaRN and Llama 4's query temperature (a step every 16 positions,
    # strongly), which its rope parameters carry
    "ministral3": (
        "ministral3",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        },
    ),
    # GLM-4 dense: four norms a layer, q/k/v biases, half of each head turned by neighbouring
    # pairs
    "glm4": ("glm4", {"attention_bias": True}),
    # Command R7B / Command A: a parallel block under a LayerNorm; layers 0 and 1 slide (window 32)
    # with rotary (neighbouring pairs), layer 2 attends everything without; scaled tied logits
    "cohere2": (
        "cohere2",
        {
            "num_hidden_layers": 3,
            "sliding_window": 32,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "logit_scale": 0.25,
        },
    ),
    # ERNIE 4.5: Llama whose rotary turns neighbouring pairs; the MoE: layer 0 dense, layer 1
    # eight experts, two a token by softmax probability plus a correction bias, beside two
    # shared ones
    "ernie4.5": ("ernie4_5", {}),
    "ernie4.5-moe": (
        "ernie4_5_moe",
        {
            "moe_num_experts": 8,
            "moe_k": 2,
            "moe_intermediate_size": 32,
            "moe_num_shared_experts": 2,
            "moe_layer_start_index": 1,
        },
    ),
    # StarCoder2: biases on every linear and LayerNorm, a plain GELU MLP, a window of 32
    "starcoder2": ("starcoder2", {"sliding_window": 32}),
    # OLMoE: OLMo 2's attention (norms over whole projections) in Llama's pre-norm layers, eight
    # experts in every layer, two a token, not renormalized
    "olmoe": ("olmoe", {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32}),
    # Hunyuan dense: per-head q/k norms after the rotary, a "dynamic" rotary with a fixed alpha
    "hunyuan": (
        "hunyuan_v1_dense",
        {
            "rope_parameters": {
                "rope_type": "dynamic",
                "rope_theta": 10000.0,
                "alpha": 1000.0,
                "factor": 1.0,
            }
        },
    ),
    # Hunyuan-A13B: the same attention; eight experts in every layer, two a token, renormalized,
    # beside a shared MLP
    "hunyuan-moe": (
        "hunyuan_v1_moe",
        {
            "num_experts": 8,
            "moe_topk": 2,
            "intermediate_size": 32,
            "rope_parameters": {
                "rope_type": "dynamic",
                "rope_theta": 10000.0,
                "alpha": 1000.0,
                "factor": 1.0,
            },
        },
    ),
    # Seed-OSS: Llama with q/k/v biases and none on the output projection
    "seed-oss": ("seed_oss", {"attention_bias": True, "attention_out_bias": False}),
    # MiniMax-M2: RMSNorms over the whole query and key projections (all heads at once), half
    # of each head rotated (its released rotary_dim), every layer eight experts with two a
    # token by sigmoid score plus a correction bias, renormalized
    "minimax-m2": (
        "minimax_m2",
        {
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "rotary_dim": 8,
        },
    ),
    # Qwen3.5: three Gated DeltaNet layers (two key heads, each serving two value heads), then
    # one gated full-attention layer with a quarter of each head rotated
    "qwen3.5": (
        "qwen3_5_text",
        {
            "num_hidden_layers": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
        },
    ),
    # Qwen3.5-MoE: the same layers over eight experts, two a token (renormalized), beside a
    # shared expert behind a sigmoid gate
    "qwen3.5-moe": (
        "qwen3_5_moe_text",
        {
            "num_hidden_layers": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    # Qwen3-Next: Qwen3.5-MoE's layers, each key head's q, k, v and z rows fused in one
    # projection (and its value heads' b and a in another)
    "qwen3-next": (
        "qwen3_next",
        {
            "num_hidden_layers": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
        },
    ),
    # LFM2: gated short convolutions (3 taps, with the biases released models leave out) in
    # layers 0 and 2, attention with per-head q/k norms in 1 and 3; the MLP's width adjusted
    "lfm2": (
        "lfm2",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "conv_bias": True,
            "block_multiple_of": 32,
        },
    ),
    # LFM2-MoE: LFM2's layers, the first dense, then eight experts, two a token by sigmoid
    # score plus a per-expert bias, renormalized and scaled
    "lfm2-moe": (
        "lfm2_moe",
        {
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "full_attention"],
            "num_dense_layers": 1,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "routed_scaling_factor": 1.5,
        },
    ),
    # OLMo Hybrid: Gated DeltaNet layers (beta up to 2) with Llama's norms, then an OLMo 3
    # attention layer (norms after each branch) without position encoding, as released
    "olmo-hybrid": (
        "olmo_hybrid",
        {
            "num_hidden_layers": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": None},
        },
    ),
    # Granite 4.0-H: Mamba2 layers (one B/C group for all sixteen heads, as released) at 0
    # and 2, attention without position encoding at 1 and 3; each layer's MLP four experts,
    # two a token, beside a shared one; Granite's four scalars
    "granite-4.0-h": (
        "granitemoehybrid",
        {
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "attention", "mamba", "attention"],
            "mamba_n_heads": 16,
            "mamba_d_head": 8,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "shared_intermediate_size": 48,
            "embedding_multiplier": 12.0,
            "residual_multiplier": 0.22,
            "attention_multiplier": 0.0625,
            "logits_scaling": 4.0,
        },
    ),
    # Bamba: Llama's layers with Mamba2 mixers (two B/C groups) in 0 and 2, attention that
    # rotates half of each head in 1 and 3
    "bamba": (
        "bamba",
        {
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "mamba_n_heads": 16,
            "mamba_d_head": 8,
            "mamba_d_state": 16,
            "mamba_n_groups": 2,
        },
    ),
    # Nemotron-H (Nemotron 3 Nano's layer kinds): each layer a norm and one mixer, Mamba2
    # (two groups), a mixture of ReLU-squared experts (four, two a token, in two groups of which
    # one is chosen, by sigmoid plus a bias, renormalized and scaled, beside a shared expert),
    # attention without position encoding, or a ReLU-squared MLP
    "nemotron-h": (
        "nemotron_h",
        {
            "num_hidden_layers": 6,
            "layers_block_type": ["mamba", "moe", "attention", "mamba", "mlp", "attention"],
            "mamba_num_heads": 8,
            "mamba_head_dim": 8,
            "ssm_state_size": 16,
            "n_groups": 2,
            "intermediate_size": 48,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "n_group": 2,
            "topk_group": 1,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 16,
            "routed_scaling_factor": 2.5,
        },
    ),
    # Falcon-H1: attention and Mamba2 (two groups, its gated norm before the gate) side by
    # side in every layer, then Llama's MLP; its muP multipliers, each away from 1
    "falcon-h1": (
        "falcon_h1",
        {
            "num_hidden_layers": 3,
            "head_dim": 16,
            "mamba_d_ssm": 64,
            "mamba_n_heads": 8,
            "mamba_d_head": 8,
            "mamba_n_groups": 2,
            "mamba_d_state": 16,
            "mamba_rms_norm": True,
            "embedding_multiplier": 1.5,
            "lm_head_multiplier": 0.7,
            "mlp_multipliers": [0.8, 1.3],
            "key_multiplier": 0.9,
            "attention_in_multiplier": 1.2,
            "attention_out_multiplier": 0.6,
            "ssm_multipliers": [0.5, 1.1, 1.4, 0.9, 0.75],
            "ssm_in_multiplier": 1.25,
            "ssm_out_multiplier": 0.85,
        },
    ),
    # Mamba2 alone (Mamba-Codestral's class): no layer attends, so no layer keeps KV
    "mamba2": (
        "mamba2",
        {
            "num_hidden_layers": 3,
            "num_heads": 16,
            "head_dim": 8,
            "n_groups": 2,
            "state_size": 16,
            "expand": 2,
        },
    ),
    # Mamba (the first: a state vector per channel, a decay per channel and state value); its
    # rank and state sizes as drawn, the draw at 16 and 8 left two logits 0.011 apart in a greedy
    # run, which the default mode's reduced precision flipped (float32 equals HF's to 1e-6)
    "mamba": (
        "mamba",
        {"num_hidden_layers": 3, "intermediate_size": 128, "time_step_rank": 4, "state_size": 8},
    ),
    # Falcon Mamba: Mamba with B, C and the time step RMS-normalized (no weights)
    "falcon-mamba": (
        "falcon_mamba",
        {"num_hidden_layers": 3, "state_size": 16, "intermediate_size": 128, "time_step_rank": 8},
    ),
    # Jamba: Mamba (B, C and the time step normed with weights) at 0 and 2, attention without
    # position encoding at 1 and 3; four experts, two a token, unrenormalized, at 1 and 3
    "jamba": (
        "jamba",
        {
            "num_hidden_layers": 4,
            "mamba_d_state": 8,
            "mamba_dt_rank": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 48,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
        },
    ),
}


# the MLA kinds run on CPU only so far (the engine refuses CUDA: tests/unit/test_mla.py)
MLA_KINDS = ("deepseek-v2", "deepseek-v3", "glm4-moe-lite")
# the hybrid kinds: linear-attention layers with per-sequence state, no prefix cache
HYBRID_KINDS = (
    "qwen3.5",
    "qwen3.5-moe",
    "qwen3-next",
    "lfm2",
    "lfm2-moe",
    "olmo-hybrid",
    "granite-4.0-h",
    "bamba",
    "nemotron-h",
    "falcon-h1",
    "mamba2",
    "mamba",
    "falcon-mamba",
    "jamba",
)
# and so do attention sinks (tests/unit/test_gpt_oss.py), Llama 4's chunked attention
# (tests/unit/test_llama4.py) and the hybrids (tests/unit/test_qwen3_5.py): CUDA refused until
# they have run there
CPU_ONLY_KINDS = (*MLA_KINDS, "gpt-oss", "llama4", *HYBRID_KINDS)


def build_arch_model(path, kind: str, seed: int = 0, labels: tuple[str, ...] = (), **overrides):
    """Save a random model of `kind` (config keys in `overrides` over the kind's) and the tiny
    word-level tokenizer to `path`; returns the HF model (float32, eval mode). With `labels`, the
    kind's *ForSequenceClassification (a random `score` head, one row per label) instead of its
    causal LM."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    model_type, extra = ARCH_KINDS[kind]
    keys = dict(
        TINY_CONFIG,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
    )
    keys.update(extra)
    keys.update(overrides)
    if labels:
        keys.update(id2label=dict(enumerate(labels)), label2id={n: i for i, n in enumerate(labels)})
    config = AutoConfig.for_model(model_type, **keys)
    torch.manual_seed(seed)
    auto = AutoModelForSequenceClassification if labels else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("sinks"):  # (gpt-oss's: HF draws them as small as the weights)
                p.normal_(0, 1.0)
            elif "norm" in name and p.dim() == 1:
                p.copy_(p + torch.randn_like(p) * 0.3)
        for name, b in model.named_buffers():  # (DeepSeek V3's gate keeps its bias as a buffer)
            if name.endswith(("e_score_correction_bias", "expert_bias")):  # (LFM2-MoE's)
                b.normal_(0, 0.5)
    model.eval().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        path
    )
    return model


def arch_prompts() -> list[list[int]]:
    prompts = random_prompts(ARCH_LENGTHS, seed=31)
    prefix = random_prompts([SHARED_PREFIX], seed=32)[0]
    return prompts + [prefix + tail for tail in random_prompts([3, 20, 41], seed=33)]


def arch_refs(tmp_path_factory, cache: dict, kind: str, scale: float = ARCH_SCALE):
    """(model_dir, hf_model, prompts, HF greedy continuations of ARCH_NEW tokens) for `kind`
    with weights drawn at `scale` (HF's initializer_range), built once per `cache`; the
    continuations are computed when a test first reads them (LazyGreedy)."""
    key = (kind, scale)
    if key not in cache:
        path = tmp_path_factory.mktemp(f"arch-{kind}")
        hf = build_arch_model(path, kind, initializer_range=scale)
        prompts = arch_prompts()
        cache[key] = (str(path), hf, prompts, LazyGreedy(hf, prompts, ARCH_NEW))
    return cache[key]
