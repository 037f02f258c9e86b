"""The documents name files that exist: every repository path docs/architecture.md, the README
and the benchmark and experiment READMEs mention (a folder ending in `/`, or a file with an
extension) is checked against the tree, so a rename cannot leave the map pointing at nothing."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = ["docs/architecture.md", "README.md", "benchmarks/README.md", "experiments/README.md"]
# a relative path: segments of word characters joined by "/", ending in a file extension or "/"
PATH = re.compile(
    r"(?<![\w./~:-])((?:[A-Za-z_][\w.-]*/)+(?:[\w-]+\.(?:py|md|cpp|proto|yaml|json|sh|toml|csv|gz))?)"
)
TOP = {p.name for p in ROOT.iterdir()}


def named_paths(text: str) -> set[str]:
    found = set()
    for m in PATH.finditer(text):
        path = m.group(1)
        if path.split("/")[0] in TOP:  # not a path of some other tree (/dev/shm, ~/.cache, ...)
            found.add(path)
    return found


def test_the_path_pattern_finds_files_and_folders():
    text = "see `engine/scheduler.py` and router/ (and not /dev/shm/x.py or ~/.cache/pdserve/)"
    assert named_paths(text) == {"engine/scheduler.py", "router/"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_document_names_exists(doc):
    paths = named_paths((ROOT / doc).read_text())
    assert paths, f"{doc} names no path: the pattern is broken"
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"
