"""The router's text stream (router/text.py): text that may be the start of a stop string is held
back until the next tokens say whether it is one. The router end to end:
tests/integration/test_router.py."""

from __future__ import annotations

from pdserve.engine.tokenizer import load_tokenizer
from pdserve.router.text import TextStream


def test_text_that_may_start_a_stop_string_is_held_back(tiny_models):
    tokenizer = load_tokenizer(tiny_models("llama-gqa")[0])
    cut = TextStream(tokenizer, [3], True, ("t6 t7",), include_stop_str=False)
    assert [cut.add([5]), cut.add([6]), cut.add([7]), cut.flush()] == [" t5", " ", "", ""]
    assert cut.stopped
    kept = TextStream(tokenizer, [3], True, ("t6 t7",), include_stop_str=True)
    assert "".join([kept.add([5]), kept.add([6]), kept.add([7]), kept.flush()]) == " t5 t6 t7"
    miss = TextStream(tokenizer, [3], True, ("t6 t8",), include_stop_str=False)
    assert [miss.add([5]), miss.add([6]), miss.add([7])] == [
        " t5",
        " ",
        "t6 t7",
    ] and not miss.stopped
