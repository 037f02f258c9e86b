"""The offline LLM's vLLM surface (engine/llm.py) on a tiny random Llama in float32: vLLM's dict
prompts ({"prompt": ...}, {"prompt_token_ids": ...}, with "cache_salt") in generate and the
pooling calls, chat's explicit keywords (lora_request, chat_template_kwargs,
add_generation_prompt, continue_final_message, content parts as vLLM's chat utils parse them,
unknown keywords a TypeError), LLM(...)'s vLLM keywords (honoured, accepted without effect, or
refused with a ValueError naming them), and generate(priority=...), embed's keywords, encode and
the pooling outputs' fields. Rendered prompts are checked against transformers'
apply_chat_template on the same conversation."""

from __future__ import annotations

import pytest
import torch

from helpers.http import CHAT_TEMPLATE, chat_model
from helpers.lora import make_adapter
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.chat_content import content_format
from pdserve.engine.llm import _vllm_source
from pdserve.engine.lora import LoRARequest
from pdserve.engine.request import PoolingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
KW = dict(dtype="float32", kv_cache_memory=1 << 20, block_size=4, max_model_len=64)
CONV = [{"role": "user", "content": "t5 t6"}]


@pytest.fixture(scope="module")
def model_dir(tiny_models, tmp_path_factory):
    return chat_model(tiny_models, tmp_path_factory)


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("adapter"))
    make_adapter(model_dir, "llama", path, seed=1)
    return LoRARequest("a", 1, path)


@pytest.fixture(scope="module")
def llm(model_dir):
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=8, **KW)
    yield llm
    llm.shutdown()


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---- F1: vLLM's dict prompts ---------------------------------------------------------------------
def test_dict_prompts_generate_as_their_text_or_ids_mixed_in_one_list(llm):
    text, ids = "t5 t6 t7", [5, 6, 7]
    (by_text,), (by_ids,) = llm.generate(text, GREEDY), llm.generate([ids], GREEDY)
    outs = llm.generate(
        [
            {"prompt": text},
            {"prompt_token_ids": ids},
            text,
            ids,
            {"prompt_token_ids": ids, "prompt": "shown"},
            {"prompt": text, "multi_modal_data": None},  # None: nothing asked for
        ],
        GREEDY,
    )
    want = [by_text, by_ids, by_text, by_ids, by_ids, by_text]
    assert _tokens(outs) == _tokens(want)
    assert [o.prompt for o in outs] == [text, None, text, None, "shown", text]
    assert [o.prompt_token_ids for o in outs] == [w.prompt_token_ids for w in want]
    # one dict is one prompt, as one text is
    assert _tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == _tokens([by_ids])


