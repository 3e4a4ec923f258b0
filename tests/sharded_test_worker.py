"""One rank of a sharded ``test`` of CDEIT on local gloo workers: ``python -m tests.sharded_test_worker
RUN_DIR DATA [KEY=VALUE ...]`` with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``); rank 0 prints its test metrics as one JSON line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter

ROOT = Path(__file__).resolve().parents[1]


def main(run_dir: str, data: str, overrides: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo")
    cfg, job = load_config(ROOT / "jobs/cdeit/small.yaml", [f"data.path={data}", "run.mode=test", *overrides])
    runtime = make_runtime("cpu", "fp32", world, rank, rank, sharding=cfg.sharding)
    trainer = Trainer(cfg, job, runtime, run_dir, Path(data), FolderReporter(Path(run_dir), rank=rank, world=world))
    metrics = trainer.test()
    if rank == 0:
        print(json.dumps(metrics), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
