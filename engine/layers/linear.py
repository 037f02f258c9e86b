"""Linear layers that own their tensor-parallel sharding.

Each layer holds only its shard and exposes `weight_loader(param, full_tensor, shard_id)`, so a
checkpoint loader streams full tensors in without knowing about TP. After loading, `finalize`
prepares the weight for the matmul that will use it: on CPU in float32 or bfloat16 it is reordered
into oneDNN's blocked layout and multiplied with `mkldnn._linear_pointwise` (dense in, dense out,
as torch inductor does), which beats `F.linear` at the row counts of decoding; a float32 weight
that is exactly a GGUF's 4- or 8-bit blocks also keeps those (quant.py Q4Blocks, Q8Blocks), which
steps of at most `float32_block_rows()` rows multiply instead, to oneDNN's float32 bits at 0.625 or
1.0625 bytes a weight: 8 rows with AVX-512, every step without it, where such a layer (without a
bias) keeps no oneDNN copy; with a quantization mode it becomes an
int8 or int4 weight (engine/layers/quant.py). A linear that an engine's LoRA adapters target
(`has_lora`, set by engine/lora.py) adds the running step's adapter deltas to its output (the
forward context's LoRABatch), before a row-parallel layer's all-reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.forward_context import current_forward_context
from pdserve.engine.layers.quant import (
    Q4Blocks,
    Q8Blocks,
    blocks_every_step,
    exact_blocks,
    float32_block_rows,
    onednn_bf16_available,
    own_linear,
    own_product,
    own_product_beside_blocks,
    quantize_weight,
)
from pdserve.engine.parallel import all_reduce, divide, tp_rank, tp_size

_BATCH_HINT = 32  # rows the reordered layout is tuned for; any row count is accepted


def onednn_linear(x2d: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x2d @ packed.T (+ bias) by oneDNN, the same bits for a row alone as inside any batch.
    oneDNN takes another kernel for one row than for two or more at some shapes, and it sums in
    another order there: SmolLM2's down projection (1536 -> 576, float32) on an AVX-512 EPYC gave
    one row alone a result a few 1e-6 off the same row's in any batch of two or more. A decode
    step of one sequence is one row, so the KV it wrote differed from what a prefill of the same
    tokens writes, and a conversation's next turn, which reuses that KV, could flip a greedy
    token at a near-tie. One row runs as two, which costs nothing measurable: a one-row step is
    bound by the weight's bytes."""
    if x2d.shape[0] == 1:
        y = torch.ops.mkldnn._linear_pointwise(
            x2d.expand(2, -1).contiguous(), packed, bias, "none", [], ""
        )
        return y[:1]
    return torch.ops.mkldnn._linear_pointwise(x2d, packed, bias, "none", [], "")


def _onednn_usable(weight: torch.Tensor) -> bool:
    """Whether oneDNN multiplies this weight: float32 on the CPU, or bf16 where oneDNN's bf16
    linear runs (else torch's own matmul takes it: an AVX2-only CPU)."""
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and (
            weight.dtype == torch.float32
            or (weight.dtype == torch.bfloat16 and onednn_bf16_available())
        )
    )


