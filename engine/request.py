"""Sequences (one sampled continuation each), the outputs handed to callers, and what the
disaggregation hooks take and give (KVSink, Reservation: engine/engine_core.py).

A Sequence is made when its request is added (n of them for n>1) and lives until the request is
forgotten: the scheduler moves it through SeqStatus (waiting, running, reserved, waiting for its
fork, finished) and owns its blocks and computed counts, the sampler reads its tokens and
generator, and the speculator and the grammar keep their per-sequence state on it. What leaves
the engine is plain data: a RequestOutput per request touched by a step, with one
CompletionOutput per sequence, cumulative or only what is new (SamplingParams.output_kind,
engine/outputs.py). KVSink is
the protocol a prefill-only request's KV leaves through, layer by layer; Reservation is what
`LLMEngine.reserve` holds for KV that another engine writes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pdserve.engine.block_manager import chain_root
from pdserve.engine.sampling_params import SamplingParams


class SeqStatus(enum.IntEnum):
    WAITING = 0  # in the waiting queue (new or preempted)
    RUNNING = 1  # in the running batch
    RESERVED = 2  # blocks held for KV that another engine writes (disaggregated decode)
    FORK_PENDING = 3  # an n>1 child waiting for its parent's prompt to finish
    FINISHED = 4


_FINISHED = SeqStatus.FINISHED  # (read for every request every step: a member's lookup costs)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    PREFILL_DONE = "prefill_done"  # prefill-only request: first token sampled, KV handed out
    POOLED = "pooled"  # pooling request: the prompt ran, its pooled hidden state is the output
    REPETITION = "repetition"  # its output ended in a repeated pattern (repetition detection)


POOLING_KINDS = ("last", "mean", "classify")


@dataclass(frozen=True)
class PoolingParams:
    """A pooling request's (embeddings, classification): the prompt runs once, nothing is
    sampled, and the output is the final hidden state (after the model's final norm) of its last
    token ("last", vLLM's default for decoder embedding models) or the mean over its tokens
    ("mean"), L2-normalised when `normalize`; or the class logits of its last token ("classify",
    on a model with a classification head: engine/score_head.py; never normalised)."""

    pooling: str = "last"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling not in POOLING_KINDS:
            raise ValueError(f"pooling must be one of {POOLING_KINDS}, got {self.pooling!r}")


@dataclass
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)  # prompt + outputs
    status: SeqStatus = SeqStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    block_ids: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    logprobs: list[float] = field(default_factory=list)
    prefill_only: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    # lower runs first (vLLM's priority scheduling): the waiting queue is kept in this order, first
    # come first served within equal values, and the running sequence with the highest value (the
    # latest admitted among them) is the first preempted (engine/scheduler.py)
    priority: int = 0
    # a pooling request (embeddings): nothing is sampled; `pooled` accumulates its hidden states
    # (the sum for "mean") and holds the finished vector once it ends with FinishReason.POOLED
    pooling: PoolingParams | None = None
    pooled: torch.Tensor | None = None
    first_token_time: float | None = None
    grammar: object | None = (
        None  # params.structured's matcher (engine/structured/grammar.py SeqGrammar)
    )
    # speculative decoding (engine/spec/speculator.py): how many guesses the next step may check,
    # the guesses already made (prompt lookup makes them before the step is planned), the tokens
    # whose KV the draft model holds, and the speculator's own record (engine/spec/speculator.py)
    spec_budget: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    draft_computed: int = 0
    spec_state: object | None = None
    # an EAGLE head's output at the sequence's last computed position, and the num_tokens it
    # belongs to (engine/spec/eagle.py); None: none kept
    draft_kept: tuple[int, object] | None = None
    # guesses from the request's predicted output the step kept, and checked but did not keep
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    # the LoRA adapter it runs under (engine/lora.py AdapterInfo; None: the base model), and
    # the root of its prefix-cache chain (the adapter's, engine/block_manager.py)
    lora: object | None = None
    # its thinking budget's state (engine/thinking.py ThinkingBudget), where the request set one
    thinking: object | None = None
    # its prompt's images (engine/multimodal.py ImagePrompt): their tokens' embedding rows, and
    # the ids its prefix-cache chain hashes
    images: object | None = None
    # a hybrid model's recurrent-state slot while it holds blocks (engine/recurrent_state.py)
    state_slot: int = -1
    # with the prefix cache on, the hash of the latest block past its prompt after which the
    # cache keeps its state (engine/scheduler.py _keep_state)
    snapshot_hash: int | None = None

    @property
    def lora_id(self) -> int:
        return 0 if self.lora is None else self.lora.lora_id

    @property
    def cache_root(self) -> int | None:
        """Its prefix-cache chain's root: its adapter's, salted by its cache salt
        (engine/block_manager.py chain_root)."""
        return chain_root(
            None if self.lora is None else self.lora.cache_root, self.params.cache_salt
        )

    def __post_init__(self):
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def cache_token_ids(self) -> list[int]:
        """The ids its prefix-cache chain hashes: its tokens, each image's tokens replaced by a
        number of that image's pixels where its prompt has images (engine/multimodal.py)."""
        if self.images is None:
            return self.token_ids
        return self.images.cache_ids + self.token_ids[len(self.images.cache_ids) :]

    def fit_chunk(self, n: int) -> int:
        """How many of its tokens the next step computes, for `n` offered: n, except where the
        piece would end inside an image whose tokens attend to one another both ways (Gemma 3,
        ImagePrompt.blocks): then up to that image's start where the piece starts before it,
        else through its end, past `n` (by less than one image), since each of the image's
        tokens must see the whole image in the step that computes it."""
        if self.images is None or not self.images.blocks:
            return n
        start = self.num_computed_tokens
        end = start + n
        for first, last in self.images.blocks:
            if first < end < last:
                return first - start if first > start else last - start
        return n

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == _FINISHED


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[float] | None = None
    # OpenAI's usage.completion_tokens_details for a request with a predicted output
    # (SamplingParams.prediction_token_ids): the prediction's tokens the engine checked as
    # guesses and kept, and those it checked and did not keep (0 where it did not speculate)
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), else {token id: logprob} holding the prompt token and the k most likely
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # a pooling request's vector (float32, on the CPU) once it finished; None otherwise
    pooled: torch.Tensor | None = None

    @classmethod
    def aborted(cls, request_id: str, reason: str) -> RequestOutput:
        """The last output of a request that was cut short, so its stream ends."""
        return cls(
            request_id,
            None,
            [],
            [CompletionOutput(0, "", [], FinishReason.ABORT.value, stop_reason=reason)],
            finished=True,
        )


class KVSink(Protocol):
    def on_layer(
        self, layer_idx: int, layer_kv: torch.Tensor, block_ids: list[int], start: int, end: int
    ) -> None:
        """layer_kv: [2, num_blocks, block_size, kv_heads, head_dim]; tokens [start, end) are final."""

    # a hybrid model's sink also has on_state(layer, [conv, ssm]): called once per linear
    # layer after the step that completes the prompt (engine/kv_publish.py), the tensors that
    # layer's recurrent state, final then: the whole model's, whatever the tensor-parallel size
    # (engine/recurrent_state.py SlotState.read); any sink may have on_step_start(), called as
    # each step that computes some of its prompt begins (engine/kv_publish.py layer_publisher)


@dataclass(frozen=True)
class Reservation:
    """What LLMEngine.reserve holds for a prompt whose KV another engine writes: the one record of
    a reservation, also the one a disaggregated decode worker's hand-off returns."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int  # leading prompt tokens whose KV this engine already holds
    block_size: int
    # a hybrid model's recurrent-state slot the other engine's state is written into
    # (LLMEngine.state_views: each layer's SlotState.write); -1: the model has none
    state_slot: int = -1
