"""lm-evaluation-harness against the HTTP front (issue 30, must-show a): its `local-completions`
model runs a small multiple-choice task built from a local file to the end, and every
log-likelihood it computed equals the engine's own prompt_logprobs for the same token ids.

lm_eval is not a project dependency: the test is skipped where it is not installed. To run it,
install it beside the project (e.g. a virtual environment made with --system-site-packages, then
`pip install lm-eval`) and run pytest with that environment's python. The cluster is
tests/helpers/http.py's (a prefill and a decode worker behind a router, the tiny model with its
word-level tokenizer); the token ids it sent are its own tokenizer's (`_encode_pair`).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from helpers.http import MODEL
from pdserve.engine import SamplingParams

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None,
    reason="lm_eval is not installed (not a dependency)",
)

DOCS = [
    {"context": "t5 t9 t13", "choices": ["t20", "t7", "t31 t2"], "answer": 0},
    {"context": "t40 t2", "choices": ["t17", "t17 t17"], "answer": 1},
    {"context": "t3 t3 t3 t8", "choices": ["t1", "t9"], "answer": 1},
]
TASK = """task: pdserve_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_loglikelihoods_equal_the_engines(
    router, llm, workers, idle, tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-datasets"))
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "pdserve_tiny_mc.yaml").write_text(TASK.format(data=data))
    model_args = ",".join(
        [
            f"base_url=http://{router.http_address}/v1/completions",
            f"model={MODEL}",
            f"tokenizer={workers.model_dir}",
            "tokenizer_backend=huggingface",
            "num_concurrent=1",
            "max_retries=1",
        ]
    )
    lm = get_model("local-completions").create_from_arg_string(model_args)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=["pdserve_tiny_mc"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        batch_size=1,
    )
    samples = results["samples"]["pdserve_tiny_mc"]
    assert len(samples) == len(DOCS)  # ran to the end, every document
    checked = 0
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ll, is_greedy = resp[0]
            ctx, cont = lm._encode_pair(context, continuation)  # the ids it sent
            ids = ctx + cont
            params = SamplingParams(max_tokens=1, prompt_logprobs=1)
            entries = llm.generate(ids, params, use_tqdm=False)[0].prompt_logprobs
            want = sum(entries[p][ids[p]] for p in range(len(ctx), len(ids)))
            assert math.isclose(ll, want, abs_tol=2e-3), (context, continuation, ll, want)
            greedy = all(
                entries[p][ids[p]] >= max(entries[p].values()) for p in range(len(ctx), len(ids))
            )
            assert is_greedy == greedy
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert "acc,none" in results["results"]["pdserve_tiny_mc"]
