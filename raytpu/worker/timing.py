"""Where a run's time goes: its goodput breakdown, and a profile of chosen steps.

**Goodput.** A run's wall time, from the command's start to its exit, splits into categories that
add up to it: ``startup`` (the command to the first step: Ray, workers, process group, data
set-up), ``compilation`` (XLA: the compile time torch_xla reports during steps; cpu/cuda: the first
steps' excess over the steady step), ``productive`` (training steps), ``input`` (waiting for the
next batch), ``evaluation``, ``checkpointing`` (the part that blocks the loop), ``lost`` (work
after a restart's last checkpoint, redone, and the restart itself) and ``shutdown``. Goodput is
productive over wall. Rank 0 measures the step phases with the host's clock only (no device sync:
on XLA the step's graph runs while the host goes on, so a step's time shows in the next wait),
the driver measures start-up and shutdown; both meet in ``<run dir>/goodput.json``, which keeps
every command and attempt of the run, so that a resumed run's breakdown covers them all.

**Profiles.** :class:`ProfileWindow` records a trace of steps ``[first, last]`` on the chosen ranks
with the runtime's profiler (``torch.profiler`` on cpu and cuda, torch_xla's on xla) into
``<run dir>/profile/``.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from raytpu.storage.run_folder import RunFolder

RECORD = "goodput.json"
CATEGORIES = ("startup", "compilation", "productive", "input", "evaluation", "checkpointing", "lost", "shutdown")
#: the phases rank 0 times inside the training loop
PHASES = ("input", "evaluation", "checkpointing")
#: steps whose excess over the steady step counts as compilation on cpu/cuda (no compiler to ask)
WARM_STEPS = 2


@dataclass(frozen=True)
class Command:
    """One command that ran the run (``raytpu train``, a Tune trial): its id and its start."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    started: float = field(default_factory=time.time)


def process_started() -> float:
    """When this process started (the command's start: imports included)."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # psutil (Ray's) missing or refused: the earliest time this module knows
        return time.time()


# ------------------------------------------------------------------ rank 0 in the loop
class StepClock:
    """Rank 0's clock of one attempt (a worker group's life): the time from its first step to its
    last record, by phase. ``compiled``: the runtime's compile seconds so far (XLA), or None."""

    def __init__(self, folder: RunFolder | None, command: Command, compiled: Any = None) -> None:
        self.folder, self.command, self.compiled = folder, command, compiled
        self.id = uuid.uuid4().hex[:12]
        self.first_step: float | None = None
        self.seconds = dict.fromkeys((*PHASES, "compilation"), 0.0)
        self.step_times: list[float] = []
        self._step_start = 0.0
        self._open_phase: tuple[str, float] | None = None
        self._compiled_seen = self._compile_seconds()

    def _compile_seconds(self) -> float:
        return float(self.compiled() or 0.0) if self.compiled is not None else 0.0

    def _compiled_since(self) -> float:
        """Compile seconds since the last call (a counter that went back was cleared: all of it is new)."""
        now = self._compile_seconds()
        since = now - self._compiled_seen if now >= self._compiled_seen else now
        self._compiled_seen = now
        return since

    def step_started(self) -> None:
        now = time.time()
        if self.first_step is None:
            self.first_step = now
        self._compiled_since()  # compiles between steps belong to what ran there (set-up, a phase)
        self._step_start = now

    def step_ended(self) -> None:
        self.step_times.append(time.time() - self._step_start)
        self.seconds["compilation"] += self._compiled_since()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the loop; compiles inside it belong to it, not to ``compilation``."""
        started, compiled = time.time(), self._compiled_since()
        if self.first_step is not None:  # the step's, before an input wait in it
            self.seconds["compilation"] += compiled
            self._open_phase = (name, started)
        try:
            yield
        finally:
            self._compiled_since()
            self._open_phase = None
            if self.first_step is not None:
                self.seconds[name] += time.time() - started

    def compilation(self) -> float:
        """Compile time of the training steps: torch_xla's count, or the warm steps' excess."""
        if self.compiled is not None:
            return self.seconds["compilation"]
        steady = self.step_times[WARM_STEPS : WARM_STEPS + 20]
        if not steady:
            return 0.0
        typical = statistics.median(steady)
        return sum(max(t - typical, 0.0) for t in self.step_times[:WARM_STEPS])

    def attempt(self, final: bool) -> dict[str, Any]:
        """This attempt as the record keeps it; a phase still running counts up to now."""
        now = time.time()
        seconds = {name: self.seconds[name] for name in PHASES}
        if self._open_phase is not None:
            name, started = self._open_phase
            seconds[name] += now - started
        return {
            "id": self.id,
            "first_step": self.first_step if self.first_step is not None else now,
            "recorded": now,
            "final": final,
            "steps": len(self.step_times),
            "seconds": {**seconds, "compilation": self.compilation()},
        }

    def record(self, final: bool = False) -> None:
        """Write this attempt into the run folder's record (at each checkpoint, and at the end)."""
        if self.folder is None or self.first_step is None:
            return
        record_attempt(self.folder, self.command, self.attempt(final))

    def goodput(self) -> float:
        """Productive time over the command's wall time so far (a running estimate, for reports)."""
        if self.first_step is None:
            return 0.0
        attempt = self.attempt(final=False)
        spent = attempt["recorded"] - attempt["first_step"]
        productive = spent - sum(attempt["seconds"].values())
        return max(productive, 0.0) / max(attempt["recorded"] - self.command.started, 1e-9)


