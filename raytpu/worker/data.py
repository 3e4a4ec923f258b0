"""The training data of one worker, behind one small interface.

:class:`WorkerData` is what the loop reads: how many batches an epoch has, an epoch's batches
(from a resume position), the eval batches of a split, and one sample (its shapes size the XLA
input sharding). :class:`TorchData` serves a job's map-style Datasets through a
``DistributedSampler``; ``raytpu.worker.raydata.RayData`` serves Ray Data shards. A third ingest path is
a new class here, never a branch in the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from raytpu.config import Config
from raytpu.config.batching import BatchPlan
from raytpu.job import Batch, Job
from raytpu.runtime.base import Runtime


class WorkerData(Protocol):
    """One worker's share of the data: the interface the loop uses."""

    def batches_per_epoch(self) -> int:
        """Batches this worker draws in one epoch (every worker draws as many)."""

    def epoch(self, epoch: int, skip: int = 0) -> Iterable[Batch]:
        """CPU batches of ``epoch`` for this worker, less the first ``skip`` (a mid-epoch resume)."""

    def eval_batches(self, split: str) -> Iterable[Batch]:
        """This worker's share of an eval split (``valid`` or ``test``), re-iterable."""

    def sample(self) -> Batch:
        """One training item, whose shapes size the XLA input sharding."""


def worker_batch(cfg: Config, runtime: Runtime) -> int:
    """Samples per worker and micro-step, checked against the worker's devices."""
    plan = BatchPlan.of(cfg)
    plan.per_device(runtime.local_devices)
    return plan.per_worker


class ResumableSampler(DistributedSampler):
    """A DistributedSampler that can start an epoch part-way (for mid-epoch resume)."""

    _skip = 0

    def skip(self, count: int) -> None:
        self._skip = count

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self._skip :]
        self._skip = 0
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples


class TorchData:
    """The job's map-style Datasets: a ``DistributedSampler`` shards and shuffles the train split
    (``set_epoch`` every epoch, ``drop_last``); eval splits are read ``rank, rank + workers, ...``."""

    def __init__(self, cfg: Config, job: Job, runtime: Runtime, data_root: Path, mode: str = "train") -> None:
        self.cfg, self.job, self.runtime, self.data_root = cfg, job, runtime, data_root
        self.workers, self.rank = runtime.data_parallel_size, runtime.data_parallel_rank
        if mode != "train":
            return
        self.train_set = job.build_dataset(cfg, "train", data_root)
        self.sampler = ResumableSampler(
            self.train_set,
            num_replicas=self.workers,
            rank=self.rank,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
            drop_last=True,
        )
        self.loader = DataLoader(
            self.train_set,
            batch_size=worker_batch(cfg, runtime),
            sampler=self.sampler,
            drop_last=True,
            num_workers=cfg.data.num_workers,
            pin_memory=runtime.pin_memory,
            generator=torch.Generator().manual_seed(cfg.run.seed),  # keeps the global RNG untouched (resume)
        )
        BatchPlan.of(cfg).check_split("train", len(self.train_set), str(data_root))

    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int, skip: int = 0) -> Iterable[Batch]:
        self.sampler.set_epoch(epoch)
        if hasattr(self.train_set, "set_epoch"):
            self.train_set.set_epoch(epoch)
        self.sampler.skip(skip * self.loader.batch_size)
        return self.loader

    def eval_batches(self, split: str) -> Iterable[Batch]:
        dataset: Dataset = self.job.build_dataset(self.cfg, split, self.data_root)
        plan = BatchPlan.of(self.cfg)
        plan.check_split(split, len(dataset), str(self.data_root))
        shard = Subset(dataset, range(self.rank, len(dataset), self.workers))
        return DataLoader(shard, batch_size=plan.eval_per_worker, num_workers=self.cfg.data.num_workers)

    def sample(self) -> Batch:
        return dict(self.train_set[0])


def make_worker_data(
    cfg: Config, job: Job, runtime: Runtime, data_root: Path, datasets: dict[str, Any] | None, mode: str = "train"
) -> WorkerData:
    """The ingest path ``data.loader`` names: ``torch`` (map-style Datasets) or ``ray`` (Ray Data shards,
    ``datasets`` mapping a split to its ``DataIterator``)."""
    if cfg.data.loader == "ray":
        from raytpu.worker.raydata import RayData  # pyarrow and Ray Data: only for this path

        batch = worker_batch(cfg, runtime) if mode == "train" else 1
        data = RayData(cfg, job, datasets or {}, runtime.data_parallel_rank, runtime.data_parallel_size, batch)
        if mode == "train":
            BatchPlan.of(cfg).check_split("train", data.train_rows(), cfg.data.path)
        return data
    return TorchData(cfg, job, runtime, data_root, mode)
