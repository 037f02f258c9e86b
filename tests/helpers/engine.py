"""Helpers shared by the engine tests on tiny random models (tests/unit/test_engine_*.py, and
tests/integration/test_engine_*.py for those that need processes): greedy sampling, stepping an
engine to the end, `CopySink` (the kv_sink that the disaggregation hooks' tests hand a
prefill-only engine) and `needs_x86_int8` (the skip mark of the int8 tests).

Not a test module: imported as `from helpers.engine import ...` (tests/helpers/ is a package on pytest's sys.path). The
fixtures those tests share (`refs`, the HF greedy reference continuations, and `one_thread`) are in
tests/conftest.py, with the reference set's constants.
"""

from __future__ import annotations

import pytest
import torch

from helpers.models import NEW
from pdserve.engine import SamplingParams

KV = 1 << 22


def greedy(max_tokens: int = NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_until_done(engine, max_steps: int = 10_000) -> list:
    outs = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outs
        outs += engine.step()
    raise AssertionError("engine did not finish")


class CopySink:
    """Copies each final token range of A's layer KV into B's reserved blocks, token by token."""

    def __init__(self, engine_b, reservation, num_layers: int):
        self.b = engine_b
        self.res = reservation
        self.num_layers = num_layers
        self.step = 0  # set by the test before each A.step()
        self.calls: list[tuple[int, int, int, int]] = []  # (step, layer, start, end)
        self.started: list[tuple[int, int]] = []  # (step, calls before it) of each step start

    def on_step_start(self):
        self.started.append((self.step, len(self.calls)))

    def on_layer(self, layer_idx, layer_kv, block_ids, start, end):
        self.calls.append((self.step, layer_idx, start, end))
        nb, bs_a = layer_kv.shape[1], layer_kv.shape[2]
        assert layer_kv.shape[0] == 2 and layer_kv.shape[3:] == self.b.kv_cache.shape[4:]
        assert all(0 <= b < nb for b in block_ids)
        bs_b = self.res.block_size
        for t in range(max(start, self.res.num_cached_tokens), end):
            self.b.kv_cache[layer_idx, :, self.res.block_ids[t // bs_b], t % bs_b] = layer_kv[
                :, block_ids[t // bs_a], t % bs_a
            ]

    def on_state(self, layer, tensors):
        """A hybrid model's linear layer's final state, into B's reserved slot."""
        self.calls.append((self.step, "state", layer, 0))
        whole = torch.cat([t.reshape(-1) for t in tensors])
        self.b.state_views(self.res.state_slot)[layer].write(whole)

    def check(self, prompt_len: int) -> None:
        steps = sorted({c[0] for c in self.calls})
        # each step that publishes said it started, before its first layer
        firsts = [next(i for i, c in enumerate(self.calls) if c[0] == s) for s in steps]
        assert self.started == list(zip(steps, firsts)), (self.started, steps)
        covered = 0
        for s in steps:
            calls = [c for c in self.calls if c[0] == s]
            assert [c[1] for c in calls] == list(range(self.num_layers)), (
                "one call per layer, in order"
            )
            ranges = {(c[2], c[3]) for c in calls}
            assert len(ranges) == 1, "every layer of a step publishes the same range"
            ((start, end),) = ranges
            assert start == covered and end > start, "ranges are consecutive"
            covered = end
        assert covered == prompt_len


# int8 linears need one of torch's x86 quantized engines
needs_x86_int8 = pytest.mark.skipif(
    not any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm", "onednn")),
    reason="torch has no x86 quantized engine here",
)


def prompt_logprob_diff(ref, llm, p) -> float:
    """The largest gap between `ref`'s and `llm`'s logprob of one of prompt p's own tokens."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    a = ref.generate([p], params, use_tqdm=False)[0].prompt_logprobs
    b = llm.generate([p], params, use_tqdm=False)[0].prompt_logprobs
    return max(abs(a[i][p[i]] - b[i][p[i]]) for i in range(1, len(p)))


def tier_settings(model_dir: str, pool_blocks: int, block_size: int) -> tuple[int, dict]:
    """For the KV tier tests (tests/unit/test_engine_host_tier.py, test_engine_disk_tier.py): the
    bytes of one KV block of `model_dir` (measured on a probe engine) and the engine settings of a
    pool of `pool_blocks` such blocks, one long-context step at a time, no speculation."""
    from pdserve.engine import LLM

    probe = LLM(model_dir, kv_cache_memory=KV, block_size=block_size)
    per_block = probe.engine.kv_cache[:, :, 0].numel() * probe.engine.kv_cache.element_size()
    probe.shutdown()
    common = dict(
        kv_cache_memory=pool_blocks * per_block,
        block_size=block_size,
        max_model_len=384,
        max_num_batched_tokens=128,
        speculative_config=None,
    )
    return per_block, common
