"""Tiny GGUF files written as llama.cpp's converter writes them, and the check every conversion
test ends with (tests/unit/test_gguf_families.py, tests/unit/test_gguf_deepseek.py).

Not a test module: imported as `from helpers.gguf_files import ...`.
"""

from __future__ import annotations

import torch
from transformers.convert_slow_tokenizer import bytes_to_unicode

from helpers.engine import KV, greedy
from helpers.models import LazyGreedy


def add_byte_tokenizer(writer, vocab_size: int) -> None:
    """A byte-level BPE over the `vocab_size` ids (transformers needs one merge to build it:
    byte 255's id holds the merge's result), with ids 0 (bos, pad) and 1 (eos)."""
    tokens = [bytes_to_unicode()[b] for b in range(vocab_size)]
    tokens[255] = tokens[97] + tokens[98]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * vocab_size)
    writer.add_token_merges([f"{tokens[97]} {tokens[98]}"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)


def finish(writer) -> None:
    """The header, the metadata and the tensors to the file, which is closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_engine_greedy_matches(model_dir, model, **engine_kw) -> None:
    """The engine serving `model_dir` (float32; `engine_kw` over the test's pool) gives HF
    `model`'s 16 greedy tokens after a 70-token prompt."""
    from pdserve.engine import LLM

    gen = torch.Generator().manual_seed(1)
    prompt = [int(t) for t in torch.randint(2, 256, (70,), generator=gen)]
    kw = dict(dtype="float32", kv_cache_memory=KV, block_size=4, **engine_kw)
    llm = LLM(str(model_dir), **kw)
    try:
        got = llm.generate([prompt], greedy(16), use_tqdm=False)[0].outputs[0].token_ids
        assert [got] == LazyGreedy(model, [prompt], 16)
    finally:
        llm.shutdown()


def assert_same_logits(out, model, tol: float, **load) -> None:
    """transformers' float32 logits of the converted checkpoint at `out` (`load`: more
    from_pretrained keywords, a gguf_file) are `model`'s, within `tol` (absolute and relative)."""
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, **load).eval()
    ids = torch.tensor([list(range(2, 90))])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=tol, rtol=tol)
