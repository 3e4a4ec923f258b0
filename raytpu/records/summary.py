"""``<run>/summary.json``: how a run ended, written by the driver at the end of each command that
trains it (completed, stopped or failed), in a local folder or a bucket.

It names the best and the latest checkpoint by their folder names (``checkpoint_00000400``), so
that a run folder copied elsewhere still reads right, with the metrics each was reported with, the
final metrics, the goodput breakdown and every command that trained the run (the size of each of
its attempts, from the goodput record), and an elastic run's changes of size. ``raytpu runs`` and
``--checkpoint best|latest`` read it.
"""

from __future__ import annotations

import json
from typing import Any

from raytpu.records import resizes
from raytpu.records.checkpoints import META
from raytpu.records.reports import CHECKPOINT_NAME
from raytpu.storage.run_folder import RunFolder

SUMMARY = "summary.json"


def folder_name(location: str | None) -> str | None:
    """``checkpoint_00000400`` of a checkpoint's path or URI."""
    return location.rstrip("/").rsplit("/", 1)[-1] if location else None


def write(folder: RunFolder, outcome: str, ended: dict[str, Any], goodput: dict[str, Any]) -> dict[str, Any]:
    """The run's summary after a command ended with ``outcome``. ``ended``: what the command knows of
    the run (``step``, ``latest_checkpoint``, ``best_checkpoint``, ``metrics``, ``best_metrics``; a
    failed command may know none of it, and then the last summary's values stay)."""
    summary = read(folder) or {}
    summary.update({key: value for key, value in ended.items() if value not in (None, {})})
    for key in ("latest_checkpoint", "best_checkpoint"):
        summary[key] = folder_name(summary.get(key))
    summary["status"] = outcome
    summary["goodput"] = {key: goodput.get(key) for key in ("goodput", "wall_s", "categories")}
    summary["attempts"] = [
        {
            **{key: entry.get(key) for key in ("id", "started", "ended", "outcome")},
            "workers": [attempt.get("workers") for attempt in sorted(entry["attempts"], key=lambda a: a["first_step"])],
        }
        for entry in goodput.get("commands", [])
    ]
    changes = resizes.read(folder)
    if changes:
        summary["resizes"] = changes
    folder.write_text(SUMMARY, json.dumps(summary, indent=1))
    return summary


def read(folder: RunFolder) -> dict[str, Any] | None:
    """The run's summary, or None before any command of it has ended (or where it is unreadable)."""
    try:
        return json.loads(folder.read_text(SUMMARY) or "null")
    except ValueError:
        return None


def checkpoints(folder: RunFolder) -> list[dict[str, Any]]:
    """The run's complete checkpoints (those with their ``meta.json``), oldest first: each one's
    ``name`` and what its ``meta.json`` says (step, epoch, reason, metrics)."""
    found = []
    for name in sorted(child for child in folder.children() if CHECKPOINT_NAME.match(child)):
        text = folder.read_text(f"{name}/{META}")
        if text:
            found.append({"name": name, **json.loads(text)})
    return found


def named_checkpoint(folder: RunFolder, which: str) -> str | None:
    """The run's ``best`` or ``latest`` checkpoint folder name: from its summary, else (``latest``
    only) its newest complete checkpoint; None when there is none to name."""
    summary = read(folder) or {}
    if summary.get(f"{which}_checkpoint"):
        return summary[f"{which}_checkpoint"]
    if which == "latest":
        found = checkpoints(folder)
        return found[-1]["name"] if found else None
    return None