@pytest.mark.parametrize(
    "prompt, needle",
    [
        ({"prompt": "t5", "multi_modal_data": {"image": 1}}, "multi_modal_data"),
        ({"prompt_embeds": [[0.0]]}, "prompt_embeds"),
        ({}, "needs 'prompt'"),
        ({"prompt_token_ids": "t5"}, "prompt_token_ids"),
        ({"prompt": 5}, "'prompt'"),
        ({"prompt": "t5", "cache_salt": 3}, "cache_salt"),
        (3.5, "prompts[0]"),
    ],
)
def test_malformed_dict_prompts_are_refused_naming_the_key(llm, prompt, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        llm.generate([prompt], GREEDY)
    with pytest.raises(ValueError, match=needle.replace("[", r"\[")):
        llm.embed([prompt])


def test_a_prompt_dicts_cache_salt_separates_its_prefix_cache(llm):
    ids = list(range(10, 22))
    llm.generate([ids], GREEDY)
    (again,) = llm.generate([{"prompt_token_ids": ids}], GREEDY)
    (salted,) = llm.generate([{"prompt_token_ids": ids, "cache_salt": "s1"}], GREEDY)
    assert again.num_cached_tokens > 0 and salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == again.outputs[0].token_ids


def test_dict_prompts_in_embed_score_and_classify(model_dir, llm):
    vectors = [o.outputs.embedding for o in llm.embed(["t5 t6", [7, 8]])]
    got = llm.embed([{"prompt": "t5 t6"}, {"prompt_token_ids": [7, 8]}])
    assert [o.outputs.embedding for o in got] == vectors
    plain = [o.outputs.score for o in llm.score("t5 t6", ["t5 t6", "t7"])]
    dicts = llm.score({"prompt": "t5 t6"}, [{"prompt": "t5 t6"}, {"prompt_token_ids": [7]}])
    assert [o.outputs.score for o in dicts] == pytest.approx(plain)
    heads = LLM(model_dir, classifier_from_token=["t1", "t2"], **KW)
    try:
        want = heads.classify(["t5 t6", "t5 t6 t7"])
        got = heads.classify([{"prompt": "t5 t6"}, {"prompt_token_ids": [5, 6, 7]}])
        assert [o.outputs.probs for o in got] == [o.outputs.probs for o in want]
        joined = heads.score([{"prompt_token_ids": [5]}], [{"prompt_token_ids": [6]}])
        assert joined[0].prompt_token_ids == [5, 6]
        with pytest.raises(ValueError, match="mixes a text and token ids"):
            heads.score("t5", [[6]])
    finally:
        heads.shutdown()


# ---- F4-F7: chat ---------------------------------------------------------------------------------
def _hf_ids(llm, conversation, **kw) -> list[int]:
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(conversation, tokenize=False, **kw)
    return tok.encode(text, add_special_tokens=False)


def test_chat_runs_under_its_lora_request(llm, adapter):
    ids = _hf_ids(llm, CONV, add_generation_prompt=True)
    base = _tokens(llm.generate([ids], GREEDY))
    under = _tokens(llm.generate([ids], GREEDY, lora_request=adapter))
    assert base != under
    assert _tokens(llm.chat(CONV, GREEDY, lora_request=adapter)) == under
    assert _tokens(llm.chat(CONV, GREEDY)) == base


def test_chat_refuses_an_unknown_keyword_as_a_signature_does(llm):
    with pytest.raises(TypeError, match="foo"):
        llm.chat(CONV, GREEDY, foo=1)


def test_chat_template_kwargs_reach_the_template(llm):
    template = "{% if flag %}t9 {% endif %}{{ messages[0].content }}"
    (on,) = llm.chat(CONV, GREEDY, chat_template=template, chat_template_kwargs={"flag": True})
    (off,) = llm.chat(CONV, GREEDY, chat_template=template)
    assert on.prompt_token_ids == [9, 5, 6] and off.prompt_token_ids == [5, 6]
    assert on.prompt == "t9 t5 t6"
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(CONV, GREEDY, chat_template_kwargs={"add_generation_prompt": False})


def test_add_generation_prompt_and_continue_final_message(llm):
    (no_turn,) = llm.chat(CONV, GREEDY, add_generation_prompt=False)
    assert no_turn.prompt_token_ids == _hf_ids(llm, CONV, add_generation_prompt=False)
    partial = CONV + [{"role": "assistant", "content": "t8"}]
    (cont,) = llm.chat(partial, GREEDY, add_generation_prompt=False, continue_final_message=True)
    assert cont.prompt_token_ids == _hf_ids(llm, partial, continue_final_message=True)
    assert cont.prompt_token_ids == [3, 5, 6, 4, 3, 8]  # the template's t4 t7 after t8 cut
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(partial, GREEDY, continue_final_message=True)


def test_text_content_parts_are_joined_and_other_parts_refused(llm):
    parts = [
        {"role": "system", "content": None},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "t5"},
                "t6",
                {"type": "text", "text": ""},  # empty: skipped, as vLLM skips it
                {"type": "input_text", "text": "t7"},
            ],
        },
    ]
    joined = [{"role": "system", "content": ""}, {"role": "user", "content": "t5\nt6\nt7"}]
    (got,) = llm.chat(parts, GREEDY)
    assert got.prompt_token_ids == _hf_ids(llm, joined, add_generation_prompt=True)
    assert got.prompt_token_ids == [3, 4, 3, 5, 6, 7, 4, 7]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*'image_url'"):
        llm.chat(image, GREEDY)
    with pytest.raises(ValueError, match="'role'"):
        llm.chat([{"content": "t5"}], GREEDY)


