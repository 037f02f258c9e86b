"""LLMEngine: one model replica behind add_request / step / abort, plus the disaggregation hooks.

An LLM (engine/llm.py), or a worker through its EngineLoop, builds one LLMEngine and steps it
from one thread until `shutdown`. A step (`_step`) is plan -> propose -> prepare -> execute ->
update -> observe -> collect: `scheduler.schedule()` makes a StepPlan, the speculator (engine/
spec) writes its guesses into it, the model runner turns it into a ModelInput and executes it
on every tensor-parallel rank (with the step's structured-output mask and the KV sinks' layer
hook) into one StepOutput, `scheduler.update()` applies the sampled tokens, the speculator
learns from the result, and the output side here detokenizes, checks stop strings and builds
RequestOutputs. The disaggregation hooks are prefill-only requests (`add_request(...,
prefill_only=True, kv_sink=sink)`, whose KV leaves layer by layer: engine/kv_publish.py) and
external KV (`reserve` sets blocks aside for KV that another engine writes, and `commit`
continues decoding from there); their docstrings say how each one works. A request may run
under a LoRA adapter (`lora_request`; the engine's registry, engine/lora.py, when enable_lora):
its sequences carry the adapter, which roots their prefix-cache chains and groups their rows in
each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import pathlib
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pdserve.engine import sleep
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cpu import log_once as log_cpu_once
from pdserve.engine.errors import (
    BadSamplingParams,
    DuplicateRequestId,
    EngineAsleep,
    InvalidRequest,
    PrefixCacheBusy,
    PromptTooLong,
    SleepRefused,
    WeightUpdateRefused,
)
from pdserve.engine.kv_disk_tier import DiskTier
from pdserve.engine.kv_host_tier import HostTier, fingerprint as kv_fingerprint
from pdserve.engine.kv_publish import layer_publisher
from pdserve.engine.loader import resolve_model
from pdserve.engine.lora import AdapterInfo, LoRAError, LoRARegistry, LoRARequest
from pdserve.engine.model_runner import ModelInput
from pdserve.engine.outputs import emit_tokens, request_output
from pdserve.engine.parallel import TPState, current_tp_state, divide, tp_scope
from pdserve.engine.precision import start_runner
from pdserve.engine.recurrent_state import STATE_FILE_SUFFIX, RecurrentStates, SlotState
from pdserve.engine.request import (
    FinishReason,
    KVSink,
    PoolingParams,
    RequestOutput,
    Reservation,
    SeqStatus,
    Sequence,
)
from pdserve.engine.sampler import make_generator, skip_sample_draw
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, StepOutput, StepPlan
from pdserve.engine.score_head import label_token_ids
from pdserve.engine.spec.draft import plan_draft
from pdserve.engine.spec.speculator import Speculator
from pdserve.engine.step_trace import STEP_TRACE_LEN, StepRecord, step_record
from pdserve.engine.structured.grammar import GrammarCache
from pdserve.engine.thinking import ThinkingBudget
from pdserve.engine.tokenizer import (
    IncrementalDetokenizer,
    bad_words_token_ids,
    load_tokenizer,
    prompt_token_ids,
    reasoning_tags,
)
from pdserve.kvpool import PoolSpaceError, map_pool_file, new_pool_paths

log = logging.getLogger(__name__)

# how long ranks_alive looks for a follower that died with the step that just failed
RANK_DEATH_GRACE_S = 2.0


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[IncrementalDetokenizer | None]  # None each: params.detokenize is False
    kv_sink: KVSink | None = None
    published: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # filled as the prompt is computed
    # RequestOutputKind.DELTA (engine/outputs.py): per sequence, the output tokens, logprobs and
    # text characters its outputs carried so far; and whether its prompt logprobs went out
    sent: list[tuple[int, int, int]] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # (most requests: read for each of them every step)
            return seqs[0].is_finished
        return all(s.is_finished for s in seqs)


def _image_inputs(images):
    """A request's images as image_keys.ImageInputs of tensors; InvalidRequest for anything
    else (the checks of their shapes are the encoder's)."""
    from pdserve.engine.image_keys import image_inputs

    try:
        images = image_inputs(images)
    except (KeyError, TypeError) as e:
        raise InvalidRequest(f"images must be pixel values or a processor's output ({e})") from None
    values, *others = images
    if not isinstance(values, torch.Tensor) or not all(
        o is None or isinstance(o, torch.Tensor) for o in others
    ):
        raise InvalidRequest(
            "images must be tensors: pixel_values, and image_sizes, pixel_attention_mask and "
            "image_grid_thw or None"
        )
    return images


def _samples_a_sink(plan: StepPlan, sinks) -> bool:
    """Whether this step samples (ends the prompt of) a request with a kv_sink: one whose
    hand-off follows the step."""
    if sinks is None:
        return False
    ids = {req.request_id for req, _, _ in sinks.pubs}
    return any(item.samples and item.seq.request_id in ids for item in plan.scheduled)


CLASSIFY = PoolingParams("classify")
MAX_WEIGHT_GROUPS = 4  # trainers' groups an engine's ranks may be in at once
# ModelConfig's fields a weight update's checkpoint must share with the served one (its shapes and
# what the runner built from them: rotary tables, windows, layer kinds)
_SHAPE_FIELDS = tuple(
    f.name
    for f in dataclasses.fields(ModelConfig)
    if f.name
    not in ("eos_token_ids", "score_token_ids", "label_names", "hf_config", "multimodal_config")
)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        from transformers import AutoConfig

        model_dir = resolve_model(config.model)
        self.model_id = model_dir.name
        # where the weights served came from, and their version ("": as started; update_weights)
        self.weights_dir, self.weight_version = str(model_dir), ""
        self._weight_groups: dict[str, float] = {}  # the trainers' groups its ranks are in: timeout
        self._checkpoint_shapes: dict[str, tuple[int, ...]] | None = None  # name -> shape
        # sleep mode (engine/sleep.py): the level slept at (0: awake), the tags still asleep, and
        # whether a level-2 sleep dropped the weights and nothing has loaded them since
        self.sleep_level, self._asleep, self._weights_dropped = 0, set[str](), False
        self.model_config = ModelConfig.from_hf(
            AutoConfig.from_pretrained(str(model_dir)), config.generation_config
        )
        self.config = config.resolve(self.model_config)
        # a draft model (speculative decoding) takes its share of the KV budget before any load
        self.config, self.draft_dir, self.draft_model_config = plan_draft(
            self.config, self.model_config, str(model_dir)
        )
        if self.config.device == "cpu":
            log_cpu_once()
        self.tokenizer = load_tokenizer(model_dir)
        self.image_encoder = None  # a vision-language model's (engine/multimodal.py)
        if self.model_config.multimodal_config is not None:
            from pdserve.engine.multimodal import ImageEncoder

            self.image_encoder = ImageEncoder(self.model_config.multimodal_config, str(model_dir))
        if self.config.classifier_from_token:  # before the ranks start: they build its head
            self.model_config = dataclasses.replace(
                self.model_config,
                score_token_ids=label_token_ids(
                    self.tokenizer, self.config.classifier_from_token, self.model_config
                ),
            )
        self._reasoning_tags: tuple[int, int] | None | bool = False  # _attach_thinking's
        torch.manual_seed(self.config.seed)
        self.kv_cache_paths = self._kv_cache_paths()
        self._rank_kv_caches: list[torch.Tensor] | None = None
        self._rank_states: list[RecurrentStates] | None = None  # (rank_states)
        self.tp = None
        self.tp_state = TPState()  # what this engine's steps run under (see engine.parallel)
        with tp_scope(self.tp_state):  # whatever TPGroup.start sets stays inside this block
            self._start_ranks(model_dir)
        # the serving mode as chosen (quantization and kv_cache_dtype "auto" resolved) and why
        q, kv = self.runner.quantization, str(self.runner.kv_dtype).removeprefix("torch.")
        self.config = dataclasses.replace(self.config, quantization=q, kv_cache_dtype=kv)
        self.mode_note = self.runner.mode_note
        log.info("%s", self.mode_note)

        self.scheduler = Scheduler.for_engine(self.config, self.model_config, self.runner)
        self.block_manager = self.scheduler.bm
        if self.config.kv_host_tier_bytes:  # evicted prefix blocks go there (kv_host_tier.py)
            self._attach_host_tier()
        self.spec = self._start_speculator()
        self._requests: dict[str, _Request] = {}
        # LoRA adapters by name (engine/lora.py); None unless enable_lora
        self.loras: LoRARegistry | None = None
        if self.config.enable_lora:
            self.loras = LoRARegistry(
                self.model_config, self.config.max_lora_rank, self.config.max_loras
            )
            for name, path in self.config.lora_modules:
                self.loras.add(name, path)
        self.grammars = GrammarCache(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self._seq_counter = itertools.count()
        # requests that finished outside step() (commit): the next step() reports them
        self._undelivered: list[RequestOutput] = []
        # the last STEP_TRACE_LEN steps that computed something (read and cleared by their reader)
        self.step_trace: deque[StepRecord] = deque(maxlen=STEP_TRACE_LEN)
        # the tokens of the step running now (0 between steps) and (tokens, seconds) of the last
        # step: how long a step of its size takes here (engine/engine_loop.py's stall figures)
        self.running_step_tokens = 0
        self.last_step: tuple[int, float] = (0, 0.0)

    def _start_speculator(self) -> Speculator | None:
        """The speculator of a speculative_config (None without one); a draft or head refused
        once the ranks run stops them with it."""
        if self.config.speculative_config is None:
            return None
        try:
            spec = Speculator(self)
        except BaseException:
            with contextlib.suppress(Exception):
                self.shutdown()
            raise
        self.scheduler.speculator = spec  # it sets the guess budgets as a plan starts
        log.info("%s", spec.mode_note)
        return spec

    def _attach_host_tier(self) -> None:
        fp = kv_fingerprint(self.kv_layout_spec(), self.config.tensor_parallel_size)
        disk = None  # and what it pushes out to disk (kv_disk_tier.py), when set
        if self.config.kv_disk_tier_bytes:
            disk = DiskTier(self.config.kv_disk_tier_bytes, self.config.kv_disk_tier_dir, fp)
        # a hybrid's recurrent states go there too (kv_host_tier.py), read from every rank
        states = self.rank_states if self.runner.states is not None else None
        self.block_manager.attach_tier(
            HostTier(
                self.config.kv_host_tier_bytes, self.rank_kv_caches, fp, disk=disk, states=states
            )
        )

    def _start_ranks(self, model_dir) -> None:
        """The followers (TP and pipeline ranks, if any), then this rank's runner; under this
        engine's tp_scope."""
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if tp * pp > 1:
            from pdserve.engine.tp import TPGroup

            mc = self.model_config
            # refuse before spawning ranks that would all fail the same way
            for n, what in (
                (mc.num_heads, "the attention heads"),
                (tp if mc.kv_latent_dim else mc.num_kv_heads, "the key/value heads"),
                (mc.intermediate_size, "the MLP intermediate size"),
                (mc.vocab_size, "the vocabulary size"),
            ):
                divide(n, tp, what)
            self.tp = TPGroup.start(
                self.config,
                self.model_config,
                str(model_dir),
                self.kv_cache_paths or [None] * (tp * pp),
            )
        try:
            self.runner = start_runner(
                self.config,
                self.model_config,
                str(model_dir),
                self.kv_cache_paths[0] if self.kv_cache_paths else None,
                self.tokenizer,
            )
            if self.tp is not None:
                self.tp.ready()
            self.tp_state = current_tp_state()
        except BaseException:
            # else the followers and the process group outlive the failed engine. They may be
            # anywhere in their own start (building their runner, in the ready barrier), where a
            # stop broadcast would meet the wrong collective and wait out the group's timeout: so
            # they are killed, not told; the rest of the stop must not hide the real error
            if self.tp is not None:
                self.tp.abort()
                self.tp = None
            try:
                self.shutdown()
            except Exception:
                pass
            raise

    # ---- requests -------------------------------------------------------------------------------
    def _check_task(self, pooling: PoolingParams | None) -> None:
        """A classifier checkpoint runs pooling requests only (its LM head is a stand-in), and
        "classify" needs a model with a classification head."""
        mc = self.model_config
        if mc.num_labels and pooling is None:
            raise InvalidRequest(
                f"this model is a {mc.num_labels}-label classifier ({mc.hf_config.architectures[0]}"
                "): it scores and classifies (/v1/score, /v1/rerank, /classify) and does not "
                "generate"
            )
        if pooling is not None and pooling.pooling == "classify" and not mc.classifies:
            raise InvalidRequest(
                "this model has no classification head: serve a *ForSequenceClassification "
                "checkpoint, or name the label tokens of a generative one (classifier_from_token)"
            )

    def _new_request(
        self,
        request_id: str,
        prompt,
        params: SamplingParams | None,
        prefill_only: bool = False,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_request=None,
        images=None,
    ) -> _Request:
        if self._asleep:
            raise EngineAsleep(
                f"the engine sleeps ({', '.join(self.asleep_tags)} asleep): wake it up first"
            )
        params = params or SamplingParams()
        lora = self._resolve_lora(lora_request)
        if not isinstance(params, SamplingParams):
            raise InvalidRequest(
                f"sampling params must be a SamplingParams, got {type(params).__name__}"
            )
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidRequest(f"priority must be an int, got {type(priority).__name__}")
        params = self._shaping_in_vocabulary(params)
        if pooling is not None and (params.n != 1 or prefill_only):
            raise InvalidRequest("a pooling request has n=1 and is not prefill-only")
        self._check_task(pooling)
        if request_id in self._requests:
            raise DuplicateRequestId(f"request_id {request_id!r} is already in use")
        ids = prompt_token_ids(self.tokenizer, prompt, self.model_config.vocab_size)
        limit = self.config.max_model_len
        ids = params.truncated_prompt(ids, limit)  # vLLM's truncate_prompt_tokens
        if len(ids) >= limit:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens but max_model_len is {limit}: shorten the "
                f"prompt to at most {limit - 1} tokens (one must be left for output)"
            )
        if params.max_tokens is None:  # vLLM's: up to the end of the context
            params = params.with_max_tokens(limit - len(ids))
        image_prompt = self._image_prompt(ids, images, params, pooling)
        seqs = []
        for i in range(params.n):
            gen = make_generator(params.seed, i) if params.seed is not None else None
            seq_id = next(self._seq_counter)
            seqs.append(
                Sequence(
                    seq_id,
                    request_id,
                    i,
                    ids,
                    params,
                    gen,
                    prefill_only=prefill_only,
                    priority=priority,
                    pooling=pooling,
                    lora=lora,
                )
            )
        for seq in seqs:
            seq.images = image_prompt
        self.grammars.attach(seqs)  # structured output: compiled once per spec, a matcher each
        if params.thinking_token_budget is not None:
            self._attach_thinking(seqs, params.thinking_token_budget)
        detoks = [
            IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            if params.detokenize
            else None
            for _ in seqs
        ]
        req = _Request(
            request_id, prompt if isinstance(prompt, str) else None, params, seqs, detoks
        )
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        req.metrics["arrival"] = time.monotonic()
        return req

    def _image_prompt(self, ids, images, params, pooling):
        """The request's images as its prompt holds them (engine/multimodal.py; encoded when a
        step first computes one of their tokens); None for a prompt without any. Refused:
        images for a model without an image encoder, or with what the engine does not yet run
        with them, and image tokens without images."""
        token = self.model_config.image_token_id
        if images is None:
            if token is not None and token in ids:
                raise InvalidRequest(
                    f"the prompt holds image tokens (id {token}) but no image came with it: "
                    f"pass the images (multi_modal_data) and write one placeholder per image"
                )
            return None
        if self.image_encoder is None:
            why = self.model_config.why_no_images
            raise InvalidRequest(f"{self.model_id} takes no images ({why}): send text only")
        images = _image_inputs(images)
        refused = [
            why
            for why, applies in (
                ("a pooling request", pooling is not None),
                ("truncate_prompt_tokens", params.truncate_prompt_tokens is not None),
            )
            if applies
        ]
        if refused:
            raise InvalidRequest(f"images are not yet served with {refused[0]}: send text only")
        from pdserve.engine.multimodal import image_prompt

        return image_prompt(ids, token, images, self.image_encoder)

    def _attach_thinking(self, seqs: list[Sequence], budget: int) -> None:
        """Each sequence's thinking budget (engine/thinking.py), or InvalidRequest for a model
        without reasoning tags."""
        if self._reasoning_tags is False:  # (read from the vocabulary once, when first needed)
            self._reasoning_tags = reasoning_tags(self.tokenizer)
        tags = self._reasoning_tags
        if tags is None:
            raise BadSamplingParams(
                "thinking_token_budget needs a reasoning model (one whose vocabulary has <think> "
                "and </think> tokens); this model has none: leave it unset"
            )
        for seq in seqs:
            seq.thinking = ThinkingBudget(budget, tags, seq.prompt_token_ids)

    def _shaping_in_vocabulary(self, params: SamplingParams) -> SamplingParams:
        """`params` with its bad words tokenized (vLLM's rule: engine/tokenizer.py), after
        checking that every token id it shapes the logits with, or predicts, is one of the
        model's."""
        if params.bad_words and not params.bad_words_token_ids:
            words = bad_words_token_ids(self.tokenizer, params.bad_words)
            params = params.with_bad_words_token_ids(words)
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in params.logit_bias]),
            ("allowed_token_ids", params.allowed_token_ids),
            ("bad_words", [t for word in params.bad_words_token_ids for t in word]),
            ("prediction", params.prediction_token_ids),
        ):
            if any(t >= vocab for t in ids):
                bad = [t for t in ids if t >= vocab][:3]
                raise BadSamplingParams(
                    f"{name} token ids must be below the vocabulary size {vocab}, got {bad}"
                )
        return params

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        prefill_only: bool = False,
        kv_sink: KVSink | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        lora_request: LoRARequest | str | None = None,
        images=None,
    ) -> None:
        """Validates fully before touching any state, so a bad request never disturbs others.

        prefill_only=True runs the prompt, calls `kv_sink.on_layer(layer, layer_kv, block_ids,
        start, end)` as each layer's KV becomes final (so a transfer can overlap the next layer),
        samples the first token and finishes ("prefill_done"). n>1: every sequence samples its
        first token from the prompt's last logits with its own generator, as an ordinary n>1
        request does; only the first sequence holds KV.

        priority: lower runs first (engine/scheduler.py). pooling: an embeddings request: the
        prompt runs, nothing is sampled, and its one output carries `pooled` (finish reason
        "pooled"); its blocks are freed then. lora_request: the LoRA adapter the request runs
        under (a LoRARequest, registered if new, or a registered adapter's name; None: the base
        model). images: a vision-language model's prompt images as its processor makes them:
        the pixel values, or a mapping with "pixel_values" and, where the encoder reads them,
        "image_sizes" (LLaVA-NeXT) and "pixel_attention_mask" (Idefics 3), one row an image,
        or image_keys.ImageInputs (the prompt then holds their image tokens:
        engine/multimodal.py)."""
        if kv_sink is not None and self.config.pipeline_parallel_size > 1:
            self._check_stage_sink(kv_sink)
        if kv_sink is not None and self.model_config.recurrent_layers:
            self._check_state_hand_off("a kv_sink")
            if not callable(getattr(kv_sink, "on_state", None)):
                raise ValueError(
                    f"{self.model_config.architecture} keeps recurrent state: its kv_sink needs "
                    f"an on_state(layer, tensors) method (engine/request.py KVSink)"
                )
        req = self._new_request(
            request_id, prompt, params, prefill_only, priority, pooling, lora_request, images
        )
        req.kv_sink = kv_sink
        self._requests[request_id] = req
        self.scheduler.add(req.seqs)

    def _check_state_hand_off(self, what: str) -> None:
        """Under tensor parallelism a hybrid model's state hands off through rank 0, which maps
        every rank's states from its file, under kv_cache_shared_dir (_kv_cache_paths)."""
        if self.config.tensor_parallel_size > 1 and not self.kv_cache_paths:
            raise ValueError(
                f"{what} on {self.model_config.architecture} at tensor_parallel_size="
                f"{self.config.tensor_parallel_size}: the recurrent state's hand-off reads every "
                f"rank's state from rank 0: set kv_cache_shared_dir (workers do)"
            )

    def state_views(self, slot: int) -> list[SlotState]:
        """A recurrent-state slot (a reservation's: Reservation.state_slot) per recurrent layer,
        as the whole model's state over every tensor-parallel rank's part: what a prefill-only
        request's sink reads after its prompt, and a hand-off writes into a reservation's (only
        until its commit)."""
        ranks, layouts = self.rank_states(), self.runner.state_layouts
        return [SlotState(ranks, layouts, layer, slot) for layer in range(len(layouts))]

    def read_kept_state(self, block_hash: int) -> bytes | None:
        """A hybrid's state kept after cached block `block_hash` in a slot, the whole model's
        (every recurrent layer's conv then ssm state, float32, in layer order: what a peer
        fetch sends, FetchKVBlock.state); None where no slot keeps one. Engine thread."""
        slots = self.block_manager.kept_states
        slot = None if slots is None else slots.kept(block_hash)
        if slot is None:
            return None
        parts = [t.reshape(-1) for view in self.state_views(slot) for t in view.read()]
        return torch.cat(parts).numpy().tobytes()

    def state_bytes(self) -> int:
        """read_kept_state's size: one whole-model state's bytes (0 for a model without). Any
        thread."""
        if self.runner.states is None:
            return 0
        return RecurrentStates.bytes_for([s.shapes(1) for s in self.runner.state_layouts], 1)

    def install_state(self, block_hash: int, data: bytes) -> bool:
        """Keeps `data` (read_kept_state's form, its size checked) as the state after cached
        block `block_hash`, in a slot the prefix cache keeps it in (a peer fetch's); False where
        no slot could be had. Engine thread."""
        slots = self.block_manager.kept_states
        if slots is None:
            return False
        if block_hash in slots:
            return True
        slot = self.scheduler.claim_state_slot(block_hash)
        if slot is None:
            return False
        flat = torch.frombuffer(bytearray(data), dtype=torch.float32)
        offset = 0
        for view in self.state_views(slot):
            view.write(flat[offset : offset + view.numel])
            offset += view.numel
        return True

    def rank_states(self) -> list[RecurrentStates]:
        """Every tensor-parallel rank's recurrent states in rank order (ranks > 0 mapped from
        their files: _check_state_hand_off says when there are none)."""
        own = self.runner.states
        if self.config.tensor_parallel_size == 1:
            return [own]
        self._check_state_hand_off("a recurrent state hand-off")
        if self._rank_states is None:
            shapes = self.runner.state_shapes
            self._rank_states = [own] + [
                RecurrentStates.mapped(p + STATE_FILE_SUFFIX, shapes, own.num_slots)
                for p in self.kv_cache_paths[1 : self.config.tensor_parallel_size]
            ]
        return self._rank_states

    def _check_stage_sink(self, kv_sink) -> None:
        """Under pipeline stages each stage pushes its own layers (engine/kv_publish.py): the
        engine needs a stage sender and the sink must describe itself to the later stages."""
        if self.config.kv_stage_sender is None:
            raise InvalidRequest(
                "a kv_sink under pipeline_parallel_size > 1 needs kv_stage_sender (set by a "
                "prefill worker): each stage pushes its own layers' KV"
            )
        for name in ("stage_spec", "on_stage_report"):
            if not callable(getattr(kv_sink, name, None)):
                raise InvalidRequest(
                    f"a kv_sink under pipeline_parallel_size > 1 needs a {name} method "
                    f"(engine/kv_publish.py): each stage pushes its own layers' KV"
                )

    # ---- LoRA adapters (engine/lora.py) ---------------------------------------------------------
    def _resolve_lora(self, lora_request):
        if lora_request is None:
            return None
        if self.loras is None:
            raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora")
        return self.loras.resolve(lora_request)

    def add_lora(self, lora_request: LoRARequest) -> AdapterInfo:
        """Registers (or replaces) an adapter by its name; raises LoRAError when it cannot be
        served. Its weights are read by each rank when a step first runs it."""
        if self.loras is None:
            raise LoRAError("this engine serves no LoRA adapters: start it with enable_lora")
        return self.loras.add(lora_request.lora_name, lora_request.lora_path)

    def remove_lora(self, name: str) -> bool:
        """Forgets an adapter by name (requests running under it finish under it)."""
        return self.loras is not None and self.loras.remove(name)

    def list_loras(self) -> list[AdapterInfo]:
        return [] if self.loras is None else self.loras.list()

    # ---- weight updates (a trainer's: router/weights.py) --------------------------------------
    def update_weights(self, model_dir: str, version: str = "") -> None:
        """Loads the base model's weights from the checkpoint directory `model_dir`, in place, on
        every rank, then drops every cached prefix block (and the host tier's): KV computed
        under the old weights must never be reused. Only while no request runs (the router
        pauses first), only where the linears run unquantized (a quantized mode's calibration
        and quality verdict belong to the weights they were taken on) and without a draft
        model; raises WeightUpdateRefused saying why, before anything changed. A checkpoint of
        other shapes or another architecture is refused by its config.json; a load that fails
        part way loads the weights it replaced again, then raises. `version`: the trainer's
        name for the new weights (weight_version), kept beside weights_dir."""
        from transformers import AutoConfig

        self._check_can_update()
        path = pathlib.Path(model_dir)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise WeightUpdateRefused(
                f"{model_dir[:300]!r} is not a checkpoint directory with a config.json here"
            )
        try:
            new = ModelConfig.from_hf(AutoConfig.from_pretrained(str(path)))
        except (OSError, ValueError, KeyError) as e:
            raise WeightUpdateRefused(f"{model_dir[:300]!r}: its config.json: {e}") from None
        differ = [
            f"{name} {getattr(new, name)!r} (serving {getattr(self.model_config, name)!r})"
            for name in _SHAPE_FIELDS
            if getattr(new, name) != getattr(self.model_config, name)
        ]
        if differ:
            raise WeightUpdateRefused(
                f"{model_dir[:300]!r} is not a checkpoint of the served model's shapes: "
                + "; ".join(differ)[:1000]
            )
        before = self.weights_dir
        try:
            self._run_on_ranks(ModelInput([], [], reload_from=str(path)))
        except Exception as e:
            if not pathlib.Path(before).is_dir():  # the weights served came from a trainer's group
                self.weights_dir, self.weight_version = "", ""
                raise WeightUpdateRefused(
                    f"loading {model_dir[:300]!r} failed ({e}), and the weights it replaced came "
                    "from a trainer's group: they cannot be loaded again; this engine serves no "
                    "known version until an update succeeds"
                ) from e
            log.error("loading weights from %s failed (%s); loading %s again", path, e, before)
            # raises if that fails too: the engine is broken
            self._run_on_ranks(ModelInput([], [], reload_from=before))
            raise WeightUpdateRefused(f"loading {model_dir[:300]!r} failed: {e}") from e
        self.weights_dir, self.weight_version = str(path), version
        self._weights_dropped = False
        self.block_manager.reset_prefix_cache()

    def _check_can_update(self) -> None:
        """Raises WeightUpdateRefused (a precondition) when this engine cannot take new weights
        now."""
        if self.has_unfinished_requests() or self.block_manager.num_used_blocks:
            raise WeightUpdateRefused(
                "requests still run on this engine: pause first (the router's /pause)", True
            )
        if self.runner.quantization is not None:
            raise WeightUpdateRefused(
                f"the engine serves quantization={self.runner.quantization}, whose calibration "
                "belongs to the weights it started with: start it with quantization none "
                "(dtype float32 or bfloat16) to update weights",
                True,
            )
        if self.draft_dir is not None:
            raise WeightUpdateRefused(
                "speculative decoding with a draft model: its weights would no longer match", True
            )

    # ---- weights from a trainer's group (engine/weight_sync.py) ---------------------------------
    def join_weights_group(
        self,
        group_name: str,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        timeout_s: float = 600.0,
    ) -> int:
        """Every rank of this engine starts joining a trainer's group (ranks rank_offset ..
        rank_offset + N - 1, in engine rank order) on a thread of its own, and this returns at
        once with N: the engine serves on while the trainer and the other engines join. A group of
        the same name is replaced. The fields are the caller's to check (protos/limits.py)."""
        if group_name not in self._weight_groups and len(self._weight_groups) >= MAX_WEIGHT_GROUPS:
            raise WeightUpdateRefused(
                f"this engine is in {MAX_WEIGHT_GROUPS} weight groups already: destroy one first",
                True,
            )
        ranks = self.tp_state.world_size
        if rank_offset < 1 or rank_offset + ranks > world_size:
            raise WeightUpdateRefused(
                f"ranks {rank_offset}..{rank_offset + ranks - 1} of this engine do not fit a "
                f"group of world_size {world_size} whose rank 0 is the trainer"
            )
        op = ["join", group_name, master_address, master_port, rank_offset, world_size, timeout_s]
        self._run_on_ranks(ModelInput([], [], weights_op=op))
        self._weight_groups[group_name] = timeout_s
        return ranks

    def weight_group_timeout(self, group_name: str) -> float:
        """The timeout a group was joined with (that of a group it is not in: the default)."""
        return self._weight_groups.get(group_name, 600.0)

    def leave_weights_group(self, group_name: str) -> bool:
        """Every rank leaves the group; False when it was in none of that name."""
        if group_name not in self._weight_groups:
            return False
        self._run_on_ranks(ModelInput([], [], weights_op=["leave", group_name]))
        del self._weight_groups[group_name]
        return True

    def receive_weights(
        self,
        group_name: str,
        names,
        dtypes,
        shapes,
        transfer_id: str,
        version: str = "",
        source: str = "",
    ) -> None:
        """The base model's weights from the trainer of `group_name`: every rank receives every
        tensor, and once every rank of the whole group received everything (weight_sync.py's
        last agreement), each loads them in place, as update_weights does from a checkpoint, and
        every cached prefix block is dropped. Refused before anything moves (WeightUpdateRefused)
        when the engine cannot take weights now, the group is unknown, or the list is not the
        checkpoint's tensors (every name, each of its shape); raises WeightSyncError when the
        transfer failed (nothing was loaded anywhere). `transfer_id` is the update's id as the
        trainer's `send` has it; `source` is what weights_dir then says (the router's name for
        the update)."""
        from pdserve.engine.weight_sync import specs_of
        from pdserve.protos.limits import check_transfer_id, check_weight_tensors

        self._check_can_update()
        if group_name not in self._weight_groups:
            raise WeightUpdateRefused(
                f"this engine is in no weight group {group_name[:100]!r}: init the group first",
                True,
            )
        why = check_transfer_id(transfer_id) or check_weight_tensors(names, dtypes, shapes)
        why = why or self._check_against_checkpoint(names, shapes)
        if why is not None:
            raise WeightUpdateRefused(why)
        op = [
            "receive",
            group_name,
            [[n, d, list(s)] for n, d, s in specs_of(names, dtypes, shapes)],
            transfer_id,
        ]
        self._run_on_ranks(ModelInput([], [], weights_op=op))
        self.weights_dir, self.weight_version = source or f"group:{group_name}", version
        self._weights_dropped = False
        self.block_manager.reset_prefix_cache()

    def call_off_transfer(self, group_name: str, transfer_id: str) -> bool:
        """Any thread: calls a group's transfer off unless it already runs, so that the ranks
        waiting for it (here and on every other member) stop waiting (engine/weight_sync.py
        Group.decide). True when it was called off."""
        receiver = self.runner.weight_groups.get(group_name)
        return receiver is not None and receiver.call_off(transfer_id)

    def _check_against_checkpoint(self, names, shapes) -> str | None:
        """Why `names`/`shapes` are not exactly the served checkpoint's tensors, or None."""
        if self._checkpoint_shapes is None:
            from pdserve.engine.loader.safetensors_io import checkpoint_shapes

            try:
                self._checkpoint_shapes = checkpoint_shapes(self.weights_dir)
            except (OSError, ValueError) as e:
                raise WeightUpdateRefused(
                    f"the served checkpoint's tensors cannot be listed ({e}): update from disk",
                    True,
                ) from None
        want, given = self._checkpoint_shapes, set(names)
        missing = [n for n in want if n not in given]
        unknown = [n for n in names if n not in want]
        if missing or unknown:
            parts = []
            if missing:
                parts.append(f"{len(missing)} missing ({', '.join(missing[:3])[:300]}...)")
            if unknown:
                parts.append(f"{len(unknown)} unknown ({', '.join(unknown[:3])[:300]}...)")
            return (
                "the tensors must be exactly the served checkpoint's "
                f"({len(want)} of them): " + "; ".join(parts)
            )
        for name, shape in zip(names, shapes, strict=True):
            if tuple(shape) != want[name]:
                return f"{name[:200]}: shape {list(shape)} (the checkpoint's is {list(want[name])})"
        return None

    def reset_prefix_cache(self, external: bool = False) -> int:
        """vLLM's: forgets every cached prefix block, and with `external` the host and disk
        tiers' entries too (vLLM's reset_external: its connector's cache); returns the device
        blocks forgotten. Raises PrefixCacheBusy, changing nothing, while a request holds
        blocks (vLLM's refuses then too)."""
        bm = self.block_manager
        cached = bm.num_cached_blocks
        if not bm.reset_prefix_cache(tier=external):
            raise PrefixCacheBusy(
                f"{len(self._requests)} request(s) hold KV blocks on this engine: reset the "
                "prefix cache once they end (or pause first)"
            )
        return cached

    # ---- sleep mode (engine/sleep.py) -----------------------------------------------------------
    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        return tuple(t for t in sleep.TAGS if t in self._asleep)

    def sleep(self, level: int = 1) -> None:
        """Gives this idle engine's memory back (engine/sleep.py says what each level frees);
        requests are refused (EngineAsleep) until every tag is woken. Sleeping again at a
        deeper level goes deeper; at the same or a shallower one changes nothing. Raises
        SleepRefused, before anything changed, for a level that is not 1 or 2 and an engine
        that cannot sleep now (requests still run, a CUDA engine, a draft model; at level 2, a
        quantized mode, whose calibration belongs to the weights it was taken on)."""
        if level not in sleep.LEVELS or isinstance(level, bool):
            raise SleepRefused(f"level must be 1 or 2; got {level!r:.40}")
        if level <= self.sleep_level and self._asleep:
            return
        self._check_can_sleep(level)
        self.block_manager.reset_prefix_cache()  # (and the host tier's entries)
        self._run_on_ranks(ModelInput([], [], memory_op=[sleep.SLEEP, level]))
        self.sleep_level = max(level, self.sleep_level if self._asleep else 0)
        self._asleep = set(sleep.TAGS)
        self._weights_dropped = self._weights_dropped or level == 2
        log.info(
            "asleep at level %d: the KV cache%s released",
            level,
            " and the weights" if level == 2 else "",
        )

    def _check_can_sleep(self, level: int) -> None:
        if self.config.device != "cpu":
            raise SleepRefused(
                f"sleep levels 1-2 release memory on CPU engines only; this one runs on "
                f"{self.config.device}",
                True,
            )
        if self.has_unfinished_requests() or self.block_manager.num_used_blocks:
            raise SleepRefused("requests still run on this engine: pause first", True)
        if self.draft_dir is not None:
            raise SleepRefused(
                "speculative decoding with a draft model: its KV cache and weights are not "
                "released by a sleep",
                True,
            )
        if level == 2 and self.runner.quantization is not None:
            raise SleepRefused(
                f"level 2 drops the weights, and this engine serves "
                f"quantization={self.runner.quantization}, whose calibration belongs to the "
                "weights it started with: sleep at level 1",
                True,
            )

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wakes `tags` ("weights", "kv_cache"; None: both). "kv_cache" takes the pools' memory
        back now (kvpool.PoolSpaceError where it cannot). The weights a level-2 sleep dropped are
        loaded when the last tag wakes, from the served checkpoint, unless an update loaded new
        ones meanwhile; where the served weights came from a trainer's group they cannot be read
        again, and SleepRefused says to send them (the tag stays asleep)."""
        try:
            woken = sleep.check_tags(tags)
        except ValueError as e:
            raise SleepRefused(str(e)) from None
        woken = [t for t in woken if t in self._asleep]
        if "kv_cache" in woken:
            try:
                self._run_on_ranks(ModelInput([], [], memory_op=[sleep.WAKE_KV]))
            except PoolSpaceError as e:
                raise SleepRefused(str(e), True) from None
            self._asleep.discard("kv_cache")
        if "weights" in woken:
            self._asleep.discard("weights")
        if not self._asleep and self._weights_dropped:
            self._load_dropped_weights()
        if not self._asleep:
            self.sleep_level = 0

    def _load_dropped_weights(self) -> None:
        # ("" after a failed update of group weights: no known checkpoint either)
        if not self.weights_dir or not pathlib.Path(self.weights_dir).is_dir():
            self._asleep.add("weights")
            raise SleepRefused(
                f"a level-2 sleep dropped the weights, which came from a trainer's group "
                f"({self.weights_dir[:100]!r}) and cannot be read again: send them "
                "(/update_weights_from_distributed) or load a checkpoint, then wake",
                True,
            )
        self._run_on_ranks(ModelInput([], [], reload_from=self.weights_dir))
        self._weights_dropped = False

    def _run_on_ranks(self, inp: ModelInput) -> None:
        with tp_scope(self.tp_state):
            if self.tp is not None:
                self.tp.broadcast(inp)
            self.runner.execute(inp)
            if self.tp is not None and inp.memory_op:  # (tp.py follower_main's barrier)
                self.tp.ready()

    def abort(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if self.tp is not None and self.tp.reports_pending:
            # A hand-off under pipeline stages waits for every pending push report: a later
            # stage may still be pushing this request's KV from a step rank 0 ran ahead of it,
            # in place into the decode worker's reservation on the shm and CUDA IPC backends,
            # and the decode side frees that reservation once this abort is answered (the
            # router's Abort, or the abort frame the sink sends below). Any other request needs
            # only the reports already in: a later stage pushes a step's KV before it runs the
            # next one, so the blocks freed here may be reused by the next step on every rank
            # (engine/tp.py). A gather that failed (a rank died) fails the next step instead,
            # which breaks the engine (engine_loop.py).
            pushing = req.kv_sink is not None and self.config.pipeline_parallel_size > 1
            with contextlib.suppress(RuntimeError):
                self.tp.harvest_reports(wait=pushing)
        for seq in req.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        return True

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | str | None = None,
        images=None,
    ) -> Reservation:
        """Blocks for a prompt whose KV another engine will write into `kv_cache[:, :, block_ids]`
        (n>1: plus one block per extra sequence for its copy of a partial last block). Raises
        NoFreeBlocks when full, and InvalidRequest when the whole KV cache could never hold them.
        images: a vision-language model's prompt images (as add_request's), which key its cached
        blocks; encoded only if the request is ever recomputed here."""
        req = self._new_request(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            lora_request=lora_request,
            images=images,
        )
        seq, children = req.seqs[0], req.seqs[1:]
        if self.model_config.recurrent_layers:
            self._check_state_hand_off("a reservation")
        bm = self.block_manager
        need = bm.blocks_needed(seq.num_tokens) + (
            len(children) if seq.num_tokens % bm.block_size else 0
        )
        if need > bm.num_blocks:
            raise InvalidRequest(
                f"n={len(req.seqs)} sequences of a {seq.num_tokens}-token prompt need {need} KV "
                f"blocks at once, more than this worker's {bm.num_blocks} in all: lower n or "
                f"shorten the prompt"
            )
        self.scheduler.reserve(seq, children)
        self._requests[request_id] = req
        return Reservation(
            request_id,
            list(seq.block_ids),
            seq.num_cached_tokens,
            self.config.block_size,
            seq.state_slot,
        )

    def cache_ids(self, prompt_token_ids: list[int], images) -> list[int]:
        """The ids the prefix cache keys a prompt by (what `held_prefix_tokens` reads): its
        tokens, or for a vision-language model's prompt with images (what add_request takes)
        each image's tokens replaced by that image's number (engine/multimodal.py
        image_cache_ids; InvalidRequest for images its encoder cannot take)."""
        token = self.model_config.image_token_id
        if images is None or token is None or self.image_encoder is None:
            return list(prompt_token_ids)
        from pdserve.engine.image_keys import image_cache_ids, image_keys

        images = _image_inputs(images)
        self.image_encoder.check(images)
        counts = self.image_encoder.rows(images)
        return image_cache_ids(list(prompt_token_ids), token, image_keys(images), counts)

    def commit(
        self,
        request_id: str,
        first_token_ids: list[int],
        logprobs: list[float] | None = None,
        draft_kv: bool = False,
    ) -> None:
        """Continues a reserved request from its first token(s), once its KV is in place.
        first_token_ids: one per sequence, in index order (one for n=1); logprobs:
        theirs as the engine that sampled them computed them (kept for outputs with logprobs);
        draft_kv: an EAGLE head's KV of the prompt came too (draft_kv()), else the head's
        blocks past the cached prefix are cleared (engine/spec/eagle.py).
        n>1 forks the other sequences on copy-on-write blocks (the scheduler's fork), and each
        seeded generator skips the draw its first token took on the other engine, so the n
        outputs equal an ordinary request's."""
        req = self._requests.get(request_id)
        if req is None or req.seqs[0].status != SeqStatus.RESERVED:
            raise KeyError(f"no reservation for request {request_id!r}")
        if not isinstance(first_token_ids, list | tuple):
            raise InvalidRequest(
                f"commit of {request_id!r}: first_token_ids must be a list (one per sequence), "
                f"got {type(first_token_ids).__name__}"
            )
        tokens = list(first_token_ids)
        if len(tokens) != len(req.seqs):
            raise InvalidRequest(
                f"commit of {request_id!r} has {len(tokens)} first tokens for "
                f"n={len(req.seqs)} sequences"
            )
        if logprobs is not None and len(logprobs) != len(tokens):
            raise InvalidRequest(
                f"commit of {request_id!r} has {len(logprobs)} logprobs for {len(tokens)} tokens"
            )
        vocab = self.model_config.vocab_size
        for token in tokens:
            if (
                not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab
            ):  # else the next step fails for every request
                raise InvalidRequest(
                    f"first_token_id must be an integer in [0, {vocab}), got {token!r}"
                )
        # the first tokens were sampled elsewhere: each generator moves past that draw, so the
        # next token comes from the same point of its stream as in an uninterrupted run
        for seq in req.seqs:
            if seq.generator is not None and not req.params.greedy:
                skip_sample_draw(seq.generator, vocab)
        head = self.spec.draft if self.spec is not None else None
        if not draft_kv and hasattr(head, "clear"):
            seq = req.seqs[0]
            head.clear(seq.block_ids, seq.num_cached_tokens // self.config.block_size)
        self.scheduler.commit(req.seqs[0], tokens, logprobs)
        for i in range(len(req.seqs)):
            self._emit_text(req, i)
        if req.finished:  # the first token already ended it (eos, a stop, max_tokens=1)
            self._undelivered.append(request_output(req, True))
            del self._requests[request_id]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._undelivered)

    def warm_up(self, prompt_len: int = 64, max_tokens: int = 8) -> float:
        """Runs one throwaway request (a prefill and a few decode steps) before any real one, so
        the one-time work happens now: building or loading the compiled decode kernel (tens of
        seconds on a CPU it was never built for), oneDNN's primitives, the allocator's first
        pages. Workers call it before they register, so "ready" means the first request runs at
        full speed. Its blocks go back to the free queue; the step trace and the speculative
        decoding counters forget it (the gate keeps the step costs it measured). Returns the
        seconds it took."""
        if self._requests or self._undelivered:
            raise RuntimeError("warm_up runs before any request")
        t0 = time.monotonic()
        max_tokens = max(1, min(max_tokens, self.config.max_model_len // 2))
        n = max(1, min(prompt_len, self.config.max_model_len - max_tokens))
        generator = torch.Generator().manual_seed(0x5EED)
        prompt = torch.randint(0, self.model_config.vocab_size, (n,), generator=generator).tolist()
        image = self.model_config.image_token_id  # (a text prompt: no image stands behind it)
        prompt = [0 if t == image else t for t in prompt]
        if self.model_config.num_labels:  # a classifier's one kind of step: it never decodes
            self.add_request(
                "pdserve-warm-up", prompt, SamplingParams(max_tokens=1), pooling=CLASSIFY
            )
        else:
            self.add_request(
                "pdserve-warm-up",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            )
        while self.has_unfinished_requests():
            self.step()
        self.step_trace.clear()
        if self.spec is not None:
            self.spec.reset_counters()
        return time.monotonic() - t0

    def kv_layout_spec(self) -> dict:
        """What identifies this engine's KV contents, as plain data (kvtransfer.KVLayout's fields):
        every worker builds its transfer layout from this one definition."""
        mc = self.model_config
        return dict(
            model=self.model_id,
            # the cache's dtype, not the activations'
            dtype=str(self.config.kv_torch_dtype).removeprefix("torch."),
            num_layers=mc.num_kv_layers,  # (a hybrid model's linear layers keep no KV)
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=self.config.block_size,
        )

    @property
    def kv_cache(self) -> torch.Tensor:
        """[num_layers, 2, num_blocks, block_size, kv_heads, head_dim] of this rank."""
        return self.runner.kv_cache

    def rank_kv_caches(self) -> list[torch.Tensor]:
        """Every tensor-parallel rank's KV pool in rank order (each holds its share of the kv
        heads); under pipeline stages, those of the first stage (rank 0's), whose layers rank 0
        pushes (the later stages push their own: engine/kv_publish.py). Ranks other than 0 need
        kv_cache_shared_dir: their pools are mapped from their files."""
        if self.config.tensor_parallel_size == 1:
            return [self.kv_cache]
        if not self.model_config.num_kv_layers:  # (Mamba2's: every rank's pool is empty)
            return [self.kv_cache] * self.config.tensor_parallel_size
        if not self.kv_cache_paths:
            raise ValueError(
                "the KV pools of tensor-parallel ranks > 0 are private to their "
                "processes: set kv_cache_shared_dir to reach them from rank 0"
            )
        if self._rank_kv_caches is None:
            own = self.kv_cache
            self._rank_kv_caches = [own] + [
                map_pool_file(p, tuple(own.shape), own.dtype)
                for p in self.kv_cache_paths[1 : self.config.tensor_parallel_size]
            ]
        return self._rank_kv_caches

    def ranks_alive(self, grace_s: float = RANK_DEATH_GRACE_S) -> bool:
        """Whether every follower rank's process (tensor-parallel ranks, pipeline stages) is
        still running: a dead one makes every later step fail (engine/engine_loop.py asks after a
        failed step). A rank killed a moment ago fails the step through its closed sockets
        before its process can be seen gone (a pipeline stage killed mid-push, while rank 0
        waits on its activations), so an engine whose ranks all look alive looks again for up to
        `grace_s` seconds before it says so."""
        if self.tp is None:
            return True
        deadline = time.monotonic() + grace_s
        while all(p.is_alive() for p in self.tp.procs):
            if time.monotonic() >= deadline:
                return True
            time.sleep(0.05)
        return False

    def _kv_cache_paths(self) -> list[str | None]:
        """One file per rank of the first pipeline stage under kv_cache_shared_dir, rank 0's
        first (empty: private pools); the later stages' ranks get None (private pools: they push
        their own KV, and may run on other hosts). A hybrid model's ranks keep their recurrent
        states in a file beside it (its name and STATE_FILE_SUFFIX; a model of no KV layer,
        Mamba2's, has that file alone)."""
        directory, mc = self.config.kv_cache_shared_dir, self.model_config
        if directory is None or not (mc.num_kv_layers or mc.recurrent_layers):
            return []
        if self.config.device != "cpu":
            raise ValueError(
                f"kv_cache_shared_dir needs KV pools in CPU memory, device is {self.config.device}: "
                f"leave it unset (workers set it for tensor parallelism and the shm backend, whose "
                f"KV hand-off is CPU-only for now: use tp=1 workers with the grpc or torch backend)"
            )
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        return new_pool_paths(directory, tp) + [None] * (tp * (pp - 1))

    # ---- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with tp_scope(self.tp_state):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        if self.tp is not None and self.tp.pipelined:
            # the later pipeline stages' backlog of earlier steps, not timed as this one's
            # (engine/tp.py TPGroup.wait_ahead), and the push reports they sent meanwhile
            self.tp.wait_ahead()
            self.tp.harvest_reports(wait=False)
        done, self._undelivered = self._undelivered, []
        plan = self.scheduler.schedule()  # (the speculator sets the guess budgets first)
        if plan.is_empty:
            return done + self._collect([])
        if self.spec is not None:
            self.spec.propose(plan)
        inp = self.runner.prepare_input(plan)
        self.running_step_tokens = plan.num_tokens  # (read by EngineLoop.load from any thread)
        start = time.monotonic()
        try:
            out = self._execute(plan, inp)
        finally:
            self.running_step_tokens = 0
        end = time.monotonic()
        self.last_step = (plan.num_tokens, end - start)
        self.step_trace.append(step_record(plan, start, end))
        self.scheduler.observe_step(plan, end - start)  # sizes the next long prefill chunk
        touched = self.scheduler.update(plan, out)
        if self.spec is not None:
            self._send_draft_kv(self.spec.observe(plan, inp, out))
        return done + self._collect(touched, plan, out)

    def _send_draft_kv(self, ran: list[tuple]) -> None:
        """What an EAGLE head just computed of prefill-only requests' prompts, to their KV sinks
        (a sink without on_draft takes none: the decode side's head starts without it)."""
        for seq, block_ids, start, end in ran:
            req = self._requests.get(seq.request_id)
            send = getattr(req.kv_sink, "on_draft", None) if req is not None else None
            if send is not None:
                kv, layout = self.draft_kv()
                send(kv[0], layout, block_ids, start, end)

    def draft_kv(self) -> tuple[torch.Tensor, dict] | None:
        """An EAGLE head's KV cache ([1, 2, blocks, block_size, heads, head_dim], the target's
        block ids) and its layout's fields (EagleDrafter.layout_spec); None without a head."""
        head = self.spec.draft if self.spec is not None else None
        if head is None or not hasattr(head, "layout_spec"):
            return None
        return head.runner.kv_cache, head.layout_spec()

    def _execute(self, plan: StepPlan, inp: ModelInput) -> StepOutput:
        """Every rank runs `inp`; this one also masks the grammar rows (one mask per step) and
        hands each layer's KV to the prefill-only requests' sinks as it is written. Under
        pipeline stages the later stages' ranks push their own layers (inp.kv_pushes says
        what) and report to the sinks (engine/kv_publish.py): rank 0 does not wait for those
        reports after a chunk that samples nothing, only after a step that samples a request
        with a sink, since that request's output (its commit) and the freeing of its KV follow
        this step; then every report still pending reaches its sink first (engine/tp.py)."""
        lag = self.config.tensor_parallel_size > 1  # (engine/kv_publish.py: why it lags a layer)
        states = self.state_views if getattr(self.runner, "states", None) is not None else None
        sinks = layer_publisher(plan, self._requests, self.runner.kv_cache, lag, states)
        staged = sinks is not None and self.config.pipeline_parallel_size > 1
        if staged:
            inp.kv_pushes = sinks.stage_pushes()
        if self.tp is not None:
            self.tp.broadcast(inp)
        mask = self.grammars.step_mask(plan.row_seqs)
        bursts = getattr(self.runner, "bursts", None)  # (decode bursts: engine/decode_burst.py)
        if bursts is not None:
            bursts.allowed = not self.scheduler.waiting
        out = self.runner.execute(inp, plan.rows, plan.row_logits, sinks, mask)
        if sinks is not None:
            sinks.finish()
        if staged:
            stage_of_rank = self.tp.stage_of_rank(self.config)
            self.tp.gather_reports(
                len(inp.kv_pushes), lambda reports: sinks.stage_reports(reports, stage_of_rank)
            )
        if self.tp is not None and self.tp.reports_pending and _samples_a_sink(plan, sinks):
            self.tp.harvest_reports(wait=True)
        return out

    def _keep_prompt_logprobs(self, plan: StepPlan, out: StepOutput) -> None:
        for i, rows in out.prompt_logprobs.items():
            item = plan.scheduled[i]
            req = self._requests.get(item.seq.request_id)
            if req is not None:  # position p's numbers are about prompt token p + 1
                req.prompt_logprobs[item.start + 1 : item.start + 1 + len(rows)] = rows

    def _emit_text(self, req: _Request, index: int, count: int = 1) -> None:
        emit_tokens(self.scheduler, req.seqs[index], req.detoks[index], req.params, count)

    def _collect(
        self, touched: list[Sequence], plan: StepPlan | None = None, out: StepOutput | None = None
    ) -> list[RequestOutput]:
        """Text for the tokens each touched sequence received (it appears once per token), and one
        RequestOutput per request touched; finished requests are forgotten. The step's prompt
        logprobs are kept first."""
        if out is not None:
            self._keep_prompt_logprobs(plan, out)
        counts: dict[int, int] = {}
        for seq in touched:
            counts[seq.seq_id] = counts.get(seq.seq_id, 0) + 1
        seen: dict[str, _Request] = {}
        requests, scheduler = self._requests, self.scheduler
        for seq in touched:
            count = counts.pop(seq.seq_id, 0)
            req = requests.get(seq.request_id)
            if req is None or not count:
                continue
            detok = req.detoks[seq.index]
            # (a pooling request has no text; nor has a request that asked for none, whose
            # first token's time is all emit_tokens would note)
            if seq.pooling is None and (detok is not None or seq.first_token_time is None):
                emit_tokens(scheduler, seq, detok, req.params, count)
            seen[req.request_id] = req
        outputs = []
        for req in seen.values():
            finished = req.finished
            out = request_output(req, finished)
            if out is not None:  # (None: FINAL_ONLY, not finished yet)
                outputs.append(out)
            if finished:
                del self._requests[req.request_id]
        return outputs

    def spec_stats(self) -> dict:
        """Speculative decoding's counters (engine/spec/speculator.py); zeros when it is off."""
        if self.spec is None:
            return dict(
                spec_drafts=0,
                spec_draft_tokens=0,
                spec_accepted_tokens=0,
                spec_accepted_per_pos=[],
                spec_draft_prefill_tokens=0,
            )
        return self.spec.stats()

    def shutdown(self) -> None:
        tier = getattr(getattr(self, "block_manager", None), "tier", None)
        if tier is not None:  # the disk tier's writer and files (kv_disk_tier.py)
            tier.close()
        runner = getattr(self, "runner", None)  # (None: a start whose runner failed)
        if runner is not None and runner.thread_fit is not None:
            runner.thread_fit.restore()
        try:
            if self.tp is not None:
                self.tp.shutdown()
                self.tp = None
        finally:  # the mappings stay valid for whoever still holds them; the names go
            for path in filter(None, self.kv_cache_paths):
                for name in (path, path + STATE_FILE_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(name)
