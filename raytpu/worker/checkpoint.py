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
import random
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from raytpu.runtime.base import Runtime
from raytpu.storage.run_folder import local_copy

META = "meta.json"
MODEL = "model.safetensors"
EMA = "ema.safetensors"
TRAIN_STATE = "train_state.pt"


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message says what was expected."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (disk full, permissions); earlier checkpoints are intact."""

    def __init__(self, path: str | Path, error: OSError) -> None:
        reason = error.strerror or str(error)
        super().__init__(
            f"cannot write the checkpoint at {path}: {reason}; free space or fix permissions under "
            "run.storage_path, then rerun the same command: it resumes from the last complete checkpoint, "
            "which is untouched"
        )


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


EXPECTED = (
    "expected a raytpu checkpoint directory (model.safetensors and meta.json, the path `raytpu train` prints "
    "as best checkpoint), a .safetensors file, or a torch file holding a state_dict"
)


def check_weights(location: str | Path) -> None:
    """Refuse, in one line, a ``--checkpoint`` / ``checkpoint.weights`` that is not loadable weights:
    reads only a checkpoint's ``meta.json``, a safetensors header or a torch file's index (mmap).
    A bucket URI is copied here first."""
    with local_copy(str(location)) as path:
        _check_weights(path)


def _check_weights(path: Path) -> None:
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} not found; {EXPECTED}")
    if path.is_dir():
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a raytpu checkpoint (no {META} or {MODEL}); {EXPECTED}")
        try:
            json.loads((path / META).read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path / META} is unreadable ({exc}); {EXPECTED}") from exc
        return
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as handle:
                handle.keys()
        except Exception as exc:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path} is not a readable safetensors file ({_reason(exc)}); {EXPECTED}") from exc
        return
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a weights file; {EXPECTED}")
    try:
        state = _state_dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True), prefer_ema=False)
    except Exception as exc:  # pickle, zip and torch errors alike mean "not weights"
        raise CheckpointError(f"{path} holds no loadable weights ({_reason(exc)}); {EXPECTED}") from exc
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} holds no state_dict of tensors; {EXPECTED}")


def _reason(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:160] or type(exc).__name__


def _state_dict(obj: Any, prefer_ema: bool) -> dict[str, Any]:
    """The state_dict in a torch file: bare, or under ``ema`` / ``model`` / ``state_dict`` (seed layouts)."""
    for key in ("ema", "model", "state_dict") if prefer_ema else ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            return obj[key]
    if not isinstance(obj, dict):
        raise CheckpointError(f"the file holds a {type(obj).__name__}, not a state_dict")
    return obj


def load_model_weights(location: str | Path, prefer_ema: bool = True) -> dict[str, torch.Tensor]:
    """Weights from a checkpoint dir, a ``.safetensors`` file or a torch file.

    Torch files may hold a bare state_dict or one under ``state_dict`` / ``model``
    / ``ema`` (the layouts of the seed scripts), loaded with ``weights_only=True``. A bucket URI
    (``s3://.../checkpoint_00000100``) is copied here first, and the copy removed once read.
    """
    with local_copy(str(location)) as path:
        return _load_weights(path, prefer_ema)


def _load_weights(path: Path, prefer_ema: bool) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"weights {str(path)!r} not found; pass a checkpoint directory or a weights file")
    if path.is_dir():
        read_meta(path)
        chosen = path / EMA if prefer_ema and (path / EMA).is_file() else path / MODEL
        return load_file(chosen)
    if path.suffix == ".safetensors":
        return load_file(path)
    try:
        state = _state_dict(load_torch(path), prefer_ema)
    except Exception as exc:
        raise CheckpointError(f"{path} holds no loadable weights ({_reason(exc)}); {EXPECTED}") from exc
    return {k.removeprefix("module."): v for k, v in state.items()}


# ------------------------------------------------------------------ what a run saves
@dataclass
class Progress:
    """Where a run is; saved in ``meta.json`` and restored on resume."""

    step: int = 0
    epoch: int = 0
    best: float | None = None
    #: reports (eval rounds with a checkpoint) so far, counted across resumes: Tune's time unit
    reports: int = 0


def rng_states(runtime: Runtime) -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "runtime": runtime.rng_state(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2])},
        "python": random.getstate(),
    }


