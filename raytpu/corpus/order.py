"""The order an epoch trains a corpus's blocks in: a pure function of the seed, the epoch and the
corpus index, so that every worker, every attempt and every size of an elastic run agree on it.

An epoch's stream is its units (files) in a seeded order (``data.shuffle``; else as found), each
unit's blocks in file order, cut into windows of ``window`` blocks whose blocks are shuffled by a
permutation seeded by (seed, epoch, window). Global step ``k`` trains the stream's blocks
``[k G, (k + 1) G)`` (``G`` the global batch); the last partial global batch of an epoch is left
out. Which of them a worker takes depends on the size of the group, but the step's blocks do not:
after a resize, a step trains the very blocks it would have trained at the old size.

A resumed run needs no record of where it stopped beyond its step: the window that step lies in
is found from the index, and reading starts at the unit that window begins in (:meth:`EpochOrder.start`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EpochOrder:
    """``counts``: the blocks of each unit, in the corpus's order; ``window`` a multiple of
    ``global_batch`` (:meth:`make`)."""

    counts: tuple[int, ...]
    global_batch: int
    window: int
    seed: int = 0
    shuffle: bool = True

    @classmethod
    def make(cls, counts: tuple[int, ...], global_batch: int, window: int, seed: int, shuffle: bool) -> EpochOrder:
        """``window``: the blocks shuffled together, rounded up to whole global batches (0: 8 of them)."""
        batches = -(-window // global_batch) if window else 8
        return cls(tuple(counts), global_batch, max(batches, 1) * global_batch, seed, shuffle)

    @property
    def blocks(self) -> int:
        return sum(self.counts)

    @property
    def steps(self) -> int:
        """Optimizer steps in an epoch."""
        return self.blocks // self.global_batch

    @property
    def used(self) -> int:
        """Blocks an epoch trains (whole global batches)."""
        return self.steps * self.global_batch

    @property
    def windows(self) -> int:
        return -(-self.used // self.window)

    def window_size(self, window: int) -> int:
        return min(self.window, self.used - window * self.window)

    def unit_order(self, epoch: int) -> list[int]:
        """The units of ``epoch`` in reading order."""
        if not self.shuffle:
            return list(range(len(self.counts)))
        return [int(i) for i in np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.counts))]

    def start(self, epoch: int, window: int) -> tuple[list[int], int]:
        """Where reading starts for ``window`` of ``epoch``: the units from the one it begins in, and
        the blocks of that first unit that come before it (skipped)."""
        order = self.unit_order(epoch)
        ends = np.cumsum([self.counts[unit] for unit in order]).tolist()
        position = window * self.window
        first = bisect.bisect_right(ends, position)
        before = ends[first - 1] if first else 0
        return order[first:], position - before

    def permutation(self, epoch: int, window: int) -> np.ndarray:
        """The shuffle of ``window``: output position -> the block's place in the window as read."""
        size = self.window_size(window)
        if not self.shuffle:
            return np.arange(size)
        return np.random.default_rng([self.seed, epoch, 1, window]).permutation(size)

    def rows(self, epoch: int, step: int, rank: int, workers: int, accum: int) -> tuple[int, np.ndarray]:
        """The window of step ``step`` of ``epoch`` and the places in it, as read, of rank
        ``rank``'s blocks for that step: ``accum`` micro-batches of ``global_batch / (workers x
        accum)`` blocks, in order (micro-batch ``m`` of rank ``r`` is the step's slot ``m x workers + r``)."""
        micro, rest = divmod(self.global_batch, workers * accum)
        if rest:
            raise ValueError(f"a global batch of {self.global_batch} does not split over {workers} x {accum}")
        first = step * self.global_batch
        window = first // self.window
        slots = np.arange(accum) * workers + rank
        places = first - window * self.window + (slots[:, None] * micro + np.arange(micro)[None, :]).reshape(-1)
        return window, self.permutation(epoch, window)[places]
