"""The HF reference that the prompt_logprobs tests compare with, and the comparison itself:
tests/unit/test_engine_prompt_logprobs.py and, across TP ranks,
tests/integration/test_engine_prompt_logprobs_tp.py.

Not a test module: imported as `from helpers.prompt_logprobs import ...` (tests/helpers/ is a package on pytest's sys.path).
"""

from __future__ import annotations

import math

import torch


def hf_prompt_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)  # row p: the distribution of token p + 1


def check(output, hf, prompt: list[int], k: int) -> None:
    got = output.prompt_logprobs
    want = hf_prompt_logprobs(hf, prompt)
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        entry = got[p]
        assert math.isclose(entry[prompt[p]], want[p - 1, prompt[p]].item(), abs_tol=1e-4), p
        top = want[p - 1].topk(k)
        assert set(top.indices.tolist()) <= set(entry)
        assert len(entry) in (k, k + 1)  # the prompt token, when it is not among the k
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert math.isclose(entry[t], v, abs_tol=1e-4)
