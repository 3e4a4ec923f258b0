"""Profilers of a window of steps, by runtime: ``torch.profiler`` on cpu and cuda (a Chrome trace
that Perfetto and TensorBoard's PyTorch profiler plugin open), torch_xla's profiler on xla (an
XSpace for TensorBoard's profile plugin and a Chrome trace, under ``plugins/profile/<time>/``).
Each has ``start()`` and ``stop()``; :func:`step_mark` names one step inside the trace."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch


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
