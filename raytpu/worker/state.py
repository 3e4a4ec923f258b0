"""What a worker saves and restores: :class:`Checkpointer` writes the model (and its EMA), the
optimizer, scheduler and loss scaler, every rank's RNG state and the :class:`Progress` of the run
into a checkpoint directory, and restores them, so that a resumed run continues as if never
stopped. The files themselves (their format, atomic writes, safe loading) are
``raytpu.records.checkpoints``."""

from __future__ import annotations

import json
import random
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch import nn

from raytpu.records.checkpoints import (
    EMA,
    META,
    MODEL,
    SHARDED,
    TRAIN_STATE,
    CheckpointError,
    CheckpointWriteError,
    frozen_names,
    is_complete,
    is_sharded,
    load_into,
    load_torch,
    reason_of,
    save_json,
    save_torch,
    save_weights,
    trained_state,
    without_ties,
)
from raytpu.runtime.base import Runtime
from raytpu.worker.optim import keep_configured_lr

if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException


# ------------------------------------------------------------------ what a run saves
@dataclass
class Progress:
    """Where a run is; saved in ``meta.json`` and restored on resume."""

    step: int = 0
    epoch: int = 0
    best: float | None = None
    #: reports (eval rounds with a checkpoint) so far, counted across resumes: Tune's time unit
    reports: int = 0
    #: ``[step, base lr]`` each time the weights went on with another base lr, from the first step,
    #: across resumes (a population-based sweep's trial takes another's checkpoint with its own lr)
    lr_steps: list[list[float]] = field(default_factory=list)

    def went_on_with(self, lr: float) -> None:
        """Record that training goes on from here with base lr ``lr`` (nothing when it is unchanged)."""
        if not self.lr_steps or self.lr_steps[-1][1] != lr:
            self.lr_steps.append([self.step, lr])


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


class ShardingMismatch(RuntimeError):
    """A checkpoint written with another sharding than the run's (a different layout of the files)."""


