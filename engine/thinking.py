"""A reasoning model's thinking budget: after `thinking_token_budget` tokens inside its reasoning,
the sequence's next token is `</think>`, so the answer starts (vLLM's `thinking_token_budget`,
Anthropic's `thinking.budget_tokens`; a cap, not a target).

One ThinkingBudget per sequence that asks for a budget, made when the request is added
(engine/engine_core.py) and read by the sampler on every row of the sequence
(engine/sampler.py `process_logits`): `forces_close(seen)` says whether the row must sample
`</think>`. The reasoning is open where the last of `<think>` / `</think>` among the prompt and
the tokens seen is `<think>`, and its tokens are those after that tag: the prompt's count too, so
a prompt the chat template ended inside the reasoning (DeepSeek-R1's), and a stream resumed on
another decode worker (whose prompt carries the tokens already streamed), spend the same budget
as one engine running from the start. The state is kept for the tokens committed to the
sequence's output and advanced over the new ones each step (a step costs the tokens it added, not
the output's length); the guesses a speculated row sees after them are counted without keeping
them. Only models whose vocabulary has both tags as tokens take a budget (the engine refuses it
otherwise, as vLLM does without a reasoning config).
"""

from __future__ import annotations

from collections.abc import Sequence


class ThinkingBudget:
    def __init__(self, budget: int, tags: tuple[int, int], prompt: Sequence[int]):
        self.budget = budget
        self.open_id, self.close_id = tags
        # the state where the output starts, then the state after its first `seen` tokens
        self.start = self._scan(False, 0, from_last_tag(prompt, tags))
        self.is_open, self.count = self.start
        self.seen = 0

    def _scan(self, is_open: bool, count: int, tokens) -> tuple[bool, int]:
        for t in tokens:
            if t == self.open_id:
                is_open = True
            elif t == self.close_id:
                is_open = False
            elif is_open:
                count += 1
        return is_open, count

    def forces_close(self, seen: Sequence[int], committed: int) -> bool:
        """Whether the token after `seen` must be `</think>`: `seen` is the sequence's output,
        its first `committed` tokens committed (kept in the state) and any after them guesses
        of a speculated row (counted, not kept)."""
        if committed < self.seen:  # an output that shrank (never expected): from the start
            (self.is_open, self.count), self.seen = self.start, 0
        self.is_open, self.count = self._scan(self.is_open, self.count, seen[self.seen : committed])
        self.seen = committed
        is_open, count = self._scan(self.is_open, self.count, seen[committed:])
        return is_open and count >= self.budget


def from_last_tag(prompt: Sequence[int], tags: tuple[int, int]) -> Sequence[int]:
    """The prompt from its last reasoning tag on (empty when it has none): all that decides the
    reasoning's state and count where the output starts."""
    for i in range(len(prompt) - 1, -1, -1):
        if prompt[i] in tags:
            return prompt[i:]
    return ()
