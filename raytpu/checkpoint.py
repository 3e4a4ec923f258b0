"""Checkpoint files: atomic writes, CPU-only tensors, safe loading.

A checkpoint directory holds

* ``model.safetensors``: the model weights (and ``ema.safetensors`` with EMA),
  readable without raytpu;
* ``train_state.pt``: optimizer, scheduler, scaler, counters (rank 0);
* ``rng/rank_<r>.pt``: each worker's RNG state (every rank writes its own; Ray
  merges the workers' directories into one checkpoint);
* ``meta.json``: step, epoch, metrics; written last, so a directory without it
  is incomplete and is never loaded.

Every file is written to a temporary name and renamed, so a crash leaves
either the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

META = "meta.json"
MODEL = "model.safetensors"
EMA = "ema.safetensors"
TRAIN_STATE = "train_state.pt"


class CheckpointError(RuntimeError):
    pass


def atomic_write(path: Path, write: Callable[[str], None]) -> None:
    """Call ``write(tmp_path)`` then rename it to ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_weights(path: Path, state_dict: dict[str, torch.Tensor]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    atomic_write(path, lambda tmp: save_file(tensors, tmp))


def save_torch(path: Path, obj: Any) -> None:
    atomic_write(path, lambda tmp: torch.save(obj, tmp))


def save_json(path: Path, obj: dict[str, Any]) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as handle:
            json.dump(obj, handle, indent=2, default=float)

    atomic_write(path, write)


def load_torch(path: Path) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def is_complete(directory: Path) -> bool:
    return (directory / META).is_file() and (directory / MODEL).is_file()


def read_meta(directory: Path) -> dict[str, Any]:
    if not is_complete(directory):
        raise CheckpointError(f"checkpoint {directory} is incomplete (no {META} or {MODEL}); use an earlier one")
    return json.loads((directory / META).read_text())


def load_model_weights(path: str | Path, prefer_ema: bool = True) -> dict[str, torch.Tensor]:
    """Weights from a checkpoint dir, a ``.safetensors`` file or a torch file.

    Torch files may hold a bare state_dict or one under ``state_dict`` / ``model``
    / ``ema`` (the layouts of the seed scripts), loaded with ``weights_only=True``.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"weights {str(path)!r} not found; pass a checkpoint directory or a weights file")
    if path.is_dir():
        read_meta(path)
        chosen = path / EMA if prefer_ema and (path / EMA).is_file() else path / MODEL
        return load_file(chosen)
    if path.suffix == ".safetensors":
        return load_file(path)
    obj = load_torch(path)
    for key in ("ema", "model", "state_dict") if prefer_ema else ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} holds no state_dict")
    return {k.removeprefix("module."): v for k, v in obj.items()}