def _with_lora(linear: LinearBase, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y plus the step's LoRA deltas for x's rows (engine/lora.py), if any adapter runs."""
    meta = current_forward_context()
    if meta is None or meta.lora is None:
        return y
    return meta.lora.apply(linear, x, y)


class LinearBase(nn.Module):
    has_lora = False  # a LoRA adapter targets this linear (engine/lora.py shard_adapter)

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self._packed: torch.Tensor | None = None
        # a float32 weight's 4- or 8-bit blocks, when it is exactly that
        self._blocks: Q4Blocks | Q8Blocks | None = None
        self._quant = None  # an engine.layers.quant weight when a quantization mode is on
        # (our own packing, its part): quant.own_product, which then replaces _packed
        self._own: tuple[torch.Tensor, int] | None = None
        # per input channel, the largest |activation| seen on calibration text (int8 smooths by it)
        self.act_absmax: torch.Tensor | None = None
        # and the SmoothQuant strength that erred least on that text (None: quant.SMOOTH_ALPHA)
        self.smooth_alpha: float | None = None
        self._dense_shape = tuple(self.weight.shape)  # what a released weight had (restore_dense)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)

    def finalize(self, quantization: str | None = None, release_dense: bool = True) -> None:
        """Called after all weights are loaded (again to switch modes, while the dense weight is
        kept). Once packed, the dense copy is only dead weight (a second copy of the model in
        memory), unless another module shares it: `release_dense` drops it."""
        if self.weight.numel() == 0:
            raise RuntimeError("finalize after the dense weight was released")
        self._packed = self._quant = self._blocks = self._own = None
        if quantization is not None:
            self._quant = quantize_weight(
                quantization, self.weight.detach(), self.act_absmax, self.smooth_alpha
            )
        elif _onednn_usable(self.weight):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(
                self.weight.detach(), _BATCH_HINT
            )
            if self.weight.dtype == torch.float32:
                packed = self._packed

                def dense(x):
                    return onednn_linear(x, packed, None)

                self._blocks = exact_blocks(self.weight.detach(), torch.float32, dense)
                if self._blocks is not None and self.bias is None and blocks_every_step():
                    self._packed = None  # (oneDNN would never run: 4 bytes a weight less)
                # our own product where it gives oneDNN's bits (quant.own_product); oneDNN adds a
                # bias inside its product, so a layer with one keeps oneDNN; beside blocks, only
                # where it beats oneDNN on their larger steps (quant.own_product_beside_blocks)
                if self.bias is None and (self._blocks is None or own_product_beside_blocks()):
                    own, part = own_product(self.weight.detach(), torch.float32, dense)
                    if own is not None:
                        self._own, self._packed = (own, part), None
        prepared = any(p is not None for p in (self._packed, self._quant, self._own, self._blocks))
        if release_dense and prepared:
            self._dense_shape = tuple(self.weight.shape)
            self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def release(self) -> None:
        """Drops every prepared form (a level-2 sleep, engine/sleep.py, drops the dense weight
        with the other parameters); `restore_dense` and `finalize` build them again."""
        self._packed = self._quant = self._blocks = self._own = None
        if self.weight.numel():
            self._dense_shape = tuple(self.weight.shape)

    def restore_dense(self) -> None:
        """Gives a released dense weight its storage back, unfilled, so that new weights load
        into it (ModelRunner.reload_weights) and `finalize` packs them again."""
        if self.weight.numel() == 0:
            self.weight.data = torch.empty(
                self._dense_shape, dtype=self.weight.dtype, device=self.weight.device
            )

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # (the dense weight may be released: a prepared weight always takes its own path)
        if self._quant is not None:
            y = self._quant.matmul(x.reshape(-1, x.shape[-1]))
            if bias is not None:
                y = y + bias
            return y.view(*x.shape[:-1], y.shape[-1])
        if self._own is not None:  # (no bias: finalize)
            x2d = x.reshape(-1, x.shape[-1])
            if self._blocks is not None and bias is None and x2d.shape[0] <= float32_block_rows():
                y = self._blocks.matmul(x2d)
            else:
                y = own_linear(x2d, *self._own)
            if bias is not None:
                y = y + bias
            return y.view(*x.shape[:-1], y.shape[-1])
        if self._packed is not None or self._blocks is not None:
            x2d = x.reshape(-1, x.shape[-1])
            # (a bias goes inside oneDNN's product: such a layer leaves every step to it; without
            # a oneDNN copy, the blocks take every step)
            if self._blocks is not None and bias is None and x2d.shape[0] <= float32_block_rows():
                y = self._blocks.matmul(x2d)
            else:
                y = onednn_linear(x2d, self._packed, bias)
            return y.view(*x.shape[:-1], y.shape[-1])
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.bias)
        return _with_lora(self, x, y) if self.has_lora else y


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no collective (the next row-parallel layer reduces)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, divide(out_features, tp_size(), "the output features"), bias)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, tp_rank() * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up of the MLP)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias)

    def weight_loader(self, param, loaded, shard_id: int = 0):
        n = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // n
        size = self.output_sizes[shard_id] // n
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul; each rank holds its own heads of each."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ):
        n = tp_size()
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, n, "the attention heads")
        self.num_kv_heads = divide(num_kv_heads, n, "the key/value heads")
        total = (num_heads + 2 * num_kv_heads) * head_dim
        super().__init__(hidden_size, total, bias)

    def weight_loader(self, param, loaded, shard_id: str = "q"):
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums are all-reduced here."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(divide(in_features, tp_size(), "the input features"), out_features, bias)

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, tp_rank() * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            y = self.matmul(x, self.bias)
            return _with_lora(self, x, y) if self.has_lora else y
        y = self.matmul(x, None)
        if self.has_lora:  # the partial delta of this rank's columns of A, reduced with y
            y = _with_lora(self, x, y)
        y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
