"""Tiny random EAGLE heads for a tiny target, and what such a head guesses computed with plain
torch (tests/unit/test_eagle.py): written from the heads' definitions (SafeAILab's EAGLE and
EAGLE-3, as vLLM and SGLang load them), sharing no code with engine/models/eagle.py."""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from helpers.engine import CopySink
from pdserve.engine.spec.eagle import EagleDrafter

HEADS, KV_HEADS, FFN = 4, 2, 96


def make_head(
    path,
    target,
    method: str,
    *,
    draft_vocab: int | None = None,
    seed: int = 1,
    speculators: bool = False,
    aux: tuple[int, ...] | None = None,
):
    """Saves a random one-layer head for the HF model `target` to `path` (config.json and
    model.safetensors in the checkpoints' names: SafeAILab's and SGLang's, or with
    `speculators` vLLM's speculators format, RedHatAI's, whose layer normalizes h before its
    residual); `aux`: the target layers it names (eagle_aux_hidden_state_layer_ids; None: none
    named, the defaults). Returns its tensors by name (and "norm_before_residual" and "aux", not
    saved)."""
    cfg = target.config
    h, v = cfg.hidden_size, cfg.vocab_size
    d = h // HEADS
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.3):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    qkv_in = 2 * h if method == "eagle3" else h
    prefix = "midlayer." if method == "eagle3" and not speculators else "layers.0."
    t = {
        prefix + "self_attn.q_proj.weight": rand(HEADS * d, qkv_in),
        prefix + "self_attn.k_proj.weight": rand(KV_HEADS * d, qkv_in),
        prefix + "self_attn.v_proj.weight": rand(KV_HEADS * d, qkv_in),
        prefix + "self_attn.o_proj.weight": rand(h, HEADS * d),
        prefix + "mlp.gate_proj.weight": rand(FFN, h),
        prefix + "mlp.up_proj.weight": rand(FFN, h),
        prefix + "mlp.down_proj.weight": rand(h, FFN),
        prefix + "post_attention_layernorm.weight": 1 + rand(h, scale=0.1),
    }
    config = {
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": v,
        "max_position_embeddings": 64,  # (shorter than the target's: the head runs past it)
        "rope_theta": 10000.0,
    }
    if method == "eagle3":
        dv = draft_vocab or v
        t["fc.weight"] = rand(h, 3 * h, scale=0.1)
        t[prefix + "input_layernorm.weight"] = 1 + rand(h, scale=0.1)
        t[prefix + "hidden_norm.weight"] = 1 + rand(h, scale=0.1)
        t["norm.weight"] = 1 + rand(h, scale=0.1)
        t["lm_head.weight"] = rand(dv, h)
        config.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=dv)
        if aux is not None:
            config["eagle_aux_hidden_state_layer_ids"] = list(aux)
        if dv < v:  # every other target id in the draft vocabulary, as a pruned one would be
            ids = torch.arange(dv) * (v // dv)
            t["d2t"] = ids - torch.arange(dv)
            t["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, ids, True)
    else:
        t["fc.weight"] = rand(h, 2 * h, scale=0.1)
        t["fc.bias"] = rand(h, scale=0.1)
        config.update(architectures=["LlamaForCausalLM"], bias=True)
    if speculators:
        layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size")}
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": config["draft_vocab_size"],
            "norm_before_residual": True,
            "target_hidden_size": None,
            "speculators_config": {"algorithm": "eagle3"},
        }
    os.makedirs(path, exist_ok=True)
    save_file(t, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if speculators:  # (the reference reads the layer's tensors under one name)
        t = {k.replace("layers.0.", "midlayer."): v for k, v in t.items()}
    default = (2, cfg.num_hidden_layers // 2, cfg.num_hidden_layers - 3)
    return {**t, "norm_before_residual": speculators, "aux": aux or default}


def _norm(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """Llama's rotary embedding (halves rotated) of [tokens, heads, dim]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions[:, None].double() * inv[None]
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()[:, None]
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()[:, None]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-b, a], -1) * sin


def _layer(t, prefix, x, residual, positions, zeroed=0):
    """Attention over all rows of x (causal; the first `zeroed` rows' keys and values zeros, as
    a cleared cache holds), then the MLP; the pre-norm sum."""
    n, h = residual.shape
    d = h // HEADS
    q = (x @ t[prefix + "self_attn.q_proj.weight"].T).view(n, HEADS, d)
    k = (x @ t[prefix + "self_attn.k_proj.weight"].T).view(n, KV_HEADS, d)
    v = (x @ t[prefix + "self_attn.v_proj.weight"].T).view(n, KV_HEADS, d)
    q, k = _rope(q, positions), _rope(k, positions)
    k[:zeroed], v[:zeroed] = 0, 0
    k = k.repeat_interleave(HEADS // KV_HEADS, 1)
    v = v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, -1)
    residual = o @ t[prefix + "self_attn.o_proj.weight"].T + residual
    y = _norm(residual, t[prefix + "post_attention_layernorm.weight"])
    gate = y @ t[prefix + "mlp.gate_proj.weight"].T
    up = y @ t[prefix + "mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[prefix + "mlp.down_proj.weight"].T + residual


def target_states(target, tokens: list[int], method: str, aux) -> torch.Tensor:
    """The target's states an EAGLE head reads at each position: the final normed hidden state
    (EAGLE-1, MTP), or the inputs of layers `aux` side by side in the order the layers run (EAGLE-3,
    as vLLM collects them)."""
    with torch.no_grad():
        out = target(torch.tensor([tokens]), output_hidden_states=True)
    states = out.hidden_states  # [0]: the embeddings; [i]: layer i's input; [-1]: normed output
    if method in ("eagle", "mtp"):
        return states[-1][0]
    return torch.cat([states[i][0] for i in sorted(aux)], -1)


def combine(t, method: str, states: torch.Tensor) -> torch.Tensor:
    """The target's states as the head's input rows (EAGLE-3's fc)."""
    return states @ t["fc.weight"].T if method == "eagle3" else states


def head_logits(t, target, method: str, x0: torch.Tensor, inputs: list[int], zeroed: int = 0):
    """The head's logits (over the target's vocabulary) at each of its positions 0..n-1, where
    position p reads token inputs[p] and input row x0[p] ([n, hidden]: `combine`d target states,
    or the head's own pre-norm output); and its pre-norm outputs. zeroed: the positions whose
    KV the head finds cleared (their own outputs are then of no use)."""
    if method == "mtp":  # (tests/helpers/mtp.py: transformers' layer of the target's family)
        return t["step"](x0, inputs, zeroed)
    emb = target.get_input_embeddings().weight.detach()
    positions = torch.arange(len(inputs))
    e = emb[torch.tensor(inputs)]
    if method == "eagle3":
        en = _norm(e, t["midlayer.input_layernorm.weight"])
        hn = _norm(x0, t["midlayer.hidden_norm.weight"])
        residual = hn if t["norm_before_residual"] else x0
        out = _layer(t, "midlayer.", torch.cat([en, hn], -1), residual, positions, zeroed)
        logits = _norm(out, t["norm.weight"]) @ t["lm_head.weight"].T
        if "d2t" in t:
            full = torch.full((len(inputs), emb.shape[0]), float("-inf"))
            full[:, torch.arange(logits.shape[1]) + t["d2t"]] = logits
            logits = full
        return logits, out
    x = torch.cat([e, x0], -1) @ t["fc.weight"].T + t["fc.bias"]
    out = _layer(t, "layers.0.", x, x, positions, zeroed)
    return out @ target.lm_head.weight.detach().T, out


def check_guesses(records, hf, method, tensors, zeroed=False) -> None:
    """Each recorded guess is the head's most likely token (tests/helpers/eagle.py) given the
    target's states before it (zeroed: a hand-off's prompt positions cleared instead)."""
    gaps = []
    for prompt_len, tokens, guesses in records[::3]:
        n = len(tokens)
        states = target_states(hf, tokens[: n - 1], method, tensors["aux"])
        x0 = combine(tensors, method, states)
        inputs = tokens[1:]
        for guess in guesses:
            z = prompt_len if zeroed else 0
            logits, out = head_logits(tensors, hf, method, x0, inputs, z)
            last = logits[-1]
            spread = float(last[torch.isfinite(last)].std())
            gaps.append(float(last.max() - last[guess]) / spread)
            x0, inputs = torch.cat([x0, out[-1:]]), inputs + [guess]
    # (gaps in units of the logits' spread: the head's KV is bfloat16 on a CPU, so near-ties
    # may go either way, nothing more; a wrong input or weight moves logits by whole spreads)
    assert gaps and max(gaps) < 0.05 and gaps.count(0.0) >= 0.9 * len(gaps), gaps


def recording(monkeypatch) -> list:
    """(prompt length, tokens, guesses) of every EagleDrafter.propose from now on."""
    records = []
    propose = EagleDrafter.propose

    def recording(self, items, eos, costs):
        propose(self, items, eos, costs)
        records.extend(
            (i.seq.num_prompt_tokens, list(i.seq.token_ids), list(i.spec_token_ids)) for i in items
        )

    monkeypatch.setattr(EagleDrafter, "propose", recording)
    return records


class DraftCopySink(CopySink):
    """CopySink, and the head's KV of the prompt into B's head cache (a "draft" chunk's way)."""

    def on_draft(self, head_kv, layout, block_ids, start, end):
        self.calls.append((self.step, "draft", start, end))
        cache = self.b.draft_kv()[0]
        bs_a, bs_b = layout["block_size"], self.res.block_size
        for t in range(max(start, self.res.num_cached_tokens), end):
            row = head_kv[:, block_ids[t // bs_a], t % bs_a]
            cache[0, :, self.res.block_ids[t // bs_b], t % bs_b] = row


def check_head_run(model_dir, hf, spec, tensors, monkeypatch, prompts, **engine) -> None:
    """Greedy tokens of `prompts` with the head of `spec` are the target's alone, the head
    guessed (three in a row somewhere) and ran over the prompts, and every guess is the head's
    (check_guesses)."""
    from helpers.engine import greedy
    from helpers.spec import run_spec

    records = recording(monkeypatch)
    want, _ = run_spec(model_dir, prompts, greedy(24), None, **engine)
    got, stats = run_spec(
        model_dir, prompts, greedy(24), spec, enable_prefix_caching=False, **engine
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0 and stats["spec_draft_prefill_tokens"] > 0
    assert any(len(g) == 3 for _, _, g in records)
    check_guesses(records, hf, spec["method"], tensors)


def check_head_hand_off(model_dir, hf, spec, tensors, monkeypatch, prompts, sent, **engine):
    """Each prompt prefilled by a prefill-only engine A that runs the head of `spec` and
    decoded by engine B after a hand-off copied in-process (the head's prompt KV too where
    `sent`; else B clears those blocks of its head's cache): B's tokens are the target's alone,
    no block is left held, and every guess is the head's (check_guesses)."""
    from helpers.engine import greedy, run_until_done
    from helpers.spec import run_spec
    from helpers.threads import assert_no_leaks
    from pdserve.engine import LLM

    a = LLM(model_dir, speculative_config=spec, max_num_batched_tokens=16, **engine).engine
    b = LLM(model_dir, speculative_config=spec, **{**engine, "block_size": 16}).engine
    b.draft_kv()[0].fill_(3.0)  # (what blocks held before: never to be read as the prompt's)
    records = recording(monkeypatch)
    want, _ = run_spec(model_dir, prompts, greedy(24), None, **engine)
    for i, prompt in enumerate(prompts):
        res = b.reserve(f"r{i}", prompt, greedy(24))
        sink = (DraftCopySink if sent else CopySink)(b, res, hf.config.num_hidden_layers)
        a.add_request(f"r{i}", prompt, greedy(24), prefill_only=True, kv_sink=sink)
        first = run_until_done(a)[-1].outputs[0].token_ids
        if sent:
            drafts = [c for c in sink.calls if c[1] == "draft"]
            assert drafts[0][2] == 0 and drafts[-1][3] == len(prompt)
        b.commit(f"r{i}", first[:1], draft_kv=sent)
        final = [o for o in run_until_done(b) if o.finished]
        assert final[0].outputs[0].token_ids == want[i].token_ids
    assert_no_leaks(a)
    assert_no_leaks(b)
    check_guesses(records, hf, spec["method"], tensors, zeroed=not sent)
