"""Predicted outputs (OpenAI's Predicted Outputs): a request's expected output as the guesses.

A client editing a file knows most of the answer before the model writes it: the file itself,
with a few lines changed. It sends that text as the request's prediction
(SamplingParams.prediction_token_ids); where the engine speculates (a speculative_config with
the "ngram" method, as the default mode has), each step checks the prediction's next tokens as
its guesses, so a stretch the model copies costs one step per 1 + k tokens instead of one per
token. The speculator keeps a `Prediction` per sequence and asks it for guesses each step
before prompt lookup (engine/spec/speculator.py); when it has none, prompt lookup guesses.

The output never depends on the prediction: guesses are checked as every guess is
(engine/spec/verify.py). Following the output: `Prediction` walks the new output tokens along
the prediction while they agree; at the first that does not (the model rewrote a line), it is
lost until the output's last n tokens (n from 8 down to prompt_lookup_min) occur in the
prediction again, looked for first after the place it last followed and then anywhere, and
guesses what follows that occurrence. Nothing here touches a tensor.
"""

from __future__ import annotations

from array import array

MATCH_MAX = 8  # the longest output suffix looked up to find the prediction again


class Prediction:
    """A sequence's predicted output and where in it the output stands."""

    __slots__ = ("_bytes", "_ids", "_next", "_seen", "_anchor")

    def __init__(self, token_ids) -> None:
        # packed once (4 bytes a token, searched by bytes.find); read through a view of it
        self._bytes = array("i", token_ids).tobytes()
        self._ids = memoryview(self._bytes).cast("i")
        self._next = 0  # the index of the prediction token expected next; -1: lost
        self._seen = 0  # output tokens followed so far
        self._anchor = 0  # where the output last followed the prediction

    def propose(self, token_ids: list[int], start: int, k: int, n_min: int) -> list[int]:
        """Up to k guesses for what follows the output `token_ids[start:]` (the sequence's tokens
        after its prompt); [] when the prediction is used up or the output has left it."""
        ids = self._ids
        done = len(token_ids) - start
        if done < self._seen:  # the output was cut back (a stop string): follow it again
            self._next, self._seen, self._anchor = 0, 0, 0
        for i in range(start + self._seen, len(token_ids)):
            if 0 <= self._next < len(ids) and ids[self._next] == token_ids[i]:
                self._next += 1
                self._anchor = self._next
            else:
                self._next = -1
        self._seen = done
        if self._next < 0:
            self._next = self._find(token_ids, start, n_min)
        if self._next < 0:
            return []
        return ids[self._next : self._next + k].tolist()

    def _find(self, token_ids: list[int], start: int, n_min: int) -> int:
        """The index after an occurrence of the output's longest suffix (MATCH_MAX down to n_min
        tokens) in the prediction, the first after the anchor if any, else the first at all;
        -1 when none occurs."""
        done = len(token_ids) - start
        data = self._bytes
        n_min = max(1, n_min)
        if done < n_min or array("i", token_ids[-n_min:]).tobytes() not in data:
            return -1  # no longer suffix occurs either: one scan while the output is elsewhere
        for n in range(min(MATCH_MAX, done), n_min - 1, -1):
            pattern = array("i", token_ids[len(token_ids) - n :]).tobytes()
            for lo in (self._anchor * 4, 0):
                at = data.find(pattern, lo)
                while at >= 0 and at % 4:  # a hit across token boundaries: look further on
                    at = data.find(pattern, at + 1)
                if at >= 0:
                    return at // 4 + n
        return -1
