"""Per-step attention metadata, visible to the attention layers only inside a `with` block.

The model keeps the signature `forward(input_ids, positions)`; everything about paging (where new
KV goes, which blocks each sequence reads) is computed once per step and shared by all layers.
`host_tensor` makes the step's index tensors from the host's lists.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.float32: np.float32, torch.float64: np.float64}


def host_tensor(values, dtype: torch.dtype = torch.long, device=None) -> torch.Tensor:
    """A 1-D tensor of a list of Python numbers, on `device` (None: the CPU). Made through numpy
    where the dtype has a numpy twin: torch.tensor reads a list one element at a time, several
    times slower for the few hundred entries of a step's index lists."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.tensor(values, dtype=dtype, device=device)
    t = torch.from_numpy(np.array(values, dtype=np_dtype))
    return t if device is None else t.to(device)


@dataclass
class PrefillSpan:
    """One sequence computing more than one token this step (a prompt chunk)."""

    q_start: int  # offset of its tokens in the flattened batch
    q_len: int
    context_len: int  # tokens visible after this step (cached + new)
    block_ids: torch.Tensor  # blocks covering context_len, int64
    causal_mask: torch.Tensor | None  # [q_len, context_len] bool when part of the context is cached


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int = 0  # rows of the decode kernel, first in the batch (one per token)
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size]
    # (the mask only when the compiled kernel is not used)
    prefills: list[PrefillSpan] = field(default_factory=list)
    kv_cache: torch.Tensor | None = (
        None  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
    )
    # called by each attention layer with its index once it has written its KV (engine_core's
    # KV sinks: a prefill whose KV leaves layer by layer)
    on_layer_done: Callable[[int], None] | None = None
    # the step's rows grouped by LoRA adapter (engine/lora.py LoRABatch); None: all the base's
    lora: object | None = None
    # the step's image tokens (engine/multimodal.py): their rows, and the embeddings that stand
    # in for their tokens' own [rows, hidden]; None: no image token in the step
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    # a hybrid model's linear layers (engine/recurrent_state.py): the state tensors, the slots
    # of the step's leading one-token rows (None: no such row) and, for every other sequence,
    # (first row, tokens, slot, keep): after those tokens each layer copies its state of `slot`
    # into slot `keep` where keep >= 0 (the prefix cache keeps it: a sequence's chunk is split
    # into two spans there, the second with keep -1)
    states: object | None = None
    state_slots: torch.Tensor | None = None
    state_spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    # speculative decoding with an EAGLE head (engine/spec/eagle.py): the head's input rows of
    # h (one per token); the target layers whose inputs a step hands back, and those inputs as
    # the layers pass them (engine/models/llama.py run_layers)
    hidden_in: torch.Tensor | None = None
    aux_layers: tuple[int, ...] = ()  # (in the order the layers run)
    aux: list = field(default_factory=list)


# per thread: two engines in one process (a test, or a colocated pair) each step on their own thread
_local = threading.local()


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata):
    if getattr(_local, "meta", None) is not None:
        raise RuntimeError("forward_context does not nest: a step is already running")
    _local.meta = meta
    try:
        yield meta
    finally:
        _local.meta = None


def current_forward_context() -> AttentionMetadata | None:
    """The running step's metadata, or None outside a step (a layer called on its own)."""
    return getattr(_local, "meta", None)


def get_forward_context() -> AttentionMetadata:
    meta = getattr(_local, "meta", None)
    if meta is None:
        raise RuntimeError("attention called outside forward_context")
    return meta
