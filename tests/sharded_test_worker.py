"""One rank of a sharded ``test`` of CDEIT on local gloo workers: ``python -m tests.sharded_test_worker
RUN_DIR DATA [KEY=VALUE ...]`` with ``RANK`` and ``WORLD_SIZE`` set; rank 0 prints its test metrics as
one JSON line. The ranks meet through a file beside RUN_DIR, not a TCP port: a port picked free can be
taken by a Ray node that another test process starts meanwhile, and a rank that reaches that process
instead of rank 0 waits forever."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from raytpu.config import load_config
from raytpu.runtime import make_runtime
from raytpu.worker.loop import Trainer
from raytpu.worker.reporting import FolderReporter

ROOT = Path(__file__).resolve().parents[1]


def main(run_dir: str, data: str, overrides: list[str]) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rendezvous = f"file://{Path(run_dir).parent / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world, timeout=timedelta(minutes=2))
    cfg, job = load_config(ROOT / "jobs/cdeit/small.yaml", [f"data.path={data}", "run.mode=test", *overrides])
    runtime = make_runtime("cpu", "fp32", world, rank, rank, sharding=cfg.sharding)
    trainer = Trainer(cfg, job, runtime, run_dir, Path(data), FolderReporter(Path(run_dir), rank=rank, world=world))
    metrics = trainer.test()
    if rank == 0:
        print(json.dumps(metrics), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
