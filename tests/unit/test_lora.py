"""LoRA adapters in the engine (engine/lora.py): greedy tokens under each of two random PEFT
adapters, and under the base, mixed in one batch, equal HF + PEFT's for a Llama, a Gemma 2 and a
mixture of experts (float32; and the default mode for the Llama; the hybrids:
tests/integration/test_lora_hybrids.py); the
prefix cache never shares blocks across adapters or with a replaced adapter of the same name;
max_loras evicts the least recently used adapter and reads it back from disk; bad adapters are
refused at load, naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from helpers.arch import build_arch_model
from helpers.engine import KV, greedy
from helpers.lora import ADAPTERS, LORA_NEW, lora_families, lora_llm, make_adapter, mixed_batch
from pdserve.engine import LLM, LoRARequest
from pdserve.engine.lora import LoRAError
from pdserve.worker_common import lora as worker_lora

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return lora_families(tmp_path_factory)


_llm = lora_llm


@pytest.mark.parametrize(
    "kind,dtype",
    [
        ("llama", "float32"),
        ("llama", "auto"),
        ("gemma2", "float32"),
        ("qwen2-moe", "float32"),
    ],
)
def test_mixed_batch_matches_hf_peft(family, kind, dtype):
    base, dirs, prompts, want = family(kind)
    assert want["sql"] != want["base"] and want["poem"] != want["base"]  # the adapters matter
    llm = _llm(base, dtype=dtype, max_loras=2)
    try:
        assert mixed_batch(llm, dirs, prompts) == want
    finally:
        llm.shutdown()


def test_prefix_cache_not_shared_across_adapters(family, tmp_path):
    base, dirs, prompts, want = family("llama")
    prompt = prompts[2]  # 70 tokens: 17 full blocks
    llm = _llm(base, max_loras=2)
    try:
        first = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        again = llm.generate(prompt, greedy(4), use_tqdm=False)[0]
        assert again.num_cached_tokens == 68  # the base's own blocks
        sql = LoRARequest("sql", 1, dirs["sql"])
        out = llm.generate(prompt, greedy(LORA_NEW), use_tqdm=False, lora_request=sql)[0]
        assert out.num_cached_tokens == 0  # nothing of the base's
        assert out.outputs[0].token_ids == want["sql"][2]
        out = llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=sql)[0]
        assert out.num_cached_tokens == 68  # its own
        poem = LoRARequest("poem", 2, dirs["poem"])
        out = llm.generate(prompt, greedy(4), use_tqdm=False, lora_request=poem)[0]
        assert out.num_cached_tokens == 0
        # "sql" replaced by other weights under the same name: none of the old KV is reused
        other = tmp_path / "sql-v2"
        shutil.copytree(dirs["poem"], other)
        llm.engine.add_lora(LoRARequest("sql", 3, str(other)))
        out = llm.generate(prompt, greedy(LORA_NEW), use_tqdm=False, lora_request="sql")[0]
        assert out.num_cached_tokens == 0
        assert out.outputs[0].token_ids == want["poem"][2]
    finally:
        llm.shutdown()


def test_max_loras_evicts_lru_and_reloads(family):
    base, dirs, prompts, want = family("llama")
    llm = _llm(base, max_loras=1, enable_prefix_caching=False)
    try:
        cache = llm.engine.runner.lora_cache
        for name in ("sql", "poem", "sql"):
            req = LoRARequest(name, ADAPTERS.index(name) + 1, dirs[name])
            out = llm.generate(prompts[0], greedy(LORA_NEW), use_tqdm=False, lora_request=req)
            assert out[0].outputs[0].token_ids == want[name][0]
            assert len(cache.resident()) == 1
        assert cache.loads == 3  # "sql" read again after "poem" evicted it
        assert cache.evictions == 2 and cache.resident_names == ("sql",)
        names = [a.name for a in llm.engine.list_loras()]
        assert names == ["sql", "poem"]
        assert worker_lora.stats(llm.engine) == {  # what a worker's Stats report
            "lora_adapters": ["sql", "poem"],
            "lora_adapters_count": 2,
            "lora_resident": ["sql"],
            "lora_loads": 3,
            "lora_evictions": 2,
            "lora_running": [],
            "lora_waiting": [],
            "lora_max": 1,
        }
        assert llm.engine.remove_lora("poem") and not llm.engine.remove_lora("poem")
        with pytest.raises(LoRAError, match="no LoRA adapter named 'poem'"):
            llm.generate(prompts[0], greedy(2), use_tqdm=False, lora_request="poem")
    finally:
        llm.shutdown()


def test_lora_modules_at_start_and_refusals(family, tmp_path):
    base, dirs, prompts, want = family("llama")
    with pytest.raises(ValueError, match="lora_modules needs enable_lora"):
        LLM(base, lora_modules={"sql": dirs["sql"]})
    with pytest.raises(LoRAError, match="rank r=8, above max_lora_rank=4"):
        _llm(base, max_lora_rank=4, lora_modules={"sql": dirs["sql"]})
    llm = _llm(base, lora_modules={"sql": dirs["sql"]})
    try:
        out = llm.generate(prompts[1], greedy(LORA_NEW), use_tqdm=False, lora_request="sql")
        assert out[0].outputs[0].token_ids == want["sql"][1]
        with pytest.raises(LoRAError, match="is not a directory"):
            llm.engine.add_lora(LoRARequest("x", 5, str(tmp_path / "missing")))
        bad = tmp_path / "dora"
        shutil.copytree(dirs["sql"], bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
        with pytest.raises(LoRAError, match="use_dora"):
            llm.engine.add_lora(LoRARequest("dora", 6, str(bad)))
        # PEFT's LoRA of gpt-oss's fused expert parameters
        experts = {**cfg, "target_parameters": ["mlp.experts.gate_up_proj"]}
        (bad / "adapter_config.json").write_text(json.dumps(experts))
        with pytest.raises(LoRAError, match=r"target_parameters=\['mlp.experts"):
            llm.engine.add_lora(LoRARequest("experts", 7, str(bad)))
        with pytest.raises(LoRAError, match="lora_name"):
            LoRARequest("", 1, dirs["sql"])
        with pytest.raises(LoRAError, match="lora_int_id"):
            LoRARequest("a", 0, dirs["sql"])
    finally:
        llm.shutdown()
    plain = LLM(base, kv_cache_memory=KV, speculative_config=None)
    try:
        with pytest.raises(LoRAError, match="enable_lora"):
            plain.generate(prompts[0], greedy(2), use_tqdm=False, lora_request="sql")
    finally:
        plain.shutdown()


def test_adapter_of_experts_refused(family, tmp_path):
    """qwen2-moe's layer 0 is sparse: its gate_proj is a shared expert's, refused by name."""
    base, _, _, _ = family("qwen2-moe")
    experts = str(tmp_path / "experts")
    make_adapter(base, "qwen2-moe", experts, seed=7, targets=["gate_proj", "up_proj"])
    # PEFT 0.22 refuses gate_proj alone on an MoE (its experts fuse it with up_proj), and adds
    # the fused experts as parameters of their own (target_parameters, rank_pattern), which the
    # server refuses first: the adapter as an older PEFT wrote it, without the experts, so that
    # the shared expert's names are what the server refuses
    from safetensors.torch import load_file, save_file

    config_path = os.path.join(experts, "adapter_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.update(rank_pattern={}, alpha_pattern={}, target_parameters=None)
    with open(config_path, "w") as f:
        json.dump(config, f)
    weights_path = os.path.join(experts, "adapter_model.safetensors")
    weights = {k: v for k, v in load_file(weights_path).items() if ".mlp.experts." not in k}
    assert any(".mlp.shared_expert.gate_proj." in k for k in weights), sorted(weights)
    save_file(weights, weights_path)
    llm = _llm(base)
    try:
        with pytest.raises(LoRAError, match="not experts"):
            llm.engine.add_lora(LoRARequest("experts", 1, experts))
    finally:
        llm.shutdown()


def test_glm4_moe_sparse_layers_refuse_mlp_adapters(tmp_path):
    """GLM-4.5's sparse layers are DeepSeek's (first_k_dense_replace): an adapter of layer 1's
    MLP is refused, layer 0's (dense) is not."""
    from transformers import AutoConfig

    from pdserve.engine.config import ModelConfig
    from pdserve.engine.lora import _check_dense_layers

    build_arch_model(tmp_path, "glm4-moe")
    mc = ModelConfig.from_hf(AutoConfig.from_pretrained(str(tmp_path)))
    _check_dense_layers("dense", mc, {0})
    with pytest.raises(LoRAError, match="layer 1 is a mixture-of-experts layer"):
        _check_dense_layers("experts", mc, {0, 1})


