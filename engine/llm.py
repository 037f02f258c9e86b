"""The offline API in the shape vLLM users know: LLM(...).generate(...) and .chat(...), the
pooling ones: .embed(...), .classify(...), .score(...) and .encode(...), and .beam_search(...)
(engine/beam_search.py's search, each step one `generate` batch of one token per beam).

An LLM owns one LLMEngine, built from its keyword arguments (EngineConfig's fields, and the vLLM
keywords `LLM.__init__` lists, mapped onto them here) when the LLM is, and steps it on the
caller's thread: `generate` adds every prompt as a request, steps the engine until all have
finished and returns their final RequestOutputs in prompt order; `chat` renders each
conversation with the tokenizer's chat template first, its messages parsed as vLLM's chat utils
parse them (OpenAI content parts: text joined, a vision-language model's images kept in order,
anything else refused). A prompt is a text, a list
of token ids, or vLLM's dict prompts ({"prompt": text} or {"prompt_token_ids": ids}, normalised
by `_prompt_inputs`), in every call that takes prompts; a vision-language model's takes images
too ({"multi_modal_data": {"image": ...}}, through the model's processor: `_with_images`). Nothing runs between calls, so an LLM is
for scripts, tests and benchmarks; `lora_request=...` runs prompts under LoRA adapters
(engine/lora.py) as vLLM's does; the workers drive an engine through engine_loop.EngineLoop
instead. `shutdown` stops the engine's tensor-parallel ranks and removes its shared KV files;
it also runs when the LLM is garbage-collected. The pooling calls run each prompt as a pooling
request (engine/request.py PoolingParams) and answer in vLLM's shapes (`out.outputs.embedding`,
`.probs`, `.score`, and `encode`'s `.data`); `score` scores a pair as the HTTP front does
(router/openai/scoring.py): by the classification head on the two texts joined where the model
has one, else by the cosine similarity of their embeddings.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from tqdm import tqdm

from pdserve.engine import chat_content
from pdserve.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, run
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine_core import LLMEngine
from pdserve.engine.image_keys import ImageInputs, image_inputs, processor_inputs
from pdserve.engine.loader import resolve_model
from pdserve.engine.lora import LoRARequest
from pdserve.engine.outputs import vllm_output
from pdserve.engine.request import PoolingParams, RequestOutput
from pdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pdserve.protos.limits import image_limit, mm_processor_kwargs as _processor_kwargs

log = logging.getLogger(__name__)

# a text, token ids, or vLLM's TextPrompt / TokensPrompt: {"prompt": text} or
# {"prompt_token_ids": ids} (a TokensPrompt's "prompt" is the text its output reports), either
# with an optional "cache_salt"
Prompt = str | list[int] | dict


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
class PoolingOutput:
    """`encode`'s output (vLLM's): the embedding, or the class probabilities, as a tensor."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """One prompt's (or pair's) answer from embed, classify, score or encode, as vLLM shapes it;
    it is returned once its request has finished, so `finished` is always True."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput | PoolingOutput
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = True


# ---- prompts -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Input:
    """One prompt as the engine takes it (text or ids), the text its RequestOutput reports (None
    for token ids given without one) and its prefix-cache salt (None: the params')."""

    prompt: str | list[int]
    text: str | None = None
    cache_salt: str | None = None
    images: tuple | None = None  # a vision-language model's images (multi_modal_data's "image")
    # tokenization_kwargs' add_special_tokens for a text with images, which the processor
    # tokenizes (a text without images is tokenized by `_encoded` itself); None: its default
    add_special_tokens: bool | None = None
    # vLLM's mm_processor_kwargs of this prompt: more arguments of the processor's call for its
    # images (Qwen2-VL's max_pixels), over the LLM's own
    mm_kwargs: dict | None = None


# what a prompt dict may hold; its other vLLM keys (prompt_embeds, encoder_prompt, ...) are
# refused unless None, since the engine runs decoders; multi_modal_data may hold images only
_PROMPT_KEYS = (
    "prompt",
    "prompt_token_ids",
    "cache_salt",
    "multi_modal_data",
    "mm_processor_kwargs",
)


def _prompt_inputs(prompts, name: str = "prompts") -> list[_Input]:
    """Every prompt of `prompts` (one prompt, or a sequence of them, of any kinds mixed) as an
    _Input; a ValueError naming the prompt where one is malformed."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    else:
        prompts = list(prompts)
        if prompts and isinstance(prompts[0], int):  # one prompt of token ids
            prompts = [prompts]
    return [_one_input(p, f"{name}[{i}]") for i, p in enumerate(prompts)]


def _one_input(p, where: str) -> _Input:
    """One prompt (a text, token ids or a prompt dict) as an _Input; `where` names it in errors."""
    if isinstance(p, str):
        return _Input(p, p)
    if isinstance(p, (list, tuple)):
        return _Input(list(p))
    if not isinstance(p, dict):
        raise ValueError(
            f"{where} must be a str, a list of token ids, or a dict with 'prompt' (a str) or "
            f"'prompt_token_ids' (a list of ints); got {type(p).__name__}"
        )
    extra = sorted(k for k, v in p.items() if k not in _PROMPT_KEYS and v is not None)
    if extra:
        raise ValueError(
            f"{where} has {extra}: this engine runs text-only decoder models, and a prompt dict "
            f"may hold 'prompt' or 'prompt_token_ids', and 'cache_salt'"
        )
    salt = p.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"{where}['cache_salt'] must be a str, got {type(salt).__name__}")
    images = _images(p.get("multi_modal_data"), where)
    mm_kwargs = _processor_kwargs(p.get("mm_processor_kwargs"), f"{where}['mm_processor_kwargs']")
    text = p.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}['prompt'] must be a str, got {type(text).__name__}")
    ids = p.get("prompt_token_ids")
    if ids is not None:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"{where}['prompt_token_ids'] must be a list of ints, got {type(ids).__name__}"
            )
        return _Input(list(ids), text, salt, images, mm_kwargs=mm_kwargs)
    if text is None:
        raise ValueError(f"{where} needs 'prompt' (a str) or 'prompt_token_ids' (a list of ints)")
    return _Input(text, text, salt, images, mm_kwargs=mm_kwargs)


def _images(data, where: str) -> tuple | None:
    """multi_modal_data's images (vLLM's {"image": an image or a list of them}; each anything
    the model's image processor takes: a PIL image, an array), or None."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError(f"{where}['multi_modal_data'] must be a dict, got {type(data).__name__}")
    other = sorted(k for k, v in data.items() if k != "image" and v is not None)
    if other:
        raise ValueError(
            f"{where}['multi_modal_data'] has {other}: this engine takes images only ('image')"
        )
    images = data.get("image")
    if images is None:
        return None
    images = tuple(images) if isinstance(images, (list, tuple)) else (images,)
    if not images:
        raise ValueError(f"{where}['multi_modal_data']['image'] is an empty list")
    return images


