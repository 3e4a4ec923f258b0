"""One worker's share of a streamed corpus (``data.loader: ray`` with ``data.train_files``): the
``WorkerData`` the loop reads (``raytpu.worker.data``).

A block is a text block's ids, or a packed row of fields (``raytpu.corpus.rows``: ids, labels and
each token's document), which becomes the batch a fine-tuning job trains on: ``input_ids``,
``labels``, ``position_ids`` (counted from 0 in each document) and ``segments``, as the torch path's
rows are. Each step's blocks come from the run's feeder (``raytpu.corpus.feeder``), asked
``data.prefetch_batches`` steps ahead; a resumed run asks for the step it resumes at, so nothing
consumed before it is sent again. Eval sets are the driver's numbered blocks in the object store,
read whole by every worker, each keeping the blocks ``id % workers == rank``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from raytpu.config import Config
from raytpu.config.batching import BatchPlan
from raytpu.job import Batch
from raytpu.storage.tables import EvalBatches

#: seconds a worker waits for the feeder's next step before it stops the run with why (a stall
#: that long is no slow file: a task hands on its blocks as it packs them)
WAIT_S = 600.0


class CorpusStream:
    """:class:`~raytpu.worker.data.WorkerData` over the feeder named ``feeder``."""

    def __init__(self, cfg: Config, feeder: str, length: int, rank: int, world: int, iterators: dict[str, Any]):
        from raytpu.corpus.feeder import find_feeder

        self.cfg, self.length, self.rank, self.world = cfg, length, rank, world
        self.iterators = iterators
        self.feeder = find_feeder(feeder) if feeder else None  # a test reads no training blocks
        self.accum = cfg.loop.grad_accum
        described = self._get(self.feeder.describe.remote()) if feeder else {"steps": 0, "shape": [length]}
        self.steps, self.shape = int(described["steps"]), tuple(described["shape"])

    @staticmethod
    def _get(ref: Any) -> Any:
        """The feeder's answer; after :data:`WAIT_S` without one, an error that says why it may be."""
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(ref, timeout=WAIT_S)
        except GetTimeoutError:
            raise RuntimeError(
                f"the corpus feeder sent no block in {WAIT_S:.0f} s: its tokenizing tasks need one free CPU on some "
                "node, and the workers may hold every node's CPUs; lower scaling.cpus_per_worker or give the "
                "head node CPUs"
            ) from None

    def batches_per_epoch(self) -> int:
        return self.steps * self.accum

    def sample(self) -> Batch:
        return {name: value[0] for name, value in batch_of(np.zeros((1, *self.shape), np.int64)).items()}

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """The micro-batches of ``epoch`` from step ``skip / accum`` on."""
        first = skip // self.accum
        asked: deque[Any] = deque()
        ahead = max(self.cfg.data.prefetch_batches, 1)
        following = first
        for _ in range(first, self.steps):
            while following < self.steps and len(asked) < ahead:
                asked.append(self.feeder.take.remote(epoch, following, self.rank, self.world, self.accum))
                following += 1
            rows = np.asarray(self._get(asked.popleft()))
            for micro in np.split(rows, self.accum):
                yield batch_of(micro)

    def eval_batches(self, split: str) -> EvalBatches:
        if split not in self.iterators:
            raise RuntimeError(f"the run has no Ray Dataset for split {split!r}")
        length = self.length

        def decode(columns: dict[str, Any], epoch: int) -> Batch:
            blocks = np.asarray(columns["input_ids"])  # (n, channels, length): one channel for text
            return batch_of(blocks[:, 0] if blocks.shape[1] == 1 else blocks)

        batch = BatchPlan.of(self.cfg).eval_per_worker
        prefetch = self.cfg.data.prefetch_batches
        return EvalBatches(
            self.iterators[split], decode, {"input_ids": [-1, length]}, self.rank, self.world, batch, prefetch
        )


def batch_of(blocks: np.ndarray) -> Batch:
    """Text blocks ``(n, length)`` as ``input_ids``; packed rows ``(n, channels, length)`` as a
    fine-tuning batch."""
    if blocks.ndim == 2:
        return {"input_ids": torch.from_numpy(blocks.astype(np.int64))}
    from raytpu.corpus.rows import rows_batch

    return rows_batch(blocks)
