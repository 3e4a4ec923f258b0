"""Where a run's time goes, as rank 0 sees it, and a profile of chosen steps.

**Goodput.** :class:`StepClock` measures the step phases (``compilation``: the compile time
torch_xla reports during steps, on cpu/cuda the first steps' excess over the steady step;
``productive`` training steps; ``input``, ``evaluation``, ``checkpointing``) with the host's clock
only (no device sync: on XLA the step's graph runs while the host goes on, so a step's time shows in
the next wait) and writes each attempt into the run's goodput record (``raytpu.records.goodput``),
where the driver adds start-up and shutdown.

**Profiles.** :class:`ProfileWindow` records a trace of steps ``[first, last]`` on the chosen ranks
with the runtime's profiler (``torch.profiler`` on cpu and cuda, torch_xla's on xla) into
``<run dir>/profile/``.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import uuid
from collections.abc import Iterator
from typing import Any

from raytpu.records.goodput import Command, process_started, record_attempt
from raytpu.storage.run_folder import RunFolder

#: the phases rank 0 times inside the training loop
PHASES = ("input", "evaluation", "checkpointing")
#: steps whose excess over the steady step counts as compilation on cpu/cuda (no compiler to ask)
WARM_STEPS = 2


# ------------------------------------------------------------------ rank 0 in the loop
class StepClock:
    """Rank 0's clock of one attempt (a worker group's life): the time from its first step to its
    last record, by phase. ``compiled``: the runtime's compile seconds so far (XLA), or None."""

    def __init__(self, folder: RunFolder | None, command: Command, compiled: Any = None, workers: int = 1) -> None:
        self.folder, self.command, self.compiled, self.workers = folder, command, compiled, workers
        self.id = uuid.uuid4().hex[:12]
        self.first_step: float | None = None
        self.seconds = dict.fromkeys((*PHASES, "compilation"), 0.0)
        self.step_times: list[float] = []
        self._step_start = 0.0
        self._open_phase: tuple[str, float] | None = None
        self._compiled_seen = self._compile_seconds()
        # the attempt's start-up, split: its process started, then this clock (imports, process group,
        # runtime done), then each of the loop's marks (:meth:`mark`); the first step ends it
        self.marks = {"process": process_started(), "clock": time.time()}

    def mark(self, name: str) -> None:
        """A moment of the attempt's start-up (the model built, the checkpoint resumed)."""
        if self.first_step is None:
            self.marks[name] = time.time()

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
            "workers": self.workers,
            "seconds": {**seconds, "compilation": self.compilation()},
            "marks": self.marks,
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