def _per_prompt(value, n: int, name: str) -> list:
    """`value` for each of n prompts: a list or tuple must have one per prompt, anything else is
    every prompt's."""
    if not isinstance(value, (list, tuple)):
        return [value] * n
    if len(value) != n:
        raise ValueError(
            f"{name} has {len(value)} entries for {n} prompts; give one, or one per prompt"
        )
    return list(value)


def _special_ends(with_special: list[int], without: list[int]) -> tuple[int, int]:
    """(before, after): how many of a text's ids with its special tokens come before its own ids
    and after them (the router's rule, router/service.py special_ends); (0, 0) where none fits."""
    extra = len(with_special) - len(without)
    for before in range(extra, -1, -1):
        if with_special[before : before + len(without)] == without:
            return before, extra - before
    return 0, 0


# ---- chats ---------------------------------------------------------------------------------------
# content parts read as text, and the key holding each one's text (vLLM's chat_utils MM_PARSER_MAP)
_TEXT_PARTS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
# apply_chat_template's own parameters: chat_template_kwargs holds the template's variables
_TEMPLATE_PARAMS = frozenset(
    "conversation messages tools chat_template add_generation_prompt continue_final_message "
    "tokenize padding truncation max_length return_tensors return_dict "
    "return_assistant_tokens_mask tokenizer_kwargs sanitize_control_tokens".split()
)


# image content parts (vLLM's chat_utils): a URL (data: only here) or a PIL image as given
_IMAGE_PARTS = ("image_url", "image_pil")


def _part_image(part: dict, where: str):
    """An image content part's image: {"type": "image_url", "image_url": {"url": "data:..."}}
    (base64 data URLs; nothing is fetched) or {"type": "image_pil", "image_pil": image}."""
    if part["type"] == "image_pil":
        return part.get("image_pil")
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url:
        raise ValueError(
            f"{where}: an image_url must be a base64 data URL (data:image/png;base64,...): the "
            f"engine fetches nothing; or pass the image itself as an image_pil part"
        )
    import base64
    import binascii
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(base64.b64decode(url.split(";base64,", 1)[1], validate=True)))
        image.load()
    except (binascii.Error, UnidentifiedImageError, OSError) as e:
        raise ValueError(f"{where}: the image_url's data is not an image ({e})") from None
    return image


def _part_text(part, where: str, images: list | None = None) -> str | None:
    """A content part's text (None: an empty part, skipped as vLLM skips it); an image part's
    image goes to `images` (a vision-language model's chat; else refused) and stands in the text
    as IMAGE_PART; a ValueError for any other part."""
    if isinstance(part, str):
        return part or None
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in _IMAGE_PARTS and images is not None:
        images.append(_part_image(part, where))
        return IMAGE_PART
    if kind not in _TEXT_PARTS:
        takes = "text only" if images is None else "text and images"
        raise ValueError(
            f"{where} is a content part of type {str(kind)[:40]!r}: this engine reads {takes} "
            f"(parts of type {sorted(_TEXT_PARTS)}"
            f"{'' if images is None else ' and ' + str(list(_IMAGE_PARTS))}); "
            f"{'images, ' if images is None else ''}audio and video are not supported"
        )
    text = part.get(_TEXT_PARTS[kind])
    if text is not None and not isinstance(text, str):
        raise ValueError(f"{where}[{_TEXT_PARTS[kind]!r}] must be a str, got {type(text).__name__}")
    return text or None


IMAGE_PART = object()  # where an image part stood among a message's parts (_part_text)


