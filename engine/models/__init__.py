"""Model families the engine serves, by the `architectures` name in a checkpoint's config.json.

ARCHITECTURES maps each HF architecture name to the module and class that implement it (imported
only when a model of that family is built). Every class takes `(ModelConfig, RotaryEmbedding)`,
and has `forward(input_ids, positions)`, `compute_logits(hidden)`, `load_weights(iterable of
(checkpoint name, tensor))` and `prepare_linears(quantization, release_dense)`; the model runner
(engine/model_runner.py) knows nothing else about a family. A family's class is checked
token-for-token against HF transformers' own by tests/unit/test_architectures.py.
"""

from __future__ import annotations

import importlib

# HF architecture name -> (module under pdserve.engine.models, class name)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Ministral3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "SeedOssForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("llama", "Phi3ForCausalLM"),
    "SmolLM3ForCausalLM": ("llama", "LlamaForCausalLM"),
    "GraniteForCausalLM": ("granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "Olmo2ForCausalLM"),
    "Olmo3ForCausalLM": ("olmo2", "Olmo3ForCausalLM"),
    "OlmoeForCausalLM": ("olmo2", "OlmoeForCausalLM"),
    "Exaone4ForCausalLM": ("olmo2", "Exaone4ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("deepseek", "DeepseekForCausalLM"),
    "Glm4MoeForCausalLM": ("deepseek", "Glm4MoeForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "GptOssForCausalLM"),
    "Cohere2ForCausalLM": ("cohere2", "Cohere2ForCausalLM"),
    "Starcoder2ForCausalLM": ("starcoder2", "Starcoder2ForCausalLM"),
    "HunYuanDenseV1ForCausalLM": ("hunyuan", "HunYuanDenseV1ForCausalLM"),
    "HunYuanMoEV1ForCausalLM": ("hunyuan", "HunYuanMoEV1ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5", "Ernie4_5_MoeForCausalLM"),
    "Llama4ForCausalLM": ("llama4", "Llama4ForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "MiniMaxM2ForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("qwen3_5", "Qwen3NextForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2", "Lfm2MoeForCausalLM"),
    "OlmoHybridForCausalLM": ("olmo2", "OlmoHybridForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("mamba_hybrid", "GraniteMoeHybridForCausalLM"),
    "BambaForCausalLM": ("mamba_hybrid", "BambaForCausalLM"),
    "NemotronHForCausalLM": ("mamba_hybrid", "NemotronHForCausalLM"),
    "FalconH1ForCausalLM": ("mamba_hybrid", "FalconH1ForCausalLM"),
    "Mamba2ForCausalLM": ("mamba_hybrid", "Mamba2ForCausalLM"),
    "MambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("mamba", "MambaForCausalLM"),
    "JambaForCausalLM": ("mamba", "JambaForCausalLM"),
}


# speculative decoding's draft heads (engine/models/eagle.py, mtp.py): built by engine/spec/eagle.py
# under these names, never served as models, so no checkpoint's own name reaches them
DRAFT_HEADS = {
    "EagleDraft": ("eagle", "EagleDraft"),
    "Eagle3Draft": ("eagle", "Eagle3Draft"),
    "MtpDraft": ("mtp", "MtpDraft"),
}


def model_class(architecture: str):
    """The class that implements `architecture` (a key of ARCHITECTURES or DRAFT_HEADS)."""
    module, name = ARCHITECTURES.get(architecture) or DRAFT_HEADS[architecture]
    return getattr(importlib.import_module(f"pdserve.engine.models.{module}"), name)
