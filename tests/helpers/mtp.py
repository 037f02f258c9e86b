"""Tiny random targets that carry an MTP layer (DeepSeek V3's and GLM-4.5's checkpoint format:
`model.layers.{L}.*` past the last layer), and what that layer guesses computed with the
transformers decoder layer of the same family (tests/integration/test_mtp.py), sharing no code with
engine/models/mtp.py."""

from __future__ import annotations

import copy
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

from helpers.arch import ARCH_SCALE, build_arch_model


def make_mtp_target(path, kind: str, seed: int = 5):
    """Saves a random `kind` target (tests/helpers/arch.py) whose checkpoint carries one MTP
    layer to `path`: DeepSeek's layout for "deepseek-v3" and the GLM kinds, Qwen's for the
    Qwen3.5 and Qwen3-Next kinds. Returns (the HF target, the reference's tensors: "step", the
    layer's forward in transformers' terms, for tests/helpers/eagle.py check_guesses)."""
    from transformers import AutoModelForCausalLM

    qwen = kind.startswith("qwen")
    # (weights at ARCH_SCALE: at the default 0.02 the layer's attention barely moves its
    # output, and a cleared or wrong context would go unseen)
    extra = {} if qwen else {"num_nextn_predict_layers": 1}
    hf = build_arch_model(path, kind, initializer_range=ARCH_SCALE, **extra)
    cfg = hf.config
    index, h, eps = cfg.num_hidden_layers, cfg.hidden_size, cfg.rms_norm_eps
    # the MTP layer's decoder layer: layer `index` of the same family one layer deeper, drawn as
    # build_arch_model draws a model and saved in the checkpoint's names
    deeper_cfg = copy.deepcopy(cfg)
    deeper_cfg.num_hidden_layers = index + 1
    deeper_cfg._attn_implementation = "eager"
    if qwen:  # (a full-attention layer, as every Qwen MTP layer is)
        deeper_cfg.layer_types = [*cfg.layer_types, "full_attention"]
    elif getattr(cfg, "mlp_layer_types", None):  # (GLM-4.7 Flash's: the MTP layer is sparse)
        deeper_cfg.mlp_layer_types = [*cfg.mlp_layer_types, "sparse"]
    torch.manual_seed(seed)
    deeper = AutoModelForCausalLM.from_config(deeper_cfg, dtype=torch.float32).eval()
    layer = deeper.model.layers[index]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5, generator=g)
            elif "norm" in name and p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5, generator=g)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp)
        saved = load_file(os.path.join(tmp, "model.safetensors"))
    base = 0.0 if qwen else 1.0  # (Qwen's norms scale by 1 + w)
    own = {
        "enorm": base + torch.randn(h, generator=g) * 0.1,
        "hnorm": base + torch.randn(h, generator=g) * 0.1,
        "fc": torch.randn(h, 2 * h, generator=g) * 0.1,
        "norm": base + torch.randn(h, generator=g) * 0.1,
    }
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layer_prefix = f"model.layers.{index}."
    if qwen:
        names = dict(
            enorm="pre_fc_norm_embedding", hnorm="pre_fc_norm_hidden", fc="fc", norm="norm"
        )
        for k, v in saved.items():
            if k.startswith(layer_prefix):
                tensors["mtp.layers.0." + k[len(layer_prefix) :]] = v
        tensors.update({f"mtp.{names[k]}.weight": v for k, v in own.items()})
    else:
        names = dict(enorm="enorm", hnorm="hnorm", fc="eh_proj", norm="shared_head.norm")
        tensors.update({k: v for k, v in saved.items() if k.startswith(layer_prefix)})
        tensors.update({f"{layer_prefix}{names[k]}.weight": v for k, v in own.items()})
        # (the released checkpoints' copies of the target's embedding and LM head)
        embed = hf.get_input_embeddings().weight.detach().clone()
        tensors[layer_prefix + "embed_tokens.weight"] = embed
        tensors[layer_prefix + "shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    def norm(x, name):
        w = own[name] + 1.0 if qwen else own[name]
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def step(x0: torch.Tensor, inputs: list[int], zeroed: int = 0):
        """(logits, what a further guess reads) of the MTP layer at positions 0..n-1: position
        p reads token inputs[p] and row x0[p] (the target's final normed state, or the layer's
        own output), and attends causally to the layer's positions before it."""
        assert zeroed == 0, "the reference models no cleared cache"
        n = len(inputs)
        with torch.no_grad():
            e = hf.get_input_embeddings().weight[torch.tensor(inputs)]
            x = torch.cat([norm(e, "enorm"), norm(x0, "hnorm")], -1)
            x = (x @ own["fc"].T)[None]
            positions = torch.arange(n)[None]
            rotary = deeper.model.rotary_emb(x, positions)
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            out = out[0] if isinstance(out, tuple) else out
            out = out[0]
            normed = norm(out, "norm")
            logits = normed @ hf.lm_head.weight.T
        return logits, normed if qwen else out

    return hf, {"step": step, "aux": None}
