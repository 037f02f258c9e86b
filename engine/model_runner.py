"""Executes a step plan on one tensor-parallel rank: build inputs, run the model, sample (rank 0)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pdserve.engine.attention import decode_kernel
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs, applies_to as graphs_apply
from pdserve.engine.forward_context import AttentionMetadata, PrefillSpan, forward_context
from pdserve.engine.kv_dtype import auto_kv_dtype_applies, choose_kv_dtype
from pdserve.engine.kv_window import max_blocks_held
from pdserve.engine.layers.rotary import RotaryEmbedding, rope_inv_freq
from pdserve.engine.loader import iter_safetensors
from pdserve.engine.models import model_class
from pdserve.engine.parallel import all_reduce, divide, tp_rank, tp_size
from pdserve.engine.sampler import Sampler, SamplingRow
from pdserve.kvpool import create_pool_file

PROMPT_LOGITS_ROWS = 512  # prompt positions whose vocabulary-wide logits are held at once


@dataclass
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


@dataclass
class ModelInput:
    seqs: list[SeqInput]
    block_copies: list[tuple[int, int]]


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
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype
        self.block_size = config.block_size
        divide(model_config.num_heads, tp_size(), "the attention heads")
        self.num_kv_heads = divide(model_config.num_kv_heads, tp_size(), "the key/value heads")
        inv_freq, attn_factor = rope_inv_freq(
            model_config.hf_config,
            model_config.rope_type,
            model_config.rope_theta,
            model_config.head_dim,
        )
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                rotary = RotaryEmbedding(
                    inv_freq.to(self.device), attn_factor, config.max_model_len
                )
                self.model = model_class(model_config.architecture)(model_config, rotary)
        finally:
            torch.set_default_dtype(default_dtype)
        self._load_weights(model_dir)
        self.model.eval()
        # with decode graphs, one block more than the scheduler is told of: padded rows write there
        use_graphs = graphs_apply(self.device, tp_size(), config.cuda_graphs)
        self._spare_blocks = 1 if use_graphs else 0
        # A model whose every layer slides puts this block, kept out of the pool and never
        # written by a sequence, in the table entries of blocks its window has left (kv_window.py).
        window = model_config.kv_window
        self._spare_blocks += window is not None
        self.kv_cache = self._allocate_kv_cache()
        self.null_block = self.kv_cache.shape[2] - 1 if window is not None else None
        self.sampler = Sampler() if tp_rank() == 0 else None
        self.graphs: DecodeGraphs | None = None  # (the weight probes below run eagerly)
        # the quantization the linears run in (None: config.dtype), and why
        self.quantization, self.mode_note = self._prepare_weights(model_dir)
        self.graphs = (
            DecodeGraphs(self, config.max_num_seqs, spare_block=self.num_blocks)
            if use_graphs
            else None
        )

    def _load_weights(self, model_dir: str) -> None:
        if self.config.load_format == "dummy":
            dummy_weights(self.model, self.config.seed)
        else:
            self.model.load_weights(iter_safetensors(model_dir))

    def _prepare_weights(self, model_dir: str) -> tuple[str | None, str]:
        wanted = self.config.quantization
        if wanted is None:
            self.model.prepare_linears(None)
            return None, f"quantization=none ({self.config.dtype}), as configured"
        from pdserve.engine.quality import PROBE_TOKENS, probe_ids
        from pdserve.engine.tokenizer import load_tokenizer

        # calibration text and probe text: disjoint stretches of the same corpus
        length = min(PROBE_TOKENS, self.config.max_model_len, self.num_blocks * self.block_size)
        ids = probe_ids(load_tokenizer(model_dir), length, skip=length) if length >= 64 else []
        calibration, probe = ids[:length], ids[length:]
        self.model.prepare_linears(None, release_dense=False)
        if calibration:
            self._calibrate(calibration)
        if wanted != "auto":
            self.model.prepare_linears(wanted)
            return wanted, f"quantization={wanted} ({self.config.dtype}), as configured"
        return self._choose_quantization(probe, length)

    def _calibrate(self, ids: list[int]) -> None:
        """Records, for every linear, the largest |input| per channel over `ids` (int8 smooths
        its activations by it; see engine/layers/quant.py)."""
        from pdserve.engine.layers.linear import LinearBase

        def record(module, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(dim=0).float()
            seen = module.act_absmax
            module.act_absmax = x if seen is None else torch.maximum(seen, x)

        hooks = [
            m.register_forward_hook(record)
            for m in self.model.modules()
            if isinstance(m, LinearBase)
        ]
        try:
            self._probe_perplexity(ids)
        finally:
            for h in hooks:
                h.remove()

    def _choose_quantization(self, ids: list[int], length: int) -> tuple[str | None, str]:
        """quantization="auto": score a probe text in float32, then with each mode in order of
        speed on this CPU, and keep the first whose perplexity is within its bound. Every rank
        runs the same probes (their collectives pair up); rank 0 judges and tells the rest."""
        from pdserve.engine.layers.quant import auto_candidates
        from pdserve.engine.quality import QUALITY_BOUNDS, informative

        note = ""
        chosen: str | None = None
        judged: float | None = None  # float32's probe perplexity where it can judge a mode
        if not ids:
            note = (
                f"float32: no probe text (the probe needs 64 tokens of English; max_model_len "
                f"and the KV cache allow {length}, or the tokenizer cannot spell it)"
            )
        else:
            base = self._probe_perplexity(ids)
            if not self._agree(
                base is not None and informative(base, self.model_config.vocab_size)
            ):
                note = (
                    f"float32: the model does not predict the probe text (perplexity "
                    f"{base if base is not None else float('nan'):.1f}), so no mode's quality "
                    "can be judged"
                )
            judged = None if note else base
            for mode in auto_candidates() if not note else ():
                self.model.prepare_linears(mode, release_dense=False)
                ppl = self._probe_perplexity(ids)
                ok = ppl is not None and ppl <= base * (1 + QUALITY_BOUNDS[mode])
                if tp_rank() == 0:
                    note += (
                        f"{mode}: probe perplexity {ppl:.3f} vs float32 {base:.3f} "
                        f"({ppl / base - 1:+.2%}, bound +{QUALITY_BOUNDS[mode]:.0%}); "
                    )
                if self._agree(ok):
                    chosen = mode
                    break
            # (only rank 0 words the probes; the others know the verdict)
            note = note.rstrip("; ") or (
                "float32: no quantization mode passed" if chosen is None else ""
            )
        self.model.prepare_linears(chosen)  # the final mode, and the dense weights released
        note = f"quantization=auto chose {chosen or 'none'} ({self.config.dtype}): {note}"
        if auto_kv_dtype_applies(self.config):  # the KV cache's dtype by the same probe
            note += "; " + choose_kv_dtype(self, ids, judged, chosen)
        return chosen, note

    @staticmethod
    def _agree(flag_on_rank0: bool) -> bool:
        """Rank 0's verdict, on every rank."""
        if tp_size() == 1:
            return bool(flag_on_rank0)
        t = torch.tensor([1.0 if (flag_on_rank0 and tp_rank() == 0) else 0.0])
        return bool(all_reduce(t).item() > 0)

    def _probe_perplexity(self, ids: list[int]) -> float | None:
        """The perplexity of `ids` on rank 0 (None on the others), through the KV cache's first
        blocks (no request holds any yet)."""
        from pdserve.engine.quality import perplexity

        seq = SeqInput(
            token_ids=ids,
            start=0,
            block_ids=list(range(-(-len(ids) // self.block_size))),
            samples=False,
            prompt_targets=ids[1:],
        )
        _, _, rows = self.execute(ModelInput([seq], []), rows=[] if tp_rank() == 0 else None)
        return perplexity(rows[0], ids) if tp_rank() == 0 else None

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """Reallocates the KV cache in `dtype` (engine/kv_dtype.py chooses it, before any request
        holds a block): the old cache is released first, so the memory is never held twice, and
        the blocks follow kv_cache_memory in bytes."""
        self.kv_cache = None
        self.kv_dtype = dtype
        self.kv_cache = self._allocate_kv_cache()
        if self.null_block is not None:
            self.null_block = self.kv_cache.shape[2] - 1

    @property
    def num_blocks(self) -> int:
        """The blocks requests may hold (a spare block for padded graph rows is not counted)."""
        return self.kv_cache.shape[2] - self._spare_blocks

    def _allocate_kv_cache(self) -> torch.Tensor:
        mc = self.model_config
        per_block = (
            2
            * mc.num_layers
            * self.block_size
            * self.num_kv_heads
            * mc.head_dim
            * self.kv_dtype.itemsize
        )
        num_blocks = self.config.kv_cache_memory // per_block - self._spare_blocks
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
        shape = (
            mc.num_layers,
            2,
            num_blocks + self._spare_blocks,
            self.block_size,
            self.num_kv_heads,
            mc.head_dim,
        )
        if self.kv_cache_path is not None:
            return create_pool_file(self.kv_cache_path, shape, self.kv_dtype)
        # zeros, not empty: masked-out slots are still multiplied by 0, and NaN * 0 is NaN
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    # ---- one step -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        inp: ModelInput,
        rows: list[SamplingRow] | None = None,
        row_logits: list[int] | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ):
        """Runs the model; on rank 0 with rows given, returns (token_ids, logprobs or None)."""
        for src, dst in inp.block_copies:
            self.kv_cache[:, :, dst].copy_(self.kv_cache[:, :, src])
        if not inp.seqs:
            return [], None, {}
        key = self._graph_key(inp, on_layer_done)
        if key is not None:  # a decode-only step, replayed from its CUDA graph
            logits = self.graphs.run(inp.seqs, key)
            if rows is None:
                return [], None, {}
            if row_logits != list(range(logits.shape[0])):
                logits = logits[row_logits]
            out = self.sampler(logits.float(), rows)
            return out.token_ids, out.logprobs, {}
        meta, input_ids, positions, last_idx, q_starts = self._prepare(inp)
        meta.on_layer_done = on_layer_done
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        prompt_lps = self._prompt_logprobs(inp, hidden, q_starts, rank0=rows is not None)
        n = last_idx.numel()
        # a decode-only step samples every row in order: no copies of hidden states or logits
        every_row = n == hidden.shape[0] and meta.num_decode_tokens == n
        last = hidden if every_row else hidden[last_idx]
        logits = self.model.compute_logits(last) if n else None
        if logits is None or rows is None:
            return [], None, prompt_lps
        if row_logits != list(range(logits.shape[0])):
            logits = logits[row_logits]
        out = self.sampler(logits.float(), rows)
        return out.token_ids, out.logprobs, prompt_lps

    def _graph_key(self, inp: ModelInput, on_layer_done) -> tuple[int, int] | None:
        """The decode graph bucket for this step, or None to run it eagerly: graphs take steps
        in which every sequence decodes one token, samples it and wants no prompt logprobs, and
        no layer hook waits (a prefill pushing its KV layer by layer)."""
        if self.graphs is None or on_layer_done is not None:
            return None
        for s in inp.seqs:
            if len(s.token_ids) != 1 or not s.samples or s.prompt_targets:
                return None
        return self.graphs.shape_for(inp.seqs)

    def _prompt_logprobs(
        self, inp: ModelInput, hidden: torch.Tensor, q_starts: dict[int, int], rank0: bool
    ) -> dict[int, list[dict[int, float]]]:
        """seq index -> for each position with a prompt target, {token id: logprob} of the target
        and the seq's prompt_topk most likely tokens. Every rank computes the logits (the LM head
        may gather across ranks); rank 0 keeps the numbers. At most PROMPT_LOGITS_ROWS rows of
        vocabulary-wide logits exist at a time."""
        out: dict[int, list[dict[int, float]]] = {}
        for i, s in enumerate(inp.seqs):
            n, k = len(s.prompt_targets), s.prompt_topk
            rows: list[dict[int, float]] = []
            for a in range(0, n, PROMPT_LOGITS_ROWS):
                b = min(n, a + PROMPT_LOGITS_ROWS)
                logits = self.model.compute_logits(hidden[q_starts[i] + a : q_starts[i] + b])
                if logits is None or not rank0:
                    continue
                lp = torch.log_softmax(logits.float(), dim=-1)
                targets = torch.tensor(s.prompt_targets[a:b], dtype=torch.long, device=lp.device)
                picked = lp.gather(1, targets[:, None])[:, 0].tolist()
                top = lp.topk(k, dim=-1) if k else None
                for r, (t, v) in enumerate(zip(s.prompt_targets[a:b], picked)):
                    entry = (
                        dict(zip(top.indices[r].tolist(), top.values[r].tolist()))
                        if top is not None
                        else {}
                    )
                    entry[t] = v
                    rows.append(entry)
            if rows:
                out[i] = rows
        return out

    def _prepare(self, inp: ModelInput):
        bs = self.block_size
        # Where the compiled kernel attends, every token is a row of it, prompt chunks included: a
        # row's result then depends on its position and context only, not on how its prompt was
        # cut into chunks or what else ran in the step (an SDPA call's shape changes its last
        # bits, and int8's per-row activation scaling turns those into whole quantization steps)
        kernel = decode_kernel(self.device, self.dtype, self.model_config.head_dim, self.kv_dtype)
        rows_all = kernel is not None
        # decodes (one new token, or guesses checked after a context: one decode row per token)
        # first, so attention can batch them with a single gather
        order = sorted(range(len(inp.seqs)), key=lambda i: not _decodes(inp.seqs[i]))
        ids, pos, slots, last_idx = [], [], [], []
        row_seqs, prefills = [], []  # (first position, rows, blocks) per sequence run as rows
        q_starts = {}
        for i in order:
            s = inp.seqs[i]
            n = len(s.token_ids)
            q_start = q_starts[i] = len(ids)
            ids += s.token_ids
            positions = range(s.start, s.start + n)
            pos += positions
            slots += [s.block_ids[p // bs] * bs + p % bs for p in positions]
            context_len = s.start + n
            num_blocks = -(-context_len // bs)
            if rows_all or _decodes(s):  # row j sees the context and the tokens up to its own
                row_seqs.append((s.start, n, s.block_ids[:num_blocks]))
            else:
                mask = None
                if s.start > 0:
                    q_pos = torch.arange(s.start, context_len).unsqueeze(1)
                    mask = torch.arange(context_len).unsqueeze(0) <= q_pos
                prefills.append(
                    PrefillSpan(
                        q_start, n, context_len, torch.tensor(s.block_ids[:num_blocks]), mask
                    )
                )
            if s.samples:
                last_idx += [(i, q_start + n - s.num_logits + j) for j in range(s.num_logits)]
        dev = self.device
        num_rows = sum(n for _, n, _ in row_seqs)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            num_decode_tokens=num_rows,
            kv_cache=self.kv_cache,
        )
        if row_seqs:
            # a sequence's rows share its block list; each reads only as far as its own length
            width = max(len(b) for _, _, b in row_seqs)
            table = torch.zeros(num_rows, width, dtype=torch.long)
            lens = torch.empty(num_rows, dtype=torch.long)
            r = 0
            for start, n, blocks in row_seqs:
                table[r : r + n, : len(blocks)] = torch.tensor(blocks)
                torch.arange(start + 1, start + n + 1, out=lens[r : r + n])
                r += n
            meta.decode_block_tables = table.to(dev)
            meta.decode_context_lens = lens.to(dev)
            if not rows_all:
                meta.decode_mask = (torch.arange(width * bs)[None, :] < lens[:, None])[
                    :, None, None, :
                ].to(dev)
        for span in prefills:
            span.block_ids = span.block_ids.to(dev)
            if span.causal_mask is not None:
                span.causal_mask = span.causal_mask.to(dev)
        meta.prefills = prefills
        # logits rows in the order of the scheduled seqs that sample (the plan's row_logits index)
        last_idx.sort()
        sample_rows = torch.tensor([t for _, t in last_idx], dtype=torch.long, device=dev)
        return (
            meta,
            torch.tensor(ids, device=dev),
            torch.tensor(pos, device=dev),
            sample_rows,
            q_starts,
        )


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
