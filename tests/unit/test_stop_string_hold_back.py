"""The router's stop-string hold-back (router/text.py TextStream._held_back): the text that may
be the start of a stop string, found without re-testing every stop string at every prefix length
on each token. It must equal the scan it replaced on every input, and its work must not grow with
the stop strings' lengths (the decode loop runs it for every event of every sequence)."""

from __future__ import annotations

import random
import sys

from pdserve.router.text import TextStream


def old_held_back(text: str, stops) -> int:
    """The scan _held_back replaced, kept as the reference: every stop string, every prefix
    length, longest first."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


class CharTokenizer:
    """Token id i is the character chr(i): a stream's text is exactly the ids it was given."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class OldTextStream(TextStream):
    def _held_back(self, text: str) -> int:
        return old_held_back(text, self.stops)


def _stream(stops, cls=TextStream) -> TextStream:
    return cls(CharTokenizer(), [], True, tuple(stops), include_stop_str=False)


def _random_case(rng: random.Random) -> tuple[str, list[str]]:
    alphabet = rng.choice(["ab", "abc", "a b", "xyz ab"])
    stops = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))
        for _ in range(rng.randint(1, 5))
    ]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
    return text, stops


def test_the_held_back_length_equals_the_old_scan_as_the_text_grows():
    rng = random.Random(1234)
    for _ in range(3000):
        text, stops = _random_case(rng)
        stream = _stream(stops)
        end = 0
        while True:  # the text arrives in pieces, as a stream's deltas do
            assert stream._held_back(text[:end]) == old_held_back(text[:end], stops), (
                text[:end],
                stops,
            )
            if end == len(text):
                break
            end = min(len(text), end + rng.randint(0, 4))
        # a call with a text it has not seen grow (not one the stream makes) searches it all
        assert stream._held_back(text[:3]) == old_held_back(text[:3], stops)


def test_a_stream_sends_the_same_text_as_with_the_old_scan():
    rng = random.Random(99)
    for _ in range(1500):
        text, stops = _random_case(rng)
        new, old = _stream(stops), _stream(stops, OldTextStream)
        ids = [ord(c) for c in text]
        i = 0
        while i < len(ids):
            step = ids[i : i + rng.randint(1, 3)]
            i += len(step)
            assert new.add(step) == old.add(step), (text, stops)
        assert new.flush() == old.flush()
        assert (new.stopped, new.stop_str) == (old.stopped, old.stop_str)


def _calls_per_event(stream: TextStream, text: str, start: int) -> list[int]:
    """The Python and C function calls each _held_back makes as `text` grows one character at a
    time from `start` characters (a count of its work, independent of the machine's speed)."""
    counts = []

    def count(frame, event, arg):
        if event in ("call", "c_call"):
            counts[-1] += 1

    for end in range(start, len(text) + 1):
        counts.append(0)
        sys.setprofile(count)
        try:
            stream._held_back(text[:end])
        finally:
            sys.setprofile(None)
    return counts


def test_the_work_per_event_does_not_grow_with_the_stop_strings_length():
    # words with spaces, and stop strings that start with a space but never match: the old scan
    # tested each one at every prefix length (511 checks each for 512 characters)
    rng = random.Random(5)
    words = " ".join(rng.choice(["the", "cat", "sat", "on", "a", "mat"]) for _ in range(400))
    for_length = {}
    for length in (8, 64, 512):
        stops = [" " + chr(ord("A") + k) * (length - 1) for k in range(64)]
        stream = _stream(stops)
        stream._held_back(words[:1000])
        for_length[length] = _calls_per_event(stream, words, 1001)
    assert for_length[8] == for_length[64] == for_length[512]
    assert max(for_length[512]) <= 12 * 64  # a few calls per stop string


def test_repeated_text_that_keeps_matching_half_a_stop_string_costs_a_few_calls_per_event():
    # "aaa..." is a suffix of each stop string's first half: each event tests its two longest
    # candidates, where the old scan tested every length from the stop's down to its half
    text = "a" * 3000
    per_event = {}
    for length in (16, 512):
        half = length // 2
        stops = ["a" * half + chr(ord("b") + k) + "a" * (length - half - 1) for k in range(64)]
        stream = _stream(stops)
        stream._held_back(text[:1000])
        per_event[length] = _calls_per_event(stream, text, 1001)
        assert stream._held_back(text) == half
    assert per_event[16] == per_event[512]
    assert max(per_event[512]) <= 12 * 64
