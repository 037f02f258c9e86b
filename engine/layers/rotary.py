"""Rotary position embeddings (HF "rotate half" layout) with a precomputed cos/sin cache.

Scaled variants (linear, llama3, yarn) take their inverse frequencies from transformers' own
`ROPE_INIT_FUNCTIONS`, so they match the reference implementation by construction. Types whose
frequencies change with the live sequence length (dynamic, longrope) do not fit a fixed cache over
paged KV and are refused. A partial rotary factor (Phi-3/Phi-4's `partial_rotary_factor`) rotates
the first head_dim * factor dimensions of each head and passes the rest through; a config whose
rope parameters are a dict per layer type (Gemma 3: sliding and full layers have their own base)
is read for the `layer_type` asked. Qwen2-VL's M-RoPE places a token in 3-D (frame, row, column):
its positions are then [3, tokens], and each section of the head's frequencies
(`mrope_section`, interleaved pair by pair for Qwen3-VL: `mrope_axes`) turns by one of the
three; a token whose three are one is turned as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pdserve.engine.kernels import fused_for, fused_triton

if TYPE_CHECKING:
    from pdserve.engine.config import ModelConfig

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The rope parameters of `hf_config` (of `layer_type`'s layers where they differ by type)."""
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):
        return rope[layer_type]
    if isinstance(rope.get("full_attention"), dict):
        return rope["full_attention"]
    return rope


def rope_inv_freq(
    hf_config, rope_type: str, rope_theta: float, head_dim: int, layer_type: str | None = None
):
    rope = getattr(hf_config, "rope_parameters", None) or {}
    if layer_type is None and isinstance(rope.get("full_attention"), dict):
        layer_type = "full_attention"  # a rope per layer type: the full layers' is the default
    alpha = rope_parameters(hf_config, layer_type).get("alpha")
    if rope_type == "dynamic" and alpha:
        # Hunyuan's "dynamic" with a fixed alpha: NTK's stretch of the base, the same at every
        # length (transformers' ntk_alpha), so a static rotary
        rope_theta = rope_theta * float(alpha) ** (head_dim / (head_dim - 2))
        rope_type = "default"
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; supported: {STATIC_ROPE_TYPES}"
        )
    if rope_type == "default":
        factor = rope_parameters(hf_config, layer_type).get("partial_rotary_factor", 1.0)
        dim = int(head_dim * factor)
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](
        hf_config, torch.device("cpu"), **kwargs
    )
    return inv_freq.float(), float(attention_factor)


