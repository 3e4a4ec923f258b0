"""The training data of one worker, behind one small interface.

:class:`WorkerData` is what the loop reads: how many batches an epoch has, an epoch's batches
(from a resume position), the eval batches of a split, and one sample (its shapes size the XLA
input sharding). :class:`TorchData` serves a job's map-style Datasets through DataLoaders whose
worker processes last the whole run, a ``DistributedSampler`` sharding the train split.
:class:`RayData` serves Ray Data (``data.loader: ray``): the worker's train shard, one pass per
epoch through ``iter_torch_batches`` (per-worker batch, ``drop_last``, prefetch, a seeded local
shuffle) with the job's ``batch_decoder`` decoding and augmenting in Ray Data's prefetch threads
(the epoch known, so augmentation equals the torch path's), and the eval sets read whole, each
worker keeping the rows ``id % workers == rank``; writing and reading the tables is
``raytpu.storage.tables``. A third ingest path is a new class here, never a branch in the loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from raytpu.config import Config
from raytpu.config.batching import BatchPlan
from raytpu.job import Batch, BatchDecoder, Job, ReadsText, table_for
from raytpu.runtime.base import Runtime
from raytpu.storage.tables import EvalBatches, open_prepared, to_columns


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


class EpochSampler(DistributedSampler):
    """The train split's sampler: a ``DistributedSampler`` that yields ``(epoch, index)``, so that
    each loader worker process, kept across epochs, moves its own copy of the dataset to the epoch
    (:class:`AtEpoch`); it can start an epoch part-way (mid-epoch resume)."""

    _skip = 0

    def skip(self, count: int) -> None:
        self._skip = count

    def __iter__(self) -> Iterator[tuple[int, int]]:  # type: ignore[override]
        indices = list(super().__iter__())[self._skip :]
        self._skip = 0
        return iter([(self.epoch, index) for index in indices])

    def __len__(self) -> int:
        return self.num_samples


class AtEpoch(Dataset):
    """The job's train set read by ``(epoch, index)``: ``set_epoch`` (where the set has it) is called
    in the process that reads, loader worker or main, before the first item of each epoch."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset, self.epoch = dataset, -1

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Batch:
        epoch, index = key
        if epoch != self.epoch and hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)
        self.epoch = epoch
        return self.dataset[index]


class TorchData:
    """The job's map-style Datasets through PyTorch DataLoaders whose worker processes (``data.num_workers``)
    live as long as the run, across epochs and evaluations: an :class:`EpochSampler` shards and shuffles
    the train split (``drop_last``); eval splits are read ``rank, rank + workers, ...``, each split's
    loader made once."""

    def __init__(self, cfg: Config, job: Job, runtime: Runtime, data_root: Path, mode: str = "train") -> None:
        self.cfg, self.job, self.runtime, self.data_root = cfg, job, runtime, data_root
        self.workers, self.rank = runtime.data_parallel_size, runtime.data_parallel_rank
        self.eval_loaders: dict[str, DataLoader] = {}
        if mode != "train":
            return
        self.train_set = job.build_dataset(cfg, "train", data_root)
        self.sampler = EpochSampler(
            self.train_set,
            num_replicas=self.workers,
            rank=self.rank,
            shuffle=cfg.data.shuffle,
            seed=cfg.run.seed,
            drop_last=True,
        )
        self.loader = self._loader(
            AtEpoch(self.train_set),
            batch_size=worker_batch(cfg, runtime),
            sampler=self.sampler,
            drop_last=True,
            generator=torch.Generator().manual_seed(cfg.run.seed),  # keeps the global RNG untouched (resume)
        )
        BatchPlan.of(cfg).check_split("train", len(self.train_set), str(data_root))

    def _loader(self, dataset: Dataset, **options: Any) -> DataLoader:
        workers = self.cfg.data.num_workers
        return DataLoader(
            dataset, num_workers=workers, persistent_workers=workers > 0, pin_memory=self.runtime.pin_memory, **options
        )

    def batches_per_epoch(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int, skip: int = 0) -> Iterable[Batch]:
        self.sampler.set_epoch(epoch)
        self.sampler.skip(skip * self.loader.batch_size)
        return self.loader

    def eval_batches(self, split: str) -> Iterable[Batch]:
        if split not in self.eval_loaders:
            dataset: Dataset = self.job.build_dataset(self.cfg, split, self.data_root)
            limit = self.cfg.data.max_eval_samples
            if limit and limit < len(dataset):  # type: ignore[arg-type]
                dataset = Subset(dataset, range(limit))
            plan = BatchPlan.of(self.cfg)
            plan.check_split(split, len(dataset), str(self.data_root))
            shard = Subset(dataset, range(self.rank, len(dataset), self.workers))
            # a generator of its own: an evaluation draws nothing from the global RNG, so that a run
            # resumed from a checkpoint its last evaluation came before goes on as it would have
            generator = torch.Generator().manual_seed(self.cfg.run.seed)
            self.eval_loaders[split] = self._loader(shard, batch_size=plan.eval_per_worker, generator=generator)
        return self.eval_loaders[split]

    def sample(self) -> Batch:
        return dict(self.train_set[0])


