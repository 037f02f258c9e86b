"""Tiny checkpoints in the quantized formats the engine reads (engine/loader/prequantized.py),
each beside an HF model holding the float weights the format stands for, as the reference.

`quantized_copy(src, dst, fmt, hf)` writes the float checkpoint `hf` (saved in `src` with its
tokenizer) to `dst` quantized as `fmt` and returns a float32 HF model whose weights are the
dequantized values. The reference never goes through a packer or an unpacker: GPTQ's and AWQ's
weights are drawn as integers, zero points and scales first, and the reference is
`(q - zero) * scale` computed from those; compressed-tensors' checkpoints are written by the
compressed-tensors library itself (its `ModelCompressor`, as llm-compressor saves them) and the
reference is that library's own quantize-dequantize of the float weight; FP8's is the FP8 value
times its block's scale. So a reader that unpacks in a wrong order, or with a wrong offset,
gives other weights than the reference and the engine's tokens differ from HF's.
"""

from __future__ import annotations

import copy
import json
import pathlib
import shutil

import torch

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packing order, as its pack step writes it
FORMATS = (
    "gptq",
    "gptq-actorder",
    "gptq8",
    "gptq2",
    "gptq-v2",
    "awq",
    "ct-w4-asym",
    "ct-w8",
    "ct-fp8",
    "ct-fp8-tensor",
    "fp8",
)
GPTQ_BITS = {"gptq": 4, "gptq-actorder": 4, "gptq8": 8, "gptq2": 2, "gptq-v2": 4}


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """values [.., n, ..] in [0, 2^bits) packed lowest bits first, 32 / bits to an int32 word
    along `dim` (GPTQ's layout; the loop is plain so that its order is plain to read)."""
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    words = torch.zeros(*v.shape[:-1], v.shape[-1] // per, dtype=torch.int64)
    for j in range(per):
        words |= v[..., j::per] << (bits * j)
    # as the int32 two's complement the files hold
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words.movedim(-1, dim)


def _linears(hf) -> dict[str, torch.nn.Linear]:
    return {
        name: m
        for name, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LINEARS
    }


def _quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether a checkpoint tensor is a linear's weight the formats quantize (experts' too)."""
    module, _, part = name.rpartition(".")
    return part == "weight" and tensor.dim() == 2 and module.rsplit(".", 1)[-1] in LINEARS


def _draw(out: int, n_in: int, bits: int, groups: int, g: torch.Generator, low_zero: int = 0):
    """Random integers, zero points and float16 scales for a weight [out, in]."""
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (n_in, out), generator=g)
    zeros = torch.randint(low_zero, top + 1, (groups, out), generator=g)
    scales = (torch.rand(groups, out, generator=g) * 0.02 + 0.005).half()
    return q, zeros, scales


def _gptq(
    tensors: dict, name: str, w, bits: int, actorder: bool, g, v2: bool = False
) -> torch.Tensor:
    out, n_in = w.shape
    size = 32
    # the original GPTQ format stores each zero point minus one (a zero of 0 does not survive
    # that, so its quantizers never write one)
    q, zeros, scales = _draw(out, n_in, bits, n_in // size, g, low_zero=1)
    g_idx = torch.arange(n_in) // size
    if actorder:  # act-order: the inputs' groups in a permuted order
        g_idx = g_idx[torch.randperm(n_in, generator=g)]
    tensors[f"{name}.qweight"] = _pack(q, bits, 0)
    tensors[f"{name}.qzeros"] = _pack(zeros if v2 else zeros - 1, bits, 1)
    tensors[f"{name}.scales"] = scales
    tensors[f"{name}.g_idx"] = g_idx.to(torch.int32)
    return ((q - zeros[g_idx]).float() * scales[g_idx].float()).t()


def _awq(tensors: dict, name: str, w, g) -> torch.Tensor:
    out, n_in = w.shape
    size = 32
    q, zeros, scales = _draw(out, n_in, 4, n_in // size, g)
    order = [c + k for c in range(0, out, 8) for k in AWQ_ORDER]
    tensors[f"{name}.qweight"] = _pack(q[:, order], 4, 1)
    tensors[f"{name}.qzeros"] = _pack(zeros[:, order], 4, 1)
    tensors[f"{name}.scales"] = scales
    gi = torch.arange(n_in) // size
    return ((q - zeros[gi]).float() * scales[gi].float()).t()


def _fp8(tensors: dict, name: str, w, block: int) -> torch.Tensor:
    w = w.float()
    out, n_in = w.shape
    blocks = w.reshape(out // block, block, n_in // block, block).abs().amax(dim=(1, 3))
    scale = blocks / 448.0
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    fp8 = (w / full).to(torch.float8_e4m3fn)
    tensors[f"{name}.weight"] = fp8
    tensors[f"{name}.weight_scale_inv"] = scale
    return fp8.float() * full


def _copy_beside(src: pathlib.Path, dst: pathlib.Path, qc: dict | None) -> None:
    """src's config (with `qc` as its quantization_config) and tokenizer files into dst."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if qc is not None:
        config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))


