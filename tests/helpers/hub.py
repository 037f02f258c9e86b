"""A Hugging Face hub cache built by a test in the library's own layout, so that a model named
`ORG/NAME` resolves offline (engine/loader/hub.py) without anything downloaded:

    HF_HUB_CACHE/models--ORG--NAME/blobs/<id>                       the files' bytes
    HF_HUB_CACHE/models--ORG--NAME/refs/main                        the commit main points to
    HF_HUB_CACHE/models--ORG--NAME/snapshots/<commit>/<file> -> ../../blobs/<id>
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(
    hub_cache: pathlib.Path, repo_id: str, model_dir: pathlib.Path, commit: str = COMMIT
) -> pathlib.Path:
    """Puts the files of `model_dir` into `hub_cache` as `repo_id`'s snapshot at `commit`, with
    refs/main pointing to it; returns the snapshot directory. Blobs are hard links where the
    filesystem allows (a converted SmolLM2 is 540 MB), else copies."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / commit
    blobs.mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in pathlib.Path(model_dir).iterdir() if p.is_file()):
        # the Hub names a blob by its git or LFS hash; any name unique to the bytes will do here
        blob = blobs / hashlib.sha256(f"{src.name}:{src.stat().st_size}".encode()).hexdigest()
        if not blob.exists():
            try:
                os.link(src, blob)
            except OSError:
                shutil.copyfile(src, blob)
        link = snapshot / src.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot
