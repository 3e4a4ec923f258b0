"""The feeder: one Ray actor per run that streams an epoch's blocks to every worker, each worker
its own rows of each step, by the order of ``raytpu.corpus.order``.

Ray Data's ``streaming_split`` hands whole blocks to whichever worker asks next; a step's samples
would then depend on block sizes, timing and the number of workers, and a resumed or resized run
could not train the blocks the uninterrupted one would have. The feeder runs one pipeline
(``raytpu.corpus.pipeline``: read, tokenize and pack in Ray Data tasks), fills the epoch's
shuffle windows from it in order, and answers each worker's request for (epoch, step, rank) with
exactly its rows. It reads at most :data:`AHEAD` windows beyond the furthest step asked for, and
keeps at most :data:`KEPT` windows: the object store and the feeder's memory stay bounded whatever
the corpus's size. Asked for a window it has passed or is far from (a resumed run, another
size), it starts reading again at the unit that window begins in.

The driver starts it (:func:`start_feeder`) and names it after the run's command; the workers
find it by that name (``raytpu.corpus.stream``). It asks for no CPU of its own: the tokenizing
tasks it starts take the cluster's spare CPUs.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from raytpu.corpus.order import EpochOrder
from raytpu.corpus.packing import Packing
from raytpu.corpus.sources import Unit

#: windows read beyond the furthest one asked for, and windows kept at most
AHEAD = 2
KEPT = AHEAD + 3
#: seconds a worker's request waits for its window before it asks again (and sees a failed read)
WAIT_S = 5.0
NAMESPACE = "raytpu"


@dataclass(frozen=True)
class StreamSpec:
    """What the feeder streams: the training units, their order and how they are packed."""

    units: tuple[Unit, ...]
    order: EpochOrder
    packing: Packing


class Feeder:
    """The actor's class (made a Ray actor by :func:`start_feeder`)."""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.order = spec.order
        self.windows: dict[tuple[int, int], np.ndarray] = {}
        self.cursor = (0, 0)  # the next window the reader fills
        self.furthest = (0, -1)  # the furthest window asked for
        self.restart = True  # the reader starts reading again at the cursor
        self.error: BaseException | None = None
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name="raytpu-feeder", daemon=True).start()

    # ------------------------------------------------------------ asked by the workers
    def describe(self) -> dict[str, Any]:
        """The epoch's blocks and steps, the window's blocks, the windows held now and a block's shape."""
        with self.changed:
            held = len(self.windows)
        shape = list(self.spec.packing.row_shape)
        return {"blocks": self.order.blocks, "steps": self.order.steps, "window": self.order.window, "held": held,
                "shape": shape}  # fmt: skip

    def take(self, epoch: int, step: int, rank: int, workers: int, accum: int) -> np.ndarray:
        """Rank ``rank``'s blocks of step ``step`` of ``epoch``: ``(accum x micro, *row_shape)``."""
        window, places = self.order.rows(epoch, step, rank, workers, accum)
        key = (epoch, window)
        with self.changed:
            self._ask(key)
            while key not in self.windows:
                if self.error is not None:
                    raise RuntimeError(f"the corpus feeder failed reading: {self.error}") from self.error
                self.changed.wait(WAIT_S)
                self._ask(key)
            return self.windows[key][places]

    def _ask(self, key: tuple[int, int]) -> None:
        """Note ``key`` as asked for; start reading again there when the reader has passed it or is
        far from it. The reader is woken only when something changed (every waiting request waking
        the others would spin)."""
        changed = key > self.furthest
        self.furthest = max(self.furthest, key)
        if key not in self.windows:
            distance = self._distance(self.cursor, key)
            if distance < 0 or distance > AHEAD + 1:
                self.cursor, self.restart = key, True
                self.windows.clear()
                self.furthest, changed = key, True
        if changed:
            self.changed.notify_all()

    def _distance(self, start: tuple[int, int], end: tuple[int, int]) -> int:
        """Windows from ``start`` to ``end`` (negative: ``end`` is behind)."""
        return (end[0] - start[0]) * self.order.windows + end[1] - start[1]

    # ------------------------------------------------------------ the reader thread
    def _read(self) -> None:
        try:
            self._read_windows()
        except BaseException as exc:  # said to the workers that wait (take)
            with self.changed:
                self.error = exc
                self.changed.notify_all()

    def _read_windows(self) -> None:
        blocks: Iterator[np.ndarray] = iter(())
        pending = np.empty((0, *self.spec.packing.row_shape), self.spec.packing.dtype)
        while True:
            with self.changed:
                while self._distance(self.furthest, self.cursor) > AHEAD:
                    self.changed.wait()
                key, restart = self.cursor, self.restart
                self.restart = False
            if restart:
                close = getattr(blocks, "close", None)
                if close is not None:
                    close()  # the last epoch's pipeline: its tail is never read
                blocks, pending = self._reading(*key), pending[:0]
            window, pending = self._fill(blocks, pending, self.order.window_size(key[1]))
            with self.changed:
                if self.restart or self.cursor != key:
                    continue  # asked elsewhere while reading: this window is not needed
                self.windows[key] = window  # as read: a step's rows are its shuffled places (EpochOrder.rows)
                for old in sorted(self.windows)[:-KEPT]:
                    del self.windows[old]
                following = (key[0], key[1] + 1) if key[1] + 1 < self.order.windows else (key[0] + 1, 0)
                self.cursor, self.restart = following, following[1] == 0
                self.changed.notify_all()

    def _reading(self, epoch: int, window: int) -> Iterator[np.ndarray]:
        from raytpu.corpus.pipeline import block_stream

        units, skip = self.order.start(epoch, window)
        return block_stream(
            [self.spec.units[unit] for unit in units if self.order.counts[unit]], self.spec.packing, skip
        )

    def _fill(self, blocks: Iterator[np.ndarray], pending: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        parts, have = [pending], len(pending)
        while have < size:
            more = next(blocks, None)
            if more is None:
                raise RuntimeError(f"the corpus ended {size - have} blocks before its index said (did files change?)")
            parts.append(more)
            have += len(more)
        whole = np.concatenate(parts)
        return whole[:size], whole[size:]


def feeder_name(command: str, run: str) -> str:
    return f"raytpu-corpus-{run}-{command}"


#: the feeders this process started, stopped when their run ends (:func:`stop_feeders`)
STARTED: list[Any] = []


def start_feeder(name: str, spec: StreamSpec) -> Any:
    """The run's feeder, started by the driver (it lives as long as the run, or the driver's process)."""
    import ray

    actor = ray.remote(Feeder).options(name=name, namespace=NAMESPACE, num_cpus=0, max_concurrency=256)
    STARTED.append(actor.remote(spec))
    return STARTED[-1]


def stop_feeders() -> None:
    import ray

    while STARTED:
        ray.kill(STARTED.pop())


def find_feeder(name: str) -> Any:
    import ray

    return ray.get_actor(name, namespace=NAMESPACE)