def test_a_template_that_loops_over_content_gets_openai_parts(llm):
    template = (
        "{% for m in messages %}{% for c in m['content'] %}{{ c.text }} {% endfor %}{% endfor %}"
    )
    conv = [{"role": "user", "content": [{"type": "text", "text": "t5"}, "t6"]}]
    (got,) = llm.chat(conv, GREEDY, chat_template=template)
    assert got.prompt == "t5 t6 " and got.prompt_token_ids == [5, 6]
    (plain,) = llm.chat(CONV, GREEDY, chat_template=template)  # a str becomes one text part
    assert plain.prompt_token_ids == [5, 6]
    (forced,) = llm.chat(
        conv, GREEDY, chat_template=CHAT_TEMPLATE, chat_template_content_format="openai"
    )
    assert forced.prompt.startswith("t3 [{'type': 'text', 'text': 't5'}")
    with pytest.raises(ValueError, match="chat_template_content_format"):
        llm.chat(CONV, GREEDY, chat_template_content_format="json")


@pytest.mark.parametrize(
    "template, want",
    [
        (CHAT_TEMPLATE, "string"),
        (
            "{% for m in messages %}{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}"
            "{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}{{ p.text }}"
            "{% endfor %}{% endfor %}",
            "openai",
        ),
        ("{% for m in messages %}{% for x in other %}{% endfor %}{% endfor %}", "string"),
        ("{% for m in messages", "string"),  # does not parse: vLLM's default
    ],
)
def test_content_format_is_detected_as_vllm_detects_it(template, want):
    assert content_format(template) == want


# ---- F10: LLM(...)'s vLLM keywords ---------------------------------------------------------------
def test_vllm_keywords_that_change_nothing_here_are_accepted(model_dir):
    llm = LLM(
        model_dir,
        device="cpu",
        tokenizer=model_dir,
        trust_remote_code=True,
        disable_log_stats=True,
        swap_space=4,
        enable_chunked_prefill=True,
        tokenizer_mode="auto",
        skip_tokenizer_init=False,
        cpu_offload_gb=0,
        runner="generate",
        disable_custom_all_reduce=True,
        hf_token=True,
        compilation_config=None,
        task="generate",
        gpu_memory_utilization=0.5,  # a CPU engine: no GPU share to take
        seed=None,
        max_num_seqs=None,
        enforce_eager=True,
        **{**KW, "dtype": "float"},
    )
    try:
        assert llm.engine.config.dtype == "float32" and llm.engine.config.seed == 0
        assert llm.engine.config.cuda_graphs is False
        assert llm.engine.config.max_num_seqs == 128
        assert len(llm.generate("t5", GREEDY)[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"tokenizer": "org/other"}, "tokenizer="),
        ({"revision": "main"}, "revision="),
        ({"tokenizer_revision": "v2"}, "tokenizer_revision"),
        ({"tokenizer_mode": "slow"}, "tokenizer_mode"),
        ({"skip_tokenizer_init": True}, "skip_tokenizer_init"),
        ({"cpu_offload_gb": 4}, "cpu_offload_gb"),
        ({"runner": "draft"}, "runner"),
        ({"task": "reward"}, "task"),
        ({"mm_processor_kwargs": {"images": []}}, "mm_processor_kwargs"),
        ({"mm_processor_kwargs": ["max_pixels"]}, "mm_processor_kwargs"),
        ({"pooler_config": {"pooling_type": "MEAN"}}, "pooler_config"),
        ({"hf_token": "hf_abc"}, "HF_TOKEN"),
        ({"hf_overrides": {"rope_theta": 1.0}}, "rope_theta"),
        ({"hf_overrides": {"architectures": ["LlamaForSequenceClassification"]}}, "recipe"),
        (
            {"gpu_memory_utilization": 0.5, "device": "cuda", "kv_cache_memory": None},
            "pass kv_cache_memory",
        ),
        ({"gpu_memory_utilization": 1.5, "device": "cpu"}, "gpu_memory_utilization"),
        ({"enforce_eager": True, "cuda_graphs": True}, "disagree"),
        ({"enforce_eager": "yes"}, "enforce_eager"),
        ({"kv_cache_memory_bytes": 1 << 21}, "disagree"),
        ({"dtype": "half8"}, "dtype"),
    ],
)
def test_vllm_keywords_that_would_change_results_are_refused_by_name(model_dir, kw, needle):
    with pytest.raises(ValueError, match=needle):
        LLM(model_dir, **{**KW, **kw})


