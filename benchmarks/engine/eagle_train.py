"""An EAGLE-3 head for the embedded default (SmolLM2-135M-Instruct), trained on this machine for
benchmarks/engine/eagle.py: no head is published for it, and nothing downloads at run time.

  python -m benchmarks.engine.eagle_train             # ~35 min on 2 cores; the head to the cache
  python -m benchmarks.engine.eagle_train --epochs 1  # shorter, weaker

Steps: (1) prompts: each of TEMPLATES about each of TRAIN_TOPICS, in the chat template (the
benchmark's prompts are about EVAL_TOPICS, which training never sees); (2) the target's greedy
answers, from the engine; (3) the target's states: transformers' model with hidden states out,
the inputs of layers 2, 15 and 27 (EAGLE-3's defaults for 30 layers); (4) a draft vocabulary:
the DRAFT_VOCAB most frequent answer tokens, and d2t from them to the target's ids; (5) the head
(EAGLE-3's one layer, in plain torch below) trained to predict t[p+2] from embed(t[p+1]) and the
states at p, and (EAGLE-3's training-time test, --steps) t[p+3] from embed(t[p+2]) and its own
output at p, as the engine's second guess reads it, over the answers' positions whose token the
draft vocabulary holds (cross-entropy, the second guess's weighted 0.8, AdamW, a cosine
schedule), its LM head started from the target's embedding rows; (6) saved as an
EAGLE-3 checkpoint in the released heads' names (config.json, model.safetensors) under
HEAD_DIR, with the training's figures in train.json beside them.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.bench_common import log, run_header, script_parser

TEMPLATES = (
    "Explain {} to a curious twelve-year-old.",
    "Write a short story about {}.",
    "List five interesting facts about {}, one sentence each.",
    "What are the advantages and disadvantages of {}?",
    "Write a short poem about {}.",
    "Describe a typical day for someone who works with {}.",
    "Give me three tips for learning about {}.",
    "Write a short dialogue between two friends about {}.",
    "Summarize the history of {} in one paragraph.",
    "What would a beginner's guide to {} include?",
    "Compare {} with something similar, in a few sentences.",
    "Write an advertisement inspired by {}.",
    "As a teacher, explain why {} matters.",
    "Describe {} using all five senses.",
)
TRAIN_TOPICS = (
    "the ocean", "volcanoes", "honey bees", "the moon", "trains", "chess", "coffee",
    "rainforests", "the internet", "bicycles", "dinosaurs", "clouds", "pianos", "gardening",
    "the Roman Empire", "electric cars", "penguins", "recycling", "airplanes", "bread baking",
    "mountains", "photography", "friendship", "deserts", "libraries", "robots", "the weather",
    "football", "castles", "solar panels", "whales", "cooking pasta", "the human heart",
    "space travel", "snow", "museums", "ants", "rivers", "video games", "the printing press",
    "elephants", "the stock market", "yoga", "thunderstorms", "bridges", "jazz music", "tigers",
    "vaccines", "the Great Wall of China", "knitting", "satellites", "coral reefs", "bees' wax",
    "the Olympic Games", "wind turbines", "cheese making", "the Amazon river", "birdwatching",
    "skyscrapers", "the French Revolution", "mushrooms", "marathon running", "smartphones",
    "sharks", "pottery", "the solar system", "camping", "wolves", "origami", "hurricanes",
    "the violin's cousin, the cello", "chocolate", "ancient Egypt", "kites", "forests in autumn",
    "a farmers' market", "time zones", "sailing", "butterflies", "the telephone", "rice farming",
    "the Arctic", "magic tricks", "city buses", "frogs", "windmills", "the Renaissance",
    "astronauts", "ice cream", "hiking boots", "raccoons", "the postal service", "lightning",
)  # fmt: skip
EVAL_TOPICS = (
    "lighthouses", "octopuses", "the desert at night", "paper money", "glaciers", "owls",
    "a small bakery", "earthquakes", "the violin", "submarines", "tea ceremonies", "comets",
)  # fmt: skip
AUX_LAYERS = (2, 15, 27)  # EAGLE-3's defaults for 30 layers: 2, L // 2, L - 3
DRAFT_VOCAB = 8192
STEP_WEIGHT = 0.8  # the loss of guess s + 1 weighs STEP_WEIGHT ** s (EAGLE-3's decay)
ANSWER_TOKENS = 256


def head_dir() -> str:
    from pdserve.engine.loader.resolve import default_cache_dir

    return str(default_cache_dir() / "eagle-heads" / "smollm2-135m-instruct-eagle3")


def chat_prompts(tokenizer, topics) -> list[list[int]]:
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t.format(topic)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for topic in topics
        for t in TEMPLATES
    ]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _answers(prompts: list[list[int]]) -> list[list[int]]:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM("smollm2", speculative_config=None)
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _states(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence, the inputs of AUX_LAYERS side by side, [tokens, 3 x hidden], bfloat16."""
    out = []
    with torch.inference_mode():
        for s in seqs:
            h = model(torch.tensor([s]), output_hidden_states=True).hidden_states
            out.append(torch.cat([h[i][0] for i in AUX_LAYERS], -1).bfloat16())
    return out


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class Head(nn.Module):
    """EAGLE-3's one layer (engine/models/eagle.py Eagle3Draft's forward), trainable."""

    def __init__(self, cfg, draft_ids: torch.Tensor, embed: torch.Tensor, final_norm: torch.Tensor):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv, self.d, self.eps = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            d,
            cfg.rms_norm_eps,
        )
        self.theta = cfg.rope_parameters["rope_theta"]
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        for lin in (self.fc, self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            nn.init.normal_(lin.weight, std=0.02)
        for lin in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.norm = nn.Parameter(final_norm.clone())
        self.lm_head = nn.Parameter(embed[draft_ids].clone())

    def _rope(self, x, positions):
        d = self.d
        inv = 1.0 / self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = positions[:, None].float() * inv[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-b, a], -1) * sin

    def steps(self, embeds: torch.Tensor, states: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Logits over the draft vocabulary, [tokens, DRAFT_VOCAB], of each of `steps` guesses
        at every base position p: step 1 reads embeds[p] (t[p+1]) and the target's states at p,
        as the engine's `absorb`; step s > 1 reads embeds[p + s - 1] and step s - 1's pre-norm
        output at p, at position p + s - 1, and attends to step 1's keys up to p and its own
        chain's (steps 2..s at p), as the engine's one-row guess steps do (EAGLE-3's
        training-time test; rows past the end are garbage the loss masks)."""
        n = embeds.shape[0]
        pos = torch.arange(n)
        x = self.fc(states)
        keys, values, out = None, [], []
        chain_k, chain_v = [], []
        for s in range(steps):
            e = embeds[torch.clamp(pos + s, max=n - 1)]
            a = torch.cat(
                [_rms(e, self.input_layernorm, self.eps), _rms(x, self.hidden_norm, self.eps)], -1
            )
            q = self._rope(self.q_proj(a).view(n, self.heads, self.d), pos + s)
            k = self._rope(self.k_proj(a).view(n, self.kv, self.d), pos + s)
            v = self.v_proj(a).view(n, self.kv, self.d)
            rep = self.heads // self.kv
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if s == 0:
                keys, values = k, v
                o = F.scaled_dot_product_attention(
                    q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
                ).transpose(0, 1)
            else:
                chain_k.append(k)
                chain_v.append(v)
                scale = self.d**-0.5
                base = torch.einsum("qhd,khd->hqk", q, keys) * scale
                base = base.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
                own = torch.stack([(q * ck).sum(-1).T * scale for ck in chain_k], -1)  # [h, n, s]
                p = torch.cat([base, own], -1).softmax(-1)
                o = torch.einsum("hqk,khd->qhd", p[..., :n], values)
                for i, cv in enumerate(chain_v):
                    o = o + p[..., n + i].T[..., None] * cv
            residual = self.o_proj(o.reshape(n, -1)) + x
            y = _rms(residual, self.post_attention_layernorm, self.eps)
            x = self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)) + residual
            out.append(_rms(x, self.norm, self.eps) @ self.lm_head.T)
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        """The released EAGLE-3 heads' names."""
        m = "midlayer."
        t = {
            "fc.weight": self.fc.weight,
            m + "self_attn.q_proj.weight": self.q_proj.weight,
            m + "self_attn.k_proj.weight": self.k_proj.weight,
            m + "self_attn.v_proj.weight": self.v_proj.weight,
            m + "self_attn.o_proj.weight": self.o_proj.weight,
            m + "mlp.gate_proj.weight": self.gate_proj.weight,
            m + "mlp.up_proj.weight": self.up_proj.weight,
            m + "mlp.down_proj.weight": self.down_proj.weight,
            m + "input_layernorm.weight": self.input_layernorm,
            m + "hidden_norm.weight": self.hidden_norm,
            m + "post_attention_layernorm.weight": self.post_attention_layernorm,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head,
        }
        return {k: v.detach().contiguous() for k, v in t.items()}


def _examples(seqs, states, prompt_lens, to_draft, steps: int):
    """Per sequence: the head's inputs (tokens t[1:], states at 0..n-2) and per step s its
    targets t[p+1+s] in draft ids, -100 where not trained (the prompt, past the end, tokens
    outside the draft vocabulary)."""
    out = []
    for s, st, plen in zip(seqs, states, prompt_lens):
        t = torch.tensor(s)
        n = len(s) - 2
        targets = []
        for k in range(steps):
            tk = torch.full((n,), -100, dtype=torch.long)
            tk[: n - k] = to_draft[t[2 + k :]]
            tk[: max(0, plen - 2)] = -100
            targets.append(tk)
        out.append((t[1:-1], st[:-2], targets))
    return out


def train(args) -> dict:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.loader import resolve_model

    t0 = time.time()
    model_dir = str(resolve_model("smollm2"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = chat_prompts(tokenizer, TRAIN_TOPICS)
    log(f"answering {len(prompts)} training prompts (greedy, {ANSWER_TOKENS} tokens at most)")
    answers = _answers(prompts)
    seqs = [p + a for p, a in zip(prompts, answers)]
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    log(f"the target's states of {sum(map(len, seqs))} tokens")
    states = _states(target, seqs)
    counts = torch.bincount(
        torch.tensor([t for a in answers for t in a]), minlength=target.config.vocab_size
    )
    draft_ids = counts.topk(DRAFT_VOCAB).indices.sort().values
    to_draft = torch.full((target.config.vocab_size,), -100, dtype=torch.long)
    to_draft[draft_ids] = torch.arange(DRAFT_VOCAB)
    covered = float(counts[draft_ids].sum() / counts.sum())
    embed = target.get_input_embeddings().weight.detach()
    head = Head(target.config, draft_ids, embed, target.model.norm.weight.detach())
    data = _examples(seqs, states, [len(p) for p in prompts], to_draft, args.steps)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(data) / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    rng = random.Random(0)
    history = []
    for epoch in range(args.epochs):
        order = list(range(len(data)))
        rng.shuffle(order)
        loss_sum, right, total = 0.0, [0] * args.steps, [0] * args.steps
        for b in range(0, len(order), args.batch):
            opt.zero_grad()
            for i in order[b : b + args.batch]:
                inputs, st, targets = data[i]
                loss = 0.0
                for k, logits in enumerate(head.steps(embed[inputs], st.float(), args.steps)):
                    mask = targets[k] >= 0
                    ce = F.cross_entropy(logits[mask], targets[k][mask], reduction="sum")
                    loss = loss + STEP_WEIGHT**k * ce / max(1, int(mask.sum()))
                    right[k] += int((logits[mask].argmax(-1) == targets[k][mask]).sum())
                    total[k] += int(mask.sum())
                (loss / args.batch).backward()
                loss_sum += float(loss.detach())
            opt.step()
            sched.step()
        top1 = [r / max(1, t) for r, t in zip(right, total)]
        history.append({"epoch": epoch + 1, "loss": loss_sum / len(data), "top1": top1})
        log(f"epoch {epoch + 1}: loss {loss_sum / len(data):.3f}, guesses right {top1}")
    out = head_dir()
    os.makedirs(out, exist_ok=True)
    tensors = head.tensors()
    tensors["d2t"] = draft_ids - torch.arange(DRAFT_VOCAB)
    tensors["t2d"] = to_draft >= 0
    save_file(tensors, os.path.join(out, "model.safetensors"))
    c = target.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "max_position_embeddings": c.max_position_embeddings,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": list(AUX_LAYERS),
        "tie_word_embeddings": False,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    report = {
        **run_header("benchmarks.engine.eagle_train", None),
        "prompts": len(prompts),
        "answer_tokens": sum(map(len, answers)),
        "draft_vocab": DRAFT_VOCAB,
        "draft_vocab_covers": covered,
        "epochs": history,
        "seconds": time.time() - t0,
    }
    with open(os.path.join(out, "train.json"), "w") as f:
        json.dump(report, f, indent=1)
    log(f"head written to {out} in {report['seconds']:.0f} s")
    return report


def main(argv=None) -> int:
    ap = script_parser(__doc__)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences a step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--steps", type=int, default=2, help="guesses trained a position")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    train(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
