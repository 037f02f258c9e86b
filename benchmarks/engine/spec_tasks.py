"""Copy-heavy prompts for the speculative decoding benchmarks (benchmarks/engine/spec_decode.py,
benchmarks/engine/spec_served.py): edit a given piece of code, quote a given text, summarize a given
text. Their material is three of this repository's files as they were at commit c6af161, where
the recorded speculation figures were measured, kept in benchmarks/engine/spec_material/ (so
nothing is downloaded, and a later edit of the README or the code does not change the prompts);
cut at line boundaries, `copy_tasks(n)` returns n chat messages, cycling over the three kinds with
different stretches of text, ready for the tokenizer's chat template.
"""

from __future__ import annotations

import os

MATERIAL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "spec_material")

# (kind, instruction, material file in spec_material/, characters of it)
_KINDS = (
    (
        "edit code",
        "Here is a Python module. Rename the function `{name}` to `{name}_v2` everywhere and "
        "return the whole module, changing nothing else:",
        "ngram_py.txt",
        1800,
    ),
    (
        "quote text",
        "Repeat the following text exactly, word for word:",
        "readme_md.txt",
        1500,
    ),
    (
        "summarize text",
        "Summarize the following text, quoting its key sentences verbatim:",
        "architecture_md.txt",
        1500,
    ),
)


def _excerpt(path: str, start_line: int, chars: int) -> str:
    with open(os.path.join(MATERIAL, path), encoding="utf-8") as f:
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


def edit_tasks(n: int) -> list[tuple[list[dict], str]]:
    """n code edits (the "edit code" kind on later and later stretches) with the answer a client
    would predict for each: the module with the rename done (OpenAI's Predicted Outputs)."""
    _, instruction, path, chars = _KINDS[0]
    out = []
    for i in range(n):
        name = "propose" if i % 2 == 0 else "sync"
        text = _excerpt(path, 20 * i, chars)
        ask = instruction.format(name=name)
        expected = text.replace(f"{name}(", f"{name}_v2(")
        out.append(([{"role": "user", "content": f"{ask}\n\n{text}"}], expected))
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
