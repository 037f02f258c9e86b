"""Checkpoints quantized by the field's tools, read as the float weights they stand for.

A Hub checkpoint made by AutoGPTQ or GPTQModel (`quant_method: gptq`), AutoAWQ (`awq`),
llm-compressor (`compressed-tensors`) or saved in block FP8 (`fp8`, as Qwen3's and DeepSeek's FP8
releases are) stores each linear's weight as packed integers or FP8 values with scales (and zero
points) beside them, under names the models' loaders do not know (`qweight`, `weight_packed`,
`weight_scale_inv`, ...). OpenAI's gpt-oss checkpoints (`mxfp4`) store each layer's experts the
same way, as FP4 values in `gate_up_proj_blocks` and `down_proj_blocks` with a power-of-two scale
per 32 of them in `*_scales`. `dequantized(weights, names, hf_config)` sits between the safetensors
reader and a model's `load_weights`: it gathers each quantized tensor's parts as they stream by
(the full list of names, read from the files' headers, says which belong together) and hands on
the float32 tensor they stand for, the value the format defines as its own dequantization
computes it in float32 (exact where the scales are float16 or bf16, or powers of two: a small
integer or FP4 value times one is a float32). A linear arrives as one `<module>.weight`; gpt-oss's
experts arrive as the float model's own parameters, `gate_up_proj` [experts, hidden, 2 *
intermediate] and `down_proj` [experts, intermediate, hidden], named and laid out as transformers'
GptOssForCausalLM holds them and writes them for a float checkpoint. Every other tensor passes as
it is.
So a quantized checkpoint loads into every model family, under tensor and pipeline parallelism,
and then serves in any of the engine's modes like any float checkpoint: float32 gives the
checkpoint's own model token for token, and `quantization="auto"` judges int8, int4 and bf16 on it
as on any other. A format or option this module does not read is refused at load with one line
that names it; nothing is guessed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# the formats' names for the parts of one quantized linear, by the suffix after its module name
GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
AWQ_PARTS = ("qweight", "qzeros", "scales")
CT_PARTS = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
# parts of the activations' quantization (W8A8, FP8 static scales): the weights alone are read,
# and the activations run in the engine's own precision
DROPPED_PARTS = ("input_scale", "input_zero_point", "output_scale", "k_scale", "v_scale")
# mxfp4's two parts of one quantized parameter `<p>`: `<p>_blocks` and `<p>_scales`
MXFP4_PARTS = ("blocks", "scales")
# the first transformers with gpt-oss, whose MXFP4 dequantization the mxfp4 reader calls
MXFP4_TRANSFORMERS = "4.55"
# GPTQ and AWQ pack 32 / bits values in an int32 word; AWQ's word holds the outputs in this order
# (the i-th four bits are output AWQ_ORDER[i] of its eight)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization this module does not read (the message names what)."""


def quant_method(hf_config: dict) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, or None for a float checkpoint."""
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    return str(qc.get("quant_method", "")).lower() or None


def checkpoint_weights(model_dir, keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the HF checkpoint in `model_dir` (every one whose name `keep` accepts,
    where given: a model that needs a few, as an MTP head), each quantized linear as its float32
    weight (what a model's `load_weights` takes)."""
    from .safetensors_io import checkpoint_names, iter_safetensors, load_hf_config

    hf_config = load_hf_config(model_dir)
    weights = iter_safetensors(model_dir, keep)
    if quant_method(hf_config) is None:
        return weights
    names = [n for n in checkpoint_names(model_dir) if keep is None or keep(n)]
    return dequantized(weights, names, hf_config)


