"""Which checkpoints a run keeps, and what each was reported with: one rule, Ray Train's own.

The ``checkpoint.num_to_keep`` best by their score, and the latest; of two with the same score the
newer ranks higher, so it is the best of a tie (:func:`best_of`). Ray Train applies it to a Ray
run's checkpoints; the workers' folder reporter (``raytpu.worker.reporting``) applies
:func:`retained` to a run folder; the driver's end-of-run summary picks the best by it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: beside a checkpoint's ``meta.json`` in a run folder: what it was reported with (its score)
REPORT = "report.json"


#: the run's checkpoint folders (``checkpoint_<step>``; not Ray's ``checkpoint_manager_snapshot.json``)
CHECKPOINT_NAME = re.compile(r"^checkpoint_\d+$")
#: what Ray Train keeps of a run's checkpoints, read when a run of that name starts again
RAY_TRAIN_STATE = "checkpoint_manager_snapshot.json"


@dataclass(frozen=True)
class Entry:
    """A checkpoint as the retention rule sees it: its name, score and place in the run's reports."""

    name: str
    score: float
    report: int


def ranked(entries: Sequence[Entry], mode: str) -> list[Entry]:
    """Worst first, best last: by score (higher is better for ``max``), then the newer."""
    sign = 1.0 if mode == "max" else -1.0
    return sorted(entries, key=lambda entry: (sign * entry.score, entry.report))


def retained(entries: Sequence[Entry], num_to_keep: int, mode: str) -> list[Entry]:
    """The checkpoints a run keeps: the ``num_to_keep`` best and the latest, in report order."""
    if not entries:
        return []
    keep = set(ranked(entries, mode)[-num_to_keep:]) | {max(entries, key=lambda entry: entry.report)}
    return sorted(keep, key=lambda entry: entry.report)


def best_of(entries: Sequence[Entry], mode: str) -> Entry | None:
    return ranked(entries, mode)[-1] if entries else None


def entry_of(name: str, metrics: dict[str, Any], order: int) -> Entry:
    """A reported checkpoint's entry: its ``score`` and ``report`` count (``order`` without one)."""
    return Entry(name, float(metrics.get("score", 0.0)), int(metrics.get("report", order)))


def checkpoint_dirs(root: Path) -> list[Path]:
    """``root``'s ``checkpoint_*`` folders, complete or not, newest (highest step) first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and CHECKPOINT_NAME.match(p.name)), reverse=True)


def read_report(directory: Path) -> dict[str, Any]:
    """What a run folder's checkpoint was reported with ({} when it has no record)."""
    try:
        return json.loads((directory / REPORT).read_text())
    except (OSError, ValueError):
        return {}


def complete(root: Path) -> list[Path]:
    """The complete checkpoints of the run folder ``root``, oldest first."""
    from raytpu.records.checkpoints import is_complete  # here: this module stays torch-free (relay.py's actor)

    return sorted(p for p in checkpoint_dirs(root) if is_complete(p))


def set_aside_unreadable_ray_state(folder: Any) -> str | None:
    """Ray Train writes :data:`RAY_TRAIN_STATE` in place: a full disk leaves it cut short, and Ray
    Train then refuses to start a run of that name. Such a record is renamed aside (the run resumes
    from the checkpoints of its folder, as a run without one does); the warning that says so, or None."""
    text = folder.read_text(RAY_TRAIN_STATE)
    if text is None:
        return None
    try:
        json.loads(text)
        return None
    except ValueError:
        pass
    aside = f"{RAY_TRAIN_STATE}.unreadable"
    folder.write_text(aside, text)
    folder.remove(RAY_TRAIN_STATE)
    return (
        f"warning: Ray Train's list of this run's checkpoints ({RAY_TRAIN_STATE}) was cut short (a full "
        f"disk?): set aside as {aside}; resuming from the checkpoints in the run folder"
    )