def make_worker_data(
    cfg: Config,
    job: Job,
    runtime: Runtime,
    data_root: Path,
    datasets: dict[str, Any] | None,
    mode: str = "train",
    feeder: str = "",
) -> WorkerData:
    """The ingest path ``data.loader`` names: ``torch`` (map-style Datasets) or ``ray`` (Ray Data shards,
    ``datasets`` mapping a split to its ``DataIterator``; a text corpus's training blocks from the
    run's ``feeder``: ``raytpu.corpus``)."""
    if cfg.data.loader == "ray" and isinstance(job, ReadsText):
        from raytpu.corpus.stream import CorpusStream

        length = job.block_length(cfg)
        rank, world = runtime.data_parallel_rank, runtime.data_parallel_size
        return CorpusStream(cfg, feeder if mode == "train" else "", length, rank, world, datasets or {})
    if cfg.data.loader == "ray":
        batch = worker_batch(cfg, runtime) if mode == "train" else 1
        data = RayData(cfg, job, datasets or {}, runtime.data_parallel_rank, runtime.data_parallel_size, batch)
        if mode == "train":
            BatchPlan.of(cfg).check_split("train", data.train_rows(), cfg.data.path)
        return data
    return TorchData(cfg, job, runtime, data_root, mode)


class RayData:
    """One worker's prepared splits: its train shard and the eval sets, decoded by the job
    (:class:`WorkerData` over Ray Data).

    ``iterators`` maps a split to its Ray ``DataIterator``
    (``ray.train.get_dataset_shard(split)`` in a Ray Train worker, or
    ``dataset.iterator()`` in a single process).
    """

    def __init__(self, cfg: Config, job: Job, iterators: dict[str, Any], rank: int, world: int, batch: int) -> None:
        self.cfg, self.job, self.iterators = cfg, job, iterators
        self.rank, self.world, self.batch = rank, world, batch
        self.prepared = open_prepared(cfg.data.path, job.name)
        self._stats_root: Path | None = None

    def _decoder(self, split: str) -> tuple[BatchDecoder, dict[str, list[int]], int]:
        if self._stats_root is None:
            self._stats_root = self.prepared.stats_root()
        info = self.prepared.table(table_for(self.job, self.cfg, split))
        return self.job.batch_decoder(self.cfg, split, self._stats_root), info["shapes"], info["rows"]

    def _iterator(self, split: str) -> Any:
        if split not in self.iterators:
            raise RuntimeError(f"data.loader=ray: the run has no Ray Dataset for split {split!r}")
        return self.iterators[split]

    # ------------------------------------------------------------ train
    def train_rows(self) -> int:
        return int(self.prepared.table(table_for(self.job, self.cfg, "train"))["rows"])

    def batches_per_epoch(self) -> int:
        """What ``streaming_split(equal=True)`` and ``drop_last`` leave each worker: the torch path's count."""
        return (self.train_rows() // self.world) // self.batch

    def sample(self) -> Batch:
        """One decoded train item (its shapes size the XLA input sharding)."""
        decode, shapes, _ = self._decoder("train")
        path = self.prepared.paths(table_for(self.job, self.cfg, "train"))[0]
        first = pq.read_table(path, filesystem=self.prepared.fs)
        return {k: v[0] for k, v in decode(to_columns(first.slice(0, 1), shapes), 0).items()}

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """The epoch's batches of this worker, less the first ``skip`` (drawn, then dropped: a resume).

        The Ray iterator is closed as soon as the epoch's last batch is taken, so
        that the next epoch's pass can start on every worker."""
        decode, shapes, _ = self._decoder("train")
        cfg = self.cfg
        buffer = (cfg.data.shuffle_buffer or 8 * self.batch) if cfg.data.shuffle else None
        seed = int(np.random.SeedSequence((cfg.run.seed, epoch, self.rank)).generate_state(1)[0])
        batches = iter(
            self._iterator("train").iter_torch_batches(
                batch_size=self.batch,
                drop_last=True,
                prefetch_batches=cfg.data.prefetch_batches,
                local_shuffle_buffer_size=max(buffer, self.batch) if buffer else None,
                local_shuffle_seed=seed if buffer else None,
                collate_fn=collate(decode, shapes, epoch),
                device="cpu",
            )
        )
        expected = self.batches_per_epoch()
        for index in range(expected):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(
                    f"worker {self.rank}: the Ray Data train shard ended after {index} of {expected} batches"
                )
            if index == expected - 1:
                batches.close()
            if index >= skip:
                yield batch

    # ------------------------------------------------------------- eval
    def eval_batches(self, split: str) -> EvalBatches:
        decode, shapes, rows = self._decoder(split)
        plan = BatchPlan.of(self.cfg)
        plan.check_split(split, rows, self.cfg.data.path)
        batch = plan.eval_per_worker
        prefetch = self.cfg.data.prefetch_batches
        return EvalBatches(self._iterator(split), decode, shapes, self.rank, self.world, batch, prefetch)


def collate(decode: BatchDecoder, shapes: dict[str, list[int]], epoch: int) -> Any:
    """An ``ArrowBatchCollateFn`` that decodes a batch with the job's decoder at ``epoch``."""
    from ray.data.collate_fn import ArrowBatchCollateFn

    class Decode(ArrowBatchCollateFn):
        def __call__(self, batch: pa.Table) -> Batch:
            return decode(to_columns(batch, shapes), epoch)

    return Decode()
