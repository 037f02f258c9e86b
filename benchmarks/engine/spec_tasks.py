"""Copy-heavy prompts for the speculative decoding benchmarks (benchmarks/engine/spec_decode.py,
benchmarks/engine/spec_served.py): edit a given piece of code, quote a given text, summarize a given
text. Their material is this repository's own files (so nothing is downloaded and every run sees
the same text), cut at line boundaries; `copy_tasks(n)` returns n chat messages, cycling over the
three kinds with different stretches of text, ready for the tokenizer's chat template.
"""

from __future__ import annotations

import os

from benchmarks.bench_common import REPO_ROOT

# (kind, instruction, source file, characters of it)
_KINDS = (
    (
        "edit code",
        "Here is a Python module. Rename the function `{name}` to `{name}_v2` everywhere and "
        "return the whole module, changing nothing else:",
        "engine/spec/ngram.py",
        1800,
    ),
    (
        "quote text",
        "Repeat the following text exactly, word for word:",
        "README.md",
        1500,
    ),
    (
        "summarize text",
        "Summarize the following text, quoting its key sentences verbatim:",
        "docs/architecture.md",
        1500,
    ),
)


def _excerpt(path: str, start_line: int, chars: int) -> str:
    with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
        lines = f.read().splitlines()[start_line:]
    out, size = [], 0
    for line in lines:
        if size + len(line) > chars and out:
            break
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)


def copy_tasks(n: int) -> list[tuple[str, list[dict]]]:
    """n (kind, chat messages) pairs: the three kinds in turn, each time on a later stretch."""
    out = []
    for i in range(n):
        kind, instruction, path, chars = _KINDS[i % len(_KINDS)]
        text = _excerpt(path, 20 * (i // len(_KINDS)), chars)
        if kind == "edit code":
            instruction = instruction.format(name="propose" if i % 2 == 0 else "sync")
        out.append((kind, [{"role": "user", "content": f"{instruction}\n\n{text}"}]))
    return out


def compare_tokens(a: list[list[int]], b: list[list[int]]) -> dict:
    """Two runs' token lists, request by request: how many are equal, and where each differs
    first (None: equal)."""
    first = []
    for x, y in zip(a, b):
        mismatch = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None)
        if mismatch is None and len(x) != len(y):
            mismatch = min(len(x), len(y))
        first.append(mismatch)
    return {"equal": sum(m is None for m in first), "of": len(first), "first_mismatch": first}
