"""Reading HF-format checkpoints: config.json and the safetensors files, sharded or not."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(model_dir: str | os.PathLike) -> dict:
    with open(pathlib.Path(model_dir) / "config.json", encoding="utf-8") as f:
        return json.load(f)


def checkpoint_files(model_dir: str | os.PathLike) -> list[pathlib.Path]:
    """The safetensors files that make up the checkpoint, in a stable order."""
    model_dir = pathlib.Path(model_dir)
    # The index wins over a stray single file or leftover shards: it is what HF itself loads.
    index = model_dir / INDEX_FILE
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def checkpoint_names(model_dir: str | os.PathLike) -> list[str]:
    """The names of every tensor of the checkpoint, from the files' headers (no tensor is read)."""
    names = []
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names += list(f.keys())
    return names


def checkpoint_shapes(model_dir: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, from the files' headers (no tensor is read)."""
    shapes = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _progress_disabled() -> bool:
    return os.environ.get("PDSERVE_NO_PROGRESS", "") not in ("", "0")


def iter_safetensors(
    model_dir: str | os.PathLike, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for every tensor of the checkpoint in `model_dir` (every one whose
    name `keep` accepts, where given: the others are never read).

    Tensors are read one at a time so the caller can place (and shard) each before the next is
    loaded; peak host memory stays near one tensor rather than the whole model.
    """
    files = checkpoint_files(model_dir)
    # Opening a file only parses its JSON header, so counting up front is cheap and lets the bar
    # show a real total across shards.
    counts = []
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            counts.append(len([n for n in f.keys() if keep is None or keep(n)]))
    with tqdm(
        total=sum(counts),
        desc=f"loading {pathlib.Path(model_dir).name}",
        unit="tensor",
        disable=_progress_disabled(),
        leave=False,
    ) as bar:
        for path in files:
            bar.set_postfix_str(path.name)
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if keep is not None and not keep(name):
                        continue
                    yield name, f.get_tensor(name)
                    bar.update(1)
