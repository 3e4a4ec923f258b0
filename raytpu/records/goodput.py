"""A run's goodput record, ``<run dir>/goodput.json``: every command and attempt of the run.

A run's wall time, from the command's start to its exit, splits into categories that add up to it:
``startup`` (the command to the first step: Ray, workers, process group, data set-up),
``compilation``, ``productive`` (training steps), ``input``, ``evaluation``, ``checkpointing``,
``lost`` (work after a restart's last checkpoint, redone, and the restart itself), ``resizing``
(an elastic run's time from a change of size, a node lost or capacity added, to the new group's
first step: ``raytpu.records.resizes``) and ``shutdown``.
Goodput is productive over wall. The driver writes a command's start and end, rank 0 each attempt's
step phases (``raytpu.worker.timing.StepClock``); both meet in this record, so that a resumed run's
breakdown covers all of them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytpu.storage.run_folder import RunFolder

RECORD = "goodput.json"


CATEGORIES = (
    "startup",
    "compilation",
    "productive",
    "input",
    "evaluation",
    "checkpointing",
    "lost",
    "resizing",
    "shutdown",
)


@dataclass(frozen=True)
class Command:
    """One command that ran the run (``raytpu train``, a Tune trial): its id and its start."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started: float = field(default_factory=time.time)