def _conversation(
    messages, content_format: str, where: str, images: list | None = None, placeholder: str = ""
) -> list[dict]:
    """The messages as the chat template reads them, parsed as vLLM's parse_chat_messages parses
    them: each message's content (a str, a list of parts, or None) becomes its text parts joined
    with "\\n" ("string" format) or those parts as [{"type": "text", "text": ...}] ("openai"; a
    tool message's joined all the same); every other key is kept as given. `images`: a
    vision-language model's chat, whose image parts' images are appended to it, in order; an
    image part is {"type": "image"} ("openai": the template writes the placeholder) or
    `placeholder` and a newline ahead of the message's text ("string", as vLLM places it)."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} must be a list of messages, got {type(messages).__name__}")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}[{i}] must be a dict with a 'role' (a str) and a 'content'")
        content = message.get("content")
        if content is None:
            parts = []
        elif isinstance(content, str):
            parts = [content]
        elif isinstance(content, (list, tuple)):
            found = (
                _part_text(p, f"{where}[{i}].content[{j}]", images) for j, p in enumerate(content)
            )
            parts = [t for t in found if t is not None]
        else:
            raise ValueError(
                f"{where}[{i}].content must be a str, a list of content parts or None, got "
                f"{type(content).__name__}"
            )
        if content_format == "string" or message["role"] == "tool":
            shown = sum(p is IMAGE_PART for p in parts)
            text = "\n".join(p for p in parts if p is not IMAGE_PART)
            content = f"{placeholder}\n" * shown + text
        else:
            content = [
                {"type": "image"} if t is IMAGE_PART else {"type": "text", "text": t} for t in parts
            ]
        out.append({**message, "content": content})
    return out


# ---- LLM(...)'s vLLM keywords ---------------------------------------------------------------
_CLASSIFY = "classify needs a classification head (a *ForSequenceClassification checkpoint)"
# vLLM keywords accepted where they change nothing on this engine: the values accepted (None:
# any), and why the others are refused
_NO_EFFECT = {
    "trust_remote_code": (None, ""),  # the engine runs its own model classes, never a repo's code
    "disable_log_stats": (None, ""),  # logging only
    "swap_space": (None, ""),  # vLLM V1 has no swap either: a preempted sequence is recomputed
    "enable_chunked_prefill": (None, ""),  # prompts are always chunked; results do not depend on it
    "tokenizer_mode": (
        ("auto", "hf"),
        "the tokenizer loads as transformers' AutoTokenizer, the fast one where there is one",
    ),
    "skip_tokenizer_init": ((False,), "the engine always loads the tokenizer"),
    "cpu_offload_gb": ((0,), "every weight stays on the engine's device"),
    "runner": (
        ("auto", "generate", "pooling"),
        "one engine generates and pools; a draft model is speculative_config's",
    ),
    "convert": (("auto", "none", "embed"), _CLASSIFY),
    "task": (("auto", "generate", "embed", "embedding", "classify", "score"), _CLASSIFY),
    "disable_custom_all_reduce": (None, ""),  # the tensor-parallel reduction is the engine's own
    "allowed_local_media_path": (("",), "the engine opens no file: pass the image itself"),
    "allowed_media_domains": ((None,), "the engine fetches nothing: pass the image itself"),
    "enable_return_routed_experts": ((False,), "the engine does not report routed experts"),
    "hf_token": ((None, True), "set HF_TOKEN in the environment: the Hub client reads it there"),
    "compilation_config": (
        (None,),
        "the engine does not torch.compile; its CUDA graphs are off under enforce_eager=True",
    ),
    "attention_config": ((None,), "the engine's attention kernels are its own"),
    "profiler_config": ((None,), "the engine has no torch profiler hook"),
    "pooler_config": (
        (None,),
        "pooling is chosen per call: embed(pooling='mean', normalize=False) or pooling_params",
    ),
    "logits_processors": ((None, []), "the engine samples with its own sampler"),
    "structured_outputs_config": (
        (None,),
        "structured output runs the engine's own grammar backend (SamplingParams.structured)",
    ),
}
# vLLM keywords whose None means "the engine's default"
_NONE_IS_DEFAULT = (
    "seed",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "block_size",
)
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and torch's) names


def _vllm_neutral(kwargs: dict) -> None:
    """Removes the keywords of _NO_EFFECT from `kwargs`, refusing a value that would change what
    the engine does, and the None of _NONE_IS_DEFAULT."""
    for name, (accepted, why) in _NO_EFFECT.items():
        if name not in kwargs:
            continue
        value = kwargs.pop(name)
        if accepted is not None and not any(_same(value, a) for a in accepted):
            raise ValueError(
                f"{name}={value!r} is not supported: {why} (accepted: "
                f"{', '.join(map(repr, accepted))})"
            )
    for name in _NONE_IS_DEFAULT:
        if name in kwargs and kwargs[name] is None:
            del kwargs[name]
    dtype = kwargs.get("dtype")
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if isinstance(dtype, str):
        kwargs["dtype"] = _DTYPE_ALIASES.get(dtype, dtype)


def _same(value, accepted) -> bool:
    """value == accepted, a bool only equal to itself (False is not 0 here, nor 0 False)."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    return value == accepted


def _vllm_memory_and_graphs(kwargs: dict) -> None:
    """enforce_eager (no CUDA graphs), kv_cache_memory_bytes (kv_cache_memory) and
    gpu_memory_utilization, in place in `kwargs`."""
    if "enforce_eager" in kwargs:
        eager = kwargs.pop("enforce_eager")
        if not isinstance(eager, bool):
            raise ValueError(f"enforce_eager must be True or False, got {eager!r}")
        if eager and kwargs.get("cuda_graphs") is True:
            raise ValueError("enforce_eager=True and cuda_graphs=True disagree: pass one of them")
        if eager:
            kwargs["cuda_graphs"] = False
    if kwargs.get("kv_cache_memory_bytes") is not None:
        size = kwargs.pop("kv_cache_memory_bytes")
        if kwargs.get("kv_cache_memory") not in (None, size):
            raise ValueError("kv_cache_memory_bytes and kv_cache_memory disagree: pass one of them")
        kwargs["kv_cache_memory"] = size
    kwargs.pop("kv_cache_memory_bytes", None)
    if "gpu_memory_utilization" not in kwargs:
        return
    share = kwargs.pop("gpu_memory_utilization")
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 < share <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {share!r}")
    device = kwargs.get("device", "auto")
    on_gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if on_gpu and kwargs.get("kv_cache_memory") is None:
        raise ValueError(
            f"gpu_memory_utilization={share!r} is vLLM's share of the whole GPU (weights, "
            f"activations and KV cache); this engine sizes its KV cache alone: pass "
            f"kv_cache_memory instead (bytes, or a fraction of the free memory at start)"
        )


def _vllm_overrides(kwargs: dict) -> None:
    """hf_overrides: the keys a reranker built from a generative checkpoint needs (vLLM's
    recipe for Qwen3-Reranker), classifier_from_token honoured; any other key refused."""
    overrides = kwargs.pop("hf_overrides", None) or {}
    if not isinstance(overrides, dict):
        raise ValueError(
            "hf_overrides must be a dict here (a function of the config is not supported)"
        )
    tokens = overrides.get("classifier_from_token")
    if tokens is not None:
        if kwargs.get("classifier_from_token") not in (None, (), [], tokens):
            raise ValueError(
                "hf_overrides['classifier_from_token'] and classifier_from_token disagree"
            )
        kwargs["classifier_from_token"] = tokens
    # vLLM's recipe for a reranker built from a generative checkpoint: its architectures as a
    # classifier's and is_original_qwen3_reranker, beside the label tokens, whose head gives the
    # last label's probability as vLLM's converted Qwen3-Reranker head does (engine/score_head.py)
    archs = overrides.get("architectures")
    recipe = archs is None or (
        isinstance(archs, (list, tuple))
        and all(str(a).endswith("ForSequenceClassification") for a in archs)
    )
    if (archs is not None or overrides.get("is_original_qwen3_reranker")) and not (
        tokens and recipe
    ):
        raise ValueError(
            "hf_overrides['architectures'] and ['is_original_qwen3_reranker'] are supported only "
            "as vLLM's reranker recipe: *ForSequenceClassification architectures together with "
            "classifier_from_token"
        )
    known = {"classifier_from_token", "architectures", "is_original_qwen3_reranker"}
    other = sorted(set(overrides) - known)
    if other:
        raise ValueError(
            f"hf_overrides {other} are not supported: the engine reads the checkpoint's "
            f"config.json as it is (edit a copy of the checkpoint instead)"
        )


