"""One process of the architecture matrix on a runtime and sharding: ``python -m
tests.architecture_worker OUT DATA RUNTIME [OVERRIDE ...]`` with ``RANK`` and ``WORLD_SIZE`` set (2
gloo processes for DDP and FSDP2; one process on the XLA CPU device, ``PJRT_DEVICE=CPU``). For
each architecture of ``tests/test_architectures.py``: a run of 4 steps, and a run stopped at step 2
then resumed to 4; rank 0 prints one JSON line per architecture: whether both runs' final weights
are equal, the tie as the model holds it, the losses. The ranks meet through a file, not a port."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from raytpu.config import load_config
from raytpu.config.plan import resolve_config
from raytpu.records import checkpoints as ckpt
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter
from tests.test_architectures import ARCHITECTURES, SMALL, TINY, model_words


def fit(runtime_name: str, out: Path, data: Path, name: str, words: list[str], rank: int, world: int) -> Trainer:
    cfg, job = load_config(SMALL, [f"data.path={data}", *TINY, *model_words(name), *words])
    cfg = resolve_config(cfg, runtime_name, "fp32")
    runtime = make_runtime(runtime_name, "fp32", world, rank, rank, cfg.xla, sharding=cfg.sharding)
    reporter = FolderReporter(out, cfg.checkpoint.num_to_keep, "min", rank, world)
    trainer = Trainer(cfg, job, runtime, out, data, reporter)
    trainer.fit()
    return trainer


def same_weights(first: Path, second: Path) -> bool:
    expected, found = ckpt.load_model_weights(first), ckpt.load_model_weights(second)
    return expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)


def main(out: Path, data: Path, runtime_name: str, overrides: list[str]) -> None:
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        rendezvous = f"file://{out / 'rendezvous'}"
        dist.init_process_group(
            "gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(minutes=5)
        )
    for name in ARCHITECTURES:
        straight, stopped = out / name / "straight", out / name / "stopped"
        trainer = fit(runtime_name, straight, data, name, [*overrides, "loop.max_steps=4"], rank, world)
        fit(runtime_name, stopped, data, name, [*overrides, "loop.max_steps=2"], rank, world)
        resumed = fit(runtime_name, stopped, data, name, [*overrides, "loop.max_steps=4"], rank, world)
        if world > 1:
            dist.barrier()
        if rank == 0:
            final = "checkpoint_00000004"
            model = trainer.runtime.unwrap(trainer.model)
            report = {
                "architecture": name,
                "steps": resumed.progress.step,
                "same": same_weights(straight / final, stopped / final),
                "sharded": ckpt.is_sharded(straight / final),
                "tied": ckpt.tied_names(model),
                "checkpoint": str(straight / final),
            }
            print(json.dumps(report), flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