QUANT_CONFIGS = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},
    "gptq-actorder": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
    "gptq8": {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": False},
    "gptq2": {"quant_method": "gptq", "bits": 2, "group_size": 32, "desc_act": False},
    "gptq-v2": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "checkpoint_format": "gptq_v2",
    },
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "version": "gemm",
        "zero_point": True,
    },
    "fp8": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    },
}


def quantized_copy(src, dst, fmt: str, hf, seed: int = 0):
    """`hf` (saved in `src`) written to `dst` quantized as `fmt`; returns the reference HF model
    (float32, the dequantized weights). Every linear of the saved checkpoint is quantized, a
    mixture of experts' experts included (saved one tensor per expert, as quantized MoE
    checkpoints hold them); the reference is HF's own load of the dequantized checkpoint."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    src, dst = pathlib.Path(src), pathlib.Path(dst)
    if fmt.startswith("ct-"):
        return _compressed_tensors(src, dst, fmt, hf)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(src / "model.safetensors"))
    packed, dense = {}, {}
    for name, tensor in tensors.items():
        if not _quantized(name, tensor):
            packed[name] = dense[name] = tensor
            continue
        module = name[: -len(".weight")]
        if fmt in GPTQ_BITS:
            bits = GPTQ_BITS[fmt]
            actorder, v2 = fmt == "gptq-actorder", fmt == "gptq-v2"
            dense[name] = _gptq(packed, module, tensor, bits, actorder, g, v2)
        elif fmt == "awq":
            dense[name] = _awq(packed, module, tensor, g)
        else:
            dense[name] = _fp8(packed, module, tensor, block=16)
    _copy_beside(src, dst, QUANT_CONFIGS[fmt])
    save_file({k: v.contiguous() for k, v in packed.items()}, str(dst / "model.safetensors"))
    ref_dir = dst.parent / f"{dst.name}-reference"
    _copy_beside(src, ref_dir, None)
    save_file({k: v.contiguous() for k, v in dense.items()}, str(ref_dir / "model.safetensors"))
    return AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()


def _compressed_tensors(src: pathlib.Path, dst: pathlib.Path, fmt: str, hf):
    """The checkpoint as llm-compressor writes it, by compressed-tensors' own code; the reference
    is compressed-tensors' quantize-dequantize of each float weight."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = {
        "ct-w4-asym": dict(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=32
        ),
        "ct-w8": dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
        "ct-fp8": dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
        "ct-fp8-tensor": dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
    }[fmt]
    form = {
        "ct-w4-asym": "pack-quantized",
        "ct-w8": "int-quantized",
        "ct-fp8": "float-quantized",
        "ct-fp8-tensor": "float-quantized",
    }
    model = copy.deepcopy(hf)
    ref = copy.deepcopy(hf)
    targets = [f"re:.*{name}$" for name in LINEARS]
    scheme = QuantizationScheme(targets=targets, weights=QuantizationArgs(**args))
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}))
    ref_linears = _linears(ref)
    for name, m in _linears(model).items():
        w, wargs = m.weight.data, m.quantization_scheme.weights
        if wargs.strategy == "group":
            parts = w.view(w.shape[0], -1, wargs.group_size)
            scale, zero = calculate_qparams(parts.amin(-1), parts.amax(-1), wargs)
        elif wargs.strategy == "tensor":
            scale, zero = calculate_qparams(w.amin(), w.amax(), wargs)
        else:
            scale, zero = calculate_qparams(w.amin(-1, True), w.amax(-1, True), wargs)
        m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
        if hasattr(m, "weight_zero_point"):
            zp = m.weight_zero_point
            m.weight_zero_point.data = zero.to(zp.dtype).reshape(zp.shape)
        zp = getattr(m, "weight_zero_point", None)
        with torch.no_grad():
            ref_linears[name].weight.copy_(fake_quantize(w, m.weight_scale, zp, wargs))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=form[fmt])
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(str(dst))
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return ref.eval()


def engine_greedy(model_dir, prompts: list[list[int]], new: int, **engine) -> list[list[int]]:
    """The engine's greedy tokens (float32) for `prompts` on the checkpoint in `model_dir`."""
    from helpers.engine import KV, greedy
    from pdserve.engine import LLM

    llm = LLM(str(model_dir), dtype="float32", kv_cache_memory=KV, **engine)
    try:
        outs = llm.generate(prompts, greedy(new), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()
