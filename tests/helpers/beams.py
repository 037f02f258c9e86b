"""HF transformers' beam search as the beam search tests' reference (engine/beam_search.py): its
`generate` with num_beams, no end-of-sequence token (vLLM's ignore_eos, where HF's and vLLM's
definitions agree) and an explicit attention mask (HF would infer one from the pad id, which is
also a token of the prompts)."""

from __future__ import annotations

import torch


def hf_beam_search(hf, prompt: list[int], width: int, new: int, **kwargs):
    """HF's `generate` output (sequences, prompt included; sequences_scores) of a beam search of
    `width` beams and `new` tokens on `prompt`; kwargs: more of generate's (length_penalty,
    early_stopping)."""
    return hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=new,
        eos_token_id=None,
        pad_token_id=0,
        output_scores=True,
        return_dict_in_generate=True,
        **kwargs,
    )
