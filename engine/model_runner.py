"""The model runner: one rank's model, KV cache and sampler, stepping a plan.

A runner is built once per rank (engine/precision.py's `start_runner`: the model and its weights,
the KV cache sized from kv_cache_memory, the precision chosen, the cache allocated in the dtype
chosen with it, decode graphs captured) and lives as long as its engine. Each step, rank 0 turns the
scheduler's plan into a ModelInput (`prepare_input`: plain data, broadcast to the other ranks as
is), and every rank calls `execute`: block copies (copy-on-write forks) first, then the attention
metadata and the model's forward pass inside a forward_context, the prompt logprobs asked for, on
rank 0 the pooling requests' hidden states (embeddings: `_pooled`, never on the decode path) and the
logits of the sampling rows, the step's structured-output mask applied and one token drawn per row.
Its result is one StepOutput record. A layer hook, when given, is called by each attention layer
once its KV is written (a prefill pushing its KV to another engine). Decode-only steps replay a
captured CUDA graph where one applies; everything else runs eagerly. Under pipeline parallelism a
rank holds its stage's layers and their KV only, and the forward pass runs the stages in turn
(`_forward`); a later stage's part of a step ends there. A step whose final hidden states the first
stage does not need (`_wants_final`: a long prompt's chunks before the one that samples) is not
waited for: each stage hands its activations on and returns, so rank 0 plans and starts the next
chunk while the later stages still compute this one, and a stage keeps the handles of those sends
(`_hand_on`); rank 0 runs at most PP_STEPS_AHEAD steps ahead of the others (engine/tp.py
`TPGroup.wait_ahead`). Every rank runs the same steps in the same order, so each stage's KV is
written as with waiting. A step whose sequences run LoRA adapters groups its rows by adapter into
the forward context (engine/lora.py), and runs eagerly.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from pdserve.engine import sleep
from pdserve.engine.attention import model_decode_kernel
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, applies_to as graphs_apply
from pdserve.engine.decode_burst import Bursts
from pdserve.engine.forward_context import (
    AttentionMetadata,
    PrefillSpan,
    forward_context,
    host_tensor,
)
from pdserve.engine.kv_window import max_blocks_held
from pdserve.engine.layers.linear import LinearBase
from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq
from pdserve.engine.loader import checkpoint_weights
from pdserve.engine.lora import LoRACache, batch_for
from pdserve.engine.models import model_class
from pdserve.engine.multimodal import chunk_embeds, chunk_rope, image_blocks, language_model_weights
from pdserve.engine.parallel import (
    PendingSend,
    current_tp_state,
    divide,
    is_first_rank,
    max_stage_layers,
    pp_irecv,
    pp_isend,
    pp_rank,
    pp_recv,
    pp_send,
    pp_size,
    stage_layers,
    tp_size,
)
from pdserve.engine.quality import CHAT_PROMPTS
from pdserve.engine.recurrent_state import STATE_FILE_SUFFIX, RecurrentStates
from pdserve.engine.sampler import RankedLogprobs, Sampler, SamplingRow, plain_greedy
from pdserve.engine.scheduler import StepOutput
from pdserve.engine.score_head import HeadCapture, ScoreHead
from pdserve.engine.threads import ThreadFit
from pdserve.kvpool import create_pool_file, new_private_pool

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from pdserve.engine.scheduler import ScheduledSeq, StepPlan
    from pdserve.engine.structured.grammar import GrammarMask

PROMPT_LOGITS_ROWS = 512  # prompt positions whose vocabulary-wide logits are held at once


# a pipelined prefill step is cut into micro-batches of at least this many tokens (_micro_batches)
PP_MICRO_MIN_TOKENS = 128
# the steps rank 0 may run ahead of the later pipeline stages, steps whose final hidden states it
# does not need (a long prompt's chunks before the last): broadcast but not yet taken by every
# rank (engine/tp.py TPGroup.wait_ahead, before the engine plans and times a step). A stage keeps
# the sends of one step more than that pending before it waits for them (ModelRunner._hand_on).
PP_STEPS_AHEAD = 1


@dataclass(slots=True)
class SeqInput:
    """What every rank needs to know about one scheduled sequence (plain data: it is broadcast)."""

    token_ids: list[int]  # the tokens computed this step
    start: int  # position of the first of them
    block_ids: list[int]
    samples: bool
    # prompt logprobs wanted: the prompt token that follows each of the first len() computed tokens
    prompt_targets: list[int] = field(default_factory=list)
    prompt_topk: int = 0  # and this many most likely tokens at each of those positions
    # positions sampled at, the last ones (speculative decoding checks a guess at each); a
    # sequence that samples at every token it computes after a context runs them as decode rows
    num_logits: int = 1
    # a pooling request (embeddings; it never samples): "last" or "mean", and whether this step
    # computes its last prompt token
    pooling: str = ""
    pool_end: bool = False
    lora_id: int = 0  # the LoRA adapter it runs under (engine/lora.py); 0: the base model
    # the embedding rows of the image tokens among these tokens (engine/multimodal.py
    # chunk_embeds): [their offsets in token_ids, the rows' float32 bytes]; []: none
    embeds: list = field(default_factory=list)
    # where the rotary embedding places these tokens, for Qwen2-VL's 3-D positions
    # (engine/multimodal.py chunk_rope): each at its index plus rope_shift, or, where rope_rows
    # holds three lists (frame, row, column), at those
    rope_shift: int = 0
    rope_rows: list = field(default_factory=list)
    # a hybrid model's recurrent-state slot (engine/recurrent_state.py); -1: none
    state_slot: int = -1
    # where the prefix cache keeps its state mid-chunk: after the first keep_at of these tokens,
    # into slot keep_slot (-1: nowhere)
    keep_at: int = 0
    keep_slot: int = -1
    # an EAGLE draft head's input (engine/models/eagle.py): a row of h per token; None: none
    hidden: torch.Tensor | None = None


@dataclass
class ModelInput:
    seqs: list[SeqInput]
    block_copies: list[tuple[int, int]]
    # the step's LoRA adapters, {id: [name, path, content hash]}: each rank reads one that is not
    # resident from the path (engine/lora.py LoRACache)
    loras: dict[int, list] = field(default_factory=dict)
    # a pipelined prefill's hand-off: what the ranks of the later stages push of this step's
    # prefill-only requests (engine/kv_publish.py stage_pushes; plain data)
    kv_pushes: list = field(default_factory=list)
    # a checkpoint directory every rank loads its weights from, in place, before the step (which
    # then has no sequences: LLMEngine.update_weights)
    reload_from: str = ""
    # a trainer's weight group (engine/weight_sync.py), before the step (which then has no
    # sequences): ["join", name, address, port, rank_offset, world_size, timeout_s], ["receive",
    # name, [[tensor name, dtype, shape], ...], transfer id] (then every rank loads them) or
    # ["leave", name]
    weights_op: list = field(default_factory=list)
    # a sleep's or a wake's part on every rank (engine/sleep.py apply), before the step (which
    # then has no sequences): ["sleep", level] or ["wake_kv"]
    memory_op: list = field(default_factory=list)
    # (source, destination) recurrent-state slots to copy before the step: forks' starts
    state_copies: list = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        model_dir: str,
        kv_cache_path: str | None = None,  # this rank's pool in a shared file; None: private
    ):
        self.config = config
        self.kv_cache_path = kv_cache_path
        self.weight_groups: dict = {}  # a trainer's group name -> this rank's WeightReceiver
        # (parameter, shape) of the weights a level-2 sleep dropped (engine/sleep.py); None: none
        self.released_weights: list | None = None
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype
        self.block_size = config.block_size
        divide(model_config.num_heads, tp_size(), "the attention heads")
        # (an MLA model's one latent is on every rank: engine/layers/mla.py)
        self.num_kv_heads = (
            1
            if model_config.kv_latent_dim
            else divide(model_config.num_kv_heads, tp_size(), "the key/value heads")
        )
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                rotary = _rotary(model_config, config.max_model_len, self.device)
                self.model = model_class(model_config.architecture)(model_config, rotary)
        finally:
            torch.set_default_dtype(default_dtype)
        self._load_weights(model_dir)
        self.model.eval()
        # a hybrid model's linear layers' per-sequence state: `state_slots` slots for the
        # scheduler to hand out (engine/recurrent_state.py)
        self.states: RecurrentStates | None = None
        self.state_slots = self._state_bytes = 0
        if model_config.recurrent_layers:
            self._allocate_states()
        # with decode graphs, one block more than the scheduler is told of: padded rows write there
        use_graphs = pp_size() == 1 and graphs_apply(self.device, tp_size(), config.cuda_graphs)
        self._spare_blocks = 1 if use_graphs else 0
        # A model whose every layer slides puts this block, kept out of the pool and never
        # written by a sequence, in the table entries of blocks its window has left (kv_window.py).
        window = model_config.kv_window
        self._spare_blocks += window is not None
        # the cache's shape is fixed (and checked) now; its memory is taken by allocate_kv_cache,
        # once the precision is chosen, so a start whose dtype is known early fills it once
        self.kv_cache: torch.Tensor | None = None
        self._kv_shape = self._kv_cache_shape()
        self.null_block = self._kv_shape[2] - 1 if window is not None else None
        self.sampler = Sampler() if is_first_rank() else None
        self._use_graphs = use_graphs
        # under pipeline stages: the sends of the last steps not waited for, oldest first (_hand_on)
        self._unsent: deque[list[PendingSend]] = deque()
        # the cores a step uses, fitted to those free now (engine/threads.py)
        self.thread_fit = ThreadFit() if self.device.type == "cpu" else None
        self.graphs: DecodeGraphs | None = None  # (precision probes run eagerly, before)
        self.bursts: Bursts | None = None  # greedy decode steps run ahead (with the graphs)
        # the quantization the linears run in (None: config.dtype), and why: engine/precision.py
        self.quantization: str | None = None
        self.mode_note = ""
        # the hidden states a step hands back per sequence (StepOutput.hidden), for an EAGLE head
        # (engine/spec/eagle.py): None, nothing; (), the model's output; layer indices, those
        # layers' inputs side by side (EAGLE-3's); steps then run eagerly, without graphs
        self.expose: tuple[int, ...] | None = None
        # this rank's resident LoRA adapters (engine/lora.py); None unless enable_lora
        self.lora_cache = (
            LoRACache(
                self.model,
                model_config,
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
            )
            if config.enable_lora
            else None
        )

    def _allocate_states(self) -> None:
        """A slot per sequence that may run (max_num_seqs), as many as half of kv_cache_memory
        holds (a state is megabytes: benchmarks/engine/hybrid.py's 1024-wide model's 6.7 MB,
        the KV of 822 of its tokens), the rest left to the KV blocks; with the prefix cache on,
        all that half holds, the slots no sequence holds keeping the cache's states
        (recurrent_state.SlotPool). The start's probes use one per chat prompt."""
        mc, config = self.model_config, self.config
        self.state_layouts = self.model.state_layouts()  # (engine/recurrent_state.py)
        shapes = self.state_shapes = [s.shapes(tp_size()) for s in self.state_layouts]
        per_slot = RecurrentStates.bytes_for(shapes, 1)
        fit = config.kv_cache_memory // 2 // per_slot
        if fit < 1:
            raise ValueError(
                f"kv_cache_memory={config.kv_cache_memory!r} is too small for {mc.architecture}: "
                f"one sequence's recurrent state takes {per_slot} bytes, and it may take half at "
                f"most: raise kv_cache_memory to at least {2 * per_slot}"
            )
        self.state_slots = fit if config.enable_prefix_caching else min(config.max_num_seqs, fit)
        allocated = max(self.state_slots, len(CHAT_PROMPTS))
        # a pool file beside the KV pool's where that is shared: rank 0 reads and writes this
        # rank's states for a P/D hand-off (engine_core.LLMEngine.state_views)
        path = None if self.kv_cache_path is None else self.kv_cache_path + STATE_FILE_SUFFIX
        self.states = RecurrentStates(shapes, allocated, self.device, path)
        self._state_bytes = allocated * per_slot

    def capture_graphs(self) -> None:
        """The decode graphs, once the precision is final (a graph records its kernels)."""
        if self._use_graphs:
            self.graphs = DecodeGraphs(self, self.config.max_num_seqs, spare_block=self.num_blocks)
            self.bursts = Bursts(self.graphs, self.config.decode_burst, self.block_size)

    def _load_weights(self, model_dir: str, tensors=None) -> None:
        """The weights of the checkpoint in `model_dir`, or of `tensors` ((HF name, tensor)
        pairs) where given."""
        self.score_head: ScoreHead | None = None  # pooling "classify"'s (engine/score_head.py)
        if self.config.load_format == "dummy" and tensors is None:
            dummy_weights(self.model, self.config.seed)
            return
        capture = HeadCapture(self.model_config)
        # (a model that reads a few of the checkpoint's tensors says which: an MTP head)
        keep = getattr(self.model, "wants", None)
        source = checkpoint_weights(model_dir, keep) if tensors is None else tensors
        mc = self.model_config
        if mc.multimodal_config is not None or mc.text_only_of:  # (the vision tower's are not)
            source = language_model_weights(source)
        self.model.load_weights(capture.wrap(source))
        self.score_head = capture.head()

    def reload_weights(self, model_dir: str) -> None:
        """This rank's weights loaded again from `model_dir` (a checkpoint of the same shapes),
        in place: each released dense weight gets its storage back, the checkpoint loads as at
        start, and the linears are packed again for the mode they run in (quantization None
        only: LLMEngine.update_weights refuses the others, whose calibration belongs to the
        weights it was taken on). On CUDA the dense weights are never released, so the new ones
        land in the storage the decode graphs read (read from the code: not yet run on a GPU)."""
        self._reload(model_dir, None)

    def _reload(self, model_dir: str, tensors) -> None:
        sleep.restore_weights(self)  # (what a level-2 sleep dropped: NaN, loaded below)
        for module in self.model.modules():
            if isinstance(module, LinearBase):
                module.restore_dense()
        self._load_weights(model_dir, tensors)
        self.model.prepare_linears(self.quantization)
        # the dense weights the packing released go back to the system, not to the heap's
        # free lists (on a CPU a model's float32 copy: 0.4-0.7 GB more resident per worker)
        sleep.trim_heap()

    def weights_op(self, op: list) -> None:
        """This rank's part of a trainer's weight group (ModelInput.weights_op): joins it on a
        thread of its own, or receives one update and loads it, or leaves it. A follower whose
        receive fails logs it and serves on with its weights: the group's agreement tells rank 0
        (weight_sync.py), which raises."""
        from pdserve.engine.weight_sync import WeightReceiver, WeightSyncError

        kind, name = op[0], op[1]
        old = self.weight_groups.pop(name, None)
        if old is not None and kind != "receive":
            old.close()
        if kind == "join":
            address, port, offset, world_size, timeout_s = op[2:]
            rank = offset + current_tp_state().world_rank
            self.weight_groups[name] = WeightReceiver(
                name, address, port, rank, world_size, timeout_s
            )
        elif kind == "receive":
            try:
                if old is None:
                    raise WeightSyncError(f"this rank is in no weight group {name!r}")
                self.weight_groups[name] = old
                received = old.receive([(n, d, tuple(s)) for n, d, s in op[2]], op[3])
            except WeightSyncError as e:
                if is_first_rank():
                    raise
                log.warning("rank %d: a weight update failed: %s", current_tp_state().world_rank, e)
                return
            self._reload("", list(received.items()))
        elif kind != "leave":
            raise ValueError(f"unknown weights_op {kind!r}")

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """Puts the KV cache in `dtype` (engine/kv_dtype.py chooses it, before any request holds
        a block); the blocks follow kv_cache_memory in bytes. An allocated cache is reallocated,
        the old one released first, so the memory is never held twice; one not allocated yet (a
        verdict kept from an earlier start, engine/precision.py) is only resized."""
        allocated = self.kv_cache is not None
        self.kv_cache = None
        self.kv_dtype = dtype
        self._kv_shape = self._kv_cache_shape()
        if self.null_block is not None:
            self.null_block = self._kv_shape[2] - 1
        if allocated:
            self.allocate_kv_cache()

    def allocate_kv_cache(self) -> torch.Tensor:
        """The KV cache, allocated (zeroed) on the first call in the shape and dtype chosen by
        then: engine/precision.py calls it before the first step that needs a cache."""
        if self.kv_cache is None:
            self.kv_cache = self._new_kv_cache()
        return self.kv_cache

    def _new_kv_cache(self) -> torch.Tensor:
        """A cache of the chosen shape and dtype, zeroed (a worker's start logs each one:
        worker_common/start_stages.py)."""
        if self.kv_cache_path is not None and self.model_config.num_kv_layers:
            return create_pool_file(self.kv_cache_path, self._kv_shape, self.kv_dtype)
        # zeros, not empty: masked-out slots are still multiplied by 0, and NaN * 0 is NaN
        if self.device.type == "cpu" and self.config.kv_cache_huge_pages:
            return new_private_pool(self._kv_shape, self.kv_dtype)  # (kvpool says why)
        return torch.zeros(self._kv_shape, dtype=self.kv_dtype, device=self.device)

    @property
    def num_blocks(self) -> int:
        """The blocks requests may hold (a spare block for padded graph rows is not counted)."""
        return self._kv_shape[2] - self._spare_blocks

    def _kv_cache_shape(self) -> tuple[int, ...]:
        mc = self.model_config
        # every rank sizes its blocks by the largest stage's layers, so all have the same count
        per_block = (
            2
            * max_stage_layers(mc.num_kv_layers)
            * self.block_size
            * self.num_kv_heads
            * mc.head_dim
            * self.kv_dtype.itemsize
        )
        # (a hybrid model's recurrent state comes out of the same budget: engine_core says)
        kv_bytes = self.config.kv_cache_memory - self._state_bytes
        if per_block == 0:  # no layer keeps KV (Mamba2's every layer): blocks count positions
            cfg = self.config
            per_seq = -(-cfg.max_model_len // self.block_size)
            kv_bytes, per_block = cfg.max_num_seqs * per_seq + self._spare_blocks, 1
        num_blocks = kv_bytes // per_block - self._spare_blocks
        min_blocks = -(-self.config.max_model_len // self.block_size)
        if mc.kv_window is not None:  # a sequence holds its window and one chunk at most
            held = max_blocks_held(
                mc.kv_window, self.block_size, self.config.max_num_batched_tokens
            )
            min_blocks = min(min_blocks, held)
        if num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory={self.config.kv_cache_memory!r} gives {num_blocks} blocks of "
                f"{self.block_size} tokens; one sequence of max_model_len={self.config.max_model_len} "
                f"needs {min_blocks}: raise kv_cache_memory or lower max_model_len"
            )
        first, end = stage_layers(mc.num_kv_layers)
        return (
            end - first,  # this pipeline stage's layers (all of them with one stage)
            2,
            num_blocks + self._spare_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
        )

    # ---- one step -------------------------------------------------------------------------------
    @staticmethod
    def prepare_input(plan: StepPlan) -> ModelInput:
        """The plan as every rank needs it: plain data, broadcast to the other ranks as is."""
        loras = {}
        for item in plan.scheduled:
            info = item.seq.lora
            if info is not None:
                loras[info.lora_id] = [info.name, info.path, info.content_hash]
        return ModelInput(
            [_seq_input(s) for s in plan.scheduled],
            plan.block_copies,
            loras,
            state_copies=plan.state_copies,
        )

    @torch.inference_mode()
    def execute(
        self,
        inp: ModelInput,
        rows: list[SamplingRow] | None = None,
        row_logits: list[int] | None = None,
        on_layer_done: Callable[[int], None] | None = None,
        mask: GrammarMask | None = None,
    ) -> StepOutput:
        """Runs the model. On rank 0 with rows given, samples each row from logits row
        row_logits[i] (after `mask`); on_layer_done(layer) runs as each layer's KV is written."""
        if inp.reload_from:
            self.reload_weights(inp.reload_from)
        if inp.weights_op:
            self.weights_op(inp.weights_op)
        if inp.memory_op:
            sleep.apply(self, inp.memory_op)
        for src, dst in inp.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        if self.states is not None:  # forks start from their parent, fresh sequences from zeros
            # (copies first: a parent that finished may have handed its slot to a new sequence)
            self.states.copy(inp.state_copies)
            self.states.reset([s.state_slot for s in inp.seqs if s.start == 0])
        if not inp.seqs:
            return StepOutput()
        if self.thread_fit is not None:
            self.thread_fit.fit()
        key = None if inp.loras or self.expose is not None else self._graph_key(inp, on_layer_done)
        if self.bursts is not None and (key is None or inp.block_copies or inp.weights_op):
            self.bursts.clear()
        if key is not None:  # a decode-only step, replayed from its CUDA graph
            return self._graph_step(inp, key, rows, row_logits, mask)
        meta, input_ids, positions, last_idx, q_starts = self._attention_inputs(inp)
        meta.on_layer_done = on_layer_done
        meta.lora = batch_for(
            self.lora_cache,
            [(inp.seqs[i].lora_id, q_starts[i], len(inp.seqs[i].token_ids)) for i in q_starts],
            inp.loras,
            self.device,
        )
        if self.expose is not None:
            _hidden_inputs(meta, inp, q_starts, self.expose, self.device)
        parts = self._micro_batches(inp)
        final = _wants_final(inp)
        if parts:
            hidden = self._forward_micro(parts, on_layer_done, final)
        else:
            with forward_context(meta):
                hidden = (
                    self._forward(input_ids, positions, final)
                    if pp_size() > 1
                    else self.model(input_ids, positions)
                )
        if hidden is None:  # a later pipeline stage: its part is done
            return StepOutput()
        out = StepOutput(
            prompt_logprobs=self._prompt_logprobs(inp, hidden, q_starts, rank0=rows is not None)
        )
        if rows is not None and any(s.pooling for s in inp.seqs):
            out.pooled = _pooled(inp, hidden, q_starts, self.score_head)
        if self.expose is not None:
            states = torch.cat(meta.aux, -1) if self.expose else hidden
            out.hidden = [
                states[q_starts[i] : q_starts[i] + len(s.token_ids)] for i, s in enumerate(inp.seqs)
            ]
        n = last_idx.numel()
        # a decode-only step samples every row in order: no copies of hidden states or logits
        every_row = n == hidden.shape[0] and meta.num_decode_tokens == n
        last = hidden if every_row else hidden[last_idx]
        logits = self.model.compute_logits(last) if n else None
        return self._sample(logits, rows, row_logits, mask, out)

    def _graph_step(self, inp: ModelInput, key, rows, row_logits, mask) -> StepOutput:
        """A decode-only step on the graphs: an all-greedy step's tokens are taken on the device
        (handed out from a burst run ahead where one applies, engine/decode_burst.py); any
        other step's logits are sampled on the host."""
        if not _device_greedy(rows, row_logits, mask, len(inp.seqs)):
            self.bursts.clear()
            logits = self.graphs.run(inp.seqs, key)
            return self._sample(logits, rows, row_logits, mask, StepOutput())
        tokens = self.bursts.take(inp.seqs)
        if tokens is None:
            tokens = self.bursts.run(inp.seqs, rows)
        if tokens is None:
            tokens = self.graphs.run_greedy(inp.seqs, key)
        return StepOutput(token_ids=tokens)

    def _micro_batches(self, inp: ModelInput) -> list[ModelInput]:
        """A pipelined step's micro-batches, or [] when it runs whole: under pipeline stages, a
        step that prefills one sequence's chunk of at least 2 x PP_MICRO_MIN_TOKENS tokens (no
        LoRA adapter) runs as up to 2 x stages consecutive pieces of it, so the first stage
        computes piece j + 1 while the next computes piece j (`_forward_micro`). Each piece is
        the chunked prefill of its tokens: it attends to the pieces before it, whose KV its
        stage has written, and on a CPU with the compiled attention kernel a token's result does
        not depend on how its prompt is cut (every token a row of the kernel). Every rank cuts
        the same way from the same ModelInput."""
        stages = pp_size()
        if stages == 1 or len(inp.seqs) != 1 or inp.loras:
            return []
        s = inp.seqs[0]
        n = len(s.token_ids)
        count = min(2 * stages, n // PP_MICRO_MIN_TOKENS)
        if count < 2 or _decodes(s):
            return []
        if s.embeds and self.model_config.image_attention_bidirectional:
            return []  # (an image's tokens see the whole image: its chunk runs whole)
        size = -(-n // count)
        return [
            ModelInput(
                [
                    SeqInput(
                        s.token_ids[a : a + size],
                        s.start + a,
                        s.block_ids,
                        samples=False,
                        embeds=piece_embeds(s.embeds, a, a + size),
                        rope_shift=s.rope_shift,
                        rope_rows=[r[a : a + size] for r in s.rope_rows],
                    )
                ],
                [],
            )
            for a in range(0, n, size)
        ]

    def _forward_micro(
        self, parts: list[ModelInput], on_layer_done, final: bool
    ) -> torch.Tensor | None:
        """`_forward` over micro-batches: each stage runs the pieces in order and hands each on
        without waiting for it to be taken (pp_isend), the first stage having posted the
        receives of every piece's final hidden states from the last one up front. Returns them
        in order, concatenated, on the first stage (None on the others, and on the first too
        when the step is not `final`: then the last stage sends nothing back and no stage waits
        for its sends, `_hand_on`). A layer's KV is final once the last piece has passed it:
        on_layer_done runs during the last piece only."""
        stage, stages = pp_rank(), pp_size()
        size, dtype = self.model_config.hidden_size, self.dtype
        inputs = [self._attention_inputs(p)[:3] for p in parts]
        sends = []
        back = (
            [
                pp_irecv([(len(p.seqs[0].token_ids), size)], dtype, self.device, stages - 1)
                for p in parts
            ]
            if stage == 0 and final
            else []
        )
        for j, (meta, ids, pos) in enumerate(inputs):
            meta.on_layer_done = on_layer_done if j == len(inputs) - 1 else None
            shape = (ids.shape[0], size)
            carried = (
                None
                if stage == 0
                else tuple(pp_recv([shape, shape], dtype, self.device, stage - 1))
            )
            with forward_context(meta):
                out = self.model(ids, pos) if stage == 0 else self.model(ids, pos, carried)
            if stage < stages - 1:
                sends.append(pp_isend(list(out), stage + 1))
            elif final:
                sends.append(pp_isend([out], 0))
        hidden = torch.cat([r.wait()[0] for r in back]) if back else None
        self._hand_on(sends, final)
        return hidden

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, final: bool = True
    ) -> torch.Tensor | None:
        """One step's forward pass through the pipeline stages (engine/parallel.py). The first
        stage embeds and runs its layers; each stage hands the hidden states and the residual
        stream to the next; the last one normalizes and hands the final hidden states back to
        the first, which computes the logits (its LM head) and samples. Returns those hidden
        states on the first stage, None on the others. The same additions in the same order as
        in one stage, so the tokens do not depend on the split. A step that is not `final`
        (`_wants_final`) sends nothing back and returns None on the first stage too, as soon as
        its own layers are done (`_hand_on`)."""
        stage, stages = pp_rank(), pp_size()
        shape = (input_ids.shape[0], self.model_config.hidden_size)
        dtype = self.dtype  # the activations'
        if stage == 0:
            hidden, residual = self.model(input_ids, positions)
            sends = [pp_isend([hidden, residual], 1)]
            out = pp_recv([shape], dtype, self.device, stages - 1)[0] if final else None
            self._hand_on(sends, final)
            return out
        carried = tuple(pp_recv([shape, shape], dtype, self.device, stage - 1))
        out = self.model(input_ids, positions, carried)
        if stage < stages - 1:
            self._hand_on([pp_isend(list(out), stage + 1)], final)
        elif final:
            pp_send([out], 0)
        return None

    def _hand_on(self, sends: list[PendingSend], final: bool) -> None:
        """A pipeline stage's sends of one step. After a `final` step every send still pending
        is waited for (the first stage has its final hidden states, so the later stages took
        everything before them); otherwise they are kept and the step returns at once, so this
        stage runs the next step while the next stage still computes this one (a long prompt's
        chunks pipeline across steps, not only within one: the stages overlap but for the
        prompt's first piece and its last). The oldest are waited for once more than
        PP_STEPS_AHEAD + 1 steps' are pending: that bounds the activations held, and how far a
        stage that is not rank 0 runs ahead (rank 0 is bounded before, TPGroup.wait_ahead, so
        this seldom waits there)."""
        self._unsent.append(sends)
        keep = 0 if final else PP_STEPS_AHEAD + 1
        while len(self._unsent) > keep:
            for pending in self._unsent.popleft():
                pending.wait()

    def _sample(self, logits, rows, row_logits, mask, out: StepOutput) -> StepOutput:
        """`out` with the sampled tokens (rank 0 with rows and logits; else as it is)."""
        if logits is None or rows is None:
            return out
        if row_logits != list(range(logits.shape[0])):
            logits = logits[row_logits]
        sampled = self.sampler(logits.float(), rows, mask)
        out.token_ids, out.logprobs = sampled.token_ids, sampled.logprobs
        return out

    def _graph_key(self, inp: ModelInput, on_layer_done) -> tuple[int, int] | None:
        """The decode graph bucket for this step, or None to run it eagerly: graphs take steps
        in which every sequence decodes one token, samples it and wants no prompt logprobs, and
        no layer hook waits (a prefill pushing its KV layer by layer)."""
        if self.graphs is None or on_layer_done is not None:
            return None
        for s in inp.seqs:
            if len(s.token_ids) != 1 or not s.samples or s.prompt_targets or s.embeds:
                return None
            if s.rope_shift or s.rope_rows:  # (a graph places each token at its index)
                return None
        return self.graphs.shape_for(inp.seqs)

    def _prompt_logprobs(
        self, inp: ModelInput, hidden: torch.Tensor, q_starts: dict[int, int], rank0: bool
    ) -> dict[int, list[dict[int, float]]]:
        """seq index -> for each position with a prompt target, {token id: logprob} of the target
        and the seq's prompt_topk most likely tokens (-1: every token, most likely first), with
        the target's rank in the vocabulary (RankedLogprobs.rank). Every rank computes the logits
        (the LM head may gather across ranks); rank 0 keeps the numbers. At most
        PROMPT_LOGITS_ROWS rows of vocabulary-wide logits exist at a time, and only for the
        positions this step computes: a long prompt's logprobs come chunk by chunk with its
        prefill (engine/scheduler.py)."""
        out: dict[int, list[dict[int, float]]] = {}
        for i, s in enumerate(inp.seqs):
            n, k = len(s.prompt_targets), s.prompt_topk
            rows: list[dict[int, float]] = []
            for a in range(0, n, PROMPT_LOGITS_ROWS):
                b = min(n, a + PROMPT_LOGITS_ROWS)
                logits = self.model.compute_logits(hidden[q_starts[i] + a : q_starts[i] + b])
                if logits is None or not rank0:
                    continue
                # log_softmax's values at the few tokens kept, without a second vocabulary-wide
                # tensor: logit - logsumexp of its row
                logits = logits.float()
                lse = torch.logsumexp(logits, dim=-1, keepdim=True)
                targets = torch.tensor(s.prompt_targets[a:b], dtype=torch.long, device=lse.device)
                target_logits = logits.gather(1, targets[:, None])
                picked = (target_logits - lse)[:, 0].tolist()
                ranks = (logits >= target_logits).sum(dim=-1).tolist()  # vLLM's rank
                top_i, top_v = [[]] * (b - a), [[]] * (b - a)
                if k:
                    top = logits.topk(logits.shape[-1] if k == -1 else k, dim=-1)
                    top_i, top_v = top.indices.tolist(), (top.values - lse).tolist()
                targets = s.prompt_targets[a:b]
                for t, v, rank, ti, tv in zip(targets, picked, ranks, top_i, top_v):
                    entry = RankedLogprobs(zip(ti, tv))
                    entry[t] = v
                    entry.rank = rank
                    rows.append(entry)
            if rows:
                out[i] = rows
        return out

    def _attention_inputs(self, inp: ModelInput):
        bs = self.block_size
        # Where the compiled kernel attends, every token is a row of it, prompt chunks included: a
        # row's result then depends on its position and context only, not on how its prompt was
        # cut into chunks or what else ran in the step (an SDPA call's shape changes its last
        # bits, and int8's per-row activation scaling turns those into whole quantization steps)
        kernel = model_decode_kernel(self.model_config, self.device, self.dtype, self.kv_dtype)
        rows_all = kernel is not None
        # Gemma 3's image tokens see their whole image: a chunk with some is one masked span
        two_way = self.model_config.image_attention_bidirectional
        # decodes (one new token, or guesses checked after a context: one decode row per token)
        # first, so attention can batch them with a single gather
        seqs = inp.seqs
        decodes = [len(s.token_ids) == 1 or _decodes(s) for s in seqs]
        order = [i for i, d in enumerate(decodes) if d]
        if len(order) < len(seqs):
            order += [i for i, d in enumerate(decodes) if not d]
        ids, pos, slots, last_idx = [], [], [], []
        row_seqs, prefills = [], []  # (first position, rows, blocks) per sequence run as rows
        q_starts = {}
        rope_rows = []  # (first row, [3 lists]) of the sequences placed in 3-D (Qwen2-VL)
        for i in order:
            s = seqs[i]
            start, blocks = s.start, s.block_ids
            n = len(s.token_ids)
            q_start = q_starts[i] = len(ids)
            ids += s.token_ids
            context_len = start + n
            shift = s.rope_shift  # (the rotary position; the cache slot is the index)
            if s.rope_rows:
                rope_rows.append((q_start, s.rope_rows))
            if n == 1:  # (a decode's one position, without a range and a list built for it)
                pos.append(start + shift)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                positions = range(start, context_len)
                pos += range(start + shift, context_len + shift) if shift else positions
                slots += [blocks[p // bs] * bs + p % bs for p in positions]
            num_blocks = -(-context_len // bs)
            if num_blocks < len(blocks):  # (most often it holds just these: no copy then)
                blocks = blocks[:num_blocks]
            if two_way and s.embeds and not decodes[i]:
                prefills.append(_prefill_span(q_start, n, start, blocks, s.embeds[0]))
            elif rows_all or decodes[i]:  # row j sees the context and the tokens up to its own
                row_seqs.append((start, n, blocks))
            else:
                prefills.append(_prefill_span(q_start, n, start, blocks))
            if s.samples:
                k = s.num_logits
                if k == 1:
                    last_idx.append((i, q_start + n - 1))
                else:
                    last_idx += [(i, q_start + n - k + j) for j in range(k)]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=host_tensor(slots, device=dev), kv_cache=self.kv_cache
        )
        if row_seqs:
            _row_inputs(meta, row_seqs, bs, masked=not rows_all, dev=dev)
        for span in prefills:
            span.block_ids = span.block_ids.to(dev)
            if span.causal_mask is not None:
                span.causal_mask = span.causal_mask.to(dev)
        meta.prefills = prefills
        _image_inputs(meta, seqs, q_starts, dev)
        if self.states is not None:
            _state_inputs(meta, [seqs[i] for i in order], self.states, dev)
        # logits rows in the order of the scheduled seqs that sample (the plan's row_logits index)
        last_idx.sort()
        sample_rows = host_tensor([t for _, t in last_idx], device=dev)
        return (
            meta,
            host_tensor(ids, device=dev),
            _rope_positions(pos, rope_rows, dev),
            sample_rows,
            q_starts,
        )


def _rotary(model_config: ModelConfig, max_len: int, device) -> RotaryEmbedding:
    """The model's rotary embedding for positions below max_len (Qwen2-VL's with its M-RoPE
    sections)."""
    inv_freq, attn_factor = rope_inv_freq(
        model_config.hf_config,
        model_config.rope_type,
        model_config.rope_theta,
        model_config.head_dim,
    )
    return RotaryEmbedding(
        inv_freq.to(device),
        attn_factor,
        max_len,
        model_config.mrope_section,
        model_config.mrope_interleaved,
    )


def _rope_positions(pos: list[int], rope_rows: list, dev) -> torch.Tensor:
    """The step's rotary positions: [tokens], or [3, tokens] where a sequence's tokens are
    placed in 3-D (`rope_rows`: its first row and its three lists; the others' three are one)."""
    if not rope_rows:
        return host_tensor(pos, device=dev)
    out = torch.tensor(pos, dtype=torch.long).repeat(3, 1)
    for first, rows in rope_rows:
        out[:, first : first + len(rows[0])] = torch.tensor(rows, dtype=torch.long)
    return out.to(dev)


def piece_embeds(embeds: list, a: int, b: int) -> list:
    """The image rows (SeqInput.embeds: [offsets, float32 bytes]) of a chunk's tokens a..b-1,
    with offsets from a: a micro-batch's share of its chunk's rows; [] where it has none."""
    if not embeds:
        return []
    offsets, data = embeds
    picked = [j for j, o in enumerate(offsets) if a <= o < b]
    if not picked:
        return []
    row = len(data) // len(offsets)  # bytes a row: the rows follow the offsets' order
    first, last = picked[0], picked[-1] + 1
    return [[offsets[j] - a for j in picked], data[first * row : last * row]]


def _image_inputs(meta: AttentionMetadata, seqs: list[SeqInput], q_starts: dict, dev) -> None:
    """The step's image tokens into `meta` (engine/multimodal.py): their rows among the step's
    tokens and the embeddings that stand in for those tokens' own."""
    rows, embeds = [], []
    for i, s in enumerate(seqs):
        if s.embeds:
            offsets, data = s.embeds
            rows += [q_starts[i] + j for j in offsets]
            embeds.append(torch.frombuffer(bytearray(data), dtype=torch.float32))
    if rows:
        meta.image_rows = host_tensor(rows, device=dev)
        meta.image_embeds = torch.cat(embeds).view(len(rows), -1).to(dev)


def _hidden_inputs(meta: AttentionMetadata, inp: ModelInput, q_starts: dict, expose, dev) -> None:
    """An EAGLE step's hidden-state rows in the step's token order (`hidden_in`, where the
    sequences bring some: a draft head's), and the layers whose inputs the model hands back
    (`aux_layers`: a target's for an EAGLE-3 head, collected in `aux`)."""
    meta.aux_layers, meta.aux = tuple(sorted(expose)), []
    given = [(q_starts[i], s.hidden) for i, s in enumerate(inp.seqs) if s.hidden is not None]
    if not given:
        return
    rows = sum(len(s.token_ids) for s in inp.seqs)
    hidden = torch.empty(rows, given[0][1].shape[-1], dtype=given[0][1].dtype, device=dev)
    for start, h in given:
        hidden[start : start + h.shape[0]] = h
    meta.hidden_in = hidden


def _state_inputs(meta: AttentionMetadata, ordered: list[SeqInput], states, dev) -> None:
    """A hybrid model's linear layers' view of the step (`ordered`: the sequences in row
    order): the leading one-token sequences' slots, updated as one batch, then each other
    sequence's (first row, tokens, slot, keep), in two spans where the prefix cache keeps its
    state after the first keep_at tokens."""
    meta.states = states
    ones, row = [], 0
    while row < len(ordered) and len(ordered[row].token_ids) == 1:
        ones.append(ordered[row].state_slot)
        row += 1
    meta.state_slots = host_tensor(ones, device=dev) if ones else None
    spans, q = [], row
    for s in ordered[row:]:
        n = len(s.token_ids)
        if s.keep_slot >= 0 and 0 < s.keep_at < n:
            spans.append((q, s.keep_at, s.state_slot, s.keep_slot))
            spans.append((q + s.keep_at, n - s.keep_at, s.state_slot, -1))
        else:
            spans.append((q, n, s.state_slot, -1))
        q += n
    meta.state_spans = spans


def _prefill_span(
    q_start: int, n: int, start: int, blocks: list[int], two_way: list[int] | None = None
) -> PrefillSpan:
    """A prompt chunk attended as one span: its n queries from row q_start, at positions from
    `start`, over `blocks`; a chunk after a context gets its causal mask (each query sees the
    context and the chunk up to its own position). `two_way`: the chunk offsets of image tokens
    that attend to their whole image (Gemma 3): each run of them sees through the run's end
    (the scheduler never ends a chunk inside an image: Sequence.fit_chunk)."""
    context_len = start + n
    mask = None
    if start > 0 or two_way:
        sees = torch.arange(start + 1, context_len + 1)  # each query's keys: those below this
        for a, b in image_blocks(two_way or []):
            sees[a:b] = start + b
        mask = torch.arange(context_len).unsqueeze(0) < sees.unsqueeze(1)
    return PrefillSpan(q_start, n, context_len, torch.tensor(blocks), mask)


def _row_inputs(meta: AttentionMetadata, row_seqs: list, bs: int, masked: bool, dev) -> None:
    """The decode rows' block table and context lengths into `meta` (and their mask where the
    compiled kernel does not attend: `masked`)."""
    meta.num_decode_tokens = num_rows = sum(n for _, n, _ in row_seqs)
    table, lens = _row_tables(row_seqs, num_rows)
    meta.decode_block_tables = table.to(dev)
    meta.decode_context_lens = lens.to(dev)
    if masked:
        visible = torch.arange(table.shape[1] * bs)[None, :] < lens[:, None]
        meta.decode_mask = visible[:, None, None, :].to(dev)


def _row_tables(row_seqs: list[tuple[int, int, list[int]]], num_rows: int):
    """The block table and context lengths of the decode rows (on the host): a sequence's rows
    share its block list (zero past its end), and row j of a sequence whose first row is at
    position `start` reads start + j + 1 tokens. The table is filled in a numpy array, every
    row's list at once: faster than a tensor built from the lists of lists."""
    widths = np.fromiter((len(b) for _, _, b in row_seqs), dtype=np.int64, count=len(row_seqs))
    array = np.zeros((len(row_seqs), int(widths.max())), dtype=np.int64)
    # every row's blocks in one flat array, put where each row's first len(blocks) columns are
    array[np.arange(array.shape[1]) < widths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(b for _, _, b in row_seqs), dtype=np.int64
    )
    table = torch.from_numpy(array)
    if num_rows == len(row_seqs):  # one row each: every sequence decodes
        lens = [start + 1 for start, _, _ in row_seqs]
    else:
        counts = torch.tensor([n for _, n, _ in row_seqs])
        table = table.repeat_interleave(counts, dim=0)
        lens = []
        for start, n, _ in row_seqs:
            lens += range(start + 1, start + n + 1)
    return table, host_tensor(lens)


def _seq_input(item: ScheduledSeq) -> SeqInput:
    """One scheduled sequence as plain data; prompt logprobs go with its first sample only.
    (Made for every scheduled sequence every step: ScheduledSeq's properties are inlined.)"""
    seq, start, num_spec = item.seq, item.start, item.num_spec
    end = start + item.num_new_tokens
    tokens = seq.token_ids
    own_end = end - num_spec  # (the guesses follow the sequence's own tokens)
    token_ids = tokens[start:own_end] + item.spec_token_ids if num_spec else tokens[start:own_end]
    targets, k = [], 0
    params = seq.params
    if params.prompt_logprobs is not None and seq.index == 0:
        # the prompt tokens that follow the positions this step computes
        last = min(end, len(seq.prompt_token_ids) - 1)
        targets, k = list(seq.prompt_token_ids[start + 1 : last + 1]), params.prompt_logprobs
    pooling = seq.pooling.pooling if seq.pooling is not None else ""
    samples = own_end == len(tokens)
    return SeqInput(
        token_ids,
        start,
        list(seq.block_ids),
        samples and not pooling,  # a pooling request takes no logits
        targets,
        k,
        num_spec + 1,
        pooling,
        samples,
        0 if seq.lora is None else seq.lora.lora_id,
        chunk_embeds(seq.images, start, own_end) if seq.images is not None else [],
        *(chunk_rope(seq.images, start, end) if seq.images is not None else ()),
        state_slot=seq.state_slot,
        keep_at=item.keep_at,
        keep_slot=item.keep_slot,
    )


def _pooled(
    inp: ModelInput, hidden: torch.Tensor, q_starts: dict[int, int], head: ScoreHead | None
) -> dict:
    """The pooling requests' part of a step (StepOutput.pooled), from the final hidden states
    (after the model's final norm: what the LM head reads), in float32 on the CPU: the last
    token's, the sum of the chunk's ("mean"), or the last token's class logits ("classify", by
    the model's classification head; the engine admits those only where there is one)."""
    out = {}
    for i, s in enumerate(inp.seqs):
        if not s.pooling:
            continue
        rows = hidden[q_starts[i] : q_starts[i] + len(s.token_ids)]
        if s.pooling == "mean":
            out[i] = rows.float().sum(0).cpu()
        elif s.pool_end and s.pooling == "classify":
            out[i] = head(rows[-1]).cpu()
        elif s.pool_end:
            out[i] = rows[-1].float().cpu()
    return out


def _device_greedy(rows, row_logits, mask, n: int) -> bool:
    """Whether a graph step's tokens can be its n rows' argmax taken on the device: rank 0, one
    sampling row per sequence, in order, no grammar mask, every row plain greedy."""
    if rows is None or mask is not None or row_logits != list(range(n)) or len(rows) != n:
        return False
    return plain_greedy(rows)


def _wants_final(inp: ModelInput) -> bool:
    """Whether the first pipeline stage needs a step's final hidden states, and so waits for the
    later stages: a sequence samples, wants prompt logprobs or pools. A step that hands KV off
    does not by itself: the later stages' push reports are gathered without waiting
    (engine/tp.py). Every rank judges the same ModelInput, so the last stage sends them back
    exactly when the first waits for them."""
    return any(s.samples or s.prompt_targets or s.pooling for s in inp.seqs)


def _decodes(s: SeqInput) -> bool:
    """Whether a sequence's tokens run as decode rows: one token, or, when it samples at every
    token it computes after a context (checking guesses), one row per token."""
    n = len(s.token_ids)
    return n == 1 or (s.samples and s.num_logits == n and s.start > 0)


@torch.no_grad()
def dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """load_format="dummy": every parameter drawn from U(-0.02, 0.02) (norm weights 1), like
    vLLM's dummy loader; the tokens mean nothing, the step times are the model's."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        gen = generators.get(param.device)
        if gen is None:
            gen = generators[param.device] = torch.Generator(param.device).manual_seed(seed)
        noise = torch.rand(param.shape, generator=gen, device=param.device, dtype=param.dtype)
        param.copy_(noise.sub_(0.5).mul_(0.04))
