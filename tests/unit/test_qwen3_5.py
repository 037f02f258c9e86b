"""Qwen3.5, the hybrid family: Gated DeltaNet layers with per-sequence state in slots
(engine/layers/gated_delta.py, engine/recurrent_state.py) beside gated full attention
(engine/models/qwen3_5.py). tests/unit/test_architectures.py checks its greedy tokens against
HF's with chunked prefill; here the paths that only a recurrent state has: the chunked rule
against one token at a time, a prompt run whole (several blocks of the rule in one span), forks
(n > 1) starting from a copy of their parent's state, preemption starting over from zeros,
slots running out before blocks do, prompt logprobs, and what the engine refuses for such a
model. The vision-language checkpoint, images and text: tests/unit/test_qwen2_vl.py."""

from __future__ import annotations

import pytest
import torch

from helpers.arch import ARCH_NEW, arch_refs
from helpers.engine import KV, greedy
from helpers.threads import assert_no_leaks
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers import gated_delta

pytestmark = pytest.mark.usefixtures("one_thread")
KIND = "qwen3.5"


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    cache: dict = {}
    return lambda: arch_refs(tmp_path_factory, cache, KIND)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 200])
def test_chunked_rule_equals_token_by_token(length):
    """The WY-form chunked rule, from a state left by earlier tokens, gives the outputs and
    final state of the rule applied one token at a time (padding of a partial last block
    included)."""
    g = torch.Generator().manual_seed(length)
    h, dk, dv = 3, 8, 5

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, k = (torch.nn.functional.normalize(rand(length, h, dk), dim=-1) for _ in range(2))
    v = rand(length, h, dv)
    decay = -torch.rand(length, h, generator=g)  # log of a decay in (e^-1, 1]
    beta = torch.rand(length, h, generator=g)
    start = rand(1, h, dk, dv)
    chunked = start.clone()
    got = gated_delta._chunked_rule(q, k, v, decay, beta, chunked, 0)
    stepped = start.clone()
    slot = torch.tensor([0])
    want = torch.stack(
        [
            gated_delta._recurrent_step_torch(
                q[t : t + 1],
                k[t : t + 1],
                v[t : t + 1],
                decay[t : t + 1],
                beta[t : t + 1],
                stepped,
                slot,
            )[0]
            for t in range(length)
        ]
    )
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert torch.allclose(chunked, stepped, atol=1e-4)


