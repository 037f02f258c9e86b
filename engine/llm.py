"""The offline API in the shape vLLM users know: LLM(...).generate(...) and .chat(...).

An LLM owns one LLMEngine, built from its keyword arguments (EngineConfig's fields) when the LLM
is, and steps it on the caller's thread: `generate` adds every prompt as a request, steps the
engine until all have finished and returns their final RequestOutputs in prompt order; `chat`
applies the tokenizer's chat template first. Nothing runs between calls, so an LLM is for
scripts, tests and benchmarks; `generate(..., lora_request=...)` runs prompts under LoRA adapters
(engine/lora.py) as vLLM's does; the workers drive an engine through engine_loop.EngineLoop
instead. `shutdown` stops the engine's tensor-parallel ranks and removes its shared KV files;
it also runs when the LLM is garbage-collected.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence as Seq

from tqdm import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import LLMEngine
from pdserve.engine.lora import LoRARequest
from pdserve.engine.request import RequestOutput
from pdserve.engine.sampling_params import SamplingParams

Prompt = str | list[int]


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
        try:
            for rid, prompt, params, lora in zip(ids, prompts, sampling_params, lora_request):
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
