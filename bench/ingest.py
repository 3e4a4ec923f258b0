"""Data delivery of the two ingest paths against what a training step consumes.

MSHNet small data (synthetic, made here), one worker's share of the small
config's global batch. For the torch DataLoader path (``data.loader=torch``) and
the Ray Data path (``data.loader=ray``, parquet from ``raytpu data prepare``),
both built by ``raytpu.worker.data.make_worker_data`` exactly as in training, measured side by side:

* delivery: batches/s when the worker only iterates its batches;
* consumption: steps/s of the training step (forward, backward, optimizer) on a
  batch already in memory;
* stall: the fraction of wall time spent waiting in ``next(batches)`` when the
  two run together, as in training, over ``--epochs`` whole epochs (each epoch's
  start included).

The last line is ``stall=<fraction>`` of the slower path; the target is below 0.05.
``--materialize-mb 0`` makes the Ray Data path stream its train set from the
parquet files every epoch instead of holding it in the object store.

    python bench/ingest.py [--steps 30] [--epochs 2] [--images 200] [--materialize-mb 1024]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raytpu.config import load_config  # noqa: E402
from raytpu.driver.ray_trainer import materialize_train, read_datasets  # noqa: E402
from raytpu.job import StepContext  # noqa: E402
from raytpu.runtime import make_runtime  # noqa: E402
from raytpu.storage import tables as ingest  # noqa: E402
from raytpu.worker.data import make_worker_data  # noqa: E402
from raytpu.worker.optim import build_optimizer  # noqa: E402

CONFIG = "jobs/mshnet/small.yaml"


@dataclass
class Worker:
    """One worker of the small config: its data (through ``raytpu.worker.data``), model and optimizer."""

    cfg: Any
    job: Any
    data: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


def worker_for(loader: str, data: Path, parquet: Path, materialize_mb: float) -> Worker:
    """One worker with this worker's share of the small config's batch."""
    small, _ = load_config(CONFIG, [])
    per_worker = small.data.global_batch_size // small.scaling.num_workers
    path = parquet if loader == "ray" else data
    overrides = [f"data.path={path}", f"data.loader={loader}", "scaling.num_workers=1"]
    overrides += [f"data.global_batch_size={per_worker}", "logging.progress_bar=false", "logging.tensorboard=false"]
    overrides += [f"data.materialize_mb={materialize_mb}"]
    cfg, job = load_config(CONFIG, overrides)
    datasets = None
    if loader == "ray":
        datasets = {k: v.iterator() for k, v in read_datasets(cfg, job, "train").items()}
    runtime = make_runtime("cpu", "fp32", 1, 0, 0)
    model = job.build_model(cfg)
    worker_data = make_worker_data(cfg, job, runtime, data, datasets)
    return Worker(cfg, job, worker_data, model, build_optimizer(cfg.optim, model))


def batches(worker: Worker) -> Iterator[dict[str, torch.Tensor]]:
    """Endless training batches, epoch after epoch, as the loop draws them."""
    epoch = 0
    while True:
        yield from worker.data.epoch(epoch, 0)
        epoch += 1


def step(worker: Worker, batch: dict[str, torch.Tensor]) -> None:
    ctx = StepContext(epoch=0, step=0, training=True, config=worker.cfg)
    loss, _ = worker.job.train_step(worker.model, batch, ctx)
    worker.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    worker.optimizer.step()


def delivery_rate(source: Iterator, steps: int) -> float:
    next(source)
    start = time.perf_counter()
    for _ in range(steps):
        next(source)
    return steps / (time.perf_counter() - start)


def consumption_rate(worker: Worker, batch: dict[str, torch.Tensor], steps: int) -> float:
    step(worker, batch)
    start = time.perf_counter()
    for _ in range(steps):
        step(worker, batch)
    return steps / (time.perf_counter() - start)


def stall_fraction(worker: Worker, source: Iterator, steps: int) -> float:
    step(worker, next(source))
    waited, start = 0.0, time.perf_counter()
    for _ in range(steps):
        before = time.perf_counter()
        batch = next(source)
        waited += time.perf_counter() - before
        step(worker, batch)
    return waited / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--materialize-mb", type=float, default=1024)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ingest-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, workdir: Path) -> None:
    import ray

    _, job = load_config(CONFIG, [])
    job.synthesize(workdir / "mshnet", n=args.images, size=64, seed=0)
    ingest.prepare(job, workdir / "mshnet", str(workdir / "parquet"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    rows = {}
    for loader in ("torch", "ray"):
        worker = worker_for(loader, workdir / "mshnet", workdir / "parquet", args.materialize_mb)
        source = batches(worker)
        delivered = delivery_rate(source, args.steps)
        consumed = consumption_rate(worker, next(source), args.steps)
        stall = stall_fraction(worker, source, args.epochs * worker.data.batches_per_epoch())
        source.close()  # ends the Ray Data pass while Ray is still up
        rows[loader] = (delivered, consumed, stall)
        rates = f"delivers {delivered:8.1f} batches/s  step consumes {consumed:6.1f} steps/s"
        print(f"{loader:>5}: {rates}  stall {stall:.4f}", flush=True)
    train = "materialized" if materialize_train(worker.cfg, worker.data.prepared, "train") else "streamed"
    ray.shutdown()
    batch, epoch = worker.cfg.data.global_batch_size, worker.data.batches_per_epoch()
    print(f"batch={batch} per worker, {epoch} steps an epoch, steps={args.steps}, epochs={args.epochs}, ", end="")
    print(f"images={args.images}, ray train set {train}, threads={torch.get_num_threads()}")
    print(f"stall={max(stall for _, _, stall in rows.values()):.4f}")


if __name__ == "__main__":
    main()