def process_started() -> float:
    """When this process started (the command's start: imports included): now less its age, read
    on Linux from the kernel's clock since boot (``/proc/self/stat`` against ``/proc/uptime``).
    psutil's ``create_time`` adds the age to the boot time, which the kernel reports in whole
    seconds (here 0.7 s late: every command's start-up counted 0.7 s more than it took)."""
    now = time.time()
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            up = float(uptime.read().split()[0])
        return now - max(0.0, up - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):  # not Linux
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil (Ray's) missing or refused: the earliest time this module knows
        return now


def command_started() -> float:
    """When the running command started: the process's start when ``raytpu`` is the program (its
    imports count as start-up), else now (a call from another program: a notebook, a script)."""
    program = str(getattr(sys.modules.get("__main__"), "__file__", "") or "")
    return process_started() if Path(program).name in ("raytpu", "cli.py") else time.time()


def read_record(folder: RunFolder) -> dict[str, Any]:
    try:
        record = json.loads(folder.read_text(RECORD) or "{}")
    except ValueError:
        record = {}
    record.setdefault("commands", [])
    return record


def write_record(folder: RunFolder, record: dict[str, Any]) -> None:
    folder.write_text(RECORD, json.dumps(record, indent=1))


def find_command(record: dict[str, Any], command: Command) -> dict[str, Any]:
    for entry in record["commands"]:
        if entry["id"] == command.id:
            return entry
    entry = {"id": command.id, "started": command.started, "ended": None, "outcome": None, "attempts": []}
    record["commands"].append(entry)
    return entry


def record_attempt(folder: RunFolder, command: Command, attempt: dict[str, Any]) -> None:
    """Write (or rewrite) ``attempt`` of ``command`` into the run folder's record."""
    record = read_record(folder)
    entry = find_command(record, command)
    entry["attempts"] = [*(a for a in entry["attempts"] if a["id"] != attempt["id"]), attempt]
    write_record(folder, record)


def begin(folder: RunFolder, command: Command) -> None:
    """The driver: this command starts a part of the run's record."""
    record = read_record(folder)
    find_command(record, command)
    write_record(folder, record)


def end(folder: RunFolder, command: Command, outcome: str, marks: dict[str, float] | None = None) -> dict[str, Any]:
    """The driver: this command ends (``completed``, ``stopped`` or ``failed``); the run's whole
    breakdown written with the record and returned. ``marks``: named moments of the command (when
    it joined Ray, ...), kept with it for a finer split of its start-up."""
    from raytpu.records import resizes

    record = read_record(folder)
    entry = find_command(record, command)
    entry.update(ended=time.time(), outcome=outcome)
    if marks:
        entry["marks"] = {**entry.get("marks", {}), **marks}
    record.update(breakdown(record, [change["ended"] for change in resizes.read(folder)]))
    write_record(folder, record)
    return record


def breakdown(record: dict[str, Any], resized: list[float] | tuple[float, ...] = ()) -> dict[str, Any]:
    """``{"wall_s", "goodput", "categories"}`` over every command of the record; the categories
    add up to the wall time (each command's time from its start to its end, or its last record).
    ``resized``: when each group of an elastic run that changed size ended."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for command in record["commands"]:
        for name, seconds in command_breakdown(command, resized).items():
            totals[name] += seconds
    return shares(totals)


def shares(totals: dict[str, float]) -> dict[str, Any]:
    wall = sum(totals.values())
    return {"wall_s": wall, "goodput": totals["productive"] / wall if wall > 0 else 0.0, "categories": totals}


def command_summary(record: dict[str, Any], command: Command, resized: list[float] | tuple[float, ...] = ()) -> str:
    """:func:`summary_line` of ``command`` alone (a resumed run's record holds every command's)."""
    return summary_line(shares(command_breakdown(find_command(record, command), resized)))


def command_breakdown(command: dict[str, Any], resized: list[float] | tuple[float, ...] = ()) -> dict[str, float]:
    totals = dict.fromkeys(CATEGORIES, 0.0)
    attempts = sorted(command["attempts"], key=lambda a: a["first_step"])
    last = attempts[-1]["recorded"] if attempts else command["started"]
    ended = command["ended"] if command["ended"] is not None else last
    if not attempts:
        totals["startup"] = max(ended - command["started"], 0.0)
        return totals
    totals["startup"] = max(attempts[0]["first_step"] - command["started"], 0.0)
    for index, attempt in enumerate(attempts):
        spent = max(attempt["recorded"] - attempt["first_step"], 0.0)
        for name, seconds in attempt["seconds"].items():
            totals[name] += seconds
        totals["productive"] += max(spent - sum(attempt["seconds"].values()), 0.0)
        following = attempts[index + 1]["first_step"] if index + 1 < len(attempts) else None
        if following is not None:  # what the attempt did after its last checkpoint, and the restart
            change = next((at for at in resized if attempt["recorded"] <= at <= following), None)
            if change is None:
                totals["lost"] += max(following - attempt["recorded"], 0.0)
            else:  # a change of size: the work since the checkpoint lost, the time from the change on resizing
                totals["lost"] += change - attempt["recorded"]
                totals["resizing"] += following - change
    after = max(ended - attempts[-1]["recorded"], 0.0)
    totals["shutdown" if attempts[-1]["final"] else "lost"] += after
    return totals


#: a command's start-up in parts, each ending at a mark of its first attempt (rank 0's process
#: started; its clock made; the model built; the checkpoint read) and the last at its first step
STARTUP_PARTS = {"process": "driver", "clock": "worker set-up", "built": "build", "resumed": "resume"}


def startup_parts(command: dict[str, Any]) -> dict[str, float]:
    """Where a command's start-up went: ``driver`` (its imports, the plan, Ray, the workers'
    start), ``worker set-up`` (imports, process group, runtime), ``build`` (data, model,
    optimizer), ``resume`` (a checkpoint read) and ``first step`` (loggers, trackers, the first
    batch), from its first attempt's marks; {} where it has none."""
    attempts = sorted(command["attempts"], key=lambda a: a["first_step"])
    marks = attempts[0].get("marks", {}) if attempts else {}
    parts, before = {}, command["started"]
    for mark, part in STARTUP_PARTS.items():
        if mark in marks:
            parts[part] = max(marks[mark] - before, 0.0)
            before = marks[mark]
    if parts:
        parts["first step"] = max(attempts[0]["first_step"] - before, 0.0)
    return parts


def summary_line(record: dict[str, Any]) -> str:
    """The breakdown in one line, as the end-of-run summary shows it."""
    others = {name: seconds for name, seconds in record["categories"].items() if name != "productive"}
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in others.items())
    return f"{record['goodput']:.1%} of {record['wall_s']:.1f} s ({parts})"
