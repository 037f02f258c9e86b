"""The classification head a scoring model ends in: class logits from the final hidden state of a
prompt's last token (pooling "classify", engine/request.py PoolingParams), for the router's
/v1/score, /v1/rerank and /classify (router/openai/scoring.py).

Two kinds of model have one:

- a `*ForSequenceClassification` checkpoint (a cross-encoder reranker or a classifier built on a
  decoder: Qwen3-Reranker-seq-cls, a Llama or Qwen classifier): its `score.weight`, one row per
  label, read from the checkpoint as it streams past the model's own loader;
- a generative model told which tokens' logits are the labels (`classifier_from_token`, vLLM's
  name: ["no", "yes"] for Qwen3-Reranker): the LM head's rows of those tokens (the embedding's
  when the head is tied), with the model's final logit soft-cap where it has one, so each label's
  logit is the one the model would give that token.

The head is a small float32 matrix [labels, hidden] copied whole into every rank (under tensor
parallelism the LM head is split by vocabulary, but each rank reads the full checkpoint tensor
first), so the rank that pools computes it alone. It is built once while the weights load and
never changes; activation (sigmoid, softmax) is the HTTP front's, so the gRPC API carries logits.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pdserve.engine.config import ModelConfig

SCORE_WEIGHT = "score.weight"  # a *ForSequenceClassification checkpoint's head
HEAD_NAMES = ("lm_head.weight", "model.embed_tokens.weight")  # the LM head's rows, then tied


def label_token_ids(tokenizer, tokens, model_config: ModelConfig) -> tuple[int, ...]:
    """classifier_from_token's strings as token ids: each must be one token of the vocabulary
    (as the tokenizer spells it, or a string it encodes as one token); a classifier checkpoint
    has its own head and takes none."""
    if model_config.num_labels:
        raise ValueError(
            "classifier_from_token is for a generative model; this checkpoint is a "
            f"{model_config.num_labels}-label classifier with its own head: leave it unset"
        )
    ids = []
    for token in tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or (tid == tokenizer.unk_token_id and token != tokenizer.unk_token):
            encoded = tokenizer.encode(token, add_special_tokens=False)
            tid = encoded[0] if len(encoded) == 1 else None
        if tid is None or not 0 <= tid < model_config.vocab_size:
            raise ValueError(
                f"classifier_from_token {token!r} is not one token of the model's vocabulary: "
                "name tokens as the tokenizer spells them"
            )
        ids.append(int(tid))
    if len(set(ids)) != len(ids):
        raise ValueError(f"classifier_from_token names one token twice: {list(tokens)}")
    return tuple(ids)


class ScoreHead:
    """Class logits of final hidden states: hidden [.., hidden_size] -> [.., labels]."""

    def __init__(self, weight: torch.Tensor, softcap: float | None = None):
        self.weight = weight.detach().to(torch.float32).contiguous()
        self.softcap = softcap

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden.to(self.weight.device, torch.float32) @ self.weight.T
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


class HeadCapture:
    """Passes a checkpoint's (name, tensor) stream through to the model's loader and keeps what
    the head is made of: `score.weight` (taken out of the stream: the causal model has no place
    for it) or the label tokens' rows of the LM head. `head()` after the stream ends."""

    def __init__(self, model_config: ModelConfig):
        self.config = model_config
        self._found: dict[str, torch.Tensor] = {}

    def wrap(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator:
        ids = list(self.config.score_token_ids)
        for name, tensor in weights:
            if self.config.num_labels and name == SCORE_WEIGHT:
                self._found[name] = tensor.detach().to(torch.float32).clone()
                continue
            if ids and name in HEAD_NAMES:
                self._found[name] = tensor.detach()[ids].to(torch.float32).clone()
            yield name, tensor

    def head(self) -> ScoreHead | None:
        """The head, or None for a model without one; a checkpoint that lacks what its config
        promises is refused."""
        cfg = self.config
        if cfg.num_labels:
            weight = self._found.get(SCORE_WEIGHT)
            if weight is None or tuple(weight.shape) != (cfg.num_labels, cfg.hidden_size):
                raise ValueError(
                    f"a {cfg.num_labels}-label classifier checkpoint needs {SCORE_WEIGHT} of shape "
                    f"[{cfg.num_labels}, {cfg.hidden_size}]; "
                    + ("it has none" if weight is None else f"got {list(weight.shape)}")
                )
            return ScoreHead(weight)
        if cfg.score_token_ids:
            rows = self._found.get(HEAD_NAMES[0])
            if rows is None and cfg.tie_word_embeddings:
                rows = self._found.get(HEAD_NAMES[1])
            if rows is None:
                raise ValueError(
                    "classifier_from_token needs the checkpoint's LM head (lm_head.weight, or "
                    "the tied model.embed_tokens.weight); it has neither"
                )
            return ScoreHead(rows, getattr(cfg.hf_config, "final_logit_softcapping", None))
        return None