def test_a_misspelt_keyword_is_a_type_error(model_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(model_dir, max_num_seq=4, **KW)


def test_vllm_renamed_keywords_are_honoured(model_dir):
    llm = LLM(
        model_dir,
        hf_overrides={
            "classifier_from_token": ["t1", "t2"],
            "architectures": ["LlamaForSequenceClassification"],
            "is_original_qwen3_reranker": True,
        },
        kv_cache_memory_bytes=1 << 20,
        dtype=torch.float32,
        block_size=4,
        max_model_len=64,
    )
    try:
        assert llm.engine.config.classifier_from_token == ("t1", "t2")
        assert llm.engine.config.kv_cache_memory == 1 << 20
        assert llm.engine.config.dtype == "float32"
        assert len(llm.classify("t5")[0].outputs.probs) == 2
    finally:
        llm.shutdown()


def test_revision_goes_onto_a_hub_id_and_nowhere_else():
    assert _vllm_source("org/name", {"revision": "v1"}) == "org/name@v1"
    assert _vllm_source("org/name@v1", {"revision": "v1", "tokenizer": "org/name"}) == (
        "org/name@v1"
    )
    assert _vllm_source("org/name", {"tokenizer_revision": None}) == "org/name"
    with pytest.raises(ValueError, match="two revisions"):
        _vllm_source("org/name@v1", {"revision": "v2"})
    with pytest.raises(ValueError, match="not a Hub id"):
        _vllm_source("smollm2", {"revision": "v1"})


# ---- F11: priority, embed's keywords, encode and the pooling outputs' fields ---------------------
def test_generate_passes_each_prompts_priority_to_the_engine(llm, monkeypatch):
    seen = []
    add = llm.engine.add_request

    def spy(rid, prompt, params, **kw):
        seen.append(kw["priority"])
        return add(rid, prompt, params, **kw)

    monkeypatch.setattr(llm.engine, "add_request", spy)
    outs = llm.generate(["t5", "t6"], GREEDY, priority=[3, -1])
    assert seen == [3, -1] and len(outs) == 2
    with pytest.raises(ValueError, match="priority has 1 entries for 2 prompts"):
        llm.generate(["t5", "t6"], GREEDY, priority=[0])
    with pytest.raises(ValueError, match=r"tokenization_kwargs \['truncation'\]"):
        llm.generate("t5", GREEDY, tokenization_kwargs={"truncation": True})


def test_embed_takes_vllms_keywords(llm, adapter):
    base = llm.embed(["t5 t6 t7"], use_tqdm=False)[0]
    assert base.finished is True and base.num_cached_tokens == 0
    under = llm.embed([{"prompt": "t5 t6 t7"}], lora_request=adapter)[0].outputs.embedding
    assert under != base.outputs.embedding
    assert llm.embed("t5 t6 t7", lora_request=adapter)[0].outputs.embedding == under
    from_generator = llm.embed(p for p in ["t5 t6 t7"])  # read once, as a list would be
    assert from_generator[0].outputs.embedding == base.outputs.embedding
    mean = llm.embed("t5 t6 t7", pooling="mean", normalize=False)[0].outputs.embedding
    by_params = llm.embed("t5 t6 t7", pooling_params=PoolingParams("mean", False))
    assert by_params[0].outputs.embedding == mean
    with pytest.raises(ValueError, match="pooling='classify'"):
        llm.embed("t5", pooling_params=PoolingParams("classify"))
    cut = llm.embed([list(range(5, 15)), "t5 t6 t7 t8"], truncate_prompt_tokens=3)
    assert [o.prompt_token_ids for o in cut] == [[5, 6, 7], [5, 6, 7]]
    assert cut[0].outputs.embedding == llm.embed([[5, 6, 7]])[0].outputs.embedding
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed("t5", truncate_prompt_tokens=0)
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        llm.embed("t5", tokenization_kwargs={"truncation": True})


def test_use_tqdm_may_be_a_progress_bar_factory(llm):
    made = []

    class Bar:
        def __init__(self, total, desc):
            made.append(total)
            self.n = 0

        def update(self, k):
            self.n += k

        def close(self):
            made.append(self.n)

    llm.generate(["t5", "t6"], GREEDY, use_tqdm=Bar)
    assert made == [2, 2]


def test_encode_answers_in_vllms_shape(llm):
    with pytest.raises(ValueError, match="pooling_task"):
        llm.encode("t5")
    (out,) = llm.encode("t5 t6", pooling_task="embed")
    assert isinstance(out.outputs.data, torch.Tensor) and out.finished
    assert out.outputs.data.tolist() == llm.embed("t5 t6")[0].outputs.embedding
