"""Speculative decoding over a tensor-parallel target (TP=2, its follower rank a process of its
own): a draft model, an EAGLE-1 and an EAGLE-3 head and a DeepSeek V3 target's MTP layer run
whole on the first rank, the heads with the target's whole embedding and LM head read from its
checkpoint (its model's are split across the ranks). Tokens are the target's alone; every head
guess is recomputed with plain torch or transformers (tests/helpers/eagle.py, mtp.py)."""

from __future__ import annotations

import pytest

from helpers.eagle import check_guesses, make_head, recording
from helpers.engine import KV, greedy
from helpers.models import make_tiny_model, random_prompts
from helpers.mtp import make_mtp_target
from helpers.spec import run_spec
from pdserve.engine import LLM
from pdserve.engine.spec import eagle as spec_eagle

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(dtype="float32", kv_cache_memory=KV, block_size=4)
PROMPTS = random_prompts([5, 23, 40], seed=8)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A six-layer tiny Llama (untied LM head) and its greedy tokens on one rank."""
    path = str(tmp_path_factory.mktemp("spec-tp"))
    hf = make_tiny_model(path, "llama-gqa", num_hidden_layers=6, tie_word_embeddings=False)
    want, _ = run_spec(path, PROMPTS, greedy(20), None, **ENGINE)
    return path, hf, [o.token_ids for o in want]


def test_a_draft_model_guesses_for_a_tensor_parallel_target(llama, always_speculate):
    """The target's own checkpoint as its draft, whole on the first rank: every guess kept."""
    path, _, want = llama
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    got, stats = run_spec(path, PROMPTS, greedy(20), spec, tensor_parallel_size=2, **ENGINE)
    assert [o.token_ids for o in got] == want
    assert stats["spec_accepted_tokens"] == stats["spec_draft_tokens"] > 0, stats


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_an_eagle_head_guesses_for_a_tensor_parallel_target(
    llama, tmp_path, always_speculate, monkeypatch, method
):
    path, hf, want = llama
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 0.0)  # (every guess step runs)
    tensors = make_head(tmp_path, hf, method)
    spec = {"method": method, "model": str(tmp_path), "num_speculative_tokens": 3}
    records = recording(monkeypatch)
    got, stats = run_spec(path, PROMPTS, greedy(20), spec, tensor_parallel_size=2, **ENGINE)
    assert [o.token_ids for o in got] == want
    assert stats["spec_drafts"] > 0
    check_guesses(records, hf, method, tensors)


def test_an_mtp_layer_guesses_for_a_tensor_parallel_target(tmp_path, always_speculate, monkeypatch):
    """DeepSeek V3: latent attention split by heads across the ranks, the MTP layer whole."""
    monkeypatch.setattr(spec_eagle, "CONTINUE_AT", 0.0)
    hf, tensors = make_mtp_target(tmp_path, "deepseek-v3")
    want, _ = run_spec(str(tmp_path), PROMPTS, greedy(20), None, **ENGINE)
    records = recording(monkeypatch)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    got, stats = run_spec(
        str(tmp_path), PROMPTS, greedy(20), spec, tensor_parallel_size=2, **ENGINE
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert stats["spec_drafts"] > 0
    check_guesses(records, hf, "mtp", tensors)


def test_a_head_refused_after_the_ranks_started_stops_them(llama, tmp_path, monkeypatch):
    """A head is built once the follower runs (it reads the target's model): refused there, the
    start raises that error and the follower and the default group end with it."""
    import torch.distributed as dist

    from pdserve.engine import tp

    path, hf, _ = llama
    make_head(tmp_path, hf, "eagle3")
    started = []
    real_start = tp.TPGroup.start

    def start(*args, **kwargs):
        started.append(real_start(*args, **kwargs))
        return started[-1]

    def refuse(model, method):
        raise ValueError("no head today")

    monkeypatch.setattr(tp.TPGroup, "start", start)
    monkeypatch.setattr(spec_eagle, "check_target", refuse)
    spec = {"method": "eagle3", "model": str(tmp_path), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="no head today"):
        LLM(path, speculative_config=spec, tensor_parallel_size=2, **ENGINE)
    assert not dist.is_initialized()
    assert len(started) == 1 and not any(p.is_alive() for p in started[0].procs)
