"""Local prefill per request in a disaggregated deployment (conditional disaggregation): the router
may run a request's prompt on the decode worker that will decode it, with no prefill leg and no
KV transfer, when that is predicted to reach the first token sooner than the prefill pool.

A pure rule, part of the planner because the planner moves its bound (max_prompt_tokens) and
the simulator applies it too (tuning/sim_planner.py). The router's Legs.start asks
`LocalPrefill.choose` once per leg, with what the pool already knows and no RPC:
the prefill pool's backlog for this prompt (the least loaded prefill worker's prompt tokens in
flight, plus this prompt's tokens it probably does not cache: router/affinity.py) and the decode
pool's (the prompt tokens its least loaded worker is prefilling locally). The prompt goes local
when

    prompt tokens <= max_prompt_tokens   and
    cost x (decode backlog + prompt tokens)  <  prefill backlog + hop_tokens

`cost` prices a prompt token computed on a decode worker (chunked into its running batch, where it
shares each step with the decodes) in prefill-pool tokens; `hop_tokens` is the fixed price of the
disaggregated path (two more RPCs, the KV transfer, its commit) in prompt tokens. So a short
prompt goes local when the prefill pool is idle, and longer ones too while the prefill pool is
queued. The running batch's step time stays bounded by the decode pool's max_num_batched_tokens
(its chunk budget: set it from the TPOT SLO). max_prompt_tokens 0 turns it off (the default).

A conversation's next turn is the other case: its decode worker probably still holds the earlier
turns, prompt and answer, in its prefix cache (router/pool.py's decode view), so only the new
tokens need computing there, where the prefill pool would recompute the answer at least. With
`held` such tokens, the same inequality is asked of the new tokens only,

    prompt tokens - held <= reuse_max_new_tokens   and
    cost x (decode backlog + prompt tokens - held)  <  prefill backlog + hop_tokens

whatever max_prompt_tokens says (reuse_max_new_tokens 0 turns it off; on by default). The view is
a hint: a worker that evicted the turns refuses (router/legs.py sends the prompt to the prefill
pool then), and a worker picked in its stead prefills the whole prompt, correctly, only slower.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPrefill:
    max_prompt_tokens: int = 0  # 0: never local
    cost: float = 2.0
    hop_tokens: int = 64
    reuse_max_new_tokens: int = 512  # 0: a held conversation never goes local for that alone

    def __post_init__(self):
        if (
            min(self.max_prompt_tokens, self.hop_tokens, self.reuse_max_new_tokens) < 0
            or not self.cost > 0
        ):
            raise ValueError(
                f"local prefill: max_prompt_tokens, hop_tokens and reuse_max_new_tokens must be "
                f">= 0 and cost > 0, got {self.max_prompt_tokens}, {self.hop_tokens}, "
                f"{self.reuse_max_new_tokens}, {self.cost}"
            )

    @property
    def enabled(self) -> bool:
        return self.max_prompt_tokens > 0

    def choose(
        self,
        prompt_tokens: int,
        prefill_backlog: int | None,
        decode_backlog: int,
        held: int = 0,
    ) -> bool:
        """Whether a prompt of `prompt_tokens` runs on its decode worker. prefill_backlog: the
        prefill pool's backlog for it, this prompt's uncached tokens included (None: no prefill
        worker is serving; then it always goes local); decode_backlog: the decode worker's local
        prompt tokens in flight (the least loaded one's, or the holder's); held: the leading
        prompt tokens that worker probably holds already (the module docstring)."""
        new = prompt_tokens - held
        reuse = held > 0 and new <= self.reuse_max_new_tokens
        if not reuse and (not self.enabled or prompt_tokens > self.max_prompt_tokens):
            return False
        if prefill_backlog is None:
            return True
        return self.cost * (decode_backlog + new) < prefill_backlog + self.hop_tokens
