"""``<run dir>/resizes.json``: every change of an elastic run's size, as its controller saw it.

Each entry says when the worker group that ran ended (a node lost, or capacity added: the workers
stopped at a checkpoint to grow), from and to how many workers, and why, in words. Ray Train's
controller writes it (``raytpu.cluster.elastic``); rank 0 reads the last one when a new group
starts (its console line), the driver when the command ends (goodput's ``resizing`` time,
``summary.json``), and ``raytpu runs`` shows them.
"""

from __future__ import annotations

import json
from typing import Any

from raytpu.storage.run_folder import RunFolder

RECORD = "resizes.json"

#: what a worker's :class:`Regrow` says, read back by the controller from the failure Ray reports
GROW = "raytpu: the group stops to grow"


class Regrow(RuntimeError):
    """The workers of an elastic run stop after a stored checkpoint, so that Ray Train restarts the
    group at the larger size the cluster now has room for."""

    def __init__(self, step: int, workers: int) -> None:
        super().__init__(f"{GROW}: step {step} is checkpointed and more than {workers} workers fit")


def read(folder: RunFolder) -> list[dict[str, Any]]:
    """The run's size changes, oldest first (none: a run of one size, or an unreadable record)."""
    try:
        found = json.loads(folder.read_text(RECORD) or "[]")
    except (OSError, ValueError):
        return []
    return found if isinstance(found, list) else []


def add(folder: RunFolder, ended: float, workers: int, now: int, reason: str, command: str) -> dict[str, Any]:
    """One change: the group of ``workers`` that ended at ``ended`` (seconds since the epoch) is
    followed by one of ``now`` workers, because of ``reason``; the entry as recorded."""
    entry = {"ended": ended, "from": workers, "to": now, "reason": reason, "command": command}
    folder.write_text(RECORD, json.dumps([*read(folder), entry], indent=1))
    return entry


def line(change: dict[str, Any], global_batch: int, accumulation: tuple[int, int]) -> str:
    """The console's line for a change: ``workers 2 -> 1 (node 10.0.0.3 lost): global batch 64 kept,
    accumulation 1 -> 2``."""
    before, after = accumulation
    kept = f"accumulation {before} -> {after}" if before != after else f"accumulation {after}"
    return f"workers {change['from']} -> {change['to']} ({change['reason']}): global batch {global_batch} kept, {kept}"
