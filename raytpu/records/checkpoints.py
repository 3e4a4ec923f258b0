"""Checkpoint files: atomic writes, CPU-only tensors, safe loading.

A checkpoint directory holds

* ``model.safetensors``: the model weights (and ``ema.safetensors`` with EMA),
  readable without raytpu; or, from a sharded run (FSDP2), ``sharded/``: the model and
  optimizer state as ``torch.distributed.checkpoint`` writes it, each rank its own shards
  (``__<rank>_0.distcp``) and rank 0 the index (``.metadata``), readable by any number of ranks;
* ``train_state.pt``: optimizer (unsharded runs), scheduler, scaler (rank 0);
* ``rng/rank_<r>.pt``: each worker's RNG state (every rank writes its own; Ray
  merges the workers' directories into one checkpoint);
* ``meta.json``: step, epoch, metrics; written last, so a directory without it
  is incomplete and is never loaded.

Every file is written to a temporary name and renamed, so a crash leaves
either the old file or the new one, never half of one. The workers write them
(``raytpu.worker.checkpoint``); the driver reads them too (``--checkpoint``,
``raytpu export``), so the format lives here, where both sides import it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from raytpu.storage.run_folder import local_copy

META = "meta.json"


MODEL = "model.safetensors"


EMA = "ema.safetensors"


TRAIN_STATE = "train_state.pt"


SHARDED = "sharded"


#: the file ``torch.distributed.checkpoint`` writes last, once every rank's shards are in
SHARDED_INDEX = f"{SHARDED}/.metadata"


class CheckpointError(ValueError):
    """A checkpoint or weights file that cannot be used; the message says what was expected."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint (or another record of the run: ``what``) could not be written (disk full,
    permissions); earlier checkpoints are intact."""

    def __init__(self, path: str | Path, reason: str, what: str = "the checkpoint") -> None:
        super().__init__(
            f"cannot write {what} at {path}: {reason}; free space or fix permissions under "
            "run.storage_path, then rerun the same command: it resumes from the last complete checkpoint, "
            "which is untouched"
        )

    @classmethod
    def of(cls, error: BaseException, where: str | Path, what: str = "the checkpoint") -> CheckpointWriteError | None:
        """``error`` as a failed write of a checkpoint at ``where``, or None where it is none. A full
        disk reaches Python in several forms: an ``OSError`` (ENOSPC), ``shutil.Error``'s list of
        failed copies, safetensors' ``SafetensorError`` ("os error 28"), and torch.save's
        ``RuntimeError`` from its C++ writer ("unexpected pos", "file write failed")."""
        if isinstance(error, CheckpointWriteError):
            return error
        text = str(error)
        if isinstance(error, OSError) and not isinstance(error, shutil.Error):
            full = error.errno == errno.ENOSPC
            path = error.filename or where
            return cls(path, space_left(path) if full else error.strerror or text, what)
        if "No space left" in text or "os error 28" in text or "[Errno 28]" in text:
            return cls(where, space_left(where), what)
        if isinstance(error, RuntimeError) and any(mark in text for mark in TORCH_WRITE_FAILURES):
            reason = space_left(where) if free_bytes(where) < FULL_BELOW else "torch.save could not write it"
            return cls(where, reason, what)
        if isinstance(error, shutil.Error):
            return cls(where, "a file could not be copied", what)
        return None


def full_disk_in(error: BaseException, where: str | Path) -> CheckpointWriteError | None:
    """A full disk anywhere in ``error``'s chain (its causes and the errors it was raised while
    handling) as the one-line error of a write under ``where`` (the run folder: a JSON record, the
    goodput record, Ray Train's own state), or None; a failed checkpoint write says its own."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, CheckpointWriteError):
            return seen
        if isinstance(seen, OSError) and (seen.errno == errno.ENOSPC or "No space left" in str(seen)):
            return CheckpointWriteError(where, space_left(where), "the run's records")
        seen = seen.__cause__ or seen.__context__
    return None


#: what torch.save's C++ writer says when a write failed (a full disk, most often)
TORCH_WRITE_FAILURES = ("unexpected pos", "file write failed", "PytorchStreamWriter failed")
#: free bytes under which a failed torch.save is taken for a full disk
FULL_BELOW = 64 * 2**20


def free_bytes(where: str | Path) -> int:
    """Free bytes on the filesystem of ``where`` (its nearest existing folder); large when unknown."""
    path = Path(where)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 2**62


def space_left(where: str | Path) -> str:
    """What is left at ``where``, and, in a run folder that has a complete checkpoint, about how
    much the next one needs (the newest one's size)."""
    free = free_bytes(where)
    known = [f"{free / 2**20:.0f} MB free"] if free < 2**62 else []
    needed = last_checkpoint_bytes(where)
    known += [f"a checkpoint takes about {needed / 2**20:.0f} MB"] if needed else []
    return f"no space left on its disk ({'; '.join(known)})" if known else "no space left on its disk"


def last_checkpoint_bytes(where: str | Path) -> int:
    """The size of the newest complete checkpoint of the run folder at or above ``where`` (a
    checkpoint folder or a file in one; 0 where there is none, or the folder is in a bucket)."""
    path = Path(where)
    for folder in (path, *list(path.parents)[:3]):
        found = [c for c in sorted(folder.glob("checkpoint_*")) if c != path and (c / META).is_file()]
        if found:
            return sum(f.stat().st_size for f in found[-1].rglob("*") if f.is_file())
    return 0


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


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter (or buffer) name that shares its tensor with an earlier name, mapped to that
    name: a tied output layer (``lm_head.weight`` -> ``model.embed_tokens.weight``). safetensors
    refuses to write one tensor twice, and Transformers' own files hold the earlier name alone."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return tied


def without_ties(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """``state_dict`` with each tied name of ``model`` left out (written once, under the earlier name)."""
    tied = tied_names(model)
    return {key: value for key, value in state_dict.items() if key not in tied}


def frozen_names(model: nn.Module) -> set[str]:
    """The names of ``model``'s parameters that do not train (a LoRA run's base), where some do, as
    its state dict names them (a wrapper's own prefixes hidden, as in a checkpoint). A model that
    trains every parameter has none, found without asking for its state dict (a job's may be slow)."""
    from raytpu.parallel.scan import unstacked_training

    if all(param.requires_grad for param in model.parameters()):
        return set()
    state = model.state_dict(keep_vars=True)
    trains = {name: value.requires_grad for name, value in state.items() if isinstance(value, nn.Parameter)}
    trains.update(unstacked_training(model))  # scanned layers' weights, stacked (xla.scan_layers)
    frozen = {name for name, training in trains.items() if not training}
    return frozen if len(frozen) < len(trains) else set()


def trained_state(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """What a checkpoint of ``model`` holds: its state less the parameters that do not train (they
    come from where the model is built: a pretrained base)."""
    frozen = frozen_names(model)
    return {key: value for key, value in state_dict.items() if key not in frozen}


def load_into(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load ``weights`` into ``model`` strictly, a tied name that the weights leave out (raytpu's
    and Transformers' files hold a tied tensor once) taking its twin's tensor; a checkpoint of what
    trains (:func:`trained_state`) leaves the frozen parameters as the model was built."""
    filled = with_ties(weights, model)
    missing = set(model.state_dict()) - set(filled)
    partial = bool(missing) and missing <= frozen_names(model)
    model.load_state_dict(filled, strict=not partial)


def with_ties(weights: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """``weights`` with every tied name of ``model`` that they lack filled in from its twin."""
    filled = dict(weights)
    for name, twin in tied_names(model).items():
        if name not in filled and twin in filled:
            filled[name] = filled[twin]
        elif twin not in filled and name in filled:
            filled[twin] = filled[name]
    return filled


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
    weights = (directory / MODEL).is_file() or (directory / SHARDED_INDEX).is_file()
    return (directory / META).is_file() and weights


def is_sharded(directory: Path) -> bool:
    return (directory / SHARDED_INDEX).is_file()


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
            raise CheckpointError(f"{path} is not a readable safetensors file ({reason_of(exc)}); {EXPECTED}") from exc
        return
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a weights file; {EXPECTED}")
    try:
        state = _state_dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True), prefer_ema=False)
    except Exception as exc:  # pickle, zip and torch errors alike mean "not weights"
        raise CheckpointError(f"{path} holds no loadable weights ({reason_of(exc)}); {EXPECTED}") from exc
    if not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} holds no state_dict of tensors; {EXPECTED}")


def reason_of(exc: BaseException) -> str:
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


def load_sharded_model(folder: Path) -> dict[str, torch.Tensor]:
    """The whole model of a sharded checkpoint, in this one process: every ``model.*`` entry of
    the index, read from the ranks' shards at its full size (the optimizer's entries are not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in entries.items()
        if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    state = {"model": model}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state["model"]


def _load_weights(path: Path, prefer_ema: bool) -> dict[str, torch.Tensor]:
    if not path.exists():
        raise CheckpointError(f"weights {str(path)!r} not found; pass a checkpoint directory or a weights file")
    if path.is_dir():
        read_meta(path)
        if is_sharded(path):
            return load_sharded_model(path / SHARDED)
        chosen = path / EMA if prefer_ema and (path / EMA).is_file() else path / MODEL
        return load_file(chosen)
    if path.suffix == ".safetensors":
        return load_file(path)
    try:
        state = _state_dict(load_torch(path), prefer_ema)
    except Exception as exc:
        raise CheckpointError(f"{path} holds no loadable weights ({reason_of(exc)}); {EXPECTED}") from exc
    return {k.removeprefix("module."): v for k, v in state.items()}