# ------------------------------------------------------------------ the record
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
    record = read_record(folder)
    entry = find_command(record, command)
    entry.update(ended=time.time(), outcome=outcome)
    if marks:
        entry["marks"] = {**entry.get("marks", {}), **marks}
    record.update(breakdown(record))
    write_record(folder, record)
    return record


def breakdown(record: dict[str, Any]) -> dict[str, Any]:
    """``{"wall_s", "goodput", "categories"}`` over every command of the record; the categories
    add up to the wall time (each command's time from its start to its end, or its last record)."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for command in record["commands"]:
        for name, seconds in command_breakdown(command).items():
            totals[name] += seconds
    wall = sum(totals.values())
    return {"wall_s": wall, "goodput": totals["productive"] / wall if wall > 0 else 0.0, "categories": totals}


def command_breakdown(command: dict[str, Any]) -> dict[str, float]:
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
            totals["lost"] += max(following - attempt["recorded"], 0.0)
    after = max(ended - attempts[-1]["recorded"], 0.0)
    totals["shutdown" if attempts[-1]["final"] else "lost"] += after
    return totals


def summary_line(record: dict[str, Any]) -> str:
    """The breakdown in one line, as the end-of-run summary shows it."""
    others = {name: seconds for name, seconds in record["categories"].items() if name != "productive"}
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in others.items())
    return f"{record['goodput']:.1%} of {record['wall_s']:.1f} s ({parts})"


# ------------------------------------------------------------------ profiles
class ProfileWindow:
    """A trace of steps ``first..last`` (counted from 1) on this rank: started before step ``first``
    runs, stopped after step ``last`` ran, by the runtime's profiler (``Runtime.profiler``)."""

    def __init__(self, runtime: Any, directory: Any, first: int, last: int) -> None:
        self.runtime, self.directory, self.first, self.last = runtime, directory, first, last
        self.profiler: Any = None

    @property
    def tracing(self) -> bool:
        return self.profiler is not None

    def before(self, step: int) -> None:
        if step == self.first:
            self.profiler = self.runtime.profiler(self.directory)
            self.profiler.start()

    def after(self, step: int) -> bool:
        """Stop after the window's last step; True when this call wrote the trace."""
        if step < self.last or self.profiler is None:
            return False
        self.profiler.stop()
        self.profiler = None
        return True
