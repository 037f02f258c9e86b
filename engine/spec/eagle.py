"""Speculative decoding with an EAGLE head (speculative_config methods "eagle" and "eagle3") or a
target's own MTP layer ("mtp", engine/models/mtp.py: run the same way as an EAGLE-1 head).

An EAGLE head (engine/models/eagle.py) guesses from the target's own hidden states, so it needs
what no separate draft model does: the states of every position the target computes. The target's
runner hands them back with each step (`ModelRunner.expose`: its output for EAGLE-1, the inputs of
three layers for EAGLE-3), and after each step `absorb` runs the head over the positions the
step kept (prompt chunks, a decode's token, a check's kept guesses and the token after them), in
one forward pass across sequences: position p reads t[p+1] and the target's state at p, and its KV
goes into the head's own cache (one layer, the same block ids as the target's, as a draft
model's). The last position's output, the head's guess for the token after the next one, is kept
with the sequence (`Sequence.draft_kept`). When the gate gives a sequence k guesses, `propose`
samples the first from that kept output and the others from k - 1 one-row steps of the head fed
its own output, each sampled with the sequence's parameters and a copy of its generator
(engine/spec/draft.py says why).

The head's KV of a position the target did not compute here (a prefix-cache hit keeps what the
block's first computation left; a hand-off's prompt, the host tier's blocks) is whatever its
blocks hold: guesses can only be worse for it, never the output, which the target checks as
always. The first step after a hand-off or a hit makes no guesses (nothing kept yet).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.model_runner import ModelInput, SeqInput
from pdserve.engine.models.eagle import LINEARS_MODE
from pdserve.engine.parallel import tp_scope
from pdserve.engine.request import FinishReason, SeqStatus
from pdserve.engine.spec.draft import _ALONE, DraftModel, _copy

HEADS = {"eagle": "EagleDraft", "eagle3": "Eagle3Draft", "mtp": "MtpDraft"}
# a speculators-format config's own keys beside its transformer_layer_config
SPECULATORS_KEYS = (
    "draft_vocab_size",
    "norm_before_residual",
    "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids",
)
# a sequence's guesses stop after one its head gave less than this share of its probability
# (EAGLE-2's lesson: a head knows when it is unsure; a step of the head costs what a guess
# checked in vain does)
CONTINUE_AT = 0.5


def load_head_config(config: EngineConfig, target: ModelConfig, target_dir: str):
    """(the head's directory, its ModelConfig) for an "eagle"/"eagle3"/"mtp"
    speculative_config, checked against the target and the engine; ValueError says what does
    not fit."""

    from pdserve.engine.loader import resolve_model

    spec = config.speculative_config
    method = spec.method
    _check_engine(config, target, method)
    if method == "mtp":
        return target_dir, mtp_head_config(target, target_dir)
    head_dir = str(resolve_model(spec.model))
    hf = head_hf_config(head_dir)
    mc = ModelConfig.from_hf(hf)
    if mc.vocab_size != target.vocab_size:
        raise ValueError(
            f"the EAGLE head's vocabulary ({mc.vocab_size} tokens) differs from the target's "
            f"({target.vocab_size}): a head is trained for one target"
        )
    target_h = int(getattr(hf, "target_hidden_size", None) or mc.hidden_size)
    if target_h != target.hidden_size or (method == "eagle" and mc.hidden_size != target_h):
        raise ValueError(
            f"the EAGLE head reads hidden states of {target_h} values, the target's have "
            f"{target.hidden_size}: a head is trained for one target"
        )
    # the head runs wherever the target does: its positions are the target's
    mc = dataclasses.replace(
        mc, architecture=HEADS[method], max_position_embeddings=config.max_model_len
    )
    return head_dir, mc


def _check_engine(config: EngineConfig, target: ModelConfig, method: str) -> None:
    """Refuses what a head does not run with yet: stages, devices, every layer sliding."""
    if config.pipeline_parallel_size > 1:
        raise ValueError(
            f"speculative_config method {method!r} runs in one pipeline stage "
            "(pipeline_parallel_size 1); use method 'ngram' with pipeline parallelism"
        )
    if config.device != "cpu":
        raise ValueError(
            f"speculative_config method {method!r} has run on CPUs only so far; use 'ngram' or "
            "'draft_model' on a GPU"
        )
    if target.kv_window is not None:
        raise ValueError(
            f"speculative_config method {method!r} needs a target whose layers do not all slide"
        )


def mtp_head_config(target: ModelConfig, target_dir: str) -> ModelConfig:
    """The ModelConfig of the target's first MTP layer as a one-layer head (its hf_config a
    copy of the target's naming the target's architecture; one full-attention layer, whatever
    the target's layers are); ValueError where the target's family has none here or its
    checkpoint carries none."""
    from pdserve.engine.loader.safetensors_io import checkpoint_names
    from pdserve.engine.models.mtp import TARGET_ARCHITECTURE, mtp_layout

    arch, hf = target.architecture, target.hf_config
    layout = mtp_layout(arch, hf)
    if layout is None:
        raise ValueError(
            f"speculative_config method 'mtp' is not available for {arch} yet (DeepSeek V3/R1, "
            "GLM-4.5/4.6, GLM-4.7 Flash, Qwen3-Next and Qwen3.5 so far); use 'ngram'"
        )
    fc = layout.prefix + next(k for k, v in layout.own.items() if v == "eh_proj.weight")
    try:
        present = fc in checkpoint_names(target_dir)
    except FileNotFoundError:  # (a GGUF: its converters leave the MTP layers out)
        present = False
    if not present:
        raise ValueError(
            f"speculative_config method 'mtp': this {arch} checkpoint carries no MTP layer "
            f"({fc} absent); use 'ngram'"
        )
    head_hf = copy.deepcopy(hf)
    setattr(head_hf, TARGET_ARCHITECTURE, arch)
    return dataclasses.replace(
        target,
        architecture=HEADS["mtp"],
        num_layers=1,
        hf_config=head_hf,
        recurrent_layers=(),
        mlp_only_layers=(),
        recurrent_attends=False,
        multimodal_config=None,
        text_only_of=None,
    )


def head_hf_config(head_dir: str):
    """The head's config as a Llama config (the class is chosen by the method): SafeAILab's and
    SGLang's format as it is, vLLM's speculators format (RedHatAI's heads: the layer's config
    under transformer_layer_config, the head's own keys beside it) lifted into one."""
    from transformers import AutoConfig

    with open(Path(head_dir) / "config.json") as f:
        raw = json.load(f)
    layer = raw.get("transformer_layer_config")
    if isinstance(layer, dict):
        if raw.get("norm_before_fc"):
            raise ValueError(
                "this EAGLE-3 head normalizes the target's states before its fc "
                "(norm_before_fc), which is not supported yet"
            )
        hf = AutoConfig.for_model(**{"model_type": "llama", **layer})
        for key in SPECULATORS_KEYS:
            if raw.get(key) is not None:
                setattr(hf, key, raw[key])
    else:
        hf = AutoConfig.from_pretrained(head_dir)
    hf.architectures = ["LlamaForCausalLM"]  # (read as Llama's)
    return hf


def check_target(model, method: str) -> None:
    """Refuses a target family whose layers' inputs or embedding an EAGLE head cannot read here
    (the Llama-shaped families: Llama, Qwen2/3, Mistral, their mixtures of experts, ...)."""
    from pdserve.engine.models.llama import LlamaModel
    from pdserve.engine.models.moe import MoeModel

    inner = getattr(model, "model", None)
    ok = (
        type(inner).forward in (LlamaModel.forward, MoeModel.forward)
        and getattr(inner, "embedding_multiplier", None) is None
        and getattr(inner, "embed_tokens", None) is not None
    )
    if not ok:
        raise ValueError(
            f"speculative_config method {method!r} is not available for "
            f"{type(model).__name__} yet (the Llama-shaped families only); use 'ngram'"
        )


def target_vocab(engine) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The target's whole embedding and LM head weights, read from its checkpoint, where its
    model holds them sharded across TP ranks (a head runs on the first rank alone); None on one
    rank, where the head shares the target's own."""
    if engine.config.tensor_parallel_size == 1:
        return None
    from pdserve.engine.loader import checkpoint_weights

    names = ("model.embed_tokens.weight", "lm_head.weight")
    try:
        found = dict(checkpoint_weights(engine.weights_dir, lambda n: n in names))
    except FileNotFoundError:
        found = {}
    if names[0] not in found:
        raise ValueError(
            f"speculative_config method {engine.config.speculative_config.method!r} with "
            "tensor_parallel_size > 1 reads the target's embedding from its safetensors "
            f"checkpoint ({names[0]}), which this one lacks; use tensor_parallel_size 1"
        )
    return found[names[0]], found.get(names[1], found[names[0]])  # (tied: the embedding)


class EagleDrafter(DraftModel):
    """The head's runner and the per-sequence output it guesses from (see the module
    docstring). Built by the Speculator of an engine whose target has started."""

    def __init__(self, engine):
        spec = engine.config.speculative_config
        check_target(engine.runner.model, spec.method)
        # the head's linears in the target's mode (engine/models/eagle.py LINEARS_MODE): a step
        # of the head reads its weights for a row or two, so it costs what their bytes do
        mc = engine.draft_model_config
        setattr(mc.hf_config, LINEARS_MODE, engine.config.quantization)
        super().__init__(engine.config, engine.draft_dir, mc, engine.runner.num_blocks)
        self.head = self.runner.model
        self.head.attach(engine.runner.model, target_vocab(engine))
        self.method = spec.method
        if spec.method == "eagle3":
            from pdserve.engine.models.eagle import aux_layers

            hf = engine.draft_model_config.hf_config
            engine.runner.expose = aux_layers(hf, engine.model_config.num_layers)
        else:
            engine.runner.expose = ()  # the target's final hidden states (EAGLE-1's, MTP's)
        self.runner.expose = ()  # the head's pre-norm output

    def catch_up(self, seq) -> int:
        """(The head catches up after every step, so a sequence never waits for it.)"""
        return 0

    def layout_spec(self) -> dict:
        """The head's KV layout (kvtransfer.KVLayout's fields): what a hand-off's "draft" chunks
        carry and both sides' heads must agree on."""
        mc = self.runner.model_config
        return dict(
            model=f"{self.method}:{Path(self.config.model).name}",
            dtype=str(self.runner.kv_dtype).removeprefix("torch."),
            num_layers=1,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=self.config.block_size,
        )

    def absorb(self, plan, inp, out) -> list[tuple]:
        """The head over the positions the executed and applied step computed and kept (see the
        module docstring); keeps each running sequence's last output. Returns (sequence, its
        blocks, start, end) of what it ran: a prefill-only request's KV sink sends it on."""
        if out.hidden is None:
            return []
        inputs, ran = [], []
        for item, given, rows in zip(plan.scheduled, inp.seqs, out.hidden):
            seq = item.seq
            seq.draft_kept = None
            if seq.status != SeqStatus.RUNNING and seq.finish_reason != FinishReason.PREFILL_DONE:
                continue
            # positions [item.start, end) have the target's states: a check's kept guesses and
            # the token it sampled after them, or all of a chunk's
            end = item.start + (1 + item.accepted if item.num_spec else item.num_new_tokens)
            n = end - item.start
            if rows.shape[0] < n or len(seq.token_ids) <= end:
                continue
            self.prefill_tokens += max(0, min(end, seq.num_prompt_tokens) - item.start)
            inputs.append(
                SeqInput(
                    seq.token_ids[item.start + 1 : end + 1],
                    item.start,
                    given.block_ids,  # (a finished prefill's: its blocks are back in the pool)
                    False,
                    hidden=self.head.combine(rows[:n]),
                )
            )
            ran.append((seq, given.block_ids, item.start, end))
        if not inputs:
            return []
        with tp_scope(_ALONE):  # (a fork's copied last block: the head's part of it too)
            states = self.runner.execute(ModelInput(inputs, list(inp.block_copies))).hidden
        for (seq, *_), h in zip(ran, states):
            if seq.status == SeqStatus.RUNNING:
                seq.draft_kept = (seq.num_tokens, h[-1].clone())
        return ran

    def clear(self, block_ids: list[int], first: int) -> None:
        """Zeroes the head's KV in blocks block_ids[first:]: a hand-off whose prompt brought none
        (its prefill worker runs no head, or its transport carries no "draft" chunks), so that
        the head attends to nothing there rather than to what the blocks held before."""
        if first < len(block_ids):
            ids = torch.tensor(block_ids[first:], dtype=torch.long)
            self.runner.kv_cache[:, :, ids.to(self.runner.kv_cache.device)] = 0

    def propose(self, items, eos_token_ids, costs) -> None:
        """Fills each scheduled item's spec_token_ids with up to item.num_spec guesses: none for
        a sequence with no kept output, and no more after a guess the head itself gave less
        than CONTINUE_AT of its probability (item.drop_guesses); `costs` learns each step's
        time."""
        ready = []
        for item in items:
            kept = item.seq.draft_kept
            item.spec_token_ids.clear()
            if kept is None or kept[0] != item.seq.num_tokens:
                item.drop_guesses(0)
                continue
            ready.append((item, kept[1]))
        gens = {id(item): _copy(item.seq.generator) for item, _ in ready}
        made, t0 = 0, time.perf_counter()
        while ready:
            with tp_scope(_ALONE):  # (the head's own LM head: whole on this rank)
                logits = self.head.compute_logits(torch.stack([h for _, h in ready])).float()
            rows = [self._row(i.seq, i, gens[id(i)], eos_token_ids) for i, _ in ready]
            tokens = self.runner.sampler(logits, rows, None).token_ids
            sure = logits.softmax(-1)[torch.arange(len(tokens)), torch.tensor(tokens)].tolist()
            # (a step as the gate counts it: the first guess's sampling, then each further
            # guess's head step and sampling)
            costs.observe(len(rows), time.perf_counter() - t0)
            t0 = time.perf_counter()
            made += 1
            more = []
            for (item, h), token, p in zip(ready, tokens, sure):
                item.spec_token_ids.append(token)
                if item.num_spec > made and p < CONTINUE_AT:
                    item.drop_guesses(made)
                if item.num_spec > made:
                    more.append((item, h))
            ready = []
            if more:  # the next guess: one row a step, fed the head's own output
                inputs = [
                    SeqInput(
                        [i.spec_token_ids[-1]],
                        i.seq.num_tokens - 2 + made,
                        i.seq.block_ids,
                        False,
                        hidden=h[None],
                    )
                    for i, h in more
                ]
                with tp_scope(_ALONE):
                    out = self.runner.execute(ModelInput(inputs, []))
                ready = [(i, h[-1]) for (i, _), h in zip(more, out.hidden)]
