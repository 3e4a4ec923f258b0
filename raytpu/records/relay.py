"""What a launched script's processes and the driver of ``raytpu launch`` share: the run's
:class:`LaunchState` actor (rank 0's checkpoints and metrics, which ranks finished, the first
failure, rank 0's console for the driver's) and the names of the launched run's checkpoint folders.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from raytpu.records.reports import RAY_TRAIN_STATE
from raytpu.storage.run_folder import RunFolder

#: environment variable naming the run's launch-state actor inside a launched script
STATE_ENV = "RAYTPU_LAUNCH_STATE"


#: environment variable holding the checkpoint a restarted script resumes from
RESUME_ENV = "RAYTPU_RESUME_FROM"


#: seconds between two freezes of the published entries while the script runs (see ``LaunchState.poll``)
FREEZE_EVERY_S = 1.0


#: the name of a launched run's checkpoint folders: ``state_000001``, ... counted over every attempt
#: and every rerun of the run (a rerun continues after the highest number the run folder holds)
STATE_DIR = re.compile(r"^state_(\d{6,})$")


def state_dir_name(number: int) -> str:
    return f"state_{number:06d}"


def last_state_number(names: Iterable[str]) -> int:
    """The highest ``state_N`` among ``names`` (0 when there is none)."""
    return max((int(match.group(1)) for match in map(STATE_DIR.match, names) if match), default=0)


class LaunchState:
    """The Ray actor of one launched run: what rank 0 published (checkpoints and metrics), which
    ranks finished, and the first failure of the script (rank, exit status, traceback).

    ``last_checkpoint``: the highest checkpoint number the run folder already holds (a rerun of
    the same ``--name``); the checkpoints published now are numbered after it, so that their
    folders never take the name of one the run already has."""

    def __init__(self, last_checkpoint: int = 0) -> None:
        self.checkpoints = last_checkpoint
        self.entries: list[tuple[str, Any]] = []
        self.read = 0  # entries before this index were polled by a worker: they never change again
        self.frozen_at = -FREEZE_EVERY_S  # when rank 0's poll last froze the entries
        self.finished: set[int] = set()
        self.failed: tuple[int, int, str] | None = None
        self.workers: dict[int, Any] = {}
        self.console: list[tuple[int, bytes]] = []

    def register(self, rank: int, actor: Any) -> None:
        """This attempt's worker actor of ``rank`` (a restart registers the new ones)."""
        self.workers[rank] = actor

    def peers(self, rank: int) -> list[Any]:
        return [actor for other, actor in self.workers.items() if other != rank]

    def publish(self, kind: str, value: Any) -> None:
        """Add an entry. Metrics logged while the previous metrics entry is still unread join it:
        every ``ray.train.report`` is a barrier of all workers that costs about a second, so a
        script that logs every few milliseconds must not queue one report per log call."""
        last = len(self.entries) - 1
        if kind == "metrics" and last >= self.read and self.entries[last][0] == "metrics":
            self.entries[last] = ("metrics", {**self.entries[last][1], **value})
            return
        if kind == "checkpoint":
            self.checkpoints += 1
            value = (value, state_dir_name(self.checkpoints))
        self.entries.append((kind, value))

    def finish(self, rank: int) -> None:
        self.finished.add(rank)

    def size(self) -> int:
        return len(self.entries)

    def poll(self, index: int, world: int, rank: int = 0) -> tuple[list[tuple[str, Any]], bool]:
        """The entries from ``index`` on that rank 0 has read, and whether they are the last (every
        rank finished and rank 0 has read them all, or the script failed): one actor call, so the
        two answers agree. Only rank 0's poll freezes entries (a read entry is never merged into
        again), once per report of its own: had every worker's poll frozen them, polls falling
        apart would split the metrics into one entry per poll, and a backlog of reports (each a
        barrier of every worker that waits for the controller) would build up behind the script.
        It freezes them at most every :data:`FREEZE_EVERY_S` while the script runs: a script that
        logs every step makes about one report a second."""
        ended = len(self.finished) >= world or self.failed is not None
        if rank == 0 and (ended or time.monotonic() - self.frozen_at >= FREEZE_EVERY_S):
            self.read, self.frozen_at = len(self.entries), time.monotonic()
        last = (ended and self.read == len(self.entries)) or self.failed is not None
        return self.entries[index : self.read], last

    def write(self, stream: int, chunk: bytes) -> None:
        """Rank 0's output, as its script wrote it (``stream`` 1: stdout, 2: stderr)."""
        self.console.append((stream, chunk))

    def take_output(self) -> list[tuple[int, bytes]]:
        """The output written since the last call, in order, for the driver's console."""
        taken, self.console = self.console, []
        return taken

    def fail(self, rank: int, code: int, details: str) -> None:
        if self.failed is None:
            self.failed = (rank, code, details)

    def failure(self) -> tuple[int, int, str] | None:
        return self.failed


def checkpoint_names(run_dir: RunFolder) -> list[str]:
    """The checkpoint folders a run already has: in its folder, and in the list Ray Train keeps
    of them (:data:`~raytpu.records.reports.RAY_TRAIN_STATE`), which may name one a crash left unwritten."""
    names = run_dir.children()
    try:
        snapshot = json.loads(run_dir.read_text(RAY_TRAIN_STATE) or "{}")
        names += [str(result.get("checkpoint_dir_name", "")) for result in snapshot.get("checkpoint_results", [])]
    except (OSError, ValueError, AttributeError):
        pass  # an unreadable snapshot: Ray Train itself reports it when the run starts
    return names