def set_rng_states(runtime: Runtime, state: dict[str, Any]) -> None:
    runtime.set_rng_state(state["runtime"])
    keys = state["numpy"]["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, state["numpy"]["pos"]))
    random.setstate(state["python"])


@dataclass
class TrainState:
    """The live objects a checkpoint holds (``ema``: the EMA copy of the model, or ``None``)."""

    model: nn.Module
    ema: nn.Module | None
    optimizer: torch.optim.Optimizer
    scheduler: Any


class Checkpointer:
    """What a checkpoint holds and how it is written and read back, for one worker.

    Every rank writes its RNG state; rank 0 writes the weights (``model`` and ``ema``
    safetensors), ``train_state.pt`` (optimizer, scheduler, loss scaler) and ``meta.json``
    (progress, metrics, config) last. Tensors are moved to the CPU first, never pickled on an
    accelerator.
    """

    def __init__(self, runtime: Runtime, job_name: str, config: dict[str, Any]) -> None:
        self.runtime, self.job_name, self.config = runtime, job_name, config

    def save(
        self, directory: Path, state: TrainState, progress: Progress, metrics: dict[str, Any], reason: str = "scheduled"
    ) -> None:
        """``reason``: why it is taken (``raytpu.worker.cadence.REASONS``), recorded in ``meta.json``."""
        try:
            self._save(directory, state, progress, metrics, reason)
        except OSError as exc:
            raise CheckpointWriteError(exc.filename or directory, exc) from exc

    def _save(
        self, directory: Path, state: TrainState, progress: Progress, metrics: dict[str, Any], reason: str
    ) -> None:
        rt = self.runtime
        save_torch(directory / "rng" / f"rank_{rt.rank}.pt", rng_states(rt))
        model_state = rt.to_cpu(rt.unwrap(state.model).state_dict())
        ema_state = rt.to_cpu(state.ema.state_dict()) if state.ema is not None else None
        train_state = rt.to_cpu(
            {
                "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(),
                "scaler": rt.scaler_state(),
            }
        )
        if not rt.is_main:
            return
        save_weights(directory / MODEL, model_state)
        if ema_state is not None:
            save_weights(directory / EMA, ema_state)
        save_torch(directory / TRAIN_STATE, train_state)
        meta = {**asdict(progress), "reason": reason, "metrics": metrics, "job": self.job_name, "config": self.config}
        meta["world_size"] = rt.world_size  # every rank's RNG file must be there for the checkpoint to be whole
        save_json(directory / META, meta)

    def read(self, directory: Path) -> dict[str, Any]:
        """Every file of ``directory`` read and checked (all ranks' RNG files too, so that every
        rank reaches the same verdict), touching no live state; a :class:`CheckpointError` that
        names what is wrong when the checkpoint is incomplete or unreadable."""
        if not is_complete(directory):
            raise CheckpointError(f"{directory} is incomplete (no {META} or {MODEL})")
        try:
            meta = json.loads((directory / META).read_text())
            progress = Progress(meta["step"], meta["epoch"], meta.get("best"), meta.get("reports", 0))
            loaded: dict[str, Any] = {"meta": meta, "progress": progress}
            loaded["model"] = load_file(directory / MODEL)
            loaded["ema"] = load_file(directory / EMA) if (directory / EMA).is_file() else None
            loaded["train_state"] = load_torch(directory / TRAIN_STATE)
            rng = {path.name: load_torch(path) for path in sorted((directory / "rng").glob("rank_*.pt"))}
        except Exception as exc:  # json, safetensors, zip and pickle errors: the files are damaged
            raise CheckpointError(f"{directory} is unreadable ({_reason(exc)})") from exc
        ranks = meta.get("world_size", len(rng))
        if len(rng) < ranks:  # a copy that stopped part-way (an object store writes each file whole)
            raise CheckpointError(f"{directory} is incomplete (the RNG state of {len(rng)} of {ranks} workers)")
        loaded["rng"] = rng.get(f"rank_{self.runtime.rank}.pt")
        return loaded

    def restore(self, loaded: dict[str, Any], state: TrainState) -> tuple[Progress, dict[str, Any]]:
        """Put what :meth:`read` returned into ``state``; the progress and the metrics it was saved with."""
        self.runtime.unwrap(state.model).load_state_dict(loaded["model"])
        if state.ema is not None and loaded["ema"] is not None:
            state.ema.load_state_dict(loaded["ema"])
        saved = loaded["train_state"]
        state.optimizer.load_state_dict(saved["optimizer"])
        state.scheduler.load_state_dict(saved["scheduler"])
        self.runtime.load_scaler_state(saved.get("scaler"))
        if loaded["rng"] is not None:
            set_rng_states(self.runtime, loaded["rng"])
        return loaded["progress"], loaded["meta"].get("metrics", {})
