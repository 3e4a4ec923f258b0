"""Profilers of a window of steps, by runtime: ``torch.profiler`` on cpu and cuda (a Chrome trace
that Perfetto and TensorBoard's PyTorch profiler plugin open), torch_xla's profiler on xla (an
XSpace for TensorBoard's profile plugin and a Chrome trace, under ``plugins/profile/<time>/``).
Each has ``start()`` and ``stop()``; :func:`step_mark` names one step inside the trace.

:class:`ScriptProfile` is ``raytpu launch --profile FIRST:LAST``: a trace of a launched script's own
steps. A script's step is not raytpu's to run, so it is counted where every training script ends one:
a call of a ``torch.optim`` optimizer's ``step()`` (PyTorch's global step hooks). That covers plain
PyTorch, Accelerate (whose ``AcceleratedOptimizer`` steps the wrapped optimizer only on the
micro-batch that syncs gradients, so accumulation counts once) and ``transformers.Trainer``. Step N
is the work from the end of the (N-1)-th ``step()`` call in this process to the end of the N-th, so
step 1 includes the script's set-up; a resumed script counts from 1 again. A script with two
optimizers (a GAN) counts two steps a round; one whose GradScaler skips a step counts none."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def profiler(runtime: str, directory: Path, rank: int) -> Any:
    """The profiler of ``runtime`` (``cpu``, ``cuda`` or ``xla``) writing under ``directory``."""
    if runtime == "xla":
        return XlaTrace(directory)
    return TorchTrace(directory, rank, cuda=runtime == "cuda")


def step_mark(runtime: str, step: int) -> contextlib.AbstractContextManager:
    """A range named ``raytpu step N`` in the trace. On xla a host-side mark only: ``xp.Trace``
    would also scope the step's IR, which the step's ``sync`` refuses to cut."""
    name = f"raytpu step {step}"
    if runtime == "xla":
        import torch_xla

        return torch_xla._XLAC.profiler.TraceMe(name)
    return torch.profiler.record_function(name)


class TorchTrace:
    """``torch.profiler`` over a window of steps; the trace as ``<directory>/rank_<r>.pt.trace.json``."""

    def __init__(self, directory: Path, rank: int, cuda: bool) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self.path = Path(directory) / f"rank_{rank}.pt.trace.json"
        self.profile = profile(activities=activities, record_shapes=True)

    def start(self) -> None:
        self.profile.start()

    def stop(self) -> None:
        self.profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.export_chrome_trace(str(self.path))


class XlaTrace:
    """torch_xla's profiler (in-process capture) over a window of steps."""

    def __init__(self, directory: Path) -> None:
        self.directory = str(directory)

    def start(self) -> None:
        import torch_xla.debug.profiler as xp

        xp.start_trace(self.directory)

    def stop(self) -> None:
        import torch_xla.debug.profiler as xp

        xp.stop_trace()


class ScriptProfile:
    """Trace optimizer steps ``first..last`` of this process with the runtime's profiler into
    ``directory``; ``done`` is called once the trace is written."""

    def __init__(self, runtime: str, directory: Path, rank: int, window: tuple[int, int], done: Callable[[], None]):
        self.runtime, self.directory, self.rank = runtime, directory, rank
        (self.first, self.last), self.done = window, done
        self.steps = 0
        self.profiler: Any = None
        self.mark: Any = None
        self.hook: Any = None

    def install(self) -> None:
        """Hook the optimizers' steps (and start at once when the window opens at step 1)."""
        self.hook = register_optimizer_step_post_hook(self.stepped)
        if self.first == 1:
            self._start()

    def stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.profiler is not None:
            self.mark.__exit__(None, None, None)
            if self.steps >= self.last:
                self._stop()
                return
            self._mark(self.steps + 1)
        elif self.steps == self.first - 1:
            self._start()

    def remove(self) -> None:
        """End of the script: a window it never finished is written as far as it got; one it never
        reached is said in one line."""
        if self.hook is not None:
            self.hook.remove()
        if self.profiler is not None:
            self.mark.__exit__(None, None, None)
            self._stop()
        elif self.steps < self.first:
            print(
                f"raytpu: warning: --profile {self.first}:{self.last}: the script made {self.steps} optimizer "
                "step(s) in this process; nothing was traced",
                file=sys.stderr,
                flush=True,
            )

    def _start(self) -> None:
        self.profiler = profiler(self.runtime, self.directory, self.rank)
        self.profiler.start()
        self._mark(self.steps + 1)

    def _mark(self, step: int) -> None:
        self.mark = step_mark(self.runtime, step)
        self.mark.__enter__()

    def _stop(self) -> None:
        self.profiler.stop()
        self.profiler = None
        self.done()