def test_max_loras_bounds_the_adapters_of_a_step(family):
    """max_loras=1 with both adapters' requests interleaved (and the base's) in one generate:
    every request is served, with the tokens it gets alone (HF + PEFT's), and no step runs two
    adapters (engine/scheduler.py: a further adapter's requests wait for the running one's)."""
    base, dirs, prompts, want = family("llama")
    llm = _llm(base, max_loras=1)
    sched = llm.engine.scheduler
    plan_step, per_step = sched.schedule, []

    def schedule():
        plan = plan_step()
        per_step.append({item.seq.lora_id for item in plan.scheduled})
        return plan

    sched.schedule = schedule
    try:
        reqs = {k: LoRARequest(k, ADAPTERS.index(k) + 1, dirs[k]) for k in ADAPTERS}
        keys = [(k, i) for i in range(len(prompts)) for k in ("sql", "poem", "base")]
        outs = llm.generate(
            [prompts[i] for _, i in keys],
            greedy(LORA_NEW),
            use_tqdm=False,
            lora_request=[reqs.get(k) for k, _ in keys],
        )
        for (k, i), out in zip(keys, outs):
            assert out.outputs[0].token_ids == want[k][i], (k, i)
        adapters = [ids - {0} for ids in per_step]
        assert all(len(ids) <= 1 for ids in adapters), per_step
        seen = {i for ids in adapters for i in ids}
        assert len(seen) == 2  # both adapters ran, one at a time
        assert len(llm.engine.runner.lora_cache.resident()) == 1
    finally:
        llm.shutdown()


def test_the_adapters_running_and_waiting_are_reported(family):
    """vLLM's vllm:lora_requests_info labels (router/worker_metrics.py): with max_loras 1, one
    adapter's sequence runs while the others wait, each adapter named once, the base model's
    counting as none."""
    base, dirs, prompts, _ = family("llama")
    llm = _llm(base, max_loras=1, enable_prefix_caching=False)
    try:
        engine = llm.engine
        for i, name in enumerate(("sql", "poem", "sql", None)):
            lora = None if name is None else LoRARequest(name, ADAPTERS.index(name) + 1, dirs[name])
            engine.add_request(f"r{i}", prompts[0], greedy(LORA_NEW), lora_request=lora)
        engine.step()
        stats = worker_lora.stats(engine)
        # (the second "sql" waits behind "poem": first come, first served)
        assert (stats["lora_running"], stats["lora_waiting"]) == (["sql"], ["poem", "sql"])
        while engine.has_unfinished_requests():
            engine.step()
        stats = worker_lora.stats(engine)
        assert (stats["lora_running"], stats["lora_waiting"]) == ([], [])
    finally:
        llm.shutdown()