def _vllm_source(model: str, kwargs: dict) -> str:
    """The model string with vLLM's revision applied (a Hub id's @REVISION), after checking
    that tokenizer and tokenizer_revision name the model's own tokenizer."""
    from pdserve.engine.loader.hub import parse_hub_id

    revision = kwargs.pop("revision", None)
    tokenizer = kwargs.pop("tokenizer", None)
    tokenizer_revision = kwargs.pop("tokenizer_revision", None)
    hub = parse_hub_id(model) if isinstance(model, str) else None
    local = isinstance(model, str) and os.path.exists(os.path.expanduser(model))
    source = model
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise ValueError(f"revision must be a non-empty str, got {revision!r}")
        if local or hub is None:
            raise ValueError(
                f"revision={revision!r} names a Hub revision, but model={model!r} is not a Hub "
                f"id (ORG/NAME): leave revision unset for a local model"
            )
        if hub[1] not in (None, revision):
            raise ValueError(f"model={model!r} and revision={revision!r} name two revisions")
        source = f"{hub[0]}@{revision}"
    same = tokenizer is None or tokenizer in (model, hub[0] if hub else model)
    if not same and local and os.path.exists(os.path.expanduser(tokenizer)):
        same = os.path.realpath(os.path.expanduser(tokenizer)) == os.path.realpath(
            os.path.expanduser(model)
        )
    if not same:
        raise ValueError(
            f"tokenizer={tokenizer!r}: the engine reads the tokenizer from the model's own "
            f"files; another tokenizer is not supported (copy its files into a copy of the "
            f"model, or leave tokenizer unset)"
        )
    if tokenizer_revision not in (None, revision, hub[1] if hub else None):
        raise ValueError(
            f"tokenizer_revision={tokenizer_revision!r}: the tokenizer comes from the model's "
            f"own revision; leave it unset or equal to revision"
        )
    return source