def test_compiled_step_equals_torch_step():
    """The compiled one-token update (fused_cpu.cpp gated_delta_step_), in place on scattered
    slots, gives the torch path's outputs and states; the other slots are left alone."""
    from pdserve.engine.kernels import cpu_fused

    if cpu_fused() is None:
        pytest.skip("no compiled CPU kernels here")
    g = torch.Generator().manual_seed(5)
    b, h, dk, dv = 3, 4, 32, 24
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, dk, generator=g), dim=-1) for _ in "qk")
    v = torch.randn(b, h, dv, generator=g)
    decay = -torch.rand(b, h, generator=g)
    beta = torch.rand(b, h, generator=g)
    start = torch.randn(6, h, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    fused, plain = start.clone(), start.clone()
    got = gated_delta._recurrent_step(q, k, v, decay, beta, fused, slots)
    want = gated_delta._recurrent_step_torch(q, k, v, decay, beta, plain, slots)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.allclose(fused, plain, atol=1e-5)
    assert torch.equal(fused[[1, 3, 5]], start[[1, 3, 5]])


def test_whole_prompts_and_forks_match_hf(refs):
    """Prompts of up to 150 tokens, each computed in one step (three blocks of the chunked rule
    in one span), and n=2: the second sample forks from the first after the prompt, its state a
    copy of the parent's, and greedy gives both HF's tokens."""
    model_dir, _, prompts, want = refs()
    llm = LLM(model_dir, kv_cache_memory=KV, block_size=4, max_num_batched_tokens=512)
    try:
        params = SamplingParams(temperature=0, max_tokens=ARCH_NEW, ignore_eos=True, n=2)
        outs = llm.generate(prompts, params, use_tqdm=False)
        for out, expected in zip(outs, want):
            assert [c.token_ids for c in out.outputs] == [expected, expected]
        assert_no_leaks(llm.engine)
        assert llm.engine.scheduler.slots.num_free == llm.engine.scheduler.slots.num_slots
    finally:
        llm.shutdown()


def test_preemption_and_few_slots_match_hf(refs):
    """A KV cache too small for the batch preempts sequences (their state is recomputed from
    zeros with them), and two slots for eight prompts admit two at a time: HF's tokens still."""
    model_dir, _, prompts, want = refs()
    # (the prefix cache off: its states would take the rest of the states' half of the memory)
    shape = dict(max_model_len=200, max_num_seqs=2, block_size=4, enable_prefix_caching=False)
    probe = LLM(model_dir, kv_cache_memory=KV, **shape)
    per_block = probe.engine.kv_cache[:, :, 0].numel() * probe.engine.kv_cache.element_size()
    state_bytes = probe.engine.runner._state_bytes  # (the states come out of the same budget)
    probe.shutdown()
    # two sequences of 150 and 100 prompt tokens hold 79 blocks: one is preempted
    small = dict(kv_cache_memory=state_bytes + 60 * per_block, **shape)
    for kw in (small, dict(kv_cache_memory=KV, max_num_seqs=2)):
        llm = LLM(model_dir, max_num_batched_tokens=64, **kw)
        try:
            outs = llm.generate(prompts, greedy(ARCH_NEW), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want, kw
            if kw is small:
                assert llm.engine.block_manager.num_blocks == 60
                assert llm.engine.scheduler.num_preemptions > 0
            assert_no_leaks(llm.engine)
        finally:
            llm.shutdown()


def test_prompt_logprobs_match_hf(refs):
    """Each prompt token's logprob equals HF's (the gated attention's and the gated norm's
    arithmetic, which greedy tokens could hide)."""
    model_dir, hf, prompts, _ = refs()
    prompt = prompts[4]  # 150 tokens: chunks of 32 carry the state four times
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV, max_num_batched_tokens=32)
    try:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        got = llm.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    finally:
        llm.shutdown()
    with torch.inference_mode():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    worst = max(
        abs(got[i][prompt[i]] - float(want[i - 1, prompt[i]])) for i in range(1, len(prompt))
    )
    assert worst < 1e-4


def test_refusals(refs):
    """What a hybrid does not run yet is refused at start with a reason, and "auto"
    speculation turns into none (tests/integration/test_hybrid_spec.py: speculation asked for;
    tests/integration/test_lora_hybrids.py: LoRA adapters)."""
    model_dir, *_ = refs()
    for kw, words in (
        (
            {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
            "carries no MTP layer",
        ),
        ({"pipeline_parallel_size": 2}, "one stage"),
    ):
        with pytest.raises(ValueError, match=words):
            LLM(model_dir, kv_cache_memory=KV, **kw)
    from transformers import AutoConfig

    from pdserve.engine.config import EngineConfig, ModelConfig

    cfg = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir))
    assert cfg.recurrent_layers == (0, 1, 2) and cfg.num_kv_layers == 1
    for kw, words in (
        ({"device": "cuda"}, r"recurrent layers\) runs on device='cpu' only"),
        (
            {"kv_host_tier_bytes": 1 << 20, "kv_disk_tier_bytes": 1 << 20},
            "host memory only",
        ),
    ):
        with pytest.raises(ValueError, match=words):
            EngineConfig(model=model_dir, kv_cache_memory=KV, **kw).resolve(cfg)
    with pytest.raises(ValueError, match="too small for Qwen3_5ForCausalLM"):
        LLM(model_dir, kv_cache_memory=1 << 14)
    llm = LLM(model_dir, kv_cache_memory=KV)
    try:
        assert llm.engine.config.speculative_config is None
    finally:
        llm.shutdown()


def test_fork_copy_runs_before_a_new_sequence_resets_the_slot(refs):
    """A parent that stops on its first token frees its slot, which the next step may hand to a
    new prompt: the fork's copy of the parent's state must be made before that prompt's slot is
    zeroed, in the same step."""
    from pdserve.engine.model_runner import ModelInput, SeqInput

    model_dir, _, prompts, _ = refs()
    llm = LLM(model_dir, dtype="float32", kv_cache_memory=KV, block_size=4)
    try:
        runner = llm.engine.runner
        states = runner.states
        prompt = prompts[2]
        blocks = list(range(-(-len(prompt) // 4)))
        runner.execute(ModelInput([SeqInput(prompt, 0, blocks, samples=False, state_slot=0)], []))
        parent = [t[0].clone() for t in (*states.conv, *states.ssm)]
        assert all(t.abs().sum() > 0 for t in parent)
        more = list(range(len(blocks), len(blocks) + len(prompts[1]) // 4 + 1))
        newcomer = SeqInput(prompts[1], 0, more, samples=False, state_slot=0)
        runner.execute(ModelInput([newcomer], [], state_copies=[(0, 1)]))
        for before, t in zip(parent, (*states.conv, *states.ssm)):
            assert torch.equal(t[1], before)
    finally:
        llm.shutdown()