def dequantized(
    weights: Iterable[tuple[str, torch.Tensor]], names: Iterable[str], hf_config: dict
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with every quantized tensor as the float32 one it stands for:
    a linear as `<module>.weight`, mxfp4's `<p>_blocks` and `<p>_scales` as `<p>` (the reader's
    `output_name`). A part's name is its module's name, one separator ('.', mxfp4's '_') and
    the part's own name (`qweight`, `blocks`, ...)."""
    method = quant_method(hf_config)
    if method is None:
        yield from weights
        return
    reader = _reader(method, hf_config["quantization_config"])
    names = list(names)
    groups = reader.groups(names)  # module -> the names of its parts, every one to arrive
    owner = {name: module for module, parts in groups.items() for name in parts}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module = owner.get(name)
        if module is None:
            if name.rsplit(".", 1)[-1] not in DROPPED_PARTS:
                yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[name[len(module) + 1 :]] = tensor
        if len(parts) == len(groups[module]):
            del pending[module]
            try:
                weight = reader.weight(module, parts)
            except UnsupportedQuantization:
                raise
            except KeyError as e:
                raise ValueError(f"{method} checkpoint: {module} has no {e.args[0]} tensor") from e
            except (RuntimeError, ValueError, IndexError) as e:
                raise ValueError(f"{method} checkpoint: {module} cannot be read: {e}") from e
            yield reader.output_name(module), weight
    if pending:
        module = next(iter(pending))
        raise ValueError(
            f"{method} checkpoint: {module} lacks some of {sorted(groups[module])} in its files"
        )


def _reader(method: str, qc: dict):
    if method == "gptq":
        return GptqReader(qc)
    if method == "awq":
        return AwqReader(qc)
    if method == "compressed-tensors":
        return CompressedTensorsReader(qc)
    if method == "fp8":
        return Fp8Reader(qc)
    if method == "mxfp4":
        return Mxfp4Reader(qc)
    raise UnsupportedQuantization(
        f"the checkpoint is quantized with quant_method={method!r}, which pdserve does not read "
        "(it reads gptq, awq, compressed-tensors, fp8 and mxfp4 checkpoints; a GGUF file or the "
        "float checkpoint with quantization='int8'/'int4'/'bf16' are the other ways to a small "
        "model)"
    )


def _by_module(names: list[str], parts: tuple[str, ...], key: str) -> dict[str, list[str]]:
    """module -> the names of its parts (those in `parts`), for every module that has `key`."""
    found: dict[str, list[str]] = {}
    for name in names:
        module, _, part = name.rpartition(".")
        if part in parts:
            found.setdefault(module, []).append(name)
    return {m: sorted(p) for m, p in found.items() if f"{m}.{key}" in p}


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words holding 32 / bits unsigned values each, lowest bits first, unpacked along
    `dim` (value j of word i becomes element i * (32 / bits) + j) as int32 in [0, 2^bits)."""
    if bits not in (2, 4, 8):
        raise UnsupportedQuantization(f"{bits}-bit packed weights are not read (2, 4 and 8 are)")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    w = words.to(torch.int32).movedim(dim, -1)
    values = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*w.shape[:-1], w.shape[-1] * per)
    return values.movedim(-1, dim)


def _check_bits(qc: dict, method: str) -> int:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits not in (2, 4, 8):
        raise UnsupportedQuantization(f"{method} with bits={bits} is not read (2, 4 and 8 are)")
    return bits


class LinearReader:
    """A format whose quantized tensors are linears' weights: the parts of module `m` stand
    for `m.weight`."""

    def output_name(self, module: str) -> str:
        return f"{module}.weight"


class GptqReader(LinearReader):
    """GPTQ (AutoGPTQ, GPTQModel, optimum): qweight int32 [in * bits / 32, out] packed along the
    inputs, qzeros int32 [groups, out * bits / 32] packed along the outputs, scales [groups, out],
    g_idx [in] (each input's group; act-order checkpoints permute them). weight[o, i] =
    scales[g, o] * (q[i, o] - zero[g, o]) with g = g_idx[i]; the original `gptq` checkpoint
    format stores each zero minus one, `gptq_v2` stores it as it is."""

    def __init__(self, qc: dict):
        self.bits = _check_bits(qc, "gptq")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(
                f"gptq checkpoint_format={fmt!r} is not read (gptq and gptq_v2 are)"
            )
        self.zero_offset = 1 if fmt == "gptq" else 0
        self.group_size = int(qc.get("group_size", 128))

    def groups(self, names: list[str]) -> dict[str, list[str]]:
        return _by_module(names, GPTQ_PARTS, "qweight")

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q = unpack_words(parts["qweight"], self.bits, 0)  # [in, out]
        zeros = unpack_words(parts["qzeros"], self.bits, 1) + self.zero_offset  # [groups, out]
        scales = parts["scales"].float()
        n_in, n_out = q.shape
        if scales.shape[1] != n_out or zeros.shape != scales.shape:
            raise ValueError(
                f"scales {list(scales.shape)} and qzeros {list(zeros.shape)} do not fit "
                f"qweight's {n_out} outputs"
            )
        g_idx = parts.get("g_idx")
        if g_idx is None:
            size = self.group_size if self.group_size > 0 else n_in
            g_idx = torch.arange(n_in) // size
        g_idx = g_idx.long()
        if g_idx.shape != (n_in,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= len(scales):
            raise ValueError(f"g_idx does not name one of the {len(scales)} groups per input")
        w = (q - zeros[g_idx]).float() * scales[g_idx]
        return w.t().contiguous()


class AwqReader(LinearReader):
    """AWQ's GEMM layout (AutoAWQ, `version: gemm`): qweight int32 [in, out / 8] and qzeros int32
    [groups, out / 8] packed along the outputs in AWQ_ORDER, scales [groups, out]. weight[o, i] =
    scales[g, o] * (q[i, o] - zero[g, o]) with g = i // group_size."""

    def __init__(self, qc: dict):
        self.bits = _check_bits(qc, "awq")
        if self.bits != 4:
            raise UnsupportedQuantization(f"awq with bits={self.bits} is not read (4 is)")
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise UnsupportedQuantization(f"awq version={version!r} is not read (gemm is)")
        if not qc.get("zero_point", True):
            raise UnsupportedQuantization("awq with zero_point=false is not read")
        self.group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
        order = torch.tensor(AWQ_ORDER)
        # the column of each output among its word's eight: output AWQ_ORDER[i] sits at i
        self.position = torch.empty_like(order)
        self.position[order] = torch.arange(len(order))

    def groups(self, names: list[str]) -> dict[str, list[str]]:
        return _by_module(names, AWQ_PARTS, "qweight")

    def _unpack(self, words: torch.Tensor) -> torch.Tensor:
        values = unpack_words(words, 4, 1)  # [rows, out] in the packed order
        index = (torch.arange(values.shape[1]) // 8) * 8 + self.position.repeat(words.shape[1])
        return values[:, index]

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q = self._unpack(parts["qweight"])  # [in, out]
        zeros = self._unpack(parts["qzeros"])
        scales = parts["scales"].float()
        n_in = q.shape[0]
        size = self.group_size if self.group_size > 0 else n_in
        if scales.shape != zeros.shape or scales.shape != (-(-n_in // size), q.shape[1]):
            raise ValueError(
                f"scales {list(scales.shape)} and qzeros {list(zeros.shape)} do not fit qweight "
                f"{list(q.shape)} in groups of {size}"
            )
        g = torch.arange(n_in) // size
        return ((q - zeros[g]).float() * scales[g]).t().contiguous()


class CompressedTensorsReader(LinearReader):
    """llm-compressor's `compressed-tensors` checkpoints in the formats that hold integer or FP8
    weights: `pack-quantized` (weight_packed int32 [out, in * bits / 32], lowest bits first,
    each value stored plus 2^(bits - 1); an asymmetric zero point packed the same way along the
    outputs), `int-quantized` and `naive-quantized` (weight int8), `float-quantized` (weight
    float8_e4m3fn). weight = (q - zero_point) * weight_scale, the scale per tensor, output
    channel, group of inputs (weight_g_idx naming each input's group where act-order wrote it) or
    block, as the matching config group's `weights.strategy` says. Which group a module belongs
    to follows compressed-tensors' own precedence: its exact name, then a `re:` pattern, then a
    class name (every quantized module here is a Linear)."""

    FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")

    def __init__(self, qc: dict):
        status = str(qc.get("quantization_status", "compressed")).lower()
        if status != "compressed":
            raise UnsupportedQuantization(
                f"compressed-tensors quantization_status={status!r} is not read (compressed is)"
            )
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise UnsupportedQuantization(f"compressed-tensors with a {key} is not read")
        self.schemes = []  # (targets, weights args, format)
        for name, group in (qc.get("config_groups") or {}).items():
            args = group.get("weights")
            if not args:
                continue
            fmt = str(group.get("format") or qc.get("format") or "").lower()
            if fmt not in self.FORMATS:
                raise UnsupportedQuantization(
                    f"compressed-tensors format {fmt!r} (config group {name}) is not read "
                    f"({', '.join(self.FORMATS)} are)"
                )
            strategy = str(args.get("strategy", "tensor")).lower()
            if strategy not in ("tensor", "channel", "group", "block"):
                raise UnsupportedQuantization(
                    f"compressed-tensors weights strategy {strategy!r} is not read"
                )
            kind, bits = str(args.get("type", "int")).lower(), int(args.get("num_bits", 8))
            if (kind, fmt == "float-quantized") not in (("int", False), ("float", True)) or (
                kind == "float" and bits != 8
            ):
                raise UnsupportedQuantization(
                    f"compressed-tensors {bits}-bit {kind} weights in {fmt!r} are not read"
                )
            if fmt == "pack-quantized" and bits not in (2, 4, 8):
                raise UnsupportedQuantization(f"pack-quantized {bits}-bit weights are not read")
            self.schemes.append((list(group.get("targets") or []), args, fmt))

    def groups(self, names: list[str]) -> dict[str, list[str]]:
        found = _by_module(names, CT_PARTS + ("weight",), "weight_scale")
        return {m: parts for m, parts in found.items() if f"{m}.weight_scale" in parts}

    def _scheme(self, module: str):
        for rank in ("name", "re", "class"):
            for targets, args, fmt in self.schemes:
                for target in targets:
                    if rank == "name" and target == module:
                        return args, fmt
                    if rank == "re" and target.startswith("re:") and re.match(target[3:], module):
                        return args, fmt
                    if rank == "class" and target == "Linear":
                        return args, fmt
        raise ValueError("no config group's targets name it")

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        args, fmt = self._scheme(module)
        bits = int(args.get("num_bits", 8))
        zero = parts.get("weight_zero_point")
        if fmt == "pack-quantized":
            shape = [int(v) for v in parts["weight_shape"].tolist()]
            offset = 1 << (bits - 1)
            q = unpack_words(parts["weight_packed"], bits, 1)[:, : shape[1]] - offset
            if zero is not None:
                zero = unpack_words(zero, bits, 0)[: shape[0]] - offset
        else:
            q = parts["weight"]
        scale = parts["weight_scale"].float()
        q = q.float()
        if zero is not None:
            q = q - _spread(zero.float(), args, q.shape, parts.get("weight_g_idx"))
        return (q * _spread(scale, args, q.shape, parts.get("weight_g_idx"))).contiguous()


def _spread(values: torch.Tensor, args: dict, shape, g_idx: torch.Tensor | None) -> torch.Tensor:
    """A scale or zero point per tensor, channel, group or block, spread over the weight's
    [out, in] `shape`."""
    out, n_in = shape
    strategy = str(args.get("strategy", "tensor")).lower()
    if strategy == "tensor":
        if values.numel() != 1:
            raise ValueError(f"a per-tensor scale has {values.numel()} values")
        return values.reshape(1, 1).expand(out, n_in)
    if strategy == "channel":
        return values.reshape(out, 1).expand(out, n_in)
    if strategy == "group":
        values = values.reshape(out, -1)
        if g_idx is None:
            g_idx = torch.arange(n_in) // int(args["group_size"])
        g_idx = g_idx.long()
        if g_idx.shape != (n_in,) or int(g_idx.max()) >= values.shape[1] or int(g_idx.min()) < 0:
            raise ValueError(f"the groups do not fit the {values.shape[1]} scales per output")
        return values[:, g_idx]
    bo, bi = (int(v) for v in args.get("block_structure") or (128, 128))
    return _blocks(values, bo, bi, out, n_in)


def _blocks(values: torch.Tensor, bo: int, bi: int, out: int, n_in: int) -> torch.Tensor:
    """A scale per [bo, bi] block spread over [out, in] (the last blocks may be cut short)."""
    if values.shape != (-(-out // bo), -(-n_in // bi)):
        raise ValueError(
            f"{list(values.shape)} block scales do not fit a [{out}, {n_in}] weight in "
            f"[{bo}, {bi}] blocks"
        )
    return values.repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :n_in]


class Fp8Reader(LinearReader):
    """The `fp8` quant_method (Qwen3's and DeepSeek-V3's FP8 releases, transformers'
    FineGrainedFP8): weight float8_e4m3fn [out, in] with weight_scale_inv, one float32 per
    `weight_block_size` block (a factor despite its name: weight = fp8 * scale_inv), or with no
    block size one weight_scale for the tensor."""

    def __init__(self, qc: dict):
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedQuantization(f"fp8 fmt={fmt!r} is not read (e4m3 is)")
        block = qc.get("weight_block_size")
        self.block = None if block is None else tuple(int(v) for v in block)

    def groups(self, names: list[str]) -> dict[str, list[str]]:
        found = _by_module(names, ("weight", "weight_scale_inv", "weight_scale"), "weight")
        return {m: p for m, p in found.items() if len(p) == 2 and f"{m}.weight" in p}

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        w = parts["weight"].float()
        scale = parts.get("weight_scale_inv", parts.get("weight_scale")).float()
        if self.block is not None and "weight_scale_inv" in parts:
            return (w * _blocks(scale, *self.block, *w.shape)).contiguous()
        if scale.numel() == 1:
            return w * scale.reshape(())
        if scale.numel() == w.shape[0]:
            return w * scale.reshape(-1, 1)
        raise ValueError(f"a scale of shape {list(scale.shape)} fits neither tensor nor channel")


class Mxfp4Reader:
    """OpenAI's MXFP4 (`mxfp4`, gpt-oss's experts): a float32 parameter `<p>` [experts, in, out]
    (each layer's `mlp.experts.gate_up_proj` [E, hidden, 2 * intermediate] and `down_proj`
    [E, intermediate, hidden]) is stored as `<p>_blocks` uint8 [E, out, in / 32, 16], two FP4
    (e2m1) values a byte, the low four bits first, and `<p>_scales` uint8 [E, out, in / 32], one
    E8M0 exponent (bias 127) per 32 consecutive inputs. It is read by transformers' own
    dequantization (`convert_moe_packed_tensors`, in float32: exact, an FP4 value times a power of
    two), which also turns it back to the [E, in, out] layout, and handed on under the
    parameter's own name (no `.weight`). `modules_to_not_convert` needs no reading: what it
    names is stored in bf16 and passes as it is."""

    def __init__(self, qc: dict):
        try:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
        except ImportError as e:
            import transformers

            raise UnsupportedQuantization(
                f"mxfp4 checkpoints are read with transformers' own MXFP4 dequantization "
                f"(transformers.integrations.mxfp4), which needs transformers >= "
                f"{MXFP4_TRANSFORMERS}; this is transformers {transformers.__version__}"
            ) from e
        self.convert = convert_moe_packed_tensors

    def output_name(self, module: str) -> str:
        return module

    def groups(self, names: list[str]) -> dict[str, list[str]]:
        """`<p>` -> both its parts' names, for every `<p>` with either one in the files (so a
        missing half is reported as missing)."""
        found = {}
        for name in names:
            param, _, part = name.rpartition("_")
            if part in MXFP4_PARTS and param:
                found[param] = [f"{param}_{p}" for p in MXFP4_PARTS]
        return found

    def weight(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
            raise ValueError(f"blocks ({blocks.dtype}) and scales ({scales.dtype}) are not uint8")
        if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise ValueError(
                f"blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit: blocks "
                "are [experts, out, in / 32, 16] and scales [experts, out, in / 32]"
            )
        # (older transformers moves the work to a GPU when one is present: back here)
        return self.convert(blocks, scales, dtype=torch.float32).to(blocks.device)