def save_shards(folder: Path, state: TrainState) -> None:
    """The model's and the optimizer's state as ``torch.distributed.checkpoint`` writes it: each rank
    its own shards, rank 0 the index, no gather onto one process (a collective of every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    model_state, optimizer_state = sharded_state(state)
    with warnings.catch_warnings():  # torch 2.9's writer asks tensor.storage() of each tensor it writes
        warnings.filterwarnings("ignore", "TypedStorage is deprecated", UserWarning)
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))
        except CheckpointException as exc:  # a BaseException, holding each rank's own error
            raise first_failure(exc) from None


def first_failure(exc: CheckpointException) -> BaseException:
    """The error of the first rank that failed to write its part of a sharded checkpoint."""
    failures = exc.failures
    return failures[min(failures)][0] if failures else RuntimeError(str(exc))


def load_shards(folder: Path, state: TrainState) -> None:
    """Each rank reads the parts of :func:`save_shards`'s files its shards cover, whatever the number
    of ranks that wrote them (``torch.distributed.checkpoint`` reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_state, optimizer_state = sharded_state(state)
    saved = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(saved, checkpoint_id=str(folder))
    options = shard_options(state.model)
    set_state_dict(
        state.model,
        state.optimizer,
        model_state_dict=saved["model"],
        optim_state_dict=saved["optimizer"],
        options=options,
    )


def sharded_state(state: TrainState) -> tuple[dict[str, Any], dict[str, Any]]:
    """What a sharded checkpoint holds: the model's state (less what does not train: a LoRA run's
    frozen base, a tied name of it too) and the optimizer's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(state.model, state.optimizer, options=shard_options(state.model))
    frozen = frozen_names(state.model)
    return {key: value for key, value in model_state.items() if key not in frozen}, optimizer_state


def shard_options(model: nn.Module) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = bool(frozen_names(model))
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


class Checkpointer:
    """What a checkpoint holds and how it is written and read back, for one worker.

    Every rank writes its RNG state; rank 0 writes the weights (``model`` and ``ema``
    safetensors), ``train_state.pt`` (optimizer, scheduler, loss scaler) and ``meta.json``
    (progress, metrics, config) last. Tensors are moved to the CPU first, never pickled on an
    accelerator. A sharded run's ranks write the model and optimizer shards together instead
    (:func:`save_shards`).
    """

    def __init__(self, runtime: Runtime, job_name: str, config: dict[str, Any], command: str = "") -> None:
        """``command``: the id of the command whose attempts write the checkpoints (in ``meta.json``)."""
        self.runtime, self.job_name, self.config, self.command = runtime, job_name, config, command

    def save(
        self, directory: Path, state: TrainState, progress: Progress, metrics: dict[str, Any], reason: str = "scheduled"
    ) -> None:
        """``reason``: why it is taken (``raytpu.worker.cadence.REASONS``), recorded in ``meta.json``."""
        try:
            self._save(directory, state, progress, metrics, reason)
        except Exception as exc:
            failure = CheckpointWriteError.of(exc, directory)
            if failure is None:
                raise
            raise failure from exc

    def _save(
        self, directory: Path, state: TrainState, progress: Progress, metrics: dict[str, Any], reason: str
    ) -> None:
        rt = self.runtime
        save_torch(directory / "rng" / f"rank_{rt.rank}.pt", rng_states(rt))
        if rt.sharded:
            save_shards(directory / SHARDED, state)
        else:
            model = rt.unwrap(state.model)
            model_state = trained_state(without_ties(rt.to_cpu(model.state_dict()), model), model)
            ema_state = without_ties(rt.to_cpu(state.ema.state_dict()), state.ema) if state.ema is not None else None
            optimizer_state = rt.to_cpu(state.optimizer.state_dict())
        if not rt.is_main:
            return
        train_state = {"scheduler": state.scheduler.state_dict(), "scaler": rt.to_cpu(rt.scaler_state())}
        if not rt.sharded:
            train_state["optimizer"] = optimizer_state
            save_weights(directory / MODEL, model_state)
            if ema_state is not None:
                save_weights(directory / EMA, ema_state)
        save_torch(directory / TRAIN_STATE, train_state)
        meta = {**asdict(progress), "reason": reason, "metrics": metrics, "job": self.job_name, "config": self.config}
        meta["world_size"] = rt.world_size  # every rank's RNG file must be there for the checkpoint to be whole
        meta["sharded"] = rt.sharded
        meta["command"] = self.command
        save_json(directory / META, meta)

    def read(self, directory: Path) -> dict[str, Any]:
        """Every file of ``directory`` read and checked (all ranks' RNG files too, so that every
        rank reaches the same verdict), touching no live state; a :class:`CheckpointError` that
        names what is wrong when the checkpoint is incomplete or unreadable."""
        if not is_complete(directory):
            raise CheckpointError(f"{directory} is incomplete (no {META} or {MODEL})")
        sharded = is_sharded(directory)
        if sharded != self.runtime.sharded:
            raise ShardingMismatch(
                f"{directory} was written by a {'sharded' if sharded else 'data-parallel'} run and this run is "
                f"{'sharded' if self.runtime.sharded else 'not'}: resume with the sharding.strategy it was saved "
                "with, or start a new run (run.name) from its weights with checkpoint.weights"
            )
        try:
            meta = json.loads((directory / META).read_text())
            progress = Progress(
                meta["step"], meta["epoch"], meta.get("best"), meta.get("reports", 0), meta.get("lr_steps", [])
            )
            loaded: dict[str, Any] = {"meta": meta, "progress": progress}
            loaded["shards"] = directory / SHARDED if sharded else None
            loaded["model"] = None if sharded else load_file(directory / MODEL)
            loaded["ema"] = load_file(directory / EMA) if (directory / EMA).is_file() else None
            loaded["train_state"] = load_torch(directory / TRAIN_STATE)
            rng = {path.name: load_torch(path) for path in sorted((directory / "rng").glob("rank_*.pt"))}
        except Exception as exc:  # json, safetensors, zip and pickle errors: the files are damaged
            raise CheckpointError(f"{directory} is unreadable ({reason_of(exc)})") from exc
        ranks = meta.get("world_size", len(rng))
        if len(rng) < ranks:  # a copy that stopped part-way (an object store writes each file whole)
            raise CheckpointError(f"{directory} is incomplete (the RNG state of {len(rng)} of {ranks} workers)")
        loaded["rng"] = rng.get(f"rank_{self.runtime.rank}.pt")
        return loaded

    def restore(self, loaded: dict[str, Any], state: TrainState) -> tuple[Progress, dict[str, Any]]:
        """Put what :meth:`read` returned into ``state``; the progress and the metrics it was saved with."""
        saved, configured = loaded["train_state"], list(state.scheduler.base_lrs)
        if loaded["shards"] is not None:
            load_shards(loaded["shards"], state)
        else:
            load_into(self.runtime.unwrap(state.model), loaded["model"])
            state.optimizer.load_state_dict(saved["optimizer"])
        if state.ema is not None and loaded["ema"] is not None:
            load_into(state.ema, loaded["ema"])
        state.scheduler.load_state_dict(saved["scheduler"])
        keep_configured_lr(state.optimizer, state.scheduler, configured)
        self.runtime.load_scaler_state(saved.get("scaler"))
        if loaded["rng"] is not None:
            set_rng_states(self.runtime, loaded["rng"])
        return loaded["progress"], loaded["meta"].get("metrics", {})
