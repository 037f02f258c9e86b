"""Prompt-lookup guesses (speculative_config method "ngram"): copy what followed the last time.

A sequence that quotes, edits or summarizes text it was given keeps repeating stretches of its own
context. For the last n tokens of the sequence (n from prompt_lookup_max down to
prompt_lookup_min), find the latest earlier place where the same n tokens occur and guess the k
tokens that followed them there. The search runs in C: the token ids are packed as 4-byte
integers once per sequence (`History` keeps the packing and appends to it as tokens arrive), and
`bytes.rfind` finds the pattern; a hit that does not start on a token boundary is skipped.
Nothing here touches a tensor; the engine calls `propose` for each sequence it may speculate on.
"""

from __future__ import annotations

from array import array


class History:
    """A sequence's token ids packed for searching, extended in place as the sequence grows."""

    __slots__ = ("_ids", "_bytes", "_len")

    def __init__(self) -> None:
        self._ids = array("i")
        self._bytes = b""
        self._len = 0

    def sync(self, token_ids: list[int]) -> None:
        n = len(token_ids)
        if n < self._len or (self._len and self._ids[self._len - 1] != token_ids[self._len - 1]):
            self._ids = array("i")  # the sequence was cut (a stop string): start over
            self._len = 0
        if n > self._len:
            self._ids.extend(token_ids[self._len :])
            self._len = n
            self._bytes = self._ids.tobytes()

    def propose(self, k: int, n_min: int, n_max: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
        n_max..n_min tokens that occurred before; [] when none did."""
        ids, data, length = self._ids, self._bytes, self._len
        for n in range(min(n_max, length - 1), n_min - 1, -1):
            pattern = data[(length - n) * 4 :]
            # the occurrence must end before the suffix itself does
            end = (length - 1) * 4
            while True:
                at = data.rfind(pattern, 0, end)
                if at < 0:
                    break
                if at % 4 == 0:
                    start = at // 4 + n
                    return ids[start : start + k].tolist()
                end = at + len(pattern) - 1  # a hit across token boundaries: look further back
        return []


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """One-shot form of History.propose (tests, and callers that keep no history)."""
    history = History()
    history.sync(token_ids)
    return history.propose(k, n_min, n_max)