def mrope_axes(section: tuple[int, ...], interleaved: bool) -> torch.Tensor:
    """Which of a token's three positions (frame, row, column) turns each frequency pair:
    Qwen2-VL's sections are runs (section[0] pairs by the frame, then the rows', then the
    columns'); Qwen3-VL's interleave, pair i by axis i % 3 while that axis has pairs left
    (3 x its section), the rest by the frame, as transformers' `recomposition_frequencies`."""
    if not interleaved:
        return torch.arange(3).repeat_interleave(torch.tensor(section))
    pairs = torch.arange(sum(section))
    axes = torch.zeros_like(pairs)
    for axis in (1, 2):
        axes[(pairs % 3 == axis) & (pairs < 3 * section[axis])] = axis
    return axes


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        inv_freq: torch.Tensor,
        attention_factor: float,
        max_position: int,
        mrope_section: tuple[int, ...] = (),
        mrope_interleaved: bool = False,
    ):
        super().__init__()
        positions = torch.arange(max_position, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self._step_positions: torch.Tensor | None = None
        self._step_cos_sin = None
        # M-RoPE: which of a token's three positions each of the cos/sin columns follows
        # (sections of frequencies, in both halves of the "rotate half" layout)
        self._mrope_axis = None
        if mrope_section:
            half = mrope_axes(mrope_section, mrope_interleaved)
            self._mrope_axis = torch.cat((half, half)).to(inv_freq.device)
        self._mrope_step = None  # (positions, their cos, their sin) of the step

    def tables(self, positions: torch.Tensor):
        """(positions, cos, sin) as a fused kernel indexes them (cos[positions]): `positions`
        and the whole tables, or, for 3-D positions [3, tokens], each token's own row and
        tables of one row a token."""
        if positions.dim() == 1:
            return positions, self.cos, self.sin
        cos, sin = self._mrope_rows(positions)
        return torch.arange(positions.shape[1], device=positions.device), cos, sin

    def _mrope_rows(self, positions: torch.Tensor):
        """Each token's cos and sin [tokens, rotary dims] for 3-D positions [3, tokens]: a
        column's from the position of its section's axis. Made once a step (every layer shares
        this module)."""
        step = self._mrope_step
        if step is None or step[0] is not positions:
            if self._mrope_axis is None:
                raise ValueError("3-D rotary positions for a model without M-RoPE sections")
            axis = self._mrope_axis[None, None, :].expand(1, positions.shape[1], -1)
            cos = self.cos[positions].gather(0, axis)[0]
            sin = self.sin[positions].gather(0, axis)[0]
            step = self._mrope_step = (positions, cos, sin)
        return step[1], step[2]

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]. The compiled path rotates
        q and k in place (they are views of the step's fresh qkv projection). 3-D positions
        [3, T] (M-RoPE) are turned by torch, into new tensors."""
        if positions.dim() == 2:
            cos, sin = self._mrope_rows(positions)
            cos, sin = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
            rot = cos.shape[-1]  # (partial rotary, Qwen3.5's: the rest of each head passes)
            q_rot, k_rot = q[..., :rot], k[..., :rot]
            q_rot = q_rot * cos + self._rotate_half(q_rot) * sin
            k_rot = k_rot * cos + self._rotate_half(k_rot) * sin
            if rot == q.shape[-1]:
                return q_rot, k_rot
            return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)
        triton_fused = fused_triton.for_tensor(q)  # None on CPU: CUDA only (kernels/fused_triton)
        if triton_fused is not None:  # in place, partial rotary included
            reference = lambda: self._rotated_copies(positions, q, k)  # noqa: E731
            if triton_fused.rope_(q, k, positions, self.cos, self.sin, reference) is not None:
                return q, k
        return self._torch_forward(positions, q, k)

    def _rotated_copies(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q and k rotated by torch into new tensors (q and k themselves untouched)."""
        rot = self.cos.shape[-1]
        if rot == q.shape[-1]:
            return self._rotate(positions, q, k)
        # partial rotary: the first `rot` dims turn, the rest pass through
        q_rot, k_rot = self._rotate(positions, q[..., :rot], k[..., :rot])
        return torch.cat((q_rot, q[..., rot:]), -1), torch.cat((k_rot, k[..., rot:]), -1)

    def _torch_forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if self.cos.shape[-1] != q.shape[-1]:
            return self._rotated_copies(positions, q, k)
        fused = fused_for(q)
        if fused is not None and q.stride(-1) == 1 and k.stride(-1) == 1:
            fused.rope_(q, k, positions, self.cos, self.sin)
            return q, k
        return self._rotate(positions, q, k)

    def _rotate(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        # one module serves every layer: look the step's positions up once, not once per layer
        if positions is not self._step_positions:
            self._step_positions = positions
            self._step_cos_sin = (
                self.cos[positions].unsqueeze(1).to(q.dtype),
                self.sin[positions].unsqueeze(1).to(q.dtype),
            )
        cos, sin = self._step_cos_sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin


def sliding_rotary(cfg: ModelConfig, rotary: RotaryEmbedding) -> RotaryEmbedding:
    """The sliding layers' rotary embedding where the config gives them a rope of their own
    (Gemma 3's and OLMo 3's `rope_parameters["sliding_attention"]`, or an older Gemma 3 config's
    `rope_local_base_freq`), over the same positions; `rotary` itself where every layer has one
    rope (Gemma 2)."""
    hf = cfg.hf_config
    rope = getattr(hf, "rope_parameters", None) or {}
    params = rope.get("sliding_attention")
    if isinstance(params, dict):
        rope_type = params.get("rope_type", "default")
        theta = float(params.get("rope_theta", 10000.0))
        layer_type = "sliding_attention"
    elif getattr(hf, "rope_local_base_freq", None):  # an older config: the local base beside
        rope_type, layer_type = "default", None
        theta = float(hf.rope_local_base_freq)
    else:
        return rotary
    inv_freq, factor = rope_inv_freq(hf, rope_type, theta, cfg.head_dim, layer_type=layer_type)
    device = rotary.cos.device
    return RotaryEmbedding(inv_freq.to(device), factor, rotary.cos.shape[0]).to(device)


def pairs_as_halves(weight: torch.Tensor, head_dim: int, rot: int | None = None) -> torch.Tensor:
    """A query or key projection's rows (or bias) for RotaryEmbedding, from a checkpoint whose
    rotary turns neighbouring pairs (values 2i and 2i + 1 by frequency i: Llama 4's, GLM-4's):
    the first `rot` rows of each head (all of them: None) reordered into halves (even rows,
    then odd ones), which RotaryEmbedding turns as pairs (i, i + rot / 2) by the same frequency;
    the rest of the head in place. Queries and keys reordered alike keep every score."""
    rot = head_dim if rot is None else rot
    heads = weight.reshape(-1, head_dim, *weight.shape[1:])
    turned = heads[:, :rot].reshape(heads.shape[0], rot // 2, 2, *weight.shape[1:])
    turned = turned.transpose(1, 2).reshape(heads.shape[0], rot, *weight.shape[1:])
    return torch.cat([turned, heads[:, rot:]], dim=1).reshape(weight.shape)
