"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab.

Under tensor parallelism each rank loads only its slice of the embedding table and of the LM
head (`weight_loader` narrows the checkpoint's tensor). The embedding looks up the ids its slice
holds, zeros the rest and sums the ranks' results (an all-reduce), so every rank ends with the
full hidden states. The LM head computes its slice's logits and gathers them on rank 0, the only
rank that samples: the others get None. A tied head shares the embedding's weight. The head is a
linear like any other, so it is quantized with the model (engine/layers/quant.py decides its
mode). With one rank both are plain lookups and matmuls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.parallel import all_reduce, divide, gather_to_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.shard_size = divide(vocab_size, tp_size(), "the vocabulary size")
        self.start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.start, self.shard_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0.0)
        return all_reduce(y)


class ParallelLMHead(LinearBase):
    """Logits for this rank's vocab slice, gathered on rank 0 (where sampling happens)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        self.shard_size = divide(vocab_size, tp_size(), "the vocabulary size")
        super().__init__(hidden_size, self.shard_size, bias=False)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded.narrow(0, tp_rank() * self.shard_size, self.shard_size))

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_to_rank0(self.matmul(hidden, None), dim=-1)
