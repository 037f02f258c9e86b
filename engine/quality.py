"""Perplexity on real text that every CPython carries, to measure a serving mode and to choose one.

The text is the Python Language Reference topics behind `help()` (`pydoc_data.topics`): English
technical prose, offline on every machine. `benchmarks/engine/quality.py` scores the first 20,480 tokens of it
per mode; `dtype="auto"` scores a short probe from its end (tokens the benchmark never reads) with
float32 and with each quantization mode, and serves the first mode, in order of speed, whose
perplexity stays within its bound of float32's.
"""

from __future__ import annotations

import math

# the most a mode's perplexity may exceed float32's, relative, for its quality to pass
QUALITY_BOUNDS = {"bfloat16": 0.01, "int8": 0.03, "int4": 0.06}
PROBE_TOKENS = 512


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def corpus_ids(tokenizer) -> list[int]:
    return tokenizer.encode(corpus_text(), add_special_tokens=False)


def probe_ids(tokenizer, length: int, skip: int = 0) -> list[int]:
    """Windows of `length` tokens from the corpus's end, each starting with BOS (when the model
    has one): the last window, preceded by `skip // length` more before it; [] if the tokenizer
    cannot make that many tokens of the text."""
    bos = tokenizer.bos_token_id
    body = length - (1 if bos is not None else 0)
    windows = skip // length + 1
    # only the end is read: ~4 characters per token in English, so 12 leave room for any tokenizer
    ids = tokenizer.encode(corpus_text()[-12 * body * windows :], add_special_tokens=False)[1:]
    if len(ids) < body * windows:  # a tokenizer that cannot spell English: nothing to probe with
        return []
    out = []
    for w in range(skip // length, -1, -1):
        end = len(ids) - w * body
        out += ([bos] if bos is not None else []) + ids[end - body : end]
    return out


def perplexity(rows: list[dict[int, float]], ids: list[int]) -> float:
    """rows[p] holds the logprob of ids[p + 1] given ids[:p + 1] (SamplingParams(prompt_logprobs)
    rows without the first, or the runner's prompt targets)."""
    nll = -sum(row[t] for row, t in zip(rows, ids[1:]))
    return math.exp(nll / (len(ids) - 1))


def informative(ppl: float, vocab_size: int) -> bool:
    """A model that predicts the text at all scores far below sqrt(vocab); an untrained one scores
    near the vocabulary size, and then no mode's quality can be judged from it."""
    return ppl < math.sqrt(vocab_size)
