"""The offline API in the shape vLLM users know: LLM(...).generate(...) and .chat(...), and the
pooling ones: .embed(...), .classify(...) and .score(...).

An LLM owns one LLMEngine, built from its keyword arguments (EngineConfig's fields) when the LLM
is, and steps it on the caller's thread: `generate` adds every prompt as a request, steps the
engine until all have finished and returns their final RequestOutputs in prompt order; `chat`
applies the tokenizer's chat template first. Nothing runs between calls, so an LLM is for
scripts, tests and benchmarks; `generate(..., lora_request=...)` runs prompts under LoRA adapters
(engine/lora.py) as vLLM's does; the workers drive an engine through engine_loop.EngineLoop
instead. `shutdown` stops the engine's tensor-parallel ranks and removes its shared KV files;
it also runs when the LLM is garbage-collected. The pooling calls run each prompt as a pooling
request (engine/request.py PoolingParams) and answer in vLLM's shapes (`out.outputs.embedding`,
`.probs`, `.score`); `score` scores a pair as the HTTP front does (router/openai/scoring.py): by
the classification head on the two texts joined where the model has one, else by the cosine
similarity of their embeddings.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import LLMEngine
from pdserve.engine.lora import LoRARequest
from pdserve.engine.request import PoolingParams, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax of the logits (sigmoid for one label)
    logits: list[float]
    label: str  # the most likely label's name


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput:
    """One prompt's (or pair's) answer from embed, classify or score, as vLLM shapes it."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput


class LLM:
    def __init__(self, model: str = "smollm2", **kwargs):
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """lora_request (vLLM's keyword): the LoRA adapter every prompt runs under, or one per
        prompt (None: the base model); needs enable_lora=True."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"sampling_params has {len(sampling_params)} entries for "
                f"{len(prompts)} prompts; give one, or one per prompt"
            )
        if not isinstance(lora_request, (list, tuple)):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(
                f"lora_request has {len(lora_request)} entries for {len(prompts)} prompts; "
                f"give one, or one per prompt"
            )
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        added = []
        final = RequestOutputKind.FINAL_ONLY  # only the last output is kept: build no other
        as_final: dict[int, SamplingParams] = {}  # (one params object is often every prompt's)
        try:
            for rid, prompt, params, lora in zip(ids, prompts, sampling_params, lora_request):
                if params.output_kind != final:
                    key = id(params)
                    if key not in as_final:
                        as_final[key] = params.with_output(final)
                    params = as_final[key]
                self.engine.add_request(rid, prompt, params, lora_request=lora)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        if use_tqdm is None:
            use_tqdm = os.environ.get("PDSERVE_NO_PROGRESS") != "1" and len(prompts) > 1
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm) as bar:
            while len(results) < len(prompts):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[rid] for rid in ids]

    def embed(
        self, prompts: Prompt | Seq[Prompt], normalize: bool = True, pooling: str = "last"
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding: its last token's final hidden state ("mean": the mean over
        its tokens), L2-normalised unless normalize=False."""
        outs = self._pool(prompts, PoolingParams(pooling, normalize))
        return [
            PoolingRequestOutput(
                o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled.tolist())
            )
            for o in outs
        ]

    def classify(self, prompts: Prompt | Seq[Prompt]) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities, on a model with a classification head (a
        *ForSequenceClassification checkpoint, or classifier_from_token: engine/score_head.py)."""
        names = self._labels()
        results = []
        for o in self._pool(prompts, PoolingParams("classify")):
            logits = o.pooled
            probs = torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, -1)
            label = names[int(logits.argmax())]
            out = ClassificationOutput(probs.tolist(), logits.tolist(), label)
            results.append(PoolingRequestOutput(o.request_id, o.prompt_token_ids, out))
        return results

    def score(
        self, text_1: str | Seq[str], text_2: str | Seq[str], use_activation: bool = True
    ) -> list[PoolingRequestOutput]:
        """Each pair's score, paired 1:1, 1:N or N:N: with a classification head of one or two
        labels, the last label's probability for the two texts joined (its log-odds without the
        activation); without one, the cosine similarity of the two embeddings."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        if not first or not second or (len(first) > 1 and len(first) != len(second)):
            raise ValueError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: pair them 1:1, 1:N or "
                "N:N, at least one each"
            )
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second))
        if not self.engine.model_config.classifies:
            vectors = {}
            texts = list(dict.fromkeys(t for pair in pairs for t in pair))
            for text, o in zip(texts, self._pool(texts, PoolingParams("last", True))):
                vectors[text] = o
            return [
                PoolingRequestOutput(
                    f"score-{next(self._ids)}",
                    vectors[a].prompt_token_ids + vectors[b].prompt_token_ids,
                    ScoringOutput(float(vectors[a].pooled @ vectors[b].pooled)),
                )
                for a, b in pairs
            ]
        labels = len(self._labels())
        if labels > 2:
            raise ValueError(f"score needs one or two labels; this model has {labels}: classify")
        results = []
        for o in self._pool([a + b for a, b in pairs], PoolingParams("classify")):
            logit = o.pooled[0] if labels == 1 else o.pooled[-1] - o.pooled[0]
            value = torch.sigmoid(logit) if use_activation else logit
            results.append(
                PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(float(value)))
            )
        return results

    def _labels(self) -> tuple[str, ...]:
        mc = self.engine.model_config
        if mc.num_labels:
            return mc.label_names
        return self.engine.config.classifier_from_token

    def _pool(self, prompts: Prompt | Seq[Prompt], pooling: PoolingParams) -> list[RequestOutput]:
        """The finished RequestOutputs (each with `pooled`) of `prompts` run as pooling requests,
        in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [f"pool-{next(self._ids)}" for _ in prompts]
        added = []
        try:
            for rid, prompt in zip(ids, prompts):
                self.engine.add_request(rid, prompt, SamplingParams(max_tokens=1), pooling=pooling)
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool | None = None,
        **template_kwargs,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            tok.apply_chat_template(
                c, add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            for c in conversations
        ]
        # the template already holds the special tokens: do not let encode add a second BOS
        prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(prompt_ids, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
