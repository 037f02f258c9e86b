"""Models named by Hugging Face Hub id: `ORG/NAME`, or `ORG/NAME@REVISION` (a branch, a tag or a
commit), resolved to a snapshot directory of the hub cache through `huggingface_hub` itself.

The library owns the cache and its settings: HF_HOME or HF_HUB_CACHE (where the cache is),
HF_HUB_OFFLINE=1 (never reach the Hub: the cache alone answers), HF_TOKEN (private and gated
repositories), HF_ENDPOINT. Only what serving needs is downloaded, once, with the library's
progress bars: the top-level JSON files (config, tokenizer, generation config, shard index), the
safetensors weights, and the tokenizer's other files. This module keeps no state; every process
that resolves an id (the router in the driver, each worker) asks the cache on its own machine.
resolve.py decides when a model string is a hub id: only when no local path of that name exists.
"""

from __future__ import annotations

import pathlib
import re

# What serving reads from a repository: its top-level files only (a repo's subfolders hold other
# formats: onnx/, gguf/, original/ checkpoints).
ALLOW_PATTERNS = [
    "*.json",
    "*.safetensors",
    "*.jinja",
    "tokenizer.model",
    "merges.txt",
    "*.tiktoken",
]
IGNORE_PATTERNS = ["*/*"]

# The Hub's own repository name rule: letters, digits, '-', '_', '.', not starting or ending with
# '-' or '.', and no '--' or '..'; the optional @REVISION is anything without whitespace.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"(?P<repo>{_PART}/{_PART})(?:@(?P<revision>\S+))?")


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `model` is spelled as a hub id, else None."""
    match = _HUB_ID.fullmatch(model)
    if match is None or "--" in match["repo"] or ".." in match["repo"]:
        return None
    return match["repo"], match["revision"]


def _what_to_do(repo: str, revision: str | None) -> str:
    at = f" --revision {revision}" if revision else ""
    return (
        f"set HF_HUB_OFFLINE=0 to let pdserve download it, download it first with "
        f"`hf download {repo}{at}` (or `huggingface-cli download {repo}{at}`), or give a local "
        f"directory"
    )


def hub_snapshot(model: str, repo: str, revision: str | None) -> pathlib.Path:
    """The cache's snapshot directory of `repo` at `revision` (default: main), downloaded first
    unless it is cached or offline; a ValueError whose one line says what to do otherwise."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"model: {model!r}"
    try:
        folder = snapshot_download(
            repo, revision=revision, allow_patterns=ALLOW_PATTERNS, ignore_patterns=IGNORE_PATTERNS
        )
    except GatedRepoError:
        raise ValueError(
            f"{where} is a gated repository on the Hugging Face Hub: accept its terms on its page, "
            f"then set HF_TOKEN to a token of that account"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{where} is neither a local directory nor a model on the Hugging Face Hub (a private "
            f"one needs HF_TOKEN set)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(
            f"{where}: {repo} has no revision {revision!r} on the Hugging Face Hub (give a branch, "
            f"a tag or a commit after '@')"
        ) from None
    except LocalEntryNotFoundError:  # an incomplete snapshot's error too (a subclass)
        at = f" at revision {revision!r}" if revision else ""
        if constants.is_offline_mode():
            why = "HF_HUB_OFFLINE is set"
        else:
            why = "the Hugging Face Hub cannot be reached"
        raise ValueError(
            f"{where}: not a local directory, and {repo}{at} is not (wholly) in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) while {why}: {_what_to_do(repo, revision)}"
        ) from None
    except HfHubHTTPError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{where}: the Hugging Face Hub answered: {first}") from None
    return _checked(model, repo, pathlib.Path(folder))


def _checked(model: str, repo: str, folder: pathlib.Path) -> pathlib.Path:
    """`folder` once it holds an HF model pdserve can load; else why not, in one line."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    if any(folder.glob("*.gguf")):
        missing = "holds GGUF files but no safetensors"
    elif (folder / "config.json").is_file():
        missing = "has no *.safetensors weights"
    else:
        missing = "has no config.json and *.safetensors weights"
    raise ValueError(
        f"model: {model!r}: the snapshot of {repo} ({folder}) {missing}; pdserve serves "
        f"safetensors repositories from the Hub (a GGUF repository: download one .gguf with "
        f"`hf download {repo} FILE.gguf` and give its path)"
    )
