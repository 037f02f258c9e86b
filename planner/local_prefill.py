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

`cost` prices a prompt token computed on a decode worker at its full speed in prefill-pool
tokens: 1 where the workers of the two pools are alike (the deployment's "auto" sets it from
their tp and resources: deploy/launcher.py); `hop_tokens` is the fixed price of the
disaggregated path (two more RPCs, the KV transfer, its commit) in prompt tokens. So a short
prompt goes local when the prefill pool is idle, and longer ones too while the prefill pool is
queued. max_prompt_tokens 0 turns it off (the default).

Beside running streams a decode worker does not compute a prompt at full speed: with
max_step_slowdown s (> 0; its decode pool's engines get the same value, deploy/config/schema.py),
a step that decodes streams computes prompt tokens for at most about s of a plain decode step
(engine/scheduler.py), so the streams' steps take about (1 + s) times as long and the prompt
runs in chunks, one a step. A prompt token then takes its full-speed time stretched by
(1 + s) / s (a step as long as 1 + s plain ones computes s of them of prompt), and while the
decode worker has streams running (`streams`) the inequality prices it so:

    cost x (1 + s) / s x (decode backlog + prompt tokens)  <  prefill backlog + hop_tokens

A worker with no stream running computes the prompt alone, at full speed, priced `cost`. s 0
bounds nothing (the running streams wait for whole prompts, within the decode pool's
max_num_batched_tokens), priced `cost` as before. The simulator asks without `streams`: its
local prefills are priced at full speed.

A conversation's next turn is the other case: its decode worker probably still holds the earlier
turns, prompt and answer, in its prefix cache (router/pool.py's decode view), so only the new
tokens need computing there, where the prefill pool would recompute the answer at least. With
`held` such tokens, the same inequality is asked of the new tokens only,

    prompt tokens - held <= reuse_max_new_tokens   and
    price x (decode backlog + prompt tokens - held)  <  prefill backlog + hop_tokens

(price: `cost`, or the chunked price above while the worker has streams running), whatever
max_prompt_tokens says (reuse_max_new_tokens 0 turns it off; on by default). The view is
a hint: a worker that evicted the turns refuses (router/legs.py sends the prompt to the prefill
pool then), and a worker picked in its stead prefills the whole prompt, correctly, only slower.
"""

from __future__ import annotations

from dataclasses import dataclass

# the default max_step_slowdown (router.local_prefill.max_step_slowdown): a step that decodes
# running streams takes at most about this much longer for a prompt computed beside them (issue
# 49's goal: the streams' ITL P90 within 10% of no reuse's)
MAX_STEP_SLOWDOWN = 0.1


@dataclass(frozen=True)
class LocalPrefill:
    max_prompt_tokens: int = 0  # 0: never local
    cost: float = 1.0  # alike workers (module docstring)
    hop_tokens: int = 64
    reuse_max_new_tokens: int = 512  # 0: a held conversation never goes local for that alone
    # what a prompt may add to the steps of the streams it runs beside (module docstring); 0: off
    max_step_slowdown: float = MAX_STEP_SLOWDOWN

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
        if not 0 <= self.max_step_slowdown < float("inf"):
            raise ValueError(
                f"local prefill: max_step_slowdown must be a number >= 0 (0: off), got "
                f"{self.max_step_slowdown}"
            )

    @property
    def enabled(self) -> bool:
        return self.max_prompt_tokens > 0

    def describe(self) -> str:
        """The rule in a line, for the start table (deploy/start_table.py)."""
        turns = (
            f"a turn with at most {self.reuse_max_new_tokens} new tokens may run on the decode "
            f"worker holding the rest"
            if self.reuse_max_new_tokens
            else "turns never run on a decode worker for what it holds"
        )
        fresh = (
            f"a fresh prompt of at most {self.max_prompt_tokens} tokens may too"
            if self.enabled
            else "fresh prompts never (max_prompt_tokens 0)"
        )
        return f"{turns}; {fresh}; cost {self.cost:g}, hop {self.hop_tokens} tokens"

    def choose(
        self,
        prompt_tokens: int,
        prefill_backlog: int | None,
        decode_backlog: int,
        held: int = 0,
        streams: bool = False,
    ) -> bool:
        """Whether a prompt of `prompt_tokens` runs on its decode worker. prefill_backlog: the
        prefill pool's backlog for it, this prompt's uncached tokens included (None: no prefill
        worker is serving; then it always goes local); decode_backlog: the decode worker's local
        prompt tokens in flight (the least loaded one's, or the holder's); held: the leading
        prompt tokens that worker probably holds already; streams: whether that worker has
        streams running, so that the prompt would run in chunks beside them (the module
        docstring)."""
        new = prompt_tokens - held
        reuse = held > 0 and new <= self.reuse_max_new_tokens
        if not reuse and (not self.enabled or prompt_tokens > self.max_prompt_tokens):
            return False
        if prefill_backlog is None:
            return True
        return self.price(streams) * (decode_backlog + new) < prefill_backlog + self.hop_tokens

    def price(self, streams: bool) -> float:
        """A prompt token computed on a decode worker, in prefill-pool tokens: `cost`, stretched
        by (1 + s) / s while streams run there and max_step_slowdown s bounds their steps."""
        s = self.max_step_slowdown
        return self.cost * (1 + s) / s if streams and s > 0 else self.cost