class LLM:
    def __init__(self, model: str = "smollm2", **kwargs):
        """An engine of `model` (a local HF directory, a .gguf, "smollm2", or a Hub id
        ORG/NAME[@REVISION]) built from EngineConfig's fields, and vLLM's LLM(...) keywords:

        Honoured: revision (a Hub id's revision), tokenizer and tokenizer_revision (naming the
        model's own only: another tokenizer is refused), dtype (with vLLM's "half" and "float"
        and torch dtypes), seed (None: 0), enforce_eager (True: no CUDA graphs, which run only
        on CUDA), kv_cache_memory_bytes (kv_cache_memory), override_generation_config (sampling
        defaults over the model's generation_config.json: get_default_sampling_params),
        hf_overrides's
        classifier_from_token (with vLLM's reranker recipe's architectures and
        is_original_qwen3_reranker), and EngineConfig's own vLLM names (tensor_parallel_size,
        pipeline_parallel_size, max_model_len, max_num_seqs, max_num_batched_tokens,
        block_size, enable_prefix_caching, kv_cache_dtype, quantization, load_format,
        speculative_config, enable_lora, max_loras, max_lora_rank; None where vLLM's default is
        None: the engine's default), limit_mm_per_prompt ({"image": N}) and mm_processor_kwargs
        (the model processor's call arguments for every prompt's images, such as Qwen2-VL's
        max_pixels; a prompt dict's own and LLM.chat's go over them).

        Accepted with no effect, since they cannot change results here (_NO_EFFECT):
        trust_remote_code (the engine runs its own model classes, never a checkpoint's code),
        disable_log_stats, swap_space, enable_chunked_prefill, disable_custom_all_reduce,
        tokenizer_mode "auto"/"hf", skip_tokenizer_init=False, cpu_offload_gb=0, runner
        "auto"/"generate"/"pooling", convert "auto"/"none"/"embed", task (not "reward"),
        hf_token None/True, the multimodal, compilation, attention, profiler, pooler,
        logits-processor and structured-output keywords at their defaults, and
        gpu_memory_utilization on a CPU engine or beside kv_cache_memory (which wins, as vLLM's
        kv_cache_memory_bytes does).

        Refused with a ValueError naming the keyword: other values of those,
        gpu_memory_utilization alone on a GPU (vLLM's share of the whole GPU; pass
        kv_cache_memory), and other hf_overrides keys. A keyword neither EngineConfig nor this
        list knows is a TypeError, as a misspelt keyword argument is."""
        kwargs = dict(kwargs)
        from pdserve.engine.loader import generation_config as gen_config

        self._sleep_mode = kwargs.pop("enable_sleep_mode", False)
        if not isinstance(self._sleep_mode, bool):
            raise ValueError(f"enable_sleep_mode must be True or False, got {self._sleep_mode!r}")
        # vLLM's limit_mm_per_prompt ({"image": N}): the images one prompt may hold
        self._max_images = image_limit(kwargs.pop("limit_mm_per_prompt", None))
        # vLLM's mm_processor_kwargs: the processor call's arguments for every prompt's images
        self._mm_kwargs = _processor_kwargs(kwargs.pop("mm_processor_kwargs", None))
        self._override = kwargs.pop("override_generation_config", None) or {}
        gen_config.check_override(self._override, "override_generation_config")
        model = _vllm_source(model, kwargs)
        _vllm_neutral(kwargs)
        _vllm_memory_and_graphs(kwargs)
        _vllm_overrides(kwargs)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._default_params: SamplingParams | None = None  # get_default_sampling_params's
        self._ids = itertools.count()
        self._processor = None  # a vision-language model's, loaded with its first images

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- generation ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm=None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        *,
        priority: Seq[int] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Each prompt's final RequestOutput, in prompt order. prompts: one or a list (texts,
        token ids, and vLLM's {"prompt": ...} / {"prompt_token_ids": ...} dicts, mixed as they
        come). sampling_params, lora_request (vLLM's; needs enable_lora=True; None: the base
        model) and priority (lower runs first): one for every prompt, or one per prompt.
        use_tqdm: True, False, a tqdm-like factory, or None (a bar for several prompts unless
        PDSERVE_NO_PROGRESS=1). tokenization_kwargs: {"add_special_tokens": bool} for text
        prompts (default True)."""
        inputs = self._encoded(_prompt_inputs(prompts), tokenization_kwargs, pooling=False)
        n = len(inputs)
        default = self.get_default_sampling_params()
        params = _per_prompt(sampling_params, n, "sampling_params")
        params = self._final_params([default if p is None else p for p in params], inputs)
        loras = _per_prompt(lora_request, n, "lora_request")
        if priority is not None and not isinstance(priority, (list, tuple)):
            raise ValueError(f"priority must be a list of ints, one per prompt, got {priority!r}")
        priorities = _per_prompt(0 if priority is None else priority, n, "priority")
        ids = self._add_all("gen", inputs, params, loras, priorities)
        outputs = self._run(ids, inputs, use_tqdm, "generate")
        # vLLM's shapes of logprobs asked for as vLLM asks (an int count), and cumulative_logprob
        return [vllm_output(o, p, self.engine.tokenizer) for o, p in zip(outputs, params)]

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: the SamplingParams a call given none runs with: SamplingParams() with the
        sampling fields the model's generation_config.json sets (engine/loader/
        generation_config.py; none under generation_config="vllm") with
        override_generation_config's over them, logged once as vLLM logs them."""
        if self._default_params is None:
            from pdserve.engine.loader import generation_config as gen_config

            config = self.engine.config
            found = gen_config.default_sampling_params(
                resolve_model(config.model), config.generation_config, self._override
            )
            if found:
                log.info("%s: %s", gen_config.OVERRIDE_NOTICE, gen_config.describe(found))
            self._default_params = SamplingParams(**found)
        return self._default_params

    def _final_params(self, params: list, inputs: list[_Input]) -> list[SamplingParams]:
        """Each prompt's params as FINAL_ONLY (only the last output is kept: the engine builds no
        other) and with its prompt dict's cache_salt, one copy per params object and salt (one
        object is often every prompt's)."""
        final = RequestOutputKind.FINAL_ONLY
        made: dict[tuple[int, str | None], SamplingParams] = {}
        out = []
        for p, inp in zip(params, inputs):
            if not isinstance(p, SamplingParams):
                raise ValueError(
                    f"sampling_params must be SamplingParams (one, or one per prompt), got "
                    f"{type(p).__name__}"
                )
            key = (id(p), inp.cache_salt)
            if key not in made:
                q = p if p.output_kind == final else p.with_output(final)
                if inp.cache_salt is not None:
                    q = dataclasses.replace(q, cache_salt=inp.cache_salt)
                made[key] = q
            out.append(made[key])
        return out

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm=None,
        lora_request: LoRARequest | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each rendered with
        `chat_template` (None: the tokenizer's) and generated as `generate` does, under
        `lora_request`. Content parts are parsed as vLLM parses them (_conversation), in
        chat_template_content_format: "string", "openai", or "auto" (detected from the template
        as vLLM detects it). add_generation_prompt opens the assistant's turn;
        continue_final_message=True (with add_generation_prompt=False) continues the last
        message instead. tools and chat_template_kwargs (more template variables, e.g.
        {"enable_thinking": False}) reach the template. tokenization_kwargs:
        {"add_special_tokens": bool} (default False: the template holds the special tokens).
        Each output's `prompt` is the rendered text."""
        mm_kwargs = _processor_kwargs(mm_processor_kwargs, "mm_processor_kwargs")
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True continues the last message: set "
                "add_generation_prompt=False with it"
            )
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                f"{chat_template_content_format!r}"
            )
        extra = dict(chat_template_kwargs or {})
        reserved = sorted(k for k in extra if k in _TEMPLATE_PARAMS or not str(k).isidentifier())
        if reserved:
            raise ValueError(
                f"chat_template_kwargs sets {reserved}, which are not template variables: "
                f"add_generation_prompt, continue_final_message, tools and chat_template are "
                f"chat's own keywords"
            )
        tok = self.engine.tokenizer
        content_format = chat_template_content_format
        if content_format == "auto":
            content_format = chat_content.content_format(
                tok.get_chat_template(chat_template, tools)
            )
        one = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        options = dict(
            extra,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
        takes_images = self.engine.image_encoder is not None
        prompts = []
        for i, conversation in enumerate(conversations):
            where = "messages" if one else f"messages[{i}]"
            images = [] if takes_images else None
            placeholder = self._image_placeholder() if takes_images else ""
            parsed = _conversation(conversation, content_format, where, images, placeholder)
            text = tok.apply_chat_template(parsed, tokenize=False, **options)
            prompts.append(
                {
                    "prompt": text,
                    "multi_modal_data": {"image": images or None},
                    "mm_processor_kwargs": mm_kwargs or None,
                }
            )
        kw = {"add_special_tokens": False, **(tokenization_kwargs or {})}
        return self.generate(
            prompts, sampling_params, use_tqdm, lora_request, tokenization_kwargs=kw
        )

    # ---- beam search -----------------------------------------------------------------------------
    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm=False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search: each prompt's best params.beam_width sequences, best first
        (engine/beam_search.py runs the search). Each step runs every live beam of the prompts
        (of each group of concurrency_limit prompts, where given) as one `generate` batch of
        one token with logprobs=2 x beam_width at params.temperature, each beam's whole token
        list as its prompt, so the prefix cache computes only its new token's block. prompts:
        texts (tokenized with the tokenizer's special tokens, as vLLM's tokenizer.encode), token
        ids and vLLM's prompt dicts (a dict's cache_salt holds for every step); lora_request one
        for every prompt or one per prompt. A sequence's `tokens` are its prompt's and its own
        (an end-of-sequence token included), its `text` all of them decoded (special tokens
        kept), as vLLM's; `finish_reason` "stop" (stop_reason the end-of-sequence id) or
        "length" (max_tokens, or the context full). use_tqdm: a bar over the steps."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(
                f"params must be BeamSearchParams (pdserve.engine), got {type(params).__name__}"
            )
        if concurrency_limit is not None and (
            not isinstance(concurrency_limit, int)
            or isinstance(concurrency_limit, bool)
            or concurrency_limit < 1
        ):
            raise ValueError(f"concurrency_limit must be an int >= 1, got {concurrency_limit!r}")
        inputs = _prompt_inputs(prompts)
        loras = _per_prompt(lora_request, len(inputs), "lora_request")
        tok = self.engine.tokenizer
        searches = []
        for i, (inp, lora) in enumerate(zip(inputs, loras)):
            ids = tok.encode(inp.prompt) if isinstance(inp.prompt, str) else inp.prompt
            if not ids:
                raise ValueError(f"prompts[{i}] is empty")
            context = {"cache_salt": inp.cache_salt, "lora_request": lora}
            searches.append(
                BeamSearch(ids, params, tok.eos_token_id, lora_request=lora, context=context)
            )
        step = SamplingParams(
            logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature
        )
        group = concurrency_limit or max(len(searches), 1)
        for start in range(0, len(searches), group):
            bar = _steps_bar(use_tqdm, params.max_tokens)
            try:
                run(
                    searches[start : start + group],
                    lambda owners, tokens: self._beam_step(owners, tokens, step),
                    on_step=lambda: bar.update(1),
                )
            finally:
                bar.close()
        outputs = []
        for search in searches:
            best = search.best()
            for seq in best:
                seq.text = tok.decode(seq.tokens)
            outputs.append(BeamSearchOutput(best))
        return outputs

    def _beam_step(self, owners, tokens: list[list[int]], params: SamplingParams) -> list:
        """One beam search step: each token list's {token id: Logprob} of its next token (the
        2 x beam_width most likely and the sampled one), through `generate`; None for a list
        that fills the context."""
        limit = self.engine.config.max_model_len
        fits = [i for i, t in enumerate(tokens) if len(t) < limit]
        results: list = [None] * len(tokens)
        if not fits:
            return results
        prompts = [
            {"prompt_token_ids": tokens[i], "cache_salt": owners[i].context["cache_salt"]}
            for i in fits
        ]
        loras = [owners[i].context["lora_request"] for i in fits]
        outs = self.generate(prompts, params, use_tqdm=False, lora_request=loras)
        for i, out in zip(fits, outs):
            logprobs = out.outputs[0].logprobs
            results[i] = logprobs[0] if logprobs else None
        return results

    # ---- pooling ---------------------------------------------------------------------------------
    def embed(
        self,
        prompts: Prompt | Seq[Prompt],
        normalize: bool = True,
        pooling: str = "last",
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm=None,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's embedding: its last token's final hidden state ("mean": the mean over
        its tokens), L2-normalised unless normalize=False; pooling_params (engine/request.py
        PoolingParams, one or one per prompt) in their place where given.
        truncate_prompt_tokens=k keeps each prompt's first k tokens (-1: max_model_len - 1),
        the special tokens its tokenizer adds at either end kept, as vLLM cuts a pooling
        model's inputs."""
        inputs = _prompt_inputs(prompts)
        if pooling_params is None:
            pooling_params = PoolingParams(pooling, normalize)
        outs = self._pool(
            inputs,
            _pooling_list(pooling_params, len(inputs), embed=True),
            use_tqdm,
            lora_request,
            _pool_tokenization(tokenization_kwargs, truncate_prompt_tokens),
        )
        return [
            PoolingRequestOutput(
                o.request_id,
                o.prompt_token_ids,
                EmbeddingOutput(o.pooled.tolist()),
                o.num_cached_tokens,
            )
            for o in outs
        ]

    def classify(
        self,
        prompts: Prompt | Seq[Prompt],
        *,
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        use_tqdm=None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's class probabilities, on a model with a classification head (a
        *ForSequenceClassification checkpoint, or classifier_from_token: engine/score_head.py)."""
        names = self._labels()
        inputs = _prompt_inputs(prompts)
        params = _pooling_list(pooling_params or PoolingParams("classify"), len(inputs), False)
        results = []
        for o in self._pool(inputs, params, use_tqdm, lora_request, tokenization_kwargs):
            logits = o.pooled
            probs = torch.sigmoid(logits) if len(logits) == 1 else torch.softmax(logits, -1)
            label = names[int(logits.argmax())]
            out = ClassificationOutput(probs.tolist(), logits.tolist(), label)
            results.append(
                PoolingRequestOutput(o.request_id, o.prompt_token_ids, out, o.num_cached_tokens)
            )
        return results

    def encode(
        self,
        prompts: Prompt | Seq[Prompt],
        pooling_params: PoolingParams | Seq[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm=None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: dict | None = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's LLM.encode: each prompt pooled for `pooling_task` ("embed": the embedding, as
        `embed` gives it; "classify": the class probabilities, as `classify` gives them), its
        `outputs.data` a tensor."""
        kw = dict(use_tqdm=use_tqdm, lora_request=lora_request, pooling_params=pooling_params)
        kw["tokenization_kwargs"] = _pool_tokenization(tokenization_kwargs, truncate_prompt_tokens)
        if pooling_task == "embed":
            outs = self.embed(prompts, **kw)
            data = [o.outputs.embedding for o in outs]
        elif pooling_task == "classify":
            outs = self.classify(prompts, **kw)
            data = [o.outputs.probs for o in outs]
        else:
            raise ValueError(
                f"pooling_task={pooling_task!r}: encode needs pooling_task 'embed' (or use "
                f"embed) or 'classify' (or use classify); score pairs with score; per-token "
                f"tasks are not supported"
            )
        return [
            PoolingRequestOutput(
                o.request_id,
                o.prompt_token_ids,
                PoolingOutput(torch.tensor(d)),
                o.num_cached_tokens,
            )
            for o, d in zip(outs, data)
        ]

    def score(
        self,
        text_1: Prompt | Seq[Prompt],
        text_2: Prompt | Seq[Prompt],
        use_activation: bool = True,
        *,
        use_tqdm=None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each pair's score, paired 1:1, 1:N or N:N: with a classification head of one or two
        labels, the last label's probability for the two texts joined (its log-odds without the
        activation; two token-id prompts are joined as their ids); without one, the cosine
        similarity of the two embeddings. Each side may hold texts, token ids and vLLM's prompt
        dicts."""
        first = _prompt_inputs(text_1, "text_1")
        second = _prompt_inputs(text_2, "text_2")
        if not first or not second or (len(first) > 1 and len(first) != len(second)):
            raise ValueError(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: pair them 1:1, 1:N or "
                "N:N, at least one each"
            )
        pairs = list(zip(first * len(second) if len(first) == 1 else first, second))
        if not self.engine.model_config.classifies:
            return self._embedding_scores(pairs, use_tqdm, lora_request)
        labels = len(self._labels())
        if labels > 2:
            raise ValueError(f"score needs one or two labels; this model has {labels}: classify")
        joined = [_joined(a, b, i) for i, (a, b) in enumerate(pairs)]
        results = []
        params = [PoolingParams("classify")] * len(joined)
        for o in self._pool(joined, params, use_tqdm, lora_request):
            logit = o.pooled[0] if labels == 1 else o.pooled[-1] - o.pooled[0]
            value = torch.sigmoid(logit) if use_activation else logit
            out = ScoringOutput(float(value))
            results.append(
                PoolingRequestOutput(o.request_id, o.prompt_token_ids, out, o.num_cached_tokens)
            )
        return results

    def _embedding_scores(self, pairs, use_tqdm, lora_request) -> list[PoolingRequestOutput]:
        """The cosine similarity of each pair's embeddings (each distinct prompt embedded once)."""
        keys = {}
        for inp in (x for pair in pairs for x in pair):
            keys.setdefault(_key(inp), inp)
        unique = list(keys.values())
        params = [PoolingParams("last", True)] * len(unique)
        outs = self._pool(unique, params, use_tqdm, lora_request)
        vectors = {_key(inp): o for inp, o in zip(unique, outs)}
        results = []
        for a, b in pairs:
            va, vb = vectors[_key(a)], vectors[_key(b)]
            results.append(
                PoolingRequestOutput(
                    f"score-{next(self._ids)}",
                    va.prompt_token_ids + vb.prompt_token_ids,
                    ScoringOutput(float(va.pooled @ vb.pooled)),
                    va.num_cached_tokens + vb.num_cached_tokens,
                )
            )
        return results

    def _labels(self) -> tuple[str, ...]:
        mc = self.engine.model_config
        if mc.num_labels:
            return mc.label_names
        return self.engine.config.classifier_from_token

    def _pool(
        self,
        inputs: list[_Input],
        pooling: list[PoolingParams],
        use_tqdm=None,
        lora_request=None,
        tokenization: dict | None = None,
    ) -> list[RequestOutput]:
        """The finished RequestOutputs (each with `pooled`) of `inputs` run as pooling requests
        (`pooling`: one per input), in order."""
        inputs = self._encoded(inputs, tokenization, pooling=True)
        n = len(inputs)
        params = [SamplingParams(max_tokens=1, cache_salt=inp.cache_salt or "") for inp in inputs]
        loras = _per_prompt(lora_request, n, "lora_request")
        ids = self._add_all("pool", inputs, params, loras, [0] * n, pooling)
        return self._run(ids, inputs, use_tqdm, "pool")

    # ---- requests --------------------------------------------------------------------------------
    def _encoded(self, inputs: list[_Input], tokenization, pooling: bool) -> list[_Input]:
        """`inputs` with tokenization_kwargs applied: text prompts tokenized here where
        add_special_tokens is given, and (pooling calls) cut to truncate_prompt_tokens."""
        options = dict(tokenization or {})
        allowed = (
            {"add_special_tokens", "truncate_prompt_tokens"} if pooling else {"add_special_tokens"}
        )
        other = sorted(set(options) - allowed)
        if other:
            raise ValueError(
                f"tokenization_kwargs {other} are not supported; it may hold {sorted(allowed)}"
            )
        special = options.get("add_special_tokens")
        if special is not None and not isinstance(special, bool):
            raise ValueError(f"add_special_tokens must be True or False, got {special!r}")
        if options.get("truncate_prompt_tokens") is None:
            keep = None
        else:
            keep = self._kept(options["truncate_prompt_tokens"])
        if special is None and keep is None:
            return inputs
        out = []
        for inp in inputs:
            if inp.images and isinstance(inp.prompt, str):  # (the processor expands its images)
                if keep is not None:
                    raise ValueError("truncate_prompt_tokens does not apply to prompts with images")
                inp = dataclasses.replace(inp, add_special_tokens=special)
            elif isinstance(inp.prompt, str) and inp.prompt:
                ids = self.engine.tokenizer.encode(
                    inp.prompt, add_special_tokens=special is not False
                )
                if keep is not None and len(ids) > keep:
                    ids = self._first_tokens(inp.prompt, ids, keep, special)
                inp = dataclasses.replace(inp, prompt=ids)
            elif keep is not None and not isinstance(inp.prompt, str):
                inp = dataclasses.replace(inp, prompt=inp.prompt[:keep])
            out.append(inp)
        return out

    def _kept(self, k) -> int:
        """How many tokens truncate_prompt_tokens=k keeps (-1: max_model_len - 1)."""
        if k == -1:
            return self.engine.config.max_model_len - 1
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be an int >= 1, or -1 for as many as "
                f"max_model_len holds, got {k!r}"
            )
        return k

    def _first_tokens(self, text: str, ids: list[int], keep: int, special) -> list[int]:
        """A text's ids cut to their first `keep`, the special tokens its tokenizer adds at
        either end kept, as HF's truncation on the right keeps them."""
        if special is False:
            return ids[:keep]
        before, after = _special_ends(
            ids, self.engine.tokenizer.encode(text, add_special_tokens=False)
        )
        if keep <= before + after:
            return ids[:keep]
        return ids[: keep - after] + ids[len(ids) - after :]

    def _add_all(self, prefix, inputs, params, loras, priorities, pooling=None) -> list[str]:
        """Adds every input as a request (their ids, in order); none stays added if one fails."""
        ids = [f"{prefix}-{next(self._ids)}" for _ in inputs]
        added = []
        try:
            for i, (rid, inp) in enumerate(zip(ids, inputs)):
                prompt, images = self._with_images(inp) if inp.images else (inp.prompt, None)
                self.engine.add_request(
                    rid,
                    prompt,
                    params[i],
                    priority=priorities[i],
                    pooling=None if pooling is None else pooling[i],
                    lora_request=loras[i],
                    images=images,
                )
                added.append(rid)
        except Exception:
            for rid in added:
                self.engine.abort(rid)
            raise
        return ids

    def _processor_loaded(self):
        """The model's processor (transformers' AutoProcessor), loaded on first use."""
        if self._processor is None:
            from transformers import AutoProcessor

            self._processor = AutoProcessor.from_pretrained(self.engine.weights_dir)
        return self._processor

    def _image_placeholder(self) -> str:
        """What stands for one image in a prompt's text (LLaVA's "<image>"), which the processor
        expands into the image's tokens."""
        return getattr(self._processor_loaded(), "image_token", None) or "<image>"

    def _with_images(self, inp: _Input) -> tuple[list[int], ImageInputs]:
        """A prompt with images as the engine takes it: the token ids, each image's placeholder
        expanded to its image tokens, and the images' inputs (pixel values, and LLaVA-NeXT's
        sizes), both made by the model's
        processor (transformers' AutoProcessor); token ids given as such must hold the expanded
        placeholders already (the processor then makes the pixel values only)."""
        if self.engine.image_encoder is None:
            why = self.engine.model_config.why_no_images
            raise ValueError(
                f"multi_modal_data: {self.engine.model_id} takes no images ({why}): send text only"
            )
        images = list(inp.images)
        if len(images) > self._max_images:
            raise ValueError(
                f"multi_modal_data: {len(images)} images in one prompt; at most "
                f"{self._max_images} (limit_mm_per_prompt)"
            )
        processor = self._processor_loaded()
        given = {**self._mm_kwargs, **(inp.mm_kwargs or {})}  # (the prompt's over the LLM's)
        kwargs = dict(given)
        try:
            if isinstance(inp.prompt, str):
                if inp.add_special_tokens is not None:
                    kwargs["add_special_tokens"] = inp.add_special_tokens
                out = processor(text=inp.prompt, images=images, return_tensors="pt", **kwargs)
                return out["input_ids"][0].tolist(), processor_inputs(processor, out, images)[0]
            made = processor.image_processor(images, return_tensors="pt", **kwargs)
            return inp.prompt, image_inputs(made)
        except (ValueError, TypeError) as e:
            if not given:
                raise
            raise ValueError(
                f"the model's processor refused mm_processor_kwargs {given}: {e}"
            ) from e

    def _run(self, ids: list[str], inputs: list[_Input], use_tqdm, desc: str):
        """Steps the engine until every request of `ids` has finished; their final outputs in
        order, each reporting its prompt dict's text where the engine has none."""
        if use_tqdm is None:
            use_tqdm = os.environ.get("PDSERVE_NO_PROGRESS") != "1" and len(ids) > 1
        if callable(use_tqdm):
            bar = use_tqdm(total=len(ids), desc=desc)
        else:
            bar = tqdm(total=len(ids), desc=desc, disable=not use_tqdm)
        results: dict[str, RequestOutput] = {}
        try:
            while len(results) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
        outs = [results[rid] for rid in ids]
        for out, inp in zip(outs, inputs):
            if out.prompt is None and inp.text is not None:
                out.prompt = inp.text
        return outs

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's: forgets every cached prefix block (with `reset_connector`, the host and disk
        tiers' entries too, vLLM's connector cache); True once done. No request runs between
        this object's calls, so `reset_running_requests` finds none to preempt."""
        self.engine.reset_prefix_cache(external=reset_connector)
        return True

    # ---- sleep mode (engine/sleep.py) ------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: gives the engine's memory back between calls, needing enable_sleep_mode=True.
        Level 1 frees the KV cache (and every cached prefix); on a CPU the weights already live
        in host memory and stay. Level 2 frees the weights too: they load again from the
        checkpoint at `wake_up`, unless an update (engine.update_weights) loaded new ones. No
        request runs between this object's calls, so every `mode` ("abort", "wait", "keep")
        finds none to end or keep. Generating while asleep raises EngineAsleep."""
        if not self._sleep_mode:
            raise ValueError("sleep mode is off: create the LLM with enable_sleep_mode=True")
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep; got {mode!r:.40}")
        if level == 0:
            raise ValueError(
                "level 0 pauses scheduling, which an offline LLM does not do between calls: "
                "sleep at level 1 or 2"
            )
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: wakes `tags` ("weights", "kv_cache"; None: both); the engine takes requests
        once both are awake."""
        if not self._sleep_mode:
            raise ValueError("sleep mode is off: create the LLM with enable_sleep_mode=True")
        self.engine.wake_up(tags)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass


def _steps_bar(use_tqdm, total: int):
    """beam_search's progress bar over its steps (vLLM's): use_tqdm True, False, or a tqdm-like
    factory."""
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Beam search", unit="token")
    return tqdm(total=total, desc="Beam search", unit="token", disable=not use_tqdm)


def _pool_tokenization(tokenization_kwargs, truncate_prompt_tokens) -> dict | None:
    """A pooling call's tokenization_kwargs with its truncate_prompt_tokens merged in."""
    if truncate_prompt_tokens is None:
        return tokenization_kwargs
    return {**(tokenization_kwargs or {}), "truncate_prompt_tokens": truncate_prompt_tokens}


def _pooling_list(pooling_params, n: int, embed: bool) -> list[PoolingParams]:
    """One PoolingParams per prompt (of n), each of the call's kind (an embedding's "last" or
    "mean", or "classify")."""
    params = _per_prompt(pooling_params, n, "pooling_params")
    for p in params:
        if not isinstance(p, PoolingParams):
            raise ValueError(
                f"pooling_params must be PoolingParams (pdserve.engine.request), got "
                f"{type(p).__name__}"
            )
        if (p.pooling == "classify") == embed:
            want = "'last' or 'mean'" if embed else "'classify'"
            raise ValueError(f"pooling_params has pooling={p.pooling!r}; this call needs {want}")
    return params


def _key(inp: _Input):
    return inp.prompt if isinstance(inp.prompt, str) else tuple(inp.prompt)


def _joined(a: _Input, b: _Input, i: int) -> _Input:
    """A scoring pair's two prompts as one: two texts joined, or two token-id prompts joined."""
    if isinstance(a.prompt, str) != isinstance(b.prompt, str):
        raise ValueError(
            f"pair {i} mixes a text and token ids: give both of a pair as text or both as ids"
        )
    return _Input(a.prompt + b.prompt, None, a.cache_salt or b.cache_salt)
